"""The gate that holds a prefetched GRPO mini-batch's delivery until the learner updates."""

from __future__ import annotations

import threading

from conduit.errors import EmptyBufferError
from conduit.plane import ExperienceDataPlane
from conduit.spec import Batch


class PrefetchGate:
    """Lets a delivery on the plane's worker start once the learner begins an update (or waits
    in a pull that finds nothing staged), at the latest after ``seconds``.

    Args:
        seconds: Most seconds a delivery waits; 0 never waits.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)
        self._permit = threading.Event()  # set: the next prefetched delivery may start
        self._pulling = threading.local()  # set on the learner's thread inside pull()
        self._closing = False

    @property
    def in_pull(self) -> bool:
        """Whether the calling thread is the learner's, inside :meth:`pull`."""
        return getattr(self._pulling, "active", False)

    def pull(self, plane: ExperienceDataPlane) -> Batch:
        """The plane's next mini-batch; a delivery the learner waits for is let go at once.

        Raises:
            EmptyBufferError, OperatorError, PlaneClosedError: As
                :meth:`ExperienceDataPlane.pull`.
        """
        if not self.seconds:
            return plane.pull()
        self._pulling.active = True  # a delivery this thread runs itself never waits
        try:
            try:
                return plane.pull(timeout=0)
            except EmptyBufferError:
                self._permit.set()  # the learner waits: the next delivery costs it nothing
                return plane.pull()
        finally:
            self._pulling.active = False

    def open(self) -> None:
        """Let the next delivery start (the learner began its update)."""
        self._permit.set()

    def rearm(self) -> None:
        """Hold the next delivery again (an iteration begins), unless closing."""
        if not self._closing:  # generation is over and the learner is not updating
            self._permit.clear()

    def wait(self) -> None:
        """Wait, on the worker, for permission to deliver, and take it (nothing to wait for
        without a gate, or on the learner's thread inside :meth:`pull`)."""
        if not self.seconds or self.in_pull:
            return
        self._permit.wait(self.seconds)
        if not self._closing:
            self._permit.clear()

    def close(self) -> None:
        """Let every delivery go from now on."""
        self._closing = True
        self._permit.set()


__all__ = ["PrefetchGate"]
