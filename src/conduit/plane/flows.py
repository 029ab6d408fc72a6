"""Flows: what off-policy and on-policy training allow through the plane.

A flow owns the queue of pushed rollout units, the stage of delivered batches, and the rules
between them: how many units may wait (backpressure), how many an ingestion invocation takes,
when a batch may be drawn, which staged batches are still valid, and, on-policy, the
iteration: exactly-once delivery of each iteration's rows per epoch, gated on the policy
version (docs/design.md §2, §3). Flows decide; they never start threads or run operators.

This module holds what both flows share (:class:`Flow`, the units, jobs and staged batches
they pass around, the plane's lock and conditions) and :class:`OffPolicyFlow`; the on-policy
flow is :class:`~conduit.plane.onpolicy.OnPolicyFlow`.

Methods whose name ends in ``_locked`` are called with the plane's lock
(:attr:`Signals.lock`) held.
"""

from __future__ import annotations

import abc
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from conduit.errors import SpecError
from conduit.plane.config import PlaneConfig
from conduit.plane.early import EarlyBatch
from conduit.scheduling.space import Schedule
from conduit.spec import Batch, ExperienceSpec
from conduit.storage import ExperienceBuffer, SampleInfo


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
            reports it (:attr:`~conduit.plane.operator_errors.OperatorErrors.untold`).
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
        info: The draw, or None for one batch drawn as it is gathered
            (:meth:`~conduit.storage.ExperienceBuffer.sample`: the same slots as a draw then
            a gather, without building the draw; only for a sampler that
            :attr:`~conduit.storage.samplers.Sampler.draws_into` and whose draws no priority
            update makes stale).
        done: The invocation is finished: what it made is staged or handed over, or its draw
            was taken back (:meth:`Flow.undo_delivery_locked`); set once, with the flow's
            count of invocations in flight.
    """

    info: SampleInfo | None
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
    def draws_as_gathered(self) -> bool:
        """Whether a delivery invocation draws its rows as it gathers them (see
        :class:`OffPolicyFlow`); False: each draw comes first."""
        return False

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

    def hand_over_drawn_locked(self, job: DeliveryJob) -> bool:
        """:meth:`hand_over_locked` for ``job``, whose batch the pull that took it sampled
        itself (:attr:`DeliveryJob.info` None)."""
        return self.hand_over_locked(job.generation, job)

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

    def __post_init__(self) -> None:
        #: ``config.first_batch_rows`` (the config is frozen), read by every pull.
        self.first_rows = self.config.first_batch_rows

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
        if len(self.staged) >= self.stage_room or len(self.buffer) < self.first_rows:
            return None
        delivering = self.delivering
        try:
            return self._draw_locked()
        except BaseException:  # an interrupt (KeyboardInterrupt): nothing is in flight
            self.delivering = delivering
            raise

    @property
    def draws_as_gathered(self) -> bool:
        """Whether a delivery invocation draws its rows as it gathers them (a job without a
        draw, :attr:`DeliveryJob.info` None): one batch (``g_del = 1``) from a sampler that
        draws into a tensor and whose draws no priority update makes stale. The slots are
        those a draw then a gather would take, from the same generator state, drawn into the
        batch's own ``_index``."""
        sampler = self.buffer.sampler
        return (self.schedule.g_del == 1 and sampler.draws_into
                and not sampler.invalidates_prefetch)

    def take_drawn_locked(self) -> DeliveryJob | None:
        """The job of a ``pull`` that samples its one batch itself (where
        :attr:`draws_as_gathered`, as the caller knows), or None where it cannot now: a batch
        is staged before it, or the buffer holds too few rows. The job is counted in flight
        as the method returns it."""
        if self.staged or self.buffer.writer.size < self.first_rows:  # (len(buffer), inline)
            return None
        job = DeliveryJob(None, 1, self.config.batch_size, self.priority_generation)
        self.delivering += 1
        return job

    def hand_over_drawn_locked(self, job: DeliveryJob) -> bool:
        """Count the batch of a job :meth:`take_drawn_locked` gave as delivered to the pull
        that sampled it, and finish the job, in one statement (an interrupt lands before
        both or after both). False, with nothing changed, where a batch was staged before
        it meanwhile: it must be staged after that one. Its draws are never stale (see
        :attr:`draws_as_gathered`) and an off-policy delivery ends nothing, so this is
        :meth:`hand_over_locked` for such a job, and there is no worker to wake."""
        if self.staged:
            return False
        counters = self.counters
        counters["delivered_batches"], job.done, self.delivering = (
            counters["delivered_batches"] + 1, True, self.delivering - 1)
        return True

    def _draw_locked(self) -> DeliveryJob:
        n = int(self.schedule.g_del)
        info = None if self.draws_as_gathered else self.buffer.draw(n * self.config.batch_size)
        self.delivering += 1
        return DeliveryJob(info, n, self.config.batch_size, self.priority_generation)

    def starved_locked(self) -> bool:
        return len(self.buffer) < self.first_rows

    def delivery_units(self, job: DeliveryJob) -> float:
        return float(job.batches)

    def empty_message(self, waited: float) -> str:
        return (f"no batch within {waited:.1f}s: the buffer holds {len(self.buffer)} rows, "
                f"min_size is {self.config.first_batch_rows} ({len(self.pending)} rollout "
                f"units pending)")
