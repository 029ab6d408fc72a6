"""The parts of the sharded front's ingestion
(:class:`~conduit.distributed.operators.FrontIngestion`): the queue of pushed units, the error
latch with the losses ``close()`` reports, the inline drains that run invocations on the
callers' threads, and the ``conduit-ingestion`` thread.

Every part takes the front's one condition (over a re-entrant lock): they change the same
state's parts under the same lock, and a part's ``*_locked`` method is called with it held.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from conduit.errors import (
    BackpressureTimeout,
    DataLossError,
    OperatorError,
    PlaneClosedError,
    raised_again,
)
from conduit.plane.operator_errors import untold_part, untold_share
from conduit.plane.runtime import take_turn, turn_timeout

if TYPE_CHECKING:
    from conduit.distributed.operators import QueuedUnit

RunFn = Callable[..., "OperatorError | None"]
"""Runs one invocation: ``run(units, current=None, floor=None)``; returns its error (not yet
latched), or re-raises an interrupt."""


class IngestionQueue:
    """The units pushed and not yet ingested: room for pushes (backpressure), the units one
    invocation takes, and the units the running invocations hold.

    Args:
        cond: The front's condition.
        g_ing: The schedule's ``g_ing`` in force.
    """

    def __init__(self, cond: threading.Condition, g_ing: Callable[[], float]) -> None:
        self._cond, self._g_ing = cond, g_ing
        self.pending: deque[QueuedUnit] = deque()
        self.inflight = 0  # units taken by a running invocation
        #: The running invocations' units, each with the unit of the push running it inline.
        self._running: dict[int, tuple[list[QueuedUnit], QueuedUnit | None]] = {}
        self._flushes = 0  # flushes waiting: ingest fewer than g_ing units
        self._hurried = False  # a learner waits for rows: ingest what is queued
        self.closed = False  # no unit is queued after close() began draining
        #: On-policy: the iteration's rows and whether all of them were pushed. ``g_ing`` is
        #: then a share of the iteration's rows per invocation, as on a local plane.
        self.iteration: tuple[int, Callable[[], bool]] | None = None
        #: Off-policy: most rows one invocation's units may hold (a shard's ring), since the
        #: operator may write them joined; None: no bound.
        self.row_limit: int | None = None

    @property
    def _g(self) -> int:
        return int(self._g_ing())

    def put_locked(self, unit: QueuedUnit, deadline: float, check: Callable[[], None]) -> None:
        """Queue ``unit`` once there is room (on-policy the iteration gate bounds what is
        queued); ``check`` raises what the push must raise instead (a latched error).

        Raises:
            PlaneClosedError: :meth:`close` began.
            BackpressureTimeout: No room by ``deadline``.
        """
        while True:
            if self.closed:
                raise PlaneClosedError("the sharded plane is closed")
            check()
            if self.iteration is not None or len(self.pending) < 2 * self._g:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise BackpressureTimeout(
                    f"push waited for room: {len(self.pending)} units queued and "
                    f"{self.inflight} being ingested (at most 2·g_ing = {2 * self._g} "
                    f"wait); the ingestion operator is slower than the actors")
            self._cond.wait(left)
        self.pending.append(unit)

    def take_locked(self, *, force: bool) -> list[QueuedUnit] | None:
        """Up to ``g_ing`` queued units of one node, no more than :attr:`row_limit` rows
        together; on-policy, up to ``g_ing`` of the iteration's rows, or everything once the
        iteration is pushed; with ``force``, however few are queued. None: none is due."""
        if not self.pending:
            return None
        if self.iteration is None:
            units_cap, rows_cap = self._g, None
            if len(self.pending) < self._g and not force:
                return None
        else:
            capacity, complete = self.iteration
            want = max(1, int(self._g_ing() * capacity))
            if force or complete():
                units_cap, rows_cap = len(self.pending), None
            elif sum(u.rows for u in self.pending) < want:
                return None
            else:
                units_cap, rows_cap = len(self.pending), want
        node = self.pending[0].node
        units: list[QueuedUnit] = []
        got = 0
        limit = self.row_limit if self.iteration is None else None
        while (self.pending and len(units) < units_cap and self.pending[0].node == node
               and (rows_cap is None or got < rows_cap)):
            if units and limit is not None and got + self.pending[0].rows > limit:
                break  # joined, they would not fit the shard: the rest go next
            units.append(self.pending.popleft())
            got += units[-1].rows
        self.inflight += len(units)
        self._cond.notify_all()  # room in the queue for a waiting push
        return units

    def take_due_locked(self) -> list[QueuedUnit] | None:
        """The units the ingestion thread takes now: ``g_ing`` of them, or what is queued
        while a flush or a learner waits."""
        units = self.take_locked(force=self._flushes > 0 or self._hurried)
        if units is not None:
            self._hurried = self._hurried and bool(self.pending)
        return units

    def running(self, units: list[QueuedUnit], current: QueuedUnit | None) -> None:
        """An invocation over ``units`` (taken) begins; ``current`` is the unit of the push
        running it inline, if any."""
        with self._cond:
            self._running[id(units)] = (units, current)

    def ran(self, units: list[QueuedUnit]) -> None:
        """The invocation over ``units`` left the operator and its writes."""
        with self._cond:
            del self._running[id(units)]

    def acknowledged_locked(self) -> list[QueuedUnit]:
        """The acknowledged units still queued or held by a running invocation (a push's own
        unit is not acknowledged: the push reports it)."""
        return [u for units, current in self._running.values() for u in units
                if u is not current] + list(self.pending)

    def holds(self, unit: QueuedUnit) -> bool:
        """Whether ``unit`` is still queued (no invocation took it)."""
        with self._cond:
            return any(u is unit for u in self.pending)

    def remove(self, unit: QueuedUnit) -> bool:
        """Take ``unit`` out of the queue; False if it was not queued any more."""
        with self._cond:
            at = next((k for k, u in enumerate(self.pending) if u is unit), None)
            if at is None:
                return False
            del self.pending[at]
            self._cond.notify_all()
        return True

    def idle(self) -> bool:
        """Whether no unit waits or is being ingested."""
        with self._cond:
            return not self.pending and not self.inflight

    def hurry(self) -> None:
        """A learner waits for rows: the thread ingests what is queued, however few units."""
        with self._cond:
            if self.pending and not self._hurried:
                self._hurried = True
                self._cond.notify_all()

    def wait_ingested(self, deadline: float, check: Callable[[], None]) -> None:
        """Have the thread ingest every queued unit and wait until it did; ``check`` raises a
        failure of its invocations.

        Raises:
            BackpressureTimeout: Not done by ``deadline``.
        """
        with self._cond:
            self._flushes += 1
            self._cond.notify_all()
            try:
                while self.pending or self.inflight:
                    check()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise BackpressureTimeout(
                            f"flush: {len(self.pending)} rollout units still queued and "
                            f"{self.inflight} being ingested when the timeout ran out; pass a "
                            f"longer timeout or check the ingestion operator")
                    self._cond.wait(left)
                check()
            finally:
                self._flushes = max(0, self._flushes - 1)


class IngestionLatch:
    """The failures of the front's ingestion, as a local plane's
    :class:`~conduit.plane.operator_errors.OperatorErrors` latches them: the latched error of
    the ingestion thread (raised by every call until :meth:`recover`), the invocations'
    counters, and the losses kept for ``close()`` (of interrupted invocations, and of failed
    inline invocations no caller was told of).

    Args:
        cond: The front's condition.
    """

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self.error: OperatorError | None = None
        #: The latched error's lost units, and the threads a call told of it: ``close()``
        #: reports the units whose pushing thread was never told.
        self._units: list[QueuedUnit] = []
        self._told: set[int] = set()
        self.counters = {"invocations": 0, "lost_units": 0, "lost_rows": 0}
        self._interrupted: list[OperatorError] = []  # losses of interrupted invocations
        #: Shares of failed inline invocations no caller was told of.
        self._untold: list[OperatorError] = []

    def raise_if_failed(self) -> None:
        """Raise the latched operator error, if any."""
        with self._cond:
            if self.error is not None:
                self._told.add(threading.get_ident())
                raise raised_again(self.error)

    def latch(self, err: OperatorError, units: list[QueuedUnit]) -> None:
        """Latch ``err``, the failure of the thread's invocation over ``units``, unless an
        error is latched already."""
        with self._cond:
            if self.error is None:
                self.error, self._units, self._told = err, units, set()
            self._cond.notify_all()

    def count_locked(self, err: OperatorError | None, *, interrupted: bool) -> None:
        """Count an invocation that ended, failed with ``err`` if not None (kept for
        ``close()`` when an interrupt ended it)."""
        self.counters["invocations"] += 1
        if err is not None:
            self.counters["lost_units"] += err.lost_units
            self.counters["lost_rows"] += err.lost_rows
        if interrupted and err is not None and err.lost_units:
            self._interrupted.append(err)

    def keep_untold(self, share: OperatorError) -> None:
        """Keep ``share``, a failed inline invocation's loss no caller was told of."""
        with self._cond:
            self._untold.append(share)

    def recover(self) -> OperatorError | None:
        """Unlatch the operator error (the caller handled it), and forget the failed inline
        invocations no caller was told of (handled as well); returns the latched error."""
        with self._cond:
            err, self.error = self.error, None
            self._untold.clear()
            self._cond.notify_all()
        return err

    def reports_locked(self) -> list[OperatorError]:
        """The failures ``close()`` reports so far: the latched error, with only its lost
        units whose pushing thread no call told of it, then the kept losses (see
        :meth:`kept_locked`); the error is unlatched."""
        latched = untold_part(self.error, self._units, self._told)
        kept = self.kept_locked()
        self.error = None
        return [latched, *kept] if latched else kept

    def kept_locked(self) -> list[OperatorError]:
        """The losses kept for ``close()`` (interrupted invocations, failures no caller was
        told of), forgotten here."""
        kept = [*self._interrupted, *self._untold]
        self._interrupted.clear()
        self._untold.clear()
        return kept


