"""A buffer's rows and ids snapshotted at one instant and read out while writes go on
(copy-on-write)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from conduit.errors import ConfigError
from conduit.spec import ExperienceSpec
from conduit.storage import (
    CheckpointError,
    ExperienceBuffer,
    Placement,
    PrioritizedSampler,
    read_checkpoint,
    write_checkpoint,
)
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
    ids = buf._row_id.copy()
    snap = buf.begin_snapshot()
    # a reader is part-way through one column when the writes come
    reader = snap.stream_rows(0, "obs", chunk_bytes=2 * small_spec.fields["obs"].nbytes)
    chunks = [next(reader).clone()]
    write(buf, small_spec, during, start=1000)
    chunks += [c.clone() for c in reader]
    assert torch.equal(torch.cat(chunks), expected[0][1]["obs"])
    for b, (_, cols) in enumerate(expected):
        for f, col in cols.items():
            if (b, f) != (0, "obs"):
                got = [c.clone() for c in snap.stream_rows(b, f, chunk_bytes=3 * col[0].nbytes)]
                assert torch.equal(torch.cat(got), col)
    with pytest.raises(ConfigError, match="read out already"):
        next(snap.stream_rows(0, "obs"))
    assert np.array_equal(snap.ids("row_id"), ids)
    buf.drop_snapshot(snap)
    assert not buf._snapshots


def test_taking_a_snapshot_copies_nothing_and_writes_copy_only_what_they_overwrite(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=64)
    buf.extend(make_rows(small_spec, 64))
    expected = clone_blocks(buf.filled_blocks())
    expected_ids = buf._row_id.copy()
    snap = buf.begin_snapshot()
    assert not snap._kept and not snap._ids and not snap._ids_kept  # nothing copied yet
    buf.extend(make_rows(small_spec, 5, start=700))  # slots 0..4
    assert {k: int(m.sum()) for k, m in snap._kept_mask.items()} == {
        (0, f): 5 for f in small_spec.fields}
    # The ids it changed, only at its own slots: not a copy of the whole array.
    assert not snap._ids and set(snap._ids_kept) == {"row_id"}
    mask, old = snap._ids_kept["row_id"]
    assert np.flatnonzero(mask).tolist() == [0, 1, 2, 3, 4]
    assert np.array_equal(old[:5], expected_ids[:5])
    assert_blocks_equal(buf.complete_snapshot(snap), expected)
    assert np.array_equal(snap.state["row_id"].numpy(), expected_ids)


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
    ids = buf._row_id.copy()
    snap = buf.begin_snapshot()
    buf.clear()
    buf.extend(make_rows(small_spec, 4, start=50))
    assert_blocks_equal(buf.complete_snapshot(snap), expected)
    assert np.array_equal(snap.state["row_id"].numpy(), ids)


def test_a_restore_during_a_snapshot_keeps_the_snapshot(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=16)
    buf.extend(make_rows(small_spec, 12))
    other = ExperienceBuffer(spec=small_spec, capacity=16)
    other.extend(make_rows(small_spec, 16, start=300))
    expected = clone_blocks(buf.filled_blocks())
    ids = buf._row_id.copy()
    snap = buf.begin_snapshot()
    buf.load_state_dict(other.state_dict())
    assert_blocks_equal(buf.complete_snapshot(snap), expected)
    assert np.array_equal(snap.state["row_id"].numpy(), ids)
    assert_blocks_equal(buf.filled_blocks(), other.filled_blocks())


def test_ids_of_slots_past_the_filled_rows_stay_those_of_the_instant(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=32)
    buf.extend(make_rows(small_spec, 10))
    ids = buf._row_id.copy()
    snap = buf.begin_snapshot()
    for k in range(3):  # fills the empty slots, then wraps over the snapshot's rows
        buf.extend(make_rows(small_spec, 10, start=100 + 10 * k))
    buf.complete_snapshot(snap)
    assert np.array_equal(snap.state["row_id"].numpy(), ids)
    assert (snap.state["row_id"].numpy()[10:] == -1).all()
    assert not np.array_equal(buf._row_id, ids)


def test_delivered_ids_are_those_of_the_instant_while_sampling_goes_on(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=32,
                           sampler=PrioritizedSampler(alpha=0.6, beta=0.4))
    buf.extend(make_rows(small_spec, 32))
    buf.sample(8)
    delivered = buf._delivered_id.copy()
    snap = buf.begin_snapshot()
    for _ in range(5):
        buf.sample(8)  # records what each slot delivered
    assert not np.array_equal(buf._delivered_id, delivered)
    buf.complete_snapshot(snap)
    assert np.array_equal(snap.state["delivered_id"].numpy(), delivered)


@pytest.mark.parametrize("ahead", [False, True], ids=["stream", "copy-ahead"])
def test_a_writer_thread_racing_the_read_out_never_reaches_the_snapshot(small_spec, ahead):
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
                ids = buf._row_id.copy()
                snap = buf.begin_snapshot()
            if not t.is_alive():
                t.start()
            if ahead:
                snap.copy_ahead(chunk_bytes=16 * small_spec.bytes_per_sample)
            blocks = buf.complete_snapshot(snap, chunk_bytes=16 * small_spec.bytes_per_sample)
            assert_blocks_equal(blocks, expected)
            assert np.array_equal(snap.state["row_id"].numpy(), ids)
    finally:
        stop.set()
        if t.is_alive():
            t.join()
    assert buf.total_written > 4000 and not buf._snapshots


def test_a_paced_read_out_is_exact_and_a_bad_duty_is_refused(small_spec):
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


def test_a_snapshot_streams_into_a_checkpoint_while_writes_go_on(small_spec, tmp_path):
    buf = ExperienceBuffer(spec=small_spec, capacity=100)
    buf.extend(make_rows(small_spec, 100))
    (_, expected), = clone_blocks(buf.filled_blocks())
    snap = buf.begin_snapshot()
    (_, cols), = snap.blocks
    writes = iter(range(20))

    def source(f):
        def chunks():
            for chunk in snap.stream_rows(0, f, chunk_bytes=10 * cols[f][0].nbytes):
                yield chunk
                if next(writes, None) is not None:  # a write between any two chunks
                    buf.extend(make_rows(small_spec, 7, start=5000))
        return chunks

    write_checkpoint(tmp_path / "s.ckpt", tensors=dict(cols), meta={},
                     sources={f: source(f) for f in cols})
    buf.drop_snapshot(snap)
    _, back = read_checkpoint(tmp_path / "s.ckpt")
    assert all(torch.equal(back[f], expected[f]) for f in expected)
    assert buf.total_written > 100


def test_a_source_of_the_wrong_size_or_name_is_refused(small_spec, tmp_path):
    t = torch.arange(10, dtype=torch.float32)
    with pytest.raises(CheckpointError, match="source made 36 bytes"):
        write_checkpoint(tmp_path / "a.ckpt", tensors={"t": t}, meta={},
                         sources={"t": lambda: iter([t[:9]])})
    assert not (tmp_path / "a.ckpt").exists()
    with pytest.raises(ConfigError, match="sources"):
        write_checkpoint(tmp_path / "a.ckpt", tensors={"t": t}, meta={},
                         sources={"u": lambda: iter([t])})


def test_streaming_a_snapshot_to_disk_does_not_double_memory(tmp_path):
    psutil = pytest.importorskip("psutil")
    spec = ExperienceSpec.of(obs=((256,), torch.float32), id=((), torch.int64))
    buf = ExperienceBuffer(spec=spec, capacity=64_000)  # 66 MB of rows
    for k in range(8):
        buf.extend(make_rows(spec, 8000, start=8000 * k))
    proc = psutil.Process()
    base = proc.memory_info().rss
    snap = buf.begin_snapshot()
    buf.extend(make_rows(spec, 500, start=100_000))  # overwritten before the reader gets there
    peak = [0]
    (_, cols), = snap.blocks

    def source(f):
        def chunks():
            for chunk in snap.stream_rows(0, f):
                peak[0] = max(peak[0], proc.memory_info().rss - base)
                yield chunk
        return chunks

    sources = {f: source(f) for f in cols}
    sources["row_id"] = lambda: snap.stream_ids("row_id")
    write_checkpoint(tmp_path / "s.ckpt", tensors={**cols, "row_id": snap.state["row_id"]},
                     meta={}, sources=sources)
    buf.drop_snapshot(snap)
    assert peak[0] < 16 << 20  # a chunk, the 500 rows set aside and the ids, not a copy
    _, back = read_checkpoint(tmp_path / "s.ckpt")
    assert back["id"].tolist() == list(range(64_000))
    assert back["row_id"].tolist() == list(range(64_000))


def test_a_later_snapshot_sets_rows_aside_in_the_memory_of_an_earlier_one(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=32)
    buf.extend(make_rows(small_spec, 32))
    first = buf.begin_snapshot()
    buf.extend(make_rows(small_spec, 8, start=100))  # set aside into fresh memory
    buf.complete_snapshot(first)
    spare = first.kept
    assert set(spare) == {(0, f) for f in small_spec.fields}
    expected = clone_blocks(buf.filled_blocks())
    second = buf.begin_snapshot(spare=spare)
    buf.extend(make_rows(small_spec, 12, start=200))  # slots 8..19: the spare holds stale rows
    assert second.kept[(0, "obs")].data_ptr() == spare[(0, "obs")].data_ptr()
    assert_blocks_equal(buf.complete_snapshot(second), expected)


def test_after_copying_ahead_writes_copy_nothing_and_the_read_out_uses_the_copies(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=48, placement=Placement.sharded(["cpu"] * 2))
    buf.extend(make_rows(small_spec, 48))
    expected = clone_blocks(buf.filled_blocks())
    snap = buf.begin_snapshot()
    buf.extend(make_rows(small_spec, 5, start=300))  # set aside by the write, kept as is
    snap.copy_ahead(chunk_bytes=7 * small_spec.bytes_per_sample)
    assert all(m.all() for m in snap._kept_mask.values()) and len(snap._kept_mask) == 6
    kept = {k: v.clone() for k, v in snap._kept.items()}
    write(buf, small_spec, 100, start=1000)  # the whole ring, twice over
    assert all(torch.equal(kept[k], snap._kept[k]) for k in kept)  # nothing copied again
    first = next(snap.stream_rows(0, "obs", chunk_bytes=4 * 16))
    assert first.data_ptr() == snap._kept[(0, "obs")].data_ptr()  # the copy, not the ring
    buf.drop_snapshot(snap)
    for b, (_, cols) in enumerate(expected):
        for f, col in cols.items():
            if (b, f) != (0, "obs"):
                assert torch.equal(torch.cat([c.clone() for c in snap.stream_rows(b, f)]), col)
    assert torch.equal(first, expected[0][1]["obs"][:first.shape[0]])


def test_copying_ahead_refuses_a_bad_duty(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=8)
    buf.extend(make_rows(small_spec, 8))
    with pytest.raises(ConfigError, match="duty"):
        buf.begin_snapshot().copy_ahead(duty=1.5)


def test_copying_ahead_starts_at_the_rows_the_next_write_overwrites(small_spec, monkeypatch):
    buf = ExperienceBuffer(spec=small_spec, capacity=40)
    buf.extend(make_rows(small_spec, 40))
    buf.extend(make_rows(small_spec, 13, start=100))  # the ring's cursor is at slot 13
    expected = clone_blocks(buf.filled_blocks())
    snap = buf.begin_snapshot()
    order: list[tuple[int, int]] = []
    copy_rows = snap._copy_ahead_rows

    def recorded(first, stop, bounces):
        order.append((first, stop))
        copy_rows(first, stop, bounces)

    monkeypatch.setattr(snap, "_copy_ahead_rows", recorded)
    snap.copy_ahead(chunk_bytes=10 * small_spec.bytes_per_sample)
    assert order == [(13, 23), (23, 33), (33, 40), (0, 10), (10, 13)]
    assert_blocks_equal(buf.complete_snapshot(snap), expected)


def test_a_snapshot_leads_the_writes_by_twice_the_largest_write(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=64)
    buf.extend(make_rows(small_spec, 5))
    buf.extend(make_rows(small_spec, 13, start=5))
    buf.extend(make_rows(small_spec, 2, start=18))
    snap = buf.begin_snapshot()
    assert snap.lead_rows == 26 and snap.rows_written == 0
    buf.extend(make_rows(small_spec, 4, start=20))  # past the snapshot's 20 rows: no threat
    assert snap.rows_written == 0
    buf.drop_snapshot(snap)


def test_copying_ahead_keeps_to_its_duty_only_once_it_leads_the_writes(small_spec, monkeypatch):
    """No pause while the copy is fewer than ``lead_rows`` rows ahead of the writes; a write
    that closes in on it sends it back to full speed, and what it sets aside is what the
    copy had not reached."""
    buf = ExperienceBuffer(spec=small_spec, capacity=60)
    buf.extend(make_rows(small_spec, 60))
    buf.extend(make_rows(small_spec, 10, start=100))  # cursor at slot 10; largest write 60
    expected = clone_blocks(buf.filled_blocks())
    snap = buf.begin_snapshot()
    snap.lead_rows = 15
    progress: list[int] = []
    copy_rows = snap._copy_ahead_rows

    def recorded(first, stop, bounces):
        copy_rows(first, stop, bounces)
        progress.append((stop - 10) % 60 or 60)  # rows done, in ring order from the cursor

    paused_at: list[tuple[int, int]] = []

    def fake_sleep(seconds):
        paused_at.append((progress[-1], snap.rows_written))
        if len(paused_at) == 1:  # a write of 12 rows lands during the first pause
            buf.extend(make_rows(small_spec, 12, start=200))

    monkeypatch.setattr(snap, "_copy_ahead_rows", recorded)
    monkeypatch.setattr("conduit.storage.snapshot.time.sleep", fake_sleep)
    snap.copy_ahead(chunk_bytes=5 * small_spec.bytes_per_sample, duty=0.5)
    assert progress == list(range(5, 65, 5))
    assert all(done - written >= 15 for done, written in paused_at)
    # 15 rows ahead, one pause; the write of 12 leaves it 3 ahead: full speed to 15 ahead again
    assert paused_at[:3] == [(15, 0), (30, 12), (35, 12)]
    assert snap.rows_written == 12
    assert_blocks_equal(buf.complete_snapshot(snap), expected)


def test_copying_ahead_takes_the_ids_before_the_next_write_would(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=16)
    buf.extend(make_rows(small_spec, 16))
    ids = buf.state_dict(rows=False)["row_id"].clone()
    snap = buf.begin_snapshot()
    snap.copy_ahead()
    assert set(snap._ids) == {"row_id", "delivered_id"}  # copied by the worker, not a write
    buf.extend(make_rows(small_spec, 4, start=50))
    assert torch.equal(torch.from_numpy(snap.ids("row_id")), ids)
    assert not np.array_equal(snap.ids("row_id"), buf.state_dict(rows=False)["row_id"].numpy())
    buf.drop_snapshot(snap)
