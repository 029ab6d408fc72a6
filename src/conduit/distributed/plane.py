"""``RayExperienceDataPlane``: one plane whose buffer is sharded over Ray actors on several
nodes, with every row replicated on other nodes so that losing a shard loses nothing.

The front runs in the driver. It orders every change of a shard's rows (pushes, priority
updates, on-policy clears) and sends it to the shard and its replicas in that order, so each
replica is the same ring as its primary, slot for slot. Payloads go into Ray's object store
once (``ray.put``, numpy columns read without a copy) and every holder reads the same object.
The Fig. 8 ingestion operator runs in the front, before that ordering, and the delivery
operator on each learner rank's thread (:mod:`conduit.distributed.operators`).
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from conduit.distributed._ray import connect
from conduit.distributed.cluster import ShardRecovery, ShardResources, ShardSet
from conduit.distributed.delivery import LearnerPort
from conduit.distributed.errors import ShardUnavailableError
from conduit.distributed.iteration import IterationGate
from conduit.distributed.operators import FrontIngestion, QueuedUnit, ScheduledOperators
from conduit.distributed.sampling import priority_updates
from conduit.distributed.shard import ShardSpec, to_wire
from conduit.errors import (
    CapacityError,
    ConfigError,
    PlaneClosedError,
    PriorityError,
    StaleRolloutError,
)
from conduit.plane.config import PlaneConfig
from conduit.plane.data_plane import admit_rollout
from conduit.scheduling.space import Mode, ScheduleSpace
from conduit.spec import Batch, ExperienceSpec
from conduit.storage import Placement, PrioritizedSampler, Sampler, UniformSampler

T = TypeVar("T")
SamplerArg = Literal["uniform", "prioritized"] | Sampler | None


class ActorPort:
    """An actor's side of the plane, bound to a node: pushes go to that node's shard."""

    def __init__(self, plane: RayExperienceDataPlane, node: str | None) -> None:
        self._plane, self.node = plane, node

    def push(self, rollout: Mapping[str, Any] | Any, *, policy_version: int | None = None,
             timeout: float | None = None) -> None:
        """Same as :meth:`RayExperienceDataPlane.push` with this port's node."""
        self._plane.push(rollout, node=self.node, policy_version=policy_version,
                         timeout=timeout)


def _shard_spec(sampler: SamplerArg, cfg: PlaneConfig, capacity: int,
                placement: Placement | None) -> ShardSpec:
    if cfg.on_policy:
        if sampler is not None:
            raise ConfigError("sampler", "on-policy sharded planes deliver every row exactly "
                                         "once per epoch; leave sampler unset")
        return ShardSpec(spec=cfg.spec, capacity=capacity, sampler="fifo",
                         placement=placement, seed=cfg.seed)
    if sampler is None or sampler == "uniform" or type(sampler) is UniformSampler:
        return ShardSpec(spec=cfg.spec, capacity=capacity, placement=placement, seed=cfg.seed)
    if sampler == "prioritized":
        sampler = PrioritizedSampler()
    if type(sampler) is PrioritizedSampler:
        return ShardSpec(spec=cfg.spec, capacity=capacity, sampler="prioritized",
                         alpha=sampler.alpha, beta=sampler.beta, eps=sampler.eps,
                         placement=placement, seed=cfg.seed)
    raise ConfigError("sampler", f"a sharded plane samples 'uniform' or 'prioritized' (or a "
                                 f"UniformSampler / PrioritizedSampler), got {sampler!r}")


