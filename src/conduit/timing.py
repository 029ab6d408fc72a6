"""Built-in timing: every operator invocation and every rollout/update window is recorded.

This is the profile the scheduling layer's cost model reads. Records are plain data
(:class:`TimingRecord`), kept in bounded per-name windows so a long run does not grow memory.

Standard names used by the plane:

* ``"rollout"`` / ``"update"``: the caller's actor-rollout and learner-update windows
  (``units`` = 1);
* ``"ingestion"`` / ``"delivery"``: one operator invocation (``units`` = the granularity it
  processed, in rollout units or training batches);
* ``"sync_ing"`` / ``"sync_del"``: time a caller spent handing work to, or waiting on, a
  background worker (the synchronization cost of overlap);
* ``"push"`` / ``"pull"``: wall time the caller spent inside ``push`` / ``pull``: the exposed
  part of the experience path.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import NamedTuple


class TimingRecord(NamedTuple):
    """One timed event (immutable; a named tuple, since every ``push`` and ``pull`` makes
    one or two on the caller's thread).

    Attributes:
        name: What was timed (see the module docstring for the standard names).
        seconds: Wall-clock duration.
        units: How much work it covered (granularity g for operators, 1 otherwise).
        start: ``time.perf_counter()`` at the start.
    """

    name: str
    seconds: float
    units: float = 1.0
    start: float = 0.0


record_from: Callable[[tuple[str, float, float, float]], TimingRecord] = functools.partial(
    tuple.__new__, TimingRecord)
"""``record_from((name, seconds, units, start))`` is ``TimingRecord(name, seconds, units,
start)``, without the Python frame of a named tuple's constructor (for the records a
synchronous ``pull`` makes)."""


class _Series:
    """One name's records: the window, and the total and count of every record ever."""

    __slots__ = ("count", "records", "total")

    def __init__(self, window: int) -> None:
        self.records: deque[TimingRecord] = deque(maxlen=window)
        self.total = 0.0
        self.count = 0


class Timings:
    """Thread-safe recorder of :class:`TimingRecord`s, bounded per name.

    Args:
        window: Records kept per name (oldest dropped first).
    """

    def __init__(self, *, window: int = 4096) -> None:
        if window < 1:
            raise ValueError("window: must be >= 1")
        self._window = window
        self._lock = threading.Lock()
        self._series: dict[str, _Series] = {}

    def record(self, name: str, seconds: float, *, units: float = 1.0,
               start: float | None = None) -> None:
        """Add one record."""
        self.add([TimingRecord(name, float(seconds), float(units),
                               start if start is not None else time.perf_counter() - seconds)])

    def add(self, records: Iterable[TimingRecord]) -> None:
        """Add existing records (for example another recorder's, filtered)."""
        with self._lock:
            for rec in records:
                series = self._series.get(rec.name)
                if series is None:
                    series = self._series[rec.name] = _Series(self._window)
                series.records.append(rec)
                series.total += rec.seconds
                series.count += 1

    @contextmanager
    def time(self, name: str, *, units: float = 1.0) -> Iterator[None]:
        """Context manager that records the wall time of its body under ``name``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, time.perf_counter() - t0, units=units, start=t0)

    def records(self, name: str) -> list[TimingRecord]:
        """The retained records for ``name``, oldest first."""
        with self._lock:
            series = self._series.get(name)
            return [] if series is None else list(series.records)

    def names(self) -> list[str]:
        """Names that have at least one record."""
        with self._lock:
            return sorted(self._series)

    def total(self, name: str) -> float:
        """Sum of all durations ever recorded under ``name`` (not only the window)."""
        with self._lock:
            series = self._series.get(name)
            return 0.0 if series is None else series.total

    def count(self, name: str) -> int:
        """Number of records ever made under ``name``."""
        with self._lock:
            series = self._series.get(name)
            return 0 if series is None else series.count

    def median(self, name: str, *, units: float | None = None) -> float | None:
        """Median duration for ``name`` (optionally only records with these ``units``)."""
        recs = [r.seconds for r in self.records(name) if units is None or r.units == units]
        return statistics.median(recs) if recs else None

    def summary(self) -> dict[str, dict[str, float]]:
        """Per name: count, total, median and mean seconds (JSON-friendly)."""
        out: dict[str, dict[str, float]] = {}
        for name in self.names():
            secs = [r.seconds for r in self.records(name)]
            out[name] = {"count": self.count(name), "total_s": self.total(name),
                         "median_s": statistics.median(secs),
                         "mean_s": sum(secs) / len(secs)}
        return out

    def clear(self) -> None:
        """Forget every record."""
        with self._lock:
            self._series.clear()


def repeat_times(fn: Callable[[], object], *, repeats: int, warmup: int = 1,
                 sync: Callable[[], None] | None = None) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn()``, after ``warmup`` untimed calls.

    Args:
        fn: What to time.
        repeats: Timed calls.
        warmup: Untimed calls first (caches, allocator, lazy initialisation).
        sync: Called before and after each timed call (for example
            ``torch.cuda.synchronize``), so asynchronous work is inside the window.
    """
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t0)
    return times
