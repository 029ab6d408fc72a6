"""The plane's constructor refuses a bad seed, a schedule that is not one, and a sampler that
needs a field its spec lacks, with a typed error naming the argument; so do the schedule
tuners. A pushed view of part of a tensor is held apart from the rest of it."""

import contextlib

import numpy as np
import pytest
import torch

from conduit import ConfigError, Schedule, SpecError
from conduit.plane import AutoScheduler, ExperienceDataPlane
from conduit.plane.config import PlaneConfig
from conduit.plane.flows import Unit, hold_rollout
from conduit.plane.tuner import WarmupScheduleTuner
from conduit.spec import ExperienceSpec
from conduit.storage import SequenceSampler
from tests.plane.helpers import frozen_elsewhere

SPEC = ExperienceSpec.of(id=((), torch.int64), terminated=((), torch.bool))


def test_plane_refuses_a_sequence_sampler_without_its_boundary_field():
    with pytest.raises(ConfigError) as err:
        ExperienceDataPlane(spec=SPEC, capacity=8, batch_size=2, timeout=1,
                            sampler=SequenceSampler(length=2))  # boundary_key="done"
    assert err.value.field == "boundary_key"


@pytest.mark.parametrize("seed", [-1, "x", True, 1.5, None])
def test_plane_needs_a_non_negative_integer_seed(seed):
    with pytest.raises(ConfigError) as err:
        ExperienceDataPlane(spec=SPEC, capacity=8, batch_size=2, timeout=1, seed=seed)
    assert err.value.field == "seed"
    with pytest.raises(ConfigError) as err:
        PlaneConfig(spec=SPEC, capacity=8, batch_size=2, seed=seed)
    assert err.value.field == "seed"


def test_plane_takes_a_numpy_seed():
    config = PlaneConfig(spec=SPEC, capacity=8, batch_size=2, seed=np.int64(3))
    assert config.seed == 3 and type(config.seed) is int
    rows = {"id": torch.arange(8), "terminated": torch.zeros(8, dtype=torch.bool)}
    with ExperienceDataPlane(spec=SPEC, capacity=8, batch_size=4, timeout=5,
                             seed=np.int64(3)) as a, \
            ExperienceDataPlane(spec=SPEC, capacity=8, batch_size=4, timeout=5, seed=3) as b:
        a.push(rows)
        b.push(rows)
        assert a.pull()["id"].tolist() == b.pull()["id"].tolist()


@pytest.mark.parametrize(("field", "value"), [
    ("capacity", True), ("batch_size", 2.0), ("num_epochs", "1"), ("g_max", 0),
    ("min_size", True), ("min_size", 9), ("max_priority_lag", -1), ("max_priority_lag", False),
    ("timeout", True), ("timeout", float("nan"))])
def test_plane_config_refuses_bools_and_out_of_range_values(field, value):
    with pytest.raises(ConfigError) as err:
        PlaneConfig(spec=SPEC, **{"capacity": 8, "batch_size": 2, field: value})
    assert err.value.field == field


def test_plane_config_keeps_numpy_integers_as_python_ints():
    config = PlaneConfig(spec=SPEC, capacity=np.int64(8), batch_size=np.int32(2),
                         min_size=np.int64(4), max_priority_lag=np.int64(1))
    for name, want in (("capacity", 8), ("batch_size", 2), ("min_size", 4),
                       ("max_priority_lag", 1)):
        assert type(getattr(config, name)) is int and getattr(config, name) == want
    with ExperienceDataPlane(spec=SPEC, capacity=np.int64(8), batch_size=np.int64(2),
                             timeout=5) as plane:
        plane.push({"id": torch.arange(4), "terminated": torch.zeros(4, dtype=torch.bool)})
        plane.flush()
        assert plane.pull()["id"].shape == (2,)


@pytest.mark.parametrize("schedule", [(1, 1, 1, 1), "1,1,1,1", {"overlap_ing": 1}, []])
def test_a_schedule_that_is_not_a_schedule_is_refused_by_name(schedule):
    with pytest.raises(ConfigError) as err:
        ExperienceDataPlane(spec=SPEC, capacity=8, batch_size=2, timeout=1, schedule=schedule)
    assert err.value.field == "schedule"
    with ExperienceDataPlane(spec=SPEC, capacity=8, batch_size=2, timeout=1) as plane:
        before = plane.schedule
        for bad in (schedule, None):
            with pytest.raises(ConfigError) as err:
                plane.set_schedule(bad)
            assert err.value.field == "schedule"
        assert plane.schedule == before


