"""``WarmupScheduleTuner``: the cost model's pick, then a measured, interleaved trial."""

from __future__ import annotations

import pytest

from conduit import ExperienceDataPlane, Schedule
from conduit.workloads.runner import IterationRecord, WarmupScheduleTuner


def _plane(small_spec):
    plane = ExperienceDataPlane(spec=small_spec, capacity=256, batch_size=8,
                                schedule=Schedule(1, 1, 1, 2), timeout=20)
    t = plane.timings  # a profile in which overlap clearly pays: the model picks it
    for _ in range(5):
        t.record("rollout", 0.010)
        t.record("update", 0.010)
        t.record("ingestion", 0.004, units=1)
        t.record("delivery", 0.004, units=1)
        t.record("sync_ing", 0.0001)
        t.record("sync_del", 0.0001)
    return plane


def _record(learner_s, learning=True):
    return IterationRecord(0, end_to_end=0.01 + learner_s, rollout=0.01, ingestion=0.0,
                           delivery=0.0, update=learner_s, other=0.0, env_steps=0,
                           learning=learning, wall_time=0.0)


def _run(tuner, plane, cost_of):
    """Feed iterations whose learner time depends on the schedule they ran."""
    tuner.step(_record(0.5, learning=False))  # not a learning iteration: ignored
    ran = []
    while not tuner.done:
        ran.append(plane.schedule)
        tuner.step(_record(cost_of(plane.schedule)))
    return ran


@pytest.mark.parametrize("gain,kept_model", [
    (0.03, True),  # within the 5 % margin: the model's pick stays
    (0.20, False),
])
def test_trial_keeps_the_model_pick_unless_inline_is_clearly_faster(small_spec, gain,
                                                                   kept_model):
    with _plane(small_spec) as plane:
        plan = {}
        tuner = WarmupScheduleTuner(plane, plan, warmup=2, margin=0.05)

        def cost_of(s):
            inline = not (s.overlap_ing or s.overlap_del)
            return 0.100 * (1 - gain) if inline else 0.100

        ran = _run(tuner, plane, cost_of)
        # Warm-up on the hand-set schedule, then A B B A A B B A (four iterations each).
        assert ran[:2] == [Schedule(1, 1, 1, 2)] * 2
        trial = ran[2:]
        a = trial[0]
        b = Schedule(0, a.g_ing, 0, a.g_del)
        assert a.overlap_ing and a.overlap_del
        assert trial == [a, b, b, a, a, b, b, a]
        want = a if kept_model else b
        assert plane.schedule == want
        assert plan["schedule"] == want.label()
        assert len(plan["schedule_trial_ms"]) == 2
        assert "measured" in plan["schedule_explain"]


def test_a_noisy_trial_does_not_switch(small_spec):
    """Inline's median is 20 % lower, but one of the model pick's iterations was faster than
    one of inline's: not a clear win, so the model's pick stays."""
    with _plane(small_spec) as plane:
        plan = {}
        tuner = WarmupScheduleTuner(plane, plan, warmup=2, margin=0.05)
        costs = {True: iter([0.070, 0.075, 0.080, 0.085]),  # inline
                 False: iter([0.100, 0.100, 0.100, 0.078])}  # the model's pick; one lucky

        def cost_of(s):
            if not tuner._candidates:
                return 0.100  # warm-up
            return next(costs[not (s.overlap_ing or s.overlap_del)])

        ran = _run(tuner, plane, cost_of)
        assert plane.schedule == ran[2]  # the model's pick
        inline = Schedule(0, ran[2].g_ing, 0, ran[2].g_del).label()
        assert plan["schedule_trial_ms"][inline] == pytest.approx(77.5)