class RayExperienceDataPlane(ScheduledOperators):
    """An Experience Data Plane whose buffer is sharded over Ray actors on several nodes.

    Actors push to the shard on their own node; each row is copied to ``replication - 1``
    shards on other nodes before the push returns. Learners sample across shards: uniform
    replay draws every row held with probability ``1/N``; prioritized replay picks a shard in
    proportion to its priority mass, then a row within it, which is exactly single-buffer
    PER. On-policy, every row of an iteration is delivered once per epoch, split into disjoint
    shares across ``num_learners`` ranks. A dead shard is re-created and restored from a
    replica on its next use (or :meth:`heal`); rows lost without a replica are counted in
    :attr:`lost_rows` and warned about.

    Args:
        spec, mode, batch_size, num_minibatches, num_epochs, min_size, max_priority_lag,
            timeout, seed, learner_device: As for :class:`~conduit.plane.ExperienceDataPlane`.
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
            again by :meth:`close`).
        shard_resources: What each shard actor reserves on its node.
        num_learners: Learner ranks (:meth:`learner`); on-policy, an iteration is consumed
            when every rank has pulled its shares.
        schedule: Overlap and granularity of the operators (:meth:`register_ingestion`,
            :meth:`register_delivery`): ``overlap_ing = 1`` ingests on the front's thread,
            ``g_ing`` units per invocation; ``overlap_del = 1`` keeps each rank's next
            delivery invocation (``g_del`` batches) in flight while the learner updates.
            Default: ``Schedule(0, 1, 1, 1)`` (on-policy ``g_del = 1/M``). On-policy, ingestion
            is inline with ``g_ing = 1``.
        prefetch: ``overlap_del`` when no schedule is given (default True).
        rollout_spec, g_max: As for :class:`~conduit.plane.ExperienceDataPlane`.
        rollout_rows, store: Not available on a sharded plane; anything but None raises
            :class:`ConfigError`.

    Raises:
        ConfigError: An argument is invalid; the message names it.
        ScheduleError: The schedule is outside the feasible space or not available sharded.
        RayUnavailableError: Ray is not installed (``pip install 'conduit-rl[ray]'``).
        ClusterConnectionError: ``address`` names no reachable cluster.
        ShardUnavailableError: The shards did not start within ``timeout``.
    """

    def __init__(self, *, spec: ExperienceSpec, capacity: int, mode: Mode = "off_policy",
                 batch_size: int = 256, num_minibatches: int = 1, num_epochs: int = 1,
                 sampler: SamplerArg = None, placement: Placement | None = None,
                 schedule: Any = None, learner_device: str | torch.device = "cpu",
                 min_size: int | None = None, rollout_spec: ExperienceSpec | None = None,
                 rollout_rows: int | None = None, g_max: int = 8, max_priority_lag: int = 0,
                 timeout: float = 60.0, seed: int = 0, store: Any = None, num_shards: int = 2,
                 replication: int = 2, address: str | None = None,
                 shard_resources: ShardResources | None = None, num_learners: int = 1,
                 prefetch: bool | None = None) -> None:
        self.config = cfg = PlaneConfig(
            spec=spec, capacity=capacity, mode=mode, batch_size=batch_size,
            num_minibatches=num_minibatches, num_epochs=num_epochs, min_size=min_size,
            rollout_spec=rollout_spec, g_max=g_max, max_priority_lag=max_priority_lag,
            timeout=timeout, seed=seed, learner_device=torch.device(learner_device))
        for name, value in (("rollout_rows", rollout_rows), ("store", store)):
            if value is not None:
                raise ConfigError(name, "not available on a sharded plane (each shard builds "
                                        "its own store; units are ingested whole); leave it "
                                        "unset")
        self.space: ScheduleSpace = cfg.schedule_space()
        schedule = self._resolve_schedule(schedule, prefetch)
        for name, value, low in (("num_shards", num_shards, 1), ("replication", replication, 1),
                                 ("num_learners", num_learners, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(name, f"must be an integer >= {low}, got {value!r}")
        if replication > num_shards:
            raise ConfigError("replication", f"{replication} copies need at least as many "
                                             f"shards, got num_shards={num_shards}")
        if placement is not None and not isinstance(placement, Placement):
            raise ConfigError("placement", f"a sharded plane takes a Placement or None, got "
                                           f"{placement!r}")
        self.mode, self.capacity, self.batch_size = cfg.mode, cfg.capacity, cfg.train_batch_size
        self.min_size, self.num_minibatches = cfg.first_batch_rows, cfg.num_minibatches
        self.num_epochs, self.timeout = cfg.num_epochs, cfg.timeout
        self.learner_device = cfg.learner_device
        self.prefetch, self._g_del = bool(schedule.overlap_del), max(1, int(schedule.g_del))
        self.num_shards, self.replication, self.num_learners = num_shards, replication, \
            num_learners
        if cfg.on_policy and cfg.train_batch_size < num_learners:
            raise ConfigError("num_learners", f"{num_learners} ranks cannot share mini-batches "
                                              f"of {cfg.train_batch_size} rows")
        shard_rows = cfg.capacity if cfg.on_policy else math.ceil(cfg.capacity / num_shards)
        shard_spec = _shard_spec(sampler, cfg, shard_rows, placement)
        self._prioritized, self._beta = shard_spec.sampler == "prioritized", shard_spec.beta
        self._ray, self._started = connect(address, timeout_s=cfg.timeout)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self._route_turn = 0
        self._priority_updates = 0
        self._max_priority = 1.0  # prioritized: the largest priority given to any shard
        self._gate = IterationGate(capacity=cfg.capacity, num_learners=num_learners,
                                   cond=self._cond, check_open=self._check_open)
        self.counters = {"units": 0, "rows": 0}
        self._ingestion = FrontIngestion(store=self._store_output, timeout=cfg.timeout)
        self._ingestion.set_schedule(schedule)
        try:
            self._shards = ShardSet(self._ray, num_shards=num_shards, replication=replication,
                                    config=shard_spec,
                                    resources=shard_resources or ShardResources(),
                                    timeout=cfg.timeout)
        except BaseException:
            self._ingestion.close()
            if self._started:
                self._ray.shutdown()
            raise
        self._ports = [LearnerPort(self, rank=r, world_size=num_learners)
                       for r in range(num_learners)]
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

    def learner(self, rank: int = 0) -> LearnerPort:
        """The learner port of ``rank``.

        Raises:
            ConfigError: ``rank`` is outside ``[0, num_learners)``.
        """
        if not isinstance(rank, int) or not 0 <= rank < self.num_learners:
            raise ConfigError("rank", f"must lie in [0, {self.num_learners}), got {rank!r}")
        return self._ports[rank]

    def actor_port(self, node: str | None = None) -> ActorPort:
        """A port whose pushes go to ``node``'s shard (None: the caller's node)."""
        return ActorPort(self, node)

    # -- ingestion --------------------------------------------------------------------------
    def _route(self, node: str | None) -> int:
        """The shard a push from ``node`` goes to: a shard on that node (round robin when it
        runs several), else the shard holding the fewest rows (cross-node balance)."""
        if node is None:
            node = self._ray.get_runtime_context().get_node_id()
        local = self._shards.shards_on(node)
        self._route_turn += 1
        if local:
            return local[self._route_turn % len(local)]
        return min(range(self.num_shards), key=lambda k: self._shards.held[k].size)

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
                iteration was not consumed in time.
            OperatorError: The ingestion operator raised (here, or earlier on the thread).
            ShardUnavailableError: The shard could not be written or restored in time.
            PlaneClosedError: The plane is closed.
        """
        self._check_open()
        deadline = time.monotonic() + self.config.wait_for(timeout)
        ing = self._ingestion
        ing.raise_if_failed()
        if isinstance(rollout, self._ray.ObjectRef):
            if self.config.on_policy:
                raise ConfigError("rollout", "on-policy rollouts are pushed as mappings (the "
                                             "iteration counts their rows)")
            if ing.direct and self.config.rollout_spec is None:
                self._store(rollout, 0, node, None, deadline, validate=True)
                self._acknowledged()
                return
            rollout = self._shards.get(rollout, deadline, shard=None)
        if ing.registered or self.config.rollout_spec is not None:
            data, rows = admit_rollout(rollout, spec=self.spec,
                                       rollout_spec=self.config.rollout_spec,
                                       capacity=self._row_limit, raw=True)
        else:
            data, rows = self._admit(rollout, what="rollout")
        if self.config.on_policy and policy_version is not None \
                and policy_version < self._gate.iteration:
            raise StaleRolloutError(f"policy_version {policy_version} is older than the "
                                    f"plane's {self._gate.iteration}")
        if ing.direct:
            self._store(data, rows, node, policy_version, deadline)
        else:
            ing.submit(QueuedUnit(data, rows, node, policy_version), deadline)
        self._acknowledged()

    @property
    def _row_limit(self) -> int:
        """Most rows one write may hold: the iteration on-policy, a shard off-policy."""
        return self.capacity if self.config.on_policy else self._shards.config.capacity

    def _admit(self, batch: Mapping[str, Any], *, what: str) -> tuple[Batch, int]:
        """``batch`` checked against the spec and the row limit."""
        data, rows = self.spec.validate(batch, what=what)
        limit = self._row_limit
        if rows > limit:
            where = "an iteration's" if self.config.on_policy else "a shard's"
            raise CapacityError(f"a {what} of {rows} rows is larger than {where} {limit} rows; "
                                f"split it or raise capacity", needed=rows, available=limit)
        return data, rows

    def _acknowledged(self) -> None:
        with self._cond:
            self.counters["units"] += 1

    def _store_output(self, batch: Mapping[str, Any], unit: QueuedUnit, deadline: float) -> int:
        """What an ingestion operator writes for ``unit``: checked, then stored."""
        data, rows = self._admit(batch, what="write")
        self._store(data, rows, unit.node, unit.version, deadline)
        return rows

    def _store(self, data: Any, rows: int, node: str | None, version: int | None,
               deadline: float, *, validate: bool = False) -> None:
        """Write checked rows (or, ``validate``, an actor's ``ObjectRef``) to the shard of
        ``node`` and its replicas."""
        payload = data if validate else self._ray.put(to_wire(data))
        with self._cond:
            if self.config.on_policy:
                self._gate.admit(rows, version, deadline)
            owner = self._route(node)
            self._write(owner, payload, validate, deadline)
            self.counters["rows"] += rows
            if self.config.on_policy:
                self._gate.stored(rows)
            self._cond.notify_all()

    def _write(self, owner: int, payload: Any, validate: bool, deadline: float) -> None:
        # The owner's write count before this write: a retry after a restore that already
        # carried the rows is then a no-op on every holder. A restore with nothing to copy
        # from (all holders lost) starts a fresh ring, and the write goes there.
        before = self._shards.held[owner].total_written

        def attempt() -> None:
            first = min(before, self._shards.held[owner].total_written)
            refs = [self._shards.actors[h].write.remote(owner, payload, validate, first,
                                                        self._max_priority)
                    for h in self._shards.holders(owner)]
            self._shards.held[owner] = self._shards.get(refs, deadline, shard=owner)[0]
        self._healing(attempt, deadline)

    def _healing(self, fn: Callable[[], T], deadline: float) -> T:
        """Run ``fn`` (remote calls to shards); when a shard is found dead, heal and retry."""
        while True:
            if self._shards.unrestored:  # a restore cut short by an earlier deadline
                self._heal(deadline)
            try:
                return fn()
            except ShardUnavailableError:
                raise
            except Exception as exc:
                if not self._shards.is_death(exc):
                    raise
                self._heal(deadline)

    def heal(self, *, timeout: float | None = None) -> list[ShardRecovery]:
        """Find dead shards, re-create them and restore their rows from replicas.

        Returns:
            The recoveries done by this call.

        Raises:
            ShardUnavailableError: A shard could not be restored within ``timeout``.
        """
        self._check_open()
        return self._heal(time.monotonic() + self.config.wait_for(timeout))

    def _heal(self, deadline: float) -> list[ShardRecovery]:
        with self._cond:
            done = self._shards.heal(deadline)
            for r in done:
                if r.lost_rows:
                    warnings.warn(f"shard {r.shard} died on node {r.old_node} with no live "
                                  f"replica: {r.lost_rows} rows lost (replication="
                                  f"{self.replication})", RuntimeWarning, stacklevel=3)
                    if self.config.on_policy:
                        self._gate.stored(-r.lost_rows)
            self._cond.notify_all()
            return done

    # -- delivery ---------------------------------------------------------------------------
    def pull(self, *, timeout: float | None = None) -> Batch:
        """Rank 0's next batch (see :meth:`LearnerPort.pull`)."""
        return self.learner_port.pull(timeout=timeout)

    def minibatches(self, *, timeout: float | None = None) -> Iterator[Batch]:
        """Rank 0's share of every mini-batch of the current on-policy iteration."""
        return self.learner_port.minibatches(timeout=timeout)

    def _rank_done(self, rank: int, iteration: int) -> None:
        """On-policy: ``rank`` pulled its last share of ``iteration``; the last rank clears
        every holder of every shard's rows and opens the next iteration."""
        deadline = time.monotonic() + self.timeout

        def clear() -> None:
            shards = self._shards
            refs = {(o, h): shards.actors[h].clear.remote(o)
                    for o in range(self.num_shards) for h in shards.holders(o)}
            got = dict(zip(refs, shards.get(list(refs.values()), deadline, shard=None),
                           strict=True))
            for o in range(self.num_shards):
                shards.held[o] = got[(o, o)]
        with self._cond:
            self._gate.consumed(rank, iteration, lambda: self._healing(clear, deadline))

    def update_priorities(self, indices: torch.Tensor, priorities: torch.Tensor) -> None:
        """Give new priorities to delivered rows, on the shard that owns each row and on its
        replicas. Rows overwritten since they were sampled are skipped.

        Raises:
            PriorityError: Not a prioritized plane; indices that are not a batch's
                ``_index``; NaN, infinite or negative priorities; mismatched lengths.
        """
        self._check_open()
        if not self._prioritized:
            raise PriorityError("sampler: this plane samples uniformly; build it with "
                                "sampler='prioritized' to update priorities")
        owners, rows, pr = priority_updates(indices, priorities, self.num_shards)
        deadline = time.monotonic() + self.timeout
        with self._cond:
            def update() -> None:
                shards = self._shards
                for o in np.unique(owners).tolist():
                    sel = owners == o
                    refs = [shards.actors[h].update_priorities.remote(o, rows[sel], pr[sel])
                            for h in shards.holders(o)]
                    shards.held[o] = shards.get(refs, deadline, shard=o)[0]
            self._healing(update, deadline)
            self._priority_updates += 1
            if pr.size:
                self._max_priority = max(self._max_priority, float(pr.max()))

    # -- lifecycle --------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Shards (node, rows, replicas), recoveries and losses, delivery waits (JSON)."""
        shards = self._shards
        return {
            "mode": self.mode, "num_shards": self.num_shards, "replication": self.replication,
            "counters": dict(self.counters), "lost_rows": self.lost_rows,
            "schedule": self.schedule.to_dict(), "ingestion": dict(self._ingestion.counters),
            "shards": [{"shard": k, "node": shards.nodes[k], "rows": shards.held[k].size,
                        "replicas_on": shards.replicas[k]} for k in range(self.num_shards)],
            "recoveries": [r.__dict__ for r in shards.recoveries],
            "remote_wait_s": [p.remote_wait_s for p in self._ports],
        }

    def _check_open(self) -> None:
        if self._closed:
            raise PlaneClosedError("the sharded plane is closed")

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Refuse new calls, store every queued unit, then end the shard actors (and the
        local Ray this plane started). Idempotent.

        Raises:
            DataLossError: Some units that ``push`` acknowledged could not be stored (an
                ingestion failure not cleared by :meth:`recover`, one while draining, or an
                operator stuck past the timeout). The plane is closed all the same.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        try:
            self._ingestion.close()
        finally:
            self._shards.kill_all()
            if self._started:
                self._ray.shutdown()

    def __enter__(self) -> RayExperienceDataPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"RayExperienceDataPlane(mode={self.mode!r}, capacity={self.capacity}, "
                f"num_shards={self.num_shards}, replication={self.replication})")
