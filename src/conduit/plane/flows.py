"""Flows: what off-policy and on-policy training allow through the plane.

A flow owns the queue of pushed rollout units, the stage of delivered batches, and the rules
between them: how many units may wait (backpressure), how many an ingestion invocation takes,
when a batch may be drawn, which staged batches are still valid, and, on-policy, the
iteration: exactly-once delivery of each iteration's rows per epoch, gated on the policy
version (docs/design.md §2, §3). Flows decide; they never start threads or run operators.

Methods whose name ends in ``_locked`` are called with the plane's lock
(:attr:`Signals.lock`) held.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import json
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar

import numpy as np
import torch

from conduit.errors import (
    CapacityError,
    ConfigError,
    EmptyBufferError,
    SpecError,
    StaleRolloutError,
    StateError,
)
from conduit.plane.config import PlaneConfig
from conduit.plane.early import EarlyBatch, plan_early
from conduit.scheduling.space import Schedule
from conduit.spec import Batch, ExperienceSpec
from conduit.storage import ExperienceBuffer, SampleInfo
from conduit.storage.state import integer


class _Condition(threading.Condition):
    """A condition that counts the threads waiting on it (changed under its lock, like the
    waits themselves), so that a notification with no one to wake costs one comparison."""

    def __init__(self, lock: threading.RLock) -> None:
        super().__init__(lock)
        self.waiting = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting += 1
        try:
            return super().wait(timeout)
        finally:
            self.waiting -= 1


class Signals:
    """One lock, with a condition per kind of waiter, so that an event wakes only the threads
    it concerns (every wake-up costs a thread hand-off on a small machine).

    Attributes:
        lock: The plane's lock (re-entrant).
        callers: Waited on by ``push``, ``pull``, ``flush`` and ``paused()``.
        ingestion: Waited on by the ingestion worker.
        delivery: Waited on by the delivery worker.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.callers = _Condition(self.lock)
        self.ingestion = _Condition(self.lock)
        self.delivery = _Condition(self.lock)

    def wake(self, *, callers: bool = False, ingestion: bool = False,
             delivery: bool = False) -> None:
        """Wake the waiters an event concerns (call with the lock held)."""
        if callers and self.callers.waiting:
            self.callers.notify_all()
        if ingestion and self.ingestion.waiting:
            self.ingestion.notify_all()
        if delivery and self.delivery.waiting:
            self.delivery.notify_all()


def check_written_rows(wrote: int, unit_rows: Sequence[int]) -> None:
    """On-policy, an ingestion invocation writes exactly the rows of its units (an iteration
    is complete when its pushed rows are written).

    Raises:
        SpecError: ``wrote`` differs from the units' rows.
    """
    pushed = sum(unit_rows)
    if wrote != pushed:
        raise SpecError(None, f"the on-policy ingestion operator wrote {wrote} rows for "
                              f"{len(unit_rows)} rollout unit(s) of {pushed} rows; on-policy, "
                              f"each invocation writes exactly the rows of its units (the "
                              f"iteration's capacity counts pushed rows), so drop or add rows "
                              f"before push, not in the operator")


@dataclass
class Unit:
    """One pushed rollout unit.

    Attributes:
        data: The unit's fields; tensors the caller passed are held, not copied.
        rows: Its rows.
        version: Its policy version (on-policy).
        guards: ``(field, tensor, version counter at push)`` of each held tensor of the
            caller's (:func:`hold_rollout`).
        spec: The buffer spec the unit was checked against at ``push`` (None: it was checked
            against a rollout spec, or an ingestion operator shapes it); a migration that
            widened the spec before the unit was queued widens it when it is queued.
        pusher: The thread whose ``push`` acknowledged it: an inline ingestion that fails on
            another thread reports the loss to that thread's caller only, so ``close()``
            reports it (:attr:`~conduit.plane.runtime.OperatorRuntime.untold`).
    """

    data: Batch
    rows: int
    version: int | None
    guards: tuple[tuple[str, torch.Tensor, int], ...] = ()
    spec: ExperienceSpec | None = None
    pusher: threading.Thread | None = None

    def check_unchanged(self) -> None:
        """Raise if the caller wrote into a held tensor since the push.

        Raises:
            SpecError: A field's tensor was changed in place (named).
        """
        for name, t, version in self.guards:
            if t._version != version:
                raise SpecError(name, "was written in place after push() and before the plane "
                                      "ingested it: a pushed tensor is held until its unit is "
                                      "ingested; push a copy (tensor.clone()) or call flush() "
                                      "before reusing it")


def hold_rollout(source: Mapping[str, Any], data: Batch, *, may_wait: bool
                 ) -> tuple[Batch, tuple[tuple[str, torch.Tensor, int], ...]]:
    """What the plane keeps of a pushed rollout until it is ingested.

    A tensor of the caller's is held as it is, with its version counter, so a write into it
    before ingestion is refused (:meth:`Unit.check_unchanged`) instead of stored. Memory whose
    writes leave no trace (a writable NumPy array, an inference-mode tensor) is copied when
    the unit may wait past the push (``may_wait``), and so is a view of part of a larger
    tensor (``buf[i * 8:(i + 1) * 8]``): a view shares its version counter with the whole
    tensor, so a write into another part of it (the actor filling its next chunk) could not be
    told from a write into the pushed rows. A partial view that is not copied (the unit is
    expected to be ingested within the push) is still guarded: should it wait after all (a save
    on another thread holding the operators), a write anywhere in its tensor is refused rather
    than a write into its rows stored. Tensors the conversion made are the plane's already.

    Args:
        source: The rollout as pushed.
        data: Its fields as admitted (:func:`~conduit.spec.as_tensor`).
        may_wait: The unit may be queued past the ``push`` call.

    Returns:
        The fields to queue and the guards of the held tensors.
    """
    out: Batch = {}
    guards: list[tuple[str, torch.Tensor, int]] = []
    for name, t in data.items():
        src = source.get(name)
        if isinstance(src, torch.Tensor) and t.numel() and t.data_ptr() == src.data_ptr():
            # (a view of part of its storage: its version counter also counts the rest)
            partial = t.untyped_storage().nbytes() > t.numel() * t.element_size()
            if may_wait and (partial or t.is_inference()):
                t = t.clone()
            elif not t.is_inference():  # a partial view too: never store overwritten rows
                guards.append((name, t, t._version))
        elif (isinstance(src, np.ndarray) and may_wait and t.numel() and src.flags.writeable
              and t.data_ptr() == src.ctypes.data):
            t = t.clone()
        out[name] = t
    return out, tuple(guards)


