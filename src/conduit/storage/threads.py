"""Thread control for the data path.

The data path sets its own torch intra-op thread count (one by default) instead of inheriting
the process's: a thread pool competing with the learner for cores can slow a gather by orders
of magnitude (``docs/design.md §7``). The setting applies to the calling OS thread, so a worker
can run with one thread while the learner keeps its own. A buffer built with more threads runs
its large gathers on them only where and while that measures faster (:class:`GatherWorkers`).
"""

from __future__ import annotations

import os
import queue
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence

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
    """A gather worker's body: run jobs until the ``None`` sentinel.

    The worker lets go of each job (and of the tensors it holds) before it reports back, so
    the caller drops their last references and the worker never frees a tensor: freeing one
    lets go of the GIL inside torch's C++ code, and a daemon thread that takes the GIL back
    while the interpreter shuts down ends there, which aborts the process (``terminate called
    without an active exception``). That would happen when the pool is stopped during
    shutdown, a worker's job being the last holder of a batch or of the columns.
    """
    torch.set_num_threads(1)
    while (job := todo.get()) is not None:
        try:
            job()
            result: BaseException | None = None
        except BaseException as exc:  # handed to the caller, which re-raises it
            result = exc
        job = None
        done.put(result)
        result = None


def _stop(todos: list[queue.SimpleQueue]) -> None:
    for todo in todos:
        todo.put(None)


#: A large gather on the caller's thread alone, with one torch thread.
ONE = "one"
#: Split over row ranges on the pool's threads, the caller running the first range.
SPLIT = "split"
#: Whole on the caller's thread with ``threads`` torch intra-op threads (torch's own pool).
INTRA_OP = "intra-op"
#: Every way :class:`GatherWorkers` can run a large gather, in trial order.
GATHER_MODES = (ONE, SPLIT, INTRA_OP)


def pick_gather_mode(seconds_per_byte: Mapping[str, Sequence[float]], *,
                     gain: float) -> str:
    """The mode a gather should run in, from measured times per byte of each mode.

    Each mode is judged by its median; a mode with more threads than one is chosen only when
    its median is under ``gain`` times :data:`ONE`'s (its threads must pay for themselves),
    and then the fastest such mode wins. Modes without samples are not candidates.

    Raises:
        ValueError: :data:`ONE` has no samples.
    """
    if not seconds_per_byte.get(ONE):
        raise ValueError("seconds_per_byte: the one-thread mode needs samples to compare with")
    medians = {m: statistics.median(t) for m, t in seconds_per_byte.items() if t}
    bound = gain * medians[ONE]
    faster = {m: v for m, v in medians.items() if m != ONE and v < bound}
    return min(faster, key=faster.__getitem__) if faster else ONE


