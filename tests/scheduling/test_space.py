"""Feasible schedule spaces derived from the RL configuration, and user caps (§6.3)."""

from fractions import Fraction

import pytest

from conduit.errors import ConfigError, ScheduleError
from conduit.scheduling import (
    MAX_GRANULARITY,
    MAX_MINIBATCHES,
    Schedule,
    ScheduleSpace,
    feasible_space,
)

F = Fraction


def test_off_policy_sets_are_one_to_g_max():
    space = feasible_space(mode="off_policy", g_max_ing=4, g_max_del=3)
    assert space.mode == "off_policy"
    assert space.g_ing == (F(1), F(2), F(3), F(4))
    assert space.g_del == (F(1), F(2), F(3))


def test_on_policy_sets_are_minibatch_fractions():
    space = feasible_space(mode="on_policy", num_minibatches=4)
    assert space.g_ing == (F(1, 4), F(1, 2), F(3, 4), F(1))
    assert space.g_del == (F(1, 4),)


def test_on_policy_ignores_off_policy_caps():
    space = feasible_space(mode="on_policy", num_minibatches=2, g_max_ing=1, g_max_del=1)
    assert space.g_ing == (F(1, 2), F(1))
    assert space.g_del == (F(1, 2),)


def test_single_minibatch_on_policy_space():
    space = feasible_space(mode="on_policy", num_minibatches=1)
    assert space.g_ing == (F(1),)
    assert space.g_del == (F(1),)
    assert len(space) == 4


@pytest.mark.parametrize(("kwargs", "n_ing", "n_del"), [
    ({"mode": "off_policy", "g_max_ing": 1, "g_max_del": 1}, 1, 1),
    ({"mode": "off_policy", "g_max_ing": 4, "g_max_del": 2}, 4, 2),
    ({"mode": "off_policy", "g_max_ing": 8, "g_max_del": 8}, 8, 8),
    ({"mode": "on_policy", "num_minibatches": 4}, 4, 1),
    ({"mode": "on_policy", "num_minibatches": 8, "max_fraction_ing": 0.5}, 4, 1),
])
def test_enumeration_size_is_four_g_ing_g_del(kwargs, n_ing, n_del):
    space = feasible_space(**kwargs)
    assert (len(space.g_ing), len(space.g_del)) == (n_ing, n_del)
    cands = space.candidates()
    assert len(space) == len(cands) == 4 * n_ing * n_del
    assert len(set(cands)) == len(cands)
    for s in cands:
        space.check(s)
    # every overlap combination appears for each granularity pair
    assert {(s.overlap_ing, s.overlap_del) for s in cands} == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_check_rejects_schedule_outside_space():
    off = feasible_space(mode="off_policy", g_max_ing=2, g_max_del=2)
    with pytest.raises(ScheduleError, match="g_ing"):
        off.check(Schedule(0, 3, 0, 1))
    with pytest.raises(ScheduleError, match="g_del"):
        off.check(Schedule(0, 1, 0, 0.5))
    on = feasible_space(mode="on_policy", num_minibatches=4)
    with pytest.raises(ScheduleError, match="g_del"):
        on.check(Schedule(1, 1, 1, 1))
    on.check(Schedule(1, 0.75, 1, 0.25))


def test_on_policy_max_fraction_cap():
    space = feasible_space(mode="on_policy", num_minibatches=4, max_fraction_ing=0.5)
    assert space.g_ing == (F(1, 4), F(1, 2))
    space = feasible_space(mode="on_policy", num_minibatches=10, max_fraction_ing=0.3)
    assert space.g_ing == (F(1, 10), F(2, 10), F(3, 10))
    space = feasible_space(mode="on_policy", num_minibatches=4, max_fraction_ing=F(1, 4))
    assert space.g_ing == (F(1, 4),)
    space = feasible_space(mode="on_policy", num_minibatches=4, max_fraction_ing=1)
    assert space.g_ing[-1] == 1


