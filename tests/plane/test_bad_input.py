"""Bad input gets a typed error naming the field; closed planes and failed operators raise;
nothing hangs (pytest-timeout guards every test)."""

import threading
import time

import pytest
import torch

from conduit import (
    BackpressureTimeout,
    CapacityError,
    ConfigError,
    EmptyBufferError,
    ExperienceDataPlane,
    ExperienceSpec,
    OperatorError,
    PlaneClosedError,
    PriorityError,
    Schedule,
    ScheduleError,
    SpecError,
    StaleRolloutError,
)
from tests.conftest import make_rows


def plane(spec, **kw):
    kw.setdefault("capacity", 32)
    kw.setdefault("batch_size", 4)
    kw.setdefault("timeout", 5)
    return ExperienceDataPlane(spec=spec, **kw)


@pytest.mark.parametrize("schedule", [Schedule(0, 1, 0, 1), Schedule(1, 1, 1, 1)])
@pytest.mark.parametrize(("mutate", "field"), [
    (lambda r: r.update(bogus=torch.zeros(4)), "bogus"),
    (lambda r: r.pop("done"), "done"),
    (lambda r: r.update(obs=torch.zeros(4, 3)), "obs"),
    (lambda r: r.update(id=torch.zeros(4, dtype=torch.int32)), "id"),
])
def test_bad_rollout_names_field(small_spec, schedule, mutate, field):
    with plane(small_spec, schedule=schedule) as p:
        rows = make_rows(small_spec, 4)
        mutate(rows)
        with pytest.raises(SpecError) as ei:
            p.push(rows)
        assert ei.value.field == field and repr(field) in str(ei.value)
        assert p.stats()["pushed_units"] == 0


def test_write_in_operator_is_validated(small_spec):
    with plane(small_spec) as p:
        @p.register_ingestion(input="Actor", output="ExperienceBuffer")
        def ingest(actor_in, exp_out):
            d = actor_in.read()
            d["obs"] = d["obs"].double()
            exp_out.write(d)

        with pytest.raises(OperatorError) as ei:
            p.push(make_rows(small_spec, 4))
        assert isinstance(ei.value.__cause__, SpecError)
        assert ei.value.__cause__.field == "obs"


def test_rollout_larger_than_capacity_is_refused_by_push(small_spec):
    with plane(small_spec, capacity=8) as p:
        with pytest.raises(CapacityError, match="larger than the buffer capacity 8"):
            p.push(make_rows(small_spec, 9))
        p.push(make_rows(small_spec, 8))  # the plane is still usable
        assert len(p.buffer) == 8


def test_on_policy_overflow_and_staleness(small_spec):
    with plane(small_spec, capacity=8, mode="on_policy", num_minibatches=2) as p:
        p.push(make_rows(small_spec, 8), policy_version=0)
        with pytest.raises(CapacityError, match="policy_version=1"):
            p.push(make_rows(small_spec, 1))
        list(p.minibatches())
        with pytest.raises(StaleRolloutError, match="version 0"):
            p.push(make_rows(small_spec, 8), policy_version=0)


def test_bad_priorities_through_plane(small_spec):
    with plane(small_spec, sampler="prioritized") as p:
        p.push(make_rows(small_spec, 8))
        b = p.pull()
        with pytest.raises(PriorityError, match="NaN"):
            p.update_priorities(b["_index"], torch.full((4,), float("nan")))
        with pytest.raises(PriorityError, match="negative"):
            p.update_priorities(b["_index"], -torch.ones(4))


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"capacity": 0}, "capacity"), ({"batch_size": 64}, "batch_size"),
    ({"mode": "offline"}, "mode"), ({"sampler": "lifo"}, "sampler"),
    ({"timeout": 0}, "timeout"), ({"min_size": 99}, "min_size"),
    ({"mode": "on_policy", "sampler": "prioritized"}, "sampler"),
    ({"mode": "on_policy", "num_minibatches": 33}, "num_minibatches"),
])
def test_bad_config(small_spec, kwargs, field):
    with pytest.raises(ConfigError) as ei:
        plane(small_spec, **kwargs)
    assert ei.value.field == field


