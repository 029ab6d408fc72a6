"""The operator runtime: runs the registered Fig. 8 operators on the units and draws a flow
hands out, records their timings, and latches the first operator error.

Which thread runs an invocation is the runners' business (:mod:`conduit.plane.runners`); what
an invocation may take is the flow's (:mod:`conduit.plane.flows`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from conduit.errors import BackpressureTimeout, OperatorError, raised_again
from conduit.plane.flows import DeliveryJob, Flow, Signals, Unit
from conduit.plane.ports import ActorIn, BufferIn, BufferOut, LearnerOut
from conduit.spec import Batch
from conduit.storage import data_path_threads
from conduit.timing import TimingRecord, Timings

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


class _Pushed(Protocol):
    """A queued unit, as :func:`untold_share` reads it (a local or a sharded plane's)."""

    rows: int
    pusher: threading.Thread | None


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


def untold_share(err: OperatorError, units: Sequence[_Pushed], *,
                 told: bool) -> OperatorError | None:
    """The share of ``err`` (an inline ingestion invocation over ``units`` that failed on the
    calling thread) that no caller answers for, or None: the units other threads pushed
    (their pushes returned) when ``err`` is raised to the calling thread (``told``), else
    every unit."""
    me = threading.current_thread()
    others = [u for u in units if not told or (u.pusher is not None and u.pusher is not me)]
    if not others:
        return None
    return _part_of(err, others)


def untold_part(err: OperatorError | None, units: Sequence[Any] | None,
                told: set[int]) -> OperatorError | None:
    """What of the latched ``err`` a ``close()`` reports: the lost ``units`` (each with its
    ``pusher`` thread) whose pushing thread is not among the ``told`` thread idents, as an
    error of their own; ``err`` itself when none was told or its units are not known, None
    when all were told."""
    if err is None or not units:
        return err
    untold = [u for u in units if u.pusher is None or u.pusher.ident not in told]
    if len(untold) == len(units):
        return err
    if not untold:
        return None
    return _part_of(err, untold)


def _part_of(err: OperatorError, units: Sequence[Any]) -> OperatorError:
    """``err`` for only ``units`` of the units it lost: same operator and cause."""
    part = OperatorError(err.operator, err.__cause__ or err, lost_units=len(units),
                         lost_rows=sum(u.rows for u in units))
    part.__cause__ = err.__cause__
    return part


def raised_to_caller(err: OperatorError) -> BaseException:
    """What the failure ``err`` of an invocation the calling thread ran raises there: ``err``
    itself, or, when the operator was interrupted (it raised ``KeyboardInterrupt``,
    ``SystemExit`` or another exception that is not an ``Exception``), that interrupt, with
    ``err``'s message (what was lost, what stays stored) added as a note, so an
    ``except Exception`` around the call does not swallow a Ctrl-C."""
    cause = err.__cause__
    if cause is None or isinstance(cause, Exception):
        return err
    cause.add_note(f"conduit: the {err}")
    return cause


class OperatorRuntime:
    """Runs ingestion and delivery invocations for a flow.

    Args:
        flow: What the operators may take and where their output goes.
        signals: The plane's lock and conditions.
        timings: Where invocations are recorded (``"ingestion"``, ``"delivery"``).
        learner_device: Where delivered batches end up; a CUDA device gets its own copy
            stream.
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
        self.error: OperatorError | None = None
        #: Whether the latched error only stands in for a stuck invocation's outcome (a
        #: worker that did not stop): that invocation's own error replaces it.
        self.error_provisional = False
        #: The latched error's lost units (None: not known, all are counted) and the threads
        #: a dependent call told of it: ``close()`` reports the units whose pushing thread
        #: was never told.
        self.error_units: tuple[Unit, ...] | None = None
        self.error_told: set[int] = set()
        self.paused = 0
        self.ingesting = 0  # ingestion invocations in flight (also counted in busy)
        self.writes_held = 0  # > 0: no ingestion invocation may start
        self.stop = False
        #: While ``close()`` runs: every failed worker ingestion invocation (its units were
        #: acknowledged by their pushes), so that close counts each loss once (None: not
        #: recording). An inline invocation's error is raised to the caller that ran it,
        #: which is told of the loss, and is not recorded here.
        self.closing_errors: list[OperatorError] | None = None
        #: The shares of failed inline invocations that no caller was told of: units pushed
        #: (and acknowledged) on other threads than the one that ran the invocation and got
        #: its error, and every unit of a failure raised to no caller (a push's invocation
        #: over units queued before its own); ``close()`` counts them (None once it has).
        self.untold: list[OperatorError] | None = []
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

    def take_unreported_locked(self) -> list[OperatorError]:
        """The losses kept for ``close()`` (:attr:`closing_errors`, :attr:`untold`); both stop
        recording (None) from here on."""
        kept = [*(self.closing_errors or ()), *(self.untold or ())]
        self.closing_errors = self.untold = None
        return kept

    def inside_operator(self) -> str | None:
        """The operator (``"ingestion"`` or ``"delivery"``) the calling thread is running
        an invocation of, innermost first; None outside every invocation."""
        return getattr(self._inside, "name", None)

    # -- errors ------------------------------------------------------------------------------

    def fail(self, operator: str, exc: BaseException, *, units: Sequence[Unit] = (),
             stored_rows: int = 0, latch: bool = True) -> OperatorError:
        """The plane's operator error for ``exc``; latched (see :meth:`latch`) unless
        ``latch`` is False.

        Args:
            operator: Which operator raised.
            exc: What it raised.
            units: The rollout units whose ingestion failed (their rows are lost).
            stored_rows: Rows the failed invocation wrote that stay in the buffer.
            latch: False for an invocation the caller's own thread ran (inline): its error
                goes to that call only, and neither workers nor other callers see it.

        Returns:
            The error made for ``exc``.
        """
        err = OperatorError(operator, exc, lost_units=len(units),
                            lost_rows=sum(u.rows for u in units), stored_rows=stored_rows)
        err.__cause__ = exc
        if latch:
            self.latch(err, units=units)
        return err

    def latch(self, err: OperatorError, *, provisional: bool = False,
              units: Sequence[Unit] | None = None) -> None:
        """Latch ``err`` as the plane's operator error and wake all: workers stop, and
        dependent calls raise it until :meth:`recover`.

        The first error wins, except over a provisional one: an invocation's own error
        replaces it, so the units that invocation lost are reported (by dependent calls,
        :meth:`recover` and ``close()``).

        Args:
            err: The error.
            provisional: ``err`` says only that a worker is stuck in an invocation (it
                reports no loss); the invocation's own error, if it raises, replaces it.
            units: The units ``err`` lost, when known (their pushing threads decide what
                ``close()`` reports, see :meth:`untold_loss`).
        """
        with self.signals.lock:
            if self.error is None or (self.error_provisional and not provisional):
                self.error, self.error_provisional = err, provisional
                self.error_units = None if units is None else tuple(units)
                self.error_told = set()
            self.signals.wake(callers=True, ingestion=True, delivery=True)

    def raise_if_failed(self) -> None:
        """Raise the latched operator error, if any."""
        if self.error is not None:
            self.error_told.add(threading.get_ident())
            raise raised_again(self.error)

    def untold_loss(self) -> OperatorError | None:
        """The latched error as ``close()`` reports it (call with the lock held): only the
        lost units whose pushing thread no call told of it (a thread told knows its pushes
        may be lost; an actor thread whose units a learner's call was told of does not).
        None when every one was told."""
        return untold_part(self.error, self.error_units, self.error_told)

    def raise_own(self, err: OperatorError | None) -> None:
        """Raise ``err``, the (unlatched) error of an invocation the calling thread ran (as
        :func:`raised_to_caller` makes it): the caller that brought the input is told, and
        the plane stays usable."""
        if err is not None:
            raise raised_to_caller(err)

    def recover(self) -> OperatorError | None:
        """Unlatch the operator error (the caller handled it), and forget the :attr:`untold`
        inline losses (handled as well); returns the latched error."""
        with self.signals.lock:
            err, self.error = self.error, None
            self.error_provisional = False
            if self.untold is not None:
                self.untold = []
            self.signals.wake(callers=True, ingestion=True, delivery=True)
        return err

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
                :attr:`untold` for ``close()``, as are all the units of a failure not raised),
                or an operator failed earlier on a worker (the error stays latched).
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
                    self.raise_if_failed()
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
                    self._keep_untold(err, units, told=told)
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

    def _keep_untold(self, err: OperatorError, units: Sequence[Unit], *, told: bool) -> None:
        """Keep :func:`untold_share` of ``err`` for ``close()``."""
        share = untold_share(err, units, told=told)
        if share is None:
            return
        with self.signals.lock:
            if self.untold is not None:
                self.untold.append(share)

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

        def write(batch: Mapping[str, Any]) -> int:
            data, n = self.flow.spec.validate(batch, what="write")
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
                    err = self.fail("ingestion", raised, units=units, stored_rows=kept,
                                    latch=False)
                    note = self.flow.kept_rows_note(units, kept)
                    if note is not None:
                        err.add_note(note)
                    if latch:
                        self.latch(err, units=units)
                    if latch and self.closing_errors is not None:
                        self.closing_errors.append(err)
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
            rows = (dict(early.out) if early is not None and early.out is not None
                    else self.flow.buffer.gather(job.info))
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
            err = self.fail("delivery", exc, latch=caller_records is None)
            staged, direct = [], None
        finally:
            event = None
            if self.stream is not None and staged:
                event = torch.cuda.Event()
                event.record(self.stream)
            rec = TimingRecord("delivery", time.perf_counter() - t0,
                               self.flow.delivery_units(job), t0)
            if caller_records is None or err is not None:
                self.timings.add((rec,))
            else:
                caller_records.append(rec)
            with self.signals.lock:
                self.flow.counters["invocations_del"] += 1
                if err is not None or self.error is not None:
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
        return err, direct
