"""A plane's state holds the rows ingested, not the units still queued, so it must not count
their pushes either: a plane loaded from a state captured while units were queued (a save
racing an actor's push) showed more rows pushed than ingested, with nothing pending, for
good. Fails on the code before the mend."""

from __future__ import annotations

import torch

from conduit import ExperienceDataPlane, ExperienceSpec, Schedule

SPEC = ExperienceSpec.of(x=((2,), torch.float32))


def test_a_state_captured_with_units_queued_counts_only_what_it_holds():
    plane = ExperienceDataPlane(spec=SPEC, capacity=100, batch_size=4,
                                schedule=Schedule(0, 4, 0, 1))
    loaded = ExperienceDataPlane(spec=SPEC, capacity=100, batch_size=4)
    try:
        for _ in range(6):  # four ingested together, two left queued (g_ing = 4)
            plane.push({"x": torch.zeros(5, 2)})
        assert plane.stats()["pending_units"] == 2
        with plane.frozen(rows=True, flush=False) as state:
            pass
        loaded.load_state_dict(state)
        c = loaded.counters
        assert (c["pushed_units"], c["pushed_rows"]) == (4, 20)
        assert (c["ingested_units"], c["ingested_rows"]) == (4, 20) and len(loaded.buffer) == 20
        loaded.push({"x": torch.zeros(5, 2)})
        assert loaded.counters["pushed_rows"] == loaded.counters["ingested_rows"] == 25
        assert plane.counters["pushed_rows"] == 30  # the plane's own count is unchanged
    finally:
        plane.close()
        loaded.close()
