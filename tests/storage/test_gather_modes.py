"""How a buffer with more than one data-path thread runs its large gathers: the trials that
choose between one thread, a split over the buffer's pool and torch's intra-op threads, the
watch that falls back to one thread when the cores get busy, and the periodic recheck."""

import gc
import os
import threading
import time
import weakref

import pytest
import torch

from conduit.spec import ExperienceSpec
from conduit.storage import Placement, PrioritizedSampler, data_path_threads, make_store
from conduit.storage import threads as threads_module
from conduit.storage.threads import (
    GATHER_MODES,
    INTRA_OP,
    ONE,
    SPLIT,
    GatherWorkers,
    pick_gather_mode,
)
from tests.conftest import one_and_two_threads


class Clock:
    """A stand-in for ``time.perf_counter`` in ``conduit.storage.threads``: it moves only
    when a fake gather says it took time, so no test here depends on the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(threads_module, "time", fake)
    return fake


class Gather:
    """A fake gather whose duration on ``clock`` depends on how it runs: ``whole`` on one
    torch thread, ``whole`` on several (intra-op), or as ``parts`` on the pool (the caller's
    part takes the time; the pool's part waits for nothing). Records each call."""

    def __init__(self, clock: Clock, *, one: float = 1.0, intra: float = 1.0,
                 split: float = 1.0) -> None:
        self.clock = clock
        self.cost = {ONE: one, INTRA_OP: intra, SPLIT: split}
        self.calls: list[str] = []
        self.threads_seen: list[int] = []

    def whole(self) -> None:
        n = torch.get_num_threads()
        self.threads_seen.append(n)
        mode = INTRA_OP if n > 1 else ONE
        self.calls.append(mode)
        self.clock.now += self.cost[mode]

    def part(self) -> None:
        self.calls.append(SPLIT)
        self.clock.now += self.cost[SPLIT]

    def other_part(self) -> None:
        self.calls.append(SPLIT)

    def run(self, workers: GatherWorkers, times: int = 1) -> None:
        with data_path_threads(1):  # as a buffer calls it
            for _ in range(times):
                workers.gather(100, self.whole, [self.part, self.other_part])


def assert_on_one_thread(g: Gather, workers: GatherWorkers, n: int) -> None:
    """``workers`` chose one thread, and its next ``n`` gathers run there."""
    assert workers.mode == ONE and workers.split is False
    g.calls.clear()
    g.run(workers, n)
    assert g.calls == [ONE] * n


def test_pick_takes_the_fastest_mode_only_when_it_beats_one_thread_by_the_gain():
    assert pick_gather_mode({ONE: [1.0, 1.0], SPLIT: [0.5], INTRA_OP: [0.4]}, gain=0.9) == INTRA_OP
    assert pick_gather_mode({ONE: [1.0], SPLIT: [0.5], INTRA_OP: [0.7]}, gain=0.9) == SPLIT
    assert pick_gather_mode({ONE: [1.0], SPLIT: [0.95], INTRA_OP: [1.2]}, gain=0.9) == ONE
    assert pick_gather_mode({ONE: [1.0], SPLIT: [], INTRA_OP: [0.5]}, gain=0.9) == INTRA_OP
    # medians, not means: one outlier does not decide
    assert pick_gather_mode({ONE: [1.0, 1.0, 1.0], INTRA_OP: [0.5, 0.5, 50.0]},
                            gain=0.9) == INTRA_OP
    with pytest.raises(ValueError, match="one-thread"):
        pick_gather_mode({SPLIT: [0.5]}, gain=0.9)


def test_intra_op_threads_are_kept_where_they_measured_faster_and_used_per_gather(clock):
    g = Gather(clock, one=1.0, split=1.0, intra=0.5)
    workers = GatherWorkers(threads=2, min_bytes=10, trials=2)
    g.run(workers, 6)  # two trials per mode
    assert workers.mode == INTRA_OP and workers.split is True
    g.calls.clear()
    g.threads_seen.clear()
    with data_path_threads(1):
        for _ in range(3):
            workers.gather(100, g.whole, [g.part, g.part])
            assert torch.get_num_threads() == 1  # the caller's count comes back
    # (the second on one thread: what intra-op must beat in use)
    assert g.calls == [INTRA_OP, ONE, INTRA_OP] and g.threads_seen == [2, 1, 2]


def test_every_mode_gets_its_trials_in_turn_before_the_choice(clock):
    g = Gather(clock)
    workers = GatherWorkers(threads=2, min_bytes=10, trials=3)
    g.run(workers, 8)
    assert workers.mode is None  # one trial short
    assert g.calls.count(ONE) == 3 and g.calls.count(INTRA_OP) == 2
    assert g.calls.count(SPLIT) == 6  # two ranges per split gather
    g.run(workers)
    assert workers.mode in GATHER_MODES


def test_restricted_modes_never_run_the_others(clock):
    g = Gather(clock, one=1.0, split=1.0, intra=0.1)  # intra-op would win; it is not allowed
    workers = GatherWorkers(threads=2, min_bytes=10, trials=2, modes=(ONE, SPLIT))
    g.run(workers, 10)
    assert INTRA_OP not in g.calls and workers.mode == ONE
    with pytest.raises(ValueError, match="modes"):
        GatherWorkers(threads=2, modes=(ONE, "turbo"))
    with pytest.raises(ValueError, match="fallback"):
        GatherWorkers(threads=2, fallback=1.0)


def test_a_mode_that_turns_slow_twice_in_a_row_sends_gathers_back_to_one_thread(clock):
    g = Gather(clock, one=1.0, split=2.0, intra=0.0)
    workers = GatherWorkers(threads=2, min_bytes=10, trials=2, fallback=2.0)
    g.run(workers, 6)
    assert workers.mode == INTRA_OP
    g.run(workers, 6)  # three in use on one thread among them: the gathers to compare with
    g.cost[INTRA_OP] = 8.0  # another busy thread holds the second core now
    g.run(workers)
    assert workers.mode == INTRA_OP  # one slow gather is not enough
    g.cost[INTRA_OP] = 0.0
    g.run(workers)
    g.cost[INTRA_OP] = 8.0
    g.run(workers)
    assert workers.mode == INTRA_OP  # the strikes must come in a row
    g.run(workers)
    assert_on_one_thread(g, workers, 3)


def test_a_mode_slow_twice_in_its_trials_leaves_them_early(clock):
    g = Gather(clock, one=1.0, split=4.0, intra=0.0)
    workers = GatherWorkers(threads=2, min_bytes=10, trials=6)
    g.run(workers, 6)  # one, split, intra, one, split (second strike), intra
    assert g.calls.count(SPLIT) == 4  # two split gathers of two ranges, then no more
    g.run(workers, 10)
    assert g.calls.count(SPLIT) == 4
    assert workers.mode == INTRA_OP


def test_the_trials_run_again_after_recheck_gathers(clock):
    g = Gather(clock, one=1.0, split=1.0, intra=0.0)
    workers = GatherWorkers(threads=2, min_bytes=10, trials=1, recheck=4)
    g.run(workers, 3)
    assert workers.mode == INTRA_OP
    g.cost = {ONE: 0.2, INTRA_OP: 1.0, SPLIT: 1.0}  # the load changed: one thread wins now
    g.run(workers, 4)  # within the recheck period: still intra-op (1.0 is not twice the
    # trials' one-thread time, 1.0, so no strike)
    assert workers.mode == INTRA_OP
    g.run(workers, 4)  # the fifth gather since the choice starts new trials
    assert workers.mode == ONE


def test_small_gathers_never_leave_the_callers_thread(clock):
    g = Gather(clock)
    workers = GatherWorkers(threads=2, min_bytes=1000, trials=1)
    g.run(workers, 5)  # 100 bytes each
    assert g.calls == [ONE] * 5 and workers.mode is None


def test_a_two_thread_prioritized_buffer_gathers_the_same_rows_in_every_mode(small_spec):
    one, two = one_and_two_threads(small_spec, lambda: PrioritizedSampler(seed=3))
    for mode in GATHER_MODES:
        two._reader.workers = GatherWorkers(threads=2, min_bytes=0, trials=1)
        two._reader.workers.mode = mode  # as if its trials had chosen it
        two._reader.workers._baseline = float("inf")  # never falls back here
        for _ in range(4):
            a, b = one.sample(33), two.sample(33)
            for k in a:
                assert torch.equal(a[k], b[k]), (mode, k)
            new = torch.rand(33) + 0.1
            one.update_priorities(a["_index"], new)
            two.update_priorities(b["_index"], new)
        assert two._reader.workers.mode == mode


def _gather_in_child(workers: GatherWorkers, results) -> None:
    calls = []
    with data_path_threads(1):
        workers.gather(100, lambda: calls.append("whole"), [lambda: calls.append("part")] * 2)
    results.put(calls)


@pytest.mark.parametrize("mode", [SPLIT, INTRA_OP])
def test_a_forked_child_gathers_on_its_own_thread(mode):
    """A fork has none of the pool's threads (a split would wait for them forever) and may
    not use torch's OpenMP threads after its parent did: its gathers run whole, here."""
    import multiprocessing

    workers = GatherWorkers(threads=2, min_bytes=10, trials=1)
    workers.mode, workers._baseline = mode, float("inf")  # as if the trials had chosen it
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=_gather_in_child, args=(workers, results))
    child.start()
    child.join(30)
    try:
        assert child.exitcode == 0, "the child's gather hung or failed"
        assert results.get(timeout=5) == ["whole"]
    finally:
        if child.is_alive():
            child.kill()
    assert os.getpid() == workers._pid  # the parent keeps its mode
    assert workers.mode == mode


