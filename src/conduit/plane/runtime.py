"""The operator runtime: runs the registered Fig. 8 operators on the units and draws a flow
hands out, and records their timings.

Which thread runs an invocation is the runners' business (:mod:`conduit.plane.runners`); what
an invocation may take is the flow's (:mod:`conduit.plane.flows`); the first operator error
is latched, and the losses kept for ``close()`` are counted, in
:mod:`conduit.plane.operator_errors`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from conduit.errors import BackpressureTimeout, OperatorError
from conduit.plane.flows import DeliveryJob, Flow, Signals, Unit
from conduit.plane.operator_errors import OperatorErrors, raised_to_caller
from conduit.plane.ports import ActorIn, BufferIn, BufferOut, LearnerOut
from conduit.spec import Batch
from conduit.storage import data_path_threads
from conduit.timing import TimingRecord, Timings, record_from

IngestionFn = Callable[[ActorIn, BufferOut], None]
DeliveryFn = Callable[[BufferIn, LearnerOut], None]


def identity_ingestion(actor_in: ActorIn, exp_out: BufferOut) -> None:
    """The default ingestion operator: rollouts are buffer rows as they are."""
    exp_out.write(actor_in.read())


def identity_delivery(exp_in: BufferIn, learn_out: LearnerOut) -> None:
    """The default delivery operator: sampled rows are training batches as they are."""
    learn_out.write(exp_in.read())


def _on_host(rows: Batch) -> bool:
    """Whether every tensor of ``rows`` is in host memory."""
    for v in rows.values():  # noqa: SIM110 - a loop: no generator on an inline pull's path
        if not v.is_cpu:
            return False
    return True


def take_turn(order: threading.RLock, deadline: float | None,
              now: Callable[[], float]) -> bool:
    """Acquire ``order``, the lock inline invocations on different threads take turns under:
    at once or not at all when ``deadline`` is None, else waiting until ``deadline`` (on the
    clock ``now``); whether it was acquired."""
    if deadline is None:
        return order.acquire(blocking=False)
    return order.acquire(timeout=max(0.0, deadline - now()))


def turn_timeout(caller: str) -> BackpressureTimeout:
    """The error of a ``caller`` (``"push"`` or ``"flush"``) whose turn did not come."""
    return BackpressureTimeout(
        f"{caller}: waited its turn past the timeout while another thread's inline ingestion "
        f"ran (inline invocations run one at a time, in push order); pass a longer timeout "
        f"or check the ingestion operator")


class OperatorRuntime:
    """Runs ingestion and delivery invocations for a flow.

    Args:
        flow: What the operators may take and where their output goes.
        signals: The plane's lock and conditions.
        timings: Where invocations are recorded (``"ingestion"``, ``"delivery"``).
        learner_device: Where delivered batches end up; a CUDA device gets its own copy
            stream.

    Attributes:
        errors: The latched operator error and the losses kept for ``close()``; a worker's
            failed invocation is latched there, an inline one's is returned to its caller.
    """

    def __init__(self, *, flow: Flow, signals: Signals, timings: Timings,
                 learner_device: torch.device) -> None:
        self.flow = flow
        self.signals = signals
        self.timings = timings
        self.learner_device = learner_device
        self.stream = (torch.cuda.Stream(learner_device)
                       if learner_device.type == "cuda" else None)
        self.ingest_fn: IngestionFn = identity_ingestion
        self.deliver_fn: DeliveryFn = identity_delivery
        self.errors = OperatorErrors(signals)
        self.paused = 0
        self.ingesting = 0  # ingestion invocations in flight (also counted in busy)
        self.writes_held = 0  # > 0: no ingestion invocation may start
        self.stop = False
        self._inline_order = threading.RLock()  # see drain_inline
        #: ``id``s of the units of pushes whose inline invocation over them runs (not
        #: acknowledged yet: the push reports what becomes of them).
        self.running_own: set[int] = set()
        self._inside = threading.local()  # which operator the thread runs (inside_operator)
        flow.deliver_ready = self.deliver_ready

    @property
    def busy(self) -> int:
        """Operator invocations in flight: ingestion ones and the flow's delivery ones (counted
        by the flow with the draw itself, so an interrupt cannot leave one counted that is not
        in flight)."""
        return self.ingesting + self.flow.delivering

    def inside_operator(self) -> str | None:
        """The operator (``"ingestion"`` or ``"delivery"``) the calling thread is running
        an invocation of, innermost first; None outside every invocation."""
        return getattr(self._inside, "name", None)

    # -- ingestion -----------------------------------------------------------------------------

    def take_ingestion_locked(self, *, force: bool,
                              ignore_holds: bool = False) -> list[Unit] | None:
        """The next ingestion invocation's units (None while paused or not ready).

        Args:
            force: Take fewer than ``g_ing`` units.
            ignore_holds: Take units even while operators are held (``close()``, where only
                the closing thread holds them).
        """
        if (self.paused or self.writes_held) and not ignore_holds:
            return None
        units = self.flow.take_ingestion_locked(force=force)
        if units is not None:
            self.ingesting += 1
        return units

    def inline_ordered(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until no inline ingestion runs on another thread,
        and keep them from starting (True) until :meth:`end_inline_ordered`."""
        return self._inline_order.acquire(timeout=timeout)

    def end_inline_ordered(self) -> None:
        """End :meth:`inline_ordered`'s exclusion."""
        self._inline_order.release()

    def drain_inline(self, *, force: bool, deadline: float | None,
                     current: Unit | None = None) -> bool:
        """Run every ready ingestion invocation on the calling thread; for a push
        (``current``: its unit), until its unit has been taken by an invocation (this
        thread's or, before it, another's).

        A failed invocation's error goes to the call that brought its input: it is raised
        here unless this is a push and the invocation did not hold ``current`` (units other
        pushes queued before it); then the push goes on, its own unit still queued. Whenever
        a push raises with its unit still queued (an interrupt such as ``KeyboardInterrupt``,
        in an invocation over earlier units or while it waits its turn; an operator error a
        worker latched meanwhile; its turn not coming by ``deadline``), the unit is withdrawn
        first: a push that raises stores nothing later, so a retry stores it once.

        Invocations on different callers' threads run one at a time, in the order they took
        their units. A caller waits its turn until ``deadline`` (``time.perf_counter()``);
        without one (a learner's hurry, a push making room) it leaves the queue to the
        thread whose invocation runs.

        Returns:
            False when it did not run: ``deadline`` is None and another thread's inline
            invocation runs.

        Raises:
            OperatorError: An invocation raised here failed (its units are lost; the error is
                not latched, and the units that other threads pushed are kept in
                :attr:`~conduit.plane.operator_errors.OperatorErrors.untold` for ``close()``,
                as are all the units of a failure not raised), or an operator failed earlier
                on a worker (the error stays latched).
            BackpressureTimeout: ``deadline`` passed while another thread's inline
                invocations ran (a push's unit, if still queued, is withdrawn; one taken by
                an earlier drain meanwhile stays with it, and the push returns).
        """
        try:
            return self._drain_inline(force=force, current=current, deadline=deadline)
        except BaseException:
            if current is not None:
                with self.signals.lock:
                    self.flow.withdraw_locked(current)  # (False: taken, and told if it failed)
            raise

    def _drain_inline(self, *, force: bool, current: Unit | None,
                      deadline: float | None) -> bool:
        order = self._inline_order
        while True:
            # Invocations on different callers' threads (a push, a flush or save on another)
            # run one at a time, in the order they took their units: rows land in push order,
            # and no other thread takes a push's unit while that push runs earlier ones.
            if not take_turn(order, deadline, time.perf_counter):
                if deadline is None:
                    return False
                if current is not None:
                    with self.signals.lock:
                        if not self.flow.withdraw_locked(current):
                            return True  # taken by the drain before it meanwhile
                raise turn_timeout("push" if current is not None else "flush")
            units: list[Unit] | None = None
            own = False  # the invocation holds ``current`` (see running_own)
            try:
                with self.signals.lock:
                    if current is not None and all(u is not current for u in self.flow.pending):
                        return True  # taken (ingested, or failed where its caller was running)
                    self.errors.raise_if_failed()
                    units = self.take_ingestion_locked(force=force)
                    own = units is not None and any(u is current for u in units)
                    if own:
                        self.running_own.add(id(current))
                if units is None:
                    return True
                with data_path_threads(1):
                    err = self.run_ingestion(units, latch=False)
                if err is not None:
                    interrupted = not isinstance(err.__cause__, Exception)
                    told = current is None or interrupted or any(u is current for u in units)
                    self.errors.keep_untold(err, units, told=told)
                    if told:  # (an interrupted push withdraws its unit just below)
                        raise raised_to_caller(err)
            except BaseException:
                if current is not None and not own:
                    with self.signals.lock:  # before another drain could take it
                        self.flow.withdraw_locked(current)
                raise
            finally:
                if own:
                    with self.signals.lock:
                        self.running_own.discard(id(current))
                order.release()

    def run_ingestion(self, units: list[Unit], *, latch: bool = True) -> OperatorError | None:
        """One ingestion invocation over ``units`` (taken with :meth:`take_ingestion_locked`).

        Args:
            units: The invocation's rollout units.
            latch: Latch the error (a worker's invocation); False where the calling thread
                reports it itself (inline ingestion, ``close()``'s drain).

        Returns:
            The error if the operator raised (latched only with ``latch``).
        """
        t0 = time.perf_counter()
        written: list[tuple[int, int, int]] = []  # what each write returned (on-policy)
        rows = [0]
        # The identity operator writes the units as admitted: where push checked each against
        # the buffer's spec as it stands (and check_unchanged below finds them as held), they
        # are not checked again.
        spec = self.flow.spec
        checked = self.ingest_fn is identity_ingestion and all(u.spec is spec for u in units)

        def write(batch: Mapping[str, Any]) -> int:
            if checked:
                data, n = dict(batch), next(iter(batch.values())).shape[0]
            else:
                data, n = spec.validate(batch, what="write")
            landed = self.flow.write(data, n)
            rows[0] += n
            if landed is not None:
                written.append(landed)
            return n

        out = BufferOut(write)
        err = None
        raised: BaseException | None = None
        outer = self.inside_operator()
        try:
            for u in units:
                u.check_unchanged()
            try:
                self._inside.name = "ingestion"
                self.ingest_fn(ActorIn([u.data for u in units], [u.version for u in units]),
                               out)
            finally:
                self._inside.name = outer
            self.flow.check_ingested(units, rows[0])
        except BaseException as exc:
            self._inside.name = outer  # (an interrupt may have skipped the line above)
            raised = exc
        finally:
            self.timings.record("ingestion", time.perf_counter() - t0,
                                units=self.flow.ingestion_units(units), start=t0)
            with self.signals.lock:
                kept = self.flow.ingested_locked(units, failed=raised is not None,
                                                 written=written, rows=rows[0])
                if raised is not None:  # with the rows the invocation left
                    err = self.errors.fail("ingestion", raised, units=units,
                                           stored_rows=kept, latch=False)
                    note = self.flow.kept_rows_note(units, kept)
                    if note is not None:
                        err.add_note(note)
                    if latch:
                        self.errors.latch(err, units=units)
                    if latch and self.errors.closing_errors is not None:
                        self.errors.closing_errors.append(err)
                self.ingesting -= 1
                self.signals.wake(callers=True)
        return err

    # -- delivery ------------------------------------------------------------------------------

    def take_delivery_locked(self) -> DeliveryJob | None:
        """The next delivery invocation (None while paused or when no batch can be formed);
        whoever takes it finishes it (:meth:`run_delivery`, or :meth:`abandon_locked`)."""
        if self.paused:
            return None
        return self.flow.take_delivery_locked()

    def abandon_locked(self, job: DeliveryJob | None) -> None:
        """``job`` was taken and an interrupt (``KeyboardInterrupt``) reached the thread
        before its invocation finished: its draw is taken back (nothing, for a job that
        finished, or None)."""
        if job is not None and not job.done:
            self.flow.undo_delivery_locked(job)
            self.signals.wake(callers=True, delivery=True)

    def deliver_ready(self) -> None:
        """Deliver the next batch on the calling (worker) thread, if one can be formed: an
        early-assembled mini-batch is staged by the ingestion worker that completed it, one
        thread hand-off fewer on the way to the learner's first pull."""
        with self.signals.lock:
            job = self.take_delivery_locked()
        if job is not None:
            self.deliver_here(job)

    def deliver_here(self, job: DeliveryJob) -> None:
        """Run a delivery job on a worker thread (on the plane's copy stream, if any)."""
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                self.run_delivery(job)
        else:
            self.run_delivery(job)

    @property
    def samples_are_batches(self) -> bool:
        """Whether the buffer's sample is a batch as the learner takes it, where it is: the
        identity operator, a host learner without a copy stream, and a host column store
        that gathers as it draws."""
        return (self.deliver_fn is identity_delivery
                and self.learner_device.type == "cpu" and self.stream is None
                and getattr(self.flow.buffer.store, "gathers_drawn", False))

    def hands_over_drawn(self, job: DeliveryJob) -> bool:
        """Whether ``job`` (taken by a ``pull``) is a batch the buffer's own sample makes as
        the learner takes it: a job without a draw (:attr:`Flow.draws_as_gathered`) where
        :attr:`samples_are_batches` (:meth:`run_drawn`)."""
        return job.info is None and job.early is None and self.samples_are_batches

    def run_drawn(self, job: DeliveryJob, records: list[TimingRecord]) -> Batch | None:
        """Run a job :meth:`hands_over_drawn` accepts on the pulling thread: the buffer's
        sample is the batch. Its timing record is appended to ``records``. The batch is
        returned as delivered, as :meth:`run_delivery` hands over an inline invocation's
        batch; None where it had to be staged (a batch staged before it) or dropped (an
        error latched meanwhile).

        Raises:
            OperatorError: The sample raised (raised to this caller only, as an inline
                invocation's error; its interrupt instead for a ``KeyboardInterrupt``);
                the job is taken back.
        """
        t0 = time.perf_counter()
        try:
            rows = self.flow.buffer.sample(job.batch_size)
        except BaseException as exc:
            err = self.errors.fail("delivery", exc, latch=False)
        else:
            seconds = time.perf_counter() - t0
            flow = self.flow
            with self.signals.lock:  # the usual outcome, in one short section
                handed = self.errors.error is None and flow.hand_over_drawn_locked(job)
                if handed:
                    flow.counters["invocations_del"] += 1
                    if self.signals.callers.waiting:  # (Signals.wake(callers=True), inline)
                        self.signals.callers.notify_all()
            if handed:
                records.append(record_from(("delivery", seconds, 1.0, t0)))
                return rows
            return self._finish(job, t0, records, None, [], rows, None)  # staged or dropped
        self._finish(job, t0, records, err, [], None, None)
        self.errors.raise_own(err)
        return None

    def run_delivery(self, job: DeliveryJob, *,
                     caller_records: list[TimingRecord] | None = None
                     ) -> tuple[OperatorError | None, Batch | None]:
        """One delivery invocation: gather (or take the early-assembled rows), run the
        operator, and stage its training batches.

        Args:
            job: The invocation.
            caller_records: Given when the thread that takes the next batch runs the
                invocation (an inline ``pull``): the invocation's timing record is appended
                here, for the caller to add with its own (added at once if the operator
                raised), and rows that are a batch as they are (the identity operator, one
                batch, host rows for a host learner) go straight back to the caller, counted
                as delivered, unless a batch is staged before them or a priority update made
                them stale (:meth:`Flow.hand_over_locked`).

        Returns:
            ``(error, batch)``: the error if the operator raised (latched only without
            ``caller_records``: an inline invocation's error goes to its caller alone), and
            the batch handed back to the caller (None: whatever the invocation made is
            staged).
        """
        t0 = time.perf_counter()
        staged: list[Batch] = []
        direct: Batch | None = None
        err = None
        outer = self.inside_operator()
        try:
            early = job.early
            if early is not None and early.out is not None:
                rows = dict(early.out)
            elif job.info is None:  # one batch, drawn as it is gathered
                rows = self.flow.buffer.sample(job.batch_size)
            else:
                rows = self.flow.buffer.gather(job.info)
            if (self.deliver_fn is identity_delivery and job.batches == 1
                    and self.learner_device.type == "cpu"
                    and _on_host(rows)):  # (no device objects made)
                direct = rows  # the gathered rows are the batch, where they are
            else:
                out = LearnerOut(batches=job.batches, device=self.learner_device)
                try:
                    self._inside.name = "delivery"
                    self.deliver_fn(BufferIn(rows, batches=job.batches,
                                             batch_size=job.batch_size), out)
                finally:
                    self._inside.name = outer
                staged = out.staged
                if len(staged) != job.batches:
                    raise RuntimeError("the delivery operator did not call learn_out.write()")
        except BaseException as exc:
            self._inside.name = outer  # (an interrupt may have skipped the line above)
            err = self.errors.fail("delivery", exc, latch=caller_records is None)
            staged, direct = [], None
        finally:
            event = None
            if self.stream is not None and staged:
                event = torch.cuda.Event()
                event.record(self.stream)
            direct = self._finish(job, t0, caller_records, err, staged, direct, event)
        return err, direct

    def _finish(self, job: DeliveryJob, t0: float, caller_records: list[TimingRecord] | None,
                err: OperatorError | None, staged: list[Batch], direct: Batch | None,
                event: Any) -> Batch | None:
        """Record a delivery invocation that began at ``t0`` and settle what it made: the
        batch ``direct`` handed to the caller (returned), or ``staged`` (with ``direct``,
        where it cannot be handed over), or nothing, with the job taken back, after an error
        (``err``, or one latched meanwhile). The record goes to ``caller_records``, or to
        the timings at once (a worker's invocation, or a failed one)."""
        rec = TimingRecord("delivery", time.perf_counter() - t0,
                           self.flow.delivery_units(job), t0)
        if caller_records is None or err is not None:
            self.timings.add((rec,))
        else:
            caller_records.append(rec)
        with self.signals.lock:
            self.flow.counters["invocations_del"] += 1
            if err is not None or self.errors.error is not None:
                direct = None  # a failure, or a latched error, drops what it made
                self.flow.undo_delivery_locked(job)
            else:
                if direct is not None and not (
                        caller_records is not None
                        and self.flow.hand_over_locked(job.generation, job)):
                    staged, direct = [direct], None
                if staged:
                    self.flow.stage_locked(staged, job.generation, event, job)
            self.signals.wake(callers=True)
        return direct