class GatherWorkers:
    """Runs a buffer's large gathers on more threads than the caller's, where and while that
    measures faster: the caller waits for the gather anyway, so a core it leaves idle can
    take part.

    A gather of at least ``min_bytes`` runs in one of :data:`GATHER_MODES`: on the caller's
    thread alone, split over row ranges on a small pool this object owns (the caller running
    the first range), or whole with ``threads`` torch intra-op threads. Which one pays depends
    on the machine and on its load now: free cores, memory bandwidth per core, and the cost
    of waking a thread (tens of microseconds for the pool; torch's threads spin briefly
    between parallel regions, so they wake fast on an idle core and are slow by orders of
    magnitude when another busy thread holds it). So the choice is measured and watched:

    - **Trials.** The gathers cycle through the modes until each has ``trials`` samples; then
      :func:`pick_gather_mode` chooses from their medians (time per byte). A mode two of
      whose samples took over ``fallback`` times the one-thread median leaves the trials at
      once.
    - **Watch.** While a multi-thread mode is chosen, two gathers in a row that take over
      ``fallback`` times the one-thread median (of the one-thread gathers in use below, or of
      the trials before there is one: the cores are busy now) send
      every later gather back to the caller's thread alone. One slow gather (a page fault, a
      preemption) is not enough.
    - **Keep only what pays in use.** Trials that run back to back can favour a mode that
      loses once the caller computes between gathers (a pool thread that has gone to sleep
      takes time to wake). So every ``probe``-th large gather in a multi-thread mode (every
      other one until there are three) runs on the caller's thread alone, and once the
      chosen mode has ``window`` gathers in use, their median must stay under the median of
      those one-thread gathers: otherwise the mode is dropped, and the next multi-thread mode
      the trials did not find slower than one thread is judged the same way (one thread when
      none is left), until the next recheck.
    - **Recheck.** After ``recheck`` large gathers in the chosen mode (or on the caller's
      thread after a fallback) the trials run again, so a machine whose load changed gets
      another choice.

    Smaller gathers always run on the caller's thread alone, and so does every gather in a
    process forked from the one that made this object: the fork has none of the pool's
    threads, and torch's OpenMP threads hang in a child whose parent had used them. One caller
    at a time (a buffer gathers under its lock). The pool's threads end when this object is
    collected.

    Args:
        threads: Threads a multi-thread gather runs on, the caller's included (at least 2).
        min_bytes: Smallest gather that may run on more threads.
        trials: Measured gathers per mode before a choice.
        gain: How much faster (median time per byte) a multi-thread mode must be than one
            thread to be chosen.
        fallback: How many times the one-thread time per byte a gather in a multi-thread
            mode may take before the caller's thread takes over.
        recheck: Large gathers after which the trials run again.
        modes: The modes to choose from (:data:`ONE` always included).
        window: Gathers of the chosen mode in use whose median is weighed against one
            thread's.
        probe: Every how many large gathers in a multi-thread mode one runs on the caller's
            thread alone, for that comparison.

    Raises:
        ValueError: An argument is out of range or names an unknown mode.
    """

    def __init__(self, *, threads: int, min_bytes: int = 1 << 20, trials: int = 8,
                 gain: float = 0.9, fallback: float = 2.0, recheck: int = 1024,
                 modes: Sequence[str] = GATHER_MODES, window: int = 8,
                 probe: int = 16) -> None:
        if threads < 2:
            raise ValueError(f"threads: a multi-thread gather needs at least 2, got {threads}")
        unknown = set(modes) - set(GATHER_MODES)
        if unknown:
            raise ValueError(f"modes: unknown {sorted(unknown)}; choose from {GATHER_MODES}")
        if (trials < 1 or recheck < 1 or window < 1 or probe < 2 or not gain > 0
                or not fallback > 1):
            raise ValueError(f"trials, recheck and window must be >= 1, probe >= 2, gain > 0 "
                             f"and fallback > 1, got trials={trials}, recheck={recheck}, "
                             f"window={window}, probe={probe}, gain={gain}, "
                             f"fallback={fallback}")
        self.threads, self.min_bytes, self.trials, self.gain = threads, min_bytes, trials, gain
        self.fallback, self.recheck, self.window, self.probe = fallback, recheck, window, probe
        self._pid = os.getpid()
        self.modes = tuple(m for m in GATHER_MODES if m == ONE or m in modes)
        self._todo: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(threads - 1)]
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        for k, todo in enumerate(self._todo):
            threading.Thread(target=_work, args=(todo, self._done), daemon=True,
                             name=f"conduit-gather-{k}").start()
        # Not at interpreter exit: the workers then stay blocked in their queues until the
        # process ends, instead of ending their threads while it tears torch down.
        weakref.finalize(self, _stop, self._todo).atexit = False
        self._times: dict[str, list[float]] = {m: [] for m in self.modes}
        self._dropped: set[str] = set()
        self._slow: dict[str, int] = {m: 0 for m in self.modes}  # strikes per mode
        self._baseline = 0.0  # the trials' one-thread median, seconds per byte
        self._since = 0  # large gathers since the last choice
        #: Times per byte of gathers in use: the chosen mode's, and one thread's probes.
        self._recent: dict[str, deque[float]] = {m: deque(maxlen=window) for m in self.modes}
        #: The mode large gathers run in; None while the trials run.
        self.mode: str | None = None

    @property
    def split(self) -> bool | None:
        """Whether large gathers run on more threads than the caller's (None: trials)."""
        return None if self.mode is None else self.mode != ONE

    def alone(self, nbytes: int) -> bool:
        """Whether a gather of ``nbytes`` runs on the caller's thread alone whatever the mode:
        it is under ``min_bytes``, or this is a process forked from the one that made this
        object."""
        return nbytes < self.min_bytes or os.getpid() != self._pid

    def run(self, jobs: Sequence[Callable[[], None]]) -> None:
        """Run ``jobs[0]`` here and the others on the pool; return when all are done.

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
            got = None
        if err is not None:
            try:
                raise err
            finally:  # (no cycle through this frame: the error's tensors go with it)
                err = None

    def _timed(self, mode: str, nbytes: int, whole: Callable[[], None],
               parts: Sequence[Callable[[], None]], one: Callable[[], None]) -> float:
        """Run the gather in ``mode``; its time per byte."""
        t0 = time.perf_counter()
        if mode == SPLIT:
            self.run(parts)
        elif mode == INTRA_OP:
            with data_path_threads(self.threads):
                whole()
        else:
            one()
        return (time.perf_counter() - t0) / max(nbytes, 1)

    def gather(self, nbytes: int, whole: Callable[[], None],
               parts: Sequence[Callable[[], None]], *,
               one: Callable[[], None] | None = None) -> None:
        """Run a gather of ``nbytes``: ``whole`` (all rows, on torch's intra-op threads), or
        ``parts`` (one row range each, at most :attr:`threads`) on the pool, or ``one`` (all
        rows on the caller's thread alone; default ``whole``), as measured (see the class).
        ``one`` may take another route than ``whole`` (one that torch's threads do not
        speed up), so that the trials compare the multi-thread modes with the gather a
        one-thread buffer runs."""
        mode = self.mode
        one = whole if one is None else one
        if self.alone(nbytes):
            one()
            return
        if mode is None:
            self._trial(nbytes, whole, parts, one)
            return
        self._since += 1
        if self._since > self.recheck:
            self._restart()
            self._trial(nbytes, whole, parts, one)
            return
        if mode == ONE:
            one()
            return
        ones = self._recent[ONE]
        if self._since % self.probe == 0 or (len(ones) < 3 and self._since % 2 == 0):
            # one thread now and then (every other gather until there are three): what the
            # mode must beat in use
            ones.append(self._timed(ONE, nbytes, whole, parts, one))
            return
        spent = self._timed(mode, nbytes, whole, parts, one)
        if spent > self.fallback * (statistics.median(ones) if ones else self._baseline):
            self._slow[mode] += 1
            if self._slow[mode] >= 2:  # the cores are busy: back to one thread until recheck
                self.mode, self._since = ONE, 0
            return
        self._slow[mode] = 0
        recent = self._recent[mode]
        recent.append(spent)
        if (len(recent) == self.window and len(ones) >= 3
                and statistics.median(recent) >= statistics.median(ones)):
            self._drop_in_use(mode)

    def _drop_in_use(self, mode: str) -> None:
        """``mode`` did not pay in use: the next multi-thread mode that was not slower than
        one thread in the trials is judged in use in turn; one thread when none is left."""
        self._dropped.add(mode)
        self.mode = pick_gather_mode({m: t for m, t in self._times.items()
                                      if m not in self._dropped}, gain=1.0)
        self._recent[self.mode].clear()
        self._slow = {m: 0 for m in self.modes}

    def _restart(self) -> None:
        self._times = {m: [] for m in self.modes}
        for recent in self._recent.values():
            recent.clear()
        self._slow = {m: 0 for m in self.modes}
        self._dropped.clear()
        self.mode = None

    def _trial(self, nbytes: int, whole: Callable[[], None],
               parts: Sequence[Callable[[], None]], one: Callable[[], None]) -> None:
        times = self._times
        live = [m for m in self.modes if m not in self._dropped]
        mode = min(live, key=lambda m: len(times[m]))  # ties: trial order, one thread first
        spent = self._timed(mode, nbytes, whole, parts, one)
        times[mode].append(spent)
        if mode != ONE and spent > self.fallback * statistics.median(times[ONE]):
            self._slow[mode] += 1
            if self._slow[mode] >= 2:
                self._dropped.add(mode)
                live.remove(mode)
        if all(len(times[m]) >= self.trials for m in live):
            self.mode = pick_gather_mode({m: times[m] for m in live}, gain=self.gain)
            self._baseline = statistics.median(times[ONE])
            self._slow = {m: 0 for m in self.modes}
            self._since = 0
            for recent in self._recent.values():
                recent.clear()
