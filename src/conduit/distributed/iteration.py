"""On-policy iteration gating of the sharded plane: which policy version the plane takes, how
many of the iteration's rows are in, and which learner ranks have consumed it.

Plain state guarded by the front's condition variable; every method is called with it held.
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
        self.rows = 0
        self._done: set[int] = set()

    @property
    def ready(self) -> bool:
        """All of the current iteration's rows are in."""
        return self.rows >= self.capacity

    def admit(self, rows: int, version: int | None, deadline: float) -> None:
        """Wait until a rollout of ``rows`` rows from policy ``version`` may be stored.

        Raises:
            StaleRolloutError: ``version`` is older than the current iteration.
            BackpressureTimeout: A newer ``version`` waited past ``deadline``.
            CapacityError: The rows do not fit the iteration.
            PlaneClosedError: The plane closed while waiting (from ``check_open``).
        """
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
        if self.rows + rows > self.capacity:
            raise CapacityError(f"{rows} rows exceed the iteration's {self.capacity} (it holds "
                                f"{self.rows})", needed=rows,
                                available=self.capacity - self.rows)

    def stored(self, rows: int) -> None:
        """``rows`` rows of the current iteration were stored (negative: lost)."""
        self.rows += rows
        self._cond.notify_all()

    def consumed(self, rank: int, iteration: int, clear: Callable[[], None]) -> None:
        """``rank`` pulled its last share of ``iteration``; once every rank has, ``clear``
        empties the shards and the next iteration opens."""
        if iteration != self.iteration:
            return
        self._done.add(rank)
        if len(self._done) < self.num_learners:
            return
        clear()
        self.iteration += 1
        self.rows, self._done = 0, set()
        self._cond.notify_all()

