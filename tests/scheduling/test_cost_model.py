"""The iteration-latency model (Eq. 2, App. E Eq. 4-6), checked against hand-worked numbers.

All times below are in milliseconds, written as seconds (``ms = 1e-3``).
"""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conduit.errors import ConfigError, ScheduleError
from conduit.scheduling import Prediction, Profile, Schedule, gamma, hide, per_unit, predict

ms = 1e-3
approx = pytest.approx


def off_profile(**kw):
    base = {"t_rollout": 10 * ms, "t_update": 20 * ms,
            "t_ing": {1: 4 * ms, 4: 8 * ms}, "t_del": {1: 3 * ms, 2: 4 * ms},
            "t_sync_ing": 1 * ms, "t_sync_del": 0.5 * ms}
    base.update(kw)
    return Profile(**base)


def test_gamma_eq6():
    assert gamma(1) == 1.0
    assert gamma(8) == 1.0
    assert gamma(Fraction(1, 4)) == approx(0.75)
    assert gamma(0.5) == approx(0.5)
    with pytest.raises(ScheduleError):
        gamma(0)


def test_per_unit_and_hide():
    assert per_unit(8 * ms, 4) == approx(2 * ms)
    assert per_unit(3 * ms, Fraction(1, 4)) == approx(12 * ms)
    # hide is gamma * min(compute, per-unit cost)
    assert hide(10 * ms, 2 * ms, 4) == approx(2 * ms)
    assert hide(1 * ms, 2 * ms, 4) == approx(1 * ms)
    assert hide(10 * ms, 12 * ms, Fraction(1, 4)) == approx(7.5 * ms)


def test_mode_c_no_overlap_g_equal_1():
    # Fig. 10(c): inline, one unit per invocation.
    # ing-path = 10 + 4/1 = 14; del-path = 20 + 3/1 = 23; T_iter = 37; exposed = 7.
    p = predict(off_profile(), Schedule(0, 1, 0, 1))
    assert p.t_ing_path == approx(14 * ms)
    assert p.t_del_path == approx(23 * ms)
    assert p.t_iter == approx(37 * ms)
    assert p.exposed == approx(7 * ms)
    # the hiding terms are reported although overlap = 0 does not use them:
    # hide_ing = 1 * min(10, 4) = 4; hide_del = 1 * min(20, 3) = 3
    assert p.hide_ing == approx(4 * ms)
    assert p.hide_del == approx(3 * ms)
    assert p.unit_ing == approx(4 * ms) and p.unit_del == approx(3 * ms)


def test_mode_a_no_overlap_g_above_1():
    # Fig. 10(a): batching amortizes: T̄_ing(4) = 8/4 = 2, T̄_del(2) = 4/2 = 2.
    # ing-path = 10 + 2 = 12; del-path = 20 + 2 = 22; T_iter = 34; exposed = 4.
    p = predict(off_profile(), Schedule(0, 4, 0, 2))
    assert p.t_ing_path == approx(12 * ms)
    assert p.t_del_path == approx(22 * ms)
    assert p.t_iter == approx(34 * ms)
    assert p.exposed == approx(4 * ms)


def test_mode_b_overlap_g_above_1():
    # Fig. 10(b): hide_ing = 1 * min(10, 2) = 2, hide_del = 1 * min(20, 2) = 2.
    # ing-path = 10 + 2 + (1 - 2) = 11; del-path = 20 + 2 + (0.5 - 2) = 20.5
    # T_iter = 31.5; exposed = 1.5 (only the sync costs remain exposed).
    p = predict(off_profile(), Schedule(1, 4, 1, 2))
    assert p.hide_ing == approx(2 * ms)
    assert p.hide_del == approx(2 * ms)
    assert p.t_ing_path == approx(11 * ms)
    assert p.t_del_path == approx(20.5 * ms)
    assert p.t_iter == approx(31.5 * ms)
    assert p.exposed == approx(1.5 * ms)