@dataclass
class DeliveryJob:
    """One delivery invocation: the rows drawn and how to split them.

    Attributes:
        done: The invocation is finished: what it made is staged or handed over, or its draw
            was taken back (:meth:`Flow.undo_delivery_locked`); set once, with the flow's
            count of invocations in flight.
    """

    info: SampleInfo
    batches: int
    batch_size: int
    generation: int
    early: EarlyBatch | None = None
    position: int = -1  # on-policy: the mini-batch's place in the iteration (0 = its first)
    done: bool = False


@dataclass
class Staged:
    """A training batch ready for the learner (``event``: its copy's CUDA event, if any)."""

    batch: Batch
    generation: int
    event: Any = None

    def accept(self, device: torch.device) -> None:
        """Hand a batch made on the plane's copy stream to the calling thread's current stream
        on ``device``: that stream waits for the copy, and the batch's device memory is marked
        as used there, so torch's caching allocator does not give it to a later batch until the
        work that stream had queued when the learner dropped it is done (without the mark, the
        copy stream could overwrite rows a queued kernel has yet to read). A no-op for batches
        made without a copy stream."""
        if self.event is None:
            return
        stream = torch.cuda.current_stream(device)
        if not self.event.query():  # (a wait releases the GIL; a query does not)
            stream.wait_event(self.event)
        marked = set()
        for t in self.batch.values():  # once per block: fields are often views of one
            if t.is_cuda and (ptr := t.untyped_storage().data_ptr()) not in marked:
                marked.add(ptr)
                t.record_stream(stream)


def new_counters() -> dict[str, int]:
    """The plane's counters, all zero."""
    return dict.fromkeys(("pushed_units", "pushed_rows", "ingested_units", "ingested_rows",
                          "lost_units", "lost_rows", "delivered_batches", "discarded_batches",
                          "invocations_ing", "invocations_del", "early_batches"), 0)


