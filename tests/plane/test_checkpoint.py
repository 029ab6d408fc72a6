"""Plane checkpoints: files round-trip every part of the state, corruption and bad values are
named, torch.load's safe default reads in-memory state, and snapshots survive SIGKILL."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from conduit import BackpressureTimeout, ExperienceDataPlane, ExperienceSpec, Placement, Schedule
from conduit.errors import SpecError, StateError
from conduit.storage import CheckpointError, read_checkpoint, write_checkpoint
from tests.conftest import make_rows


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("placement", [Placement.pageable(), Placement.sharded(["cpu", "cpu"])],
                         ids=lambda p: p.label())
def test_off_policy_round_trip_continues_the_same_batches(small_spec, tmp_path, placement):
    kw = {"spec": small_spec, "capacity": 48, "batch_size": 8, "sampler": "prioritized",
          "placement": placement, "seed": 3}
    with ExperienceDataPlane(**kw) as plane:
        plane.push(make_rows(small_spec, 40))
        plane.push(make_rows(small_spec, 20, start=40))  # wraps the ring
        for _ in range(3):
            b = plane.pull()
            plane.update_priorities(b["_index"], b["id"].float() % 5)
        plane.save(tmp_path / "p.ckpt")
        with ExperienceDataPlane.load(tmp_path / "p.ckpt") as back:
            assert back.buffer.placement == placement and len(back.buffer) == 48
            assert back.counters == plane.counters
            for _ in range(5):
                assert same(plane.pull(), back.pull())


def test_load_reads_host_rows_straight_into_the_planes_columns(small_spec, tmp_path,
                                                               monkeypatch):
    from conduit.storage import ColumnStore

    with ExperienceDataPlane(spec=small_spec, capacity=48, batch_size=8, seed=1) as plane:
        plane.push(make_rows(small_spec, 40))
        plane.push(make_rows(small_spec, 20, start=40))  # wraps the ring
        plane.save(tmp_path / "p.ckpt")
        copied = []
        real = ColumnStore.set_range
        monkeypatch.setattr(ColumnStore, "set_range",
                            lambda self, start, batch: copied.append(start) or
                            real(self, start, batch))
        with ExperienceDataPlane.load(tmp_path / "p.ckpt") as back:
            assert copied == []  # no rows went through a second copy
            for f in small_spec.fields:
                assert torch.equal(back.buffer.store.column(f), plane.buffer.store.column(f))
            for _ in range(3):
                assert same(plane.pull(), back.pull())
        sharded = Placement.sharded(["cpu", "cpu"])  # no single column: read, then copied
        with ExperienceDataPlane.load(tmp_path / "p.ckpt", placement=sharded) as back:
            assert copied and back.buffer.placement == sharded
            rows = torch.arange(48)
            assert same(back.buffer.store.get(rows), plane.buffer.store.get(rows))


def test_a_capacity_override_other_than_the_saved_one_is_refused(small_spec, tmp_path):
    from conduit.errors import ConfigError

    with ExperienceDataPlane(spec=small_spec, capacity=48, batch_size=8, seed=1) as plane:
        plane.push(make_rows(small_spec, 30))
        plane.save(tmp_path / "p.ckpt")
    for capacity in (20, 64):
        with pytest.raises(ConfigError, match="saved with \\(48 rows\\)") as err:
            ExperienceDataPlane.load(tmp_path / "p.ckpt", capacity=capacity)
        assert err.value.field == "capacity"
    with ExperienceDataPlane.load(tmp_path / "p.ckpt", capacity=48) as back:
        assert len(back.buffer) == 30


@pytest.mark.parametrize("schedule", [Schedule(0, 1, 0, 0.25), Schedule(1, 0.25, 1, 0.25)],
                         ids=lambda s: s.label())
def test_on_policy_mid_iteration_round_trip_delivers_the_rest_once(small_spec, tmp_path,
                                                                    schedule):
    kw = {"spec": small_spec, "capacity": 32, "mode": "on_policy", "num_minibatches": 4,
          "num_epochs": 2, "schedule": schedule, "seed": 9}
    with ExperienceDataPlane(**kw) as plane:
        plane.push(make_rows(small_spec, 32))
        for _ in range(3):
            plane.pull()
        plane.save(tmp_path / "p.ckpt")
        rest = [plane.pull() for _ in range(5)]
        with ExperienceDataPlane.load(tmp_path / "p.ckpt") as back:
            assert back.policy_version == 0
            got = [back.pull() for _ in range(5)]
            assert all(same(a, b) for a, b in zip(rest, got))
            assert back.policy_version == 1


@pytest.mark.parametrize("schedule", [Schedule(0, 0.5, 1, 0.5), Schedule(1, 0.5, 1, 0.5)],
                         ids=lambda s: s.label())
def test_a_save_after_an_early_delivered_mini_batch_loads_and_delivers_the_rest_once(
        small_spec, tmp_path, schedule):
    """Defect: with early assembly the first mini-batch is delivered before the iteration's
    last rows are pushed; a save then succeeded but its file (and the state dict) were
    refused on load ("mini-batches delivered from an iteration that is not full")."""
    from conduit.storage import FifoSampler

    def sampler():
        return FifoSampler(num_minibatches=2, first_within=0.5, seed=1)

    kw = {"spec": small_spec, "capacity": 16, "mode": "on_policy", "num_minibatches": 2,
          "num_epochs": 2, "schedule": schedule, "seed": 1}
    with ExperienceDataPlane(**kw, sampler=sampler()) as plane:
        plane.push(make_rows(small_spec, 8))
        first = plane.pull(timeout=10)  # before the iteration's second half is pushed
        assert plane.state_dict()["flow"]["delivered_in_iter"] == 1
        state = plane.state_dict()
        plane.save(tmp_path / "p.ckpt")
        plane.push(make_rows(small_spec, 8, start=8))
        rest = [plane.pull() for _ in range(3)]
        with ExperienceDataPlane.load(tmp_path / "p.ckpt", sampler=sampler()) as back, \
                ExperienceDataPlane(**kw, sampler=sampler()) as other:
            other.load_state_dict(state)
            for restored in (back, other):
                restored.push(make_rows(small_spec, 8, start=8))
                got = [restored.pull() for _ in range(3)]
                assert all(same(a, b) for a, b in zip(rest, got))
                ids = sorted(first["id"].tolist() + got[0]["id"].tolist())
                assert ids == list(range(16))  # the first epoch: every row once
                assert restored.policy_version == 1


def test_state_dict_reads_back_with_torch_load_defaults(small_spec, tmp_path):
    with ExperienceDataPlane(spec=small_spec, capacity=16, batch_size=4,
                             sampler="prioritized") as plane:
        plane.push(make_rows(small_spec, 16))
        torch.save(plane.state_dict(), tmp_path / "s.pt")
        state = torch.load(tmp_path / "s.pt")  # weights_only=True by default
        with ExperienceDataPlane(spec=small_spec, capacity=16, batch_size=4,
                                 sampler="prioritized") as other:
            other.load_state_dict(state)
            assert same(plane.pull(), other.pull())


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corruption_is_detected_and_named(small_spec, tmp_path):
    with ExperienceDataPlane(spec=small_spec, capacity=16, batch_size=4) as plane:
        plane.push(make_rows(small_spec, 16))
        info = plane.save(tmp_path / "p.ckpt")
    meta, _ = read_checkpoint(info.path)
    good = info.path.read_bytes()
    # a byte inside the obs rows
    from conduit.storage.checkpoint import _read_header  # the part offsets, for the test
    with open(info.path, "rb") as f:
        _, parts, _ = _read_header(f, info.path, len(good))
    obs = next(p for p in parts if p.name == "rows/0/obs")
    _flip(info.path, obs.offset + 5)
    with pytest.raises(CheckpointError) as ei:
        ExperienceDataPlane.load(info.path)
    assert ei.value.part == "rows/0/obs"
    info.path.write_bytes(good)
    _flip(info.path, 40)  # the header
    with pytest.raises(CheckpointError):
        ExperienceDataPlane.load(info.path)
    assert meta["format"] == "conduit-plane"


@pytest.mark.parametrize(("where", "value", "part"), [
    (("buffer", "writer", "cursor"), -1, "writer.cursor"),
    (("buffer", "writer", "size"), 999, "writer.size"),
    (("counters", "pushed_rows"), -5, "counters"),
    (("buffer", "sampler", "max_priority"), float("nan"), "sampler.max_priority"),
])
def test_every_loaded_value_is_validated(small_spec, tmp_path, where, value, part):
    with ExperienceDataPlane(spec=small_spec, capacity=16, batch_size=4,
                             sampler="prioritized") as plane:
        plane.push(make_rows(small_spec, 10))
        info = plane.save(tmp_path / "p.ckpt")
    meta, parts = read_checkpoint(info.path)
    node = meta["state"]
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = value if value == value else None  # strict JSON has no NaN
    write_checkpoint(info.path, tensors=parts, meta=meta)
    with pytest.raises(CheckpointError) as ei:
        ExperienceDataPlane.load(info.path)
    if part is not None:
        assert part in str(ei.value)


def test_bad_in_memory_state_raises_a_typed_error(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=16, batch_size=4,
                             sampler="prioritized") as plane:
        plane.push(make_rows(small_spec, 16))
        state = plane.state_dict()
        broken = {**state, "buffer": {k: v for k, v in state["buffer"].items()
                                      if k != "writer"}}
        with pytest.raises(StateError, match=r"buffer\.writer"):
            plane.load_state_dict(broken)
        state["buffer"]["sampler"]["tree"]["leaves"][3] = float("nan")
        with pytest.raises(StateError, match=r"tree\.leaves"):
            plane.load_state_dict(state)


def test_snapshots_run_in_the_background_and_load(small_spec, tmp_path):
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                             schedule=Schedule(1, 1, 1, 1)) as plane:
        with plane.snapshots(tmp_path / "s.ckpt", every_s=3600) as snap:
            plane.push(make_rows(small_spec, 20))
            snap.request(wait=True)
            plane.push(make_rows(small_spec, 20, start=20))
            plane.pull()
            snap.request(wait=True)  # reuses the first copy's memory
            plane.push(make_rows(small_spec, 30, start=40))  # wraps the ring
            plane.flush()
            expected = plane.state_dict()["buffer"]["store"]["columns"]
        assert snap.stats.snapshots == 2 and snap.stats.failures == 0
        with ExperienceDataPlane.load(tmp_path / "s.ckpt") as back:
            assert len(back.buffer) == 40
        snap = plane.snapshots(tmp_path / "s.ckpt", every_s=3600)
        snap.request(wait=True)
        snap.close()
        with ExperienceDataPlane.load(tmp_path / "s.ckpt") as back:
            got = back.state_dict()["buffer"]["store"]["columns"]
            assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_snapshot_that_cannot_be_written_warns_and_raises_on_request(small_spec, tmp_path):
    path = tmp_path / "missing" / "s.ckpt"
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4) as plane, \
            plane.snapshots(path, every_s=3600) as snap:
        plane.push(make_rows(small_spec, 20))
        with pytest.warns(RuntimeWarning, match="snapshot 1 .* failed"), \
                pytest.raises(FileNotFoundError):
            snap.request(wait=True)
        assert snap.stats.failures == 1 and snap.stats.snapshots == 0
        assert isinstance(snap.last_error, FileNotFoundError) and not path.exists()
        path.parent.mkdir()
        snap.request(wait=True)  # the next one is written: nothing raised
        assert snap.stats.snapshots == 1 and snap.stats.failures == 1
    with ExperienceDataPlane.load(path) as back:
        assert len(back.buffer) == 20


# -- a snapshotting process killed at random points ----------------------------------------------


def _snapshotting_child(folder: str, seed: int) -> None:
    """Push rows whose content is a function of their id, save after every push, and log
    each save's row count before and after it."""
    torch.set_num_threads(1)
    path = Path(folder, "buffer.ckpt")
    spec = ExperienceSpec.from_dict(json.loads(Path(folder, "spec.json").read_text()))
    plane = (ExperienceDataPlane.load(path) if path.exists() else
             ExperienceDataPlane(spec=spec, capacity=256, batch_size=8,
                                 schedule=Schedule(1, 1, 0, 1)))
    rng = random.Random(seed)
    start = plane.buffer.total_written
    with open(Path(folder, "log.txt"), "a") as log:
        while True:
            n = rng.randint(1, 40)
            plane.push(make_rows(spec, n, start=start))
            start += n
            log.write(f"begin {start}\n")
            log.flush()
            plane.save(path)
            log.write(f"done {start}\n")
            log.flush()