def raise_lost(errors: list[OperatorError]) -> None:
    """Raise what ``close()`` reports of ``errors``, if they lost any unit.

    Raises:
        DataLossError: Their lost units and rows, the first error attached as the cause.
    """
    lost_units = sum(e.lost_units for e in errors)
    lost_rows = sum(e.lost_rows for e in errors)
    if lost_units:
        cause = errors[0]
        raise DataLossError(
            f"close(): {lost_units} rollout units ({lost_rows} rows) acknowledged by push "
            f"were not stored: {cause}", lost_units=lost_units,
            lost_rows=lost_rows) from cause


class InlineDrains:
    """Inline ingestion (``overlap_ing = 0``): the callers' threads run the invocations that
    are due, one thread at a time in the order they took their units, and each failure goes
    to the call that brought its input.

    Args:
        cond: The front's condition.
        queue: The queued units.
        latch: The failures.
        run: Runs one invocation (``run(units, current, deadline)``).
        on_lost: Called with a unit withdrawn from the queue (and 0 stored rows).
    """

    def __init__(self, *, cond: threading.Condition, queue: IngestionQueue,
                 latch: IngestionLatch, run: RunFn,
                 on_lost: Callable[[list[QueuedUnit], int], None]) -> None:
        self._cond, self._queue, self._latch = cond, queue, latch
        self._run, self._on_lost = run, on_lost
        self.count = 0  # threads in drain() (close() waits for them)
        self._order = threading.RLock()  # see _drain

    def drain(self, *, force: bool, deadline: float | None,
              current: QueuedUnit | None = None, counted: bool = False) -> None:
        """Run the due invocations on this thread: every one (a flush), or, for a push
        (``current``: its unit), those until its unit is taken, by this thread or another.

        A failed invocation's error goes to the call that brought its input: it is raised
        here unless this is a push and the invocation did not hold ``current`` (units of
        other pushes queued before it); the push then goes on, its unit still queued. The
        units of a failure that other threads pushed, or of one not raised, are kept for
        ``close()`` (their pushes returned). An interrupt (such as ``KeyboardInterrupt``)
        of an invocation without ``current`` takes ``current`` out of the queue and hands it
        to ``on_lost`` (the push raises, so it stores nothing; had it stayed queued, a retry
        of the push would store its rows twice).

        Drains on different threads run their invocations one at a time, in the order they
        took their units (rows land in push order; no other thread takes a push's unit while
        that push runs earlier ones). A drain waits its turn until ``deadline``
        (``time.monotonic()``); without one (a learner's hurry) it leaves the queue to the
        drain that runs. A push that raises while it waits its turn (its deadline passed, an
        interrupt) withdraws its unit if it is still queued; one that a drain before it has
        taken meanwhile stays with that drain (after an interrupt, its rows may then be stored
        although the push raised). ``close()`` waits for the drains on other threads
        (:meth:`wait_locked`), so what they keep is counted; one that would begin after it (a
        flush or a learner's hurry, ``counted`` False) leaves the queue to it. ``counted``:
        the push's drain was counted in :attr:`count` when its unit was queued.

        Raises:
            BackpressureTimeout: ``deadline`` passed while another thread's inline
                invocations ran (a push's unit is then withdrawn).
        """
        with self._cond:
            if not counted:
                if self._queue.closed:
                    return
                self.count += 1
        try:
            self._drain(force=force, current=current, deadline=deadline)
        except BaseException:
            if current is not None:  # e.g. interrupted while waiting its turn
                self.withdraw(current)
            raise
        finally:
            with self._cond:
                self.count -= 1
                self._cond.notify_all()

    def _drain(self, *, force: bool, current: QueuedUnit | None,
               deadline: float | None) -> None:
        order = self._order
        while True:
            units: list[QueuedUnit] = []
            # Invocations on different callers' threads run one at a time, in the order they
            # took their units: rows land in push order, and while a push's invocation over
            # earlier units runs, no other thread takes its unit, so a push that raises
            # withdraws it (under the same lock) before anyone could store it.
            if not take_turn(order, deadline, time.monotonic):
                if deadline is None or (current is not None and not self.withdraw(current)):
                    return  # the running drain ingests; or this push's unit was taken
                raise turn_timeout("push" if current is not None else "flush")
            try:
                with self._cond:
                    if current is not None and not self._queue.holds(current):
                        return  # taken: stored, or failed where its push was told
                    self._latch.raise_if_failed()
                    units = self._queue.take_locked(force=force) or []
                if not units:
                    return
                err = self._run(units, current, deadline)
            except BaseException:
                if current is not None and all(u is not current for u in units):
                    self.withdraw(current)
                raise
            finally:
                order.release()
            if err is None:
                continue
            told = current is None or any(u is current for u in units)
            share = untold_share(err, units, told=told)
            if share is not None:
                self._latch.keep_untold(share)
            if told:
                raise err

    def withdraw(self, unit: QueuedUnit) -> bool:
        """Take ``unit`` out of the queue, if it is still there, and hand it to ``on_lost``;
        False if it was not queued any more (taken by an invocation)."""
        if not self._queue.remove(unit):
            return False
        self._on_lost([unit], 0)
        return True

    def wait_locked(self, timeout: float) -> bool:
        """Wait for the drains on other threads; whether none is left. They run one at a
        time, so the wait lasts while they make progress: it ends when ``timeout`` passes
        without an invocation finishing."""
        counters = self._latch.counters
        deadline, done = time.monotonic() + timeout, counters["invocations"]
        while self.count and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(left)
            if counters["invocations"] != done:
                deadline, done = time.monotonic() + timeout, counters["invocations"]
        return not self.count


