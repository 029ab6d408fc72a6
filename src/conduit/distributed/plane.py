"""``RayExperienceDataPlane``: one plane whose buffer is sharded over Ray actors on several
nodes, with every row replicated on other nodes so that losing a shard loses nothing.

The front runs in the driver. It orders every change of a shard's rows (pushes, priority
updates, on-policy clears) and sends it to the shard and its replicas in that order, so each
replica is the same ring as its primary, slot for slot. Payloads go into Ray's object store
once (``ray.put``, numpy columns read without a copy) and every holder reads the same object.
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
from conduit.distributed.shard import ShardSpec, to_wire
from conduit.errors import CapacityError, ConfigError, PlaneClosedError, PriorityError
from conduit.plane.config import PlaneConfig
from conduit.scheduling.space import Mode
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


class RayExperienceDataPlane:
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
        prefetch: Keep each rank's next batch in flight while the learner updates.
        schedule, rollout_spec, rollout_rows, g_max, store: Not available on a sharded plane;
            anything but their defaults raises :class:`ConfigError`.

    Raises:
        ConfigError: An argument is invalid; the message names it.
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
                 prefetch: bool = True) -> None:
        self.config = cfg = PlaneConfig(
            spec=spec, capacity=capacity, mode=mode, batch_size=batch_size,
            num_minibatches=num_minibatches, num_epochs=num_epochs, min_size=min_size,
            g_max=g_max, max_priority_lag=max_priority_lag, timeout=timeout, seed=seed,
            learner_device=torch.device(learner_device))
        for name, value in (("schedule", schedule), ("rollout_spec", rollout_spec),
                            ("rollout_rows", rollout_rows), ("store", store)):
            if value is not None:
                raise ConfigError(name, "not available on a sharded plane (each shard builds "
                                        "its own store; delivery is prefetched per rank); "
                                        "leave it unset")
        if g_max != 8:
            raise ConfigError("g_max", "not available on a sharded plane; leave it unset")
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
        self.learner_device, self.prefetch = cfg.learner_device, bool(prefetch)
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
        try:
            self._shards = ShardSet(self._ray, num_shards=num_shards, replication=replication,
                                    config=shard_spec,
                                    resources=shard_resources or ShardResources(),
                                    timeout=cfg.timeout)
        except BaseException:
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
        """Store one rollout on ``node``'s shard and its replicas; returns once every copy is
        written (the push is then acknowledged: it survives the loss of any
        ``replication - 1`` shards).

        Args:
            rollout: Field -> tensor or numpy array, leading dimension = rows; or (off-policy)
                an ``ObjectRef`` of such a mapping that an actor put in its node's object
                store (checked against the spec by the shard).
            node: The pushing actor's Ray node id (None: this process's node).
            policy_version: On-policy: the policy that produced the rollout (older raises,
                newer waits for the current iteration to be consumed).
            timeout: Seconds the push may take (default: the plane's ``timeout``).

        Raises:
            SpecError: The rollout does not match the spec.
            CapacityError: More rows than a shard (off-policy) or the iteration holds.
            StaleRolloutError: On-policy rollout from an older policy.
            BackpressureTimeout: On-policy: the current iteration was not consumed in time.
            ShardUnavailableError: The shard could not be written or restored in time.
            PlaneClosedError: The plane is closed.
        """
        self._check_open()
        deadline = time.monotonic() + self.config.wait_for(timeout)
        ref_type = self._ray.ObjectRef
        validate = isinstance(rollout, ref_type)
        if validate:
            if self.config.on_policy:
                raise ConfigError("rollout", "on-policy rollouts are pushed as mappings (the "
                                             "iteration counts their rows)")
            payload, rows = rollout, 0
        else:
            data, rows = self.spec.validate(rollout, what="rollout")
            on = self.config.on_policy
            limit = self.capacity if on else self._shards.config.capacity
            if rows > limit:
                where = "an iteration's" if on else "a shard's"
                raise CapacityError(f"a rollout of {rows} rows is larger than {where} "
                                    f"{limit} rows; split it or raise capacity",
                                    needed=rows, available=limit)
            payload = self._ray.put(to_wire(data))
        with self._cond:
            if self.config.on_policy:
                self._gate.admit(rows, policy_version, deadline)
            owner = self._route(node)
            self._write(owner, payload, validate, deadline)
            self.counters["units"] += 1
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
        idx = torch.as_tensor(indices).detach().cpu().reshape(-1)
        if idx.is_floating_point() or idx.dtype == torch.bool:
            raise PriorityError(f"indices: must be a batch's integer _index, got {idx.dtype}")
        pr = torch.as_tensor(priorities).detach().cpu().reshape(-1).to(torch.float64).numpy()
        if pr.size != idx.numel():
            raise PriorityError(f"priorities: {pr.size} values for {idx.numel()} indices")
        if not np.isfinite(pr).all() or (pr < 0).any():
            raise PriorityError("priorities: must be finite and >= 0 (pass |TD errors|)")
        from conduit.distributed.sampling import decode
        owners, rows = decode(idx.numpy())
        if owners.size and (owners.min() < 0 or owners.max() >= self.num_shards):
            raise PriorityError(f"indices: name shards outside [0, {self.num_shards}); pass "
                                f"the _index of a batch this plane delivered")
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
        """End the shard actors (and the local Ray this plane started). Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
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