def test_sigkill_during_snapshots_always_leaves_a_completed_snapshot(small_spec, tmp_path):
    Path(tmp_path, "spec.json").write_text(json.dumps(small_spec.to_dict()))
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(0)
    kills = 0
    deadline = time.monotonic() + 90
    while kills < 20 and time.monotonic() < deadline:
        child = ctx.Process(target=_snapshotting_child, args=(str(tmp_path), kills))
        child.start()
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        kills += 1
        path = tmp_path / "buffer.ckpt"
        if not path.exists():
            continue
        lines = (tmp_path / "log.txt").read_text().split()
        begun = {int(v) for k, v in zip(lines[::2], lines[1::2]) if k == "begin"}
        with ExperienceDataPlane.load(path) as back:
            total = back.buffer.total_written
            assert total in begun  # a snapshot that was being written or completed
            ids = back.buffer.store.get(torch.arange(len(back.buffer)))["id"]
            assert sorted(ids.tolist()) == list(range(total - len(back.buffer), total))
            want = make_rows(small_spec, 1, start=int(ids[0]))["obs"][0]
            assert torch.equal(back.buffer.store.get(torch.tensor([0]))["obs"][0], want)
    assert kills >= 20


def test_a_plane_on_a_memory_mapped_store_keeps_its_rows_in_files(small_spec, tmp_path):
    from conduit.storage import MemmapColumnStore

    store = MemmapColumnStore(directory=tmp_path / "cols", spec=small_spec, capacity=64)
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=8, store=store,
                             schedule=Schedule(1, 1, 1, 1)) as plane:
        plane.push(make_rows(small_spec, 40))
        assert plane.pull()["obs"].shape == (8, 4)
        plane.save(tmp_path / "p.ckpt")
    store.flush()
    reopened = MemmapColumnStore(directory=tmp_path / "cols", spec=small_spec, capacity=64)
    assert reopened.get(torch.arange(40))["id"].tolist() == list(range(40))
    again = MemmapColumnStore(directory=tmp_path / "cols2", spec=small_spec, capacity=64)
    with ExperienceDataPlane.load(tmp_path / "p.ckpt", store=again) as back:
        assert len(back.buffer) == 40 and back.buffer.store is again
        assert again.get(torch.arange(40))["id"].tolist() == list(range(40))


