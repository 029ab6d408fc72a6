"""Capacity-constrained, bandwidth-aware placement (paper §5.2, Eq. 1, Alg. 1).

:func:`candidate_set` builds the small candidate set ``P`` with the paper's two heuristics:

(i) *cross-node balance*: on a multi-node topology every candidate spreads the buffer evenly
    over the nodes (actors write to their node's part; inter-node links are the slow edges);
(ii) *intra-node representatives*: pageable CPU, pinned CPU, each single accelerator (the
    learner's own first), and sharded placements over accelerator subsets of increasing size,
    grown greedily by adding the rank with the best bandwidth to the learner (ties: the best
    worst-case bandwidth to the ranks already chosen, then the lowest rank), so that on a
    non-uniform fabric the fast ranks come first. That is at most ``2G + 2`` candidates per
    node for ``G`` accelerators.

:func:`scan` is Alg. 1: a linear scan that keeps the feasible candidate with the smallest
``T_transfer``. :func:`plan_placement` puts the two together and returns a
:class:`PlacementDecision` that explains itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from conduit.errors import CapacityError, ConfigError, TopologyError
from conduit.placement.endpoints import CPU_PINNED
from conduit.placement.topology import Topology
from conduit.placement.transfer import (
    Candidate,
    _check_capacity,
    _check_x,
    check_capacity,
    check_endpoint,
    transfer_estimate,
)
from conduit.spec import ExperienceSpec
from conduit.storage.layout import Placement

PLACEMENT_KINDS = ("pageable", "pinned", "device", "sharded")

TIE = 1e-9
"""Relative difference under which two candidates' times tie in :func:`scan`."""


@dataclass(frozen=True, kw_only=True)
class CandidateEvaluation:
    """One row of a decision: a candidate with its predicted time or why it was rejected.

    Attributes:
        candidate: The candidate placement.
        feasible: Whether ``C_buf * x <= Mem(p)``.
        time_s: Predicted ``T_transfer(p)`` per sample (computed for rejected ones too).
        ingest_s: The actor -> buffer leg.
        deliver_s: The buffer -> learner leg.
        needed_bytes: ``C_buf * x``.
        available_bytes: ``Mem(p)``.
        limiting_device: The endpoint whose share fills first.
        reason: Empty when feasible; otherwise why the candidate was rejected.
    """

    candidate: Candidate
    feasible: bool
    time_s: float
    ingest_s: float
    deliver_s: float
    needed_bytes: float
    available_bytes: float
    limiting_device: str
    reason: str = ""

    @property
    def placement(self) -> Placement:
        """The candidate's per-node placement."""
        return self.candidate.placement


@dataclass(frozen=True, kw_only=True)
class PlacementDecision:
    """The outcome of Alg. 1, with every candidate considered.

    Attributes:
        chosen: The selected candidate.
        candidates: Every candidate, in scan order, with its time or rejection reason.
        x: Bytes per sample.
        capacity: Buffer capacity ``C_buf`` in rows.
        actor_device: Where rollouts are produced.
        learner_device: Where batches are consumed.
        topology_source: Which topology the decision was made on.
    """

    chosen: Candidate
    candidates: tuple[CandidateEvaluation, ...]
    x: float
    capacity: int
    actor_device: str
    learner_device: str
    topology_source: str = ""

    @property
    def placement(self) -> Placement:
        """The chosen per-node :class:`Placement` (what a store is built for)."""
        return self.chosen.placement

    @property
    def chosen_evaluation(self) -> CandidateEvaluation:
        """The chosen candidate's row."""
        return next(e for e in self.candidates if e.candidate == self.chosen)

    @property
    def time_s(self) -> float:
        """Predicted per-sample ``T_transfer`` of the chosen placement."""
        return self.chosen_evaluation.time_s

    def explain(self) -> str:
        """A table of every candidate: time per sample and per batch of 512, or why rejected."""
        ev = self.chosen_evaluation
        head = (f"placement: {self.chosen.label()}  (x = {self.x:,.0f} B/sample, "
                f"C_buf = {self.capacity:,} rows, needs {ev.needed_bytes / 1e9:,.2f} GB; "
                f"actor {self.actor_device} -> learner {self.learner_device}"
                + (f"; topology {self.topology_source}" if self.topology_source else "")
                + ")")
        width = max(24, *(len(e.candidate.label()) for e in self.candidates))
        rows = [head,
                f"  {'candidate':<{width}} {'T/sample':>10} {'ingest':>10} {'deliver':>10} "
                f"{'Mem(p) GB':>11}  verdict"]
        for e in self.candidates:
            mark = "*" if e.candidate == self.chosen else " "
            verdict = "chosen" if mark == "*" else ("feasible" if e.feasible else e.reason)
            rows.append(f"{mark} {e.candidate.label():<{width}} {_fmt_t(e.time_s):>10} "
                        f"{_fmt_t(e.ingest_s):>10} {_fmt_t(e.deliver_s):>10} "
                        f"{e.available_bytes / 1e9:>11,.1f}  {verdict}")
        return "\n".join(rows)

    def to_dict(self) -> dict:
        """JSON-friendly summary."""
        return {"chosen": self.chosen.to_dict(), "x": self.x, "capacity": self.capacity,
                "actor_device": self.actor_device, "learner_device": self.learner_device,
                "candidates": [{"candidate": e.candidate.to_dict(), "feasible": e.feasible,
                                "time_s": e.time_s, "available_bytes": e.available_bytes,
                                "reason": e.reason} for e in self.candidates]}


