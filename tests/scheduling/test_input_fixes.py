"""Bad inputs to scheduling / placement are refused with a Conduit error naming the field, before
anything changes (AutoScheduler knobs, Candidate shares, cost fits, topology memory, granularity).
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import torch

from conduit.errors import ConfigError, PlacementError, ScheduleError, TopologyError
from conduit.placement.topology import DeviceInfo, Topology
from conduit.placement.transfer import Candidate
from conduit.plane import ExperienceDataPlane
from conduit.plane.autotune import AutoScheduler
from conduit.scheduling import Schedule
from conduit.scheduling.profile import CostFit, Profile, as_granularity, fit_cost
from conduit.spec import ExperienceSpec
from conduit.storage.layout import Placement

SPEC = ExperienceSpec.of(obs=((4,), torch.float32))


def _fit_profile() -> Profile:
    return Profile(t_rollout=0.1, t_update=0.1, t_ing={}, t_del={},
                   ing_fit=CostFit(fixed=0.05, per_unit=0.001),
                   del_fit=CostFit(fixed=0.05, per_unit=0.001))


# ---------------------------------------------------------------- AutoScheduler knobs

@pytest.mark.parametrize(("field", "value"), [
    ("patience", 0), ("patience", 1.5), ("patience", True),
    ("threshold", -1.0), ("threshold", 0), ("threshold", math.nan), ("threshold", math.inf),
    ("threshold", "0.2"),
    ("abs_tol", math.nan), ("abs_tol", -0.1), ("abs_tol", math.inf), ("abs_tol", None),
])
def test_autoscheduler_refuses_bad_policy_knobs_at_construction(field: str,
                                                                 value: object) -> None:
    with ExperienceDataPlane(spec=SPEC, capacity=64, batch_size=4,
                             schedule=Schedule(0, 1, 0, 1)) as plane:
        before = plane.schedule
        with pytest.raises(ConfigError) as info:
            AutoScheduler(plane=plane, profile=_fit_profile(), **{field: value})
        assert info.value.field == field
        assert plane.schedule == before


def test_autoscheduler_plan_refusal_leaves_plane_schedule() -> None:
    # A knob spoiled after construction is still refused before the plane is switched.
    with ExperienceDataPlane(spec=SPEC, capacity=64, batch_size=4,
                             schedule=Schedule(0, 1, 0, 1)) as plane:
        before = plane.schedule
        auto = AutoScheduler(plane=plane, profile=_fit_profile())
        auto.patience = 0
        with pytest.raises(ConfigError) as info:
            auto.plan()
        assert info.value.field == "patience"
        assert plane.schedule == before
        assert auto.current is None and auto.policy is None and auto.history == []


def test_autoscheduler_accepts_good_policy_knobs() -> None:
    with ExperienceDataPlane(spec=SPEC, capacity=64, batch_size=4,
                             schedule=Schedule(0, 1, 0, 1)) as plane:
        auto = AutoScheduler(plane=plane, profile=_fit_profile(), threshold=1, patience=2,
                             abs_tol=0)
        plan = auto.plan()
        assert plane.schedule == plan.schedule
        assert auto.policy is not None
        assert isinstance(auto.threshold, float) and auto.patience == 2


# ---------------------------------------------------------------- Candidate.node_shares

@pytest.mark.parametrize("shares", [
    (math.nan, math.nan), (math.inf, -math.inf), (math.nan, 1.0), (0.5, "x"), (0.5, None),
])
def test_candidate_refuses_non_finite_node_shares(shares: tuple) -> None:
    with pytest.raises(PlacementError, match="node_shares"):
        Candidate(placement=Placement.device("cuda:0"), nodes=("node0", "node1"),
                  node_shares=shares)


def test_candidate_accepts_finite_node_shares() -> None:
    c = Candidate(placement=Placement.device("cuda:0"), nodes=("node0", "node1"),
                  node_shares=(0.25, 0.75))
    assert c.node_shares == (0.25, 0.75)


# ---------------------------------------------------------------- CostFit / fit_cost

@pytest.mark.parametrize(("field", "kw"), [
    ("fixed", {"fixed": math.nan, "per_unit": 0.1}),
    ("fixed", {"fixed": -100.0, "per_unit": 0.1}),
    ("fixed", {"fixed": math.inf, "per_unit": 0.1}),
    ("per_unit", {"fixed": 0.1, "per_unit": -1e-9}),
    ("per_unit", {"fixed": 0.1, "per_unit": math.nan}),
    ("per_unit", {"fixed": 0.1, "per_unit": None}),
    ("fixed", {"fixed": "0.1", "per_unit": 0.1}),
    ("fixed", {"fixed": True, "per_unit": 0.1}),
])
def test_costfit_refuses_non_finite_or_negative(field: str, kw: dict) -> None:
    with pytest.raises(ConfigError) as info:
        CostFit(**kw)
    assert info.value.field == field


def test_costfit_normalizes_numbers() -> None:
    fit = CostFit(fixed=Fraction(1, 2), per_unit=0)
    assert fit == CostFit(fixed=0.5, per_unit=0.0)
    assert isinstance(fit.fixed, float) and fit(3) == 0.5


def test_profile_refuses_a_fit_built_around_the_check() -> None:
    fit = CostFit(fixed=0.1, per_unit=0.1)
    object.__setattr__(fit, "fixed", math.nan)   # as an old pickle could hold
    with pytest.raises(ConfigError) as info:
        Profile(t_rollout=1, t_update=1, t_ing={}, t_del={1: 1.0}, ing_fit=fit)
    assert info.value.field == "ing_fit.fixed"


@pytest.mark.parametrize("points", [
    [(1, math.nan), (2, 1.0)], [(1, -5.0)], [(1, 1.0), (2, -0.5)], [(1, math.inf)],
    [(0, 1.0)], [(-1, 1.0), (2, 1.0)], [(math.nan, 1.0), (1, 1.0)], {0: 1.0},
    [(1, "1.0")], [(True, 1.0)], [(1,)], [1.0],
    # finite but out of range for the arithmetic: overflow / underflow, no raw error
    [(1, 1e308), (1, 1e308)], [(1e200, 1.0), (2e200, 2.0)], [(1e-320, 1.0)],
    [(Fraction(10**400), 1.0)], [(1e-320, 1.0), (2e-320, 1.0)],
])
def test_fit_cost_refuses_bad_points(points: object) -> None:
    with pytest.raises(ConfigError) as info:
        fit_cost(points)
    assert info.value.field == "points"


def test_fit_cost_accepts_fraction_and_zero_cost_points() -> None:
    fit = fit_cost({Fraction(1, 4): 0.0, 1: 0.0})
    assert fit == CostFit(fixed=0.0, per_unit=0.0)



# ---------------------------------------------------------------- topology memory

def _topology_doc(mem: object) -> dict:
    return {"nodes": [{"name": "node0", "devices": [{"name": "cpu", "memory_bytes": 1e9},
                                                    {"name": "cuda:0", "memory_bytes": mem}],
                       "links": []}]}


@pytest.mark.parametrize("mem", [math.nan, math.inf, -math.inf, -1])
def test_topology_refuses_non_finite_memory(mem: float) -> None:
    # json.dumps writes NaN / Infinity and json.loads reads them back (a hand-edited file).
    text = json.dumps(_topology_doc(mem))
    with pytest.raises(TopologyError, match=r"nodes\[0\]\.devices\[1\]\.memory_bytes"):
        Topology.from_json(text)
    with pytest.raises(TopologyError, match=r"nodes\[0\]\.devices\[1\]\.memory_bytes"):
        Topology.from_dict(_topology_doc(mem))
    with pytest.raises(TopologyError, match="memory_bytes"):
        DeviceInfo(name="cuda:0", memory_bytes=mem)


def test_topology_accepts_finite_memory() -> None:
    topo = Topology.from_json(json.dumps(_topology_doc(8e9)))
    assert topo.memory("cuda:0") == 8_000_000_000


# ---------------------------------------------------------------- granularity rounding to 0

@pytest.mark.parametrize(("args", "field"), [
    ((0, 1e-4, 0, 1), "g_ing"), ((0, 1, 0, 1e-4), "g_del"),
    ((0, Fraction(1, 4096), 0, 1), "g_ing"), ((0, 1, 0, 1e-300), "g_del"),
])
def test_schedule_refuses_granularity_rounding_to_zero(args: tuple, field: str) -> None:
    with pytest.raises(ScheduleError, match=rf"^{field}: .*rounds to 0"):
        Schedule(*args)


def test_schedule_keeps_smallest_representable_granularity() -> None:
    s = Schedule(0, Fraction(1, 1024), 0, 1 / 1024)
    assert s.g_ing == s.g_del == Fraction(1, 1024)


@pytest.mark.parametrize("g", [1e-4, Fraction(1, 4096), 1e-300])
def test_granularity_rounding_to_zero_is_refused(g: float) -> None:
    with pytest.raises(ScheduleError, match="rounds to 0"):
        as_granularity(g)
    with pytest.raises(ConfigError) as info:
        Profile(t_rollout=1, t_update=1, t_ing={g: 1.0, 1: 2.0}, t_del={1: 1.0})
    assert info.value.field == "t_ing"
    with pytest.raises(ConfigError) as info:
        Profile(t_rollout=1, t_update=1, t_ing={1: 1.0}, t_del={g: 1.0})
    assert info.value.field == "t_del"


def test_profile_from_timings_skips_records_rounding_to_zero() -> None:
    from conduit.scheduling import feasible_space, profile_from_timings
    from conduit.timing import Timings

    t = Timings()
    for name in ("rollout", "update"):
        t.record(name, 0.01)
    for name in ("ingestion", "delivery"):
        t.record(name, 0.002, units=1)
        t.record(name, 5.0, units=1e-4)   # not a granularity: ignored, no g = 0 key
    prof = profile_from_timings(t, feasible_space(mode="off_policy", g_max_ing=2, g_max_del=2))
    assert min(prof.t_ing) > 0 and min(prof.t_del) > 0
    assert prof.ing_time(1) == prof.del_time(1) == 0.002


def test_autoscheduler_observe_ignores_records_rounding_to_zero() -> None:
    with ExperienceDataPlane(spec=SPEC, capacity=64, batch_size=4,
                             schedule=Schedule(0, 1, 0, 1)) as plane:
        auto = AutoScheduler(plane=plane, profile=_fit_profile())
        auto.plan()
        plane.timings.record("ingestion", 0.05, units=1e-4)
        plane.timings.record("delivery", 0.05, units=1e-4)
        decision = auto.observe()
        assert not decision.replan