def test_on_policy_unit_fraction_adds_finer_steps():
    space = feasible_space(mode="on_policy", num_minibatches=4, unit_fraction_ing=F(1, 8))
    assert space.g_ing == (F(1, 8), F(1, 4), F(1, 2), F(3, 4), F(1))
    space = feasible_space(mode="on_policy", num_minibatches=4, unit_fraction_ing=F(1, 16))
    assert space.g_ing[:4] == (F(1, 16), F(1, 8), F(3, 16), F(1, 4))
    # Units of a mini-batch or more add nothing.
    for u in (F(1, 4), F(1, 2), F(1)):
        space = feasible_space(mode="on_policy", num_minibatches=4, unit_fraction_ing=u)
        assert space.g_ing == (F(1, 4), F(1, 2), F(3, 4), F(1))
    space = feasible_space(mode="on_policy", num_minibatches=4, max_fraction_ing=0.5,
                           unit_fraction_ing=F(1, 8))
    assert space.g_ing == (F(1, 8), F(1, 4), F(1, 2))
    space.check(Schedule(1, F(1, 8), 1, F(1, 4)))


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"mode": "on_policy", "num_minibatches": 4, "unit_fraction_ing": F(0)},
     "unit_fraction_ing"),
    ({"mode": "on_policy", "num_minibatches": 4, "unit_fraction_ing": 0.125},
     "unit_fraction_ing"),
    ({"mode": "on_policy", "num_minibatches": 4, "unit_fraction_ing": F(3, 2)},
     "unit_fraction_ing"),
    ({"mode": "on_policy", "num_minibatches": 4, "unit_fraction_ing": F(1, 2048)},
     "unit_fraction_ing"),
    ({"mode": "off_policy", "unit_fraction_ing": F(1, 8)}, "unit_fraction_ing"),
    ({"mode": "off_policy", "g_max_ing": 0}, "g_max_ing"),
    ({"mode": "off_policy", "g_max_ing": -2}, "g_max_ing"),
    ({"mode": "off_policy", "g_max_ing": 2.5}, "g_max_ing"),
    ({"mode": "off_policy", "g_max_ing": True}, "g_max_ing"),
    ({"mode": "off_policy", "g_max_ing": MAX_GRANULARITY + 1}, "g_max_ing"),
    ({"mode": "off_policy", "g_max_del": 0}, "g_max_del"),
    ({"mode": "off_policy", "g_max_del": -1}, "g_max_del"),
    ({"mode": "off_policy", "g_max_del": MAX_GRANULARITY + 1}, "g_max_del"),
    ({"mode": "on_policy", "num_minibatches": 0}, "num_minibatches"),
    ({"mode": "on_policy", "num_minibatches": MAX_MINIBATCHES + 1}, "num_minibatches"),
    ({"mode": "on_policy", "num_minibatches": 4, "max_fraction_ing": 0}, "max_fraction_ing"),
    ({"mode": "on_policy", "num_minibatches": 4, "max_fraction_ing": -0.5},
     "max_fraction_ing"),
    ({"mode": "on_policy", "num_minibatches": 4, "max_fraction_ing": 1.5},
     "max_fraction_ing"),
    ({"mode": "on_policy", "num_minibatches": 4, "max_fraction_ing": float("nan")},
     "max_fraction_ing"),
    ({"mode": "on_policy", "num_minibatches": 4, "max_fraction_ing": "half"},
     "max_fraction_ing"),
    # below one mini-batch: the space would be empty
    ({"mode": "on_policy", "num_minibatches": 4, "max_fraction_ing": 0.125},
     "max_fraction_ing"),
    # a fraction cap makes no sense off-policy
    ({"mode": "off_policy", "max_fraction_ing": 0.5}, "max_fraction_ing"),
    ({"mode": "offline"}, "mode"),
])
def test_infeasible_caps_are_rejected_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        feasible_space(**kwargs)
    assert info.value.field == field
    assert field in str(info.value)


def test_largest_allowed_caps_are_accepted():
    space = feasible_space(mode="off_policy", g_max_ing=MAX_GRANULARITY, g_max_del=1)
    assert len(space.g_ing) == MAX_GRANULARITY
    space = feasible_space(mode="on_policy", num_minibatches=MAX_MINIBATCHES)
    assert space.g_del == (F(1, MAX_MINIBATCHES),)
    assert space.g_ing[0] == F(1, MAX_MINIBATCHES)


def test_schedule_normalizes_and_validates():
    s = Schedule(1, 0.25, 0, 2)
    assert s.g_ing == F(1, 4) and s.g_del == F(2)
    assert s.label() == "ing(ov=1,g=1/4) del(ov=0,g=2)"
    assert s.to_dict() == {"overlap_ing": 1, "g_ing": "1/4", "overlap_del": 0, "g_del": "2"}
    with pytest.raises(ScheduleError):
        Schedule(2, 1, 0, 1)
    with pytest.raises(ScheduleError):
        Schedule(0, 0, 0, 1)
    with pytest.raises(ScheduleError):
        Schedule(0, 1.5, 0, 1)
    assert Schedule.inline() == Schedule(0, 1, 0, 1)


def test_space_is_a_value():
    a = feasible_space(mode="off_policy", g_max_ing=2, g_max_del=2)
    b = feasible_space(mode="off_policy", g_max_ing=2, g_max_del=2)
    assert a == b and hash(a) == hash(b)
    assert isinstance(a, ScheduleSpace)


@pytest.mark.parametrize(("m", "u", "finer"), [
    (1, F(1, 2), (F(1, 2),)),  # one mini-batch: ingestion may still run once per unit
    (2, F(1, 8), (F(1, 8), F(1, 4), F(3, 8))),  # every multiple below 1/M, not M - 1 of them
    (4, F(1, 4), ()),
])
def test_every_multiple_of_the_unit_below_one_minibatch_is_feasible(m, u, finer):
    space = feasible_space(mode="on_policy", num_minibatches=m, unit_fraction_ing=u)
    assert space.g_ing == (*finer, *(F(k, m) for k in range(1, m + 1)))