def _fmt_t(s: float) -> str:
    if s < 1e-6:
        return f"{s * 1e9:.2f} ns"
    if s < 1e-3:
        return f"{s * 1e6:.2f} us"
    return f"{s * 1e3:.2f} ms"


# -- candidate set -------------------------------------------------------------------------------


def _peer_bw(topology: Topology, a: str, b: str) -> float:
    return min(topology.bandwidth(a, b), topology.bandwidth(b, a))


def greedy_accelerator_order(*, topology: Topology, node: str, learner_device: str,
                             devices: Sequence[str] | None = None) -> tuple[str, ...]:
    """Accelerators of ``node`` in the order the subset heuristic adds them.

    Starts from the learner's own accelerator when it is on this node (else the one with the
    best bandwidth to the learner), then repeatedly adds the rank with the best bandwidth to
    the learner, breaking ties by the best worst-case bandwidth to the ranks already chosen,
    then by the lowest rank.

    Args:
        topology: Devices and bandwidths.
        node: Node name.
        learner_device: Global name of the learner's endpoint.
        devices: Restrict to these local accelerator names.

    Returns:
        Local accelerator names (``"cuda:i"``).
    """
    n = topology.node(node)
    pool = [a for a in n.accelerators if devices is None or a in devices]
    if not pool:
        return ()
    lnode, ldev = topology.resolve(learner_device)
    order: list[str] = []
    if lnode == node and ldev in pool:
        order.append(ldev)
        pool.remove(ldev)
    rank = {a: i for i, a in enumerate(n.accelerators)}
    while pool:
        def score(a: str) -> tuple[float, float, int]:
            ga = topology.qualify(node, a)
            to_learner = topology.bandwidth(ga, learner_device)
            to_set = min((_peer_bw(topology, ga, topology.qualify(node, s)) for s in order),
                         default=math.inf)
            return (to_learner, to_set, -rank[a])
        best = max(pool, key=score)
        order.append(best)
        pool.remove(best)
    return tuple(order)


def candidate_set(*, topology: Topology, learner_device: str,
                  allowed_kinds: Iterable[str] | None = None,
                  devices: Sequence[str] | None = None,
                  nodes: Sequence[str] | None = None) -> tuple[Candidate, ...]:
    """The reduced candidate set ``P`` of §5.2 (see the module docstring).

    Args:
        topology: Devices and bandwidths.
        learner_device: The learner's endpoint (global name).
        allowed_kinds: Restrict to these placement kinds (``"pageable"``, ``"pinned"``,
            ``"device"``, ``"sharded"``).
        devices: Restrict accelerator candidates to these local device names.
        nodes: Restrict to these nodes (default: all nodes; the buffer is balanced over them).

    Returns:
        Candidates in scan order: pageable, pinned, single accelerators (learner's own first),
        sharded subsets by increasing size.

    Raises:
        ConfigError: An unknown kind, device or node, or the restriction leaves no candidate.
    """
    kinds = _check_kinds(allowed_kinds)
    node_names = _check_nodes(topology, nodes)
    check_endpoint(topology, learner_device, "learner_device")
    lnode, _ = topology.resolve(learner_device)
    ref = lnode if lnode in node_names else node_names[0]
    ref_node = topology.node(ref)
    if devices is not None:
        devices = tuple(devices)
        for d in devices:
            if not any(topology.node(nn).has(d) for nn in node_names):
                raise ConfigError("devices", f"{d!r} is not a device of the selected node(s) "
                                             f"{list(node_names)}")
    local: list[Placement] = []
    if "pageable" in kinds:
        local.append(Placement.pageable())
    if "pinned" in kinds and ref_node.has(CPU_PINNED):
        local.append(Placement.pinned())
    order = greedy_accelerator_order(topology=topology, node=ref, learner_device=learner_device,
                                     devices=devices)
    if "device" in kinds:
        local += [Placement.device(a) for a in order]
    if "sharded" in kinds:
        local += [Placement.sharded(order[:k]) for k in range(2, len(order) + 1)]
    out: list[Candidate] = []
    for p in local:
        eps = p.devices if p.kind != "pinned" else (CPU_PINNED,)
        if all(all(topology.node(nn).has(e) for e in eps) for nn in node_names):
            if len(node_names) == 1 and not topology.is_multi_node:
                out.append(Candidate(placement=p))
            else:
                out.append(Candidate(placement=p, nodes=node_names))
    if not out:
        raise ConfigError("allowed_kinds", f"no candidate placement remains after the "
                                           f"restrictions (kinds={sorted(kinds)}, "
                                           f"devices={devices}, nodes={list(node_names)})")
    return tuple(out)


