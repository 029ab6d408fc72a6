"""Closing a plane's engine: stop the workers, store every queued unit, count what was lost.

:func:`close_and_drain` is :meth:`PlaneEngine.close <conduit.plane.engine.PlaneEngine.close>`'s
body; the engine's docstring states its contract.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Set
from typing import TYPE_CHECKING

from conduit.errors import DataLossError, OperatorError
from conduit.plane.flows import Flow

if TYPE_CHECKING:
    from conduit.plane.engine import PlaneEngine


class Loss:
    """What :func:`close_and_drain` could not store: units and rows, and the first cause."""

    def __init__(self) -> None:
        self.units = self.rows = 0
        self.cause: BaseException | None = None

    def add(self, err: OperatorError | None) -> None:
        """Count a failed invocation's lost units (None: nothing failed)."""
        if err is not None:
            self.cause = self.cause or err
            self.units += err.lost_units
            self.rows += err.lost_rows

    def add_all(self, errors: list[OperatorError] | None) -> None:
        """Count each of ``errors``."""
        for err in errors or ():
            self.add(err)

    def add_queue(self, flow: Flow, *, inflight: bool, own: Set[int] = frozenset()) -> None:
        """Count the queued units (and, with ``inflight``, those being ingested, less the
        ``own`` units, by ``id``, of pushes that run their invocation inline and report it)
        as lost and drop the queue."""
        if inflight:
            acked = [u for u in flow.inflight if id(u) not in own]
            self.units += len(acked)
            self.rows += sum(u.rows for u in acked)
        self.units += len(flow.pending)
        self.rows += sum(u.rows for u in flow.pending)
        flow.pending.clear()


def close_and_drain(engine: PlaneEngine) -> None:
    """Mark ``engine`` closed, stop its workers and ingest its queued units on this thread;
    a no-op once closed. Call after refusing a call from inside an operator.

    Raises:
        DataLossError: Acknowledged units could not be stored (see ``PlaneEngine.close``).
        KeyboardInterrupt: The ingestion operator raised an interrupt while draining.
    """
    rt, flow, lock = engine.runtime, engine.flow, engine.signals.lock
    with lock:
        if engine.closed:
            return
        engine.closed = True  # pushes after this point raise PlaneClosedError
        engine.signals.wake(callers=True, ingestion=True, delivery=True)
        loss = Loss()
        loss.add(rt.errors.untold_loss())  # the acked units of threads never told
        rt.errors.closing_errors = []  # failures from here on, on any thread, are counted below
    try:
        engine.stop()
    except OperatorError as stuck:
        with lock:
            # failed before the stuck worker was found; what is in flight is counted lost here
            loss.add_all(rt.errors.take_unreported_locked())
            loss.cause = loss.cause or stuck
            loss.add_queue(flow, inflight=True, own=rt.running_own)
    deadline = time.perf_counter() + engine.timeout
    interrupt: BaseException | None = None  # an interrupt the operator raised here
    ordered = rt.inline_ordered(engine.timeout)
    try:
        with lock:
            if not ordered and rt.errors.closing_errors is not None:
                loss.add_all(rt.errors.take_unreported_locked())
                loss.cause = loss.cause or OperatorError("runtime", TimeoutError(
                    f"an inline ingestion on another thread did not finish within "
                    f"{engine.timeout}s"))
                loss.add_queue(flow, inflight=True, own=rt.running_own)
        while True:
            with lock:
                own = engine.holds.held_by(threading.get_ident())
                while flow.pending and rt.paused + rt.writes_held > own:
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:
                        break
                    engine.signals.callers.wait(min(remaining, 0.5))
                units = rt.take_ingestion_locked(
                    force=True, ignore_holds=rt.paused + rt.writes_held <= own)
                if units is None:
                    if flow.pending:  # held by another thread past the timeout
                        loss.cause = loss.cause or OperatorError("runtime", TimeoutError(
                            f"the operators stayed held (paused(), frozen() or a save on "
                            f"another thread) past {engine.timeout}s"))
                        loss.add_queue(flow, inflight=False)
                    break
            err = rt.run_ingestion(units, latch=False)
            loss.add(err)
            if err is not None and not isinstance(err.__cause__, Exception):
                interrupt = err.__cause__  # the caller asked to stop: the rest is lost
                with lock:
                    loss.add_queue(flow, inflight=False)
                break
    finally:
        if ordered:
            rt.end_inline_ordered()
    with lock:
        rt.errors.error = None  # counted above (``loss.cause``) or here (``closing_errors``)
        loss.add_all(rt.errors.take_unreported_locked())
    cause = loss.cause
    if loss.units:
        lost = DataLossError(
            f"close(): {loss.units} rollout units ({loss.rows} rows) acknowledged by push "
            f"were not stored: {cause}", lost_units=loss.units, lost_rows=loss.rows)
        if interrupt is not None:
            interrupt.add_note(f"conduit: {lost}")
            raise interrupt
        raise lost from cause
    if interrupt is not None:  # pragma: no cover - an interrupted invocation lost units
        raise interrupt
    if cause is not None and not isinstance(cause, OperatorError):  # pragma: no cover
        raise cause
