"""Reviewed defects of the placement and scheduling decisions, each pinned by a test."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from conduit.errors import (
    CapacityError,
    ConduitError,
    ConfigError,
    PlacementError,
    ScheduleError,
    TopologyError,
)
from conduit.placement.migration import PlacementMap, solve_transfer_plan
from conduit.placement.planner import decide, plan_placement
from conduit.placement.presets import preset
from conduit.placement.topology import DeviceInfo, Link, NodeTopology, Topology
from conduit.placement.transfer import Candidate, check_capacity, delivery_terms
from conduit.scheduling.profile import Profile, as_granularity
from conduit.scheduling.space import Schedule, feasible_space
from conduit.scheduling.trial import start_schedule
from conduit.storage.layout import Placement

HUGE = 10**400  # a valid Python (and JSON) integer that no float holds


# -- 1. the start schedule lies in the feasible space ---------------------------------------


@pytest.mark.parametrize("space", [
    feasible_space(mode="off_policy", g_max_ing=1, g_max_del=1),
    feasible_space(mode="off_policy", g_max_ing=3, g_max_del=1),
    feasible_space(mode="off_policy", g_max_ing=1, g_max_del=2),
    feasible_space(mode="off_policy"),
    feasible_space(mode="on_policy", num_minibatches=4),
    feasible_space(mode="on_policy", num_minibatches=4, max_fraction_ing=0.5),
], ids=lambda s: f"{s.mode}-{len(s.g_ing)}x{len(s.g_del)}")
@pytest.mark.parametrize("prioritized", [False, True])
def test_start_schedule_is_feasible(space, prioritized) -> None:
    s = start_schedule(space, prioritized=prioritized)
    space.check(s)  # raises ScheduleError outside the space
    assert s.overlap_ing == 1 and s.overlap_del == int(not prioritized)


def test_start_schedule_off_policy_prefetches_two_when_it_can() -> None:
    assert start_schedule(feasible_space(mode="off_policy")) == Schedule(1, 1, 1, 2)
    assert start_schedule(feasible_space(mode="off_policy", g_max_del=1)) == Schedule(1, 1, 1, 1)


# -- 2. one device or node named twice never doubles Mem(p) ---------------------------------


def test_sharded_placement_naming_a_device_twice_is_refused_by_the_planner() -> None:
    topo = preset("a100-8")
    dup = Placement.sharded(["cuda:0", "cuda:0"])  # a store may simulate shards this way
    with pytest.raises(PlacementError, match="cuda:0"):
        check_capacity(dup, capacity=150_000, x=1_000_000, topology=topo)
    with pytest.raises(PlacementError, match=r"placement\.devices"):
        decide([Candidate(placement=Placement.device("cuda:0")), Candidate(placement=dup)],
               x=1_000_000, capacity=150_000, actor_device="cpu", learner_device="cuda:0",
               topology=topo)


def test_candidate_naming_a_node_twice_is_refused() -> None:
    with pytest.raises(PlacementError, match=r"candidate\.nodes.*node0"):
        Candidate(placement=Placement.device("cuda:0"), nodes=("node0", "node0"))
    with pytest.raises(PlacementError, match="node0"):
        Candidate(placement=Placement.pinned(), nodes=["node0", "node1", "node0"],
                  node_shares=(0.25, 0.5, 0.25))


# -- 3. a remote pageable row is not priced faster than a local one -------------------------


def test_cross_node_path_from_pageable_memory_includes_the_staging_copy() -> None:
    t = preset("a100-8x2")
    stage = t.node("node0").bandwidth("cpu", "cpu_pinned")
    assert stage < t.inter_node_bandwidth  # the preset where the segment matters
    assert t.bandwidth("node0/cpu", "node1/cpu_pinned") == stage
    assert t.bandwidth("node1/cpu_pinned", "node0/cpu") == t.node("node0").bandwidth(
        "cpu_pinned", "cpu")
    assert t.bandwidth("node1/cpu", "node0/cuda:0") <= t.bandwidth("node0/cpu", "node0/cuda:0")
    terms = delivery_terms(Candidate(placement=Placement.pageable(), nodes=("node0", "node1")),
                           x=1_000_000, learner_device="node0/cuda:0", topology=t)
    local, remote = sorted(terms, key=lambda d: not d.local)
    assert local.local and not remote.local
    assert remote.seconds >= local.seconds


def test_cross_node_path_without_pinned_memory_has_no_staging_segment() -> None:
    def node(name: str) -> NodeTopology:
        return NodeTopology(name=name, devices=(DeviceInfo(name="cpu", memory_bytes=10**9),),
                            links=(Link(src="cpu", dst="cpu", bandwidth=1e9),))
    t = Topology(nodes=(node("a"), node("b")), inter_node_bandwidth=5e9)
    assert t.bandwidth("a/cpu", "b/cpu") == 5e9


# -- 4. ints too large for a float get typed errors -----------------------------------------


_JSON = ('{"nodes":[{"name":"n0","devices":[{"name":"cpu","memory_bytes":' + str(HUGE)
         + '}],"links":[]}]}')


@pytest.mark.parametrize(("make", "error", "field"), [
    (lambda: Schedule(0, HUGE, 0, 1), ScheduleError, "g_ing"),
    (lambda: Profile(t_rollout=HUGE, t_update=1, t_ing={1: 1}, t_del={1: 1}), ConfigError,
     "t_rollout"),
    (lambda: Profile(t_rollout=1, t_update=1, t_ing={HUGE: 1}, t_del={1: 1}), ConfigError,
     "t_ing"),
    (lambda: as_granularity(HUGE), ScheduleError, "granularity"),
    (lambda: DeviceInfo(name="cpu", memory_bytes=HUGE), TopologyError, "memory_bytes"),
    (lambda: Link(src="cpu", dst="cpu", bandwidth=HUGE), TopologyError, "bandwidth"),
    (lambda: Topology.from_json(_JSON), TopologyError, "memory_bytes"),
    (lambda: plan_placement(capacity=10, actor_device="cpu", learner_device="cuda:0",
                            topology=preset("a100-8"), spec_bytes=HUGE), ConfigError,
     "spec_bytes"),
    (lambda: plan_placement(capacity=HUGE, actor_device="cpu", learner_device="cuda:0",
                            topology=preset("a100-8"), spec_bytes=4), ConfigError, "capacity"),
    (lambda: solve_transfer_plan([HUGE], [HUGE], [[1e9]]), PlacementError, "source_volumes"),
], ids=["schedule", "profile", "profile-key", "granularity", "device", "link", "json",
        "spec_bytes", "capacity", "transfer-plan"])
def test_huge_ints_get_typed_errors(make, error, field) -> None:
    with pytest.raises(error, match=field) as info:
        make()
    assert isinstance(info.value, ConduitError)


# -- 5. the on-policy cap is never rounded up -----------------------------------------------


def test_max_fraction_cap_is_compared_exactly() -> None:
    with pytest.raises(ConfigError) as info:
        feasible_space(mode="on_policy", num_minibatches=4, max_fraction_ing=0.24999)
    assert info.value.field == "max_fraction_ing"
    space = feasible_space(mode="on_policy", num_minibatches=1000, max_fraction_ing=0.99999)
    assert max(space.g_ing) <= Fraction(0.99999)
    assert max(space.g_ing) == Fraction(999, 1000)
    # a float cap still admits the fraction it is the float of
    assert max(feasible_space(mode="on_policy", num_minibatches=3,
                              max_fraction_ing=1 / 3).g_ing) == Fraction(1, 3)


# -- 6. M(x) equals Alg. 1 at fractional x --------------------------------------------------


def test_map_lookup_at_fractional_x_equals_alg1() -> None:
    topo = Topology.single_node(
        devices=[DeviceInfo(name="cpu", memory_bytes=10**12),
                 DeviceInfo(name="cuda:0", memory_bytes=1_000_500)],
        links=[Link(src="cpu", dst="cpu", bandwidth=1e9),
               Link(src="cpu", dst="cuda:0", bandwidth=1e10),
               Link(src="cuda:0", dst="cuda:0", bandwidth=1e12)])
    kw = dict(capacity=1000, actor_device="cpu", learner_device="cuda:0", topology=topo)
    pm = PlacementMap.build(x_min=512, x_max=4096, **kw)
    assert pm.boundaries == (1001,)
    for x in (1000.4, 1000.5, 1000.9, 600.5, 3000.25):
        assert pm.lookup_candidate(x) == plan_placement(spec_bytes=x, **kw).chosen, x
    assert pm.region(1000.4).candidate == pm.regions[0].candidate
    assert pm.region(1000.6).candidate == pm.regions[1].candidate


# -- 7. the map's sweep range is bounded --------------------------------------------------------


@pytest.mark.parametrize(("kw", "field"), [
    ({"x_max": 2**63}, "x_max"), ({"x_max": 10**30}, "x_max"), ({"x_max": HUGE}, "x_max"),
    ({"x_max": 1000, "points": 100_001}, "points"),
])
def test_map_refuses_a_sweep_it_cannot_represent(kw, field) -> None:
    with pytest.raises(ConfigError) as info:
        PlacementMap.build(capacity=1000, actor_device="cpu", learner_device="cuda:0",
                           topology=preset("a100-8"), **kw)
    assert info.value.field == field


# -- 8. a tiny bandwidth is named, not reported as a capacity problem -------------------------


def test_tiny_bandwidth_error_names_the_link() -> None:
    t = Topology.single_node(devices=[DeviceInfo(name="cpu", memory_bytes=10**12)],
                             links=[Link(src="cpu", dst="cpu", bandwidth=1e-300)])
    with pytest.raises(TopologyError, match=r"links\[cpu->cpu\]\.bandwidth") as info:
        plan_placement(capacity=10, actor_device="cpu", learner_device="cpu", topology=t,
                       spec_bytes=1e10)
    assert not isinstance(info.value, CapacityError)


# -- 10. small refusals name their field --------------------------------------------------------


def test_small_refusals_are_typed() -> None:
    with pytest.raises(ConfigError) as info:
        decide([], x=4, capacity=1, actor_device="cpu", learner_device="cpu",
               topology=preset("a100-8"))
    assert info.value.field == "candidates"
    for m in (0, -1, 2000, 1.5):
        with pytest.raises(ConfigError) as info:
            Schedule.inline(num_minibatches=m)
        assert info.value.field == "num_minibatches"
    with pytest.raises(PlacementError, match=r"^bandwidth:"):
        solve_transfer_plan([1, 1], [1, 1], [[1, 2], [3]])
    with pytest.raises(PlacementError, match=r"^bandwidth:"):
        solve_transfer_plan([1], [1], [["a"]])
    with pytest.raises(PlacementError, match=r"^source_volumes:"):
        solve_transfer_plan(["x"], [1], [[1.0]])
    with pytest.raises(PlacementError, match=r"^sources: expected 1 names.*got 2"):
        solve_transfer_plan([1], [1], np.ones((1, 1)), sources=["a", "b"])
    with pytest.raises(PlacementError, match=r"^targets:"):
        solve_transfer_plan([1], [1], np.ones((1, 1)), targets=[])


@pytest.mark.parametrize("nodes", [2.5, "2", True, 0])
def test_a100_preset_node_count_must_be_a_positive_integer(nodes):
    from conduit.placement.presets import a100_8

    with pytest.raises(ConfigError) as info:
        a100_8(nodes=nodes)
    assert info.value.field == "nodes"