@pytest.mark.parametrize("schedule", [Schedule(0, 8, 0, 1), Schedule(1, 4, 0, 1)])
def test_chunks_of_one_preallocated_tensor_are_stored_as_pushed(schedule):
    """An actor fills one preallocated rollout tensor chunk by chunk and pushes each chunk as
    a view: filling the next chunk is no write into a queued one, and a write into a queued
    chunk does not reach its stored rows."""
    with ExperienceDataPlane(spec=SPEC, capacity=64, batch_size=4, schedule=schedule,
                             timeout=5) as plane:
        buf = torch.zeros(64, dtype=torch.int64)
        done = torch.zeros(64, dtype=torch.bool)
        with plane.paused() if schedule.overlap_ing else contextlib.nullcontext():
            for i in range(8):
                chunk = slice(8 * i, 8 * i + 8)
                buf[chunk] = torch.arange(8 * i, 8 * i + 8)  # only this chunk is written
                plane.push({"id": buf[chunk], "terminated": done[chunk]})
            if schedule.overlap_ing:
                buf.add_(1000)  # the queued chunks themselves, before their ingestion
        plane.flush()
        assert plane.counters["lost_units"] == 0 and plane.failed is None
        stored = plane.buffer.store.column("id")[:len(plane.buffer)]
        assert sorted(stored.tolist()) == list(range(64))


def test_a_chunk_pushed_while_another_thread_holds_the_operators_is_stored_as_pushed():
    """Under the inline schedule a push is ingested within the call, unless another thread
    holds the operators (a save): then the chunk waits, and the actor's next write into its
    rows must not reach the buffer."""
    with ExperienceDataPlane(spec=SPEC, capacity=64, batch_size=4,
                             schedule=Schedule(0, 1, 0, 1), timeout=5) as plane:
        buf = torch.arange(8, dtype=torch.int64)
        done = torch.zeros(8, dtype=torch.bool)
        with frozen_elsewhere(plane, hold_s=5):  # what a checkpoint on another thread does
            plane.push({"id": buf[0:4], "terminated": done[0:4]})
            assert plane.stats()["pending_units"] == 1  # it waits past the push
            buf[0:4] = 99
        plane.flush()
        stored = plane.buffer.store.column("id")[:len(plane.buffer)]
        assert sorted(stored.tolist()) == [0, 1, 2, 3]


def test_a_partial_view_held_without_a_copy_is_guarded():
    """A view expected to be ingested within its push is not copied, but stays guarded: a
    write into its tensor before ingestion is refused, never stored."""
    buf = torch.arange(8, dtype=torch.int64)
    data, guards = hold_rollout({"id": buf[0:4]}, {"id": buf[0:4]}, may_wait=False)
    assert data["id"].data_ptr() == buf.data_ptr() and [g[0] for g in guards] == ["id"]
    unit = Unit(data, 4, None, guards)
    unit.check_unchanged()
    buf[0:4] = 99
    with pytest.raises(SpecError, match="written in place"):
        unit.check_unchanged()


def _never_run(plane):  # pragma: no cover - a refused AutoScheduler profiles nothing
    raise AssertionError("the step ran")


@pytest.mark.parametrize(("field", "value"), [
    ("min_copy", "x"), ("min_copy", None), ("min_copy", float("nan")), ("min_copy", -1.0),
    ("granularities", 5), ("granularities", "12"), ("granularities", []),
    ("granularities", [0]), ("granularities", ["a"]), ("top_k", 0), ("iterations_per_g", 0),
    ("watch", "rollout")])
def test_auto_scheduler_refuses_bad_settings_before_any_work(field, value):
    with ExperienceDataPlane(spec=SPEC, capacity=64, batch_size=4, timeout=5) as plane:
        before = plane.schedule
        with pytest.raises(ConfigError) as err:
            AutoScheduler(plane=plane, step=_never_run, **{field: value}).plan()
        assert err.value.field == field
        assert plane.schedule == before


def test_auto_scheduler_takes_a_generator_of_granularities():
    with ExperienceDataPlane(spec=SPEC, capacity=64, batch_size=4, timeout=5) as plane:
        auto = AutoScheduler(plane=plane, step=_never_run, granularities=(g for g in (1, 2)))
        assert auto.granularities == (1, 2)


@pytest.mark.parametrize(("field", "value"), [
    ("bogus", 1), ("min_copy", "x"), ("margin", float("nan")), ("min_gain", None),
    ("prioritized", 1), ("policy", 3), ("report", [])])
def test_warmup_tuner_refuses_bad_settings_by_name(field, value):
    with ExperienceDataPlane(spec=SPEC, capacity=64, batch_size=4, timeout=5) as plane:
        with pytest.raises(ConfigError) as err:
            WarmupScheduleTuner(plane, **{field: value})
        assert err.value.field == field