def test_a_zero_byte_gather_is_timed_without_dividing_by_zero(clock):
    g = Gather(clock)
    workers = GatherWorkers(threads=2, min_bytes=0, trials=1)
    with data_path_threads(1):
        for _ in range(4):
            workers.gather(0, g.whole, [g.part, g.other_part])
    assert workers.mode in GATHER_MODES


def test_the_one_thread_mode_runs_the_gather_a_one_thread_buffer_runs(clock):
    """``one`` (the caller's route, numpy's take in a column store) runs for the one-thread
    mode and for a gather under ``min_bytes``; ``whole`` only on torch's intra-op threads."""
    g = Gather(clock, one=1.0, split=1.0, intra=0.5)
    ran: list[str] = []

    def one() -> None:
        ran.append("one")
        clock.now += 1.0

    workers = GatherWorkers(threads=2, min_bytes=10, trials=2)
    with data_path_threads(1):
        for _ in range(6):
            workers.gather(100, g.whole, [g.part, g.other_part], one=one)
        assert workers.mode == INTRA_OP
        assert ran == ["one", "one"] and ONE not in g.calls  # the trials' one-thread runs
        assert g.calls.count(INTRA_OP) == 2
        workers.gather(5, g.whole, [g.part, g.other_part], one=one)
    assert ran == ["one"] * 3 and g.calls.count(INTRA_OP) == 2
    assert workers.alone(5) and not workers.alone(10)