class IngestionWorker:
    """The front's ingestion thread (``overlap_ing = 1``): it takes the due units and runs
    one invocation at a time, latching a failure (and taking no units while one is latched).

    Args:
        cond: The front's condition.
        queue: The queued units.
        latch: The failures.
        run: Runs one invocation (``run(units)``).
        name: The thread's name.
    """

    def __init__(self, *, cond: threading.Condition, queue: IngestionQueue,
                 latch: IngestionLatch, run: RunFn, name: str) -> None:
        self._cond, self._queue, self._latch, self._run = cond, queue, latch, run
        self._name = name
        self.thread: threading.Thread | None = None
        self._stop = False

    def start(self) -> None:
        """Start the thread (none runs: :meth:`join` stopped it)."""
        with self._cond:
            self._stop = False
        self.thread = threading.Thread(target=self._work, name=self._name, daemon=True)
        self.thread.start()

    def join(self, timeout: float) -> bool:
        """Stop the thread after its running invocation; False if it did not stop within
        ``timeout`` seconds."""
        thread, self.thread = self.thread, None
        if thread is None:
            return True
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        thread.join(timeout)
        return not thread.is_alive()

    def _work(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stop:  # close() drains the queue itself, counting failures
                        return
                    if self._latch.error is None:
                        units = self._queue.take_due_locked()
                        if units is not None:
                            break
                    self._cond.wait()
            err = self._run(units)
            if err is not None:
                self._latch.latch(err, units)