@pytest.mark.parametrize(("mode", "schedule", "word"), [
    ("off_policy", Schedule(0, 0.5, 0, 1), "g_ing"),
    ("off_policy", Schedule(0, 9, 0, 1), "g_ing"),
    ("off_policy", Schedule(0, 1, 0, 9), "g_del"),
    ("on_policy", Schedule(0, 1, 0, 1), "g_del"),
    ("on_policy", Schedule(0, 2, 0, 0.25), "g_ing"),
    ("on_policy", Schedule(0, 1 / 3, 0, 0.25), "g_ing"),
])
def test_infeasible_schedule_rejected(small_spec, mode, schedule, word):
    with pytest.raises(ScheduleError, match=word):
        plane(small_spec, mode=mode, num_minibatches=4, schedule=schedule)


def test_schedule_values_validated():
    with pytest.raises(ScheduleError, match="overlap_ing"):
        Schedule(2, 1, 0, 1)
    with pytest.raises(ScheduleError, match="g_del"):
        Schedule(0, 1, 0, 1.5)
    with pytest.raises(ScheduleError, match="g_ing"):
        Schedule(0, 0, 0, 1)


def test_register_wrong_ports(small_spec):
    with plane(small_spec) as p, pytest.raises(ConfigError, match="Actor"):
        p.register_ingestion(input="Learner", output="ExperienceBuffer")


def test_closed_plane_raises(small_spec):
    p = plane(small_spec)
    p.close()
    p.close()  # idempotent
    with pytest.raises(PlaneClosedError):
        p.push(make_rows(small_spec, 2))
    with pytest.raises(PlaneClosedError):
        p.pull()


@pytest.mark.parametrize("overlap", [0, 1])
def test_ingestion_exception_propagates_with_traceback(small_spec, overlap):
    with plane(small_spec, schedule=Schedule(overlap, 1, 0, 1)) as p:
        @p.register_ingestion(input="Actor", output="ExperienceBuffer")
        def broken(actor_in, exp_out):
            raise KeyError("framework bug")

        with pytest.raises(OperatorError) as ei:
            p.push(make_rows(small_spec, 2))
            p.flush()
        assert isinstance(ei.value.__cause__, KeyError)
        assert ei.value.__cause__.__traceback__ is not None
        assert "broken" in str(_frames(ei.value.__cause__))
        # A worker's failure stays latched until recover(); an inline failure was raised to
        # the push that brought the input, and the plane stays usable. Neither hangs.
        with pytest.raises(OperatorError if overlap else EmptyBufferError):
            p.pull(timeout=0.5)
        p.recover()  # the loss is handled: close() does not report it


@pytest.mark.parametrize("overlap", [0, 1])
def test_delivery_exception_propagates(small_spec, overlap):
    with plane(small_spec, schedule=Schedule(0, 1, overlap, 1)) as p:
        @p.register_delivery(input="ExperienceBuffer", output="Learner")
        def broken(exp_in, learn_out):
            raise ValueError("bad reshape")

        with pytest.raises(OperatorError, match="bad reshape") as ei:
            p.push(make_rows(small_spec, 8))  # a background failure may surface here already
            p.pull()
        assert ei.value.operator == "delivery"


def test_delivery_that_writes_nothing(small_spec):
    with plane(small_spec) as p:
        p.register_delivery(input="ExperienceBuffer", output="Learner")(lambda i, o: None)
        p.push(make_rows(small_spec, 8))
        with pytest.raises(OperatorError, match=r"learn_out\.write"):
            p.pull()


def test_empty_pull_times_out_with_typed_error(small_spec):
    with plane(small_spec, mode="on_policy", capacity=8, num_minibatches=2) as p:
        p.push(make_rows(small_spec, 4), policy_version=0)
        t0 = time.perf_counter()
        with pytest.raises(EmptyBufferError, match=r"4 of 8 rows ingested \(4 pushed\)"):
            p.pull(timeout=0.3)
        assert time.perf_counter() - t0 < 5
    with plane(small_spec, schedule=Schedule(1, 1, 1, 1)) as p, \
            pytest.raises(EmptyBufferError, match="min_size"):
        p.pull(timeout=0.3)


def test_backpressure_times_out(small_spec):
    gate = threading.Event()
    with plane(small_spec, schedule=Schedule(1, 1, 0, 1)) as p:
        @p.register_ingestion(input="Actor", output="ExperienceBuffer")
        def slow(actor_in, exp_out):
            gate.wait(10)
            exp_out.write(actor_in.read())

        with pytest.raises(BackpressureTimeout, match="queued"):
            for _ in range(10):
                p.push(make_rows(small_spec, 1), timeout=0.3)
        gate.set()
        p.flush()
        assert p.stats()["ingested_units"] == p.stats()["pushed_units"]


