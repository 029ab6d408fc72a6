"""The transfer-latency model (paper §5.1) and the capacity check of Eq. 1.

For a placement ``p`` and per-sample size ``x`` (bytes)::

    T_transfer(p) = x / BW(actor -> p) + x / BW(p -> learner)

For a placement spread over several endpoints (sharded GPUs, or nodes), each leg is the
expected per-sample time over where the sample lives: a sample sits on endpoint ``e`` with
probability ``share_e`` (uniform sampling over rows), so::

    x / BW(p -> learner) := sum_e share_e * x / BW(e -> learner)

which is the harmonic mixture of bandwidths the paper's example describes (a learner on one of
8 shard GPUs reads locally with probability 1/8 and over peer links with probability 7/8). The
ingestion leg mixes the same way; in multi-node placements an actor writes to the shards on its
own node (the cross-node balance rule), so ingestion stays node-local.

Capacity: ``C_buf * x <= Mem(p)``, where for a spread placement ``Mem(p) = min_e Mem(e) /
share_e`` (every endpoint's share must fit its own free memory).

Everything here is a pure function of plain data.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from conduit._checks import finite_float
from conduit.errors import ConfigError, PlacementError
from conduit.placement.endpoints import CPU_PINNED
from conduit.placement.topology import Topology
from conduit.storage.layout import Placement, split_rows


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A placement, possibly replicated across nodes (the cross-node balance rule).

    On a single-node topology a candidate is just its :class:`Placement`. On a multi-node
    topology the same per-node placement is instantiated on each of ``nodes``, with
    ``node_shares`` of the rows on each.

    Attributes:
        placement: The per-node placement (device names are local to a node).
        nodes: Node names holding a part of the buffer; empty means the topology's first node.
        node_shares: Fraction of rows on each node (sums to 1); ``None`` means even.

    Raises:
        PlacementError: ``placement`` is not a :class:`Placement`, ``nodes`` names a node
            twice (its memory would count twice in the capacity check), or ``node_shares`` is
            not one finite, non-negative number per node summing to 1.
    """

    placement: Placement
    nodes: tuple[str, ...] = ()
    node_shares: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.placement, Placement):
            raise PlacementError(f"candidate.placement: expected a Placement, got "
                                 f"{self.placement!r}")
        nodes = tuple(self.nodes)
        dup = [n for i, n in enumerate(nodes) if n in nodes[:i]]
        if dup:
            raise PlacementError(f"candidate.nodes: each node may appear once, got {nodes} "
                                 f"naming {dup} more than once; list each node once and "
                                 f"give it a larger node_shares entry instead")
        object.__setattr__(self, "nodes", nodes)
        if self.node_shares is not None:
            try:
                shares = tuple(float(s) for s in self.node_shares)
            except (TypeError, ValueError, OverflowError):
                shares = ()  # not numbers: refused below (an empty tuple never sums to 1)
            # NaN compares False with everything, so finiteness is checked explicitly.
            if len(shares) != len(nodes) or not shares \
                    or any(not math.isfinite(s) or s < 0 for s in shares) \
                    or abs(sum(shares) - 1.0) > 1e-6:
                raise PlacementError(f"candidate.node_shares: need {len(nodes)} finite, "
                                     f"non-negative shares summing to 1, got "
                                     f"{self.node_shares!r}")
            object.__setattr__(self, "node_shares", shares)

    @classmethod
    def of(cls, p: Placement | Candidate) -> Candidate:
        """Wrap a :class:`Placement` (a candidate is returned unchanged)."""
        return p if isinstance(p, Candidate) else cls(placement=p)

    def label(self) -> str:
        """Short name for tables, e.g. ``device[cuda:0]`` or ``2 nodes x pinned``."""
        base = self.placement.label()
        if len(self.nodes) > 1:
            return f"{len(self.nodes)} nodes x {base}"
        if self.nodes:
            return f"{self.nodes[0]}:{base}"
        return base

    def to_dict(self) -> dict:
        """JSON-friendly description."""
        return {"placement": self.placement.to_dict(), "nodes": list(self.nodes),
                "node_shares": list(self.node_shares) if self.node_shares else None}


def placement_endpoints(placement: Placement) -> tuple[str, ...]:
    """The memory endpoints a placement occupies inside one node.

    A pinned placement lives on ``"cpu_pinned"``; the other kinds on their devices.
    """
    if placement.kind == "pinned":
        return (CPU_PINNED,)
    return placement.devices