def _choose(g: Gather, workers: GatherWorkers) -> None:
    """Run the trials (two per mode) to their choice, then forget the calls."""
    g.run(workers, 6)
    g.calls.clear()


def test_a_mode_that_loses_to_one_thread_in_use_gives_way_to_the_next(clock):
    """Fast in the trials, slow in use (a pool thread asleep between the caller's gathers):
    once ``window`` gathers in use are no faster than the one-thread gathers run among them,
    the mode is dropped and the next one the trials found no slower than one thread is
    judged in turn; when that one loses too, one thread is left."""
    g = Gather(clock, one=1.0, split=0.3, intra=0.5)
    workers = GatherWorkers(threads=2, min_bytes=10, trials=2, window=4, probe=16)
    _choose(g, workers)
    assert workers.mode == SPLIT
    g.cost[SPLIT] = 1.2  # slower than one thread now, not twice as slow: no strike
    g.run(workers, 7)  # gathers 1..7: one thread at 2, 4 and 6, split at the other four
    assert g.calls.count(ONE) == 3 and g.calls.count(SPLIT) == 8  # (two ranges a gather)
    assert workers.mode == INTRA_OP and workers.split is True
    g.calls.clear()
    g.run(workers, 4)
    assert g.calls == [INTRA_OP] * 4 and workers.mode == INTRA_OP  # 0.5 < 1.0: it pays
    g.cost[INTRA_OP] = 1.0  # no faster than one thread: not enough to keep it
    g.run(workers, 4)
    assert_on_one_thread(g, workers, 20)


def test_a_mode_that_pays_in_use_is_kept_and_one_thread_is_timed_now_and_then(clock):
    g = Gather(clock, one=1.0, split=1.0, intra=0.5)
    workers = GatherWorkers(threads=2, min_bytes=10, trials=2, window=4, probe=8)
    _choose(g, workers)
    assert workers.mode == INTRA_OP
    g.run(workers, 40)
    # one thread at gathers 2, 4, 6 (three to compare with), then every eighth: 8 .. 40
    assert [k + 1 for k, c in enumerate(g.calls) if c == ONE] == [2, 4, 6, 8, 16, 24, 32, 40]
    assert g.calls.count(INTRA_OP) == 32 and workers.mode == INTRA_OP