def test_close_leaves_no_thread_and_keeps_pending(small_spec):
    before = {t.name for t in threading.enumerate()}
    p = plane(small_spec, schedule=Schedule(1, 4, 1, 2))
    for i in range(3):  # fewer than g_ing: still pending
        p.push(make_rows(small_spec, 2, start=2 * i))
    p.close()
    after = {t.name for t in threading.enumerate()}
    assert not any(n.startswith("conduit-") for n in after - before)
    assert len(p.buffer) == 6  # close ingested what was queued: no lost transition


def test_numpy_rollouts_accepted(small_spec):
    import numpy as np
    with plane(small_spec) as p:
        p.push({"obs": np.ones((4, 4), np.float32), "id": np.arange(4),
                "done": np.zeros(4, bool)})
        assert p.pull()["obs"].dtype == torch.float32


@pytest.mark.parametrize(("mode", "schedule"), [
    ("off_policy", Schedule(0, 1, 0, 1)), ("off_policy", Schedule(1, 1, 1, 1)),
    ("on_policy", Schedule(0, 1, 0, 0.5)), ("on_policy", Schedule(1, 1, 1, 0.5))])
def test_rollouts_with_autograd_history_are_stored_as_values(small_spec, mode, schedule):
    # e.g. values an actor computed without torch.no_grad(): stored detached, and the plane
    # keeps delivering (a column that joined the graph would fail every later gather).
    kw = {"num_minibatches": 2, "capacity": 8} if mode == "on_policy" else {}
    with plane(small_spec, schedule=schedule, mode=mode, **kw) as p:
        rows = make_rows(small_spec, 8)
        w = torch.ones(8, 4, requires_grad=True)
        rows["obs"] = rows["obs"] * w
        p.push(rows)
        batches = list(p.minibatches()) if mode == "on_policy" else [p.pull(), p.pull()]
        for b in batches:
            assert not b["obs"].requires_grad
            assert torch.equal(b["obs"][:, 0], b["id"].float())
        assert w.grad is None


def test_rollout_spec_validates_raw_rollouts(small_spec):
    raw = ExperienceSpec.of(obs=((4,), torch.float32), id=((), torch.int64))
    with plane(small_spec, rollout_spec=raw) as p:
        @p.register_ingestion(input="Actor", output="ExperienceBuffer")
        def add_done(actor_in, exp_out):
            d = actor_in.read()
            d["done"] = torch.zeros(d["id"].shape[0], dtype=torch.bool)
            exp_out.write(d)

        p.push({"obs": torch.zeros(4, 4), "id": torch.arange(4)})
        with pytest.raises(SpecError, match="'obs'"):
            p.push({"obs": torch.zeros(4, 5), "id": torch.arange(4)})
        assert len(p.buffer) == 4


def _frames(exc):
    import traceback
    return "".join(traceback.format_tb(exc.__traceback__))


@pytest.mark.parametrize("kw,fragment", [
    (dict(mode="on_policy", rollout_rows=0), "rollout_rows"),
    (dict(mode="on_policy", rollout_rows=1000), "rollout_rows"),
    (dict(mode="on_policy", rollout_rows=2.5), "rollout_rows"),
    (dict(mode="off_policy", rollout_rows=8), "only applies on-policy"),
])
def test_rollout_rows_is_checked(small_spec, kw, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=8, **kw)
    assert info.value.field == "rollout_rows"


@pytest.mark.parametrize("version", ["0", [0], 0.5, 1.0, True, torch.tensor(0.5)],
                         ids=repr)
def test_a_policy_version_that_is_not_an_integer_is_refused(small_spec, version):
    # A float or bool version used to wait out the timeout for a "newer" policy; a string
    # raised a bare TypeError from a comparison.
    with plane(small_spec, mode="on_policy", capacity=8, num_minibatches=2) as p:
        with pytest.raises(ConfigError) as ei:
            p.push(make_rows(small_spec, 8), policy_version=version, timeout=0.5)
        assert ei.value.field == "policy_version" and p.stats()["pushed_units"] == 0
        import numpy as np
        p.push(make_rows(small_spec, 4), policy_version=np.int64(0))
        p.push(make_rows(small_spec, 4, start=4), policy_version=torch.tensor(0))
        assert sorted(i for b in p.minibatches() for i in b["id"].tolist()) == list(range(8))
