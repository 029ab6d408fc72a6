"""On-policy iteration gating of the sharded plane: which policy version the plane takes, how
many of the iteration's rows are pushed and stored, and which learner ranks have consumed it.

Plain state guarded by the front's condition variable; every method is called with it held.
A push is admitted (its rows counted against the iteration) before it is queued for
ingestion, so an overlapped ingestion thread never waits on the gate; the iteration's
mini-batches start once its rows are all stored (:attr:`IterationGate.ready`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from conduit.errors import BackpressureTimeout, CapacityError, StaleRolloutError


class IterationGate:
    """One on-policy iteration at a time: ``capacity`` rows in, then ``num_learners`` ranks
    consume them, then the next policy version's rows are admitted.

    Args:
        capacity: Rows per iteration (N).
        num_learners: Ranks that must each consume the iteration.
        cond: The front's condition variable (held by every caller).
        check_open: Raises :class:`PlaneClosedError` once the plane is closed.
    """

    def __init__(self, *, capacity: int, num_learners: int, cond: threading.Condition,
                 check_open: Callable[[], None]) -> None:
        self.capacity, self.num_learners = capacity, num_learners
        self._cond, self._check_open = cond, check_open
        self.iteration = 0
        self.pushed = 0  # rows admitted to the iteration (queued for ingestion or stored)
        self.rows = 0  # rows stored on the shards
        self.losses = 0  # heals that lost stored rows (an epoch begun before one restarts)
        self._done: set[int] = set()

    @property
    def ready(self) -> bool:
        """All of the current iteration's rows are stored."""
        return self.rows >= self.capacity

    def admit(self, rows: int, version: int | None, deadline: float,
              clear: Callable[[], None] | None = None) -> None:
        """Wait until a rollout of ``rows`` rows from policy ``version`` may join the
        iteration, then count them as pushed. With ``clear``, a consumed iteration whose clear
        was cut short (:attr:`clearing`) is cleared here first, and again whenever the wait
        is woken by a clear that failed, so a newer ``version`` does not wait on a clear no
        one finishes.

        Raises:
            StaleRolloutError: ``version`` is older than the current iteration.
            BackpressureTimeout: A newer ``version`` waited past ``deadline``.
            CapacityError: The rows do not fit the iteration.
            PlaneClosedError: The plane closed while waiting (from ``check_open``).
            Exception: What ``clear`` raised (nothing was admitted).
        """
        if clear is not None:
            self.finish(clear)
        if version is not None and version < self.iteration:
            raise StaleRolloutError(f"policy_version {version} is older than the plane's "
                                    f"{self.iteration}")
        while version is not None and version > self.iteration:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BackpressureTimeout(f"policy_version {version} waited for iteration "
                                          f"{self.iteration} to be consumed")
            self._cond.wait(left)
            self._check_open()
            if clear is not None:
                self.finish(clear)
        if self.pushed + rows > self.capacity:
            raise CapacityError(f"{rows} rows exceed the iteration's {self.capacity} (it holds "
                                f"{self.pushed})", needed=rows,
                                available=self.capacity - self.pushed)
        self.pushed += rows

    def released(self, rows: int) -> None:
        """Admitted rows that will not be stored (their ingestion failed)."""
        self.pushed -= rows
        self._cond.notify_all()

    def check_store(self, rows: int) -> None:
        """Raise unless ``rows`` more stored rows fit the iteration (a guard: an ingestion
        invocation's outputs are stored only once they hold exactly its units' rows).

        Raises:
            CapacityError: They do not fit.
        """
        if self.rows + rows > self.capacity:
            raise CapacityError(f"ingestion wrote {self.rows + rows} rows into on-policy "
                                f"iteration {self.iteration}, which holds {self.capacity}",
                                needed=rows, available=self.capacity - self.rows)

    def stored(self, rows: int) -> None:
        """``rows`` rows of the current iteration were stored."""
        self.rows += rows
        self._cond.notify_all()

    def lost(self, rows: int) -> None:
        """``rows`` stored rows were lost with a shard: the iteration takes as many again."""
        self.rows -= rows
        self.pushed -= rows
        self.losses += 1
        self._cond.notify_all()

    @property
    def clearing(self) -> bool:
        """Every rank consumed the iteration but clearing the shards did not finish (it was
        interrupted or failed); :meth:`finish` completes it."""
        return len(self._done) >= self.num_learners

    def consumed(self, rank: int, iteration: int, clear: Callable[[], None]) -> None:
        """``rank`` pulled its last share of ``iteration``; once every rank has, ``clear``
        empties the shards and the next iteration opens. When ``clear`` raises, the
        iteration stays consumed (:attr:`clearing`) and :meth:`finish` clears it again."""
        if iteration != self.iteration:
            return
        self._done.add(rank)
        if len(self._done) < self.num_learners:
            return
        self.finish(clear)

    def finish(self, clear: Callable[[], None]) -> None:
        """Clear the consumed iteration (``clear`` is safe to run again after it was cut
        short) and open the next one; nothing while the iteration is still being read. When
        ``clear`` raises, the waiters are woken (a push waiting in :meth:`admit` with its own
        ``clear`` finishes it) and the error goes on."""
        if not self.clearing:
            return
        try:
            clear()
        except BaseException:
            self._cond.notify_all()
            raise
        self.iteration += 1
        self.pushed, self.rows, self._done = 0, 0, set()
        self._cond.notify_all()