@dataclass
class Flow(abc.ABC):
    """Queue, stage and delivery rules shared by both flows.

    Attributes:
        config: The plane's configuration.
        buffer: The buffer rows live in (replaced by a migration).
        signals: The plane's lock and conditions.
        schedule: The schedule in force (set by the plane).
        deliver_ready: Called (without the lock) when a batch became deliverable on an
            ingestion thread; the plane may deliver it right there.
        assemble_early: On-policy: whether an iteration's first mini-batches may be
            delivered while its later rows still arrive (False when the delivery operator
            reads the whole iteration, e.g. pads to its longest row).
    """

    config: PlaneConfig
    buffer: ExperienceBuffer
    signals: Signals
    schedule: Schedule
    deliver_ready: Callable[[], None] = lambda: None
    counters: dict[str, int] = field(default_factory=new_counters)
    pending: deque[Unit] = field(default_factory=deque)
    pending_rows: int = 0
    #: The units of the running ingestion invocations.
    inflight: list[Unit] = field(default_factory=list)
    staged: deque[Staged] = field(default_factory=deque)
    #: Delivery invocations drawn and not finished (:attr:`DeliveryJob.done`).
    delivering: int = 0
    priority_generation: int = 0
    policy_version: int = 0
    assemble_early: bool = True
    #: Whether ingesting queued units makes room for a waiting push (off-policy); on-policy
    #: pushes wait on the learner instead.
    room_by_ingesting: ClassVar[bool] = False
    #: Whether a delivery can change the buffer's rows (on-policy: the last mini-batch of an
    #: iteration clears it).
    delivery_changes_rows: ClassVar[bool] = True
    #: Whether the flow's own state says nothing about the rows (off-policy: it is empty), so
    #: the buffer read atomically under its lock is a consistent instant of the plane.
    state_is_buffer: ClassVar[bool] = False

    def __post_init__(self) -> None:
        return None

    def check_ingested(self, units: Sequence[Unit], rows: int) -> None:
        """Check what one ingestion invocation wrote for ``units`` (``rows`` in all); raises
        to fail the invocation. Off-policy an operator may write any number of rows."""
        return None

    @property
    def spec(self) -> ExperienceSpec:
        """Fields of one buffer row."""
        return self.buffer.spec

    # -- actor side ------------------------------------------------------------------------

    @abc.abstractmethod
    def admit_locked(self, rows: int, version: int | None) -> bool:
        """Whether a unit of ``rows`` may be queued now (False: wait for room).

        Raises:
            StaleRolloutError: On-policy rollout from an older policy.
            CapacityError: On-policy rows beyond the iteration's capacity.
        """

    def enqueue_locked(self, unit: Unit) -> None:
        """Queue an admitted unit."""
        self.pending.append(unit)
        self.pending_rows += unit.rows
        self.counters["pushed_units"] += 1
        self.counters["pushed_rows"] += unit.rows

    def withdraw_locked(self, unit: Unit) -> bool:
        """Take ``unit`` back out of the queue, as if it had never been pushed (its push
        raises); False when it is no longer queued."""
        for k, queued in enumerate(self.pending):
            if queued is unit:
                del self.pending[k]
                self.pending_rows -= unit.rows
                self.counters["pushed_units"] -= 1
                self.counters["pushed_rows"] -= unit.rows
                self.signals.wake(callers=True)  # room for a waiting push
                return True
        return False

    @abc.abstractmethod
    def take_ingestion_locked(self, *, force: bool) -> list[Unit] | None:
        """The units of the next ingestion invocation, or None if it should not run yet
        (``force``: run with fewer than ``g_ing`` units)."""

    @property
    def inflight_units(self) -> int:
        """Units of the running ingestion invocations."""
        return len(self.inflight)

    def _taken_locked(self, take: list[Unit]) -> list[Unit]:
        self.pending_rows -= sum(u.rows for u in take)
        self.inflight.extend(take)
        return take

    def ingested_locked(self, units: list[Unit], *, failed: bool,
                        written: Sequence[tuple[int, int, int]] = (), rows: int = 0) -> int:
        """An ingestion invocation over ``units`` finished, or ``failed`` (its units are
        lost and counted in ``lost_units`` / ``lost_rows``). ``written``: what each of its
        writes returned (:meth:`write`), in order; ``rows``: the rows they wrote.

        Returns:
            Rows a failed invocation wrote that stay in the buffer (0 when it did not fail).
        """
        done = {id(u) for u in units}
        self.inflight = [u for u in self.inflight if id(u) not in done]
        self.counters["invocations_ing"] += 1
        key = "lost" if failed else "ingested"
        self.counters[f"{key}_units"] += len(units)
        if failed:
            self.counters["lost_rows"] += sum(u.rows for u in units)
        return rows if failed else 0

    def kept_rows_note(self, units: Sequence[Unit], kept: int) -> str | None:
        """What to push again after an ingestion invocation over ``units`` failed with
        ``kept`` of the rows it wrote staying in the buffer (None: nothing to add to the
        error's own advice). Off-policy, kept rows count against nothing."""
        return None

    @abc.abstractmethod
    def ingestion_units(self, units: list[Unit]) -> float:
        """The granularity an invocation over ``units`` processed, for the timings."""

    @abc.abstractmethod
    def write(self, data: Batch, n: int) -> tuple[int, int, int] | None:
        """Append ``n`` validated rows (called by the ingestion operator, without the lock).

        Returns:
            On-policy, ``(policy version, first row in the iteration, n)``; None off-policy.
        """

    @property
    @abc.abstractmethod
    def max_pending_units(self) -> int:
        """Units that may wait before ``push`` blocks."""

    # -- learner side ----------------------------------------------------------------------

    @property
    def staleness_bound(self) -> int:
        """Rollout units that may be pushed but not yet sampleable when ``push`` returns."""
        g = 0 if self.config.on_policy else int(self.schedule.g_ing)
        return g - 1 if self.schedule.overlap_ing == 0 else 2 * g

    @property
    @abc.abstractmethod
    def prefetch_bound(self) -> int:
        """Training batches that may be staged ahead of the learner."""

    @property
    @abc.abstractmethod
    def stage_room(self) -> int:
        """Staged batches below which a delivery invocation may run."""

    @property
    def wake_below(self) -> int:
        """Staged batches below which a pull wakes the delivery worker (:attr:`stage_room`
        unless a flow batches its wake-ups)."""
        return self.stage_room

    @abc.abstractmethod
    def take_delivery_locked(self) -> DeliveryJob | None:
        """Draw the next delivery invocation's rows, or None if no batch can be formed yet."""

    @abc.abstractmethod
    def starved_locked(self) -> bool:
        """Whether no batch can be formed until queued units are ingested."""

    @abc.abstractmethod
    def delivery_units(self, job: DeliveryJob) -> float:
        """The granularity a delivery invocation processed, for the timings."""

    def undo_delivery_locked(self, job: DeliveryJob) -> None:
        """``job``'s invocation made nothing that will be delivered (its operator raised,
        another operator's error was latched meanwhile, or an interrupt such as
        ``KeyboardInterrupt`` reached the thread that ran it): it is done. Off-policy nothing
        is owed: the next draw is another sample. Nothing changes for a job already done."""
        self._delivery_done_locked(job)

    def _delivery_done_locked(self, job: DeliveryJob | None) -> None:
        """``job``'s invocation finished (staged, handed over or taken back): once per job
        (None: nothing to finish)."""
        if job is not None and not job.done:
            # one statement: an interrupt lands before both changes or after both
            job.done, self.delivering = True, self.delivering - 1

    def caller_delivers_locked(self) -> bool:
        """Whether, under overlapped delivery, a waiting ``pull`` runs the next delivery
        invocation itself instead of waiting for the worker."""
        return False

    def worker_delivers_locked(self) -> bool:
        """Whether the delivery worker may take the next invocation."""
        return True

    def stage_locked(self, batches: list[Batch], generation: int, event: Any,
                     job: DeliveryJob | None = None) -> None:
        """Put the training batches of ``job``'s finished invocation on the stage; the job is
        done. An interrupt (``KeyboardInterrupt``) stages them all and finishes the job, or
        does neither (the job's caller then takes its draw back)."""
        made = [Staged(b, generation, event) for b in batches]
        try:
            self.staged.extend(made)
            self._delivery_done_locked(job)
        except BaseException:
            if made and self.staged and self.staged[-1] is made[-1]:
                self._delivery_done_locked(job)  # staged: finished
            raise

    def pop_staged_locked(self) -> Staged | None:
        """The next valid staged batch, or None, accepted on the calling (learner) thread's
        current stream (:meth:`Staged.accept`). Batches that priority updates made stale are
        discarded (beyond ``max_priority_lag``). An interrupt (``KeyboardInterrupt``) leaves
        the batch staged, or counts it delivered (:meth:`_deliver_locked`)."""
        while self.staged:
            s = self.staged[0]
            if self._stale(s.generation):
                self.staged.popleft()
                self.counters["discarded_batches"] += 1
                self.signals.wake(delivery=True)  # the worker may now refill the stage
                continue
            self._deliver_locked(s, None)
            # Before the wake-up: the stream calls may release the GIL, and a worker woken
            # first would take it for its whole next delivery while the learner waits.
            s.accept(self.config.learner_device)
            self._refill_if_room_locked()
            return s
        return None

    def hand_over_locked(self, generation: int, job: DeliveryJob | None = None) -> bool:
        """Count a batch drawn at ``generation`` (by ``job``, then done) that a ``pull`` made
        for itself as delivered, as :meth:`pop_staged_locked` counts a staged one, so that it
        skips the stage. False, with nothing counted, when a batch is staged before it or
        priority updates made it stale: it must then be staged. An interrupt
        (``KeyboardInterrupt``) counts it delivered and finishes ``job``, or does neither
        (:meth:`_deliver_locked`)."""
        if self.staged or self._stale(generation):
            return False
        self._deliver_locked(None, job)
        self._refill_if_room_locked()
        return True

    def _deliver_locked(self, staged: Staged | None, job: DeliveryJob | None) -> None:
        """Count one batch delivered: ``staged``, the first on the stage, taken off it, or the
        batch of ``job``, handed over (its invocation done). All or nothing with respect to an
        interrupt (``KeyboardInterrupt``): the count is one statement
        (:meth:`_count_delivered_locked`), and an interrupt after it completes the rest
        (:meth:`_settle_delivered_locked`, which does each step once) before it propagates."""
        count = self.counters["delivered_batches"]
        try:
            self._count_delivered_locked()
            self._settle_delivered_locked(staged, job)
        except BaseException:
            if self.counters["delivered_batches"] != count:  # counted: complete it
                self._settle_delivered_locked(staged, job)
            raise

    def _count_delivered_locked(self) -> None:
        """Count a delivered batch, in one statement."""
        self.counters["delivered_batches"] += 1

    def _settle_delivered_locked(self, staged: Staged | None, job: DeliveryJob | None) -> None:
        """What follows a delivered batch's count; a step already done is not done again."""
        if staged is not None and self.staged and self.staged[0] is staged:
            self.staged.popleft()
        self._delivery_done_locked(job)
        self._delivered_locked()

    def _stale(self, generation: int) -> bool:
        return (self.buffer.sampler.invalidates_prefetch
                and generation < self.priority_generation - self.config.max_priority_lag)

    def _refill_if_room_locked(self) -> None:
        if len(self.staged) < self.wake_below:
            # Room for an invocation. Off-policy a whole g_del is staged at once, so the
            # pulls that leave some staged do not wake the worker: a wake-up is a thread
            # hand-off the learner pays for, and the worker could do nothing with it.
            self.signals.wake(delivery=True)

    def _delivered_locked(self) -> None:
        """After a delivered batch's count (on-policy: end a consumed iteration); does nothing
        when called again."""
        return None

    def priorities_updated_locked(self) -> None:
        """A priority update happened: batches drawn before it are stale."""
        self.priority_generation += 1

    def pause_locked(self) -> None:
        """Both operators are quiescent (a migration or restore may follow)."""
        return None

    @abc.abstractmethod
    def empty_message(self, waited: float) -> str:
        """Why no batch could be formed within ``waited`` seconds."""

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """Iteration state (empty off-policy)."""
        return {}

    def check_state(self, state: Mapping[str, int], *, rows: int) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state`` over a buffer of
        ``rows`` rows, changing nothing (a restore checks before it loads the buffer)."""
        return None

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore :meth:`state_dict` (with the buffer already restored)."""
        self.staged.clear()