def test_a_snapshot_holds_writes_but_not_off_policy_reads(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                             schedule=Schedule(1, 1, 1, 1)) as plane:
        plane.push(make_rows(small_spec, 32))
        plane.flush()
        with plane.frozen(flush=False, reads=True) as state:
            plane.push(make_rows(small_spec, 8, start=100))  # queued, not ingested
            for _ in range(3):
                assert plane.pull(timeout=5)["obs"].shape == (4, 4)  # delivery goes on
            assert len(plane.buffer) == 32 and state["buffer"]["writer"]["size"] == 32
        plane.flush()
        assert len(plane.buffer) == 40


def test_a_push_waiting_while_writes_are_held_waits_instead_of_spinning(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                             schedule=Schedule(0, 1, 0, 1)) as plane:
        plane.push(make_rows(small_spec, 8))
        with plane.frozen(flush=False, reads=True):
            plane.push(make_rows(small_spec, 2, start=10))
            plane.push(make_rows(small_spec, 2, start=12))  # the queue (2 units) is full
            with pytest.raises(BackpressureTimeout):
                plane.push(make_rows(small_spec, 2, start=14), timeout=0.3)
            assert plane.pull(timeout=5)["obs"].shape == (4, 4)
        plane.flush()
        assert len(plane.buffer) == 12


