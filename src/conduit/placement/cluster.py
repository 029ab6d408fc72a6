"""Probes of a running Ray cluster for :meth:`Topology.detect`: its alive nodes, a function run
on each of them, and the network between them.

Functions run on a node through tasks pinned to it with node-affinity scheduling; the
inter-node bandwidth is measured by moving objects through Ray's object store from the first
node to each other one, the path a remote shard's rows take. Ray is imported on call; it comes
with ``pip install 'conduit-rl[ray]'``.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from conduit.errors import ConduitError, ConfigError

RAY_HINT = "pip install 'conduit-rl[ray]'"

T = TypeVar("T")


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConduitError(f"ray is not installed ({exc}); {RAY_HINT}") from exc
    return ray


def ray_attached() -> bool:
    """Whether this process is attached to Ray (False when it never imported Ray: this never
    imports it)."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(getattr(ray, "is_initialized", lambda: False)())


def attached_nodes() -> int:
    """Alive nodes of the Ray cluster this process is attached to; 0 when it is not attached
    or never imported Ray (this never imports it)."""
    if not ray_attached():
        return 0
    return sum(1 for n in sys.modules["ray"].nodes() if n.get("Alive"))


def alive_node_ids() -> list[str]:
    """The alive nodes' Ray ids, sorted.

    Raises:
        ConduitError: Ray is not installed, or this process is not attached to a cluster.
    """
    ray = _ray()
    if not ray.is_initialized():
        raise ConduitError("not attached to a Ray cluster: call ray.init(address=...) first")
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def node_name(node_id: str) -> str:
    """The topology name of the Ray node ``node_id``: ``"ray-"`` and its first 12 hex digits."""
    return f"ray-{node_id[:12]}"


def _pinned(node_id: str) -> dict[str, Any]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"num_cpus": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)}


def on_each_node(node_ids: list[str], fn: Callable[..., T], *args: Any) -> list[T]:
    """``fn(node_name(id), *args)`` run on each node, in ``node_ids`` order."""
    ray = _ray()
    task = ray.remote(fn)
    return ray.get([task.options(**_pinned(i)).remote(node_name(i), *args) for i in node_ids])


class _Probe:
    """Runs on one node: makes objects there, or fetches another node's and times it."""

    def make(self, nbytes: int) -> np.ndarray:
        return np.ones(nbytes, dtype=np.uint8)

    def fetch(self, refs: list[Any]) -> float:
        ray = _ray()
        t0 = time.perf_counter()
        ray.get(refs[0])
        return time.perf_counter() - t0


def inter_node_bandwidth(node_ids: list[str], *, probe_bytes: int = 32 << 20,
                         repeats: int = 3) -> float:
    """Bytes/s of an object moved from ``node_ids[0]`` to each other node through Ray's object
    store: the median of ``repeats`` fresh objects per pair, the slowest pair reported.

    Raises:
        ConfigError: Fewer than two nodes, or a non-positive probe size or repeat count.
    """
    if len(node_ids) < 2:
        raise ConfigError("node_ids", f"need at least two nodes, got {len(node_ids)}")
    if probe_bytes < 1 or repeats < 1:
        raise ConfigError("probe_bytes", "probe_bytes and repeats must be positive")
    ray = _ray()
    probe = ray.remote(_Probe)
    actors = [probe.options(**_pinned(n)).remote() for n in node_ids]
    try:
        per_pair = []
        for dst in actors[1:]:
            rates = []
            for _ in range(repeats):
                ref = actors[0].make.remote(probe_bytes)
                ray.wait([ref], fetch_local=False)
                rates.append(probe_bytes / ray.get(dst.fetch.remote([ref])))
                del ref
            per_pair.append(statistics.median(rates))
        return min(per_pair)
    finally:
        for a in actors:
            ray.kill(a)
