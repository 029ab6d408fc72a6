"""A plane call that waits for the operators' invocations (close, a checkpoint, a flush, a
pause, a migration, a schedule switch) made from inside an operator would wait for itself:
it is refused at once with a typed error, and the plane goes on as if it had not been made."""

import threading
import time

import pytest
import torch

from conduit import ConfigError, ExperienceDataPlane, ExperienceSpec, Schedule
from conduit.storage import Placement

SPEC = ExperienceSpec.of(obs=((4,), torch.float32), reward=((), torch.float32))
OVERLAPPED = Schedule(overlap_ing=1, g_ing=1, overlap_del=1, g_del=1)
INLINE = Schedule(overlap_ing=0, g_ing=1, overlap_del=0, g_del=1)


def _rows(n: int) -> dict[str, torch.Tensor]:
    return {"obs": torch.randn(n, 4), "reward": torch.randn(n)}


CALLS = {  # (plane, a scratch folder, a state dict taken from the caller's thread)
    "close": lambda plane, tmp, state: plane.close(),
    "save": lambda plane, tmp, state: plane.save(tmp / "plane.ckpt"),
    "state_dict": lambda plane, tmp, state: plane.state_dict(),
    "frozen": lambda plane, tmp, state: plane.frozen().__enter__(),
    "load_state_dict": lambda plane, tmp, state: plane.load_state_dict(state),
    "flush": lambda plane, tmp, state: plane.flush(),
    "set_schedule": lambda plane, tmp, state: plane.set_schedule(plane.schedule),
    "paused": lambda plane, tmp, state: plane.paused().__enter__(),
    "migrate": lambda plane, tmp, state: plane.migrate(Placement.pageable()),
}


@pytest.mark.parametrize("schedule", [OVERLAPPED, INLINE], ids=["overlapped", "inline"])
@pytest.mark.parametrize("operator", ["ingestion", "delivery"])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_waiting_call_from_inside_an_operator_is_refused_and_changes_nothing(
        schedule, operator, call, tmp_path):
    # The timeout bounds a regression (the call waiting for itself) to a few seconds.
    plane = ExperienceDataPlane(spec=SPEC, capacity=1000, batch_size=8, schedule=schedule,
                                timeout=3)
    got: dict[str, object] = {}
    state = plane.state_dict()  # empty: loading it would drop the rows

    def attempt() -> None:
        if got:
            return
        got["thread"] = threading.get_ident()
        t0 = time.perf_counter()
        try:
            CALLS[call](plane, tmp_path, state)
        except Exception as exc:
            got["error"] = exc
        got["seconds"] = time.perf_counter() - t0

    @plane.register_ingestion(input="Actor", output="ExperienceBuffer")
    def ingestion(actor_in, exp_out):
        exp_out.write(actor_in.read())
        if operator == "ingestion":
            attempt()

    @plane.register_delivery(input="ExperienceBuffer", output="Learner")
    def delivery(exp_in, learn_out):
        rows = exp_in.read()
        if operator == "delivery":
            attempt()
        learn_out.write(rows)

    plane.push(_rows(100))
    plane.flush()
    first = plane.pull()
    assert first["obs"].shape == (8, 4)
    err = got["error"]
    assert isinstance(err, ConfigError) and err.field == call, repr(err)
    assert "inside the " + operator + " operator" in str(err)
    assert got["seconds"] < 1.0  # refused, not timed out
    # Nothing changed: the plane is open, not failed, and stores and delivers as before.
    assert not plane.closed and plane.failed is None
    plane.push(_rows(20))
    plane.flush()
    assert len(plane.buffer) == 120
    assert plane.pull()["obs"].shape == (8, 4)
    plane.save(tmp_path / "after.ckpt")  # from the caller's thread these all work
    plane.close()
    assert plane.closed


def test_an_operator_may_still_push_and_an_inline_delivery_may_pull():
    """Calls that do not wait for the running invocation stay allowed inside operators."""
    plane = ExperienceDataPlane(spec=SPEC, capacity=1000, batch_size=8, schedule=INLINE)
    pushed = []

    @plane.register_ingestion(input="Actor", output="ExperienceBuffer")
    def ingestion(actor_in, exp_out):
        exp_out.write(actor_in.read())
        if not pushed:
            pushed.append(True)
            plane.push(_rows(5))  # queued behind this invocation

    plane.push(_rows(50))
    plane.flush()
    assert len(plane.buffer) == 55
    plane.close()
