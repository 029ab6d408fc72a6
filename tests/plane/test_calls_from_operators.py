"""A plane call that waits for the operators' invocations (close, a checkpoint, a flush, a
pause, a migration, a schedule switch) made from inside an operator would wait for itself:
it is refused at once with a typed error, and the plane goes on as if it had not been made."""

import threading
import time
from fractions import Fraction

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


def test_recover_inside_an_inline_delivery_is_refused_before_it_clears_anything():
    plane = ExperienceDataPlane(spec=SPEC, capacity=1000, batch_size=8, schedule=INLINE,
                                timeout=3)
    got = {}

    @plane.register_delivery(input="ExperienceBuffer", output="Learner")
    def delivery(exp_in, learn_out):
        rows = exp_in.read()
        try:
            plane.recover()
        except ConfigError as exc:
            got["error"] = exc
        learn_out.write(rows)

    plane.push(_rows(20))
    plane.pull()
    assert got["error"].field == "recover" and "inside the delivery" in str(got["error"])
    plane.close()


def test_close_from_an_operator_during_close_returns_and_the_drain_stores_everything():
    """close() is idempotent: an operator of the drain that calls it finds the plane closing
    and returns, instead of failing its invocation (which lost the unit)."""
    plane = ExperienceDataPlane(spec=SPEC, capacity=1000, batch_size=8, timeout=3,
                                schedule=Schedule(overlap_ing=1, g_ing=4, overlap_del=1,
                                                  g_del=1))

    @plane.register_ingestion(input="Actor", output="ExperienceBuffer")
    def ingestion(actor_in, exp_out):
        exp_out.write(actor_in.read())
        if plane.closed:
            plane.close()

    plane.push(_rows(4))  # fewer than g_ing units: stays queued until close drains it
    plane.close()
    assert len(plane.buffer) == 4


@pytest.mark.parametrize(("mode", "schedule", "refused"), [
    ("off_policy", OVERLAPPED, True),
    ("on_policy", OVERLAPPED, True),
    ("on_policy", INLINE, True),
    ("off_policy", INLINE, False),  # an inline pull runs its own (nested) invocation
])
def test_pull_from_inside_a_delivery_operator(mode, schedule, refused):
    kw = {"num_minibatches": 2} if mode == "on_policy" else {"batch_size": 8}
    capacity = 16 if mode == "on_policy" else 1000
    if mode == "on_policy":  # one mini-batch per delivery invocation
        schedule = Schedule(overlap_ing=schedule.overlap_ing, g_ing=schedule.g_ing,
                            overlap_del=schedule.overlap_del, g_del=Fraction(1, 2))
    plane = ExperienceDataPlane(spec=SPEC, capacity=capacity, mode=mode, schedule=schedule,
                                timeout=3, **kw)
    got = {}

    @plane.register_delivery(input="ExperienceBuffer", output="Learner")
    def delivery(exp_in, learn_out):
        rows = exp_in.read()
        if not got:
            got["t0"] = time.perf_counter()
            try:
                got["batch"] = plane.pull(timeout=2)
            except Exception as exc:  # what it raised is the point
                got["error"] = exc
            got["seconds"] = time.perf_counter() - got["t0"]
        learn_out.write(rows)

    plane.push(_rows(16))
    plane.pull()
    if refused:
        assert isinstance(got.get("error"), ConfigError) and got["error"].field == "pull"
        assert got["seconds"] < 1.0
    else:
        assert got["batch"]["obs"].shape == (8, 4)
    plane.close()


def test_a_snapshot_waited_for_from_inside_an_operator_is_refused(tmp_path):
    plane = ExperienceDataPlane(spec=SPEC, capacity=1000, batch_size=8, schedule=OVERLAPPED,
                                timeout=3)
    snap = plane.snapshots(tmp_path / "snap.ckpt", every_s=3600)
    got = {}

    @plane.register_ingestion(input="Actor", output="ExperienceBuffer")
    def ingestion(actor_in, exp_out):
        exp_out.write(actor_in.read())
        t0 = time.perf_counter()
        for name, call in (("request", lambda: snap.request(wait=True)),
                           ("close", snap.close)):
            try:
                call()
            except ConfigError as exc:
                got[name] = exc
        got["seconds"] = time.perf_counter() - t0

    plane.push(_rows(10))
    plane.flush()
    assert got["request"].field == "request" and got["close"].field == "close"
    assert got["seconds"] < 1.0
    snap.request(wait=True)  # from the caller's thread it works
    assert (tmp_path / "snap.ckpt").exists()
    plane.close()


def test_a_plane_collected_inside_its_own_operator_is_still_closed():
    """Garbage collection runs on any thread: a dropped plane collected on its own worker,
    inside an operator, is closed from another thread once that invocation ends."""
    import gc

    before = {t.ident for t in threading.enumerate()}
    plane = ExperienceDataPlane(spec=SPEC, capacity=1000, batch_size=8, schedule=OVERLAPPED,
                                timeout=3)
    plane._cycle = plane  # only the cyclic collector frees it
    go = threading.Event()

    def ingestion(actor_in, exp_out):  # holds no reference to the plane
        exp_out.write(actor_in.read())
        go.wait(5)
        gc.collect()

    plane.register_ingestion()(ingestion)
    plane.push(_rows(4))
    del plane
    gc.disable()
    try:
        go.set()
        deadline = time.monotonic() + 10
        left = None
        while time.monotonic() < deadline:
            left = [t.name for t in threading.enumerate()
                    if t.ident not in before and t.name.startswith("conduit")]
            if not left:
                break
            time.sleep(0.05)
    finally:
        gc.enable()
    assert not left, f"threads of the collected plane still running: {left}"