def test_mode_b_hiding_bounded_by_short_compute_stage():
    # rollout (1 ms) shorter than T̄_ing(4) = 2 ms: hide_ing = min(1, 2) = 1.
    # ing-path = 1 + 2 + (1 - 1) = 3.  update 1.5 ms < T̄_del(2) = 2: hide_del = 1.5,
    # del-path = 1.5 + 2 + (0.5 - 1.5) = 2.5.  T_iter = 5.5; exposed = 5.5 - 2.5 = 3.
    p = predict(off_profile(t_rollout=1 * ms, t_update=1.5 * ms), Schedule(1, 4, 1, 2))
    assert p.hide_ing == approx(1 * ms)
    assert p.hide_del == approx(1.5 * ms)
    assert p.t_ing_path == approx(3 * ms)
    assert p.t_del_path == approx(2.5 * ms)
    assert p.t_iter == approx(5.5 * ms)
    assert p.exposed == approx(3 * ms)


def test_mode_d_overlap_fractional_pipelining():
    # Fig. 10(d), on-policy with M = 4 mini-batches.
    # T̄_ing(1/4) = 3 / (1/4) = 12; gamma(1/4) = 3/4; hide_ing = 0.75 * min(10, 12) = 7.5
    # ing-path = 10 + 12 + (1 - 7.5) = 15.5
    # T̄_del(1/4) = 2 / (1/4) = 8; hide_del = 0.75 * min(20, 8) = 6
    # del-path = 20 + 8 + (1 - 6) = 23;  T_iter = 38.5; exposed = 8.5
    prof = Profile(t_rollout=10 * ms, t_update=20 * ms,
                   t_ing={Fraction(1, 4): 3 * ms, Fraction(1, 2): 5 * ms},
                   t_del={0.25: 2 * ms}, t_sync_ing=1 * ms, t_sync_del=1 * ms)
    p = predict(prof, Schedule(1, Fraction(1, 4), 1, Fraction(1, 4)))
    assert p.unit_ing == approx(12 * ms)
    assert p.hide_ing == approx(7.5 * ms)
    assert p.t_ing_path == approx(15.5 * ms)
    assert p.hide_del == approx(6 * ms)
    assert p.t_del_path == approx(23 * ms)
    assert p.t_iter == approx(38.5 * ms)
    assert p.exposed == approx(8.5 * ms)
    # g = 1/2: T̄ = 5 / 0.5 = 10, hide = 0.5 * min(10, 10) = 5 -> ing-path = 10 + 10 + 1 - 5 = 16
    q = predict(prof, Schedule(1, 0.5, 1, 0.25))
    assert q.hide_ing == approx(5 * ms)
    assert q.t_ing_path == approx(16 * ms)
    # sequential on-policy at g = 1/4: ing-path = 10 + 12 = 22, del-path = 20 + 8 = 28
    r = predict(prof, Schedule(0, 0.25, 0, 0.25))
    assert r.t_iter == approx(50 * ms)


def test_on_policy_whole_rollout_ingestion_hides_nothing():
    # On-policy g_ing = 1 ingests the rollout only after its last unit: gamma = 1 - 1 = 0, so
    # overlap adds its sync cost and hides nothing. Off-policy g = 1 hides min(T, T̄) fully.
    from conduit.scheduling import gamma
    assert gamma(1, mode="on_policy") == 0.0
    assert gamma(Fraction(1, 4), mode="on_policy") == 0.75
    assert gamma(1) == 1.0
    prof = Profile(t_rollout=10 * ms, t_update=20 * ms, t_ing={1: 4 * ms},
                   t_del={0.25: 2 * ms}, t_sync_ing=1 * ms, t_sync_del=1 * ms)
    on = predict(prof, Schedule(1, 1, 0, 0.25), mode="on_policy")
    assert on.hide_ing == 0.0
    assert on.t_ing_path == approx((10 + 4 + 1) * ms)
    off = predict(prof, Schedule(1, 1, 0, 0.25))
    assert off.hide_ing == approx(4 * ms)


def test_overlap_with_expensive_sync_is_worse():
    # sync 5 ms > hide 2 ms: ing-path = 10 + 2 + (5 - 2) = 15 vs 12 without overlap.
    prof = off_profile(t_sync_ing=5 * ms)
    with_ov = predict(prof, Schedule(1, 4, 0, 1))
    without = predict(prof, Schedule(0, 4, 0, 1))
    assert with_ov.t_ing_path == approx(15 * ms)
    assert without.t_ing_path == approx(12 * ms)


