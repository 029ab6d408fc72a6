"""The Experience Data Plane: control points, ports and the operator runtime.

Actors push rollouts through the actor port; ingestion turns them into buffer rows; delivery
turns buffer rows into training batches; learners pull them through the learner port. A
:class:`~conduit.scheduling.Schedule` decides, for each operator, whether it runs inline on the
caller's thread (``overlap=0``, the sequential baseline) or on a background worker
(``overlap=1``), and how much it processes per invocation (``g``). The schedule never changes
what data the learner sees: on-policy batches are identical under every schedule for a seed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

import torch

from conduit.errors import (
    BackpressureTimeout,
    CapacityError,
    ConfigError,
    EmptyBufferError,
    OperatorError,
    PlaneClosedError,
    SpecError,
    StaleRolloutError,
)
from conduit.plane.ports import ActorIn, BufferIn, BufferOut, LearnerOut
from conduit.scheduling.space import (
    MAX_MINIBATCHES,
    Mode,
    Schedule,
    ScheduleSpace,
    feasible_space,
)
from conduit.spec import Batch, ExperienceSpec, as_tensor, batch_rows
from conduit.storage import (
    ExperienceBuffer,
    FifoSampler,
    Placement,
    PrioritizedSampler,
    SampleInfo,
    Sampler,
    UniformSampler,
)
from conduit.storage.column_store import copy_rows
from conduit.storage.threads import data_path_threads
from conduit.timing import Timings

IngestionFn = Callable[[ActorIn, BufferOut], None]
DeliveryFn = Callable[[BufferIn, LearnerOut], None]
SamplerArg = Literal["uniform", "prioritized"] | Sampler | None


def _check_growth(old: ExperienceSpec, new: ExperienceSpec) -> None:
    for name, fs in old.fields.items():
        if name not in new.fields:
            raise SpecError(name, "a migration may widen fields but not drop them")
        nf = new.fields[name]
        if nf.dtype != fs.dtype:
            raise SpecError(name, f"dtype changes from {fs.dtype} to {nf.dtype}; a migration "
                                  f"only widens shapes")
        if len(nf.shape) != len(fs.shape) or any(a < b for a, b in zip(nf.shape, fs.shape)):
            raise SpecError(name, f"shape {fs.shape} -> {nf.shape} is not a growth")


def _pad_to(data: Batch, spec: ExperienceSpec) -> Batch:
    out: Batch = {}
    for name, fs in spec.fields.items():
        v = data.get(name)
        n = next(iter(data.values())).shape[0]
        if v is None:
            out[name] = torch.zeros((n, *fs.shape), dtype=fs.dtype)
        elif tuple(v.shape[1:]) != fs.shape:
            pad = torch.zeros((n, *fs.shape), dtype=fs.dtype, device=v.device)
            pad[(slice(None), *(slice(0, s) for s in v.shape[1:]))] = v
            out[name] = pad
        else:
            out[name] = v
    return out


def _device_ranges(store: Any) -> list[tuple[str, int, int]]:
    bounds = getattr(store, "bounds", None)
    if bounds is None:
        return [(str(store.placement.devices[0]), 0, store.capacity)]
    return [(f"{d}[{k}]", int(bounds[k]), int(bounds[k + 1]))
            for k, d in enumerate(store.placement.devices)]


def _range_flows(old: Any, new: Any, start: int, n: int) -> list[tuple[str, str, int]]:
    out = []
    for a, a0, a1 in _device_ranges(old):
        for b, b0, b1 in _device_ranges(new):
            lo, hi = max(a0, b0, start), min(a1, b1, start + n)
            if lo < hi:
                out.append((a, b, hi - lo))
    return out


def _identity_ingestion(actor_in: ActorIn, exp_out: BufferOut) -> None:
    exp_out.write(actor_in.read())


def _identity_delivery(exp_in: BufferIn, learn_out: LearnerOut) -> None:
    learn_out.write(exp_in.read())


@dataclass
class _Unit:
    data: Batch
    rows: int
    version: int | None


@dataclass
class _Early:
    """One of an on-policy iteration's first mini-batches, assembled while its rows arrive.

    The FIFO layout is a pure function of (seed, iteration, epoch, size), so the slots of the
    first mini-batches are known before any row lands; ingestion copies each written row that
    belongs to one of them straight into ``out``. When the last one lands the mini-batch is
    complete without a gather, which takes the gather off the learner's path at the start of
    the iteration.
    """

    indices: torch.Tensor
    out: Batch | None = None
    filled: int = 0

    @property
    def complete(self) -> bool:
        return self.filled == int(self.indices.numel())


@dataclass
class _DeliveryJob:
    info: SampleInfo
    batches: int
    batch_size: int
    generation: int
    early: _Early | None = None


@dataclass
class _Staged:
    batch: Batch
    generation: int
    event: Any = None


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


class ExperienceDataPlane:
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
            :class:`~conduit.storage.Sampler`. On-policy always uses a FIFO consume-once
            sampler.
        placement: Where the buffer lives: a :class:`~conduit.storage.Placement`, ``"auto"``
            (Alg. 1 over this machine's detected topology; the decision is kept in
            :attr:`placement_decision`), or None for pageable CPU memory.
        schedule: Overlap and granularity of both operators (default: everything inline,
            g = 1; on-policy delivery g = 1/M).
        learner_device: Device the learner trains on; delivered batches end up there.
        min_size: Off-policy rows needed before the first batch is served (default
            ``batch_size``).
        rollout_spec: Optional spec that pushed rollouts must match when a registered
            ingestion operator reshapes them. Without it and without an ingestion operator,
            pushes are checked against ``spec``.
        rollout_rows: On-policy: rows in every pushed rollout unit, when that is fixed (for
            example envs × steps of a rollout fragment). Units smaller than a mini-batch then
            add their share of the iteration to the feasible ingestion granularities, so
            ingestion can run once per arriving unit (see
            :func:`~conduit.scheduling.feasible_space`). Pushes are not required to match it.
        g_max: Cap on off-policy granularity (bounds staleness and memory).
        max_priority_lag: Priority updates that a prefetched prioritized batch may miss.
            0 (default) discards prefetched batches drawn before the latest update.
        timeout: Seconds a push or pull may wait before raising (never hangs).
        seed: Seed of the sampler.
    """

    def __init__(self, *, spec: ExperienceSpec, capacity: int, mode: Mode = "off_policy",
                 batch_size: int = 256, num_minibatches: int = 1, num_epochs: int = 1,
                 sampler: SamplerArg = None,
                 placement: Placement | Literal["auto"] | None = None,
                 schedule: Schedule | None = None, learner_device: str | torch.device = "cpu",
                 min_size: int | None = None, rollout_spec: ExperienceSpec | None = None,
                 rollout_rows: int | None = None, g_max: int = 8, max_priority_lag: int = 0,
                 timeout: float = 60.0,
                 seed: int = 0) -> None:
        if not isinstance(spec, ExperienceSpec):
            raise ConfigError("spec", f"expected an ExperienceSpec, got {type(spec).__name__}")
        if mode not in ("off_policy", "on_policy"):
            raise ConfigError("mode", f"must be 'off_policy' or 'on_policy', got {mode!r}")
        for name, v in (("capacity", capacity), ("batch_size", batch_size),
                        ("num_minibatches", num_minibatches), ("num_epochs", num_epochs)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(name, f"must be a positive integer, got {v!r}")
        if mode == "off_policy" and batch_size > capacity:
            raise ConfigError("batch_size", f"{batch_size} exceeds capacity {capacity}")
        if mode == "on_policy" and num_minibatches > capacity:
            raise ConfigError("num_minibatches", f"{num_minibatches} mini-batches cannot be "
                                                 f"cut from {capacity} rows per iteration")
        if not timeout > 0:
            raise ConfigError("timeout", f"must be > 0 seconds, got {timeout!r}")
        if not isinstance(max_priority_lag, int) or max_priority_lag < 0:
            raise ConfigError("max_priority_lag", f"must be an integer >= 0, got "
                                                  f"{max_priority_lag!r}")
        self.spec = spec
        self.mode: Mode = mode
        self.capacity = capacity
        self.batch_size = batch_size if mode == "off_policy" else capacity // num_minibatches
        self.num_minibatches = num_minibatches
        self.num_epochs = num_epochs
        self.rollout_spec = rollout_spec
        self.learner_device = torch.device(learner_device)
        self.timeout = float(timeout)
        self.max_priority_lag = max_priority_lag
        self.seed = seed
        if min_size is None:
            min_size = batch_size if mode == "off_policy" else capacity
        if not isinstance(min_size, int) or min_size < 1 or min_size > capacity:
            raise ConfigError("min_size", f"must be an integer in [1, capacity={capacity}], "
                                          f"got {min_size!r}")
        self.min_size = min_size
        unit = None
        if rollout_rows is not None:
            if (not isinstance(rollout_rows, int) or isinstance(rollout_rows, bool)
                    or not 1 <= rollout_rows <= capacity):
                raise ConfigError("rollout_rows", f"must be an integer in [1, capacity="
                                                  f"{capacity}], got {rollout_rows!r}")
            if mode != "on_policy":
                raise ConfigError("rollout_rows", "only applies on-policy; off-policy "
                                                  "granularity already counts rollout units")
            unit = Fraction(rollout_rows, capacity)
            if unit.denominator > MAX_MINIBATCHES:
                unit = None  # not representable as a granularity; the hint is not needed
        self.space: ScheduleSpace = feasible_space(
            mode=mode, num_minibatches=num_minibatches, g_max_ing=g_max, g_max_del=g_max,
            unit_fraction_ing=unit)
        self.timings = Timings()
        self.placement_decision: Any = None
        if placement == "auto":
            placement = self._auto_placement()
        elif placement is not None and not isinstance(placement, Placement):
            raise ConfigError("placement", f"expected a Placement, 'auto' or None, got "
                                           f"{placement!r}")
        self.buffer = ExperienceBuffer(spec=spec, capacity=capacity,
                                       sampler=self._make_sampler(sampler, seed),
                                       placement=placement)
        self.actor_port = ActorPort(self)
        self.learner_port = LearnerPort(self)

        # One lock; a condition per kind of waiter, so that an event wakes only the threads
        # it concerns (every wake-up costs the learner a GIL hand-off on a small machine).
        lock = threading.RLock()
        self._cv = threading.Condition(lock)  # callers: push, pull, flush, paused()
        self._ing_cv = threading.Condition(lock)  # the ingestion worker
        self._del_cv = threading.Condition(lock)  # the delivery worker
        self._ingest_fn: IngestionFn = _identity_ingestion
        self._deliver_fn: DeliveryFn = _identity_delivery
        self._ingest_registered = False
        self._pending: deque[_Unit] = deque()
        self._pending_rows = 0
        self._inflight_units = 0
        self._staged: deque[_Staged] = deque()
        self._error: OperatorError | None = None
        self._closed = False
        self._stop = False
        self._flush_requested = 0
        self._workers: list[threading.Thread] = []
        self._paused = 0
        self._busy = 0
        self._priority_generation = 0
        self.counters = {"pushed_units": 0, "pushed_rows": 0, "ingested_units": 0,
                         "ingested_rows": 0, "delivered_batches": 0, "discarded_batches": 0,
                         "invocations_ing": 0, "invocations_del": 0, "early_batches": 0}
        # On-policy iteration state.
        self.policy_version = 0
        self._iter_pushed_rows = 0
        self._iter_written_rows = 0
        self._iter_landed_rows = 0  # rows whose buffer write finished (<= written)
        self._write_lock = threading.Lock()  # slot order = write order within an iteration
        self._early: dict[int, _Early] = {}
        self._epoch = 0
        self._drawn_in_iter = 0
        self._delivered_in_iter = 0
        self._stream = (torch.cuda.Stream(self.learner_device)
                        if self.learner_device.type == "cuda" else None)

        default = Schedule(0, 1, 0, 1 if mode == "off_policy" else Fraction(1, num_minibatches))
        self.schedule = default
        self._start(schedule or default)

    # ------------------------------------------------------------------ configuration

    def _make_sampler(self, sampler: SamplerArg, seed: int) -> Sampler:
        if self.mode == "on_policy":
            if sampler is not None and not isinstance(sampler, FifoSampler):
                raise ConfigError("sampler", "on-policy planes deliver every row exactly once "
                                             "per epoch with a FIFO sampler; leave sampler "
                                             "unset or pass a FifoSampler")
            if isinstance(sampler, FifoSampler):
                if sampler.num_minibatches != self.num_minibatches:
                    raise ConfigError("sampler", f"FifoSampler has num_minibatches="
                                                 f"{sampler.num_minibatches}, plane has "
                                                 f"{self.num_minibatches}")
                return sampler
            return FifoSampler(num_minibatches=self.num_minibatches, seed=seed)
        if sampler is None or sampler == "uniform":
            return UniformSampler(seed=seed)
        if sampler == "prioritized":
            return PrioritizedSampler(seed=seed)
        if isinstance(sampler, FifoSampler):
            raise ConfigError("sampler", "a FifoSampler is for on-policy planes; use "
                                         "mode='on_policy'")
        if isinstance(sampler, Sampler):
            return sampler
        raise ConfigError("sampler", f"expected 'uniform', 'prioritized' or a Sampler, got "
                                     f"{sampler!r}")

    def _auto_placement(self) -> Placement:
        from conduit.placement import Topology, plan_placement

        topo = Topology.detect()
        learner = str(self.learner_device)
        if self.learner_device.type == "cuda" and self.learner_device.index is None:
            learner = "cuda:0"
        decision = plan_placement(capacity=self.capacity, spec=self.spec, actor_device="cpu",
                                  learner_device=learner, topology=topo)
        self.placement_decision = decision
        return decision.placement

    def register_ingestion(self, *, input: str = "Actor",
                           output: str = "ExperienceBuffer") -> Callable[[IngestionFn],
                                                                         IngestionFn]:
        """Decorator registering the framework's ingestion logic (Fig. 8).

        The function receives ``(actor_in, exp_out)``: it reads rollouts with
        ``actor_in.read()`` (or ``read_units()``) and writes buffer rows with
        ``exp_out.write(...)``.
        """
        if input != "Actor" or output != "ExperienceBuffer":
            raise ConfigError("register_ingestion", f"ingestion connects input='Actor' to "
                                                    f"output='ExperienceBuffer', got "
                                                    f"{input!r} -> {output!r}")

        def deco(fn: IngestionFn) -> IngestionFn:
            with self._cv:
                self._ingest_fn = fn
                self._ingest_registered = True
            return fn
        return deco

    def register_delivery(self, *, input: str = "ExperienceBuffer",
                          output: str = "Learner") -> Callable[[DeliveryFn], DeliveryFn]:
        """Decorator registering the framework's delivery logic (Fig. 8).

        The function receives ``(exp_in, learn_out)``: it reads sampled rows with
        ``exp_in.read()`` and writes training-ready data with ``learn_out.write(...)``, which
        splits it into the invocation's training batches.
        """
        if input != "ExperienceBuffer" or output != "Learner":
            raise ConfigError("register_delivery", f"delivery connects input="
                                                   f"'ExperienceBuffer' to output='Learner', "
                                                   f"got {input!r} -> {output!r}")

        def deco(fn: DeliveryFn) -> DeliveryFn:
            with self._cv:
                self._deliver_fn = fn
            return fn
        return deco

    # ------------------------------------------------------------------ schedule / workers

    @property
    def staleness_bound(self) -> int:
        """Rollout units that may be pushed but not yet sampleable when ``push`` returns."""
        g = int(self.schedule.g_ing) if self.mode == "off_policy" else 0
        return g - 1 if self.schedule.overlap_ing == 0 else 2 * g

    @property
    def prefetch_bound(self) -> int:
        """Training batches that may be staged ahead of the learner.

        Off-policy: one invocation's ``g_del`` batches (the worker refills only when the stage
        is empty, so prefetched batches are at most ``g_del`` ahead). On-policy: two
        mini-batches of the current iteration with overlapped delivery, so one slow gather does
        not stall the learner; the order is fixed by the FIFO layout, so this changes nothing
        the learner sees.
        """
        if self.mode == "on_policy":
            return 2 if self.schedule.overlap_del else 1
        return int(self.schedule.g_del)

    def _stage_room(self) -> int:
        # Off-policy refills an empty stage with one invocation of g_del batches.
        return 1 if self.mode == "off_policy" else self.prefetch_bound

    def _max_pending_units(self) -> int:
        return max(1, 2 * int(self.schedule.g_ing)) if self.mode == "off_policy" else 1 << 30

    def _start(self, schedule: Schedule) -> None:
        self.space.check(schedule)
        self.schedule = schedule
        self._stop = False
        self._workers = []
        if schedule.overlap_ing:
            self._workers.append(threading.Thread(target=self._ingestion_worker,
                                                  name="conduit-ingestion", daemon=True))
        if schedule.overlap_del:
            self._workers.append(threading.Thread(target=self._delivery_worker,
                                                  name="conduit-delivery", daemon=True))
        for w in self._workers:
            w.start()

    def _wake(self, *, callers: bool = False, ingestion: bool = False,
              delivery: bool = False) -> None:
        """Wake the waiters an event concerns (call with the lock held)."""
        if callers:
            self._cv.notify_all()
        if ingestion:
            self._ing_cv.notify_all()
        if delivery:
            self._del_cv.notify_all()

    def _stop_workers(self) -> None:
        with self._cv:
            self._stop = True
            self._wake(callers=True, ingestion=True, delivery=True)
        for w in self._workers:
            w.join(timeout=self.timeout)
            if w.is_alive():  # pragma: no cover - an operator stuck in user code
                raise OperatorError("runtime", TimeoutError(
                    f"worker {w.name} did not stop within {self.timeout}s"))
        self._workers = []

    def set_schedule(self, schedule: Schedule) -> None:
        """Switch overlap and granularity at a quiescent point; data and order are kept.

        Raises:
            ScheduleError: The schedule is outside the feasible space for this configuration.
        """
        self._check_open()
        self.space.check(schedule)
        # Units queued under the old granularity are ingested under it first, so a smaller
        # g_ing never starts with more pending units than its backpressure bound allows.
        self.flush()
        with self.paused():
            self._start(schedule)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Quiesce both operators (in-flight invocations finish), e.g. for migration."""
        self._stop_workers()
        with self._cv:
            self._paused += 1
            while self._busy:
                self._cv.wait(0.05)
            # Mini-batches being assembled early fall back to a gather (the buffer may move,
            # the spec may grow); dropping them is always safe.
            self._early = {}
        try:
            yield
        finally:
            with self._cv:
                self._paused -= 1
                self._wake(callers=True, ingestion=True, delivery=True)
            if not self._workers and not self._closed:
                self._start(self.schedule)

    # ------------------------------------------------------------------ actor side

    def push(self, rollout: Mapping[str, Any], *, policy_version: int | None = None,
             timeout: float | None = None) -> None:
        """Hand one rollout unit to the plane (the actor port).

        With ``overlap_ing=1`` this returns as soon as the unit is queued; ingestion runs on a
        background worker. With ``overlap_ing=0`` ingestion runs here, every ``g_ing`` units.
        The queue is bounded: when it is full, ``push`` waits (backpressure).

        Args:
            rollout: Field -> tensor or numpy array, leading dimension = rows.
            policy_version: On-policy: the policy version that produced the rollout. Older
                than the plane's current version raises; newer waits until the current
                iteration has been consumed.
            timeout: Seconds to wait for room (default: the plane's ``timeout``).

        Raises:
            SpecError: The rollout does not match the spec.
            StaleRolloutError: On-policy rollout from an older policy.
            CapacityError: On-policy rows beyond the iteration's capacity.
            BackpressureTimeout: No room within ``timeout``.
            OperatorError: An ingestion operator raised (now or on the worker earlier).
            PlaneClosedError: The plane is closed.
        """
        t0 = time.perf_counter()
        self._check_open()
        data, rows = self._validate_rollout(rollout)
        deadline = t0 + (self.timeout if timeout is None else timeout)
        with self._cv:
            while True:
                self._raise_if_failed()
                if self.mode == "on_policy":
                    if policy_version is not None and policy_version < self.policy_version:
                        raise StaleRolloutError(
                            f"rollout from policy version {policy_version}, but the plane is "
                            f"at version {self.policy_version}; on-policy updates use fresh "
                            f"samples only")
                    waiting_next = (policy_version is not None
                                    and policy_version > self.policy_version)
                    if not waiting_next:
                        if self._iter_pushed_rows + rows > self.capacity:
                            raise CapacityError(
                                f"on-policy iteration {self.policy_version} holds "
                                f"{self.capacity} rows; {self._iter_pushed_rows} are pushed "
                                f"and this rollout adds {rows}. Pull the iteration's "
                                f"mini-batches first, or tag the rollout with "
                                f"policy_version={self.policy_version + 1}",
                                needed=self._iter_pushed_rows + rows, available=self.capacity)
                        break
                elif len(self._pending) + self._inflight_units < self._max_pending_units():
                    break
                elif self.schedule.overlap_ing == 0 and not self._paused:
                    # Inline ingestion: this thread is the one that drains the queue.
                    self._cv.release()
                    try:
                        self._drain_inline(force=True)
                    finally:
                        self._cv.acquire()
                    continue
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    raise BackpressureTimeout(
                        f"push waited {self.timeout if timeout is None else timeout:.1f}s for "
                        f"room: {len(self._pending)} units queued, {self._inflight_units} "
                        f"being ingested, policy version {self.policy_version}")
                self._cv.wait(remaining)
                self._check_open()
            self._pending.append(_Unit(data, rows, policy_version))
            self._pending_rows += rows
            self.counters["pushed_units"] += 1
            self.counters["pushed_rows"] += rows
            if self.mode == "on_policy":
                self._iter_pushed_rows += rows
            self._wake(ingestion=True)
            inline = self.schedule.overlap_ing == 0
        if inline:
            self._drain_inline(force=False)
        else:
            self.timings.record("sync_ing", time.perf_counter() - t0, start=t0)
        self.timings.record("push", time.perf_counter() - t0, start=t0)

    def _validate_rollout(self, rollout: Mapping[str, Any]) -> tuple[Batch, int]:
        if self.rollout_spec is not None:
            return self.rollout_spec.validate(rollout, what="rollout")
        if not self._ingest_registered:
            return self.spec.validate(rollout, what="rollout")
        rows = batch_rows(rollout, what="rollout")
        return {k: as_tensor(v, field=k) for k, v in rollout.items()}, rows

    def flush(self, *, timeout: float | None = None) -> None:
        """Ingest every pending unit now (even if fewer than ``g_ing`` are queued)."""
        self._check_open()
        if self.schedule.overlap_ing == 0:
            self._drain_inline(force=True)
            return
        deadline = time.perf_counter() + (self.timeout if timeout is None else timeout)
        with self._cv:
            self._flush_requested += 1
            self._wake(ingestion=True)
            try:
                while self._pending or self._inflight_units:
                    self._raise_if_failed()
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:
                        raise EmptyBufferError(f"flush timed out with {len(self._pending)} "
                                               f"units pending")
                    self._cv.wait(remaining)
                self._raise_if_failed()
            finally:
                self._flush_requested -= 1

    def _take_ingestion_locked(self, force: bool) -> list[_Unit] | None:
        if not self._pending or self._paused:
            return None
        g = self.schedule.g_ing
        take: list[_Unit] = []
        if self.mode == "off_policy":
            want = int(g)
            if len(self._pending) < want and not force:
                return None
            while self._pending and len(take) < want:
                take.append(self._pending.popleft())
        else:
            want_rows = max(1, int(g * self.capacity))
            complete = self._iter_pushed_rows >= self.capacity
            if self._pending_rows < want_rows and not (force or complete):
                return None
            got = 0
            while self._pending and (got < want_rows or force or complete):
                u = self._pending.popleft()
                take.append(u)
                got += u.rows
                if got >= want_rows and not (force or complete):
                    break
        self._pending_rows -= sum(u.rows for u in take)
        self._inflight_units += len(take)
        self._busy += 1
        return take

    def _drain_inline(self, *, force: bool) -> None:
        while True:
            with self._cv:
                self._raise_if_failed()
                units = self._take_ingestion_locked(force)
            if units is None:
                return
            with data_path_threads(1):
                self._run_ingestion(units)
            self._raise_if_failed()

    def _ingestion_worker(self) -> None:
        torch.set_num_threads(1)
        while True:
            with self._cv:
                while True:
                    if self._stop or self._error is not None:
                        return
                    units = self._take_ingestion_locked(force=self._flush_requested > 0)
                    if units is not None:
                        break
                    self._ing_cv.wait(1.0)  # wake-ups drive progress; the timeout is a backstop
            self._run_ingestion(units)

    def _run_ingestion(self, units: list[_Unit]) -> None:
        t0 = time.perf_counter()
        out = BufferOut(self._write_rows)
        try:
            self._ingest_fn(ActorIn([u.data for u in units], [u.version for u in units]), out)
        except BaseException as exc:
            self._fail("ingestion", exc)
        finally:
            dt = time.perf_counter() - t0
            g = (len(units) if self.mode == "off_policy"
                 else sum(u.rows for u in units) / self.capacity)
            self.timings.record("ingestion", dt, units=g, start=t0)
            with self._cv:
                self._inflight_units -= len(units)
                self._busy -= 1
                self.counters["ingested_units"] += len(units)
                self.counters["invocations_ing"] += 1
                self._wake(callers=True)

    def _write_rows(self, batch: Mapping[str, Any]) -> int:
        data, n = self.spec.validate(batch, what="write")
        if self.mode != "on_policy":
            self.buffer.extend(data, validate=False)
            with self._cv:
                self.counters["ingested_rows"] += n
                self._wake(callers=True, delivery=True)
            return n
        with self._write_lock:
            with self._cv:
                if self._iter_written_rows + n > self.capacity:
                    raise CapacityError(
                        f"ingestion wrote {self._iter_written_rows + n} rows into on-policy "
                        f"iteration {self.policy_version}, which holds {self.capacity}",
                        needed=self._iter_written_rows + n, available=self.capacity)
                start = self._iter_written_rows
                self._iter_written_rows += n
                plan = start == 0 and self._wants_early_locked()
                version = self.policy_version
            # Planned outside the plane's lock (a permutation of the iteration's rows); the
            # iteration cannot end meanwhile, since its last batch needs this write.
            planned = self._plan_early(version) if plan else None
            with self._cv:
                if planned is not None:
                    self._early = planned
                early = list(self._early.values())
            for e in early:  # in delivery order, each released as soon as it is filled
                k = self._fill_early(e, data, start, n)
                if k:
                    with self._cv:
                        e.filled += k
                        # Complete and next in line: the ingestion worker stages it itself
                        # rather than wake the delivery worker for it (one thread hand-off
                        # fewer on the way to the learner's first pull).
                        job = (self._take_delivery_locked()
                               if e.complete and self.schedule.overlap_ing else None)
                        self._wake(delivery=True)
                    if job is not None:
                        self._deliver_here(job)
            # Slots [start, start + n): the buffer was cleared when the iteration began and
            # the write lock keeps concurrent ingestions in order.
            self.buffer.extend(data, validate=False)
            with self._cv:
                self._iter_landed_rows += n
                self.counters["ingested_rows"] += n
                self._wake(callers=True, delivery=True)
        return n

    def _wants_early_locked(self) -> bool:
        """Assemble the first mini-batches while rows arrive? Only when delivery is
        overlapped (it would stage them first) and the rows live in host memory."""
        return bool(self.schedule.overlap_del) and all(
            torch.device(d).type == "cpu" for d in self.buffer.placement.devices)

    def _plan_early(self, version: int) -> dict[int, _Early]:
        """The first mini-batches of iteration ``version`` (epoch 0), by their slots."""
        sampler = self.buffer.sampler
        assert isinstance(sampler, FifoSampler)
        parts = sampler.layout(self.capacity, iteration=version, epoch=0)
        # Never the iteration's last mini-batch: delivering it ends the iteration and clears
        # the buffer, which must wait until every write has landed.
        total = self.num_minibatches * self.num_epochs
        return {d: _Early(parts[d])
                for d in range(min(self.prefetch_bound, len(parts), total - 1))}

    def _fill_early(self, e: _Early, data: Batch, start: int, n: int) -> int:
        """Copy the rows of ``data`` (slots ``start..start+n``) that belong to ``e``; returns
        how many."""
        pos = ((e.indices >= start) & (e.indices < start + n)).nonzero().squeeze(1)
        if pos.numel() and any(v.device.type != "cpu" for v in data.values()):
            return 0  # never completes; the mini-batch falls back to a gather
        if e.out is None:
            m = int(e.indices.numel())
            # zeros, not empty: touching the pages in one sequential pass is far cheaper than
            # faulting them in row by row as scattered rows arrive (~20× measured).
            e.out = {name: torch.zeros((m, *fs.shape), dtype=fs.dtype)
                     for name, fs in self.spec.fields.items()}
            e.out["_index"] = e.indices
        if pos.numel():
            src = e.indices[pos] - start
            with data_path_threads(1):
                for name in self.spec.fields:
                    copy_rows(e.out[name], pos, data[name], src)
        return int(pos.numel())

    # ------------------------------------------------------------------ learner side

    def pull(self, *, timeout: float | None = None) -> Batch:
        """Take the next training-ready batch (the learner port).

        Off-policy: a sampled batch of ``batch_size`` rows (with ``_index`` and, for
        prioritized samplers, ``_weight``). On-policy: the next shuffled mini-batch of the
        current iteration; after the last one of the last epoch the plane moves to the next
        policy version.

        Raises:
            EmptyBufferError: No batch could be formed within ``timeout`` (for example an
                on-policy iteration that never received its rows).
            OperatorError: A delivery (or ingestion) operator raised.
            PlaneClosedError: The plane is closed.
        """
        t0 = time.perf_counter()
        self._check_open()
        deadline = t0 + (self.timeout if timeout is None else timeout)
        while True:
            with self._cv:
                self._raise_if_failed()
                staged = self._pop_staged_locked()
                job = None
                if staged is None:
                    if self.schedule.overlap_del == 0:
                        job = self._take_delivery_locked()
                    if job is None:
                        remaining = deadline - time.perf_counter()
                        if remaining <= 0:
                            raise EmptyBufferError(self._empty_message(timeout))
                        self._cv.wait(min(remaining, 0.5))
                        self._check_open()
                        continue
            if staged is not None:
                break
            with data_path_threads(1):
                self._run_delivery(job)
        if staged.event is not None:
            torch.cuda.current_stream(self.learner_device).wait_event(staged.event)
        if self.schedule.overlap_del:
            self.timings.record("sync_del", time.perf_counter() - t0, start=t0)
        self.timings.record("pull", time.perf_counter() - t0, start=t0)
        return staged.batch

    def minibatches(self, *, timeout: float | None = None) -> Iterator[Batch]:
        """On-policy: every mini-batch of the current iteration (M × epochs), in order."""
        if self.mode != "on_policy":
            raise ConfigError("mode", "minibatches() is for on-policy planes; use pull()")
        start = self.policy_version
        for _ in range(self.num_minibatches * self.num_epochs):
            yield self.pull(timeout=timeout)
        assert self.policy_version == start + 1

    def _empty_message(self, timeout: float | None) -> str:
        waited = self.timeout if timeout is None else timeout
        if self.mode == "on_policy":
            return (f"no on-policy mini-batch within {waited:.1f}s: iteration "
                    f"{self.policy_version} has {self._iter_written_rows} of {self.capacity} "
                    f"rows ingested ({self._iter_pushed_rows} pushed); push the whole "
                    f"rollout before pulling")
        return (f"no batch within {waited:.1f}s: the buffer holds {len(self.buffer)} rows, "
                f"min_size is {self.min_size} ({len(self._pending)} rollout units pending)")

    def _pop_staged_locked(self) -> _Staged | None:
        while self._staged:
            s = self._staged.popleft()
            if (isinstance(self.buffer.sampler, PrioritizedSampler)
                    and s.generation < self._priority_generation - self.max_priority_lag):
                self.counters["discarded_batches"] += 1
                self._wake(delivery=True)  # the worker may now refill the stage
                continue
            self.counters["delivered_batches"] += 1
            if self.mode == "on_policy":
                self._delivered_in_iter += 1
                if self._delivered_in_iter == self.num_minibatches * self.num_epochs:
                    self._advance_iteration_locked()
                    self._wake(callers=True, ingestion=True)  # pushes of the next version
            self._wake(delivery=True)  # room on the stage
            return s
        return None

    def _advance_iteration_locked(self) -> None:
        self.buffer.clear()
        self.policy_version += 1
        self._iter_pushed_rows = sum(u.rows for u in self._pending)
        self._iter_written_rows = 0
        self._iter_landed_rows = 0
        self._early = {}
        self._epoch = 0
        self._drawn_in_iter = 0
        self._delivered_in_iter = 0

    def _take_delivery_locked(self) -> _DeliveryJob | None:
        if self._paused or len(self._staged) >= self._stage_room():
            return None
        if self.mode == "off_policy":
            if len(self.buffer) < self.min_size:
                return None
            n = int(self.schedule.g_del)
            info = self.buffer.draw(n * self.batch_size)
            job = _DeliveryJob(info, n, self.batch_size, self._priority_generation)
        else:
            total = self.num_minibatches * self.num_epochs
            if self._drawn_in_iter >= total:
                return None
            landed = self._iter_landed_rows >= self.capacity
            early = self._early.get(self._drawn_in_iter)
            if early is not None and landed and not early.complete:
                early = None  # could not be assembled (rows were not on the host): gather
            if not (landed or (early is not None and early.complete)):
                return None
            sampler = self.buffer.sampler
            assert isinstance(sampler, FifoSampler)
            if self._drawn_in_iter % self.num_minibatches == 0:
                sampler.begin_epoch(self.capacity, iteration=self.policy_version,
                                    epoch=self._drawn_in_iter // self.num_minibatches)
            info = sampler.sample(self.capacity)
            if early is not None and not torch.equal(early.indices, info.indices):
                early = None  # pragma: no cover - the layout is a pure function; be safe
            if early is None and not landed:  # pragma: no cover - follows from the above
                raise RuntimeError("on-policy delivery started before the iteration landed")
            self._early.pop(self._drawn_in_iter, None)
            if early is not None:
                self.counters["early_batches"] += 1
            self._drawn_in_iter += 1
            job = _DeliveryJob(info, 1, int(info.indices.numel()), self._priority_generation,
                               early)
        self._busy += 1
        return job

    def _delivery_worker(self) -> None:
        torch.set_num_threads(1)
        while True:
            with self._cv:
                while True:
                    if self._stop or self._error is not None:
                        return
                    job = self._take_delivery_locked()
                    if job is not None:
                        break
                    self._del_cv.wait(1.0)  # wake-ups drive progress; the timeout is a backstop
            self._deliver_here(job)

    def _deliver_here(self, job: _DeliveryJob) -> None:
        """Run a delivery job on the calling worker thread (on the plane's copy stream)."""
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                self._run_delivery(job)
        else:
            self._run_delivery(job)

    def _run_delivery(self, job: _DeliveryJob) -> None:
        t0 = time.perf_counter()
        out = LearnerOut(batches=job.batches, device=self.learner_device)
        try:
            rows = (dict(job.early.out) if job.early is not None and job.early.out is not None
                    else self.buffer.gather(job.info))
            self._deliver_fn(BufferIn(rows, batches=job.batches, batch_size=job.batch_size), out)
            if len(out.staged) != job.batches:
                raise RuntimeError("the delivery operator did not call learn_out.write()")
        except BaseException as exc:
            self._fail("delivery", exc)
        finally:
            event = None
            if self._stream is not None and out.staged:
                event = torch.cuda.Event()
                event.record(self._stream)
            g = job.batches if self.mode == "off_policy" else Fraction(1, self.num_minibatches)
            self.timings.record("delivery", time.perf_counter() - t0, units=float(g), start=t0)
            with self._cv:
                if self._error is None:
                    self._staged.extend(_Staged(b, job.generation, event) for b in out.staged)
                self._busy -= 1
                self.counters["invocations_del"] += 1
                self._wake(callers=True)

    def update_priorities(self, indices: torch.Tensor, priorities: torch.Tensor) -> None:
        """Give new priorities to delivered rows (prioritized sampler only).

        The next batch the learner pulls is drawn after this update (prefetched batches that
        were drawn before it are discarded), unless ``max_priority_lag`` allows otherwise.

        Raises:
            PriorityError: NaN, infinite or negative priorities, or mismatched lengths.
        """
        self._check_open()
        self.buffer.update_priorities(indices, priorities)
        with self._cv:
            self._priority_generation += 1
            self._wake(delivery=True)

    # ------------------------------------------------------------------ placement migration

    def migrate(self, placement: Placement, *, spec: ExperienceSpec | None = None,
                chunk_rows: int = 65_536) -> dict[str, Any]:
        """Move the buffer to ``placement`` (and optionally a wider ``spec``) online.

        Ingestion and delivery pause at a quiescent point (in-flight invocations finish;
        pushes queue up and pulls wait), rows move in chunks from every old shard to every new
        one, and both operators resume under the new placement (Alg. 2). No row is lost or
        duplicated; the ring cursor and the sampler state (priorities, FIFO layout) are kept,
        since indices do not change. When ``spec`` widens a field, rows written before the
        growth are zero-padded in the new part of that field.

        Args:
            placement: The new placement.
            spec: The new spec; every field must keep its name and dtype, and its shape may
                only grow.
            chunk_rows: Rows copied per step (bounds the transient memory).

        Returns:
            What moved: rows, bytes, seconds, and the realized per-device-pair volumes.

        Raises:
            SpecError: ``spec`` drops or narrows a field or changes a dtype.
            CapacityError: The new placement cannot hold the buffer.
        """
        self._check_open()
        new_spec = spec or self.spec
        _check_growth(self.spec, new_spec)
        t0 = time.perf_counter()
        with self.paused():
            old = self.buffer
            new = ExperienceBuffer(spec=new_spec, capacity=self.capacity, sampler=old.sampler,
                                   placement=placement)
            rows = len(old)
            flows: dict[tuple[str, str], int] = {}
            for start in range(0, rows, chunk_rows):
                idx = torch.arange(start, min(rows, start + chunk_rows), dtype=torch.int64)
                data = old.store.get(idx, device=torch.device("cpu")
                                     if placement.primary_device.type == "cpu" else None)
                new.store.set_range(start, _pad_to(data, new_spec))
                for a, b, n in _range_flows(old.store, new.store, start, len(idx)):
                    flows[(a, b)] = flows.get((a, b), 0) + n
            new.writer.load_state_dict(old.writer.state_dict())
            with self._cv:
                self.buffer = new
                self.spec = new_spec
        dt = time.perf_counter() - t0
        self.timings.record("migration", dt, start=t0)
        per_row = new_spec.bytes_per_sample
        return {"rows": rows, "bytes": rows * per_row, "seconds": dt,
                "from": old.placement.to_dict(), "to": placement.to_dict(),
                "flows_rows": {f"{a}->{b}": n for (a, b), n in flows.items()}}

    # ------------------------------------------------------------------ timing / state

    def timed(self, name: Literal["rollout", "update"] | str) -> AbstractContextManager[None]:
        """Time a caller window, e.g. ``with plane.timed("rollout"): ...``."""
        return self.timings.time(name)

    def stats(self) -> dict[str, Any]:
        """Counters, fill level, schedule and placement (JSON-friendly)."""
        with self._cv:
            return {**self.counters, "size": len(self.buffer), "pending_units":
                    len(self._pending), "staged_batches": len(self._staged),
                    "policy_version": self.policy_version, "schedule": self.schedule.to_dict(),
                    "placement": self.buffer.placement.to_dict(), "mode": self.mode}

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint: buffer contents, sampler state (priorities, FIFO cursor), counters.

        Pending rollouts are ingested first, so nothing pushed is lost. Batches staged for the
        learner are not saved; on-policy, their rows are delivered again after a restore.
        """
        self.flush()
        with self.paused(), self._cv:
            sampler_state = self.buffer.state_dict()
            return {"buffer": sampler_state, "counters": dict(self.counters),
                    "policy_version": self.policy_version,
                    "iter_pushed_rows": self._iter_written_rows,
                    "iter_written_rows": self._iter_written_rows,
                    "delivered_in_iter": self._delivered_in_iter,
                    "schedule": self.schedule.to_dict(), "spec": self.spec.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint made by :meth:`state_dict` (placement and schedule may differ)."""
        self._check_open()
        with self.paused(), self._cv:
            self.buffer.load_state_dict(state["buffer"])
            self.counters.update(state["counters"])
            self.policy_version = int(state["policy_version"])
            self._iter_pushed_rows = int(state["iter_pushed_rows"])
            self._iter_written_rows = int(state["iter_written_rows"])
            self._iter_landed_rows = self._iter_written_rows
            self._delivered_in_iter = int(state["delivered_in_iter"])
            self._drawn_in_iter = self._delivered_in_iter
            self._staged.clear()
            sampler = self.buffer.sampler
            if isinstance(sampler, FifoSampler) and self._drawn_in_iter:
                m = self.num_minibatches
                sampler.begin_epoch(self.capacity, iteration=self.policy_version,
                                    epoch=(self._drawn_in_iter - 1) // m)
                sampler.cursor = (self._drawn_in_iter - 1) % m + 1

    # ------------------------------------------------------------------ lifecycle

    def _fail(self, operator: str, exc: BaseException) -> None:
        err = OperatorError(operator, exc)
        err.__cause__ = exc
        with self._cv:
            if self._error is None:
                self._error = err
            self._wake(callers=True, ingestion=True, delivery=True)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _check_open(self) -> None:
        if self._closed:
            raise PlaneClosedError("the plane is closed; create a new ExperienceDataPlane")

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Stop the workers and release the plane. Idempotent; never hangs.

        Units still queued are ingested first (unless an operator failed), so no pushed
        transition is lost from the buffer.
        """
        if self._closed:
            return
        self._stop_workers()
        if self._error is None:
            with contextlib.suppress(OperatorError):
                self._drain_inline(force=True)
        with self._cv:
            self._closed = True
            self._wake(callers=True, ingestion=True, delivery=True)

    def __enter__(self) -> ExperienceDataPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ExperienceDataPlane(mode={self.mode!r}, capacity={self.capacity}, "
                f"placement={self.buffer.placement.label()}, schedule={self.schedule.label()})")
