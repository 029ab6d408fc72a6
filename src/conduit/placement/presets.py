"""Named topologies for planning and tests on machines that lack the hardware.

Every number here is a documented *estimate*, not a measurement on this machine; the
provenance of each is given in the builder's docstring. Use :func:`preset` to get one by name:

============== ==================================================================================
name           what
============== ==================================================================================
``a100-8``     the paper's evaluation node: 8x A100 80 GB, NVLink/NVSwitch, PCIe 4, 2 TB host RAM
``a100-8x2``   two such nodes joined by a 200 Gb/s (25 GB/s) network
``mi250x-8``   the MI250X node of the paper's Fig. 4a: GCD links 400/200/100 GB/s,
               CPU<->GCD 72 GB/s, fast ranks 0/2/4/6
``mi250x-8-fig4b`` the same node with GPU<->GPU bandwidths derived from the Fig. 4b latency
               heatmap (5 GB transfers) instead of the link classes
============== ==================================================================================
"""

from __future__ import annotations

from collections.abc import Callable

from conduit._checks import check_int
from conduit.errors import ConfigError
from conduit.placement.endpoints import CPU, CPU_PINNED
from conduit.placement.topology import DeviceInfo, Link, NodeTopology, Topology

GiB = 1024**3
GB = 1e9

DEVICE_RESERVE_BYTES = 8 * GiB
"""Accelerator memory held back from the buffer in presets: CUDA/HIP context (~0.5-1.5 GiB)
plus the learner's parameters, optimizer state and activations. Free memory in a preset is the
device's HBM minus this reserve."""


def _host_links(*, host_copy: float, host_gather: float) -> list[Link]:
    return [Link(src=CPU, dst=CPU, bandwidth=host_gather),
            Link(src=CPU_PINNED, dst=CPU_PINNED, bandwidth=host_gather),
            Link(src=CPU, dst=CPU_PINNED, bandwidth=host_copy),
            Link(src=CPU_PINNED, dst=CPU, bandwidth=host_copy)]


def _node(*, name: str, n_gpu: int, gpu_mem: int, gpu_model: str, host_mem: int,
          host_copy: float, host_gather: float, pageable_dev: float, pinned_dev: float,
          device_local: float, peer: Callable[[int, int], float]) -> NodeTopology:
    devices = [DeviceInfo(name=CPU, memory_bytes=host_mem, model="host DRAM"),
               DeviceInfo(name=CPU_PINNED, memory_bytes=host_mem // 2,
                          model="host DRAM (pinned)")]
    devices += [DeviceInfo(name=f"cuda:{i}", memory_bytes=gpu_mem, model=gpu_model)
                for i in range(n_gpu)]
    links = _host_links(host_copy=host_copy, host_gather=host_gather)
    for i in range(n_gpu):
        g = f"cuda:{i}"
        links += [Link(src=CPU, dst=g, bandwidth=pageable_dev),
                  Link(src=g, dst=CPU, bandwidth=pageable_dev),
                  Link(src=CPU_PINNED, dst=g, bandwidth=pinned_dev),
                  Link(src=g, dst=CPU_PINNED, bandwidth=pinned_dev),
                  Link(src=g, dst=g, bandwidth=device_local)]
        links += [Link(src=g, dst=f"cuda:{j}", bandwidth=peer(i, j))
                  for j in range(n_gpu) if j != i]
    return NodeTopology(name=name, devices=tuple(devices), links=tuple(links))


def a100_8(*, nodes: int = 1, inter_node_bandwidth: float = 25 * GB) -> Topology:
    """The paper's evaluation node (§7): 8x NVIDIA A100 80 GB, optionally several of them.

    Numbers and where they come from:

    * GPU memory: 80 GiB HBM2e per A100-80GB (datasheet) minus
      :data:`DEVICE_RESERVE_BYTES` -> 72 GiB free for the buffer.
    * GPU<->GPU: NVLink 3 through NVSwitch gives 600 GB/s bidirectional, i.e. 300 GB/s per
      direction, uniform over all pairs (DGX/HGX A100 datasheet); effective peer copies reach
      ~250-280 GB/s, we use the brief's 300 GB/s.
    * Device-local gather: HBM2e peak 2.0 TB/s; a gather reads and writes, ~1 TB/s effective.
    * CPU<->GPU: PCIe 4.0 x16, 32 GB/s peak, ~25 GB/s from pinned memory (bandwidthTest);
      pageable copies are staged by the driver and reach ~10 GB/s.
    * Host: 2 TB DRAM; 1.9 TB assumed available; pinned budget half of it. Single-threaded
      host memcpy / gather on EPYC-class CPUs: ~10 GB/s.
    * Inter-node: HDR InfiniBand 200 Gb/s = 25 GB/s per direction.

    Args:
        nodes: Number of identical nodes (``"node0"``, ``"node1"``...).
        inter_node_bandwidth: Network bandwidth between nodes in bytes/s.
    """
    nodes = check_int("nodes", nodes, minimum=1)
    ns = tuple(_node(name=f"node{k}", n_gpu=8, gpu_mem=80 * GiB - DEVICE_RESERVE_BYTES,
                     gpu_model="NVIDIA A100-SXM4-80GB", host_mem=int(1.9e12),
                     host_copy=10 * GB, host_gather=10 * GB, pageable_dev=10 * GB,
                     pinned_dev=25 * GB, device_local=1000 * GB,
                     peer=lambda i, j: 300 * GB)
               for k in range(nodes))
    name = "a100-8" if nodes == 1 else f"a100-8x{nodes}"
    return Topology(nodes=ns, inter_node_bandwidth=inter_node_bandwidth, source=f"preset:{name}")