class OffPolicyFlow(Flow):
    """Replay: rows stay until the ring overwrites them; batches are drawn with replacement
    across iterations. A push waits when ``2·g_ing`` units are already queued."""

    room_by_ingesting: ClassVar[bool] = True
    delivery_changes_rows: ClassVar[bool] = False
    state_is_buffer: ClassVar[bool] = True

    @property
    def max_pending_units(self) -> int:
        return max(1, 2 * int(self.schedule.g_ing))

    def admit_locked(self, rows: int, version: int | None) -> bool:
        return len(self.pending) + self.inflight_units < self.max_pending_units

    def take_ingestion_locked(self, *, force: bool) -> list[Unit] | None:
        """The next ``g_ing`` units, fewer where more would hold over ``capacity`` rows: an
        invocation's units may be written as one batch, which must fit the ring (each unit
        does, as ``push`` checks)."""
        want = int(self.schedule.g_ing)
        if not self.pending or (len(self.pending) < want and not force):
            return None
        take: list[Unit] = []
        rows, room = 0, self.config.capacity
        while self.pending and len(take) < want:
            if take and rows + self.pending[0].rows > room:
                break
            rows += self.pending[0].rows
            take.append(self.pending.popleft())
        return self._taken_locked(take)

    def ingestion_units(self, units: list[Unit]) -> float:
        return float(len(units))

    def write(self, data: Batch, n: int) -> None:
        self.buffer.extend(data, validate=False)
        with self.signals.lock:
            self.counters["ingested_rows"] += n
            self.signals.wake(callers=True, delivery=True)
        return None

    @property
    def prefetch_bound(self) -> int:
        """One invocation's ``g_del`` batches: the stage is refilled only when empty."""
        return int(self.schedule.g_del)

    @property
    def stage_room(self) -> int:
        return 1

    def take_delivery_locked(self) -> DeliveryJob | None:
        if len(self.staged) >= self.stage_room or len(self.buffer) < self.config.first_batch_rows:
            return None
        delivering = self.delivering
        try:
            return self._draw_locked()
        except BaseException:  # an interrupt (KeyboardInterrupt): nothing is in flight
            self.delivering = delivering
            raise

    def _draw_locked(self) -> DeliveryJob:
        n = int(self.schedule.g_del)
        info = self.buffer.draw(n * self.config.batch_size)
        self.delivering += 1
        return DeliveryJob(info, n, self.config.batch_size, self.priority_generation)

    def starved_locked(self) -> bool:
        return len(self.buffer) < self.config.first_batch_rows

    def delivery_units(self, job: DeliveryJob) -> float:
        return float(job.batches)

    def empty_message(self, waited: float) -> str:
        return (f"no batch within {waited:.1f}s: the buffer holds {len(self.buffer)} rows, "
                f"min_size is {self.config.first_batch_rows} ({len(self.pending)} rollout "
                f"units pending)")


