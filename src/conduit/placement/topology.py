"""Hardware topology: nodes, devices with free memory, and a bandwidth table.

A :class:`Topology` is plain data that the planner (:mod:`conduit.placement.planner`) and the
migration planner (:mod:`conduit.placement.migration`) read. It can be

* detected on the current machine (:meth:`Topology.detect`, from torch and psutil, with
  bandwidths from the profiler cache when present),
* loaded from JSON (:meth:`Topology.from_json` / :meth:`Topology.load`), or
* taken from a named preset (:func:`conduit.placement.presets.preset`).

Endpoints
    Inside a node, memory endpoints are ``"cpu"`` (pageable host memory), ``"cpu_pinned"``
    (page-locked host memory) and accelerators named like torch devices (``"cuda:0"``...).
    Across nodes an endpoint is qualified by its node: ``"node1/cuda:3"``. An unqualified name
    refers to the first node, so single-node code never needs the qualified form.

Bandwidth table
    Each node holds directed links ``(src, dst) -> bytes/s`` (a ``(d, d)`` link is the
    within-tier gather/copy bandwidth of ``d``). A missing ``(src, dst)`` falls back to
    ``(dst, src)`` (links are assumed symmetric unless both directions are given). Between nodes,
    one ``inter_node_bandwidth`` applies; a cross-node path is limited by its slowest segment
    (source device -> its host's pinned memory, the network, destination host's pinned memory
    -> destination device; pageable ``cpu`` memory stages through pinned memory too).
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from conduit._checks import finite_float
from conduit.errors import TopologyError
from conduit.placement import cluster as ray_cluster
from conduit.placement.bandwidth import load_cached_profile
from conduit.placement.endpoints import CPU, CPU_PINNED, device_kind, is_accelerator

_DEVICE_RE = re.compile(r"^(cpu|cpu_pinned|[a-z][a-z0-9_]*:\d+)$")
_FORMAT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class DeviceInfo:
    """One memory endpoint of a node.

    Attributes:
        name: Endpoint name: ``"cpu"``, ``"cpu_pinned"`` or ``"cuda:<i>"``.
        memory_bytes: Free memory usable by the buffer, in bytes.
        model: Free-form hardware name (``"NVIDIA A100-SXM4-80GB"``), informational.

    Raises:
        TopologyError: ``name`` is not an endpoint name, or ``memory_bytes`` is not a
            non-negative finite number (NaN and infinity included).
    """

    name: str
    memory_bytes: int
    model: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _DEVICE_RE.match(self.name):
            raise TopologyError(f"device.name: {self.name!r} is not an endpoint name "
                                f"(expected 'cpu', 'cpu_pinned' or like 'cuda:0')")
        if not _is_finite(self.memory_bytes) or self.memory_bytes < 0:
            raise TopologyError(f"device[{self.name!r}].memory_bytes: must be a non-negative "
                                f"finite number, got {self.memory_bytes!r}")
        object.__setattr__(self, "memory_bytes", int(self.memory_bytes))

    @property
    def kind(self) -> str:
        """``"cpu"``, ``"cpu_pinned"`` or the accelerator type (``"cuda"``)."""
        return device_kind(self.name)


@dataclass(frozen=True, kw_only=True)
class Link:
    """A directed bandwidth-table entry.

    Attributes:
        src: Source endpoint (unqualified, within the node).
        dst: Destination endpoint.
        bandwidth: Effective bandwidth in bytes/s (must be positive and finite).
        estimated: True when the value is a default rather than a measurement.
    """

    src: str
    dst: str
    bandwidth: float
    estimated: bool = False

    def __post_init__(self) -> None:
        if not _is_finite(self.bandwidth) or self.bandwidth <= 0:
            raise TopologyError(f"link[{self.src}->{self.dst}].bandwidth: must be a positive "
                                f"finite number of bytes/s, got {self.bandwidth!r}")
        object.__setattr__(self, "bandwidth", float(self.bandwidth))


@dataclass(frozen=True, kw_only=True)
class NodeTopology:
    """One machine: its memory endpoints and its intra-node bandwidth table.

    Attributes:
        name: Node name, unique within the topology (``"node0"``).
        devices: Memory endpoints. ``"cpu"`` is required.
        links: Directed bandwidth-table entries between this node's endpoints.
    """

    name: str
    devices: tuple[DeviceInfo, ...]
    links: tuple[Link, ...] = ()
    _by_name: dict[str, DeviceInfo] = field(init=False, repr=False, compare=False)
    _table: dict[tuple[str, str], Link] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise TopologyError(f"node.name: {self.name!r} must be a non-empty string "
                                f"without '/'")
        devices = tuple(self.devices)
        links = tuple(self.links)
        object.__setattr__(self, "devices", devices)
        object.__setattr__(self, "links", links)
        by_name: dict[str, DeviceInfo] = {}
        for d in devices:
            if d.name in by_name:
                raise TopologyError(f"node[{self.name!r}].devices: duplicate device {d.name!r}")
            by_name[d.name] = d
        if CPU not in by_name:
            raise TopologyError(f"node[{self.name!r}].devices: a node needs a 'cpu' device")
        table: dict[tuple[str, str], Link] = {}
        for ln in links:
            for end in (ln.src, ln.dst):
                if end not in by_name:
                    raise TopologyError(
                        f"node[{self.name!r}].links[{ln.src}->{ln.dst}]: unknown device "
                        f"{end!r} (known: {sorted(by_name)})")
            table[(ln.src, ln.dst)] = ln
        object.__setattr__(self, "_by_name", by_name)
        object.__setattr__(self, "_table", table)

    @property
    def device_names(self) -> tuple[str, ...]:
        """Endpoint names in declaration order."""
        return tuple(d.name for d in self.devices)

    @property
    def accelerators(self) -> tuple[str, ...]:
        """Accelerator endpoint names (``"cuda:i"``), sorted by rank."""
        accs = [d.name for d in self.devices if is_accelerator(d.name)]
        return tuple(sorted(accs, key=_rank_key))

    def has(self, name: str) -> bool:
        """True when ``name`` is an endpoint of this node."""
        return name in self._by_name

    def device(self, name: str) -> DeviceInfo:
        """The endpoint called ``name``.

        Raises:
            TopologyError: ``name`` is not an endpoint of this node.
        """
        try:
            return self._by_name[name]
        except KeyError:
            raise TopologyError(f"device: {name!r} is not a device of node {self.name!r} "
                                f"(known: {list(self._by_name)})") from None

    def link(self, src: str, dst: str) -> Link:
        """The link ``src -> dst`` (or ``dst -> src`` when only that direction is given).

        Raises:
            TopologyError: An endpoint is unknown or no link joins them.
        """
        self.device(src)
        self.device(dst)
        ln = self._table.get((src, dst)) or self._table.get((dst, src))
        if ln is None:
            raise TopologyError(f"links[{src}->{dst}]: node {self.name!r} has no bandwidth "
                                f"entry for this pair")
        return ln

    def bandwidth(self, src: str, dst: str) -> float:
        """Effective bandwidth of ``src -> dst`` in bytes/s (see :meth:`link`)."""
        return self.link(src, dst).bandwidth


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Nodes, their devices and bandwidth tables, and the inter-node bandwidth.

    Attributes:
        nodes: The machines. Single-node topologies have one.
        inter_node_bandwidth: Bytes/s between any two nodes (network), used only when
            ``len(nodes) > 1``.
        source: Where the description came from (``"preset:a100-8"``, ``"detected"``...).
    """

    nodes: tuple[NodeTopology, ...]
    inter_node_bandwidth: float = 12.5e9
    source: str = ""
    _by_name: dict[str, NodeTopology] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        nodes = tuple(self.nodes)
        if not nodes:
            raise TopologyError("nodes: a topology needs at least one node")
        object.__setattr__(self, "nodes", nodes)
        by_name: dict[str, NodeTopology] = {}
        for n in nodes:
            if n.name in by_name:
                raise TopologyError(f"nodes: duplicate node name {n.name!r}")
            by_name[n.name] = n
        object.__setattr__(self, "_by_name", by_name)
        bw = self.inter_node_bandwidth
        if not _is_finite(bw) or bw <= 0:
            raise TopologyError(f"inter_node_bandwidth: must be a positive finite number of "
                                f"bytes/s, got {bw!r}")
        object.__setattr__(self, "inter_node_bandwidth", float(bw))

    # -- naming -------------------------------------------------------------------------------

    @property
    def is_multi_node(self) -> bool:
        """True when the topology has more than one node."""
        return len(self.nodes) > 1

    @property
    def estimated(self) -> bool:
        """True when any bandwidth is a default rather than a measurement."""
        return any(ln.estimated for n in self.nodes for ln in n.links)

    def node(self, name: str) -> NodeTopology:
        """The node called ``name``.

        Raises:
            TopologyError: No such node.
        """
        try:
            return self._by_name[name]
        except KeyError:
            raise TopologyError(f"node: {name!r} is not a node of this topology "
                                f"(known: {list(self._by_name)})") from None

    def qualify(self, node: str, device: str) -> str:
        """Global endpoint name: ``device`` on single-node topologies, else ``"node/device"``."""
        self.node(node).device(device)
        return f"{node}/{device}" if self.is_multi_node else device

    def resolve(self, endpoint: str) -> tuple[str, str]:
        """Split a global endpoint name into ``(node, device)``.

        An unqualified name refers to the first node.

        Raises:
            TopologyError: The node or device is unknown.
        """
        if not isinstance(endpoint, str):
            raise TopologyError(f"endpoint: expected a string, got {endpoint!r}")
        if "/" in endpoint:
            node, dev = endpoint.split("/", 1)
        else:
            node, dev = self.nodes[0].name, endpoint
        self.node(node).device(dev)
        return node, dev

    def has(self, endpoint: str) -> bool:
        """True when ``endpoint`` names a device of this topology."""
        try:
            self.resolve(endpoint)
        except TopologyError:
            return False
        return True

    def endpoints(self) -> tuple[str, ...]:
        """Every endpoint, by global name."""
        return tuple(self.qualify(n.name, d) for n in self.nodes for d in n.device_names)

    def memory(self, endpoint: str) -> int:
        """Free memory of ``endpoint`` in bytes."""
        node, dev = self.resolve(endpoint)
        return self.node(node).device(dev).memory_bytes

    def bandwidth(self, src: str, dst: str) -> float:
        """Effective bandwidth ``src -> dst`` in bytes/s between two global endpoints.

        Same node: the node's table. Different nodes: the slowest of (source -> its host's
        pinned staging memory, the network, destination host's pinned memory -> destination).
        A ``cpu_pinned`` endpoint is the staging memory and skips the segment on its side; so
        does any endpoint of a node without ``cpu_pinned`` that is not an accelerator (an
        accelerator there stages through ``cpu``). Pageable ``cpu`` memory stages through
        pinned memory like an accelerator, so a remote path is never faster than the local
        ``cpu -> cpu_pinned`` copy it includes.
        """
        sn, sd = self.resolve(src)
        dn, dd = self.resolve(dst)
        if sn == dn:
            return self.node(sn).bandwidth(sd, dd)
        segs = [self.inter_node_bandwidth]
        for node, dev, out in ((sn, sd, True), (dn, dd, False)):
            n = self.node(node)
            host = CPU_PINNED if n.has(CPU_PINNED) else CPU
            if is_accelerator(dev) or (dev == CPU and host == CPU_PINNED):
                segs.append(n.bandwidth(dev, host) if out else n.bandwidth(host, dev))
        return min(segs)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def single_node(cls, *, devices: Sequence[DeviceInfo], links: Sequence[Link],
                    name: str = "node0", source: str = "") -> Topology:
        """A one-node topology."""
        return cls(nodes=(NodeTopology(name=name, devices=tuple(devices), links=tuple(links)),),
                   source=source)

    @classmethod
    def detect(cls, *, use_profile_cache: bool = True, cluster: bool | None = None) -> Topology:
        """Describe the current machine, or every node of the Ray cluster this process is
        attached to.

        Devices come from psutil (host memory; pinned memory is budgeted as half of the
        available host memory) and torch (each visible CUDA device's free memory). Bandwidths
        come from the profiler cache (:mod:`conduit.placement.bandwidth`) when a profile for
        this machine exists; the remaining entries are conservative defaults with
        ``estimated=True``. The profiler itself is not run (``conduit profile`` does that).

        Args:
            use_profile_cache: Read measured bandwidths from the cache when present.
            cluster: ``None``: every node of the attached Ray cluster when it has more than
                one, else this machine; ``True``: the attached Ray cluster, however many
                nodes; ``False``: this machine only. On a cluster each node describes itself
                (named :func:`~conduit.placement.cluster.node_name` of its Ray id) and the
                inter-node bandwidth is measured
                (:func:`~conduit.placement.cluster.inter_node_bandwidth`).

        Returns:
            A single-node topology named after the host, or the cluster's.

        Raises:
            ConduitError: ``cluster=True`` without Ray or without an attached cluster.
        """
        if cluster or (cluster is None and ray_cluster.attached_nodes() > 1):
            return cls._detect_cluster(use_profile_cache=use_profile_cache)
        avail = int(psutil.virtual_memory().available)
        devices = [DeviceInfo(name=CPU, memory_bytes=avail, model="host")]
        if torch.cuda.is_available():
            # Page-locking needs a CUDA driver; without one "pinned" would be pageable memory
            # under another name, so the endpoint is not offered to the planner at all.
            devices.append(DeviceInfo(name=CPU_PINNED, memory_bytes=avail // 2,
                                      model="host (pinned)"))
        accs: list[str] = []
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                try:
                    free, _total = torch.cuda.mem_get_info(i)
                except RuntimeError:  # pragma: no cover - depends on the driver
                    free = torch.cuda.get_device_properties(i).total_memory
                devices.append(DeviceInfo(name=f"cuda:{i}", memory_bytes=int(free),
                                          model=torch.cuda.get_device_name(i)))
                accs.append(f"cuda:{i}")
        table = default_links(accs)
        if use_profile_cache:
            prof = load_cached_profile()
            if prof is not None:
                known = (CPU, CPU_PINNED, *accs)
                for (s, d), bw in prof.link_table().items():
                    if s in known and d in known and bw > 0 and math.isfinite(bw):
                        table[(s, d)] = (bw, False)
                # a direction that was not measured takes its measured reverse (the same
                # symmetry rule NodeTopology.link applies to missing entries)
                for (s, d), (_bw, est) in list(table.items()):
                    rev = table.get((d, s))
                    if est and rev is not None and not rev[1]:
                        table[(s, d)] = (rev[0], False)
        present = {dev.name for dev in devices}
        links = tuple(Link(src=s, dst=d, bandwidth=bw, estimated=est)
                      for (s, d), (bw, est) in table.items() if s in present and d in present)
        name = socket.gethostname().split(".")[0] or "node0"
        name = name.replace("/", "_")
        return cls.single_node(devices=devices, links=links, name=name, source="detected")

    @classmethod
    def _detect_cluster(cls, *, use_profile_cache: bool) -> Topology:
        ids = ray_cluster.alive_node_ids()
        nodes = tuple(ray_cluster.on_each_node(ids, _describe_node, use_profile_cache))
        if len(ids) < 2:
            return cls(nodes=nodes, source="detected:ray")
        return cls(nodes=nodes, inter_node_bandwidth=ray_cluster.inter_node_bandwidth(ids),
                   source="detected:ray")

    # -- JSON -----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly description (the format :meth:`from_dict` reads)."""
        return {
            "version": _FORMAT_VERSION,
            "source": self.source,
            "inter_node_bandwidth": self.inter_node_bandwidth,
            "nodes": [{
                "name": n.name,
                "devices": [{"name": d.name, "memory_bytes": d.memory_bytes, "model": d.model}
                            for d in n.devices],
                "links": [{"src": ln.src, "dst": ln.dst, "bandwidth": ln.bandwidth,
                           "estimated": ln.estimated} for ln in n.links],
            } for n in self.nodes],
        }

    def to_json(self, path: str | os.PathLike[str] | None = None, *, indent: int = 1) -> str:
        """Serialize to JSON; also write it to ``path`` when given.

        Returns:
            The JSON text.
        """
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Topology:
        """Build from the :meth:`to_dict` format, validating every key.

        Raises:
            TopologyError: A key is missing or a value is malformed; the message names the key
                (``nodes[0].devices[2].memory_bytes``).
        """
        if not isinstance(d, Mapping):
            raise TopologyError(f"topology: expected a JSON object, got {type(d).__name__}")
        version = d.get("version", _FORMAT_VERSION)
        if version != _FORMAT_VERSION:
            raise TopologyError(f"version: unsupported topology format {version!r} "
                                f"(expected {_FORMAT_VERSION})")
        nodes_raw = _get(d, "nodes", "nodes", list)
        nodes = []
        for i, nd in enumerate(nodes_raw):
            where = f"nodes[{i}]"
            if not isinstance(nd, Mapping):
                raise TopologyError(f"{where}: expected an object, got {nd!r}")
            name = _get(nd, "name", f"{where}.name", str)
            devs = []
            for j, dv in enumerate(_get(nd, "devices", f"{where}.devices", list)):
                w = f"{where}.devices[{j}]"
                if not isinstance(dv, Mapping):
                    raise TopologyError(f"{w}: expected an object, got {dv!r}")
                dname = _get(dv, "name", f"{w}.name", str)
                if any(prev.name == dname for prev in devs):
                    raise TopologyError(f"{w}.name: duplicate device {dname!r}")
                mem = _get(dv, "memory_bytes", f"{w}.memory_bytes", None)
                if not _is_finite(mem) or mem < 0:
                    raise TopologyError(f"{w}.memory_bytes: must be a non-negative finite "
                                        f"number, got {mem!r}")
                devs.append(_wrap(f"{w}", lambda dname=dname, mem=mem, dv=dv: DeviceInfo(
                    name=dname, memory_bytes=mem, model=str(dv.get("model", "")))))
            known = {dv.name for dv in devs}
            links = []
            for j, ln in enumerate(_get(nd, "links", f"{where}.links", list)):
                w = f"{where}.links[{j}]"
                if not isinstance(ln, Mapping):
                    raise TopologyError(f"{w}: expected an object, got {ln!r}")
                src = _get(ln, "src", f"{w}.src", str)
                dst = _get(ln, "dst", f"{w}.dst", str)
                for key, end in (("src", src), ("dst", dst)):
                    if end not in known:
                        raise TopologyError(f"{w}.{key}: unknown device {end!r} "
                                            f"(node {name!r} has {sorted(known)})")
                bw = _get(ln, "bandwidth", f"{w}.bandwidth", None)
                if not _is_finite(bw) or bw <= 0:
                    raise TopologyError(f"{w}.bandwidth: must be a positive finite number of "
                                        f"bytes/s, got {bw!r}")
                links.append(Link(src=src, dst=dst, bandwidth=bw,
                                  estimated=bool(ln.get("estimated", False))))
            nodes.append(_wrap(where, lambda name=name, devs=devs, links=links: NodeTopology(
                name=name, devices=tuple(devs), links=tuple(links))))
        inter = d.get("inter_node_bandwidth", 12.5e9)
        if not _is_finite(inter) or inter <= 0:
            raise TopologyError(f"inter_node_bandwidth: must be a positive finite number of "
                                f"bytes/s, got {inter!r}")
        return cls(nodes=tuple(nodes), inter_node_bandwidth=inter,
                   source=str(d.get("source", "")))

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike[str]) -> Topology:
        """Parse JSON text (a string starting with ``{``), or read the file at a path.

        Raises:
            TopologyError: The file is unreadable, the JSON is malformed, or validation fails.
        """
        text: str | None = None
        if isinstance(text_or_path, str) and text_or_path.lstrip().startswith(("{", "[")):
            text = text_or_path
        if text is None:
            try:
                text = Path(text_or_path).read_text()
            except OSError as exc:
                raise TopologyError(f"topology file: cannot read {str(text_or_path)!r}: "
                                    f"{exc}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TopologyError(f"topology JSON: malformed at line {exc.lineno} column "
                                f"{exc.colno}: {exc.msg}") from exc
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Topology:
        """Read a topology JSON file (see :meth:`from_json`)."""
        return cls.from_json(Path(path))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write this topology as JSON to ``path``."""
        self.to_json(path)

    def describe(self) -> str:
        """A human-readable summary: devices with memory, then the bandwidth table."""
        lines = [f"topology ({self.source or 'custom'}), {len(self.nodes)} node(s)"
                 + (f", inter-node {self.inter_node_bandwidth / 1e9:.1f} GB/s"
                    if self.is_multi_node else "")]
        for n in self.nodes:
            lines.append(f"node {n.name}:")
            for d in n.devices:
                lines.append(f"  {d.name:<12} {d.memory_bytes / 1e9:10.1f} GB  {d.model}")
            for ln in n.links:
                flag = "  (estimated)" if ln.estimated else ""
                lines.append(f"  {ln.src:>10} -> {ln.dst:<10} {ln.bandwidth / 1e9:9.2f} GB/s{flag}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------

DEFAULT_BANDWIDTH = {
    "host_copy": 5e9,        # pageable <-> pinned memcpy, one thread, conservative
    "host_gather": 2e9,      # index_select within host memory
    "pageable_to_device": 6e9,
    "pinned_to_device": 12e9,
    "device_local": 200e9,
    "device_peer": 20e9,     # PCIe peer copy without NVLink
}
"""Conservative defaults used by :meth:`Topology.detect` when nothing was measured (bytes/s)."""


def default_links(accelerators: Sequence[str]) -> dict[tuple[str, str], tuple[float, bool]]:
    """Conservative, ``estimated`` bandwidth entries for a node with these accelerators.

    Returns:
        ``{(src, dst): (bytes_per_s, estimated=True)}``.
    """
    b = DEFAULT_BANDWIDTH
    t: dict[tuple[str, str], tuple[float, bool]] = {
        (CPU, CPU): (b["host_gather"], True),
        (CPU_PINNED, CPU_PINNED): (b["host_gather"], True),
        (CPU, CPU_PINNED): (b["host_copy"], True),
        (CPU_PINNED, CPU): (b["host_copy"], True),
    }
    for a in accelerators:
        t[(CPU, a)] = (b["pageable_to_device"], True)
        t[(a, CPU)] = (b["pageable_to_device"], True)
        t[(CPU_PINNED, a)] = (b["pinned_to_device"], True)
        t[(a, CPU_PINNED)] = (b["pinned_to_device"], True)
        t[(a, a)] = (b["device_local"], True)
        for c in accelerators:
            if c != a:
                t[(a, c)] = (b["device_peer"], True)
    return t


def _describe_node(name: str, use_profile_cache: bool) -> NodeTopology:
    """This machine as the node ``name`` (run on each node of a cluster)."""
    node = Topology.detect(use_profile_cache=use_profile_cache, cluster=False).nodes[0]
    return NodeTopology(name=name, devices=node.devices, links=node.links)


def _rank_key(name: str) -> tuple[str, int]:
    kind, _, idx = name.partition(":")
    return (kind, int(idx) if idx.isdigit() else -1)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_finite(v: Any) -> bool:
    """An int or float that is finite as a float (an int too large for one is not)."""
    return _is_number(v) and finite_float(v) is not None


def _get(d: Mapping[str, Any], key: str, where: str, typ: type | None) -> Any:
    if key not in d:
        raise TopologyError(f"{where}: missing key {key!r}")
    v = d[key]
    if typ is not None and not isinstance(v, typ):
        raise TopologyError(f"{where}: expected {typ.__name__}, got {v!r}")
    return v


def _wrap(where: str, make: Any) -> Any:
    try:
        return make()
    except TopologyError as exc:
        raise TopologyError(f"{where}: {exc}") from exc
