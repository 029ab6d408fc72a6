"""The Experience Data Plane's front: ports, operator registration, schedule and lifecycle.

Actors push rollouts through the actor port; ingestion turns them into buffer rows; delivery
turns buffer rows into training batches; learners pull them through the learner port. The
front wires three parts together (docs/design.md §2):

* a flow (:mod:`conduit.plane.flows`, :mod:`conduit.plane.onpolicy`), off-policy or
  on-policy, which owns the queue, the stage, backpressure and the delivery rules;
* the operator runtime (:mod:`conduit.plane.runtime`), which runs the registered operators;
* one runner per operator (:mod:`conduit.plane.runners`): inline on the caller's thread
  (``overlap = 0``) or on a background worker (``overlap = 1``), as the
  :class:`~conduit.scheduling.Schedule` says.

The schedule never changes what data the learner sees: on-policy batches are identical under
every schedule for a seed.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch

from conduit.errors import CapacityError, ConduitError, ConfigError, OperatorError
from conduit.placement import PlacementDecision, PlacementMap
from conduit.plane import checkpoint
from conduit.plane.config import PlaneConfig
from conduit.plane.config import policy_version as check_policy_version
from conduit.plane.engine import PlaneEngine
from conduit.plane.flows import Unit, hold_rollout
from conduit.plane.front_state import CheckpointCalls, LifecycleCalls, MigrationCalls
from conduit.plane.migration import PlacementArg, initial_placement
from conduit.plane.ports import ActorIn, BufferIn, BufferOut, LearnerOut
from conduit.plane.runtime import DeliveryFn, IngestionFn
from conduit.scheduling.space import Mode, Schedule, ScheduleSpace
from conduit.spec import Batch, ExperienceSpec, as_tensor, batch_rows
from conduit.storage import (
    ExperienceBuffer,
    FifoSampler,
    PrioritizedSampler,
    Sampler,
    Store,
    UniformSampler,
)
from conduit.storage.hostmem import retain_freed_memory
from conduit.timing import TimingRecord, Timings

SamplerArg = Literal["uniform", "prioritized"] | Sampler | None


class ActorPort:
    """The actor side of the plane: ``push`` rollouts."""

    def __init__(self, plane: ExperienceDataPlane) -> None:
        self._plane = plane

    def push(self, rollout: Mapping[str, Any], *, policy_version: int | None = None,
             timeout: float | None = None) -> None:
        """Same as :meth:`ExperienceDataPlane.push`."""
        self._plane.push(rollout, policy_version=policy_version, timeout=timeout)


class LearnerPort:
    """The learner side of the plane: ``pull`` training-ready batches."""

    def __init__(self, plane: ExperienceDataPlane) -> None:
        self._plane = plane

    def pull(self, *, timeout: float | None = None) -> Batch:
        """Same as :meth:`ExperienceDataPlane.pull`."""
        return self._plane.pull(timeout=timeout)


def make_sampler(sampler: SamplerArg, config: PlaneConfig) -> Sampler:
    """The sampler a plane uses for ``sampler`` (see :class:`ExperienceDataPlane`).

    Raises:
        ConfigError: The sampler does not suit the plane's mode.
    """
    if config.on_policy:
        if sampler is None:
            return FifoSampler(num_minibatches=config.num_minibatches, seed=config.seed)
        if not isinstance(sampler, Sampler) or not sampler.consume_once:
            raise ConfigError("sampler", "on-policy planes deliver every row exactly once per "
                                         "epoch with a consume-once sampler; leave sampler unset "
                                         "or pass a FifoSampler")
        if getattr(sampler, "num_minibatches", None) != config.num_minibatches:
            raise ConfigError("sampler", f"the sampler has num_minibatches="
                                         f"{getattr(sampler, 'num_minibatches', None)}, the "
                                         f"plane has {config.num_minibatches}")
        return sampler
    if sampler is None or sampler == "uniform":
        return UniformSampler(seed=config.seed)
    if sampler == "prioritized":
        return PrioritizedSampler(seed=config.seed)
    if not isinstance(sampler, Sampler):
        raise ConfigError("sampler", f"expected 'uniform', 'prioritized' or a Sampler, got "
                                     f"{sampler!r}")
    if sampler.consume_once:
        raise ConfigError("sampler", f"a {type(sampler).__name__} is for on-policy planes; use "
                                     f"mode='on_policy'")
    return sampler


def admit_rollout(rollout: Mapping[str, Any], *, spec: ExperienceSpec,
                  rollout_spec: ExperienceSpec | None, capacity: int, raw: bool,
                  on_policy: bool = False) -> tuple[Batch, int]:
    """A pushed rollout as tensors, and its rows: checked against ``rollout_spec`` if any,
    else against the buffer's ``spec`` unless ``raw`` (an ingestion operator reshapes it).

    Raises:
        SpecError: The rollout does not match.
        CapacityError: It has more rows than the buffer holds, unreshaped or ``on_policy``
            (an on-policy ingestion operator writes exactly its units' rows).
    """
    if rollout_spec is not None:
        data, rows = rollout_spec.validate(rollout, what="rollout")
    elif raw:
        rows = batch_rows(rollout, what="rollout")
        data = {k: as_tensor(v, field=k) for k, v in rollout.items()}
    else:
        data, rows = spec.validate(rollout, what="rollout")
    if (on_policy or not (raw or rollout_spec is not None)) and rows > capacity:
        raise CapacityError(f"a rollout of {rows} rows is larger than the buffer capacity "
                            f"{capacity}; split it or raise capacity", needed=rows,
                            available=capacity)
    return data, rows


def _check_ports(kind: str, got: tuple[str, str], want: tuple[str, str]) -> None:
    if got != want:
        raise ConfigError(f"register_{kind}", f"{kind} connects input={want[0]!r} to "
                                              f"output={want[1]!r}, got {got[0]!r} -> "
                                              f"{got[1]!r}")


def _check_schedule(schedule: Any) -> Schedule:
    """``schedule`` if it is a :class:`Schedule`.

    Raises:
        ConfigError: It is anything else (a tuple, a string, a dict, None).
    """
    if not isinstance(schedule, Schedule):
        raise ConfigError("schedule", f"expected a Schedule, e.g. Schedule(1, 1, 1, 2) for "
                                      f"(overlap_ing, g_ing, overlap_del, g_del), got "
                                      f"{schedule!r}")
    return schedule


def _close_dropped(engine: PlaneEngine,
                   snapshotters: weakref.WeakSet[checkpoint.Snapshotter] | None = None) -> None:
    """Close a plane that was dropped without ``close()`` (its workers and snapshotters hold
    no reference to the front, so it can be collected); a loss becomes a warning, as nobody
    can catch it. Its snapshotters are told to stop first (not waited for: garbage collection
    runs on any thread, one of theirs included); a snapshot being written finishes.

    Collected on a thread Conduit made (a plane's worker or gather thread, this plane's or
    another's, possibly inside an operator or holding the import lock while it loads a
    kernel), it is closed from a new thread instead: joining workers there could wait for
    the collecting thread itself, or for a lock it holds."""
    for snapshotter in list(snapshotters or ()):
        snapshotter.stop_soon()
    if (engine.runtime.inside_operator() is not None
            or threading.current_thread().name.startswith("conduit")):
        threading.Thread(target=_close_engine, args=(engine,), daemon=True,
                         name="conduit-close-dropped").start()
        return
    _close_engine(engine)


def _close_engine(engine: PlaneEngine) -> None:
    """``engine.close()``, its loss a warning (see :func:`_close_dropped`)."""
    try:
        engine.close()
    except ConduitError as exc:
        warnings.warn(f"an ExperienceDataPlane was dropped without close(): {exc}",
                      ResourceWarning, stacklevel=1)


class ExperienceDataPlane(MigrationCalls, CheckpointCalls, LifecycleCalls):
    """Ingestion, placement and delivery between actors and learners.

    Example:
        >>> plane = ExperienceDataPlane(spec=spec, capacity=100_000, mode="off_policy",
        ...                             batch_size=256, schedule=Schedule(1, 1, 1, 2))
        >>> plane.push(rollout)          # actors
        >>> batch = plane.pull()         # learner

    Args:
        spec: Fields of one buffer-resident sample.
        capacity: Off-policy: replay capacity in rows. On-policy: rows per iteration (N),
            delivered as ``num_minibatches`` mini-batches of about N/M rows per epoch.
        mode: ``"off_policy"`` (replay) or ``"on_policy"`` (consume-once, fresh data only).
        batch_size: Off-policy training batch size (on-policy mini-batches are N/M).
        num_minibatches: On-policy M, mini-batches per epoch.
        num_epochs: On-policy passes over each iteration's data.
        sampler: ``"uniform"`` (default off-policy), ``"prioritized"``, or a
            :class:`~conduit.storage.Sampler`. On-policy always uses a consume-once sampler
            (default :class:`~conduit.storage.FifoSampler`).
        placement: A :class:`~conduit.storage.Placement`; ``"auto"`` (Alg. 1 over this
            machine's topology, kept in :attr:`placement_decision`); a
            :class:`~conduit.placement.PlacementMap` to follow as the spec grows
            (:meth:`grow`, Alg. 2); or None for pageable CPU memory.
        schedule: Overlap and granularity of both operators (default: everything inline,
            g = 1; on-policy delivery g = 1/M).
        learner_device: Device the learner trains on; delivered batches end up there.
        min_size: Off-policy rows needed before the first batch is served (default
            ``batch_size``).
        rollout_spec: Spec pushed rollouts must match when an ingestion operator reshapes
            them (without both, pushes are checked against ``spec``).
        rollout_rows: On-policy: rows of every pushed unit, when fixed; adds their share of
            the iteration to the ingestion granularities (see
            :func:`~conduit.scheduling.feasible_space`).
        g_max: Cap on off-policy granularity (bounds staleness and memory).
        max_priority_lag: Priority updates that a prefetched prioritized batch may miss.
            0 (default) discards prefetched batches drawn before the latest update.
        timeout: Seconds a push or pull may wait before raising (never hangs).
        seed: Seed of the sampler.
        store: Rows in this store instead of one made for ``placement``, e.g. a
            :class:`~conduit.storage.MemmapColumnStore` for a buffer larger than RAM.

    The first plane of a process makes glibc keep freed batch memory for reuse
    (:func:`~conduit.storage.hostmem.retain_freed_memory`; ``CONDUIT_HOST_MALLOC=system``
    leaves the allocator alone).

    Raises:
        ConfigError: An argument is invalid; the message names it.
    """

    def __init__(self, *, spec: ExperienceSpec, capacity: int, mode: Mode = "off_policy",
                 batch_size: int = 256, num_minibatches: int = 1, num_epochs: int = 1,
                 sampler: SamplerArg = None, placement: PlacementArg = None,
                 schedule: Schedule | None = None, learner_device: str | torch.device = "cpu",
                 min_size: int | None = None, rollout_spec: ExperienceSpec | None = None,
                 rollout_rows: int | None = None, g_max: int = 8, max_priority_lag: int = 0,
                 timeout: float = 60.0, seed: int = 0, store: Store | None = None) -> None:
        self.config = cfg = PlaneConfig(
            spec=spec, capacity=capacity, mode=mode, batch_size=batch_size,
            num_minibatches=num_minibatches, num_epochs=num_epochs, min_size=min_size,
            rollout_spec=rollout_spec, rollout_rows=rollout_rows, g_max=g_max,
            max_priority_lag=max_priority_lag, timeout=timeout, seed=seed,
            learner_device=learner_device)
        self.mode: Mode = cfg.mode
        self.capacity, self.batch_size, self.min_size = (cfg.capacity, cfg.train_batch_size,
                                                         cfg.first_batch_rows)
        self.num_minibatches, self.num_epochs = cfg.num_minibatches, cfg.num_epochs
        self.max_priority_lag, self.timeout = cfg.max_priority_lag, cfg.timeout
        self.learner_device, self.rollout_spec = cfg.learner_device, rollout_spec
        self.space: ScheduleSpace = cfg.schedule_space()
        if schedule is not None:
            _check_schedule(schedule)
        self.timings = Timings()
        retain_freed_memory()
        where = initial_placement(placement, cfg)
        self.placement_decision: PlacementDecision | None = where.decision  # "auto": Alg. 1's
        self.placement_map: PlacementMap | None = where.placement_map  # what grow() follows
        buffer = ExperienceBuffer(spec=spec, capacity=cfg.capacity, store=store,
                                  sampler=make_sampler(sampler, cfg), placement=where.placement)
        self.actor_port, self.learner_port = ActorPort(self), LearnerPort(self)
        self._engine = PlaneEngine.build(cfg, buffer, self.timings)
        self._flow, self._signals = self._engine.flow, self._engine.signals
        self._ingest_registered = False
        #: Snapshotters taking snapshots of this plane; close() stops them.
        self._snapshotters: weakref.WeakSet[checkpoint.Snapshotter] = weakref.WeakSet()
        schedule = cfg.default_schedule() if schedule is None else schedule
        self.space.check(schedule)
        self._engine.start(schedule)
        self._finalizer = weakref.finalize(self, _close_dropped, self._engine,
                                           self._snapshotters)

    @property
    def spec(self) -> ExperienceSpec:
        """Fields of one buffer row (widened by :meth:`grow` or :meth:`migrate`)."""
        return self._flow.spec

    @property
    def buffer(self) -> ExperienceBuffer:
        """The buffer rows live in (replaced by a migration)."""
        return self._flow.buffer

    @property
    def counters(self) -> dict[str, int]:
        """Units, rows, batches and invocations so far."""
        return self._flow.counters

    @property
    def policy_version(self) -> int:
        """On-policy: the policy version whose rows the plane takes now (0 off-policy)."""
        return self._flow.policy_version

    def register_ingestion(self, *, input: str = "Actor", output: str = "ExperienceBuffer"
                           ) -> Callable[[IngestionFn], IngestionFn]:
        """Decorator registering the framework's ingestion logic (Fig. 8): the function gets
        ``(actor_in, exp_out)``, reads rollouts with ``actor_in.read()`` (or ``read_units()``)
        and writes buffer rows with ``exp_out.write(...)``. Off-policy it may write any
        number of rows; on-policy exactly the rows of the units it read (an invocation that
        writes another count fails with an :class:`OperatorError` caused by a
        :class:`SpecError`, and its rows are taken back).

        Raises:
            ConfigError: The ports are not ``"Actor"`` -> ``"ExperienceBuffer"``.
        """
        _check_ports("ingestion", (input, output), ("Actor", "ExperienceBuffer"))

        def deco(fn: IngestionFn) -> IngestionFn:
            with self._signals.lock:
                self._engine.runtime.ingest_fn, self._ingest_registered = fn, True
            return fn
        return deco

    def register_delivery(self, *, input: str = "ExperienceBuffer", output: str = "Learner",
                          whole_iteration: bool = False) -> Callable[[DeliveryFn], DeliveryFn]:
        """Decorator registering the framework's delivery logic (Fig. 8): the function gets
        ``(exp_in, learn_out)``, reads sampled rows with ``exp_in.read()`` and writes
        training-ready data with ``learn_out.write(...)``, which splits it into the
        invocation's training batches.

        Args:
            input: The operator's input port (``"ExperienceBuffer"``).
            output: The operator's output port (``"Learner"``).
            whole_iteration: On-policy: the function reads state of the whole iteration
                besides its rows (for example it pads to the iteration's longest sequence),
                so no mini-batch is delivered before every row of the iteration has landed.
                By default the first mini-batches may be assembled and delivered while the
                iteration's last rows are still being ingested.

        Raises:
            ConfigError: The ports are not ``"ExperienceBuffer"`` -> ``"Learner"``.
        """
        _check_ports("delivery", (input, output), ("ExperienceBuffer", "Learner"))

        def deco(fn: DeliveryFn) -> DeliveryFn:
            with self._signals.lock:
                self._engine.runtime.deliver_fn = fn
                self._flow.assemble_early = not whole_iteration
            return fn
        return deco

    @property
    def staleness_bound(self) -> int:
        """Rollout units that may be pushed but not yet sampleable when ``push`` returns."""
        return self._flow.staleness_bound

    @property
    def prefetch_bound(self) -> int:
        """Training batches that may be staged ahead of the learner: off-policy one
        invocation's ``g_del``; on-policy two mini-batches with overlapped delivery, else one.
        """
        return self._flow.prefetch_bound

    def set_schedule(self, schedule: Schedule) -> None:
        """Switch overlap and granularity at a quiescent point; data and order are kept.

        Raises:
            ConfigError: ``schedule`` is not a :class:`~conduit.scheduling.Schedule`.
            ScheduleError: The schedule is outside the feasible space for this configuration.
            ConfigError: Called from inside an operator (nothing changes).
        """
        self._engine.refuse_inside_operator("set_schedule")
        self._check_open()
        self.space.check(_check_schedule(schedule))
        self.flush()  # queued units are ingested under the granularity they were queued for
        with self.paused():
            self._engine.schedule = schedule

    @property
    def schedule(self) -> Schedule:
        """The schedule in force."""
        return self._engine.schedule

    def paused(self) -> AbstractContextManager[None]:
        """Quiesce both operators (in-flight invocations finish), e.g. for migration.

        Raises:
            ConfigError: Called from inside an operator, whose invocation it would wait for.
        """
        self._engine.refuse_inside_operator("paused")
        return self._engine.paused()

    def push(self, rollout: Mapping[str, Any], *, policy_version: int | None = None,
             timeout: float | None = None) -> None:
        """Hand one rollout unit to the plane (the actor port). With ``overlap_ing=1`` it
        returns once the unit is queued; with ``overlap_ing=0`` ingestion runs here every
        ``g_ing`` units. A full queue makes it wait (backpressure).

        A queued unit holds the rollout's tensors, not copies, until it is ingested (the
        next ``g_ing``-th push, the ingestion worker, ``flush()``, or on-policy the
        iteration's last rows): write into a pushed tensor before then and its unit is
        refused at ingestion (an :class:`~conduit.errors.OperatorError` caused by a
        :class:`~conduit.errors.SpecError` naming the field) instead of stored changed.
        Writable NumPy arrays and inference-mode tensors, whose writes cannot be detected,
        are copied when the unit can wait, and so is a tensor that is a view of part of a
        larger one (an actor that fills one preallocated buffer chunk by chunk and pushes
        ``buf[i * 8:(i + 1) * 8]``): a view shares its version counter with the whole buffer,
        so only the copy tells writes into the other chunks from writes into the pushed rows.
        Push whole tensors to avoid that copy.

        Args:
            rollout: Field -> tensor or numpy array, leading dimension = rows.
            policy_version: On-policy: the policy version that produced the rollout. Older
                than the plane's current version raises; newer waits until the plane reaches
                that version (the iterations before it consumed).
            timeout: Seconds to wait for room (default: the plane's ``timeout``).

        Raises:
            SpecError: The rollout does not match the spec.
            StaleRolloutError: On-policy rollout from an older policy.
            CapacityError: On-policy rows beyond the iteration's capacity, or a rollout of
                more rows than the capacity (whatever its version; refused at once).
            ConfigError: ``policy_version`` is not an integer.
            BackpressureTimeout: No room within ``timeout`` (on-policy: the plane did not
                reach the rollout's newer version by then; the message says so), or,
                inline, its turn to ingest (after other threads' inline invocations) did
                not come by then: its rows are not stored.
            OperatorError: An ingestion operator raised: on the worker earlier (latched), or
                inline here in the invocation that held this push's unit (its rows are not
                stored, except the error's ``stored_rows``; on-policy those stay counted
                against the iteration's capacity, so push again only rollouts of the
                ``lost_rows - stored_rows`` rows not stored, as a note on the error
                says). An inline invocation this push
                runs over units other pushes queued before its own is not this push's to
                report: when it fails, the push goes on and ``close()`` counts those units.
                An operator interrupted here (it raised ``KeyboardInterrupt``,
                ``SystemExit``: not an ``Exception``) raises that interrupt instead, with
                this error's message as a note. A push that raises (this error, or an
                interrupt) never has its unit stored later: pushing it again stores it once.
            PlaneClosedError: The plane is closed.
        """
        t0 = time.perf_counter()
        self._check_open()
        policy_version = check_policy_version(policy_version)
        spec, raw = self.spec, self._ingest_registered
        data, rows = admit_rollout(rollout, spec=spec, rollout_spec=self.rollout_spec,
                                   capacity=self.capacity, raw=raw,
                                   on_policy=self.config.on_policy)
        waited = self.config.wait_for(timeout)
        sched = self._engine.schedule
        data, guards = hold_rollout(rollout, data, may_wait=(
            sched.overlap_ing == 1 or sched.g_ing != 1 or self.config.on_policy
            # operators held on another thread (a save): the unit waits past this push
            or bool(self._engine.runtime.paused or self._engine.runtime.writes_held)))
        checked = None if raw or self.rollout_spec is not None else spec
        self._engine.submit(Unit(data, rows, policy_version, guards, spec=checked,
                                 pusher=threading.current_thread()),
                            deadline=t0 + waited, waited=waited)
        self._record("push", "sync_ing" if self._engine.ingestion.overlapped else None, t0)

    def flush(self, *, timeout: float | None = None) -> None:
        """Ingest every pending unit now (even if fewer than ``g_ing`` are queued).

        Raises:
            BackpressureTimeout: Ingestion did not finish within ``timeout`` (also: another
                thread's inline ingestion ran past it).
            OperatorError: An ingestion operator raised (one interrupted on this thread
                raises its interrupt instead, as :meth:`push`).
            PlaneClosedError: The plane is closed.
            ConfigError: Called from inside an operator, whose invocation it would wait for.
        """
        self._check_open()
        self._engine.refuse_inside_operator("flush")
        self._engine.ingestion.flush(time.perf_counter() + self.config.wait_for(timeout))

    def pull(self, *, timeout: float | None = None) -> Batch:
        """Take the next training-ready batch (the learner port).

        Off-policy: a sampled batch of ``batch_size`` rows (with ``_index`` and, for
        prioritized samplers, ``_weight``). On-policy: the next shuffled mini-batch of the
        current iteration; after the last one of the last epoch the plane moves to the next
        policy version.

        An interrupt (``KeyboardInterrupt``) reaching the call leaves the plane consistent:
        the batch it was making is either not drawn (the next pull returns it; on-policy,
        every row is still delivered once per epoch) or counted delivered, as when the
        interrupt comes just after the call returned.

        Raises:
            EmptyBufferError: No batch could be formed within ``timeout`` (for example an
                on-policy iteration that never received its rows).
            OperatorError: A delivery (or ingestion) operator raised (one interrupted on
                this thread raises its interrupt instead, as :meth:`push`).
            PlaneClosedError: The plane is closed.
            ConfigError: Called from inside an operator where the batch could only come from
                that invocation: a delivery operator (unless delivery is inline and
                off-policy, where the pull runs its own invocation) or, on-policy, an
                ingestion operator.
        """
        t0 = time.perf_counter()
        drawn = self._engine.drawn_pull
        if drawn is not None and timeout is None:  # the buffer's sample, taken here
            batch = drawn.pull(t0)
            if batch is not None:
                return batch
        self._check_open()
        inside = self._engine.runtime.inside_operator()
        if inside is not None and (self.mode == "on_policy" or (
                inside == "delivery" and self._engine.delivery.overlapped)):
            self._engine.refuse_inside_operator("pull")
        waited = self.config.wait_for(timeout)
        records: list[TimingRecord] = []  # of the deliveries this pull runs itself
        try:
            batch = self._engine.next_batch(deadline=t0 + waited, waited=waited,
                                            records=records)
        except BaseException:
            self.timings.add(records)
            raise
        self._record("pull", "sync_del" if self._engine.delivery.overlapped else None, t0,
                     records)
        return batch

    def _record(self, name: str, sync: str | None, t0: float,
                earlier: list[TimingRecord] | None = None) -> None:
        """Record a call that began at ``t0`` as ``name``, and as ``sync`` (the wait on a
        worker) when the operator is overlapped, after the ``earlier`` records it made; one
        clock read and one lock for all."""
        seconds = time.perf_counter() - t0
        recs = earlier if earlier is not None else []
        recs.append(TimingRecord(name, seconds, 1.0, t0))
        if sync is not None:
            recs.append(TimingRecord(sync, seconds, 1.0, t0))
        self.timings.add(recs)

    def minibatches(self, *, timeout: float | None = None) -> Iterator[Batch]:
        """On-policy: the current iteration's mini-batches (M × epochs), in order, from the
        first not yet pulled: a loop left early and called again resumes where it stopped,
        and never runs into the next iteration.

        Raises:
            ConfigError: The plane is off-policy.
        """
        if not self.config.on_policy:
            raise ConfigError("mode", "minibatches() is for on-policy planes; use pull()")
        version = self.policy_version
        while self.policy_version == version:  # the iteration's last pull moves it on
            yield self.pull(timeout=timeout)

    def update_priorities(self, indices: torch.Tensor, priorities: torch.Tensor) -> None:
        """Give new priorities to delivered rows (prioritized sampler only).

        The next batch the learner pulls is drawn after this update (prefetched batches that
        were drawn before it are discarded), unless ``max_priority_lag`` allows otherwise.

        Raises:
            PriorityError: NaN, infinite or negative priorities, or mismatched lengths.
        """
        self._check_open()
        self.buffer.update_priorities(indices, priorities)
        with self._signals.lock:
            self._flow.priorities_updated_locked()
            self._signals.wake(delivery=True)

    def timed(self, name: Literal["rollout", "update"] | str) -> AbstractContextManager[None]:
        """Time a caller window, e.g. ``with plane.timed("rollout"): ...``."""
        return self.timings.time(name)

    def stats(self) -> dict[str, Any]:
        """Counters, fill level, schedule and placement (JSON-friendly)."""
        return self._engine.stats()

    @property
    def failed(self) -> OperatorError | None:
        """The operator error that calls now raise (until :meth:`recover`), if any: each
        raises a copy of it (same type, attributes, cause and traceback)."""
        return self._engine.runtime.errors.error

    def _check_open(self) -> None:
        self._engine.check_open()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._engine.closed

    def __repr__(self) -> str:
        return (f"ExperienceDataPlane(mode={self.mode!r}, capacity={self.capacity}, "
                f"placement={self.buffer.placement.label()}, schedule={self.schedule.label()})")


__all__ = ["ActorIn", "ActorPort", "BufferIn", "BufferOut", "ExperienceDataPlane",
           "LearnerOut", "LearnerPort"]
