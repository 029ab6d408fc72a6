"""The shard actors of one plane: where they run, who replicates whom, and their restore.

Shard ``k`` runs on a live node chosen round robin over the nodes that have what a shard
reserves, pinned there with Ray's ``NodeAffinitySchedulingStrategy``. Its rows are replicated
on the next ``replication - 1`` shards that run on other nodes (on any other shard when there
are fewer nodes than copies). A shard found dead is re-created (on its node if that node lives,
else on the least loaded live node), its primary rows are copied from a live replica, shard to
shard through Ray's object store, and the replicas it kept for others are copied from their
primaries. Without a live replica its rows are lost, and the count is reported (docs/design.md,
distributed faults); its new ring's row ids continue above every id it ever gave out
(off-policy), so an update for a lost row never reaches a new one.

The set also records what every holder reported after the last change it applied, so a read
can be served by any copy that is current (:meth:`ShardSet.read_from`). The plane's ports are
bound to nodes of the cluster (:class:`ClusterNodes`).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conduit.distributed._ray import actor_died_errors, alive_nodes
from conduit.distributed.errors import ShardUnavailableError
from conduit.distributed.sampling import nearest_copy
from conduit.distributed.shard import BufferShard, HeldRows, RemoteError, ShardSpec
from conduit.errors import ConfigError, PlaneClosedError

_RESERVED = ("CPU", "GPU", "memory", "object_store_memory")
"""Ray resources ``ShardResources.resources`` may not name."""


def _amount(v: Any) -> bool:
    """Whether ``v`` is a resource amount: a finite real number >= 0 (not a bool)."""
    return (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            and v >= 0)


@dataclass(frozen=True)
class ShardResources:
    """Ray resources each shard actor reserves on its node.

    Attributes:
        num_cpus: CPUs (fractions allowed).
        num_gpus: GPUs.
        memory: Bytes of memory to reserve (None: no reservation).
        resources: Custom resources, e.g. ``{"buffer_host": 1}``.
    """

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory: int | None = None
    resources: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("num_cpus", "num_gpus"):
            v = getattr(self, name)
            if not _amount(v):
                raise ConfigError(f"shard_resources.{name}", f"must be a finite number >= 0, "
                                                             f"got {v!r}")
        if self.memory is not None and (isinstance(self.memory, bool)
                                        or not isinstance(self.memory, int) or self.memory < 1):
            raise ConfigError("shard_resources.memory", f"must be a positive int of bytes or "
                                                        f"None, got {self.memory!r}")
        if not isinstance(self.resources, dict):
            raise ConfigError("shard_resources.resources", f"must be a dict of resource name "
                                                           f"to amount, got {self.resources!r}")
        for key, v in self.resources.items():
            if not isinstance(key, str) or not key or key in _RESERVED:
                raise ConfigError("shard_resources.resources", f"names a custom resource, got "
                                                               f"{key!r} (CPUs, GPUs and memory "
                                                               f"have their own fields)")
            if not _amount(v):
                raise ConfigError(f"shard_resources.resources[{key!r}]",
                                  f"must be a finite number >= 0, got {v!r}")

    def demand(self) -> dict[str, float]:
        """What one shard needs of a node, by Ray resource name (amounts above 0)."""
        need = {"CPU": self.num_cpus, "GPU": self.num_gpus, "memory": self.memory or 0,
                **self.resources}
        return {k: float(v) for k, v in need.items() if v > 0}

    def options(self) -> dict[str, Any]:
        """Keyword arguments of ``ActorClass.options``."""
        out: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory is not None:
            out["memory"] = self.memory
        if self.resources:
            out["resources"] = dict(self.resources)
        return out


@dataclass(frozen=True)
class ShardRecovery:
    """One re-created shard.

    Attributes:
        shard: Its id.
        old_node: The node it died on.
        new_node: The node it runs on now.
        source: The shard its rows were copied from (None: no live replica).
        restored_rows: Rows restored.
        lost_rows: Rows lost (those it held when no replica lived).
        seconds: Time from detection to the restored shard answering.
    """

    shard: int
    old_node: str
    new_node: str
    source: int | None
    restored_rows: int
    lost_rows: int
    seconds: float


SHARD_START_S = 120.0
"""The least time the shards of a new plane are given to start, whatever the plane's
``timeout``: a shard's start includes a Ray worker process's (its interpreter, torch and
Conduit imported), which takes seconds more on a loaded node than any call does (docs/design.md,
the sharded plane). Ray itself waits for an actor's start without a bound; this one only
keeps a plane whose shards never start from waiting forever."""


def start_deadline(timeout: float, now: float) -> float:
    """When the shards of a plane whose calls may take ``timeout`` seconds must have started,
    from ``now``: ``timeout`` or :data:`SHARD_START_S`, whichever is longer."""
    return now + max(timeout, SHARD_START_S)


def replica_sets(nodes: list[str], replication: int) -> list[list[int]]:
    """For each shard (running on ``nodes[k]``), the shards holding its replicas: the next
    shards in ring order on other nodes first, then the next on any node."""
    n = len(nodes)
    out = []
    for k in range(n):
        ring = [(k + j) % n for j in range(1, n)]
        other = [s for s in ring if nodes[s] != nodes[k]]
        same = [s for s in ring if nodes[s] == nodes[k]]
        out.append((other + same)[:replication - 1])
    return out


class ShardSet:
    """The actors of a sharded buffer and the bookkeeping the front needs.

    Args:
        ray: The ``ray`` module (connected).
        num_shards: Shards.
        replication: Copies of every row (1: no replica).
        config: What each shard is built from.
        resources: What each shard reserves.
        timeout: Seconds any remote call may take before :class:`ShardUnavailableError`;
            the shards' start may take :data:`SHARD_START_S` if that is longer.
    """

    def __init__(self, ray: Any, *, num_shards: int, replication: int, config: ShardSpec,
                 resources: ShardResources, timeout: float) -> None:
        self.ray, self.config, self.resources, self.timeout = ray, config, resources, timeout
        self._died = actor_died_errors(ray)
        self._cls = ray.remote(BufferShard)
        live = alive_nodes(ray, resources.demand())
        if not live:
            raise ShardUnavailableError(None, f"no live node has what a shard reserves "
                                              f"({resources.demand()}); lower shard_resources "
                                              f"or add nodes that have it")
        self.nodes = [live[k % len(live)] for k in range(num_shards)]
        self.replicas = replica_sets(self.nodes, replication)
        self.held = [HeldRows(0, 0, 0.0, 1.0) for _ in range(num_shards)]
        # the most rows each owner ever wrote (a ring restarted after a total loss counts
        # from 0 again; ids below this mark were real rows, delivered perhaps)
        self.high_water = [0] * num_shards
        # how often each owner's ring was started afresh (every copy lost): a write whose
        # count predates a restart goes to the new ring, it is no retry of a write there
        self.restarts = [0] * num_shards
        # owner -> holder -> what that holder reported after the last change it applied
        self.copies: list[dict[int, HeldRows]] = [
            dict.fromkeys(self.holders(k), self.held[k]) for k in range(num_shards)]
        self.recoveries: list[ShardRecovery] = []
        self._pending: dict[int, tuple[str, float]] = {}  # re-created, not yet restored
        self.closed = False  # kill_all() ran: nothing is re-created any more
        self._life = threading.Lock()  # closed, and the actors made while it is False
        self._lost: dict[int, int] = {}  # re-created without a replica: rows lost with it
        self.actors = [self._spawn(k, self.nodes[k]) for k in range(num_shards)]
        try:
            self.get([a.ping.remote() for a in self.actors],
                     start_deadline(timeout, time.monotonic()), shard=None)
        except BaseException:  # (a shard Ray cannot place) no actor is left behind
            self.kill_all()
            raise

    def __len__(self) -> int:
        return len(self.actors)

    def _spawn(self, k: int, node: str) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        return self._cls.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            max_restarts=0, max_concurrency=1, **self.resources.options(),
        ).remote(shard_id=k, config=self.config)

    @property
    def unrestored(self) -> bool:
        """A shard was re-created but its restore did not finish (call :meth:`heal`)."""
        return bool(self._pending)

    def holders(self, owner: int) -> list[int]:
        """Shards holding ``owner``'s rows: its primary first, then its replicas."""
        return [owner, *self.replicas[owner]]

    def acknowledged(self, owner: int, states: list[HeldRows]) -> None:
        """Every holder of ``owner`` (in :meth:`holders` order) applied a change and reported
        ``states``; the primary's is the owner's state."""
        self.held[owner] = states[0]
        self.high_water[owner] = max(self.high_water[owner], states[0].total_written)
        self.copies[owner] = dict(zip(self.holders(owner), states, strict=True))

    def current(self, owner: int) -> list[int]:
        """Holders of ``owner`` whose copy equals the primary's (none while a restore of the
        owner or of the holder is unfinished)."""
        if owner in self._pending:
            return []
        want = self.held[owner]
        return [h for h, got in self.copies[owner].items()
                if h not in self._pending and got == want]

    def read_from(self, owner: int, node: str | None) -> int:
        """The shard a reader on ``node`` fetches ``owner``'s rows from: a current copy on
        ``node`` (the primary first), else the primary."""
        return nearest_copy(owner, self.holders(owner), self.nodes, node, self.current(owner))

    def probe(self, skip: set[int]) -> dict[int, Any]:
        """Pings to the shards not in ``skip``. A draw reads a shard's rows from one copy, so
        it may contact no copy of a dead shard; its probes still find it dead."""
        return {k: self.actors[k].ping.remote() for k in range(len(self)) if k not in skip}

    def any_died(self, probes: dict[int, Any]) -> bool:
        """Whether a probe that has answered found its shard dead (probes still running are
        not waited for: a busy shard is not a dead one)."""
        refs = list(probes.values())
        if not refs:
            return False
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            try:
                self.ray.get(ref, timeout=0)
            except Exception as exc:
                if not self.is_death(exc):
                    raise
                return True
        return False

    def shards_on(self, node: str) -> list[int]:
        """Shards running on ``node``."""
        return [k for k, n in enumerate(self.nodes) if n == node]

    def _check_open(self) -> None:
        if self.closed:
            raise PlaneClosedError("the sharded plane is closed")

    def get(self, refs: Any, deadline: float, *, shard: int | None) -> Any:
        """``ray.get`` bounded by ``deadline``; the task's own Conduit error is re-raised.

        Raises:
            ShardUnavailableError: The deadline passed.
            RayActorError (and kin): A shard died (the caller heals and retries).
            PlaneClosedError: :meth:`kill_all` ended the shards while the call waited (a
                call in flight when the plane closed).
        """
        try:
            return self._get(refs, deadline, shard=shard)
        except Exception as exc:
            if self.closed:
                raise PlaneClosedError("the sharded plane is closed") from exc
            raise

    def _get(self, refs: Any, deadline: float, *, shard: int | None) -> Any:
        exc_mod = self.ray.exceptions
        left = max(0.0, deadline - time.monotonic())
        try:
            return self.ray.get(refs, timeout=left)
        except exc_mod.GetTimeoutError as exc:
            raise ShardUnavailableError(shard,
                                        f"no answer within the {left:g} s left of the call's "
                                        f"timeout (the plane's is {self.timeout:g} s); pass "
                                        f"a longer timeout") from exc
        except getattr(exc_mod, "ActorUnschedulableError", ()) as exc:
            raise ShardUnavailableError(shard,
                                        f"Ray cannot place the shard on its node ({exc}); "
                                        f"lower shard_resources or free the node") from exc
        except exc_mod.RayTaskError as exc:
            if isinstance(exc, self._died):
                raise
            self.settle(refs, deadline)
            cause = getattr(exc, "cause", None)
            if isinstance(cause, RemoteError):
                raise cause.rebuild() from None
            raise

    def settle(self, refs: Any, deadline: float) -> None:
        """Fetch the outcome of every task in ``refs`` once one of them failed: ``ray.get``
        of a list stops at the first error, and Ray logs the errors nobody fetched (the other
        holders refusing the same rows) as unhandled. Bounded by ``deadline``."""
        if not isinstance(refs, list) or len(refs) < 2:
            return
        for ref in refs:
            try:
                self.ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # each outcome is only marked as seen
                continue

    def is_death(self, exc: BaseException) -> bool:
        """Whether ``exc`` says a shard's actor or node is gone."""
        return isinstance(exc, self._died)

    def dead(self, deadline: float) -> list[int]:
        """Shards whose actor is gone (a ping answers with an actor error)."""
        refs = [a.ping.remote() for a in self.actors]
        out = []
        for k, ref in enumerate(refs):
            try:
                self.get(ref, deadline, shard=k)
            except ShardUnavailableError:
                raise
            except Exception as exc:
                if not self.is_death(exc):
                    raise
                out.append(k)
        return out

    def heal(self, deadline: float) -> list[ShardRecovery]:
        """Re-create every dead shard and restore its rows and the replicas it kept. A shard
        whose restore did not finish (the deadline passed) is restored by the next call.

        Raises:
            ShardUnavailableError: A shard could not be re-created or restored before
                ``deadline``.
            PlaneClosedError: :meth:`kill_all` ran (the shards were ended on purpose; nothing
                is re-created).
        """
        self._check_open()
        dead = self.dead(deadline)
        self._check_open()
        now = time.monotonic()
        if dead:
            live = alive_nodes(self.ray, self.resources.demand())
        for k in dead:
            with contextlib.suppress(Exception):  # it is gone already
                self.ray.kill(self.actors[k], no_restart=True)
            self._pending.setdefault(k, (self.nodes[k], now))
            self.nodes[k] = self._home(k, live)
            with self._life:  # kill_all() on another thread ends it, or it is never made
                self._check_open()
                self.actors[k] = self._spawn(k, self.nodes[k])
        todo = sorted(self._pending)
        if not todo:
            return []
        self.get([self.actors[k].ping.remote() for k in todo], deadline, shard=todo[0])
        sources: dict[int, int | None] = {}
        for k in todo:
            sources[k] = next((r for r in self.replicas[k] if r not in todo), None)
            if sources[k] is not None:
                state = self.actors[sources[k]].export.remote(k)
                self.held[k] = self.get(self.actors[k].restore.remote(k, state), deadline,
                                        shard=k)
            else:  # a fresh ring, its ids above all the lost ones (on-policy: from 0)
                self._lost.setdefault(k, self.held[k].size)
                self.held[k] = self.get(self.actors[k].start_at.remote(k, self._fresh_id(k)),
                                        deadline, shard=k)
                self.restarts[k] += 1
            self.copies[k][k] = self.held[k]
        for k in todo:  # the replicas the dead shard kept for others
            owners = [o for o in range(len(self)) if k in self.replicas[o]]
            refs = [self.actors[k].restore.remote(o, self.actors[o].export.remote(o))
                    for o in owners]
            for o, state in zip(owners, self.get(refs, deadline, shard=k), strict=True):
                self.copies[o][k] = state
        out = []
        for k in todo:
            old_node, since = self._pending.pop(k)
            out.append(ShardRecovery(k, old_node, self.nodes[k], sources[k], self.held[k].size,
                                     self._lost.pop(k, 0), time.monotonic() - since))
        self.recoveries.extend(out)
        return out

    def _fresh_id(self, k: int) -> int:
        """The first row id of shard ``k``'s re-created ring when every copy was lost: the
        next multiple of its capacity at or above every id it gave out (0 on-policy, where
        each iteration's rows count from 0 again)."""
        if self.config.sampler == "fifo":
            return 0
        cap = self.config.capacity
        top = max(self.high_water[k], self.held[k].total_written)
        return -(-top // cap) * cap

    def _home(self, k: int, live: list[str]) -> str:
        """Where shard ``k`` is re-created: its node if alive, else the live node with the
        fewest shards, avoiding when possible the nodes of its replicas and of the owners it
        keeps a replica for (no two copies of a row on one node)."""
        if self.nodes[k] in live:
            return self.nodes[k]
        if not live:
            raise ShardUnavailableError(k, "no live node to re-create the shard on")
        load = Counter(n for j, n in enumerate(self.nodes) if j != k)
        owners = [o for o in range(len(self.replicas)) if k in self.replicas[o]]
        avoid = {self.nodes[r] for r in [*self.replicas[k], *owners]}
        return min(live, key=lambda n: (n in avoid, load[n], live.index(n)))

    def kill_all(self) -> None:
        """End every shard actor; from now on :meth:`heal` re-creates none and every call
        waiting on a shard raises :class:`PlaneClosedError` (safe while a heal runs on
        another thread: an actor it re-creates is ended here, or not created)."""
        with self._life:
            self.closed = True
            actors = list(self.actors)
        if not self.ray.is_initialized():  # Ray (and the actors) gone: ray.kill would start one
            return
        for a in actors:
            with contextlib.suppress(Exception):  # already gone
                self.ray.kill(a, no_restart=True)


class ClusterNodes:
    """The Ray node ids a plane's ports may be bound to: the cluster's nodes, whose list is
    asked again only for an id not seen before.

    Args:
        ray: The ``ray`` module (connected).
        known: The ids known at first (the driver's node and the shards').
        check_open: Raises :class:`PlaneClosedError` once the plane is closed (the cluster
            is not asked then: its Ray may be gone).
    """

    def __init__(self, ray: Any, known: set[str], check_open: Callable[[], None]) -> None:
        self._ray, self._known, self._check_open = ray, known, check_open

    def check(self, node: str | None) -> None:
        """Refuse a node id that is not (and was never) a node of the cluster.

        Raises:
            ConfigError: ``node`` is not a node of the cluster.
            PlaneClosedError: ``node`` was not seen before and the plane is closed.
        """
        if node is None:
            return
        if not isinstance(node, str):
            raise ConfigError("node", f"expected a Ray node id (a str) or None, got {node!r}")
        if node in self._known:
            return
        self._check_open()  # the cluster is not asked once closed (its Ray may be gone)
        self._known = {n["NodeID"] for n in self._ray.nodes()}
        if node not in self._known:
            raise ConfigError("node", f"{node!r} is not a node of the cluster; pass a Ray "
                                      f"node id (ray.nodes(), plane.nodes)")