def _check_kinds(allowed_kinds: Iterable[str] | None) -> frozenset[str]:
    if allowed_kinds is None:
        return frozenset(PLACEMENT_KINDS)
    if isinstance(allowed_kinds, str):
        allowed_kinds = (allowed_kinds,)
    kinds = frozenset(allowed_kinds)
    bad = sorted(k for k in kinds if k not in PLACEMENT_KINDS)
    if bad or not kinds:
        raise ConfigError("allowed_kinds", f"unknown or empty placement kinds {bad or []}; "
                                           f"choose from {PLACEMENT_KINDS}")
    return kinds


def _check_nodes(topology: Topology, nodes: Sequence[str] | None) -> tuple[str, ...]:
    if nodes is None:
        return tuple(n.name for n in topology.nodes)
    nodes = tuple(nodes)
    known = {n.name for n in topology.nodes}
    for n in nodes:
        if n not in known:
            raise ConfigError("nodes", f"{n!r} is not a node of the topology "
                                       f"(known: {sorted(known)})")
    if not nodes:
        raise ConfigError("nodes", "at least one node is needed")
    return nodes


# -- Alg. 1 --------------------------------------------------------------------------------------


def evaluate(candidates: Sequence[Candidate], *, x: float, capacity: int, actor_device: str,
             learner_device: str, topology: Topology) -> tuple[CandidateEvaluation, ...]:
    """Predicted time and capacity verdict for every candidate (pure)."""
    out = []
    for c in candidates:
        est = transfer_estimate(c, x=x, actor_device=actor_device,
                                learner_device=learner_device, topology=topology)
        cap = check_capacity(c, capacity=capacity, x=x, topology=topology)
        reason = "" if cap.fits else (
            f"does not fit: needs {cap.needed_bytes / 1e9:,.2f} GB, "
            f"{cap.available_bytes / 1e9:,.2f} GB available (limited by {cap.limiting_device})")
        out.append(CandidateEvaluation(
            candidate=c, feasible=cap.fits, time_s=est.total_s, ingest_s=est.ingest_s,
            deliver_s=est.deliver_s, needed_bytes=cap.needed_bytes,
            available_bytes=cap.available_bytes, limiting_device=cap.limiting_device,
            reason=reason))
    return tuple(out)


def scan(evaluations: Sequence[CandidateEvaluation]) -> CandidateEvaluation | None:
    """Alg. 1: linear scan keeping the feasible candidate with the smallest time.

    Ties keep the earlier candidate: a time within a relative :data:`TIE` of the best so far
    is a tie (sums of equal shares round differently, so exact equality in the model is not
    exact in floating point). Returns ``None`` when no candidate is feasible.
    """
    best: CandidateEvaluation | None = None
    t_min = math.inf
    for e in evaluations:
        if e.feasible and e.time_s < t_min * (1.0 - TIE):  # (inf: not feasible in time)
            t_min, best = e.time_s, e
    return best


def resolve_spec_bytes(spec_bytes: float | None, spec: ExperienceSpec | None) -> float:
    """``x`` from exactly one of ``spec_bytes`` or ``spec``.

    Raises:
        ConfigError: Both or neither are given, or the size is not positive.
    """
    if (spec_bytes is None) == (spec is None):
        raise ConfigError("spec_bytes", "give exactly one of spec_bytes= or spec=")
    if spec is not None:
        if not isinstance(spec, ExperienceSpec):
            raise ConfigError("spec", f"expected an ExperienceSpec, got {spec!r}")
        spec_bytes = spec.bytes_per_sample
    return _check_x(spec_bytes)


