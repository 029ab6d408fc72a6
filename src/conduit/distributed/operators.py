"""The Fig. 8 operators of the sharded plane and the schedule that runs them.

Ingestion runs in the front, before a unit's rows are routed and replicated: the operator's
output is what goes into Ray's object store once and is written to the owner and every replica
in one order, so the copies stay the same ring slot for slot and an operator never runs twice
for one unit (running it on each shard would run it ``replication`` times, and a
non-deterministic operator would make the replicas differ). With ``overlap_ing = 1`` it runs on
the front's ``conduit-ingestion`` thread: ``push`` returns once the unit is queued (at most
``2·g_ing`` units wait; a full queue makes ``push`` wait, then raise
:class:`~conduit.errors.BackpressureTimeout`, as on a local plane). One invocation takes up to
``g_ing`` queued units pushed on the same node, so its rows still go to that node's shard.

Delivery runs on the learner rank's thread over the rows one draw fetched from the shards
(``g_del`` training batches per invocation, with ``_index`` and ``_weight``); with
``overlap_del = 1`` the next invocation's remote fetch is in flight while the learner updates
(:mod:`conduit.distributed.delivery`).

A failure of an operator on the ingestion thread is latched as on a local plane
(:mod:`conduit.plane.runtime`): ``push``, ``flush`` and ``pull`` raise its
:class:`~conduit.errors.OperatorError` until ``recover()``; ``close()`` reports every
acknowledged unit that was not stored with :class:`~conduit.errors.DataLossError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from conduit.distributed.errors import ShardUnavailableError
from conduit.errors import (
    BackpressureTimeout,
    ConfigError,
    DataLossError,
    OperatorError,
    PlaneClosedError,
    raised_again,
)
from conduit.plane.config import PlaneConfig
from conduit.plane.flows import check_written_rows
from conduit.plane.ports import ActorIn, BufferIn, BufferOut, LearnerOut
from conduit.plane.runtime import (
    DeliveryFn,
    IngestionFn,
    identity_delivery,
    identity_ingestion,
    take_turn,
    turn_timeout,
    untold_part,
    untold_share,
)
from conduit.scheduling.space import Schedule, ScheduleSpace
from conduit.spec import Batch
from conduit.storage import data_path_threads

StoreFn = Callable[[Mapping[str, Any], "QueuedUnit", float], int]
"""Writes one operator output for a unit (validated, routed, replicated); returns its rows."""

PrepareFn = Callable[[Mapping[str, Any]], tuple[Any, int]]
"""Checks one operator output (as :data:`StoreFn` would) and readies it to be stored (a copy
the operator cannot change any more); returns it and its rows."""

CommitFn = Callable[[Any, int, "QueuedUnit", float], None]
"""Stores one output :data:`PrepareFn` readied (routed, replicated)."""


@dataclass
class QueuedUnit:
    """One pushed rollout unit waiting for ingestion.

    Attributes:
        data: Field -> tensor, as pushed.
        rows: Its rows.
        node: The Ray node it was pushed on (its rows go to that node's shard).
        version: On-policy: the policy version it was pushed with.
        pusher: The thread whose ``push`` queued it: a failed inline invocation reports the
            units of other threads' pushes, which returned, at ``close()``.
    """

    data: Batch
    rows: int
    node: str | None
    version: int | None
    pusher: threading.Thread | None = None


def check_schedule(space: ScheduleSpace, schedule: Schedule, *, on_policy: bool) -> None:
    """Raise if ``schedule`` cannot run on a sharded plane.

    Raises:
        ConfigError: ``schedule`` is not a :class:`Schedule`.
        ScheduleError: Outside the feasible space.
    """
    if not isinstance(schedule, Schedule):
        raise ConfigError("schedule", f"expected a conduit.scheduling.Schedule, got "
                                      f"{type(schedule).__name__}")
    space.check(schedule)


def deliver(fn: DeliveryFn, rows: Batch, *, batches: int, batch_size: int,
            device: torch.device) -> list[Batch]:
    """Run the delivery operator over one draw's ``rows``; its training batches, on ``device``.

    Raises:
        OperatorError: The operator raised, or did not write ``batches`` training batches.
    """
    out = LearnerOut(batches=batches, device=device)
    try:
        fn(BufferIn(rows, batches=batches, batch_size=batch_size), out)
        if len(out.staged) != batches:
            raise RuntimeError("the delivery operator did not call learn_out.write()")
    except Exception as exc:
        raise OperatorError("delivery", exc) from exc
    return out.staged


STORED_ATTR = "conduit_stored_rows"
"""Where :func:`mark_stored` records rows on an exception that documents no such attribute
(a :class:`ShardUnavailableError` has its public ``stored_rows``)."""


def _rows_attr(exc: BaseException, public: str, private: str) -> str:
    return public if isinstance(exc, ShardUnavailableError) else private


def stored_rows_of(exc: BaseException) -> int:
    """Rows a failed write stored all the same (it was sent, not acknowledged, and the holders
    applied it), as :func:`mark_stored` recorded them on ``exc``."""
    return int(getattr(exc, _rows_attr(exc, "stored_rows", STORED_ATTR), 0))


def mark_stored(exc: BaseException, rows: int) -> None:
    """Record on ``exc`` that the write it ended stored ``rows`` rows all the same."""
    setattr(exc, _rows_attr(exc, "stored_rows", STORED_ATTR), stored_rows_of(exc) + rows)


UNSETTLED_ATTR = "conduit_unsettled_rows"
"""Where :func:`mark_unsettled` records rows on an exception that documents no such attribute
(a :class:`ShardUnavailableError` has its public ``unsettled_rows``)."""


@contextlib.contextmanager
def front_until(cond: threading.Condition, deadline: float, what: str) -> Iterator[bool]:
    """Hold the front's ``cond`` (a condition over a re-entrant lock), waiting for another
    call that holds it (it may wait on a stalled shard) only until ``deadline``; yields
    whether it had to wait.

    Raises:
        ShardUnavailableError: ``deadline`` passed first (``what`` says what was not done).
    """
    waited = not cond.acquire(blocking=False)
    if waited and not cond.acquire(timeout=max(0.0, deadline - time.monotonic())):
        raise ShardUnavailableError(None, f"the call's timeout ran out while another call held "
                                          f"the front (waiting on a shard); {what}: pass a "
                                          f"longer timeout")
    try:
        yield waited
    finally:
        cond.release()


def unsettled_rows_of(exc: BaseException) -> int:
    """Rows of a failed write not known to be stored or not (its holders were not or could
    not be re-read), as :func:`mark_unsettled` recorded them on ``exc``: on-policy they stay
    counted against the iteration until the write is settled."""
    return int(getattr(exc, _rows_attr(exc, "unsettled_rows", UNSETTLED_ATTR), 0))


def mark_unsettled(exc: BaseException, rows: int) -> None:
    """Record on ``exc`` that whether the write it ended stored its ``rows`` rows is not
    known yet."""
    setattr(exc, _rows_attr(exc, "unsettled_rows", UNSETTLED_ATTR),
            unsettled_rows_of(exc) + rows)


def invoke(fn: IngestionFn, units: list[QueuedUnit], *, store: StoreFn,
           hold: tuple[PrepareFn, CommitFn] | None, timeout: float,
           floor: float | None = None, current: QueuedUnit | None, inside: threading.local
           ) -> tuple[OperatorError | None, BaseException | None, int]:
    """Run the ingestion operator ``fn`` once over ``units`` on the calling thread, its writes
    stored at once (``store``) or, with ``hold``, readied as they are written and stored only
    once ``fn`` returned having written exactly its units' rows.

    Args:
        fn: The operator.
        units: Its input (the first unit's node receives the rows).
        store: Stores one write.
        hold: ``(prepare, commit)`` to hold the writes until ``fn`` returned.
        timeout: Seconds each write may take, from when it starts (a slow operator does not
            use up its writes' time).
        floor: A deadline no write's is earlier than (``time.monotonic()``; the push running
            the invocation inline gave a longer timeout), if any.
        current: The unit of the push running this invocation inline, if any: not
            acknowledged, so not counted as lost when an interrupt ends the invocation.
        inside: Its ``active`` is True on this thread while ``fn`` runs.

    Returns:
        ``(error, interrupt, kept)``: the invocation's error, if it failed (its units, or on
        an interrupt the acknowledged ones, counted as lost); the interrupt (a
        ``BaseException`` that is not an ``Exception``, such as ``KeyboardInterrupt``), if
        one ended it, for the caller to re-raise; the rows of its units that were stored all
        the same or whose write is not settled yet.
    """
    first = units[0]
    held: list[tuple[Any, int]] = []
    stored = 0  # rows of this invocation's acknowledged writes (they stay on failure)

    def deadline() -> float:  # of a write starting now
        return max(time.monotonic() + timeout, floor or 0.0)

    def write(batch: Mapping[str, Any]) -> int:
        nonlocal stored
        if hold is None:
            rows = store(batch, first, deadline())
            stored += rows
            return rows
        held.append(hold[0](batch))
        return held[-1][1]

    try:
        outer, inside.active = getattr(inside, "active", False), True
        try:
            with data_path_threads(1):
                fn(ActorIn([u.data for u in units], [u.version for u in units]),
                   BufferOut(write))
        finally:
            inside.active = outer
        if hold is not None:
            check_written_rows(sum(rows for _, rows in held), [u.rows for u in units])
            for payload, rows in held:
                hold[1](payload, rows, first, deadline())
                stored += rows
    except BaseException as exc:
        interrupt = None if isinstance(exc, Exception) else exc
        stored += stored_rows_of(exc)
        unsettled = unsettled_rows_of(exc)  # a write that raised and may still land
        lost = [u for u in units if interrupt is None or u is not current]
        err = OperatorError("ingestion", exc, lost_units=len(lost),
                            lost_rows=sum(u.rows for u in lost), stored_rows=stored,
                            unsettled_rows=unsettled)
        err.__cause__ = exc
        return err, interrupt, stored + unsettled
    return None, None, stored


class FrontIngestion:
    """The operators of the sharded front: the ingestion operator with its queue, its thread
    and its error latch, and the delivery operator the learner ports run.

    Args:
        store: Writes one operator output (called with no lock of this class held).
        timeout: Seconds a worker write may take, and ``close`` may wait for the worker.
        on_lost: Called (with no lock of this class held) with the units that will not be
            stored (refused by :meth:`submit`, or taken by a failed or interrupted invocation)
            and the rows of theirs that were stored all the same or whose write is not settled
            yet (they are not released).
        prepare: With ``commit``, on-policy (:attr:`iteration` set): an invocation's outputs
            are checked and readied as they are written, and stored only once the operator
            returned having written exactly its units' rows, so a failed invocation leaves no
            row in the iteration (which counts pushed rows).
        commit: Stores an output ``prepare`` readied.
    """

    thread_name = "conduit-ingestion"

    def __init__(self, *, store: StoreFn, timeout: float,
                 on_lost: Callable[[list[QueuedUnit], int], None] = lambda units, stored: None,
                 prepare: PrepareFn | None = None, commit: CommitFn | None = None) -> None:
        self._store, self._timeout, self._on_lost = store, timeout, on_lost
        self._prepare, self._commit = prepare, commit
        self.fn: IngestionFn = identity_ingestion
        self.registered = False
        self.deliver_fn: DeliveryFn = identity_delivery
        self.schedule = Schedule()
        self._cond = threading.Condition(threading.RLock())
        self._pending: deque[QueuedUnit] = deque()
        self._inflight = 0  # units taken by a running invocation
        #: The running invocations' units, each with the unit of the push running it inline.
        self._running: dict[int, tuple[list[QueuedUnit], QueuedUnit | None]] = {}
        self._hurry = 0  # flushes waiting: ingest fewer than g_ing units
        self._hurried = False  # a learner waits for rows: ingest what is queued
        self._thread: threading.Thread | None = None
        # set_schedule and close, one at a time: a close during a schedule change would find
        # no thread while the old one still runs, and a change after close would start one
        self._life = threading.Lock()
        self._stop = False
        self._closed = False  # no unit is queued after close() began draining
        self.error: OperatorError | None = None
        #: The latched error's lost units, and the threads a call told of it: ``close()``
        #: reports the units whose pushing thread was never told.
        self._error_units: list[QueuedUnit] = []
        self._error_told: set[int] = set()
        self.counters = {"invocations": 0, "lost_units": 0, "lost_rows": 0}
        self._interrupted: list[OperatorError] = []  # losses of interrupted invocations
        #: Shares of failed inline invocations no caller was told of (see _drain_inline).
        self._untold: list[OperatorError] = []
        self._draining = 0  # threads in _drain_inline (close() waits for them)
        self._inline_order = threading.RLock()  # see _drain
        self._inside = threading.local()  # set on a thread while it runs the operator
        #: On-policy: the iteration's rows and whether all of them were pushed. ``g_ing`` is
        #: then a share of the iteration's rows per invocation, as on a local plane.
        self.iteration: tuple[int, Callable[[], bool]] | None = None
        #: Off-policy: most rows one invocation's units may hold (a shard's ring), since the
        #: operator may write them joined; None: no bound.
        self.row_limit: int | None = None

    # -- schedule ---------------------------------------------------------------------------
    @property
    def overlapped(self) -> bool:
        """Whether ingestion runs on the front's thread (``overlap_ing = 1``)."""
        return bool(self.schedule.overlap_ing)

    @property
    def direct(self) -> bool:
        """No operator and one unit per inline invocation: a push writes its rows itself."""
        return not self.registered and not self.overlapped and (
            self.iteration is not None or self.schedule.g_ing == 1)

    def refuse_inside(self, call: str) -> None:
        """Raise if the calling thread runs the ingestion operator: ``call`` waits for its
        invocations to end, this one included.

        Raises:
            ConfigError: (field ``call``) It does.
        """
        if getattr(self._inside, "active", False):
            raise ConfigError(call, "called from inside the ingestion operator: it waits for "
                                    "the operator's invocations to end, this one included; "
                                    "call it from the thread that pushes or pulls")

    def set_schedule(self, schedule: Schedule) -> None:
        """Use ``schedule`` from now on (call after :meth:`flush`), starting or stopping the
        thread.

        Raises:
            ConfigError: Called from inside the ingestion operator (nothing changes).
            PlaneClosedError: :meth:`close` began (nothing changes).
        """
        self.refuse_inside("set_schedule")
        with self._life:
            self._join()
            with self._cond:
                if self._closed:
                    raise PlaneClosedError("the sharded plane is closed")
                self.schedule, self._stop = schedule, False
            if self.overlapped:
                self._thread = threading.Thread(target=self._work, name=self.thread_name,
                                                daemon=True)
                self._thread.start()

    @property
    def _g(self) -> int:
        return int(self.schedule.g_ing)

    # -- errors (as conduit.plane.runtime.OperatorRuntime latches them) -----------------------
    def raise_if_failed(self) -> None:
        """Raise the latched operator error, if any."""
        with self._cond:
            if self.error is not None:
                self._error_told.add(threading.get_ident())
                raise raised_again(self.error)

    def _untold_locked(self) -> OperatorError | None:
        """The latched error as ``close()`` reports it: only its lost units whose pushing
        thread no call told of it (None when all were told)."""
        return untold_part(self.error, self._error_units, self._error_told)

    def recover(self) -> OperatorError | None:
        """Unlatch the operator error (the caller handled it), and forget the failed inline
        invocations no caller was told of (handled as well); returns the latched error."""
        with self._cond:
            err, self.error = self.error, None
            self._untold.clear()
            self._cond.notify_all()
        return err

    # -- the queue --------------------------------------------------------------------------
    def submit(self, unit: QueuedUnit, deadline: float) -> None:
        """Queue ``unit``; inline, run the invocations that are due on this thread until
        ``unit`` is taken (see :meth:`_drain_inline`).

        Raises:
            BackpressureTimeout: No room in the queue by ``deadline``, or, inline, its turn
                to ingest (after other threads' inline invocations) did not come by then (the
                unit is withdrawn).
            OperatorError: The operator raised here, in the invocation that held ``unit``
                (the error is not kept; it counts that invocation's units, ``unit`` among
                them), or earlier on the thread (latched until ``recover``; ``unit`` is not
                queued).
            PlaneClosedError: :meth:`close` began (the unit is not taken).
        """
        try:
            inline = self._queue(unit, deadline)
        except BaseException:
            self._on_lost([unit], 0)
            raise
        if inline:  # as decided when it was queued (a set_schedule may have come since)
            self._drain_inline(force=False, deadline=deadline, current=unit, counted=True)

    def _queue(self, unit: QueuedUnit, deadline: float) -> bool:
        """Queue ``unit``; whether its push drains inline (then counted in ``_draining``)."""
        with self._cond:
            while True:
                if self._closed:
                    raise PlaneClosedError("the sharded plane is closed")
                self.raise_if_failed()
                # On-policy the iteration gate bounds what is queued.
                if self.iteration is not None or len(self._pending) < 2 * self._g:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BackpressureTimeout(
                        f"push waited for room: {len(self._pending)} units queued and "
                        f"{self._inflight} being ingested (at most 2·g_ing = {2 * self._g} "
                        f"wait); the ingestion operator is slower than the actors")
                self._cond.wait(left)
            self._pending.append(unit)
            inline = not self.overlapped
            if inline:
                self._draining += 1  # its push's drain, counted before close() can begin
            self._cond.notify_all()
            return inline

    def _take(self, *, force: bool) -> list[QueuedUnit] | None:
        """Up to ``g_ing`` queued units of one node (call with the lock held), no more than
        :attr:`row_limit` rows together; on-policy, up to ``g_ing`` of the iteration's rows, or
        everything once the iteration is pushed."""
        if not self._pending:
            return None
        if self.iteration is None:
            units_cap, rows_cap = self._g, None
            if len(self._pending) < self._g and not force:
                return None
        else:
            capacity, complete = self.iteration
            want = max(1, int(self.schedule.g_ing * capacity))
            if force or complete():
                units_cap, rows_cap = len(self._pending), None
            elif sum(u.rows for u in self._pending) < want:
                return None
            else:
                units_cap, rows_cap = len(self._pending), want
        node = self._pending[0].node
        units: list[QueuedUnit] = []
        got = 0
        limit = self.row_limit if self.iteration is None else None
        while (self._pending and len(units) < units_cap and self._pending[0].node == node
               and (rows_cap is None or got < rows_cap)):
            if units and limit is not None and got + self._pending[0].rows > limit:
                break  # joined, they would not fit the shard: the rest go next
            units.append(self._pending.popleft())
            got += units[-1].rows
        self._inflight += len(units)
        self._cond.notify_all()  # room in the queue for a waiting push
        return units

    def _run(self, units: list[QueuedUnit], current: QueuedUnit | None = None,
             floor: float | None = None) -> OperatorError | None:
        """One invocation over ``units``; returns its error (not yet latched).

        An interrupt (any ``BaseException`` that is not an ``Exception``, such as
        ``KeyboardInterrupt``) restores the queue's counters, hands the units to ``on_lost``,
        records the acknowledged units as lost (:meth:`close` reports them) and is re-raised.
        ``current`` is the unit of the push running this invocation inline (not acknowledged,
        so not counted as lost). Each write may take the timeout from when it starts, or
        until ``floor`` (the inline caller's deadline) when that is later.
        """
        prepare, commit = self._prepare, self._commit
        hold = (prepare, commit) if (self.iteration is not None and prepare is not None
                                     and commit is not None) else None
        with self._cond:
            self._running[id(units)] = (units, current)
        try:
            err, interrupt, kept = invoke(self.fn, units, store=self._store, hold=hold,
                                          timeout=self._timeout, floor=floor,
                                          current=current, inside=self._inside)
        finally:
            with self._cond:
                del self._running[id(units)]
        with self._cond:
            self._inflight -= len(units)
            self.counters["invocations"] += 1
            if err is not None:
                self.counters["lost_units"] += err.lost_units
                self.counters["lost_rows"] += err.lost_rows
            if interrupt is not None and err is not None and err.lost_units:
                self._interrupted.append(err)
            self._cond.notify_all()
        if err is not None:
            self._on_lost(units, kept)
        if interrupt is not None:
            raise interrupt
        return err

    def _drain_inline(self, *, force: bool, deadline: float | None,
                      current: QueuedUnit | None = None, counted: bool = False) -> None:
        """Run the due invocations on this thread: every one (a flush), or, for a push
        (``current``: its unit), those until its unit is taken, by this thread or another.

        A failed invocation's error goes to the call that brought its input: it is raised
        here unless this is a push and the invocation did not hold ``current`` (units of
        other pushes queued before it); the push then goes on, its unit still queued. The
        units of a failure that other threads pushed, or of one not raised, are kept for
        :meth:`close` (their pushes returned). An interrupt (such as ``KeyboardInterrupt``)
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
        although the push raised). :meth:`close` waits for the drains on other threads, so
        what they keep is counted; one that would begin after it (a flush or a learner's
        hurry, ``counted`` False) leaves the queue to it.

        Raises:
            BackpressureTimeout: ``deadline`` passed while another thread's inline
                invocations ran (a push's unit is then withdrawn).
        """
        with self._cond:
            if not counted:
                if self._closed:
                    return
                self._draining += 1
        try:
            self._drain(force=force, current=current, deadline=deadline)
        except BaseException:
            if current is not None:  # e.g. interrupted while waiting its turn
                self._withdraw(current)
            raise
        finally:
            with self._cond:
                self._draining -= 1
                self._cond.notify_all()

    def _drain(self, *, force: bool, current: QueuedUnit | None,
               deadline: float | None) -> None:
        order = self._inline_order
        while True:
            units: list[QueuedUnit] = []
            # Invocations on different callers' threads run one at a time, in the order they
            # took their units: rows land in push order, and while a push's invocation over
            # earlier units runs, no other thread takes its unit, so a push that raises
            # withdraws it (under the same lock) before anyone could store it.
            if not take_turn(order, deadline, time.monotonic):
                if deadline is None or (current is not None and not self._withdraw(current)):
                    return  # the running drain ingests; or this push's unit was taken
                raise turn_timeout("push" if current is not None else "flush")
            try:
                with self._cond:
                    if current is not None and all(u is not current for u in self._pending):
                        return  # taken: stored, or failed where its push was told
                    self.raise_if_failed()
                    units = self._take(force=force) or []
                if not units:
                    return
                err = self._run(units, current, deadline)
            except BaseException:
                if current is not None and all(u is not current for u in units):
                    self._withdraw(current)
                raise
            finally:
                order.release()
            if err is None:
                continue
            told = current is None or any(u is current for u in units)
            share = untold_share(err, units, told=told)
            if share is not None:
                with self._cond:
                    self._untold.append(share)
            if told:
                raise err

    def _withdraw(self, unit: QueuedUnit) -> bool:
        """Take ``unit`` out of the queue, if it is still there, and hand it to ``on_lost``;
        False if it was not queued any more (taken by an invocation)."""
        with self._cond:
            at = next((k for k, u in enumerate(self._pending) if u is unit), None)
            if at is None:
                return False
            del self._pending[at]
            self._cond.notify_all()
        self._on_lost([unit], 0)
        return True

    def _work(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stop:  # close() drains the queue itself, counting failures
                        return
                    if self.error is None:
                        units = self._take(force=self._hurry > 0 or self._hurried)
                        if units is not None:
                            self._hurried = self._hurried and bool(self._pending)
                            break
                    self._cond.wait()
            err = self._run(units)
            if err is not None:
                with self._cond:
                    if self.error is None:
                        self.error, self._error_units, self._error_told = err, units, set()
                    self._cond.notify_all()

    def hurry(self) -> None:
        """A learner waits for rows: ingest what is queued, however few units (inline: on
        this thread, which must not hold the front's lock, unless another thread's inline
        ingestion runs, which it leaves the queue to; overlapped: on the thread)."""
        if self.overlapped:
            with self._cond:
                if self._pending and not self._hurried:
                    self._hurried = True
                    self._cond.notify_all()
            return
        self._drain_inline(force=True, deadline=None)

    def idle(self) -> bool:
        """Whether no unit waits or is being ingested."""
        with self._cond:
            return not self._pending and not self._inflight

    def flush(self, deadline: float) -> None:
        """Ingest every queued unit (fewer than ``g_ing`` included).

        Raises:
            BackpressureTimeout: Not done by ``deadline``.
            OperatorError: An invocation failed.
            ConfigError: Called from inside the ingestion operator.
        """
        self.refuse_inside("flush")
        if not self.overlapped:
            self._drain_inline(force=True, deadline=deadline)
            return
        with self._cond:
            self._hurry += 1
            self._cond.notify_all()
            try:
                while self._pending or self._inflight:
                    self.raise_if_failed()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise BackpressureTimeout(
                            f"flush: {len(self._pending)} rollout units still queued and "
                            f"{self._inflight} being ingested when the timeout ran out; pass a "
                            f"longer timeout or check the ingestion operator")
                    self._cond.wait(left)
                self.raise_if_failed()
            finally:
                self._hurry = max(0, self._hurry - 1)

    # -- close ------------------------------------------------------------------------------
    def _join(self) -> bool:
        """Stop the thread after its running invocation; False if it did not stop in time."""
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        thread.join(self._timeout)
        return not thread.is_alive()

    def close(self) -> None:
        """Stop the thread and store every queued unit.

        Raises:
            DataLossError: Some acknowledged units were not stored: a latched failure not
                cleared by :meth:`recover` (its units whose pushing thread no call told of
                it), an
                inline failure raised to another thread's call than
                the pushes of its units (or to none) and not cleared by :meth:`recover`, an
                invocation cut short by an interrupt (such as ``KeyboardInterrupt``), a
                failure while draining, or a thread stuck in the operator past the timeout;
                the first cause is attached.
            ConfigError: Called from inside the ingestion operator (nothing changes).
        """
        self.refuse_inside("close")
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        with self._life:  # after a schedule change in progress has stopped its thread
            stopped = self._join()
        with self._cond:
            # Inline drains on other threads first: what they fail or keep is counted below.
            # They run one at a time, so the wait lasts while they make progress: it ends
            # when ``timeout`` passes without an invocation finishing.
            deadline, done = time.monotonic() + self._timeout, self.counters["invocations"]
            while self._draining and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
                if self.counters["invocations"] != done:
                    deadline, done = time.monotonic() + self._timeout, self.counters[
                        "invocations"]
            stopped = stopped and not self._draining
            latched = self._untold_locked()
            errors = [latched, *self._kept_locked()] if latched else self._kept_locked()
            self.error = None  # the queue is drained below whatever happened
            if not stopped:
                # Acknowledged units still queued or in a running invocation (a push's own
                # unit is not acknowledged: the push reports it).
                acked = [u for units, current in self._running.values() for u in units
                         if u is not current] + list(self._pending)
                errors.append(OperatorError("runtime", TimeoutError(
                    f"the ingestion thread, or an inline ingestion on another thread, did not "
                    f"finish within {self._timeout:g} s"),
                    lost_units=len(acked), lost_rows=sum(u.rows for u in acked)))
                self._pending.clear()
        while True:
            with self._cond:
                units = self._take(force=True)
            if units is None:
                break
            err = self._run(units)
            if err is not None:
                errors.append(err)
        with self._cond:  # kept by a drain that outlived the wait above
            errors += self._kept_locked()
        lost_units = sum(e.lost_units for e in errors)
        lost_rows = sum(e.lost_rows for e in errors)
        if lost_units:
            cause = errors[0]
            raise DataLossError(
                f"close(): {lost_units} rollout units ({lost_rows} rows) acknowledged by push "
                f"were not stored: {cause}", lost_units=lost_units,
                lost_rows=lost_rows) from cause

    def _kept_locked(self) -> list[OperatorError]:
        """The losses kept for :meth:`close` (interrupted invocations, failures no caller was
        told of), forgotten here."""
        kept = [*self._interrupted, *self._untold]
        self._interrupted.clear()
        self._untold.clear()
        return kept


def check_ports(kind: str, got: tuple[str, str], want: tuple[str, str]) -> None:
    """Raise unless an operator connects the ports of its kind (Fig. 8).

    Raises:
        ConfigError: Named ``register_<kind>``.
    """
    if got != want:
        raise ConfigError(f"register_{kind}", f"{kind} connects input={want[0]!r} to "
                                              f"output={want[1]!r}, got {got[0]!r} -> "
                                              f"{got[1]!r}")


class ScheduledOperators:
    """The operator and schedule methods of the sharded plane's front (a mixin of
    :class:`~conduit.distributed.RayExperienceDataPlane`, which provides the attributes)."""

    config: PlaneConfig
    space: ScheduleSpace
    prefetch: bool
    _g_del: int
    _ingestion: FrontIngestion
    _check_open: Callable[[], None]

    def _resolve_schedule(self, schedule: Schedule | None, prefetch: bool | None) -> Schedule:
        cfg = self.config
        if schedule is None:
            schedule = Schedule(0, 1, int(True if prefetch is None else bool(prefetch)),
                                cfg.default_schedule().g_del)
        elif prefetch is not None and bool(prefetch) != bool(getattr(schedule, "overlap_del",
                                                                     prefetch)):
            raise ConfigError("prefetch", f"prefetch={prefetch} contradicts the schedule's "
                                          f"overlap_del; leave prefetch unset with a schedule")
        check_schedule(self.space, schedule, on_policy=cfg.on_policy)
        return schedule

    def register_ingestion(self, *, input: str = "Actor", output: str = "ExperienceBuffer"
                           ) -> Callable[[IngestionFn], IngestionFn]:
        """Decorator registering the ingestion operator (Fig. 8), as on a local plane: it gets
        ``(actor_in, exp_out)``, reads rollouts with ``actor_in.read()`` (or ``read_units()``)
        and writes buffer rows with ``exp_out.write(...)``. It runs in the front, before the
        rows are routed to the pushing node's shard and replicated. Register it before the
        first push.

        Raises:
            ConfigError: The ports are not ``"Actor"`` -> ``"ExperienceBuffer"``.
        """
        check_ports("ingestion", (input, output), ("Actor", "ExperienceBuffer"))

        def deco(fn: IngestionFn) -> IngestionFn:
            self._ingestion.fn, self._ingestion.registered = fn, True
            return fn
        return deco

    def register_delivery(self, *, input: str = "ExperienceBuffer", output: str = "Learner"
                          ) -> Callable[[DeliveryFn], DeliveryFn]:
        """Decorator registering the delivery operator (Fig. 8), as on a local plane: it gets
        ``(exp_in, learn_out)``, reads the sampled rows (with ``_index`` and, prioritized,
        ``_weight``) with ``exp_in.read()`` and writes training-ready data with
        ``learn_out.write(...)``, which splits it into the invocation's ``g_del`` batches. It
        runs on each learner rank's pulling thread over that rank's draw.

        Raises:
            ConfigError: The ports are not ``"ExperienceBuffer"`` -> ``"Learner"``.
        """
        check_ports("delivery", (input, output), ("ExperienceBuffer", "Learner"))

        def deco(fn: DeliveryFn) -> DeliveryFn:
            self._ingestion.deliver_fn = fn
            return fn
        return deco

    @property
    def schedule(self) -> Schedule:
        """The schedule in force (``overlap_del`` follows :attr:`prefetch`)."""
        return dataclasses.replace(self._ingestion.schedule, overlap_del=int(self.prefetch))

    def set_schedule(self, schedule: Schedule) -> None:
        """Ingest what is queued, then switch overlap and granularity; data are kept.

        Raises:
            ScheduleError: The schedule is outside the feasible space or not available on a
                sharded plane.
        """
        self._check_open()
        check_schedule(self.space, schedule, on_policy=self.config.on_policy)
        self.flush()
        self._ingestion.set_schedule(schedule)  # not under the lock: the thread may write
        self.prefetch, self._g_del = bool(schedule.overlap_del), max(1, int(schedule.g_del))

    def flush(self, *, timeout: float | None = None) -> None:
        """Ingest every queued unit now (even fewer than ``g_ing``).

        Raises:
            BackpressureTimeout: Ingestion did not finish within ``timeout``.
            OperatorError: The ingestion operator raised.
            PlaneClosedError: The plane is closed.
        """
        self._check_open()
        self._ingestion.flush(time.monotonic() + self.config.wait_for(timeout))

    @property
    def failed(self) -> OperatorError | None:
        """The operator error that calls now raise (until :meth:`recover`), if any: each
        raises a copy of it (same type, attributes, cause and traceback)."""
        return self._ingestion.error

    def recover(self) -> OperatorError | None:
        """Clear an ingestion failure once the caller has handled it, and return it; the
        queued units are ingested again. The failed invocation's units are lost (counted in
        the error and in ``stats()["ingestion"]``)."""
        self._check_open()
        return self._ingestion.recover()
