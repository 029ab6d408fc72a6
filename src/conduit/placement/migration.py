"""Online placement migration decisions (paper §5.3, App. D: Alg. 2, Eq. 3).

Two pieces, both pure:

* :func:`solve_transfer_plan` / :func:`transfer_plan`: Eq. 3, the min-makespan transfer plan
  between a source placement (volume ``V_i`` on device ``d_i``) and a target placement (volume
  ``V'_j`` on ``d'_j``)::

      min_{f_ij >= 0}  max_ij f_ij / BW(d_i -> d'_j)
      s.t.  sum_j f_ij = V_i,   sum_i f_ij = V'_j

  solved as a linear program with an epigraph variable ``t`` (``f_ij / BW_ij <= t``, minimize
  ``t``) by scipy's HiGHS. Transfers run in parallel on dedicated streams, so the makespan is
  the slowest single transfer.

* :class:`PlacementMap`: Alg. 1 pre-solved over a range of per-sample sizes ``x``, giving
  regions ``[x_lo, x_hi] -> placement`` with exact integer boundaries, an ``O(log R)``
  :meth:`PlacementMap.lookup`, and pre-computed transfer plans between consecutive regions.
  :func:`migration_steps` replays a growth trace (Alg. 2 without the pause/move/resume, which
  the plane executes).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from conduit.errors import CapacityError, ConfigError, PlacementError
from conduit.placement.planner import (
    _check_capacity,
    _check_x,
    candidate_set,
    evaluate,
    plan_placement,
    scan,
)
from conduit.placement.topology import Topology
from conduit.placement.transfer import (
    Candidate,
    check_capacity,
    check_endpoint,
    endpoint_shares,
)
from conduit.storage.layout import Placement, split_rows

# -- Eq. 3 ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TransferPlan:
    """A migration transfer plan: how many bytes each source sends to each target.

    Attributes:
        sources: Source endpoints ``d_i``.
        targets: Target endpoints ``d'_j``.
        source_volumes: ``V_i`` (bytes).
        target_volumes: ``V'_j`` (bytes).
        flows: ``f_ij`` (bytes), one row per source.
        makespan_s: ``max_ij f_ij / BW(d_i -> d'_j)`` in seconds.
    """

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    source_volumes: tuple[float, ...]
    target_volumes: tuple[float, ...]
    flows: tuple[tuple[float, ...], ...]
    makespan_s: float

    def matrix(self) -> np.ndarray:
        """``f`` as a ``(len(sources), len(targets))`` array."""
        return np.array(self.flows, dtype=np.float64).reshape(len(self.sources),
                                                              len(self.targets))

    def transfers(self, *, min_bytes: float = 0.5) -> tuple[tuple[str, str, float], ...]:
        """Non-trivial transfers ``(src, dst, bytes)`` with ``f_ij >= min_bytes``."""
        return tuple((s, d, f) for s, row in zip(self.sources, self.flows)
                     for d, f in zip(self.targets, row) if f >= min_bytes)

    @property
    def total_bytes(self) -> float:
        """Bytes moved in total (``sum V_i``)."""
        return float(sum(self.source_volumes))


def _float_array(name: str, values: object) -> np.ndarray:
    """``values`` as a float64 array (a ragged or non-numeric input, or an int too large for a
    float, is a :class:`PlacementError` naming ``name``)."""
    try:
        return np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise PlacementError(f"{name}: must be a rectangular array of finite numbers, got "
                             f"{values!r} ({exc})") from None


BANDWIDTH_SPAN = 1e12
"""Largest ratio between two positive finite bandwidths :func:`solve_transfer_plan` takes
(NVLink next to a 1 Gb/s network is about 3e3)."""


def solve_transfer_plan(source_volumes: Sequence[float], target_volumes: Sequence[float],
                        bandwidth: Sequence[Sequence[float]] | np.ndarray, *,
                        sources: Sequence[str] | None = None,
                        targets: Sequence[str] | None = None) -> TransferPlan:
    """Solve Eq. 3 on plain arrays.

    Args:
        source_volumes: ``V_i >= 0``.
        target_volumes: ``V'_j >= 0`` with ``sum V' == sum V``.
        bandwidth: ``BW[i][j]`` in bytes/s; ``inf`` means free (no constraint, e.g. data that
            stays on its device), ``0`` means no path (``f_ij`` forced to 0).
        sources: Names for the rows (default ``"s0"``...).
        targets: Names for the columns (default ``"t0"``...).

    Returns:
        The optimal plan.

    Raises:
        PlacementError: Non-numeric, ragged or negative volumes or bandwidths (an int too
            large for a float included), positive finite bandwidths that span more than
            :data:`BANDWIDTH_SPAN` (field ``bandwidth``), mismatched totals, shapes or name
            counts, or no feasible plan (some volume has no path).
    """
    v = _float_array("source_volumes", source_volumes).reshape(-1)
    w = _float_array("target_volumes", target_volumes).reshape(-1)
    bw = _float_array("bandwidth", bandwidth)
    m, n = v.size, w.size
    src = tuple(sources) if sources is not None else tuple(f"s{i}" for i in range(m))
    dst = tuple(targets) if targets is not None else tuple(f"t{j}" for j in range(n))
    if bw.shape != (m, n):
        raise PlacementError(f"bandwidth: expected shape ({m}, {n}) matching the volumes, "
                             f"got {bw.shape}")
    for name, names, k in (("sources", src, m), ("targets", dst, n)):
        if len(names) != k:
            raise PlacementError(f"{name}: expected {k} names, one per volume, got "
                                 f"{len(names)}")
    if m == 0 or n == 0:
        raise PlacementError("volumes: need at least one source and one target")
    if np.any(~np.isfinite(v)) or np.any(v < 0):
        raise PlacementError(f"source_volumes: must be finite and non-negative, got {v.tolist()}")
    if np.any(~np.isfinite(w)) or np.any(w < 0):
        raise PlacementError(f"target_volumes: must be finite and non-negative, got {w.tolist()}")
    if np.any(np.isnan(bw)) or np.any(bw < 0):
        raise PlacementError("bandwidth: must be non-negative (inf for free, 0 for no path)")
    with np.errstate(over="ignore"):
        total, total_w = float(v.sum()), float(w.sum())
    if not (math.isfinite(total) and math.isfinite(total_w)):
        raise PlacementError(f"volumes: sum to more bytes than a float holds ({total}); give "
                             f"them in bytes")
    if abs(total - float(w.sum())) > 1e-9 * max(total, float(w.sum()), 1.0):
        raise PlacementError(f"volumes: sources hold {total:,.0f} B but targets need "
                             f"{float(w.sum()):,.0f} B (sum V must equal sum V')")

    def done(f: np.ndarray) -> TransferPlan:
        with np.errstate(divide="ignore", invalid="ignore"):
            times = np.where(f > 0, f / bw, 0.0)
        return TransferPlan(sources=src, targets=dst, source_volumes=tuple(v.tolist()),
                            target_volumes=tuple(w.tolist()),
                            flows=tuple(tuple(r) for r in f.tolist()),
                            makespan_s=float(times.max(initial=0.0)))

    if total == 0:
        return done(np.zeros((m, n)))

    from scipy.optimize import linprog

    # Scale to O(1): volumes as fractions of the total, bandwidths relative to the largest
    # finite one, so HiGHS's absolute tolerances mean the same thing at any size.
    finite = bw[np.isfinite(bw) & (bw > 0)]
    bscale = float(finite.max()) if finite.size else 1.0
    if finite.size and bscale > BANDWIDTH_SPAN * float(finite.min()):
        # Beyond it HiGHS rejects the model (or a coefficient overflows), which would read as
        # "no path" where there is one.
        raise PlacementError(f"bandwidth: positive finite bandwidths span {float(finite.min()):.3g}"
                             f" to {bscale:.3g} B/s, more than the {BANDWIDTH_SPAN:.0e} the "
                             f"linear program weighs together; give a path that slow 0 (no "
                             f"path)")
    vs, ws = v / total, w / total
    nf = m * n
    c = np.zeros(nf + 1)
    c[-1] = 1.0
    a_ub, b_ub = [], []
    bounds: list[tuple[float, float | None]] = []
    for i in range(m):
        for j in range(n):
            b = bw[i, j]
            if b == 0:
                bounds.append((0.0, 0.0))
                continue
            bounds.append((0.0, None))
            if math.isfinite(b):
                row = np.zeros(nf + 1)
                row[i * n + j] = bscale / b
                row[-1] = -1.0
                a_ub.append(row)
                b_ub.append(0.0)
    bounds.append((0.0, None))
    a_eq = np.zeros((m + n, nf + 1))
    for i in range(m):
        a_eq[i, i * n:(i + 1) * n] = 1.0
    for j in range(n):
        a_eq[m + j, j:nf:n] = 1.0
    b_eq = np.concatenate([vs, ws])
    res = linprog(c, A_ub=np.array(a_ub) if a_ub else None, b_ub=np.array(b_ub) if b_ub else None,
                  A_eq=a_eq, b_eq=b_eq, bounds=bounds, method="highs")
    if res.status != 0:
        raise PlacementError(f"transfer plan: no feasible plan ({res.message}); some volume "
                             f"has no path to a target")
    f = np.clip(res.x[:nf].reshape(m, n), 0.0, None) * total
    return done(f)


def transfer_plan(source_volumes: Mapping[str, float], target_volumes: Mapping[str, float], *,
                  topology: Topology, local_bandwidth: float | None = math.inf) -> TransferPlan:
    """Eq. 3 between named endpoints, bandwidths from ``topology``.

    Args:
        source_volumes: Endpoint (global name) -> bytes held now.
        target_volumes: Endpoint -> bytes it must hold afterwards.
        topology: Bandwidth table.
        local_bandwidth: Bandwidth of a flow that stays on its endpoint; ``inf`` (default)
            treats it as free, ``None`` uses the topology's ``(d, d)`` entry.

    Raises:
        PlacementError: Unknown endpoints or mismatched totals.
    """
    srcs, dsts = list(source_volumes), list(target_volumes)
    for what, names in (("source_volumes", srcs), ("target_volumes", dsts)):
        for e in names:
            if not topology.has(e):
                raise PlacementError(f"{what}: {e!r} is not a device of the topology")
    bw = np.empty((len(srcs), len(dsts)))
    for i, s in enumerate(srcs):
        for j, d in enumerate(dsts):
            same = topology.resolve(s) == topology.resolve(d)
            bw[i, j] = (local_bandwidth if same and local_bandwidth is not None
                        else topology.bandwidth(s, d))
    return solve_transfer_plan([source_volumes[s] for s in srcs],
                               [target_volumes[d] for d in dsts], bw, sources=srcs, targets=dsts)


# -- volumes ---------------------------------------------------------------------------------------


def rows_per_device(placement: Placement, capacity: int) -> dict[str, int]:
    """Rows of a ``capacity``-row buffer on each device of ``placement`` (storage's names).

    Sharded placements split by their shares with largest-remainder rounding, so the rows sum
    exactly to ``capacity``.

    Raises:
        ConfigError: ``capacity`` is negative.
    """
    _check_capacity(capacity)
    if placement.kind != "sharded":
        return {placement.devices[0]: capacity}
    return dict(zip(placement.devices, split_rows(capacity, placement.shares)))


def rows_per_endpoint(p: Placement | Candidate, capacity: int,
                      topology: Topology) -> dict[str, int]:
    """Like :func:`rows_per_device` but keyed by global endpoint (``"cpu_pinned"``,
    ``"node1/cuda:0"``), as the transfer plans are."""
    _check_capacity(capacity)
    shares = endpoint_shares(p, topology)
    return dict(zip((e for e, _ in shares), split_rows(capacity, [s for _, s in shares])))


def volumes_for(p: Placement | Candidate, total_bytes: float,
                topology: Topology) -> dict[str, float]:
    """Bytes on each endpoint when ``p`` holds ``total_bytes`` (proportional to its shares)."""
    return {e: total_bytes * s for e, s in endpoint_shares(p, topology)}


# -- placement map -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PlacementRegion:
    """A range of per-sample sizes with one placement.

    Attributes:
        x_lo: Smallest per-sample size (bytes, inclusive).
        x_hi: Largest per-sample size (bytes, inclusive).
        candidate: The placement Alg. 1 picks throughout the range.
        time_per_byte_s: Predicted ``T_transfer / x`` (the model is linear in ``x``).
    """

    x_lo: int
    x_hi: int
    candidate: Candidate
    time_per_byte_s: float

    @property
    def placement(self) -> Placement:
        """The per-node placement."""
        return self.candidate.placement


MAX_MAP_BYTES = 2**53
"""Largest ``x_max`` :meth:`PlacementMap.build` sweeps (every integer up to it is a float)."""
MAX_MAP_POINTS = 100_000
"""Largest ``points`` :meth:`PlacementMap.build` takes (each is one Alg. 1 solve)."""


@dataclass(frozen=True, kw_only=True)
class PlacementMap:
    """Alg. 1 pre-solved over per-sample sizes, with pre-computed migration plans (App. D).

    Build with :meth:`build`. Regions are contiguous and sorted; beyond the last region no
    candidate fits (up to ``x_max``).

    Attributes:
        regions: The regions, by increasing ``x``.
        capacity: ``C_buf`` in rows.
        actor_device: Where rollouts are produced.
        learner_device: Where batches are consumed.
        topology: The topology the map was solved on.
        x_min: Smallest size solved.
        x_max: Largest size solved.
        plans: Transfer plan from region ``i`` to ``i + 1`` (a full buffer at region ``i``'s
            largest size), keyed by ``(i, i + 1)``.
    """

    regions: tuple[PlacementRegion, ...]
    capacity: int
    actor_device: str
    learner_device: str
    topology: Topology
    x_min: int
    x_max: int
    plans: Mapping[tuple[int, int], TransferPlan] = field(default_factory=dict)
    restrict: Mapping[str, object] = field(default_factory=dict)
    _his: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_his", tuple(r.x_hi for r in self.regions))

    @classmethod
    def build(cls, *, capacity: int, actor_device: str, learner_device: str,
              topology: Topology, x_min: int = 128 * 4, x_max: int = 20000 * 4,
              points: int = 48, allowed_kinds: Iterable[str] | None = None,
              devices: Sequence[str] | None = None, nodes: Sequence[str] | None = None,
              local_bandwidth: float | None = math.inf) -> PlacementMap:
        """Sweep log-spaced sizes in ``[x_min, x_max]``, solve Alg. 1 at each, and refine every
        change to its exact integer boundary by bisection.

        Args:
            capacity: ``C_buf`` in rows.
            actor_device: Where rollouts are produced.
            learner_device: Where batches are consumed.
            topology: Devices and bandwidths.
            x_min: Smallest per-sample size in bytes (default 128 float32 values).
            x_max: Largest per-sample size in bytes (default 20,000 float32 values), at most
                :data:`MAX_MAP_BYTES`.
            points: Number of log-spaced sizes in the sweep, at most :data:`MAX_MAP_POINTS`
                (the boundaries are exact whatever their number: bisection refines them).
            allowed_kinds: Candidate restriction (see :func:`plan_placement`).
            devices: Candidate restriction.
            nodes: Candidate restriction.
            local_bandwidth: Passed to :func:`transfer_plan` for the pre-computed plans.

        Raises:
            ConfigError: Bad sizes (``x_max`` above :data:`MAX_MAP_BYTES` included),
                ``points``, capacity, devices.
            CapacityError: Nothing fits even at ``x_min``.
        """
        _check_capacity(capacity)
        for name, val in (("x_min", x_min), ("x_max", x_max)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ConfigError(name, f"must be a positive integer number of bytes, "
                                        f"got {val!r}")
        if x_max < x_min:
            raise ConfigError("x_max", f"must be >= x_min ({x_min}), got {x_max}")
        if x_max > MAX_MAP_BYTES:
            raise ConfigError("x_max", f"must be at most {MAX_MAP_BYTES:,} B (2**53, the "
                                       f"largest size every float holds exactly), got "
                                       f"about 2**{x_max.bit_length() - 1}; sweep a smaller range")
        if (isinstance(points, bool) or not isinstance(points, int)
                or not 2 <= points <= MAX_MAP_POINTS):
            raise ConfigError("points", f"must be an integer from 2 to {MAX_MAP_POINTS:,}, "
                                        f"got {points!r}")
        check_endpoint(topology, actor_device, "actor_device")
        check_endpoint(topology, learner_device, "learner_device")
        cands = candidate_set(topology=topology, learner_device=learner_device,
                              allowed_kinds=allowed_kinds, devices=devices, nodes=nodes)
        memo: dict[int, Candidate | None] = {}

        def best(x: int) -> Candidate | None:
            if x not in memo:
                e = scan(evaluate(cands, x=x, capacity=capacity, actor_device=actor_device,
                                  learner_device=learner_device, topology=topology))
                memo[x] = None if e is None else e.candidate
            return memo[x]

        grid = sorted(set(np.rint(np.geomspace(x_min, x_max, points)).astype(int).tolist())
                      | {x_min, x_max})
        cur = best(grid[0])
        if cur is None:
            # Raise the planner's CapacityError with its numbers.
            plan_placement(spec_bytes=grid[0], capacity=capacity, actor_device=actor_device,
                           learner_device=learner_device, topology=topology,
                           allowed_kinds=allowed_kinds, devices=devices, nodes=nodes)
        spans: list[tuple[int, int, Candidate]] = []
        lo = prev = grid[0]
        for g in grid[1:]:
            while cur is not None and best(g) != cur:
                a, c = prev, g          # best(a) == cur != best(c)
                while c - a > 1:
                    mid = (a + c) // 2
                    if best(mid) == cur:
                        a = mid
                    else:
                        c = mid
                spans.append((lo, a, cur))
                cur, lo, prev = best(c), c, c
            if cur is None:
                break
            prev = g
        if cur is not None:
            spans.append((lo, grid[-1], cur))
        regions = []
        for lo_, hi_, cand in spans:
            t = scan(evaluate([cand], x=hi_, capacity=0, actor_device=actor_device,
                              learner_device=learner_device, topology=topology))
            regions.append(PlacementRegion(x_lo=lo_, x_hi=hi_, candidate=cand,
                                           time_per_byte_s=t.time_s / hi_))
        plans = {}
        for i in range(len(regions) - 1):
            total = float(capacity) * regions[i].x_hi
            plans[(i, i + 1)] = transfer_plan(
                volumes_for(regions[i].candidate, total, topology),
                volumes_for(regions[i + 1].candidate, total, topology),
                topology=topology, local_bandwidth=local_bandwidth)
        restrict = {"allowed_kinds": None if allowed_kinds is None else tuple(allowed_kinds),
                    "devices": None if devices is None else tuple(devices),
                    "nodes": None if nodes is None else tuple(nodes),
                    "local_bandwidth": local_bandwidth}
        return cls(regions=tuple(regions), capacity=capacity, actor_device=actor_device,
                   learner_device=learner_device, topology=topology, x_min=x_min, x_max=x_max,
                   plans=plans, restrict=restrict)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """Sizes at which the placement changes: the ``x_lo`` of every region but the first."""
        return tuple(r.x_lo for r in self.regions[1:])

    @property
    def x_feasible_max(self) -> int:
        """Largest size (within ``[x_min, x_max]``) at which some candidate fits."""
        return self.regions[-1].x_hi

    def region_index(self, x: float) -> int:
        """Index of the region holding ``x`` (``O(log R)``).

        Regions have integer bounds. A fractional ``x`` between one region's ``x_hi`` and the
        next region's ``x_lo`` belongs to the lower region while its candidate still fits at
        ``x`` (then it is Alg. 1's choice at ``x``: every faster candidate already failed to
        fit at the smaller ``x_hi``), else to the upper one.

        Raises:
            ConfigError: ``x`` is not positive or lies outside ``[x_min, x_max]``.
            CapacityError: ``x`` is in range but nothing fits there.
        """
        k = self._floor_index(x)
        if k < len(self.regions) and self._in_gap(k, x):
            k += 1  # the lower region's candidate no longer fits at x
        if k >= len(self.regions):
            needed = float(self.capacity) * x
            avail = max(self.topology.memory(e) / s
                        for r in self.regions[-1:]
                        for e, s in endpoint_shares(r.candidate, self.topology) if s > 0)
            raise CapacityError(f"placement map: x = {x:,.0f} B needs {needed / 1e9:,.2f} GB; "
                                f"no placement fits beyond x = {self.x_feasible_max:,} B",
                                needed=needed, available=avail)
        return k

    def _floor_index(self, x: float) -> int:
        """Index of the region holding ``floor(x)`` (``len(regions)`` past the last)."""
        _check_x(x)
        if x < self.x_min or x > self.x_max:
            raise ConfigError("x", f"{x} B is outside the map's range [{self.x_min}, "
                                   f"{self.x_max}]")
        return bisect.bisect_left(self._his, math.floor(x))

    def _in_gap(self, k: int, x: float) -> bool:
        """Whether ``x`` lies past region ``k``'s ``x_hi`` where its candidate no longer fits
        (only a fractional ``x`` can: the next integer starts the next region)."""
        return x > self._his[k] and not check_capacity(
            self.regions[k].candidate, capacity=self.capacity, x=x, topology=self.topology).fits

    def region(self, x: float) -> PlacementRegion:
        """The region holding ``x`` (see :meth:`region_index`)."""
        return self.regions[self.region_index(x)]

    def lookup_candidate(self, x: float) -> Candidate:
        """``M(x)`` as a candidate: Alg. 1's choice at ``x``. Outside ``[x_min, x_max]``, and
        for a fractional ``x`` between two regions where the lower one's candidate no longer
        fits (the choice there may be neither region's), Alg. 1 is solved directly."""
        gap = False
        if self.x_min <= x <= self.x_max:
            k = self._floor_index(x)
            gap = k < len(self.regions) and self._in_gap(k, x)
        if gap or x < self.x_min or x > self.x_max:
            _check_x(x)
            r = self.restrict
            return plan_placement(spec_bytes=x, capacity=self.capacity,
                                  actor_device=self.actor_device,
                                  learner_device=self.learner_device, topology=self.topology,
                                  allowed_kinds=r.get("allowed_kinds"), devices=r.get("devices"),
                                  nodes=r.get("nodes")).chosen
        return self.region(x).candidate

    def lookup(self, x: float) -> Placement:
        """``M(x)``: the placement for per-sample size ``x`` (``O(log R)`` inside the range;
        see :meth:`lookup_candidate`).

        Raises:
            CapacityError: Nothing fits at ``x``.
        """
        return self.lookup_candidate(x).placement

    def plan_between(self, p: Placement | Candidate, p_new: Placement | Candidate,
                     volumes: Mapping[str, float] | None = None) -> TransferPlan:
        """Transfer plan from ``p`` to ``p_new``.

        Args:
            p: Current placement.
            p_new: Target placement.
            volumes: Bytes held now on each endpoint of ``p`` (global endpoint names, as
                :func:`rows_per_endpoint` gives). Default: a full buffer at the largest size of
                ``p``'s region, which for consecutive regions is the pre-computed plan.

        Returns:
            The plan; targets receive the same total, split by ``p_new``'s shares.

        Raises:
            PlacementError: ``p`` is not in the map and no volumes are given, or the volumes
                name endpoints ``p`` does not occupy.
        """
        c, c_new = Candidate.of(p), Candidate.of(p_new)
        idx = {r.candidate: i for i, r in enumerate(self.regions)}
        if volumes is None:
            if c not in idx:
                raise PlacementError(f"plan_between: {c.label()} is not a region of the map; "
                                     f"pass volumes=")
            i = idx[c]
            if c_new in idx and (i, idx[c_new]) in self.plans:
                return self.plans[(i, idx[c_new])]
            volumes = volumes_for(c, float(self.capacity) * self.regions[i].x_hi,
                                  self.topology)
        occupied = {e for e, _ in endpoint_shares(c, self.topology)}
        for e in volumes:
            if e not in occupied:
                raise PlacementError(f"volumes: {e!r} is not an endpoint of {c.label()} "
                                     f"(expected some of {sorted(occupied)})")
        total = float(sum(volumes.values()))
        return transfer_plan(dict(volumes), volumes_for(c_new, total, self.topology),
                             topology=self.topology,
                             local_bandwidth=self.restrict.get("local_bandwidth", math.inf))

    def describe(self) -> str:
        """The regions as a table."""
        lines = [f"placement map: C_buf = {self.capacity:,} rows, actor {self.actor_device} -> "
                 f"learner {self.learner_device}, x in [{self.x_min:,}, {self.x_max:,}] B"]
        for i, r in enumerate(self.regions):
            plan = self.plans.get((i, i + 1))
            mig = f"  -> migrate: {plan.makespan_s * 1e3:,.1f} ms makespan" if plan else ""
            lines.append(f"  x in [{r.x_lo:>9,}, {r.x_hi:>9,}] B: {r.candidate.label()}{mig}")
        if self.x_feasible_max < self.x_max:
            lines.append(f"  x > {self.x_feasible_max:,} B: no placement fits")
        return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class MigrationStep:
    """One migration of a growth trace (Alg. 2 lines 1-3).

    Attributes:
        step: Index into the trace.
        x: Per-sample size that triggered it.
        source: Placement before.
        target: Placement after.
        plan: The transfer plan for a full buffer at the previous step's size.
    """

    step: int
    x: float
    source: Candidate
    target: Candidate
    plan: TransferPlan


def migration_steps(pmap: PlacementMap, xs: Sequence[float], *,
                    start: Placement | Candidate | None = None) -> tuple[MigrationStep, ...]:
    """Replay a trace of per-sample sizes through Alg. 2's decision part.

    At each step ``M(x)`` is looked up; when it differs from the active placement a migration
    is recorded with its transfer plan (volumes: a full buffer at the previous step's size).

    Args:
        pmap: The placement map.
        xs: Per-sample sizes over time.
        start: Active placement before the first step (default ``M(xs[0])``).

    Raises:
        CapacityError: A size in the trace fits nowhere.
    """
    if not xs:
        return ()
    active = Candidate.of(start) if start is not None else pmap.lookup_candidate(xs[0])
    prev_x = xs[0]
    out = []
    for k, x in enumerate(xs):
        new = pmap.lookup_candidate(x)
        if new != active:
            vols = volumes_for(active, float(pmap.capacity) * prev_x, pmap.topology)
            plan = pmap.plan_between(active, new, vols)
            out.append(MigrationStep(step=k, x=x, source=active, target=new, plan=plan))
            active = new
        prev_x = x
    return tuple(out)
