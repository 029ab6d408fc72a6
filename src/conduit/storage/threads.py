"""Thread control for the data path.

The data path sets its own torch intra-op thread count (one by default) instead of inheriting
the process's: gathers and copies of a few MB gain nothing from intra-op parallelism, and a
thread pool competing with the learner for cores slows them down (``docs/design.md §7``). The
setting applies to the calling OS thread, so a worker can run with one thread while the learner
keeps its own.
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch


class data_path_threads:  # noqa: N801 - used like a function: ``with data_path_threads(1):``
    """Run the body with ``n`` torch intra-op threads on this OS thread, then restore.

    A plain class rather than a generator-based context manager: it sits on every gather, and
    when the count is already ``n`` (the usual case) entering and leaving cost two attribute
    reads and one ``torch.get_num_threads()``.
    """

    __slots__ = ("_before", "_n")

    def __init__(self, n: int = 1) -> None:
        self._n = n
        self._before = 0

    def __enter__(self) -> None:
        before = torch.get_num_threads()
        self._before = before
        if before != self._n:
            torch.set_num_threads(self._n)

    def __exit__(self, *exc: object) -> None:
        if self._before != self._n:
            torch.set_num_threads(self._before)


def _work(todo: queue.SimpleQueue, done: queue.SimpleQueue) -> None:
    """A gather worker's body: run jobs until the ``None`` sentinel."""
    torch.set_num_threads(1)
    while (job := todo.get()) is not None:
        try:
            job()
        except BaseException as exc:  # handed to the caller, which re-raises it
            done.put(exc)
        else:
            done.put(None)


def _stop(todos: list[queue.SimpleQueue]) -> None:
    for todo in todos:
        todo.put(None)


class GatherWorkers:
    """A small pool of threads, owned by one buffer, that splits a large gather over row ranges
    while its caller waits anyway (the caller runs the first range itself).

    Whether the split pays depends on the machine: cores that are free, and memory bandwidth
    per core against a hand-off of a few tens of microseconds. So the pool measures it: its
    first ``trials`` gathers of at least ``min_bytes`` alternate one thread and the split, and
    it then splits only if the split's median time per byte is under ``gain`` times the single
    thread's. Smaller gathers always run on the caller's thread. Torch's intra-op threads are
    not used: under contention they cost far more than they save (``docs/design.md §7``).

    One caller at a time (a buffer gathers under its lock). The threads end when the pool is
    collected.

    Args:
        threads: Threads a split gather runs on, the caller's included (at least 2).
        min_bytes: Smallest gather that may be split.
        trials: Measured gathers of each kind before the choice.
        gain: How much faster the split must be to be kept.
    """

    def __init__(self, *, threads: int, min_bytes: int = 1 << 20, trials: int = 8,
                 gain: float = 0.9) -> None:
        if threads < 2:
            raise ValueError(f"threads: a split needs at least 2, got {threads}")
        self.threads, self.min_bytes, self.trials, self.gain = threads, min_bytes, trials, gain
        self._todo: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(threads - 1)]
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        for k, todo in enumerate(self._todo):
            threading.Thread(target=_work, args=(todo, self._done), daemon=True,
                             name=f"conduit-gather-{k}").start()
        weakref.finalize(self, _stop, self._todo)
        self._seconds_per_byte: dict[bool, list[float]] = {False: [], True: []}
        #: Whether large gathers are split; None while the trials run.
        self.split: bool | None = None

    def run(self, jobs: Sequence[Callable[[], None]]) -> None:
        """Run ``jobs[0]`` here and the others on the workers; return when all are done.

        Raises:
            BaseException: The first error a job raised (after every job finished).
        """
        if not 0 < len(jobs) <= self.threads:
            raise ValueError(f"jobs: 1 to {self.threads} per run, got {len(jobs)}")
        for todo, job in zip(self._todo, jobs[1:]):
            todo.put(job)
        err: BaseException | None = None
        try:
            jobs[0]()
        except BaseException as exc:
            err = exc
        for _ in jobs[1:]:
            got = self._done.get()
            err = err or got
        if err is not None:
            raise err

    def gather(self, nbytes: int, whole: Callable[[], None],
               parts: Sequence[Callable[[], None]]) -> None:
        """Run a gather of ``nbytes``: ``whole`` on this thread, or ``parts`` (one row range
        each, at most :attr:`threads`) split over the pool, as measured (see the class)."""
        split = self.split
        if nbytes < self.min_bytes or split is False:
            whole()
            return
        if split:
            self.run(parts)
            return
        times = self._seconds_per_byte
        trial = len(times[True]) < len(times[False])
        t0 = time.perf_counter()
        if trial:
            self.run(parts)
        else:
            whole()
        times[trial].append((time.perf_counter() - t0) / nbytes)
        if len(times[True]) >= self.trials:
            self.split = (statistics.median(times[True])
                          < self.gain * statistics.median(times[False]))
