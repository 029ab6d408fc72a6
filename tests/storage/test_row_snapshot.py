"""A buffer's rows snapshotted at one instant and copied while writes go on (copy-on-write)."""

from __future__ import annotations

import threading

import pytest
import torch

from conduit.storage import ExperienceBuffer, Placement
from tests.conftest import make_rows


def clone_blocks(blocks):
    return [(s, {k: v.clone() for k, v in cols.items()}) for s, cols in blocks]


def assert_blocks_equal(a, b):
    assert [s for s, _ in a] == [s for s, _ in b]
    for (_, x), (_, y) in zip(a, b):
        assert x.keys() == y.keys()
        assert all(torch.equal(x[k], y[k]) for k in x)


def write(buf, spec, rows, *, start, step=9):
    done = 0
    while done < rows:
        n = min(step, rows - done)
        buf.extend(make_rows(spec, n, start=start + done))
        done += n


@pytest.mark.parametrize("placement", [Placement.pageable(), Placement.sharded(["cpu"] * 3)],
                         ids=lambda p: p.label())
@pytest.mark.parametrize(("before", "during"), [(10, 7), (30, 25), (40, 10), (40, 64), (5, 0)])
def test_the_snapshot_holds_the_rows_at_its_start_despite_writes(small_spec, placement, before,
                                                                 during):
    buf = ExperienceBuffer(spec=small_spec, capacity=40, placement=placement)
    buf.extend(make_rows(small_spec, before))
    expected = clone_blocks(buf.filled_blocks())
    snap = buf.begin_snapshot()
    with buf._lock:
        snap.step(3)  # part copied by the copying thread, the rest copied by the writes
    write(buf, small_spec, during, start=1000)
    assert_blocks_equal(buf.complete_snapshot(snap, chunk_bytes=2 * small_spec.bytes_per_sample),
                        expected)
    assert snap.done


def test_rows_written_after_the_snapshot_completes_do_not_reach_it(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=16)
    buf.extend(make_rows(small_spec, 16))
    blocks = buf.complete_snapshot(buf.begin_snapshot())
    kept = clone_blocks(blocks)
    buf.extend(make_rows(small_spec, 16, start=500))
    assert_blocks_equal(blocks, kept)
    assert not torch.equal(buf.filled_blocks()[0][1]["obs"], kept[0][1]["obs"])


def test_a_clear_and_new_writes_during_a_snapshot(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=16)
    buf.extend(make_rows(small_spec, 16))
    expected = clone_blocks(buf.filled_blocks())
    snap = buf.begin_snapshot()
    buf.clear()
    buf.extend(make_rows(small_spec, 4, start=50))
    assert_blocks_equal(buf.complete_snapshot(snap), expected)


def test_a_restore_during_a_snapshot_keeps_the_snapshot(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=16)
    buf.extend(make_rows(small_spec, 12))
    other = ExperienceBuffer(spec=small_spec, capacity=16)
    other.extend(make_rows(small_spec, 16, start=300))
    expected = clone_blocks(buf.filled_blocks())
    snap = buf.begin_snapshot()
    buf.load_state_dict(other.state_dict())
    assert_blocks_equal(buf.complete_snapshot(snap), expected)
    assert_blocks_equal(buf.filled_blocks(), other.filled_blocks())


def test_memory_of_an_earlier_snapshot_is_reused(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=16)
    buf.extend(make_rows(small_spec, 16))
    first = buf.complete_snapshot(buf.begin_snapshot())
    ptr = first[0][1]["obs"].data_ptr()
    buf.extend(make_rows(small_spec, 5, start=70))
    expected = clone_blocks(buf.filled_blocks())
    second = buf.complete_snapshot(buf.begin_snapshot(reuse=first))
    assert second[0][1]["obs"].data_ptr() == ptr
    assert_blocks_equal(second, expected)


def test_a_writer_thread_racing_the_copy_never_reaches_the_snapshot(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=4000, placement=Placement.sharded(["cpu"] * 2))
    buf.extend(make_rows(small_spec, 4000))
    stop = threading.Event()

    def writer():
        k = 0
        while not stop.is_set():
            buf.extend(make_rows(small_spec, 37, start=10_000 + 37 * k))
            k += 1

    t = threading.Thread(target=writer)
    try:
        for _ in range(3):
            with buf._lock:  # the instant of the snapshot, as the plane's hold gives it
                expected = clone_blocks(buf.filled_blocks())
                snap = buf.begin_snapshot()
            if not t.is_alive():
                t.start()
            blocks = buf.complete_snapshot(snap, chunk_bytes=16 * small_spec.bytes_per_sample)
            assert_blocks_equal(blocks, expected)
    finally:
        stop.set()
        if t.is_alive():
            t.join()
    assert buf.total_written > 4000 and not buf._snapshots


def test_a_paced_copy_is_exact_and_a_bad_duty_is_refused(small_spec):
    from conduit.errors import ConfigError

    buf = ExperienceBuffer(spec=small_spec, capacity=64)
    buf.extend(make_rows(small_spec, 64))
    expected = clone_blocks(buf.filled_blocks())
    snap = buf.begin_snapshot()
    with pytest.raises(ConfigError, match="duty"):
        buf.complete_snapshot(snap, duty=0)
    assert not buf._snapshots  # a refused call stops tracking the snapshot too
    snap = buf.begin_snapshot()
    buf.extend(make_rows(small_spec, 10, start=900))
    assert_blocks_equal(buf.complete_snapshot(snap, chunk_bytes=small_spec.bytes_per_sample * 4,
                                              duty=0.5), expected)