@pytest.mark.parametrize("double_buffer", [True, False], ids=["double-buffer", "stream"])
def test_a_snapshot_taken_while_pushes_go_on_is_the_plane_at_one_instant(small_spec, tmp_path,
                                                                         double_buffer):
    with ExperienceDataPlane(spec=small_spec, capacity=3000, batch_size=8,
                             schedule=Schedule(1, 1, 1, 1)) as plane:
        plane.push(make_rows(small_spec, 3000))
        plane.flush()
        stop = threading.Event()

        def pusher():
            k = 0
            while not stop.is_set():
                plane.push(make_rows(small_spec, 50, start=10_000 + 50 * k), timeout=10)
                k += 1

        t = threading.Thread(target=pusher)
        t.start()
        try:
            with plane.snapshots(tmp_path / "s.ckpt", every_s=3600,
                                 double_buffer=double_buffer) as snap:
                for _ in range(3):
                    snap.request(wait=True)
                    assert snap.stats.failures == 0, snap.last_error
                    loaded = ExperienceDataPlane.load(tmp_path / "s.ckpt")
                    with loaded:
                        buf = loaded.buffer
                        (_, cols), = buf.filled_blocks()
                        # every slot holds the row its id says (pushed rows: id + 7000), and
                        # the writer agrees
                        ids = torch.from_numpy(buf._row_id)
                        assert torch.equal(cols["id"], torch.where(ids < 3000, ids, ids + 7000))
                        assert int(ids.max()) + 1 == buf.total_written
        finally:
            stop.set()
            t.join()
        assert plane.buffer.total_written > 3000


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="per-thread policies need Linux")
def test_snapshots_copy_and_write_at_the_lowest_priority(small_spec, tmp_path):
    """The copy and the write run under SCHED_IDLE (a waking normal thread preempts them);
    the calling thread keeps its policy."""
    me = threading.get_native_id()
    policy = os.sched_getscheduler(me)
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4) as plane:
        plane.push(make_rows(small_spec, 16))
        with plane.snapshots(tmp_path / "s.ckpt", every_s=3600) as snap:
            worker = snap._io.submit(threading.get_native_id).result()
            assert worker != me
            assert os.sched_getscheduler(worker) == os.SCHED_IDLE
            assert os.sched_getscheduler(me) == policy != os.SCHED_IDLE
            snap.request(wait=True)
            assert snap.stats.snapshots == 1 and snap.stats.failures == 0


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread priorities need Linux")
def test_lowest_priority_falls_back_to_nice_19_where_sched_idle_is_refused(monkeypatch):
    from conduit.plane import checkpoint

    def refused(*_):
        raise PermissionError("sched_setscheduler refused")

    monkeypatch.setattr(os, "sched_setscheduler", refused)
    got = {}

    def probe():
        checkpoint._lowest_priority()
        tid = threading.get_native_id()
        got.update(nice=os.getpriority(os.PRIO_PROCESS, tid), policy=os.sched_getscheduler(tid))

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert got == {"nice": 19, "policy": os.sched_getscheduler(threading.get_native_id())}


