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
(:mod:`conduit.plane.operator_errors`): ``push``, ``flush`` and ``pull`` raise its
:class:`~conduit.errors.OperatorError` until ``recover()``; ``close()`` reports every
acknowledged unit that was not stored with :class:`~conduit.errors.DataLossError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from conduit.distributed.errors import ShardUnavailableError
from conduit.distributed.ingestion import (
    IngestionLatch,
    IngestionQueue,
    IngestionWorker,
    InlineDrains,
    raise_lost,
)
from conduit.errors import ConfigError, OperatorError, PlaneClosedError
from conduit.plane.config import PlaneConfig
from conduit.plane.flows import check_written_rows
from conduit.plane.ports import ActorIn, BufferIn, BufferOut, LearnerOut
from conduit.plane.runtime import (
    DeliveryFn,
    IngestionFn,
    identity_delivery,
    identity_ingestion,
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

    It holds the operators and the schedule and runs one invocation; the queue
    (:class:`~conduit.distributed.ingestion.IngestionQueue`), the error latch
    (:class:`~conduit.distributed.ingestion.IngestionLatch`), the inline drains
    (:class:`~conduit.distributed.ingestion.InlineDrains`) and the thread
    (:class:`~conduit.distributed.ingestion.IngestionWorker`) are its parts.

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
        self._units = IngestionQueue(self._cond, lambda: self.schedule.g_ing)
        self._latch = IngestionLatch(self._cond)
        self._drains = InlineDrains(cond=self._cond, queue=self._units, latch=self._latch,
                                    run=self._run, on_lost=on_lost)
        self._worker = IngestionWorker(cond=self._cond, queue=self._units, latch=self._latch,
                                       run=self._run, name=self.thread_name)
        # set_schedule and close, one at a time: a close during a schedule change would find
        # no thread while the old one still runs, and a change after close would start one
        self._life = threading.Lock()
        self._inside = threading.local()  # set on a thread while it runs the operator

    # -- state of the parts ------------------------------------------------------------------
    @property
    def error(self) -> OperatorError | None:
        """The latched operator error, if any."""
        return self._latch.error

    @property
    def counters(self) -> dict[str, int]:
        """Invocations run, and units and rows their failures lost."""
        return self._latch.counters

    @property
    def iteration(self) -> tuple[int, Callable[[], bool]] | None:
        """On-policy: the iteration's rows and whether all of them were pushed. ``g_ing`` is
        then a share of the iteration's rows per invocation, as on a local plane."""
        return self._units.iteration

    @iteration.setter
    def iteration(self, value: tuple[int, Callable[[], bool]] | None) -> None:
        self._units.iteration = value

    @property
    def row_limit(self) -> int | None:
        """Off-policy: most rows one invocation's units may hold (a shard's ring), since the
        operator may write them joined; None: no bound."""
        return self._units.row_limit

    @row_limit.setter
    def row_limit(self, value: int | None) -> None:
        self._units.row_limit = value

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
                if self._units.closed:
                    raise PlaneClosedError("the sharded plane is closed")
                self.schedule = schedule
            if self.overlapped:
                self._worker.start()

    # -- errors -----------------------------------------------------------------------------
    def raise_if_failed(self) -> None:
        """Raise the latched operator error, if any."""
        self._latch.raise_if_failed()

    def recover(self) -> OperatorError | None:
        """Unlatch the operator error (the caller handled it), and forget the failed inline
        invocations no caller was told of (handled as well); returns the latched error."""
        return self._latch.recover()

    # -- the queue --------------------------------------------------------------------------
    def submit(self, unit: QueuedUnit, deadline: float) -> None:
        """Queue ``unit``; inline, run the invocations that are due on this thread until
        ``unit`` is taken (see :meth:`InlineDrains.drain
        <conduit.distributed.ingestion.InlineDrains.drain>`).

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
            self._drains.drain(force=False, deadline=deadline, current=unit, counted=True)

    def _queue(self, unit: QueuedUnit, deadline: float) -> bool:
        """Queue ``unit``; whether its push drains inline (then counted in ``_draining``)."""
        with self._cond:
            self._units.put_locked(unit, deadline, self.raise_if_failed)
            inline = not self.overlapped
            if inline:
                self._drains.count += 1  # its push's drain, counted before close() can begin
            self._cond.notify_all()
            return inline

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
        self._units.running(units, current)
        try:
            err, interrupt, kept = invoke(self.fn, units, store=self._store, hold=hold,
                                          timeout=self._timeout, floor=floor,
                                          current=current, inside=self._inside)
        finally:
            self._units.ran(units)
        with self._cond:
            self._units.inflight -= len(units)
            self._latch.count_locked(err, interrupted=interrupt is not None)
            self._cond.notify_all()
        if err is not None:
            self._on_lost(units, kept)
        if interrupt is not None:
            raise interrupt
        return err

    def hurry(self) -> None:
        """A learner waits for rows: ingest what is queued, however few units (inline: on
        this thread, which must not hold the front's lock, unless another thread's inline
        ingestion runs, which it leaves the queue to; overlapped: on the thread)."""
        if self.overlapped:
            self._units.hurry()
            return
        self._drains.drain(force=True, deadline=None)

    def idle(self) -> bool:
        """Whether no unit waits or is being ingested."""
        return self._units.idle()

    def flush(self, deadline: float) -> None:
        """Ingest every queued unit (fewer than ``g_ing`` included).

        Raises:
            BackpressureTimeout: Not done by ``deadline``.
            OperatorError: An invocation failed.
            ConfigError: Called from inside the ingestion operator.
        """
        self.refuse_inside("flush")
        if not self.overlapped:
            self._drains.drain(force=True, deadline=deadline)
            return
        self._units.wait_ingested(deadline, self.raise_if_failed)

    # -- close ------------------------------------------------------------------------------
    def _join(self) -> bool:
        """Stop the thread after its running invocation; False if it did not stop in time."""
        return self._worker.join(self._timeout)

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
            self._units.closed = True
            self._cond.notify_all()
        with self._life:  # after a schedule change in progress has stopped its thread
            stopped = self._join()
        with self._cond:
            # Inline drains on other threads first: what they fail or keep is counted below.
            stopped = self._drains.wait_locked(self._timeout) and stopped
            errors = self._latch.reports_locked()  # the queue is drained below regardless
            if not stopped:
                acked = self._units.acknowledged_locked()
                errors.append(OperatorError("runtime", TimeoutError(
                    f"the ingestion thread, or an inline ingestion on another thread, did not "
                    f"finish within {self._timeout:g} s"),
                    lost_units=len(acked), lost_rows=sum(u.rows for u in acked)))
                self._units.pending.clear()
        while True:
            with self._cond:
                units = self._units.take_locked(force=True)
            if units is None:
                break
            err = self._run(units)
            if err is not None:
                errors.append(err)
        with self._cond:  # kept by a drain that outlived the wait above
            errors += self._latch.kept_locked()
        raise_lost(errors)


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
