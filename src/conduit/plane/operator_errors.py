"""The operator errors of a plane: the first operator error, latched until ``recover()``, and
the losses kept for ``close()`` that no caller was told of.

An invocation a worker runs latches its error: workers stop, and every dependent call raises
it. An invocation the calling thread runs (inline) raises its error to that caller only;
the share of its loss that no caller answers for is kept for ``close()``. The functions here
(:func:`untold_share`, :func:`untold_part`, :func:`raised_to_caller`) are the rules a sharded
plane's front applies to its own ingestion as well.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

from conduit.errors import OperatorError, raised_again
from conduit.plane.flows import Signals, Unit


class _Pushed(Protocol):
    """A queued unit, as :func:`untold_share` reads it (a local or a sharded plane's)."""

    rows: int
    pusher: threading.Thread | None


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


class OperatorErrors:
    """A plane's latched operator error and the losses kept for ``close()``.

    Its state is guarded by the plane's lock (``signals.lock``): :meth:`latch`,
    :meth:`recover` and :meth:`keep_untold` take it themselves (it is re-entrant); methods
    named ``*_locked``, :meth:`raise_if_failed` and :meth:`untold_loss` are called with it
    held, and so are writes to the attributes below.

    Args:
        signals: The plane's lock and conditions; a latch or a recovery wakes every waiter.

    Attributes:
        error: The latched error (None: none is).
        provisional: Whether :attr:`error` only stands in for a stuck invocation's outcome
            (a worker that did not stop): that invocation's own error replaces it.
        units: The latched error's lost units (None: not known, all are counted).
        told: The idents of the threads a dependent call told of the latched error:
            ``close()`` reports the lost units whose pushing thread was never told.
        closing_errors: While ``close()`` runs, every failed worker ingestion invocation (its
            units were acknowledged by their pushes), so that close counts each loss once
            (None: not recording). An inline invocation's error is raised to the caller
            that ran it, which is told of the loss, and is not recorded here.
        untold: The shares of failed inline invocations that no caller was told of: units
            pushed (and acknowledged) on other threads than the one that ran the invocation
            and got its error, and every unit of a failure raised to no caller (a push's
            invocation over units queued before its own); ``close()`` counts them (None once
            it has).
    """

    def __init__(self, signals: Signals) -> None:
        self.signals = signals
        self.error: OperatorError | None = None
        self.provisional = False
        self.units: tuple[Unit, ...] | None = None
        self.told: set[int] = set()
        self.closing_errors: list[OperatorError] | None = None
        self.untold: list[OperatorError] | None = []

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
            if self.error is None or (self.provisional and not provisional):
                self.error, self.provisional = err, provisional
                self.units = None if units is None else tuple(units)
                self.told = set()
            self.signals.wake(callers=True, ingestion=True, delivery=True)

    def raise_if_failed(self) -> None:
        """Raise the latched operator error, if any (call with the lock held); the calling
        thread counts as told of it (see :meth:`untold_loss`)."""
        if self.error is not None:
            self.told.add(threading.get_ident())
            raise raised_again(self.error)

    def untold_loss(self) -> OperatorError | None:
        """The latched error as ``close()`` reports it (call with the lock held): only the
        lost units whose pushing thread no call told of it (a thread told knows its pushes
        may be lost; an actor thread whose units a learner's call was told of does not).
        None when every one was told."""
        return untold_part(self.error, self.units, self.told)

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
            self.provisional = False
            if self.untold is not None:
                self.untold = []
            self.signals.wake(callers=True, ingestion=True, delivery=True)
        return err

    def keep_untold(self, err: OperatorError, units: Sequence[Unit], *, told: bool) -> None:
        """Keep :func:`untold_share` of ``err``, an inline invocation's failure over ``units``
        (``told``: raised to the calling thread), for ``close()``."""
        share = untold_share(err, units, told=told)
        if share is None:
            return
        with self.signals.lock:
            if self.untold is not None:
                self.untold.append(share)

    def take_unreported_locked(self) -> list[OperatorError]:
        """The losses kept for ``close()`` (:attr:`closing_errors`, :attr:`untold`); both stop
        recording (None) from here on."""
        kept = [*(self.closing_errors or ()), *(self.untold or ())]
        self.closing_errors = self.untold = None
        return kept