def test_a_snapshot_that_fails_to_start_is_not_left_tracked(small_spec, tmp_path, monkeypatch):
    from conduit.plane import checkpoint

    def broken(*_):
        raise RuntimeError("layout failed")

    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4) as plane:
        plane.push(make_rows(small_spec, 16))
        monkeypatch.setattr(checkpoint, "_layout", broken)
        with plane.snapshots(tmp_path / "s.ckpt", every_s=3600) as snap:
            with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="layout"):
                snap.request(wait=True)
            assert snap.stats.failures == 1 and "layout failed" in str(snap.last_error)
        assert plane.buffer._snapshots == []  # later writes copy into no stale snapshot
        plane.push(make_rows(small_spec, 8, start=100))
        plane.flush()
        assert len(plane.buffer) == 24


def _corrupt(state, path, value):
    *keys, last = path
    for k in keys:
        state = state[k]
    state[last] = value


@pytest.mark.parametrize(("path", "value"), [
    (("flow", "policy_version"), -1), (("flow", "iter_written_rows"), 7),
    (("buffer", "sampler", "parts"), [torch.arange(3)]),
    (("buffer", "row_id"), torch.zeros(3, dtype=torch.int64)),
    (("buffer", "store", "columns", "obs"), torch.zeros(8, 5))], ids=lambda v: str(v)[:30])
