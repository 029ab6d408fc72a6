"""Whether the sharded plane is open, the calls in flight on it, and the order its ``close()``
ends things in (:class:`~conduit.distributed.RayExperienceDataPlane`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from conduit.distributed._ray import connection_id, release
from conduit.errors import PlaneClosedError

if TYPE_CHECKING:
    from conduit.distributed.cluster import ShardSet
    from conduit.distributed.operators import FrontIngestion


class PlaneLifecycle:
    """The sharded plane's life against the Ray it uses: calls are refused once it closed or
    that Ray is gone, the pushes and pulls in flight are counted, and ``close()`` ends the
    ingestion, then the shards, then (once the calls in flight ended) the local Ray the plane
    started.

    Args:
        ray: The ``ray`` module (connected).
        started: Whether the plane started that Ray
            (:func:`~conduit.distributed._ray.connect`); :meth:`close` then releases it.
        cond: The front's condition (over its re-entrant lock).
        timeout: Seconds :meth:`close` waits for the calls in flight.
    """

    def __init__(self, *, ray: Any, started: bool, cond: threading.Condition,
                 timeout: float) -> None:
        self._ray, self._started, self._cond, self._timeout = ray, started, cond, timeout
        self._conn = connection_id(ray)
        self._closed = False
        self._closing = threading.Lock()  # close(): only one call ends the plane
        # pushes and pulls in progress: some wait (an ObjectRef, a draw's rows) or put rows
        # outside the front's lock, so close() waits for them before it shuts down a Ray it
        # started
        self._pushing = 0
        self._pushes = threading.Condition(threading.Lock())
        self._mine = threading.local()  # this thread's calls among them (a close() inside an
        # operator that a pull runs does not wait for that pull)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def check_open(self) -> None:
        """Refuse a call on a closed plane, or on one whose Ray is gone.

        Raises:
            PlaneClosedError: The plane is closed, or its Ray was shut down.
        """
        if self._closed:
            raise PlaneClosedError("the sharded plane is closed")
        if connection_id(self._ray) != self._conn:
            # a call would start a new local Ray (or use another): the plane's Ray is gone
            raise PlaneClosedError("the sharded plane's Ray was shut down; build a new plane")

    def release_started(self) -> None:
        """Release the Ray the plane started, if it did (its construction failed)."""
        if self._started:
            release(self._ray, self._conn)

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """A push or pull in progress: :meth:`close` waits for it before it shuts down a Ray
        the plane started."""
        mine = self._mine
        with self._pushes:
            self._pushing += 1
        mine.calls = getattr(mine, "calls", 0) + 1
        try:
            yield
        finally:
            mine.calls -= 1
            with self._pushes:
                self._pushing -= 1
                self._pushes.notify_all()

    def close(self, ingestion: FrontIngestion, shards: ShardSet) -> None:
        """Refuse new calls, close ``ingestion`` (storing every queued unit), then end
        ``shards`` and release the local Ray the plane started. Idempotent.

        Raises:
            DataLossError: As :meth:`FrontIngestion.close
                <conduit.distributed.operators.FrontIngestion.close>` raises it; the plane is
                closed all the same.
            ConfigError: Called from inside the ingestion operator; nothing changes.
        """
        # Not under the front's lock, which a call holds while it waits on a shard: close
        # would wait out that call's timeout. Ending the shards ends such a call, with
        # PlaneClosedError (and ShardSet re-creates no shard once they were ended).
        with self._closing:
            if self._closed:
                return
            ingestion.refuse_inside("close")
            self._closed = True
        self._wake()
        try:
            ingestion.close()
        finally:
            shards.kill_all()
            with self._cond:  # the call in flight has ended: waiters see the plane closed
                self._cond.notify_all()
            if self._started:
                # pushes and pulls still running end with PlaneClosedError once they see the
                # shards ended (an ObjectRef's wait looks every half second), or a pull hands
                # out the batch it formed; Ray must outlive them
                with self._pushes:
                    own = getattr(self._mine, "calls", 0)
                    self._pushes.wait_for(lambda: self._pushing <= own, timeout=self._timeout)
                release(self._ray, self._conn)  # the last plane using it shuts it down

    def _wake(self) -> None:
        """Wake the calls waiting on the front's condition, unless a call holds its lock (it
        is woken after the shards were ended)."""
        if self._cond.acquire(blocking=False):
            try:
                self._cond.notify_all()
            finally:
                self._cond.release()