def endpoint_shares(p: Placement | Candidate, topology: Topology) -> tuple[tuple[str, float], ...]:
    """Where the rows of ``p`` live: ``((global endpoint, fraction of rows), ...)``.

    Raises:
        PlacementError: The placement names a device or node the topology lacks, or names
            one device twice (``Placement.sharded(["cuda:0", "cuda:0"])``: Eq. 1 would count
            its free memory twice; a store may simulate shards that way, a plan may not).
    """
    c = Candidate.of(p)
    nodes = c.nodes or (topology.nodes[0].name,)
    nshares = c.node_shares or tuple(1.0 / len(nodes) for _ in nodes)
    dshares = c.placement.shares if c.placement.kind == "sharded" else (1.0,)
    eps = placement_endpoints(c.placement)
    out: list[tuple[str, float]] = []
    for node, ns in zip(nodes, nshares):
        for ep, ds in zip(eps, dshares):
            try:
                name = topology.qualify(node, ep)
            except Exception as exc:
                raise PlacementError(f"placement.devices: {ep!r} on node {node!r} is not in "
                                     f"the topology ({exc})") from exc
            out.append((name, ns * ds))
    names = [e for e, _ in out]
    dup = sorted({e for e in names if names.count(e) > 1})
    if dup:
        raise PlacementError(f"placement.devices: {c.label()} names {', '.join(dup)} more "
                             f"than once, so its memory would count once per mention in "
                             f"Mem(p); list each device once and give it a larger share")
    return tuple(out)


def _check_x(x: float) -> float:
    # finite_float also refuses an int too large for a float (10**400), which math.isfinite
    # would raise OverflowError on.
    if not isinstance(x, (int, float)) or finite_float(x) is None or x <= 0:
        raise ConfigError("spec_bytes", f"per-sample size must be a positive finite number of "
                                        f"bytes, got {x!r}")
    return x


def _check_capacity(capacity: int) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ConfigError("capacity", f"must be a non-negative integer number of rows, "
                                      f"got {capacity!r}")
    if finite_float(capacity) is None:
        raise ConfigError("capacity", f"too large to price (above {sys.float_info.max:.3e} "
                                      f"rows, the largest float); pass a realistic number of "
                                      f"rows")
    return capacity


def check_endpoint(topology: Topology, endpoint: str, field_name: str) -> str:
    """Validate that ``endpoint`` is in ``topology``.

    Raises:
        ConfigError: Unknown endpoint; the error's ``field`` is ``field_name``.
    """
    if not isinstance(endpoint, str) or not topology.has(endpoint):
        raise ConfigError(field_name, f"{endpoint!r} is not a device of the topology "
                                      f"(known: {', '.join(topology.endpoints())})")
    return endpoint


def _actor_sites(topology: Topology, actor_device: str) -> tuple[tuple[str, str], ...]:
    """(node, device) pairs actors run on: every node for an unqualified multi-node name."""
    if topology.is_multi_node and "/" not in actor_device:
        return tuple((n.name, actor_device) for n in topology.nodes if n.has(actor_device))
    return (topology.resolve(actor_device),)


@dataclass(frozen=True, kw_only=True)
class TransferEstimate:
    """Per-sample transfer time of one placement, split into its two legs (seconds).

    Attributes:
        ingest_s: Expected ``x / BW(actor -> p)``.
        deliver_s: Expected ``x / BW(p -> learner)``.
    """

    ingest_s: float
    deliver_s: float

    @property
    def total_s(self) -> float:
        """``T_transfer(p)`` of Eq. 1."""
        return self.ingest_s + self.deliver_s


@dataclass(frozen=True, kw_only=True)
class DeliveryTerm:
    """One endpoint's term of the delivery mixture: a learner reads a row from ``endpoint``
    with probability ``share``, at ``bandwidth``.

    Attributes:
        endpoint: Global endpoint name (``"node1/cuda:0"``; unqualified on a single node).
        share: Fraction of the rows held there (the probability a sampled row is there).
        local: Whether the endpoint is on the learner's node.
        bandwidth: Bytes/s of ``endpoint -> learner`` (the slowest segment across nodes).
        seconds: ``share * x / bandwidth``: this term's part of the per-sample delivery leg.
    """

    endpoint: str
    share: float
    local: bool
    bandwidth: float
    seconds: float