def test_a_state_that_is_refused_changes_nothing(small_spec, path, value):
    """Defect: the buffer (rows, cursor, sampler) was loaded before the flow's entry was
    checked, so a refused state left the plane half restored: the next iteration delivered
    some rows twice and others never. A refused state now leaves the plane as it was."""
    with ExperienceDataPlane(spec=small_spec, capacity=8, mode="on_policy",
                             num_minibatches=2) as source:
        source.push(make_rows(small_spec, 8, start=100))
        next(iter(source.minibatches()))
        state = source.state_dict()
    _corrupt(state, path, value)
    with ExperienceDataPlane(spec=small_spec, capacity=8, mode="on_policy",
                             num_minibatches=2) as p:
        p.push(make_rows(small_spec, 4))
        before = p.state_dict()
        with pytest.raises((StateError, SpecError)):
            p.load_state_dict(state)
        after = p.state_dict()
        assert after["flow"] == before["flow"] and len(p.buffer) == 4
        for key in ("row_id", "delivered_id"):
            assert torch.equal(after["buffer"][key], before["buffer"][key])
        assert torch.equal(after["buffer"]["store"]["columns"]["id"],
                           before["buffer"]["store"]["columns"]["id"])
        p.push(make_rows(small_spec, 4, start=4))
        got = [i for b in p.minibatches() for i in b["id"].tolist()]
        assert sorted(got) == list(range(8))


def test_a_snapshot_request_on_a_closed_plane_is_refused_at_once(small_spec, tmp_path):
    """Defect: after the plane closed, ``request(wait=True)`` waited out its whole timeout and
    raised a TimeoutError, and a snapshotter could be started on a closed plane."""
    from conduit.errors import PlaneClosedError

    plane = ExperienceDataPlane(spec=small_spec, capacity=16, batch_size=4, timeout=30)
    plane.push(make_rows(small_spec, 8))
    snap = plane.snapshots(tmp_path / "s.ckpt", every_s=3600)
    try:
        snap.request(wait=True, timeout=30)
        plane.close()
        with pytest.raises(PlaneClosedError):
            snap.request(wait=True, timeout=30)
    finally:
        snap.close()
    with ExperienceDataPlane.load(tmp_path / "s.ckpt") as back:
        assert back.buffer.total_written == 8
    with pytest.raises(PlaneClosedError):
        plane.snapshots(tmp_path / "t.ckpt", every_s=3600)


@pytest.mark.parametrize(("override", "error", "field"), [
    ({"schedule": Schedule(1, 9, 1, 1)}, "ScheduleError", None),
    ({"batch_size": 0}, "ConfigError", "batch_size"),
    ({"placment": Placement.pageable()}, "ConfigError", "placment"),
    ({"sampler": "prioritised"}, "ConfigError", "sampler"),
    ({"timeout": float("nan")}, "ConfigError", "timeout"),
])
def test_a_bad_load_override_is_the_callers_error_not_a_corrupt_file(small_spec, tmp_path,
                                                                      override, error, field):
    """Defect: a bad override to ``load`` was reported as a corrupt file (CheckpointError
    'the header does not describe a plane'), its typed error hidden in ``__cause__``."""
    with ExperienceDataPlane(spec=small_spec, capacity=16, batch_size=4) as plane:
        plane.push(make_rows(small_spec, 8))
        info = plane.save(tmp_path / "p.ckpt")
    with pytest.raises(Exception) as ei:
        ExperienceDataPlane.load(info.path, **override)
    assert type(ei.value).__name__ == error and not isinstance(ei.value, CheckpointError)
    if field is not None:
        assert ei.value.field == field
    with ExperienceDataPlane.load(info.path) as back:  # the file itself is fine
        assert back.buffer.total_written == 8


