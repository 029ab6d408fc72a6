"""How a buffer with more than one data-path thread runs its large gathers: the trials that
choose between one thread, a split over the buffer's pool and torch's intra-op threads, the
watch that falls back to one thread when the cores get busy, and the periodic recheck."""

import time

import pytest
import torch

from conduit.storage import ExperienceBuffer, PrioritizedSampler, data_path_threads
from conduit.storage.threads import (
    GATHER_MODES,
    INTRA_OP,
    ONE,
    SPLIT,
    GatherWorkers,
    pick_gather_mode,
)
from tests.conftest import make_rows

SLOW = 0.02  # seconds: far above any scheduling noise of a call that does nothing


class Gather:
    """A fake gather whose duration depends on how it runs: ``whole`` on one torch thread,
    ``whole`` on several (intra-op), or as ``parts`` on the pool. Records each call."""

    def __init__(self, *, one: float = 0.0, intra: float = 0.0, split: float = 0.0) -> None:
        self.cost = {ONE: one, INTRA_OP: intra, SPLIT: split}
        self.calls: list[str] = []
        self.threads_seen: list[int] = []

    def whole(self) -> None:
        n = torch.get_num_threads()
        self.threads_seen.append(n)
        mode = INTRA_OP if n > 1 else ONE
        self.calls.append(mode)
        time.sleep(self.cost[mode])

    def part(self) -> None:
        self.calls.append(SPLIT)
        time.sleep(self.cost[SPLIT])  # the ranges run at once: the gather takes this long

    def run(self, workers: GatherWorkers, times: int = 1) -> None:
        with data_path_threads(1):  # as a buffer calls it
            for _ in range(times):
                workers.gather(100, self.whole, [self.part, self.part])


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


def test_intra_op_threads_are_kept_where_they_measured_faster_and_used_per_gather():
    g = Gather(one=SLOW, split=SLOW)
    workers = GatherWorkers(threads=2, min_bytes=10, trials=2)
    g.run(workers, 6)  # two trials per mode
    assert workers.mode == INTRA_OP and workers.split is True
    g.calls.clear()
    g.threads_seen.clear()
    with data_path_threads(1):
        for _ in range(3):
            workers.gather(100, g.whole, [g.part, g.part])
            assert torch.get_num_threads() == 1  # the caller's count comes back
    assert g.calls == [INTRA_OP] * 3 and g.threads_seen == [2] * 3


def test_every_mode_gets_its_trials_in_turn_before_the_choice():
    g = Gather()
    workers = GatherWorkers(threads=2, min_bytes=10, trials=3)
    g.run(workers, 8)
    assert workers.mode is None  # one trial short
    assert g.calls.count(ONE) == 3 and g.calls.count(INTRA_OP) == 2
    assert g.calls.count(SPLIT) == 6  # two ranges per split gather
    g.run(workers)
    assert workers.mode in GATHER_MODES


def test_restricted_modes_never_run_the_others():
    g = Gather(one=SLOW, split=SLOW)  # intra-op would win, but it is not allowed
    workers = GatherWorkers(threads=2, min_bytes=10, trials=2, modes=(ONE, SPLIT))
    g.run(workers, 10)
    assert INTRA_OP not in g.calls and workers.mode == ONE
    with pytest.raises(ValueError, match="modes"):
        GatherWorkers(threads=2, modes=(ONE, "turbo"))
    with pytest.raises(ValueError, match="fallback"):
        GatherWorkers(threads=2, fallback=1.0)


def test_a_mode_that_turns_slow_twice_in_a_row_sends_gathers_back_to_one_thread():
    g = Gather(one=SLOW / 2, split=SLOW)
    workers = GatherWorkers(threads=2, min_bytes=10, trials=2, fallback=2.0)
    g.run(workers, 6)
    assert workers.mode == INTRA_OP
    g.cost[INTRA_OP] = 4 * SLOW  # another busy thread holds the second core now
    g.run(workers)
    assert workers.mode == INTRA_OP  # one slow gather is not enough
    g.cost[INTRA_OP] = 0.0
    g.run(workers)
    g.cost[INTRA_OP] = 4 * SLOW
    g.run(workers)
    assert workers.mode == INTRA_OP  # the strikes must come in a row
    g.run(workers)
    assert workers.mode == ONE and workers.split is False
    g.calls.clear()
    g.run(workers, 3)
    assert g.calls == [ONE] * 3


def test_a_mode_slow_twice_in_its_trials_leaves_them_early():
    g = Gather(one=SLOW / 4, split=SLOW, intra=0.0)
    workers = GatherWorkers(threads=2, min_bytes=10, trials=6)
    g.run(workers, 6)  # one, split, intra, one, split (second strike), intra
    assert g.calls.count(SPLIT) == 4  # two split gathers of two ranges, then no more
    g.run(workers, 10)
    assert g.calls.count(SPLIT) == 4
    assert workers.mode == INTRA_OP


def test_the_trials_run_again_after_recheck_gathers():
    g = Gather(one=SLOW, split=SLOW)
    workers = GatherWorkers(threads=2, min_bytes=10, trials=1, recheck=4)
    g.run(workers, 3)
    assert workers.mode == INTRA_OP
    g.cost = {ONE: 0.0, INTRA_OP: SLOW, SPLIT: SLOW}  # the load changed: one thread wins now
    g.run(workers, 4)  # within the recheck period: still intra-op (no two strikes: 2x rule
    # reads the trials' one-thread time, which was SLOW)
    assert workers.mode == INTRA_OP
    g.run(workers, 4)  # the fifth gather since the choice starts new trials
    assert workers.mode == ONE


def test_small_gathers_never_leave_the_callers_thread():
    g = Gather()
    workers = GatherWorkers(threads=2, min_bytes=1000, trials=1)
    g.run(workers, 5)  # 100 bytes each
    assert g.calls == [ONE] * 5 and workers.mode is None


def test_a_two_thread_prioritized_buffer_gathers_the_same_rows_in_every_mode(small_spec):
    rows = make_rows(small_spec, 64)
    one = ExperienceBuffer(spec=small_spec, capacity=64, sampler=PrioritizedSampler(seed=3))
    two = ExperienceBuffer(spec=small_spec, capacity=64, sampler=PrioritizedSampler(seed=3),
                           threads=2)
    for buf in (one, two):
        buf.extend(rows)
    for mode in GATHER_MODES:
        two._workers = GatherWorkers(threads=2, min_bytes=0, trials=1)
        two._workers.mode = mode  # as if its trials had chosen it
        two._workers._baseline = float("inf")  # never falls back here
        for _ in range(4):
            a, b = one.sample(33), two.sample(33)
            for k in a:
                assert torch.equal(a[k], b[k]), (mode, k)
            new = torch.rand(33) + 0.1
            one.update_priorities(a["_index"], new)
            two.update_priorities(b["_index"], new)
        assert two._workers.mode == mode