def plan_placement(*, capacity: int, actor_device: str, learner_device: str,
                   topology: Topology, spec_bytes: float | None = None,
                   spec: ExperienceSpec | None = None,
                   allowed_kinds: Iterable[str] | None = None,
                   devices: Sequence[str] | None = None,
                   nodes: Sequence[str] | None = None) -> PlacementDecision:
    """Solve Eq. 1 approximately with Alg. 1 over the heuristic candidate set.

    Args:
        capacity: Buffer capacity ``C_buf`` in rows.
        actor_device: Where actors produce rollouts (``"cpu"``).
        learner_device: Where the learner consumes batches (``"cuda:0"``).
        topology: Devices, free memory and bandwidths (detected, loaded or a preset).
        spec_bytes: Bytes per sample ``x`` (or give ``spec``).
        spec: Experience spec; ``x = spec.bytes_per_sample``.
        allowed_kinds: Restrict candidates to these kinds.
        devices: Restrict accelerator candidates to these device names.
        nodes: Restrict to these nodes.

    Returns:
        The decision, with every candidate's predicted time or rejection reason.

    Raises:
        ConfigError: A bad size, capacity, device, node or kind (``field`` names it).
        CapacityError: No candidate fits; ``needed`` is ``C_buf * x`` bytes and ``available``
            the largest ``Mem(p)`` over the candidates.
    """
    x = resolve_spec_bytes(spec_bytes, spec)
    _check_capacity(capacity)
    check_endpoint(topology, actor_device, "actor_device")
    check_endpoint(topology, learner_device, "learner_device")
    cands = candidate_set(topology=topology, learner_device=learner_device,
                          allowed_kinds=allowed_kinds, devices=devices, nodes=nodes)
    return decide(cands, x=x, capacity=capacity, actor_device=actor_device,
                  learner_device=learner_device, topology=topology)


def decide(candidates: Sequence[Candidate], *, x: float, capacity: int, actor_device: str,
           learner_device: str, topology: Topology) -> PlacementDecision:
    """Evaluate given candidates and run Alg. 1 (the core of :func:`plan_placement`).

    Raises:
        ConfigError: ``candidates`` is empty, or a bad size, capacity or device.
        CapacityError: No candidate fits.
        TopologyError: Candidates fit, but a bandwidth is so small that every one of them
            takes infinitely long per sample (the message names the slowest link).
    """
    evals = evaluate(candidates, x=x, capacity=capacity, actor_device=actor_device,
                     learner_device=learner_device, topology=topology)
    if not evals:
        raise ConfigError("candidates", "at least one candidate placement is needed; pass "
                                        "candidate_set(...) or a list of Candidates")
    best = scan(evals)
    stalled = [e.candidate.label() for e in evals if e.feasible]
    if best is None and stalled:  # they fit, but T_transfer overflowed to infinity
        links = [(ln.bandwidth, f"node {n.name!r} links[{ln.src}->{ln.dst}].bandwidth")
                 for n in topology.nodes for ln in n.links]
        if topology.is_multi_node:
            links.append((topology.inter_node_bandwidth, "inter_node_bandwidth"))
        bw, where = min(links)
        raise TopologyError(
            f"{where}: {bw:.3g} B/s is too small to price: moving x = {x:,.0f} B per sample "
            f"takes infinitely long on every candidate that fits ({', '.join(stalled)}). "
            f"Give bandwidths in bytes/s (1e9 for 1 GB/s).")
    if best is None:
        needed = float(capacity) * float(x)
        top = max(evals, key=lambda e: e.available_bytes)
        raise CapacityError(
            f"placement: a buffer of {capacity:,} rows x {x:,.0f} B = {needed / 1e9:,.2f} GB "
            f"fits no candidate placement; the largest, {top.candidate.label()}, holds "
            f"{top.available_bytes / 1e9:,.2f} GB. Reduce capacity or the per-sample size, or "
            f"add devices/nodes.", needed=needed, available=top.available_bytes)
    return PlacementDecision(chosen=best.candidate, candidates=evals, x=x, capacity=capacity,
                             actor_device=actor_device, learner_device=learner_device,
                             topology_source=topology.source)
