"""Regressions found by end-to-end runs."""

import torch

from conduit import ExperienceDataPlane, Schedule
from tests.conftest import make_rows


def test_discarded_prefetch_wakes_the_delivery_worker(small_spec):
    """All staged batches discarded after a priority update must not stall the next pull."""
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=16, sampler="prioritized",
                             schedule=Schedule(0, 1, 1, 4), timeout=5) as plane:
        plane.push(make_rows(small_spec, 64))
        for _ in range(20):
            b = plane.pull(timeout=5)
            plane.update_priorities(b["_index"], torch.rand(16) + 0.1)
        assert plane.stats()["discarded_batches"] > 0


def test_switch_to_smaller_g_with_pending_units_does_not_block(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=200, batch_size=4, timeout=3,
                             schedule=Schedule(0, 8, 0, 1)) as plane:
        for i in range(7):  # 7 pending units: more than g_ing=1 allows
            plane.push(make_rows(small_spec, 2, start=2 * i))
        assert plane.stats()["pending_units"] == 7
        plane.set_schedule(Schedule(0, 1, 0, 1))
        plane.push(make_rows(small_spec, 2, start=14))
        assert plane.stats()["ingested_units"] == 8 and len(plane.buffer) == 16


def test_inline_schedule_for_on_policy(small_spec):
    from fractions import Fraction
    s = Schedule.inline(num_minibatches=4)
    assert s == Schedule(0, 1, 0, Fraction(1, 4))
    with ExperienceDataPlane(spec=small_spec, capacity=16, mode="on_policy", num_minibatches=4,
                             schedule=s) as plane:
        plane.push(make_rows(small_spec, 16), policy_version=0)
        assert sum(mb["id"].numel() for mb in plane.minibatches()) == 16
