"""Building a Profile from recorded Timings, and the fixed + per-unit cost fit."""

from fractions import Fraction

import pytest

from conduit.errors import ConduitError, ConfigError
from conduit.scheduling import (
    CostFit,
    Profile,
    ProfileError,
    Schedule,
    choose,
    feasible_space,
    fit_cost,
    predict,
    profile_from_timings,
)
from conduit.timing import Timings

F = Fraction
approx = pytest.approx


def filled_timings():
    t = Timings()
    for s in (0.010, 0.012, 0.011):  # median 0.011
        t.record("rollout", s)
    for s in (0.020, 0.030, 0.025, 0.021):  # median (0.021 + 0.025) / 2 = 0.023
        t.record("update", s)
    for s in (0.004, 0.0041, 0.0039):  # g=1: median 0.004
        t.record("ingestion", s, units=1)
    for s in (0.007, 0.0075, 0.0065):  # g=4: median 0.007
        t.record("ingestion", s, units=4)
    for s in (0.003, 0.003, 0.009):  # g=1: median 0.003
        t.record("delivery", s, units=1)
    t.record("delivery", 0.004, units=2)
    t.record("sync_ing", 0.0005)
    t.record("sync_ing", 0.0007)  # median 0.0006
    t.record("sync_del", 0.0002)
    return t


def test_profile_from_hand_filled_timings():
    space = feasible_space(mode="off_policy", g_max_ing=6, g_max_del=2)
    prof = profile_from_timings(filled_timings(), space)
    assert prof.t_rollout == approx(0.011)
    assert prof.t_update == approx(0.023)
    assert prof.t_sync_ing == approx(0.0006)
    assert prof.t_sync_del == approx(0.0002)
    # measured medians are kept exactly
    assert prof.t_ing[F(1)] == approx(0.004)
    assert prof.t_ing[F(4)] == approx(0.007)
    assert prof.t_del == {F(1): approx(0.003), F(2): approx(0.004)}
    # missing g from the fit through (1, 4 ms) and (4, 7 ms): a = 3 ms, b = 1 ms per unit
    assert (prof.ing_fit.fixed, prof.ing_fit.per_unit) == (approx(0.003), approx(0.001))
    assert prof.t_ing[F(2)] == approx(0.005)  # interpolated
    assert prof.t_ing[F(3)] == approx(0.006)
    assert prof.t_ing[F(5)] == approx(0.008)  # extrapolated
    assert prof.t_ing[F(6)] == approx(0.009)
    assert set(prof.t_ing) == set(space.g_ing)
    # the profile prices every candidate, so the optimizer runs on it
    plan = choose(prof, space)
    assert plan.num_candidates == 4 * 6 * 2


def test_on_policy_units_group_as_fractions():
    t = Timings()
    t.record("rollout", 0.010)
    t.record("update", 0.020)
    t.record("ingestion", 0.003, units=0.25)
    t.record("ingestion", 0.005, units=0.5)
    t.record("delivery", 0.002, units=0.25)
    space = feasible_space(mode="on_policy", num_minibatches=4)
    prof = profile_from_timings(t, space)
    assert prof.t_ing[F(1, 4)] == approx(0.003)
    assert prof.t_ing[F(1, 2)] == approx(0.005)
    # fit through (1/4, 3 ms), (1/2, 5 ms): b = 8 ms per unit, a = 1 ms
    assert prof.t_ing[F(3, 4)] == approx(0.007)
    assert prof.t_ing[F(1)] == approx(0.009)
    assert prof.t_del == {F(1, 4): approx(0.002)}
    # no sync records: default_sync (0) is assumed
    assert prof.t_sync_ing == 0.0 and prof.t_sync_del == 0.0
    prof2 = profile_from_timings(t, space, default_sync=0.001)
    assert prof2.t_sync_ing == prof2.t_sync_del == 0.001
    assert predict(prof, Schedule(1, 0.75, 1, 0.25)).t_iter > 0


def test_single_measured_granularity_assumes_proportional_cost():
    t = Timings()
    t.record("rollout", 0.01)
    t.record("update", 0.01)
    t.record("ingestion", 0.006, units=2)
    t.record("delivery", 0.002, units=1)
    prof = profile_from_timings(t, feasible_space(mode="off_policy", g_max_ing=3,
                                                  g_max_del=2))
    assert prof.t_ing[F(1)] == approx(0.003)
    assert prof.t_ing[F(3)] == approx(0.009)
    assert prof.t_del[F(2)] == approx(0.004)


@pytest.mark.parametrize("missing", ["rollout", "update", "ingestion", "delivery"])
def test_missing_measurements_raise_a_typed_error(missing):
    src = filled_timings()
    t = Timings()
    for name in src.names():
        if name != missing:
            for r in src.records(name):
                t.record(name, r.seconds, units=r.units)
    with pytest.raises(ProfileError) as info:
        profile_from_timings(t, feasible_space(mode="off_policy"))
    assert info.value.field == missing
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ConduitError)


def test_nothing_measured_raises():
    with pytest.raises(ProfileError):
        profile_from_timings(Timings(), feasible_space(mode="on_policy", num_minibatches=2))


def test_fit_least_squares_by_hand():
    # points (1, 1), (2, 3), (3, 2): mean g = 2, mean T = 2, Sxy = 1, Sxx = 2
    # -> b = 0.5, a = 1
    fit = fit_cost({1: 1.0, 2: 3.0, 3: 2.0})
    assert fit.fixed == approx(1.0) and fit.per_unit == approx(0.5)
    assert fit(4) == approx(3.0)


def test_fit_never_goes_negative():
    # super-linear: OLS gives a = -2, b = 3 -> fit through the origin: b = (1 + 8) / (1 + 4)
    fit = fit_cost([(1, 1.0), (2, 4.0)])
    assert fit.fixed == 0.0 and fit.per_unit == approx(1.8)
    # falling costs (noise): OLS slope < 0 -> constant at the mean
    fit = fit_cost([(1, 3.0), (2, 1.0)])
    assert fit.per_unit == 0.0 and fit.fixed == approx(2.0)
    with pytest.raises(ProfileError):
        fit_cost({})


def test_profile_normalizes_keys_and_uses_fit_for_missing_g():
    prof = Profile(t_rollout=1.0, t_update=1.0, t_ing={0.25: 0.1}, t_del={1: 0.2},
                   del_fit=CostFit(fixed=0.1, per_unit=0.1))
    assert F(1, 4) in prof.t_ing
    assert prof.ing_time(F(1, 4)) == 0.1
    assert prof.del_time(3) == approx(0.4)
    assert prof.to_dict()["t_ing"] == {"1/4": 0.1}
    assert hash(prof) == hash(Profile(t_rollout=1.0, t_update=1.0, t_ing={F(1, 4): 0.1},
                                      t_del={1: 0.2}))


def test_timings_add_copies_records_with_their_totals_and_window():
    src = filled_timings()
    dst = Timings(window=2)
    dst.add(r for r in src.records("update"))
    assert [r.seconds for r in dst.records("update")] == [0.025, 0.021]  # window kept
    assert dst.count("update") == 4
    assert dst.total("update") == approx(0.096)
    assert dst.names() == ["update"]