def test_predict_needs_profiled_granularity():
    with pytest.raises(ScheduleError, match="t_ing"):
        predict(off_profile(), Schedule(0, 2, 0, 1))
    with pytest.raises(ScheduleError):
        predict(off_profile(), (0, 1, 0, 1))


def test_prediction_is_frozen_and_pure():
    prof = off_profile()
    a = predict(prof, Schedule(1, 4, 1, 2))
    b = predict(prof, Schedule(1, 4, 1, 2))
    assert a == b
    assert isinstance(a, Prediction)
    with pytest.raises(AttributeError):
        a.t_iter = 0.0  # type: ignore[misc]
    assert set(a.to_dict()) >= {"t_iter", "t_ing_path", "t_del_path", "exposed"}


def test_copy_time_caps_what_overlap_hides():
    """``t_copy_*``: only an operator's data movement runs beside the caller on a Python
    thread. Mode (b) of Fig. 10 with g = 1: unbounded (Eq. 4/5) it hides min(10, 4) = 4 and
    min(20, 3) = 3; capped at 0.5 and 0.25 per unit it hides only those, so the overlapped
    schedule now pays its sync costs for little: T_iter = 37 - 0.5 + 1 - 0.25 + 0.5."""
    sched = Schedule(1, 1, 1, 1)
    free = predict(off_profile(), sched)
    assert (free.hide_ing, free.hide_del) == (approx(4 * ms), approx(3 * ms))
    capped = predict(off_profile(t_copy_ing=0.5 * ms, t_copy_del=0.25 * ms), sched)
    assert (capped.hide_ing, capped.hide_del) == (approx(0.5 * ms), approx(0.25 * ms))
    assert capped.t_iter == approx((37 - 0.5 + 1 - 0.25 + 0.5) * ms)
    inline = predict(off_profile(t_copy_ing=0.5 * ms, t_copy_del=0.25 * ms), Schedule(0, 1, 0, 1))
    assert capped.t_iter > inline.t_iter  # overlap no longer pays
    # A cap above the per-unit cost changes nothing.
    roomy = predict(off_profile(t_copy_ing=1.0, t_copy_del=1.0), sched)
    assert roomy.t_iter == approx(free.t_iter)
    with pytest.raises(ConfigError) as info:
        off_profile(t_copy_del=-1 * ms)
    assert info.value.field == "t_copy_del"


def test_profile_validates_inputs():
    with pytest.raises(ConfigError) as info:
        off_profile(t_rollout=-1.0)
    assert info.value.field == "t_rollout"
    with pytest.raises(ConfigError) as info:
        off_profile(t_ing={})
    assert info.value.field == "t_ing"
    with pytest.raises(ConfigError):
        off_profile(t_del={0: 1.0})
    with pytest.raises(ConfigError):
        off_profile(t_sync_del=float("nan"))
    with pytest.raises(TypeError):
        Profile(10 * ms, 20 * ms, {1: 1.0}, {1: 1.0})  # keyword-only


times = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(tr=times, tu=times, ti=times, td=times, si=times, sd=times,
       oi=st.sampled_from([0, 1]), od=st.sampled_from([0, 1]),
       gi=st.sampled_from([Fraction(1, 4), Fraction(1, 2), Fraction(1), Fraction(3)]),
       gd=st.sampled_from([Fraction(1, 4), Fraction(1), Fraction(2)]))
def test_model_identities(tr, tu, ti, td, si, sd, oi, od, gi, gd):
    prof = Profile(t_rollout=tr, t_update=tu, t_ing={gi: ti}, t_del={gd: td},
                   t_sync_ing=si, t_sync_del=sd)
    p = predict(prof, Schedule(oi, gi, od, gd))
    assert p.t_iter == approx(p.t_ing_path + p.t_del_path)
    assert p.exposed == approx(p.t_iter - tr - tu, abs=1e-12)
    # hiding never exceeds the per-unit cost nor the neighbouring compute stage
    assert 0 <= p.hide_ing <= min(tr, p.unit_ing) + 1e-15
    assert 0 <= p.hide_del <= min(tu, p.unit_del) + 1e-15
    # without overlap the exposed latency is exactly the per-unit costs
    if oi == od == 0:
        assert p.exposed == approx(p.unit_ing + p.unit_del, abs=1e-12)