@pytest.mark.parametrize("schedule", [Schedule(1, 1, 1, 0.5), Schedule(0, 1, 0, 0.5)],
                         ids=lambda s: s.label())
def test_an_on_policy_state_is_not_loaded_over_queued_units(small_spec, schedule):
    """Defect: loading an on-policy state into a plane whose pushed units still waited for
    ingestion kept them: they were ingested into the loaded iteration (a latched
    CapacityError, rows lost) or delivered with the next iteration (rows of an older policy).
    The load is refused and changes nothing; after a flush it loads."""
    kw = {"spec": small_spec, "capacity": 16, "mode": "on_policy", "num_minibatches": 2,
          "schedule": schedule, "seed": 5}
    with ExperienceDataPlane(**kw) as src:
        src.push(make_rows(small_spec, 16, start=500))
        src.pull()
        state = src.state_dict()
        rest = src.pull()
    with ExperienceDataPlane(**kw) as plane:
        plane.push(make_rows(small_spec, 8))  # half an iteration, queued (g_ing = 1)
        assert plane.stats()["pending_units"] == 1
        with pytest.raises(StateError) as ei:
            plane.load_state_dict(state)
        assert ei.value.key == "pending" and plane.stats()["pending_units"] == 1
        plane.flush()
        plane.load_state_dict(state)
        assert same(plane.pull(), rest) and plane.policy_version == 1
        plane.push(make_rows(small_spec, 16, start=1000), policy_version=1)
        ids = sorted(i for b in plane.minibatches() for i in b["id"].tolist())
        assert ids == list(range(1000, 1016))


@pytest.mark.parametrize("mutate", [
    lambda m: m["rows"][0].update(start=3),  # loaded before: rows in the wrong slots
    lambda m: m["rows"][0].update(start=-3),
    lambda m: m["rows"][0].update(start=12),
    lambda m: m["rows"][0].update(start="abc"),
    lambda m: m.update(rows=5),
    lambda m: m["state"]["buffer"].update(writer=7),
    lambda m: m["state"]["buffer"].update(row_id={"$tensor": [1]}),
    lambda m: m.update(spec=5),
], ids=["start-3", "start-neg", "start-past", "start-str", "rows-int", "writer-int",
        "tensor-list", "spec-int"])
def test_a_header_with_values_of_the_wrong_shape_is_a_checkpoint_error(small_spec, tmp_path,
                                                                       mutate):
    """Defect: a header whose checksum holds but whose values have the wrong types raised
    raw TypeError/ValueError/AttributeError, and a row block saved at another start loaded
    its rows into the wrong slots."""
    with ExperienceDataPlane(spec=small_spec, capacity=16, batch_size=4) as plane:
        plane.push(make_rows(small_spec, 10))
        info = plane.save(tmp_path / "p.ckpt")
    meta, parts = read_checkpoint(info.path)
    mutate(meta)
    write_checkpoint(info.path, tensors=parts, meta=meta)
    with pytest.raises(CheckpointError):
        ExperienceDataPlane.load(info.path)


def test_a_state_of_another_capacity_is_refused_naming_the_capacity(small_spec):
    """Defect: the refusal blamed the writer's cursor, not the capacity the state was of."""
    with ExperienceDataPlane(spec=small_spec, capacity=8, batch_size=4) as small:
        small.push(make_rows(small_spec, 8))
        state = small.state_dict()
    with ExperienceDataPlane(spec=small_spec, capacity=16, batch_size=4) as plane:
        plane.push(make_rows(small_spec, 3))
        with pytest.raises(StateError, match="capacity=8") as ei:
            plane.load_state_dict(state)
        assert ei.value.key == "buffer.row_id" and len(plane.buffer) == 3