@pytest.mark.parametrize(("intra", "then"), [(1.1, ONE), (0.95, INTRA_OP)])
def test_only_a_mode_the_trials_found_no_slower_than_one_thread_is_tried_in_use(clock, intra,
                                                                                 then):
    """After a drop, the next mode need not beat one thread by ``gain`` in the trials (it is
    judged in use), but it must not have been slower there."""
    g = Gather(clock, one=1.0, split=0.3, intra=intra)
    workers = GatherWorkers(threads=2, min_bytes=10, trials=2, window=4)
    _choose(g, workers)
    assert workers.mode == SPLIT
    g.cost[SPLIT] = 1.5
    g.run(workers, 7)
    assert workers.mode == then and INTRA_OP not in g.calls


def test_the_watch_weighs_a_slow_gather_against_one_thread_in_use(clock):
    """Once one-thread gathers in use are timed, a strike is a gather over ``fallback``
    times their median, not the trials' (which ran back to back, and may be far faster)."""
    g = Gather(clock, one=0.2, split=1.0, intra=0.1)
    workers = GatherWorkers(threads=2, min_bytes=10, trials=2, fallback=2.0, window=8)
    _choose(g, workers)
    assert workers.mode == INTRA_OP
    g.cost = {ONE: 1.0, INTRA_OP: 0.5, SPLIT: 1.0}  # in use: both slower than in the trials
    g.run(workers, 6)  # one thread at 2, 4 and 6; intra-op 0.5 < 2 x 1.0: no strike
    g.cost[INTRA_OP] = 1.5  # over twice the trials' 0.2, under twice in use's 1.0
    g.run(workers, 2)
    assert workers.mode == INTRA_OP
    g.cost[INTRA_OP] = 2.5
    g.run(workers, 2)
    assert workers.mode == ONE


@pytest.mark.parametrize("kw", [{"window": 0}, {"probe": 1}])
def test_the_in_use_check_needs_a_window_and_a_probe_period(kw):
    with pytest.raises(ValueError, match="window"):
        GatherWorkers(threads=2, **kw)


class _Payload:
    """Stands for the tensors a gather job holds (weakly referenceable)."""


def _dead_within(ref: weakref.ref, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()  # (what a raised error's traceback holds may wait for a collection)
        time.sleep(0.01)
    return ref() is None


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_a_worker_holds_no_job_once_it_reported_back(fails: bool) -> None:
    # Defect: a pool worker kept its last job, and the tensors it held, until its next job.
    # A pool stopped during interpreter shutdown then freed them on the worker, which takes
    # the GIL back inside torch's C++ code and aborts the process ("terminate called without
    # an active exception", exit status 134 after `conduit bench peers` with conduit-split).
    workers = GatherWorkers(threads=2)
    payload = _Payload()
    ref = weakref.ref(payload)

    def job(held: _Payload = payload) -> None:
        if fails:
            raise RuntimeError(f"a failed gather holding {held!r}")

    if fails:
        with pytest.raises(RuntimeError):
            workers.run([lambda: None, job])
    else:
        workers.run([lambda: None, job])
    del job, payload
    # (``workers`` is alive until the end: the worker must let go by itself, not because the
    # pool was stopped)
    assert _dead_within(ref)
    assert any(t.name.startswith("conduit-gather-") for t in threading.enumerate())


@pytest.mark.parametrize("mode", GATHER_MODES)
def test_slot_pairs_gathered_on_two_threads_are_the_rows_in_their_shape(mode: str) -> None:
    # Indices of two dimensions (the RLlib buffers' [B, 2] slot pairs) are taken flat, split
    # over the pool in the split mode, then viewed in their shape.
    spec = ExperienceSpec.of(obs=((64,), torch.float32), a=((), torch.int64))
    store = make_store(spec=spec, capacity=100, placement=Placement.pageable())
    store.set_range(0, {"obs": torch.randn(100, 64), "a": torch.arange(100)})
    workers = GatherWorkers(threads=2, min_bytes=1, modes=(mode,), trials=1, gain=100.0,
                            fallback=1e9)
    idx = torch.randint(0, 100, (40, 2), generator=torch.Generator().manual_seed(3))
    for _ in range(4):  # the trials, then the chosen mode
        got = store.get(idx, workers=workers)
        assert got["obs"].shape == (40, 2, 64) and got["a"].shape == (40, 2)
        assert torch.equal(got["a"], idx)
        assert torch.equal(got["obs"], store.get(idx.reshape(-1))["obs"].view(40, 2, 64))
    assert workers.mode == mode
