"""Three reconfiguration mends of the local plane: an ingestion granularity whose joined
units would overflow the ring, placements on devices no store can live on, and the re-plan
the auto scheduler makes after a migration. Each test fails on the code before its mend."""

from __future__ import annotations

import time

import pytest
import torch

from conduit.errors import PlacementError
from conduit.plane import ExperienceDataPlane
from conduit.plane.autotune import AutoScheduler
from conduit.scheduling import Profile, Schedule
from conduit.spec import ExperienceSpec
from conduit.storage import Placement

SPEC = ExperienceSpec.of(rid=((), torch.int64))


@pytest.mark.parametrize("schedule", [Schedule(0, 4, 0, 1), Schedule(1, 4, 0, 1),
                                      Schedule(1, 4, 1, 1)], ids=lambda s: s.label())
def test_units_joined_past_the_capacity_are_ingested_in_several_invocations(schedule):
    """g_ing = 4 units of 16 rows into a ring of 32: the four units were joined into one write
    of 64 rows, which the ring refused, losing every acknowledged unit (push 3 raised inline,
    the worker latched it overlapped). An invocation now takes only the units that fit."""
    plane = ExperienceDataPlane(spec=SPEC, capacity=32, batch_size=8, timeout=5)
    try:
        plane.set_schedule(schedule)
        for i in range(4):
            plane.push({"rid": torch.arange(16) + 16 * i})
        plane.flush()
        assert plane.counters["lost_units"] == 0
        assert plane.counters["ingested_rows"] == 64
        held = plane.buffer.store.get(torch.arange(32))["rid"]
        assert sorted(held.tolist()) == list(range(32, 64))  # the newest rows, once each
        batch = plane.pull()  # (a prefetched one may be drawn before the last units landed)
        assert len(batch["rid"]) == 8 and all(0 <= r < 64 for r in batch["rid"].tolist())
    finally:
        plane.close()


@pytest.mark.parametrize("device", ["meta", "xpu", "mps", "hpu"])
def test_a_store_on_a_device_that_is_neither_cpu_nor_cuda_is_refused(device):
    """migrate() to Placement.device('meta') succeeded and left every row unreadable (each
    pull an OperatorError, and no way back); other device types raised assertion, import or
    capacity errors. Each is a PlacementError now, and the plane keeps its rows."""
    plane = ExperienceDataPlane(spec=SPEC, capacity=64, batch_size=4, timeout=3)
    try:
        plane.push({"rid": torch.arange(8)})
        with pytest.raises(PlacementError, match=r"placement\.devices") as info:
            plane.migrate(Placement.device(device))
        assert device in str(info.value)
        assert set(plane.pull()["rid"].tolist()) <= set(range(8))
        assert len(plane.buffer) == 8
    finally:
        plane.close()
    for placement in (Placement.device(device), Placement.sharded(["cpu", device])):
        with pytest.raises(PlacementError, match="neither CPU memory nor a CUDA device"):
            ExperienceDataPlane(spec=SPEC, capacity=64, batch_size=4, placement=placement)


def test_the_replan_after_a_migration_uses_the_timings_made_after_it():
    """observe() that found a migration dropped every record made so far, those made after
    the migration included, so its re-plan priced the old placement's update time (0.01 s)
    and the next observe re-planned again for drift. It keeps the records made after the
    migration ended now."""
    plane = ExperienceDataPlane(spec=SPEC, capacity=1000, batch_size=4, timeout=3, g_max=2)
    profile = Profile(t_rollout=0.01, t_update=0.01, t_ing={1: 1e-4, 2: 2e-4},
                      t_del={1: 1e-4, 2: 2e-4}, t_sync_ing=1e-3, t_sync_del=1e-3)
    auto = AutoScheduler(plane=plane, profile=profile)
    auto.plan()

    def step(update_s: float) -> None:  # rollout and update timings as timed() records them
        plane.timings.record("rollout", 0.01, start=time.perf_counter())
        plane.push({"rid": torch.arange(4)})
        plane.pull()
        plane.timings.record("update", update_s, start=time.perf_counter())

    try:
        for _ in range(3):
            step(0.01)
            auto.observe()
        step(0.01)  # recorded before the migration: not a cost of the new placement
        plane.migrate(Placement.sharded(["cpu", "cpu"]))
        for _ in range(10):
            step(0.03)
        decision = auto.observe()
        assert decision.replan and "migration" in decision.reasons
        assert auto.profile.t_update == pytest.approx(0.03)
    finally:
        plane.close()