class OnPolicyFlow(Flow):
    """Consume-once iterations: ``capacity`` rows per policy version, each delivered exactly
    once per epoch in the sampler's fixed layout; the last mini-batch of the last epoch clears
    the buffer and moves to the next policy version. Pushes tagged with a newer version queue
    up until then."""

    #: Mini-batches staged ahead with overlapped delivery, and so the most an iteration
    #: assembles early (delivered before all of its rows landed).
    MOST_STAGED: ClassVar[int] = 2

    def __post_init__(self) -> None:
        self.iter_pushed_rows = 0
        self.iter_written_rows = 0
        self.iter_landed_rows = 0  # rows whose buffer write finished (<= written)
        self.drawn_in_iter = 0
        self.drawn_rows = 0  # rows [0, drawn_rows) may be in a mini-batch drawn this iteration
        self.delivered_in_iter = 0
        self.early: dict[int, EarlyBatch] = {}
        self._write_lock = threading.Lock()  # slot order = write order within an iteration
        # (``delivering``: at most one on-policy, see :meth:`take_delivery_locked`)
        self._refused_delivery = False  # a draw waited on one in flight: wake the worker
        self._advancing_to: int | None = None  # see _advance_locked

    @property
    def max_pending_units(self) -> int:
        return 1 << 30

    def admit_locked(self, rows: int, version: int | None) -> bool:
        """Admits the current version's rows up to the capacity; a newer version waits until
        the plane reaches it (the iterations before it consumed). A unit of more rows than an
        iteration holds is refused whatever its version: it can never be admitted."""
        cap = self.config.capacity
        if rows > cap:
            raise CapacityError(
                f"a rollout of {rows} rows is larger than an on-policy iteration, which holds "
                f"{cap} rows (capacity); split it or raise capacity", needed=rows,
                available=cap)
        if version is not None and version < self.policy_version:
            raise StaleRolloutError(
                f"rollout from policy version {version}, but the plane is at version "
                f"{self.policy_version}; on-policy updates use fresh samples only")
        if version is not None and version > self.policy_version:
            return False
        if self.iter_pushed_rows + rows > self.config.capacity:
            raise CapacityError(
                f"on-policy iteration {self.policy_version} holds {self.config.capacity} "
                f"rows; {self.iter_pushed_rows} are pushed and this rollout adds {rows}. "
                f"Pull the iteration's mini-batches first, or tag the rollout with "
                f"policy_version={self.policy_version + 1}",
                needed=self.iter_pushed_rows + rows, available=self.config.capacity)
        return True

    def enqueue_locked(self, unit: Unit) -> None:
        super().enqueue_locked(unit)
        self.iter_pushed_rows += unit.rows

    def withdraw_locked(self, unit: Unit) -> bool:
        if not super().withdraw_locked(unit):
            return False
        self.iter_pushed_rows -= unit.rows
        return True

    def take_ingestion_locked(self, *, force: bool) -> list[Unit] | None:
        if not self.pending:
            return None
        want_rows = max(1, int(self.schedule.g_ing * self.config.capacity))
        complete = self.iter_pushed_rows >= self.config.capacity
        if self.pending_rows < want_rows and not (force or complete):
            return None
        take: list[Unit] = []
        got = 0
        while self.pending and (got < want_rows or force or complete):
            u = self.pending.popleft()
            take.append(u)
            got += u.rows
            if got >= want_rows and not (force or complete):
                break
        return self._taken_locked(take)

    def ingested_locked(self, units: list[Unit], *, failed: bool,
                        written: Sequence[tuple[int, int, int]] = (), rows: int = 0) -> int:
        """Failed units leave the iteration, so it can still fill up with new pushes; so do
        the rows their invocation wrote before it failed, where nothing depends on them yet
        (:meth:`_take_back_locked`). Rows that stay (the returned count) stay counted against
        the iteration's capacity: only the failed units' other rows leave it."""
        kept = super().ingested_locked(units, failed=failed, rows=rows)
        if failed:
            if self._take_back_locked(written):
                kept = 0
            self.iter_pushed_rows -= sum(u.rows for u in units) - kept
        return kept

    def kept_rows_note(self, units: Sequence[Unit], kept: int) -> str | None:
        if not kept:
            return None
        lost = sum(u.rows for u in units)
        prefix, first = 0, None
        for k, u in enumerate(units):
            prefix += u.rows
            if prefix == kept:
                first = k + 1
                break
        which = (f"; an operator that wrote its units in order wrote the rows of the first "
                 f"{first} of the {len(units)}: push again only the last {len(units) - first}"
                 if first is not None else "")
        return (f"conduit: on-policy, the {kept} rows kept stay in iteration "
                f"{self.policy_version} and count against its {self.config.capacity} rows: "
                f"push again only rollouts of the {lost - kept} rows not stored (pushing "
                f"every lost unit again would store the kept rows twice, or be refused with "
                f"CapacityError past the capacity){which}")

    def _take_back_locked(self, written: Sequence[tuple[int, int, int]]) -> bool:
        """Drop the rows of a failed invocation's writes ``(version, start, n)`` from the
        iteration, as if never written: a push of the same rollout then lands each row once.
        Kept where something depends on them: a later write of another invocation, or a
        mini-batch already drawn that may hold them (one assembled early from the rows before
        them does not). True when none is kept."""
        if not written:
            return True
        start, total = written[0][1], sum(n for _, _, n in written)
        if (any(v != self.policy_version for v, _, _ in written) or self.drawn_rows > start
                or self.iter_written_rows != start + total
                or self.iter_landed_rows != self.iter_written_rows):
            return False
        try:
            self.buffer.drop_newest(total)
        except ConfigError:  # a sampler with per-row state: the rows stay, as they were
            return False
        self.iter_written_rows = self.iter_landed_rows = start
        self.counters["ingested_rows"] -= total
        self.early = {}  # they may hold the dropped rows: the iteration gathers instead
        return True

    def check_ingested(self, units: Sequence[Unit], rows: int) -> None:
        """An iteration is complete when its pushed rows are written, so an invocation must
        write as many rows as its units hold.

        Raises:
            SpecError: It wrote another number of rows.
        """
        check_written_rows(rows, [u.rows for u in units])

    def ingestion_units(self, units: list[Unit]) -> float:
        return sum(u.rows for u in units) / self.config.capacity

    def write(self, data: Batch, n: int) -> None:
        cap = self.config.capacity
        with self._write_lock:
            with self.signals.lock:
                if self.iter_written_rows + n > cap:
                    raise CapacityError(
                        f"ingestion wrote {self.iter_written_rows + n} rows into on-policy "
                        f"iteration {self.policy_version}, which holds {cap}",
                        needed=self.iter_written_rows + n, available=cap)
                start = self.iter_written_rows
                self.iter_written_rows += n
                # one write that lands the whole iteration leaves nothing to assemble early
                plan = start == 0 and n < cap and self._wants_early()
                version = self.policy_version
            # Planned outside the lock (a permutation of the iteration's rows); the iteration
            # cannot end meanwhile, since its last batch needs this write.
            planned = (plan_early(self.buffer.sampler, capacity=cap, iteration=version,
                                  count=self.prefetch_bound,
                                  batches_per_iteration=self.config.batches_per_iteration)
                       if plan else None)
            with self.signals.lock:
                if planned is not None:
                    self.early = planned
                early = list(self.early.values())
            for e in early:  # in delivery order, each released as soon as it is filled
                k = e.fill(self.spec, data, start, n)
                if k:
                    with self.signals.lock:
                        e.filled += k
                        self.signals.wake(delivery=True)
                        ready = e.complete and bool(self.schedule.overlap_ing)
                    if ready:
                        self.deliver_ready()
            # Slots [start, start + n): the buffer was cleared when the iteration began, and
            # the write lock keeps concurrent ingestions in order.
            self.buffer.extend(data, validate=False)
            with self.signals.lock:
                self.iter_landed_rows += n
                self.counters["ingested_rows"] += n
                # the worker takes nothing while the caller's first mini-batch is still due
                self.signals.wake(callers=True, delivery=not self.caller_delivers_locked())
        return version, start, n

    def _wants_early(self) -> bool:
        """Assemble the first mini-batches while rows arrive only when delivery is overlapped
        (it stages them first), the rows live in host memory and the delivery operator does
        not read the whole iteration (``assemble_early``)."""
        return self.assemble_early and bool(self.schedule.overlap_del) and all(
            torch.device(d).type == "cpu" for d in self.buffer.placement.devices)

    @property
    def first_by_caller(self) -> bool:
        """With inline ingestion and overlapped delivery, the learner's own ``pull`` assembles
        each iteration's first mini-batch, and the worker prefetches from the second on, once
        the first is staged (docs/design.md §2)."""
        return bool(self.schedule.overlap_del) and not self.schedule.overlap_ing

    def caller_delivers_locked(self) -> bool:
        return self.first_by_caller and self.drawn_in_iter == 0

    def worker_delivers_locked(self) -> bool:
        if not self.first_by_caller:
            return True
        first_pending = self.drawn_in_iter == 1 and not (self.delivered_in_iter or self.staged)
        return self.drawn_in_iter > 0 and not first_pending

    @property
    def prefetch_bound(self) -> int:
        """Two mini-batches with overlapped delivery (one slow gather does not stall the
        learner; the order is fixed by the layout), else one."""
        return self.MOST_STAGED if self.schedule.overlap_del else 1

    @property
    def stage_room(self) -> int:
        return self.prefetch_bound

    @property
    def wake_below(self) -> int:
        return 1

    def take_delivery_locked(self) -> DeliveryJob | None:
        """The next mini-batch in the layout's order, or None while another delivery
        invocation is in flight (the ingestion worker stages an early-assembled mini-batch
        while the delivery worker runs): an iteration's invocations run one at a time, each
        staged before the next is drawn, so the learner gets the mini-batches in layout order
        under every schedule, and a failed invocation is always the last drawn
        (:meth:`undo_delivery_locked`). The invocation that finishes wakes the delivery
        worker if a draw was refused meanwhile."""
        if self.delivering:
            self._refused_delivery = True
            return None
        cap = self.config.capacity
        if (len(self.staged) >= self.stage_room
                or self.drawn_in_iter >= self.config.batches_per_iteration):
            return None
        landed = self.iter_landed_rows >= cap
        early = self.early.get(self.drawn_in_iter)
        if early is not None and landed and not early.complete:
            early = None  # could not be assembled (rows were not in host memory): gather
        if not (landed or (early is not None and early.complete)):
            return None
        # A draw is all or nothing: a sampler error, or an interrupt (KeyboardInterrupt)
        # anywhere in it, puts back what it changed, the sampler's cursor included.
        saved = (self.drawn_in_iter, self.drawn_rows, self.delivering,
                 self.counters["early_batches"], self.early.get(self.drawn_in_iter))
        try:
            return self._draw_locked(early, landed)
        except BaseException:
            self._undraw_locked(*saved)
            raise

    def _draw_locked(self, early: EarlyBatch | None, landed: bool) -> DeliveryJob:
        """Draw the next mini-batch (see :meth:`take_delivery_locked`)."""
        cap, position = self.config.capacity, self.drawn_in_iter
        sampler = self.buffer.sampler
        m = self.config.num_minibatches
        if position % m == 0:
            sampler.begin_epoch(cap, iteration=self.policy_version, epoch=position // m)
        info = sampler.sample(cap, 0)
        if early is not None and not torch.equal(early.indices, info.indices):
            early = None  # pragma: no cover - the layout is a pure function
        if early is None and not landed:  # pragma: no cover - follows from the above
            raise EmptyBufferError("on-policy delivery started before the iteration landed")
        self.early.pop(position, None)
        if early is not None:
            self.counters["early_batches"] += 1
            if info.indices.numel():
                self.drawn_rows = max(self.drawn_rows, int(info.indices.max()) + 1)
        else:
            self.drawn_rows = cap  # drawn from the landed iteration: any row
        self.drawn_in_iter, self.delivering = position + 1, self.delivering + 1
        return DeliveryJob(info, 1, int(info.indices.numel()), self.priority_generation, early,
                           position=position)

    def _undraw_locked(self, position: int, drawn_rows: int, delivering: int, early_count: int,
                       early: EarlyBatch | None) -> None:
        """Put back what a draw of mini-batch ``position`` changed (the values before it):
        the next draw is that mini-batch again (an epoch's first lays the epoch out again)."""
        with contextlib.suppress(Exception):  # (the draw's own error is raised)
            self.buffer.sampler.seek(position % self.config.num_minibatches)
        if early is not None:
            self.early[position] = early
        self.counters["early_batches"] = early_count
        self.drawn_in_iter, self.drawn_rows, self.delivering = position, drawn_rows, delivering

    def _delivery_done_locked(self, job: DeliveryJob | None) -> None:
        """A delivery invocation finished (staged, handed over or undone): the next may be
        drawn."""
        super()._delivery_done_locked(job)
        if self._refused_delivery:
            self._refused_delivery = False
            self.signals.wake(delivery=True)

    def undo_delivery_locked(self, job: DeliveryJob) -> None:
        """The mini-batch of a failed invocation is owed: its draw is taken back, so that the
        next invocation (after ``recover()``) draws the same rows and every row is still
        delivered exactly once per epoch. Invocations of an iteration run one at a time
        (:meth:`take_delivery_locked`), so the failed one is the last drawn. Nothing changes
        for a job already done; an interrupt (``KeyboardInterrupt``) leaves the job not done
        (called again, it completes) or the draw taken back."""
        if job.done:
            return
        if job.position < 0 or job.position != self.drawn_in_iter - 1:
            self._delivery_done_locked(job)  # pragma: no cover - not expected
            return  # pragma: no cover - a later draw or another iteration (not expected)
        # The next draw is this mini-batch again (an epoch's first lays the epoch out again).
        self.buffer.sampler.seek(job.position % self.config.num_minibatches)
        # one statement: the draw is taken back and the job done together
        self.drawn_in_iter, job.done, self.delivering = (job.position, True,
                                                         self.delivering - 1)
        if self._refused_delivery:
            self._refused_delivery = False
            self.signals.wake(delivery=True)

    def starved_locked(self) -> bool:
        return self.iter_written_rows < self.config.capacity

    def delivery_units(self, job: DeliveryJob) -> float:
        return float(Fraction(1, self.config.num_minibatches))

    def _count_delivered_locked(self) -> None:
        # one statement: the plane's count and the iteration's
        self.counters["delivered_batches"], self.delivered_in_iter = (
            self.counters["delivered_batches"] + 1, self.delivered_in_iter + 1)

    def _delivered_locked(self) -> None:
        if self.delivered_in_iter == self.config.batches_per_iteration:
            self._advance_locked()
            # Pushes of the next version wait in push() for admission; the ingestion worker
            # has work only if units were already queued (a push wakes it for its own).
            self.signals.wake(callers=True, ingestion=bool(self.pending))

    def _advance_locked(self) -> None:
        """End the consumed iteration (every mini-batch delivered): clear the buffer and move
        to the next policy version. Until its last statement, which marks the iteration
        ended, it may be called again (an interrupt before it): each step sets what it set
        the first time (the version it moves to is noted first)."""
        if self._advancing_to is None:
            self._advancing_to = self.policy_version + 1
        self.buffer.clear()
        self.early = {}
        self.policy_version = self._advancing_to
        self.iter_pushed_rows = sum(u.rows for u in self.pending)
        self.iter_written_rows = self.iter_landed_rows = 0
        self.drawn_in_iter = self.drawn_rows = 0
        self.delivered_in_iter, self._advancing_to = 0, None  # (one line: ended)

    def pause_locked(self) -> None:
        """Mini-batches being assembled early fall back to a gather (the buffer may move, the
        spec may grow); dropping them is always safe."""
        self.early = {}

    def empty_message(self, waited: float) -> str:
        return (f"no on-policy mini-batch within {waited:.1f}s: iteration "
                f"{self.policy_version} has {self.iter_written_rows} of {self.config.capacity} "
                f"rows ingested ({self.iter_pushed_rows} pushed); push the whole rollout "
                f"before pulling")

    def state_dict(self) -> dict[str, Any]:
        """Policy version, rows written and mini-batches delivered in the iteration, and,
        part way through an epoch, how that epoch is laid out (``layout``: the sampler's kind
        and configuration, and a digest of the epoch's mini-batches)."""
        return {"policy_version": self.policy_version,
                "iter_written_rows": self.iter_written_rows,
                "delivered_in_iter": self.delivered_in_iter,
                "layout": self._layout(self.policy_version, self.delivered_in_iter)}

    def _layout(self, version: int, delivered: int) -> dict[str, Any] | None:
        """What a load re-lays after ``delivered`` mini-batches of iteration ``version``
        (None at an epoch's start: nothing of the epoch is laid out yet). ``digest`` is None
        for a sampler whose ``layout`` raises ``ConfigError`` (the base class's: no pure
        layout); its kind and configuration are compared instead."""
        m = self.config.num_minibatches
        if delivered % m == 0:
            return None
        sampler = self.buffer.sampler
        digest = None
        try:
            parts = sampler.layout(self.config.capacity, iteration=version, epoch=delivered // m)
        except ConfigError:  # a consume-once sampler without a pure layout
            parts = None
        if parts is not None:
            h = hashlib.sha1(usedforsecurity=False)
            for part in parts:
                h.update(np.asarray(part, dtype=np.int64).tobytes() + b"|")
            digest = h.hexdigest()
        # as a checkpoint's JSON holds it (a value JSON lacks is compared as its text)
        return json.loads(json.dumps({"kind": type(sampler).__name__, "config": sampler.config(),
                                      "digest": digest}, default=repr))

    def check_state(self, state: Mapping[str, int], *, rows: int) -> None:
        integer(state, "policy_version", "flow")
        written = integer(state, "iter_written_rows", "flow", high=self.config.capacity)
        delivered = integer(state, "delivered_in_iter", "flow",
                            high=self.config.batches_per_iteration - 1)
        if written != rows:
            raise StateError("flow.iter_written_rows", f"{written}, but the buffer holds "
                                                       f"{rows} rows")
        if written < self.config.capacity and delivered > self.MOST_STAGED:
            # early assembly delivers an iteration's first mini-batches before its last rows
            raise StateError("flow.delivered_in_iter", f"{delivered} mini-batches delivered "
                                                       f"from an iteration that is not full "
                                                       f"(at most {self.MOST_STAGED} are "
                                                       f"delivered early)")
        saved = state.get("layout")  # absent from states made before it was recorded
        if isinstance(saved, dict) and delivered % self.config.num_minibatches:
            mine = self._layout(integer(state, "policy_version", "flow"), delivered)
            assert mine is not None
            same = (saved.get("digest") == mine["digest"] if saved.get("digest") and
                    mine["digest"] else (saved.get("kind"), saved.get("config"))
                    == (mine["kind"], mine["config"]))
            if not same:  # the rest of the epoch is laid out again on load
                raise StateError("flow.layout", f"the saved epoch's mini-batches (laid out by "
                                                f"a {saved.get('kind')} with "
                                                f"{saved.get('config')}) are not those this "
                                                f"plane's {mine['kind']} with "
                                                f"{mine['config']} lays out: rows delivered "
                                                f"before the save would be delivered again "
                                                f"and others never; load into a plane whose "
                                                f"sampler is like the saved one (or save at "
                                                f"an epoch's end)")

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore :meth:`state_dict`; the sampler resumes after the last delivered batch."""
        self.check_state(state, rows=len(self.buffer))
        version = integer(state, "policy_version", "flow")
        written = integer(state, "iter_written_rows", "flow", high=self.config.capacity)
        delivered = integer(state, "delivered_in_iter", "flow",
                            high=self.config.batches_per_iteration - 1)
        super().load_state_dict(state)
        self.policy_version = version
        self.iter_pushed_rows = self.iter_written_rows = self.iter_landed_rows = written
        self.delivered_in_iter = self.drawn_in_iter = delivered
        self.drawn_rows = written if delivered else 0
        self.early = {}
        if self.drawn_in_iter:
            m = self.config.num_minibatches
            self.buffer.sampler.begin_epoch(self.config.capacity, iteration=self.policy_version,
                                            epoch=(self.drawn_in_iter - 1) // m)
            self.buffer.sampler.seek((self.drawn_in_iter - 1) % m + 1)