MI250X_FAST_RANKS = (0, 2, 4, 6)
"""GCD ranks with the high-bandwidth fabric connections in the ``mi250x-8`` preset."""


def _mi250x_link_class(i: int, j: int) -> float:
    """Link-class bandwidth between GCDs ``i`` and ``j`` (Fig. 4a, as read for this preset)."""
    fast = set(MI250X_FAST_RANKS)
    if i in fast and j in fast:
        return 400 * GB
    if i // 2 == j // 2:  # the two GCDs of one MI250X package
        return 200 * GB
    return 100 * GB


# Fig. 4b of the paper: GPU->GPU latency (ms) of a 5 GB transfer, source row, destination
# column, as read from the heatmap's cell labels in the paper text.
MI250X_FIG4B_LATENCY_MS = (
    (2, 53, 145, 146, 141, 146, 80, 107),
    (52, 3, 144, 146, 146, 147, 105, 107),
    (145, 146, 2, 54, 81, 106, 144, 146),
    (142, 146, 51, 3, 106, 107, 146, 146),
    (142, 146, 74, 107, 3, 42, 146, 146),
    (142, 147, 105, 107, 40, 3, 144, 146),
    (77, 105, 144, 147, 146, 146, 2, 41),
    (102, 107, 146, 147, 144, 147, 40, 3),
)


def mi250x_8(*, from_heatmap: bool = False) -> Topology:
    """The 8-GCD AMD MI250X node of the paper's Fig. 4 (4 packages x 2 GCDs).

    Numbers and where they come from:

    * GCD memory: 64 GB HBM2e per GCD (Fig. 4 caption / MI250X datasheet: 128 GB per package)
      -> 64 GiB minus :data:`DEVICE_RESERVE_BYTES` = 56 GiB free for the buffer.
    * GPU<->GPU (default): the three Infinity Fabric link classes of Fig. 4a, 400 / 200 /
      100 GB/s. As a modelling choice, ranks 0/2/4/6 (:data:`MI250X_FAST_RANKS`) are the
      fast ranks: any two of them are joined at 400 GB/s, a rank and its package partner
      (``2k``, ``2k+1``) at 200 GB/s, every other pair at 100 GB/s. This is a planning model of
      the link classes, not a measurement.
    * GPU<->GPU (``from_heatmap=True``): 5 GB divided by the Fig. 4b latencies
      (:data:`MI250X_FIG4B_LATENCY_MS`), i.e. 34-125 GB/s effective; there the package partner
      is the fastest peer.
    * CPU<->GCD: 72 GB/s (Fig. 4a, 36+36 GB/s Infinity Fabric CPU links) from pinned memory;
      pageable copies are assumed to reach half of that (driver staging).
    * Device-local gather: HBM2e 1.6 TB/s peak per GCD, ~1 TB/s effective for a gather.
    * Host: 512 GB DRAM (Frontier-class node), 480 GB assumed available; ~10 GB/s
      single-threaded memcpy / gather.

    Args:
        from_heatmap: Use the Fig. 4b-derived peer bandwidths instead of the link classes.
    """
    if from_heatmap:
        lat = MI250X_FIG4B_LATENCY_MS

        def peer(i: int, j: int) -> float:
            return 5 * GB / (lat[i][j] * 1e-3)
        name = "mi250x-8-fig4b"
    else:
        peer = _mi250x_link_class
        name = "mi250x-8"
    node = _node(name="node0", n_gpu=8, gpu_mem=64 * GiB - DEVICE_RESERVE_BYTES,
                 gpu_model="AMD Instinct MI250X (GCD)", host_mem=480 * 10**9,
                 host_copy=10 * GB, host_gather=10 * GB, pageable_dev=36 * GB,
                 pinned_dev=72 * GB, device_local=1000 * GB, peer=peer)
    return Topology(nodes=(node,), source=f"preset:{name}")


_PRESETS: dict[str, Callable[[], Topology]] = {
    "a100-8": lambda: a100_8(nodes=1),
    "a100-8x2": lambda: a100_8(nodes=2),
    "mi250x-8": lambda: mi250x_8(),
    "mi250x-8-fig4b": lambda: mi250x_8(from_heatmap=True),
}


def preset_names() -> tuple[str, ...]:
    """Names accepted by :func:`preset`."""
    return tuple(_PRESETS)


def preset(name: str) -> Topology:
    """A named topology (see the module docstring for the list).

    Raises:
        ConfigError: ``name`` is not a known preset (field ``preset``).
    """
    try:
        make = _PRESETS[name]
    except KeyError:
        raise ConfigError("preset", f"unknown topology preset {name!r} "
                                    f"(known: {', '.join(_PRESETS)})") from None
    return make()
