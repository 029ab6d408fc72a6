"""``RayExperienceDataPlane``: one plane whose buffer is sharded over Ray actors on several
nodes, with every row replicated on other nodes so that losing a shard loses nothing.

The front runs in the driver. It orders every change of a shard's rows (pushes, priority
updates, on-policy clears) and sends it to the shard and its replicas in that order
(:mod:`conduit.distributed.replication`), so each replica is the same ring as its primary,
slot for slot. Payloads go into Ray's object store once (``ray.put``, numpy columns read
without a copy) and every holder reads the same object. The Fig. 8 ingestion operator runs in
the front, before that ordering, and the delivery operator on each learner rank's thread
(:mod:`conduit.distributed.operators`, :mod:`conduit.distributed.delivery`).

The plane composes the front's parts: the push path (:mod:`conduit.distributed.ingress`),
priority updates and iteration clears (:mod:`conduit.distributed.changes`), and its open and
closed life on the Ray it uses (:mod:`conduit.distributed.lifecycle`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch

from conduit.distributed._ray import connect
from conduit.distributed.changes import FrontChanges
from conduit.distributed.cluster import ClusterNodes, ShardRecovery, ShardResources, ShardSet
from conduit.distributed.delivery import DeviceArg, LearnerPort, rank_devices
from conduit.distributed.ingress import Ingress
from conduit.distributed.iteration import IterationGate
from conduit.distributed.lifecycle import PlaneLifecycle
from conduit.distributed.operators import ScheduledOperators
from conduit.distributed.replication import Replicator
from conduit.distributed.shard import shard_spec_for
from conduit.errors import ConfigError
from conduit.plane.config import PlaneConfig
from conduit.plane.config import policy_version as check_policy_version
from conduit.scheduling.space import Mode, ScheduleSpace
from conduit.spec import Batch, ExperienceSpec
from conduit.storage import Placement, Sampler

SamplerArg = Literal["uniform", "prioritized"] | Sampler | None


def check_counts(*, num_shards: Any, replication: Any, num_learners: Any) -> None:
    """Refuse shard, copy and learner counts that are not integers >= 1.

    Raises:
        ConfigError: Named after the first such argument.
    """
    for name, value, low in (("num_shards", num_shards, 1), ("replication", replication, 1),
                             ("num_learners", num_learners, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(name, f"must be an integer >= {low}, got {value!r}")


def refuse_unsharded(*, rollout_rows: int | None, store: Any) -> None:
    """Refuse the local plane's arguments a sharded plane has no use for.

    Raises:
        ConfigError: ``rollout_rows`` or ``store`` is not None (named).
    """
    for name, value in (("rollout_rows", rollout_rows), ("store", store)):
        if value is not None:
            raise ConfigError(name, "not available on a sharded plane (each shard builds "
                                    "its own store; units are ingested whole); leave it "
                                    "unset")


def check_sharding(cfg: PlaneConfig, *, num_shards: int, replication: int, num_learners: int,
                   shard_resources: Any, placement: Any) -> None:
    """Refuse a layout of shards, copies and learner ranks that cannot hold ``cfg``'s rows.

    Raises:
        ConfigError: More copies than shards; ``shard_resources`` that is not a
            :class:`ShardResources` or ``placement`` that is not a
            :class:`~conduit.storage.Placement` (None allowed for both); on-policy, more ranks
            than rows in a mini-batch.
    """
    if replication > num_shards:
        raise ConfigError("replication", f"{replication} copies need at least as many "
                                         f"shards, got num_shards={num_shards}")
    if shard_resources is not None and not isinstance(shard_resources, ShardResources):
        raise ConfigError("shard_resources", f"expected a ShardResources or None, got "
                                             f"{shard_resources!r}")
    if placement is not None and not isinstance(placement, Placement):
        raise ConfigError("placement", f"a sharded plane takes a Placement or None, got "
                                       f"{placement!r}")
    if cfg.on_policy and cfg.train_batch_size < num_learners:
        raise ConfigError("num_learners", f"{num_learners} ranks cannot share mini-batches "
                                          f"of {cfg.train_batch_size} rows")


class ActorPort:
    """An actor's side of the plane, bound to a node: pushes go to that node's shard."""

    def __init__(self, plane: RayExperienceDataPlane, node: str | None) -> None:
        self._plane, self.node = plane, node

    def push(self, rollout: Mapping[str, Any] | Any, *, policy_version: int | None = None,
             timeout: float | None = None) -> None:
        """Same as :meth:`RayExperienceDataPlane.push` with this port's node."""
        self._plane.push(rollout, node=self.node, policy_version=policy_version,
                         timeout=timeout)


