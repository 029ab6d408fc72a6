"""The warm-up trial's decisions: start and probe schedules, the candidate pair, the verdict
without a trial, and the trial's statistic."""

from __future__ import annotations

from fractions import Fraction

import pytest

from conduit.errors import ConfigError
from conduit.scheduling import (
    Profile,
    Schedule,
    TrialPair,
    TrialPolicy,
    choose,
    feasible_space,
    fresh_draws,
    judge_trial,
    learner_delivery,
    spare_core,
    start_schedule,
    warmup_schedule,
)

OFF = feasible_space(mode="off_policy", g_max_ing=4, g_max_del=4)
ON = feasible_space(mode="on_policy", num_minibatches=4, unit_fraction_ing=Fraction(1, 8))


def _profile(op_s: float, **kw: float) -> Profile:
    g = {1: op_s, 2: 2 * op_s, 3: 3 * op_s, 4: 4 * op_s}
    return Profile(t_rollout=0.010, t_update=0.010, t_ing=g, t_del=g, **kw)


def test_policy_order_interleaves_and_validates():
    assert TrialPolicy(trial=4).order() == (0, 1, 1, 0, 0, 1, 1, 0)
    assert TrialPolicy(trial=0).order() == ()
    assert TrialPolicy(trial=4).order(2) == (0, 1, 1, 0)
    for bad in ({"warmup": 0}, {"trial": -1}, {"margin": 1.0}, {"inversions": 1.5},
                {"extend": -1}, {"extend": 2.0},
                {"min_gain": -0.1}, {"min_copy": "x"}, {"min_copy": None},
                {"min_gain": float("nan")}, {"margin": "0.1"}, {"min_copy": True}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            TrialPolicy(**bad)


def test_start_schedule():
    assert start_schedule(OFF) == Schedule(1, 1, 1, 2)
    assert start_schedule(OFF, prioritized=True) == Schedule(1, 1, 0, 1)
    # On-policy: one rollout unit per ingestion, one mini-batch per delivery.
    assert start_schedule(ON) == Schedule(1, Fraction(1, 8), 1, Fraction(1, 4))


def test_warmup_probes_coarse_threadless_delivery_off_policy_only():
    start = start_schedule(OFF)
    probe = Schedule(0, 1, 0, 4)
    assert [warmup_schedule(k, warmup=5, start=start, space=OFF) for k in (1, 2, 3, 4)] == [
        probe, start, probe, start]
    assert warmup_schedule(1, warmup=2, start=start, space=OFF) == start  # never the last
    assert warmup_schedule(1, warmup=3, start=start_schedule(ON), space=ON) == start_schedule(ON)


def test_fresh_draws_keeps_off_policy_delivery_one_batch_per_invocation():
    """A priority update discards every batch drawn before it, so the rest of a coarse
    invocation would be drawn for nothing: only the finest g_del is left, ingestion as it
    was; on-policy delivery (1/M) and a space already at one granularity are unchanged."""
    assert OFF.g_del == (1, 2, 3, 4)
    fresh = fresh_draws(OFF)
    assert fresh.g_del == (1,) and fresh.g_ing == OFF.g_ing and fresh.mode == "off_policy"
    assert {c.g_del for c in fresh.candidates()} == {1}
    assert len(fresh) == 4 * len(OFF.g_ing)
    fresh.check(Schedule(1, 4, 1, 1))
    assert fresh_draws(ON) is ON
    assert fresh_draws(fresh) is fresh
    assert start_schedule(fresh) == Schedule(1, 1, 1, 1)  # prefetch one batch, not two
    assert warmup_schedule(1, warmup=3, start=Schedule(1, 1, 1, 1), space=fresh) == Schedule(
        1, 1, 1, 1)  # nothing coarser to probe


def test_learner_delivery_keeps_the_best_ranked_schedule_without_prefetch():
    plan = choose(_profile(0.004, t_sync_ing=1e-4, t_sync_del=1e-4), OFF, top_k=len(OFF))
    assert plan.schedule.overlap_del
    kept = learner_delivery(plan)
    assert not kept.schedule.overlap_del
    assert kept.schedule == next(c.schedule for c in plan.ranked if not c.schedule.overlap_del)
    assert learner_delivery(kept) is kept


@pytest.mark.parametrize("op_s,verdict", [
    (0.004, None),  # overlap saves a lot: run the trial
    (0.0001, "less than 2%"),  # 1 % of the iteration: keep the threadless schedule
])
def test_a_trial_runs_only_when_the_predicted_saving_is_worth_it(op_s, verdict):
    prof = _profile(op_s, t_sync_ing=1e-5, t_sync_del=1e-5)
    pair = TrialPair.of(choose(prof, OFF), prof, OFF)
    a, b = pair.schedules()
    assert a.overlap_ing and not (b.overlap_ing or b.overlap_del)
    assert pair.gain == pytest.approx(pair.threadless.prediction.t_iter
                                      - pair.model.prediction.t_iter)
    got = pair.verdict_without_trial(TrialPolicy())
    if verdict is None:
        assert got is None
        untried = pair.verdict_without_trial(TrialPolicy(trial=0))
        assert untried is not None and untried.schedule == a
        return
    assert got is not None and got.schedule == b and verdict in got.reason


def test_a_threadless_model_pick_is_kept_without_a_trial():
    prof = _profile(0.004, t_sync_ing=1.0, t_sync_del=1.0)  # overlap costs a second
    pair = TrialPair.of(choose(prof, OFF), prof, OFF)
    got = pair.verdict_without_trial(TrialPolicy())
    assert got is not None and got.schedule == pair.threadless.schedule
    assert "starts no thread" in got.reason


@pytest.mark.parametrize("threadless,keep,open_", [
    ([0.070, 0.075, 0.080, 0.085], True, False),  # clearly faster
    ([0.098, 0.097, 0.099, 0.096], False, False),  # within the 5 % margin
    ([0.070, 0.080, 0.0905, 0.110], False, True),  # 11 % faster by median, 4 inversions
    ([0.120, 0.110, 0.130, 0.070], False, False),  # slower by median
])
def test_judge_trial_needs_margin_and_few_inversions(threadless, keep, open_):
    model = [0.100, 0.100, 0.091, 0.090]
    out = judge_trial(model, threadless, policy=TrialPolicy())
    assert out.keep_threadless == keep
    assert out.open == open_
    assert out.inverted == sum(b >= a for b in threadless for a in model)
    assert out.allowed == 3


def test_the_inversion_allowance_grows_with_the_pairs():
    """Over 8 iterations each (64 pairs) the default allows 12 inversions, 3 per 16 pairs:
    the same share as over the first 4 each."""
    model = [0.100, 0.100, 0.091, 0.090] * 2
    four = [0.070, 0.080, 0.0905, 0.110]  # 4 of 16 pairs inverted: open
    eight = [*four, 0.070, 0.075, 0.080, 0.085]  # 10 of 64: clear
    assert judge_trial(model[:4], four, policy=TrialPolicy()).open
    out = judge_trial(model, eight, policy=TrialPolicy())
    assert (out.inverted, out.allowed, out.keep_threadless, out.open) == (10, 12, True, False)
    assert judge_trial(model, eight, policy=TrialPolicy(inversions=1)).open  # allows 4


def test_judge_trial_needs_scores():
    with pytest.raises(ValueError):
        judge_trial([], [0.1], policy=TrialPolicy())


@pytest.mark.parametrize(("cores", "threads", "accelerator", "spare"), [
    (2, 2, False, False), (2, 4, False, False), (4, 2, False, True), (2, 1, False, True),
    (2, 2, True, True), (1, 1, True, True)])
def test_a_worker_has_a_core_only_beside_an_update_that_leaves_one(cores, threads,
                                                                  accelerator, spare):
    assert spare_core(cores=cores, compute_threads=threads, accelerator=accelerator) is spare
