"""A queued rollout unit holds the caller's tensors until it is ingested: a write into one
before then is refused, never stored; memory whose writes leave no trace is copied."""

import contextlib

import numpy as np
import pytest
import torch

from conduit import ExperienceDataPlane, ExperienceSpec, OperatorError, Schedule, SpecError

SPEC = ExperienceSpec.of(id=((), torch.int64))


def held(plane, schedule):
    return plane.paused() if schedule.overlap_ing else contextlib.nullcontext()


def stored(plane):
    return sorted(plane.buffer.store.column("id")[:len(plane.buffer)].tolist())


@pytest.mark.parametrize("schedule", [Schedule(0, 2, 0, 1), Schedule(1, 1, 0, 1)])
def test_a_tensor_written_before_ingestion_is_refused_not_stored(schedule):
    with ExperienceDataPlane(spec=SPEC, capacity=16, batch_size=4, schedule=schedule,
                             timeout=5) as plane:
        reused = torch.arange(4)
        with held(plane, schedule):  # the worker must not ingest before the caller writes
            plane.push({"id": reused})
            reused.add_(100)  # the actor refills its rollout memory
        with pytest.raises(OperatorError) as ei:
            plane.push({"id": torch.arange(200, 204)})
            plane.flush()
        assert isinstance(ei.value.__cause__, SpecError)
        assert ei.value.__cause__.field == "id" and "clone()" in str(ei.value)
        assert not any(100 <= i < 104 for i in stored(plane))  # the changed rows never land
        plane.recover()
        plane.push({"id": torch.arange(300, 304)})
        plane.flush()
        assert set(range(300, 304)) <= set(stored(plane))


def test_tensors_left_alone_are_stored_under_every_schedule():
    for schedule in (Schedule(0, 1, 0, 1), Schedule(0, 2, 0, 1), Schedule(1, 1, 1, 1)):
        with ExperienceDataPlane(spec=SPEC, capacity=16, batch_size=4, schedule=schedule,
                                 timeout=5) as plane:
            for k in range(3):
                plane.push({"id": torch.arange(4 * k, 4 * k + 4)})
            plane.flush()
            assert stored(plane) == list(range(12)), schedule.label()


@pytest.mark.parametrize("schedule", [Schedule(0, 4, 0, 1), Schedule(1, 1, 0, 1)])
def test_reused_numpy_and_inference_memory_is_copied_when_the_unit_waits(schedule):
    with ExperienceDataPlane(spec=SPEC, capacity=16, batch_size=4, schedule=schedule,
                             timeout=5) as plane:
        array = np.arange(4, dtype=np.int64)
        with torch.inference_mode():
            frozen = torch.arange(4, 8)
        with held(plane, schedule):
            plane.push({"id": array})
            plane.push({"id": frozen})
            array += 100  # neither write can be seen on the held memory
            with torch.inference_mode():
                frozen.add_(100)
        plane.flush()
        assert stored(plane) == list(range(8))
