"""App. D: Eq. 3 transfer plans and the placement map (Alg. 2 decisions, Fig. 13 trace)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conduit.errors import CapacityError, ConfigError, PlacementError
from conduit.placement import (
    PlacementMap,
    check_capacity,
    migration_steps,
    plan_placement,
    preset,
    rows_per_device,
    rows_per_endpoint,
    solve_transfer_plan,
    transfer_plan,
)
from conduit.storage.layout import Placement

A100 = preset("a100-8")
C_BUF = 10**6


def transition_bytes(d: int) -> int:
    """obs + next_obs float32 of dim d, int64 action, float32 reward, bool done."""
    return 8 * d + 8 + 4 + 1


# -- Eq. 3 ---------------------------------------------------------------------------------------


def brute_force_makespan(v, w, bw, steps: int = 400) -> float:
    """Minimum makespan over a fine grid of the free flow variables (2 x n, n in {2, 3})."""
    v, w, bw = np.asarray(v, float), np.asarray(w, float), np.asarray(bw, float)
    n = w.size
    if n == 2:
        a = np.linspace(0, min(v[0], w[0]), steps * 10 + 1)
        f = np.stack([a, v[0] - a, w[0] - a, w[1] - (v[0] - a)], axis=1)
        ok = np.all(f >= -1e-9, axis=1)
        t = np.max(f / bw.reshape(-1), axis=1)
        return float(t[ok].min())
    a = np.linspace(0, min(v[0], w[0]), steps + 1)[:, None]
    b = np.linspace(0, min(v[0], w[1]), steps + 1)[None, :]
    f11, f12 = np.broadcast_arrays(a, b)
    f13 = v[0] - f11 - f12
    f = np.stack([f11, f12, f13, w[0] - f11, w[1] - f12, w[2] - f13], axis=-1)
    ok = np.all(f >= -1e-9, axis=-1)
    t = np.max(f / bw.reshape(-1), axis=-1)
    return float(t[ok].min())


def check_feasible(plan, v, w) -> None:
    f = plan.matrix()
    assert np.all(f >= -1e-9)
    np.testing.assert_allclose(f.sum(axis=1), v, rtol=1e-7, atol=1e-6)
    np.testing.assert_allclose(f.sum(axis=0), w, rtol=1e-7, atol=1e-6)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n", [2, 3])
def test_lp_matches_brute_force(seed: int, n: int) -> None:
    rng = np.random.default_rng(seed * 10 + n)
    v = rng.integers(1, 10, size=2).astype(float)
    w = rng.multinomial(int(v.sum()) - n, [1 / n] * n).astype(float) + 1
    bw = rng.choice([1.0, 2.0, 4.0, 5.0, 10.0], size=(2, n))
    plan = solve_transfer_plan(v, w, bw)
    check_feasible(plan, v, w)
    brute = brute_force_makespan(v, w, bw)
    grid_step = max(v) / (4000 if n == 2 else 400)
    assert plan.makespan_s <= brute + 1e-7          # LP is at least as good as any grid point
    assert brute <= plan.makespan_s + grid_step / bw.min() + 1e-9   # and the grid gets close
    recomputed = max(f / b for f, b in zip(plan.matrix().reshape(-1), bw.reshape(-1)))
    assert plan.makespan_s == pytest.approx(recomputed)


def test_lp_known_small_instance() -> None:
    plan = solve_transfer_plan([3, 5], [4, 4], [[1, 2], [3, 4]])
    assert plan.makespan_s == pytest.approx(1.0)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=4),
       st.integers(1, 4), st.integers(0, 10**6))
def test_lp_beats_proportional_plan(v, n, seed) -> None:
    rng = np.random.default_rng(seed)
    v = np.array(v, float)
    w = rng.dirichlet(np.ones(n)) * v.sum()
    bw = rng.uniform(1.0, 100.0, size=(v.size, n))
    plan = solve_transfer_plan(v, w, bw)
    check_feasible(plan, v, w)
    prop = np.outer(v, w) / v.sum()
    assert plan.makespan_s <= float(np.max(prop / bw)) * (1 + 1e-6) + 1e-12


def test_lp_large_byte_volumes_and_free_local_flows() -> None:
    # Volumes in the tens of GB, bandwidths in the 100s of GB/s; cuda:0 keeps its part.
    src = {"cuda:0": 40e9}
    dst = {"cuda:0": 20e9, "cuda:1": 20e9}
    plan = transfer_plan(src, dst, topology=A100)
    assert plan.makespan_s == pytest.approx(20e9 / 300e9, rel=1e-6)
    moves = {(s, d): f for s, d, f in plan.transfers()}
    assert moves[("cuda:0", "cuda:1")] == pytest.approx(20e9, rel=1e-6)
    # with the topology's own local bandwidth the local flow costs time too
    plan2 = transfer_plan(src, dst, topology=A100, local_bandwidth=None)
    assert plan2.makespan_s >= plan.makespan_s - 1e-12


def test_lp_zero_bandwidth_means_no_path() -> None:
    plan = solve_transfer_plan([5, 5], [5, 5], [[0, 1], [1, 0]])
    np.testing.assert_allclose(plan.matrix(), [[0, 5], [5, 0]], atol=1e-6)
    with pytest.raises(PlacementError, match="no feasible plan"):
        solve_transfer_plan([5, 5], [10, 0], [[0, 1], [0, 1]])


@pytest.mark.parametrize("slow", [1e-3, 1e-300])
def test_lp_bandwidths_too_far_apart_are_refused_by_name(slow) -> None:
    """Beyond the span the solver weighs, HiGHS rejected the model (reported as "no feasible
    plan", though the slow path makes one) or a coefficient overflowed (a raw ValueError)."""
    with pytest.raises(PlacementError, match="bandwidth: positive finite bandwidths span"):
        solve_transfer_plan([5, 5], [2, 8], [[1e12, slow], [slow, 1e12]])


def test_lp_bandwidths_within_the_span_use_the_slow_path_when_they_must() -> None:
    plan = solve_transfer_plan([5, 5], [2, 8], [[1e12, 1.0], [1.0, 1e12]])
    np.testing.assert_allclose(plan.matrix(), [[2, 3], [0, 5]], atol=1e-6)
    assert plan.makespan_s == pytest.approx(3.0)


def test_lp_bad_inputs() -> None:
    with pytest.raises(PlacementError, match="sum V must equal"):
        solve_transfer_plan([1, 2], [4], [[1], [1]])
    with pytest.raises(PlacementError, match="source_volumes"):
        solve_transfer_plan([-1, 2], [1], [[1], [1]])
    with pytest.raises(PlacementError, match="shape"):
        solve_transfer_plan([1, 2], [3], [[1, 1]])
    with pytest.raises(PlacementError, match="target_volumes"):
        transfer_plan({"cuda:0": 1.0}, {"cuda:12": 1.0}, topology=A100)
    zero = solve_transfer_plan([0, 0], [0], [[1], [1]])
    assert zero.makespan_s == 0


# -- volumes -------------------------------------------------------------------------------------


def test_rows_per_device_sums_to_capacity() -> None:
    p = Placement.sharded(["cuda:0", "cuda:1", "cuda:2"])
    rows = rows_per_device(p, 10)
    assert sum(rows.values()) == 10 and sorted(rows.values()) == [3, 3, 4]
    assert rows_per_device(Placement.pinned(), 7) == {"cpu": 7}
    assert rows_per_endpoint(Placement.pinned(), 7, A100) == {"cpu_pinned": 7}
    skew = Placement.sharded(["cuda:0", "cuda:1"], shares=(0.9, 0.1))
    assert rows_per_device(skew, 1001) == {"cuda:0": 901, "cuda:1": 100}
    with pytest.raises(ConfigError) as ei:
        rows_per_device(p, -1)
    assert ei.value.field == "capacity"


# -- placement map -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def a100_map() -> PlacementMap:
    return PlacementMap.build(capacity=C_BUF, actor_device="cpu", learner_device="cuda:0",
                              topology=A100, x_min=transition_bytes(128),
                              x_max=transition_bytes(20000))


def test_map_regions_and_exact_capacity_boundaries(a100_map: PlacementMap) -> None:
    regions = a100_map.regions
    labels = [r.candidate.label() for r in regions]
    assert labels == ["device[cuda:0]", "sharded[cuda:0,cuda:1]",
                      "sharded[cuda:0,cuda:1,cuda:2]"]
    mem = A100.memory("cuda:0")
    for r in regions[:-1]:
        # the region ends exactly where its placement stops fitting
        boundary = math.floor(check_capacity(r.candidate, capacity=C_BUF, x=1,
                                             topology=A100).available_bytes / C_BUF)
        assert r.x_hi == boundary
    assert regions[0].x_hi == mem // C_BUF
    for a, b in itertools.pairwise(regions):
        assert b.x_lo == a.x_hi + 1
        assert a100_map.lookup(a.x_hi) == a.placement
        assert a100_map.lookup(b.x_lo) == b.placement
    assert a100_map.boundaries == tuple(r.x_lo for r in regions[1:])
    assert "placement map" in a100_map.describe()


@settings(max_examples=40, deadline=None)
@given(x=st.integers(transition_bytes(128), transition_bytes(20000)))
def test_map_lookup_equals_direct_solve(a100_map: PlacementMap, x: int) -> None:
    direct = plan_placement(spec_bytes=x, capacity=C_BUF, actor_device="cpu",
                            learner_device="cuda:0", topology=A100)
    assert a100_map.lookup(x) == direct.placement


def test_fig13_growth_trace_migrates_exactly_at_capacity_boundaries(
        a100_map: PlacementMap) -> None:
    # 40 iterations, d = 128 -> 20000 as in Fig. 13
    dims = [128] * 8 + [1000] * 8 + [5000] * 8 + [10000] * 8 + [20000] * 8
    xs = [transition_bytes(d) for d in dims]
    steps = migration_steps(a100_map, xs)
    active = a100_map.lookup_candidate(xs[0])
    expected = []
    for k, x in enumerate(xs):
        if not check_capacity(active, capacity=C_BUF, x=x, topology=A100).fits:
            new = plan_placement(spec_bytes=x, capacity=C_BUF, actor_device="cpu",
                                 learner_device="cuda:0", topology=A100).chosen
            expected.append((k, active, new))
            active = new
    assert [(s.step, s.source, s.target) for s in steps] == expected
    assert [s.step for s in steps] == [24, 32]  # two replacements: d = 10000 and d = 20000
    assert steps[0].source.placement == Placement.device("cuda:0")
    assert steps[0].target.placement.kind == "sharded"
    for s in steps:
        assert s.plan.makespan_s > 0
        assert s.plan.total_bytes == pytest.approx(C_BUF * xs[s.step - 1])


def test_precomputed_plans_between_consecutive_regions(a100_map: PlacementMap) -> None:
    r0, r1 = a100_map.regions[0], a100_map.regions[1]
    plan = a100_map.plan_between(r0.placement, r1.placement)
    assert plan is a100_map.plans[(0, 1)]
    total = C_BUF * r0.x_hi
    assert plan.total_bytes == pytest.approx(total)
    # half stays on cuda:0 (free), half moves to cuda:1 over NVLink
    assert plan.makespan_s == pytest.approx(total / 2 / 300e9, rel=1e-6)
    vols = rows_per_endpoint(r0.placement, 1000, A100)
    custom = a100_map.plan_between(r0.placement, r1.placement,
                                   {k: v * 64.0 for k, v in vols.items()})
    assert custom.total_bytes == pytest.approx(64_000)
    with pytest.raises(PlacementError, match="volumes"):
        a100_map.plan_between(r0.placement, r1.placement, {"cuda:5": 10.0})


def test_map_beyond_feasible_and_out_of_range() -> None:
    m = PlacementMap.build(capacity=C_BUF, actor_device="cpu", learner_device="cuda:0",
                           topology=A100, allowed_kinds=["device", "sharded"], x_min=512,
                           x_max=2_000_000, points=24)
    assert m.x_feasible_max == 8 * A100.memory("cuda:0") // C_BUF
    with pytest.raises(CapacityError) as ei:
        m.lookup(m.x_feasible_max + 1)
    assert ei.value.needed == pytest.approx(C_BUF * (m.x_feasible_max + 1))
    assert m.lookup(100) == Placement.device("cuda:0")  # below range: solved directly
    with pytest.raises(ConfigError):
        m.region(10)


def test_map_bad_inputs() -> None:
    base = {"capacity": C_BUF, "actor_device": "cpu", "learner_device": "cuda:0",
            "topology": A100}
    with pytest.raises(ConfigError) as ei:
        PlacementMap.build(**base, x_min=-1)
    assert ei.value.field == "x_min"
    with pytest.raises(ConfigError) as ei:
        PlacementMap.build(**base, x_min=100, x_max=10)
    assert ei.value.field == "x_max"
    with pytest.raises(ConfigError) as ei:
        PlacementMap.build(**{**base, "learner_device": "cuda:77"})
    assert ei.value.field == "learner_device"
    with pytest.raises(CapacityError):
        PlacementMap.build(**base, x_min=10**7, x_max=10**8, points=4)


def test_map_with_pinned_to_device_migration() -> None:
    m = PlacementMap.build(capacity=C_BUF, actor_device="cpu", learner_device="cuda:0",
                           topology=A100, devices=["cuda:0"], x_min=512,
                           x_max=200_000, points=16)
    kinds = [r.placement.kind for r in m.regions]
    assert kinds == ["device", "pinned"]
    plan = m.plans[(0, 1)]
    assert plan.sources == ("cuda:0",) and plan.targets == ("cpu_pinned",)
    assert plan.makespan_s == pytest.approx(plan.total_bytes / A100.bandwidth("cuda:0",
                                                                              "cpu_pinned"))


def test_multi_node_map_plans_use_qualified_endpoints() -> None:
    t = preset("a100-8x2")
    m = PlacementMap.build(capacity=C_BUF, actor_device="cpu", learner_device="cuda:0",
                           topology=t, x_min=512, x_max=transition_bytes(20000), points=16)
    assert all(len(r.candidate.nodes) == 2 for r in m.regions)
    plan = m.plans[(0, 1)]
    assert all("/" in e for e in plan.sources + plan.targets)