class RayExperienceDataPlane(ScheduledOperators):
    """An Experience Data Plane whose buffer is sharded over Ray actors on several nodes.

    Actors push to the shard on their own node; each row is copied to ``replication - 1``
    shards on other nodes before the push returns. Learners sample across shards: uniform
    replay draws every row held with probability ``1/N``; prioritized replay picks a shard in
    proportion to its priority mass, then a row within it, which is exactly single-buffer
    PER. On-policy, every row of an iteration is delivered once per epoch, split into disjoint
    shares across ``num_learners`` ranks. A dead shard is found by the next call that writes
    to it, reads from it or (every draw pings the shards it reads nothing from) pulls, or by
    :meth:`heal`; it is re-created and restored from a replica, and rows lost without a
    replica are counted in :attr:`lost_rows` and warned about.

    Where a learner reads (the §5.1 local/remote mixture): the draw above fixes which rows a
    rank gets; each shard's part of it is then fetched from the copy of that shard's rows on
    the rank's node (:meth:`learner` ``node=``; by default the driver's) when one is current,
    else from the shard's primary. A copy is current when it reported the same rows, write
    count and priority mass as the primary after the last change; a copy whose shard is being
    restored, or that missed a change, is stale and never read. A copy found dead on a read is
    restored (as any dead shard) and the draw planned again. Every current copy is the same
    ring with the same priorities, so sampling frequencies are exactly those of one buffer;
    only where the bytes come from changes.

    Args:
        spec, mode, batch_size, num_minibatches, num_epochs, min_size, max_priority_lag,
            timeout, seed: As for :class:`~conduit.plane.ExperienceDataPlane`.
        learner_device: Where delivered batches end up, as for the local plane: one device
            for every rank, or a sequence with one per rank (``("cuda:0", "cuda:1")``).
        capacity: Off-policy: replay capacity in rows, split evenly over shards (each
            primary is a ring of ``ceil(capacity / num_shards)`` rows). On-policy: rows per
            iteration over all shards.
        sampler: ``"uniform"`` (default), ``"prioritized"``, or a ``UniformSampler`` /
            ``PrioritizedSampler`` (its ``alpha``, ``beta``, ``eps`` are used). On-policy:
            unset.
        placement: Where rows live on each shard's node (a
            :class:`~conduit.storage.Placement`, or None for pageable CPU memory).
        num_shards: Buffer shards, placed round robin over the cluster's live nodes.
        replication: Copies of each row, on distinct shards (and nodes when there are enough);
            1 turns replication off. At most ``num_shards``.
        address: A Ray cluster to attach to (``"host:port"``, ``"auto"``, ``"ray://..."``);
            None uses the Ray this process is connected to, or starts a local one (shut down
            again by :meth:`close` of the last plane using it).
        shard_resources: What each shard actor reserves on its node.
        num_learners: Learner ranks (:meth:`learner`); on-policy, an iteration is consumed
            when every rank has pulled its shares.
        schedule: Overlap and granularity of the operators (:meth:`register_ingestion`,
            :meth:`register_delivery`): ``overlap_ing = 1`` ingests on the front's thread
            (``push`` returns once the unit is queued), ``g_ing`` units per invocation;
            ``overlap_del = 1`` keeps each rank's next delivery invocation (``g_del``
            batches) in flight while the learner updates. Default: ``Schedule(0, 1, 1, 1)``
            (on-policy ``g_del = 1/M``). On-policy, ``g_ing`` is a share of the
            iteration's rows per invocation, as on a local plane (each invocation takes
            whole units pushed on one node), and an iteration's mini-batches start once all
            its rows are stored.
        prefetch: ``overlap_del`` when no schedule is given (default True).
        rollout_spec, g_max: As for :class:`~conduit.plane.ExperienceDataPlane`.
        rollout_rows, store: Not available on a sharded plane; anything but None raises
            :class:`ConfigError`.

    Raises:
        ConfigError: An argument is invalid (a learner device this process cannot use
            included); the message names it.
        ScheduleError: The schedule is outside the feasible space or not available sharded.
        RayUnavailableError: Ray is not installed (``pip install 'conduit-rl[ray]'``).
        ClusterConnectionError: ``address`` names no reachable cluster.
        ShardUnavailableError: The shards did not start within ``timeout``, or within
            :data:`~conduit.distributed.cluster.SHARD_START_S` (120 s) if that is longer: a
            shard's start includes its Ray worker process's.
    """

    def __init__(self, *, spec: ExperienceSpec, capacity: int, mode: Mode = "off_policy",
                 batch_size: int = 256, num_minibatches: int = 1, num_epochs: int = 1,
                 sampler: SamplerArg = None, placement: Placement | None = None,
                 schedule: Any = None, learner_device: DeviceArg = "cpu",
                 min_size: int | None = None, rollout_spec: ExperienceSpec | None = None,
                 rollout_rows: int | None = None, g_max: int = 8, max_priority_lag: int = 0,
                 timeout: float = 60.0, seed: int = 0, store: Any = None, num_shards: int = 2,
                 replication: int = 2, address: str | None = None,
                 shard_resources: ShardResources | None = None, num_learners: int = 1,
                 prefetch: bool | None = None) -> None:
        check_counts(num_shards=num_shards, replication=replication, num_learners=num_learners)
        devices = rank_devices(learner_device, num_learners)
        self.config = cfg = PlaneConfig(
            spec=spec, capacity=capacity, mode=mode, batch_size=batch_size,
            num_minibatches=num_minibatches, num_epochs=num_epochs, min_size=min_size,
            rollout_spec=rollout_spec, g_max=g_max, max_priority_lag=max_priority_lag,
            timeout=timeout, seed=seed, learner_device=devices[0])
        refuse_unsharded(rollout_rows=rollout_rows, store=store)
        self.space: ScheduleSpace = cfg.schedule_space()
        schedule = self._resolve_schedule(schedule, prefetch)
        check_sharding(cfg, num_shards=num_shards, replication=replication,
                       num_learners=num_learners, shard_resources=shard_resources,
                       placement=placement)
        self.mode, self.capacity, self.batch_size = cfg.mode, cfg.capacity, cfg.train_batch_size
        self.min_size, self.num_minibatches = cfg.first_batch_rows, cfg.num_minibatches
        self.num_epochs, self.timeout = cfg.num_epochs, cfg.timeout
        self.learner_device, self.learner_devices = devices[0], devices
        self.prefetch, self._g_del = bool(schedule.overlap_del), max(1, int(schedule.g_del))
        self.num_shards, self.replication, self.num_learners = num_shards, replication, \
            num_learners
        shard_rows = cfg.capacity if cfg.on_policy else math.ceil(cfg.capacity / num_shards)
        shard_spec = shard_spec_for(sampler, cfg, shard_rows, placement)
        self._prioritized, self._beta = shard_spec.sampler == "prioritized", shard_spec.beta
        ray, started = connect(address, timeout_s=cfg.timeout)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._life = PlaneLifecycle(ray=ray, started=started, cond=self._cond,
                                    timeout=cfg.timeout)
        self._gate = IterationGate(capacity=cfg.capacity, num_learners=num_learners,
                                   cond=self._cond, check_open=self._check_open)
        try:
            self._shards = ShardSet(ray, num_shards=num_shards, replication=replication,
                                    config=shard_spec,
                                    resources=shard_resources or ShardResources(),
                                    timeout=cfg.timeout)
        except BaseException:
            self._life.release_started()
            raise
        self._replicator = Replicator(shards=self._shards, cond=self._cond,
                                      replication=replication, on_lost=self._lost)
        self._changes = FrontChanges(cond=self._cond, gate=self._gate,
                                     replicator=self._replicator, shards=self._shards,
                                     prioritized=self._prioritized, timeout=cfg.timeout)
        here = ray.get_runtime_context().get_node_id()
        self._nodes = ClusterNodes(ray, {here, *self._shards.nodes}, self._check_open)
        self._ingress = Ingress(config=cfg, ray=ray, shards=self._shards,
                                replicator=self._replicator, gate=self._gate, cond=self._cond,
                                schedule=schedule, here=here)
        self._ingestion = self._ingress.ingestion
        self.counters = self._ingress.counters
        self._ports = [LearnerPort(self, rank=r, world_size=num_learners, device=devices[r],
                                   node=here) for r in range(num_learners)]
        self.learner_port = self._ports[0]

    # -- properties -------------------------------------------------------------------------
    @property
    def spec(self) -> ExperienceSpec:
        """Fields of one buffer row."""
        return self.config.spec

    @property
    def policy_version(self) -> int:
        """On-policy: the policy version whose rows the plane takes now (0 off-policy)."""
        return self._gate.iteration

    @property
    def recoveries(self) -> list[ShardRecovery]:
        """Every shard re-created so far, with rows restored and lost."""
        return list(self._shards.recoveries)

    @property
    def lost_rows(self) -> int:
        """Rows lost with shards that had no live replica (0 with replication on)."""
        return sum(r.lost_rows for r in self._shards.recoveries)

    @property
    def nodes(self) -> list[str]:
        """The node each shard runs on."""
        return list(self._shards.nodes)

    def __len__(self) -> int:
        return sum(h.size for h in self._shards.held)

    def learner(self, rank: int = 0, *, node: str | None = None) -> LearnerPort:
        """The learner port of ``rank``.

        Args:
            rank: The rank.
            node: The Ray node the rank runs on, from now on: its reads prefer the current
                copies there (None keeps the port's node; the driver's at first).

        Raises:
            ConfigError: ``rank`` is outside ``[0, num_learners)``, or ``node`` is not a
                node of the cluster.
        """
        if not isinstance(rank, int) or not 0 <= rank < self.num_learners:
            raise ConfigError("rank", f"must lie in [0, {self.num_learners}), got {rank!r}")
        port = self._ports[rank]
        if node is not None:
            self._nodes.check(node)
            port.bind(node)
        return port

    def actor_port(self, node: str | None = None) -> ActorPort:
        """A port whose pushes go to ``node``'s shard (None: the caller's node).

        Raises:
            ConfigError: ``node`` is not a node of the cluster.
        """
        self._nodes.check(node)
        return ActorPort(self, node)

    # -- ingestion --------------------------------------------------------------------------
    def push(self, rollout: Mapping[str, Any] | Any, *, node: str | None = None,
             policy_version: int | None = None, timeout: float | None = None) -> None:
        """Hand one rollout unit to the plane for ``node``'s shard and its replicas.

        With the default schedule and no ingestion operator it returns once every copy is
        written (the push is then acknowledged: it survives the loss of any
        ``replication - 1`` shards). Otherwise the unit is queued for the ingestion operator,
        which runs here every ``g_ing`` units (``overlap_ing = 0``) or on the front's thread
        (``overlap_ing = 1``, the push returns once the unit is queued); :meth:`flush` and
        :meth:`close` ingest what is queued, and a unit that could not be stored is reported
        (:class:`~conduit.errors.OperatorError`, :class:`~conduit.errors.DataLossError`).
        On-policy, the unit's rows count against the iteration before it is queued.

        Args:
            rollout: Field -> tensor or numpy array, leading dimension = rows; or (off-policy)
                an ``ObjectRef`` of such a mapping that an actor put in its node's object
                store (checked against the spec by the shard; fetched to the front when an
                ingestion operator or a queued schedule needs its rows).
            node: The pushing actor's Ray node id (None: this process's node).
            policy_version: On-policy: the policy that produced the rollout (older raises,
                newer waits for the current iteration to be consumed).
            timeout: Seconds the push may take (default: the plane's ``timeout``).

        Raises:
            SpecError: The rollout does not match the spec (or ``rollout_spec``).
            CapacityError: More rows than a shard (off-policy) or the iteration holds.
            StaleRolloutError: On-policy rollout from an older policy.
            BackpressureTimeout: The ingestion queue had no room, or (on-policy) the current
                iteration was not consumed in time, or, inline, its turn to ingest (after other
                threads' inline invocations) did not come in time (its rows are not stored).
            OperatorError: The ingestion operator raised: here, in the inline invocation
                that held this push's unit (the error counts that invocation's units; rows
                its writes left are its ``stored_rows`` and ``unsettled_rows``), or earlier
                on the thread (this push's unit is not queued). An invocation this push runs
                over units other pushes queued before its own is not this push's to report:
                when it fails, the push goes on and ``close()`` counts those units.
            ShardUnavailableError: The shard could not be written or restored in time.
                The write may have been sent all the same: on-policy the holders are
                re-read before this is raised (as after an interrupt), and when they applied
                it its rows stay stored and count against the iteration
                (``stored_rows``), otherwise no holder keeps them; when they cannot be
                re-read by the push's timeout (plus a short grace), its rows stay counted
                against the iteration until the next push or pull re-reads them
                (``unsettled_rows``); off-policy the front counts such rows by its next
                change (``unsettled_rows``). With both 0, pushing the rollout (a mapping)
                again stores it once; for an ``ObjectRef`` both stay 0 and say nothing.
                A pushed ``ObjectRef`` whose object was not made in time (its task still
                runs) raises it too; nothing was sent then.
            ConfigError: ``node`` is not a node of the cluster (field ``node``), or the
                ``ObjectRef``'s object is gone: the actor that put it died, or every copy
                was lost, or its task raised (field ``rollout``; nothing was stored).
            PlaneClosedError: The plane is closed.
        """
        with self._life.in_flight():
            self._check_open()
            self._nodes.check(node)
            self._ingress.push(rollout, node=node,
                               policy_version=check_policy_version(policy_version),
                               deadline=time.monotonic() + self.config.wait_for(timeout))

    def _lost(self, rows: int) -> None:
        """A heal lost ``rows`` stored rows (reported and warned about): on-policy they leave
        the iteration, which then takes as many again."""
        if self.config.on_policy:
            self._gate.lost(rows)

    def heal(self, *, timeout: float | None = None) -> list[ShardRecovery]:
        """Find dead shards, re-create them and restore their rows from replicas.

        Returns:
            The recoveries done by this call.

        Raises:
            ShardUnavailableError: A shard could not be restored within ``timeout``.
            PlaneClosedError: The plane is closed.
        """
        self._check_open()
        return self._replicator.heal(time.monotonic() + self.config.wait_for(timeout))

    # -- delivery ---------------------------------------------------------------------------
    def pull(self, *, timeout: float | None = None) -> Batch:
        """Rank 0's next batch (see :meth:`LearnerPort.pull`)."""
        return self.learner_port.pull(timeout=timeout)

    def minibatches(self, *, timeout: float | None = None) -> Iterator[Batch]:
        """Rank 0's share of every mini-batch of the current on-policy iteration."""
        return self.learner_port.minibatches(timeout=timeout)

    def update_priorities(self, indices: torch.Tensor, priorities: torch.Tensor) -> None:
        """Give new priorities to delivered rows, on the shard that owns each row and on its
        replicas, all or nothing (the whole update is checked first). Rows overwritten since
        they were sampled, or lost with a shard that had no replica, are skipped.

        Raises:
            PriorityError: Not a prioritized plane; indices that are not a batch's
                ``_index``; NaN, infinite or negative priorities, or priorities too large for
                the shards' sum trees; mismatched lengths. Nothing is changed then.
            ShardUnavailableError: A shard could not be updated or restored in time, or the
                plane's timeout ran out while another call held the front (waiting on a
                shard; nothing was changed).
        """
        self._check_open()
        self._changes.update_priorities(indices, priorities)

    # -- lifecycle --------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Shards (node, rows, replicas), recoveries and losses, learner ranks (node,
        device, delivery waits) (JSON)."""
        shards = self._shards
        return {
            "mode": self.mode, "num_shards": self.num_shards, "replication": self.replication,
            "counters": dict(self.counters), "lost_rows": self.lost_rows,
            "schedule": self.schedule.to_dict(), "ingestion": dict(self._ingestion.counters),
            "shards": [{"shard": k, "node": shards.nodes[k], "rows": shards.held[k].size,
                        "replicas_on": shards.replicas[k]} for k in range(self.num_shards)],
            "recoveries": [r.__dict__ for r in shards.recoveries],
            "learners": [{"rank": p.rank, "node": p.node, "device": str(p.device)}
                         for p in self._ports],
            "remote_wait_s": [p.remote_wait_s for p in self._ports],
        }

    def _check_open(self) -> None:
        self._life.check_open()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._life.closed

    def close(self) -> None:
        """Refuse new calls, store every queued unit, then end the shard actors (and the
        local Ray this plane started): a call still waiting on a shard ends with
        :class:`~conduit.errors.PlaneClosedError`. Idempotent.

        Raises:
            DataLossError: Some units that ``push`` acknowledged could not be stored (an
                ingestion failure not cleared by :meth:`recover`, one while draining, or an
                operator stuck past the timeout). The plane is closed all the same.
            ConfigError: Called from inside the ingestion operator, which close would wait
                for; nothing changes.
        """
        self._life.close(self._ingestion, self._shards)

    def __enter__(self) -> RayExperienceDataPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"RayExperienceDataPlane(mode={self.mode!r}, capacity={self.capacity}, "
                f"num_shards={self.num_shards}, replication={self.replication})")
