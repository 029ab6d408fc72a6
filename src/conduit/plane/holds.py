"""Holding the operators: blocks inside which no invocation of a kind runs.

A hold raises one of the runtime's counters (``paused`` or ``writes_held``), which stops
invocations of that kind from starting, then waits for those already running to end. Workers
stay alive and idle meanwhile, so a hold costs no thread start; the engine's ``paused()``
stops the workers as well.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Literal

from conduit.errors import OperatorError
from conduit.plane.flows import Signals
from conduit.plane.runtime import OperatorRuntime


class OperatorHolds:
    """The holds taken on a plane's operators, and by which threads.

    Args:
        runtime: The operator runtime whose counters the holds raise.
        signals: The plane's lock and conditions.
        timeout: Seconds a hold waits for running invocations to end.
    """

    def __init__(self, *, runtime: OperatorRuntime, signals: Signals, timeout: float) -> None:
        self.runtime = runtime
        self.signals = signals
        self.timeout = timeout
        self._holders: list[int] = []  # the threads in a hold block, one entry per hold

    def held_by(self, ident: int) -> int:
        """How many holds the thread ``ident`` is inside; call under the plane's lock."""
        return self._holders.count(ident)

    @contextlib.contextmanager
    def hold(self, counter: Literal["paused", "writes_held"], *,
             until_idle: Literal["busy", "ingesting"]) -> Iterator[None]:
        """Raise the runtime's ``counter`` (which stops invocations from starting) for the
        block, once its ``until_idle`` count of running invocations is zero.

        Raises:
            OperatorError: (``operator="runtime"``, a ``TimeoutError`` as its cause) An
                invocation was still running after the plane's timeout (an operator stuck on a
                worker or on another caller's thread); the hold is given back, so the plane
                stays usable once the invocation returns. Not latched. An interrupt during
                the wait gives the hold back too.
        """
        rt, me = self.runtime, threading.get_ident()
        deadline = time.perf_counter() + self.timeout
        with self.signals.lock:
            setattr(rt, counter, getattr(rt, counter) + 1)
            self._holders.append(me)
            try:
                while getattr(rt, until_idle):
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:
                        stuck = ("an ingestion" if rt.ingesting
                                 else "a delivery" if rt.busy > rt.ingesting else "an")
                        late = TimeoutError(
                            f"{stuck} operator invocation was still running after the "
                            f"plane's timeout ({self.timeout}s), so the operators could not "
                            f"be held (for a save, state_dict(), paused() or a migration); "
                            f"nothing was changed: retry once the operator returns")
                        raise OperatorError("runtime", late) from late
                    self.signals.callers.wait(min(remaining, 0.05))
            except BaseException:  # the timeout, or an interrupt: the hold is given back
                self._release_locked(counter, me)
                raise
        try:
            yield
        finally:
            with self.signals.lock:
                self._release_locked(counter, me)

    def _release_locked(self, counter: str, me: int) -> None:
        rt = self.runtime
        setattr(rt, counter, getattr(rt, counter) - 1)
        self._holders.remove(me)
        self.signals.wake(callers=True, ingestion=True, delivery=True)