def delivery_terms(p: Placement | Candidate, *, x: float, learner_device: str,
                   topology: Topology) -> tuple[DeliveryTerm, ...]:
    """The local/remote mixture behind the delivery leg of Eq. 1, term by term.

    Raises:
        ConfigError: ``x`` is not positive, or the learner device is unknown.
        PlacementError: ``p`` names a device the topology lacks.
        TopologyError: The bandwidth table lacks a needed entry.
    """
    _check_x(x)
    check_endpoint(topology, learner_device, "learner_device")
    home = topology.resolve(learner_device)[0]
    out = []
    for e, s in endpoint_shares(p, topology):
        if s > 0:
            bw = topology.bandwidth(e, learner_device)
            out.append(DeliveryTerm(endpoint=e, share=s, local=topology.resolve(e)[0] == home,
                                    bandwidth=bw, seconds=s * x / bw))
    return tuple(out)


def transfer_estimate(p: Placement | Candidate, *, x: float, actor_device: str,
                      learner_device: str, topology: Topology) -> TransferEstimate:
    """Both legs of Eq. 1 for placement ``p`` (see the module docstring for the mixture).

    Args:
        p: The placement (or multi-node candidate).
        x: Bytes per sample.
        actor_device: Where actors produce rollouts (``"cpu"``, ``"cuda:1"``). On a multi-node
            topology an unqualified name means "this device on every node".
        learner_device: Where the learner consumes batches.
        topology: Devices and bandwidths.

    Raises:
        ConfigError: ``x`` is not positive, or an actor/learner device is unknown.
        PlacementError: ``p`` names a device the topology lacks.
        TopologyError: The bandwidth table lacks a needed entry.
    """
    _check_x(x)
    check_endpoint(topology, actor_device, "actor_device")
    check_endpoint(topology, learner_device, "learner_device")
    shares = [(e, s) for e, s in endpoint_shares(p, topology) if s > 0]
    deliver = sum(t.seconds for t in delivery_terms(p, x=x, learner_device=learner_device,
                                                     topology=topology))
    sites = _actor_sites(topology, actor_device)
    ingest = 0.0
    for node, dev in sites:
        src = topology.qualify(node, dev)
        local = [(e, s) for e, s in shares if topology.resolve(e)[0] == node]
        targets = local or shares
        tot = sum(s for _, s in targets)
        ingest += sum(s / tot * x / topology.bandwidth(src, e) for e, s in targets)
    ingest /= len(sites)
    return TransferEstimate(ingest_s=ingest, deliver_s=deliver)


def transfer_time(p: Placement | Candidate, *, x: float, actor_device: str,
                  learner_device: str, topology: Topology) -> float:
    """``T_transfer(p) = x/BW(actor -> p) + x/BW(p -> learner)`` in seconds per sample.

    See :func:`transfer_estimate` for the arguments and errors.
    """
    return transfer_estimate(p, x=x, actor_device=actor_device, learner_device=learner_device,
                             topology=topology).total_s


def placement_memory(p: Placement | Candidate, topology: Topology) -> float:
    """``Mem(p)``: the largest buffer (bytes) the placement can hold.

    For a spread placement this is ``min_e Mem(e) / share_e``: the buffer is limited by the
    endpoint whose share fills first.
    """
    best = math.inf
    for e, s in endpoint_shares(p, topology):
        if s > 0:
            best = min(best, topology.memory(e) / s)
    return best


@dataclass(frozen=True, kw_only=True)
class CapacityCheck:
    """Result of ``C_buf * x <= Mem(p)``.

    Attributes:
        fits: Whether the buffer fits.
        needed_bytes: ``C_buf * x``.
        available_bytes: ``Mem(p)``.
        limiting_device: The endpoint whose share fills first.
    """

    fits: bool
    needed_bytes: float
    available_bytes: float
    limiting_device: str


def check_capacity(p: Placement | Candidate, *, capacity: int, x: float,
                   topology: Topology) -> CapacityCheck:
    """Capacity constraint of Eq. 1 (each endpoint's share must fit its free memory).

    Raises:
        ConfigError: ``capacity`` is negative or ``x`` is not positive.
    """
    _check_capacity(capacity)
    _check_x(x)
    needed = float(capacity) * float(x)
    best, limiting = math.inf, ""
    shares = endpoint_shares(p, topology)
    for e, s in shares:
        if s > 0 and topology.memory(e) / s < best:
            best, limiting = topology.memory(e) / s, e
    fits = needed <= best
    # Rows are whole: an endpoint may hold one row more than its share (split_rows).
    for (e, _), rows in zip(shares, split_rows(capacity, [s for _, s in shares])):
        if fits and rows * float(x) > topology.memory(e):
            fits, limiting = False, e
    return CapacityCheck(fits=fits, needed_bytes=needed, available_bytes=best,
                         limiting_device=limiting)
