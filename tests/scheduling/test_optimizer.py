"""The cost-based optimizer (Eq. 2): enumeration, argmin, tie-breaking, explanation."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conduit.errors import ConfigError, ScheduleError
from conduit.scheduling import (
    Plan,
    Profile,
    Schedule,
    baseline_schedule,
    choose,
    feasible_space,
    predict,
    rank_candidates,
)

ms = 1e-3


def linear_costs(gs, fixed, per_unit):
    return {g: fixed + per_unit * float(g) for g in gs}


def make_profile(space, *, t_rollout=10 * ms, t_update=20 * ms, fixed=0.0, per_unit=1 * ms,
                 sync_ing=0.0, sync_del=0.0):
    return Profile(t_rollout=t_rollout, t_update=t_update,
                   t_ing=linear_costs(space.g_ing, fixed, per_unit),
                   t_del=linear_costs(space.g_del, fixed, per_unit),
                   t_sync_ing=sync_ing, t_sync_del=sync_del)


def test_scores_every_candidate_and_returns_the_argmin():
    space = feasible_space(mode="off_policy", g_max_ing=4, g_max_del=3)
    prof = make_profile(space, fixed=2 * ms, per_unit=1 * ms, sync_ing=1.5 * ms,
                        sync_del=0.2 * ms, t_rollout=1 * ms)
    plan = choose(prof, space, top_k=5)
    assert plan.num_candidates == 4 * 4 * 3 == len(space)
    best = min(predict(prof, s).t_iter for s in space.candidates())
    assert plan.prediction.t_iter == pytest.approx(best)
    assert plan.prediction == predict(prof, plan.schedule)
    space.check(plan.schedule)


def test_sync_cost_outweighing_hiding_picks_no_overlap():
    # per-unit cost 1 ms at every g (hide <= 1 ms) but sync costs 5 ms: overlap never pays.
    # T̄ is flat in g, so the tie-break picks the smallest g.
    space = feasible_space(mode="off_policy", g_max_ing=4, g_max_del=4)
    prof = make_profile(space, sync_ing=5 * ms, sync_del=5 * ms)
    plan = choose(prof, space)
    assert plan.schedule == Schedule(0, 1, 0, 1)
    # exposed = T̄_ing + T̄_del = 1 + 1 = 2 ms
    assert plan.prediction.exposed == pytest.approx(2 * ms)


def test_cheap_sync_picks_overlap():
    # T̄ = 4 ms fully hidden behind a 10 ms rollout / 20 ms update; sync 0.1 ms.
    # ing-path = 10 + 4 + (0.1 - 4) = 10.1; del-path = 20 + 4 + (0.1 - 4) = 20.1
    space = feasible_space(mode="off_policy", g_max_ing=2, g_max_del=2)
    prof = make_profile(space, per_unit=4 * ms, sync_ing=0.1 * ms, sync_del=0.1 * ms)
    plan = choose(prof, space)
    assert (plan.schedule.overlap_ing, plan.schedule.overlap_del) == (1, 1)
    assert plan.schedule == Schedule(1, 1, 1, 1)  # tie on g -> smaller g
    assert plan.prediction.t_iter == pytest.approx(30.2 * ms)


def test_mixed_overlap_decisions_are_independent_per_operator():
    # ingestion: sync 0.1 < hide 4 -> overlap; delivery: sync 9 > hide 4 -> no overlap.
    space = feasible_space(mode="off_policy", g_max_ing=1, g_max_del=1)
    prof = make_profile(space, per_unit=4 * ms, sync_ing=0.1 * ms, sync_del=9 * ms)
    assert choose(prof, space).schedule == Schedule(1, 1, 0, 1)


def test_large_per_invocation_overhead_picks_largest_g():
    # T(g) = 10 ms + 1 ms * g: T̄(g) = 10/g + 1 falls with g; sync too expensive to overlap.
    space = feasible_space(mode="off_policy", g_max_ing=8, g_max_del=6)
    prof = make_profile(space, fixed=10 * ms, per_unit=1 * ms, sync_ing=50 * ms,
                        sync_del=50 * ms)
    plan = choose(prof, space)
    assert plan.schedule == Schedule(0, 8, 0, 6)
    # exposed = (10/8 + 1) + (10/6 + 1) ms
    assert plan.prediction.exposed == pytest.approx((10 / 8 + 1 + 10 / 6 + 1) * ms)


def test_overhead_not_fully_hidden_picks_overlap_and_largest_g():
    # rollout/update 1 ms < T̄: overlap hides only 1 ms, so the path is T̄(g) + sync,
    # minimized by the largest g.
    space = feasible_space(mode="off_policy", g_max_ing=5, g_max_del=5)
    prof = make_profile(space, t_rollout=1 * ms, t_update=1 * ms, fixed=10 * ms,
                        per_unit=1 * ms, sync_ing=0.1 * ms, sync_del=0.1 * ms)
    assert choose(prof, space).schedule == Schedule(1, 5, 1, 5)


def test_on_policy_pipelining_choice():
    # M = 4; T_ing(g) = 1 ms + 8 ms * g, T_del(1/4) = 2 ms; rollout 10, update 20; sync 1.
    # ing-path, overlap=1: 10 + T̄ + 1 - gamma * min(10, T̄), gamma = 1 - g on-policy:
    #   g=1/4: T̄=12, hide=7.5 -> 15.5   <- best     g=1/2: T̄=10, hide=5 -> 16
    #   g=3/4: T̄=9.33, hide=2.33 -> 18              g=1:   T̄=9,  hide=0 -> 20
    # ing-path, overlap=0: 10 + T̄ >= 19.   del-path: overlap=1: 20 + 8 + 1 - 6 = 23 < 28.
    space = feasible_space(mode="on_policy", num_minibatches=4)
    prof = Profile(t_rollout=10 * ms, t_update=20 * ms,
                   t_ing=linear_costs(space.g_ing, 1 * ms, 8 * ms),
                   t_del={Fraction(1, 4): 2 * ms}, t_sync_ing=1 * ms, t_sync_del=1 * ms)
    plan = choose(prof, space)
    assert plan.num_candidates == 16
    assert plan.schedule == Schedule(1, Fraction(1, 4), 1, Fraction(1, 4))
    assert plan.prediction.t_iter == pytest.approx(38.5 * ms)
    # whole-rollout ingestion with overlap hides nothing on-policy: worse than inline g = 1
    def t(s):
        return predict(prof, s, mode="on_policy").t_iter
    assert t(Schedule(1, 1, 1, Fraction(1, 4))) > t(Schedule(0, 1, 1, Fraction(1, 4)))
    # capping the fraction at 1/2 keeps the pipelined pick
    capped = feasible_space(mode="on_policy", num_minibatches=4, max_fraction_ing=0.5)
    plan2 = choose(prof, capped)
    assert plan2.schedule == Schedule(1, Fraction(1, 4), 1, Fraction(1, 4))
    assert plan2.baseline is None  # inline g_ing = 1 was capped out


def test_exact_ties_prefer_no_overlap_then_smaller_g():
    # T̄ = 0.3 ms at every g (values built to carry float noise) and sync == hide: every
    # candidate has the same T_iter, so the tie-break alone decides.
    space = feasible_space(mode="off_policy", g_max_ing=7, g_max_del=7)
    prof = Profile(t_rollout=10 * ms, t_update=20 * ms,
                   t_ing={g: 0.0003 * float(g) for g in space.g_ing},
                   t_del={g: 0.0003 * float(g) for g in space.g_del},
                   t_sync_ing=0.0003, t_sync_del=0.0003)
    ranked = rank_candidates(prof, space)
    assert ranked[0].schedule == Schedule(0, 1, 0, 1)
    assert ranked[1].schedule == Schedule(0, 1, 0, 2)
    assert ranked[2].schedule == Schedule(0, 2, 0, 1)
    # all no-overlap candidates before any overlapped one
    n_no_overlap = 7 * 7
    assert all(c.schedule.overlap_ing == c.schedule.overlap_del == 0
               for c in ranked[:n_no_overlap])
    assert choose(prof, space).schedule == Schedule(0, 1, 0, 1)


def test_ranking_is_deterministic_and_ordered():
    space = feasible_space(mode="off_policy", g_max_ing=3, g_max_del=3)
    prof = make_profile(space, fixed=1 * ms, per_unit=2 * ms, sync_ing=0.5 * ms,
                        sync_del=3 * ms)
    a, b = choose(prof, space, top_k=8), choose(prof, space, top_k=8)
    assert a == b
    assert [c.rank for c in a.ranked] == list(range(1, 9))
    t = [c.prediction.t_iter for c in a.ranked]
    assert t == sorted(t)
    assert a.ranked[0].schedule == a.schedule
    full = rank_candidates(prof, space)
    assert [c.schedule for c in full[:8]] == [c.schedule for c in a.ranked]
    assert len(full) == len(space)


def test_top_k_is_capped_and_validated():
    space = feasible_space(mode="off_policy", g_max_ing=1, g_max_del=1)
    prof = make_profile(space)
    assert len(choose(prof, space, top_k=100).ranked) == 4
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError) as info:
            choose(prof, space, top_k=bad)
        assert info.value.field == "top_k"


def test_profile_missing_a_granularity_is_an_error():
    space = feasible_space(mode="off_policy", g_max_ing=2, g_max_del=1)
    prof = Profile(t_rollout=1.0, t_update=1.0, t_ing={1: 0.1}, t_del={1: 0.1})
    with pytest.raises(ScheduleError, match="g=2"):
        choose(prof, space)


def test_plan_explains_itself():
    space = feasible_space(mode="off_policy", g_max_ing=4, g_max_del=2)
    prof = make_profile(space, fixed=2 * ms, per_unit=1 * ms, sync_ing=0.3 * ms,
                        sync_del=0.3 * ms)
    plan = choose(prof, space, top_k=3)
    assert isinstance(plan, Plan)
    text = plan.explain()
    assert str(plan) == text
    assert plan.schedule.label() in text
    assert "32 candidates" in text
    assert "T_iter" in text and "hide_ing" in text
    assert "inline" in text
    # one table row per ranked candidate
    rows = [line for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 3
    assert plan.baseline is not None
    assert plan.baseline.schedule == baseline_schedule(space) == Schedule(0, 1, 0, 1)
    assert plan.speedup_vs_baseline >= 1.0
    d = plan.to_dict()
    assert d["schedule"] == plan.schedule.to_dict()
    assert len(d["ranked"]) == 3


def test_baseline_schedule_on_policy():
    space = feasible_space(mode="on_policy", num_minibatches=4)
    assert baseline_schedule(space) == Schedule(0, 1, 0, Fraction(1, 4))


ms_times = st.floats(min_value=0.0, max_value=50.0, allow_nan=False)


@settings(max_examples=40, deadline=None)
@given(tr=ms_times, tu=ms_times, fixed=ms_times, unit=ms_times, si=ms_times, sd=ms_times,
       gmax=st.integers(min_value=1, max_value=4))
def test_choice_is_never_beaten_by_any_candidate(tr, tu, fixed, unit, si, sd, gmax):
    space = feasible_space(mode="off_policy", g_max_ing=gmax, g_max_del=gmax)
    prof = make_profile(space, t_rollout=tr * ms, t_update=tu * ms, fixed=fixed * ms,
                        per_unit=unit * ms, sync_ing=si * ms, sync_del=sd * ms)
    plan = choose(prof, space)
    best = min(predict(prof, s).t_iter for s in space.candidates())
    assert plan.prediction.t_iter <= best + 1e-9 * max(best, 1e-12) + 1e-15
