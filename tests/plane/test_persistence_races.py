"""Persistence under concurrency: migrations with queued units, snapshot headers racing a
migration, holds past the timeout, request(wait=True) ordering, save targets that are not
regular files, load overrides and snapshotters outliving their plane."""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest
import torch

from conduit import ExperienceDataPlane, ExperienceSpec, Placement, Schedule
from conduit.errors import ConfigError, OperatorError
from conduit.storage import ExperienceBuffer, read_checkpoint


def spec_of(width: int) -> ExperienceSpec:
    return ExperienceSpec.of(obs=((width,), torch.float32), id=((), torch.int64))


def rows(start: int, n: int, width: int = 4) -> dict[str, torch.Tensor]:
    ids = torch.arange(start, start + n)
    return {"obs": ids.float()[:, None].repeat(1, width), "id": ids}


@pytest.mark.parametrize("schedule", [Schedule(0, 2, 0, 1), Schedule(1, 2, 1, 1)],
                         ids=["inline", "overlapped"])
def test_migrate_wider_keeps_units_queued_before_it(schedule):
    p = ExperienceDataPlane(spec=spec_of(4), capacity=100, batch_size=4, schedule=schedule,
                            timeout=5)
    try:
        p.push(rows(0, 10))
        p.push(rows(10, 10))
        p.push(rows(20, 10))  # acknowledged; waits for a second unit (g_ing=2)
        p.migrate(Placement.pageable(), spec=spec_of(6))
        p.flush()
        assert len(p.buffer) == 30
        ids = p.buffer.store.get(torch.arange(30))["id"]
        assert sorted(ids.tolist()) == list(range(30))
        obs = p.buffer.store.get(torch.arange(30))["obs"]
        assert obs.shape == (30, 6)
        assert torch.equal(obs[:, 4:], torch.zeros(30, 2))  # old rows zero-padded
        assert torch.equal(obs[:, 0], ids.float())
    finally:
        p.close()
    assert p.counters["lost_rows"] == 0
    assert p.counters["ingested_rows"] == 30


def test_migrate_wider_on_policy_keeps_the_queued_unit_and_the_next_push():
    p = ExperienceDataPlane(spec=spec_of(4), capacity=16, mode="on_policy",
                            num_minibatches=2, timeout=5)
    try:
        p.push({"obs": torch.ones(8, 4), "id": torch.arange(8)})  # queued
        p.migrate(Placement.pageable(), spec=spec_of(6))
        p.push({"obs": torch.full((8, 6), 2.0), "id": torch.arange(8, 16)})  # the new spec
        got = [p.pull(), p.pull()]
        ids = torch.cat([b["id"] for b in got])
        assert sorted(ids.tolist()) == list(range(16))
        obs = torch.cat([b["obs"] for b in got])
        assert obs.shape == (16, 6)
    finally:
        p.close()
    assert p.counters["lost_rows"] == 0


def test_snapshot_header_describes_its_rows_when_a_migration_lands_after_the_instant(
        tmp_path, monkeypatch):
    path = tmp_path / "snap.ckpt"
    p = ExperienceDataPlane(spec=spec_of(4), capacity=100, batch_size=4,
                            schedule=Schedule(1, 1, 1, 1), timeout=5)
    snap = p.snapshots(path, every_s=float("inf"))
    try:
        p.push(rows(0, 30))
        real = ExperienceBuffer.begin_snapshot

        def begin_then_migrate(self, **kw):
            out = real(self, **kw)
            t = threading.Thread(target=lambda: p.migrate(Placement.pageable(),
                                                          spec=spec_of(6)))
            t.start()
            t.join()
            return out

        monkeypatch.setattr(ExperienceBuffer, "begin_snapshot", begin_then_migrate)
        snap.request(wait=True)
        monkeypatch.setattr(ExperienceBuffer, "begin_snapshot", real)
        assert snap.stats.failures == 0
        assert p.spec == spec_of(6)
        with ExperienceDataPlane.load(path) as q:  # the rows as they were at the instant
            assert q.spec == spec_of(4)
            assert len(q.buffer) == 30
            assert sorted(q.buffer.store.get(torch.arange(30))["id"].tolist()) == list(range(30))
    finally:
        snap.close()
        p.close()


def test_save_and_state_dict_give_up_after_the_timeout_on_a_stuck_operator(tmp_path):
    p = ExperienceDataPlane(spec=spec_of(4), capacity=64, batch_size=2,
                            schedule=Schedule(1, 1, 0, 1), timeout=0.5)
    entered, release = threading.Event(), threading.Event()
    try:
        p.push(rows(0, 8))
        p.flush()

        @p.register_ingestion()
        def hangs(actor_in, exp_out):
            entered.set()
            release.wait(30)
            exp_out.write(actor_in.read())

        p.push(rows(8, 3))
        assert entered.wait(10)
        with pytest.raises(OperatorError), p.paused():
            pass
        assert p.failed is not None  # latched: save() and state_dict() skip the flush
        for call in (lambda: p.save(tmp_path / "x.ckpt"), lambda: p.state_dict(rows=False)):
            t0 = time.perf_counter()
            with pytest.raises(OperatorError) as info:
                call()
            assert time.perf_counter() - t0 < 5
            assert isinstance(info.value.__cause__, TimeoutError)
            assert "ingestion" in str(info.value)
        assert not (tmp_path / "x.ckpt").exists()
        release.set()
        deadline = time.perf_counter() + 10
        while p.stats()["pending_units"] or p._engine.runtime.busy:
            assert time.perf_counter() < deadline
            time.sleep(0.05)
        p.recover()
        p.save(tmp_path / "x.ckpt")  # usable again
        assert p.state_dict(rows=False)["counters"]["ingested_rows"] == 11
    finally:
        release.set()
        p.close()
    with ExperienceDataPlane.load(tmp_path / "x.ckpt") as q:
        assert len(q.buffer) == 11


def test_request_wait_returns_a_snapshot_begun_after_the_call(tmp_path, monkeypatch):
    path = tmp_path / "r.ckpt"
    p = ExperienceDataPlane(spec=spec_of(4), capacity=100, batch_size=4,
                            schedule=Schedule(0, 1, 0, 1), timeout=5)
    snap = p.snapshots(path, every_s=float("inf"))
    try:
        p.push(rows(0, 10))
        in_write, go_on = threading.Event(), threading.Event()
        real = snap._write

        def slow_write(*args):
            in_write.set()
            assert go_on.wait(10)
            return real(*args)

        monkeypatch.setattr(snap, "_write", slow_write)
        first = threading.Thread(target=lambda: snap.request(wait=True))
        first.start()
        assert in_write.wait(10)  # an older snapshot is being written
        p.push(rows(10, 1))
        p.flush()
        threading.Timer(0.3, go_on.set).start()
        snap.request(wait=True)
        first.join(10)
        meta, _ = read_checkpoint(path, verify=False)
        assert sum(b["rows"] for b in meta["rows"]) == 11
        assert snap.stats.snapshots == 2
    finally:
        go_on.set()
        snap.close()
        p.close()


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_save_onto_something_not_a_regular_file_is_refused_before_pausing(tmp_path, kind):
    target = tmp_path / "target"
    if kind == "folder":
        target.mkdir()
    else:
        if not hasattr(os, "mkfifo"):
            pytest.skip("no FIFOs here")
        os.mkfifo(target)
    p = ExperienceDataPlane(spec=spec_of(4), capacity=64, batch_size=2, timeout=5)
    try:
        p.push(rows(0, 8))
        paused = []
        real = p._engine.quiesced
        p._engine.quiesced = lambda: paused.append(1) or real()  # type: ignore[method-assign]
        with pytest.raises(ConfigError) as info:
            p.save(target)
        assert info.value.field == "path"
        assert not paused  # refused before the operators were held
        assert (target.is_dir() if kind == "folder" else target.is_fifo())
        assert list(tmp_path.iterdir()) == [target]  # no temporary file left either
        with pytest.raises(ConfigError) as info:
            p.snapshots(target, every_s=float("inf"))
        assert info.value.field == "path"
    finally:
        p.close()


def test_save_refuses_a_device_node(tmp_path):
    node = tmp_path / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # like /dev/null
    except (AttributeError, OSError):
        pytest.skip("cannot make a device node here (needs root)")
    with ExperienceDataPlane(spec=spec_of(4), capacity=64, batch_size=2) as p:
        p.push(rows(0, 8))
        with pytest.raises(ConfigError) as info:
            p.save(node)
        assert info.value.field == "path"
    assert stat.S_ISCHR(os.stat(node).st_mode)  # still the device node


def test_load_refuses_a_seed_override_it_would_not_use(tmp_path):
    path = tmp_path / "s.ckpt"
    with ExperienceDataPlane(spec=spec_of(4), capacity=64, batch_size=2, seed=3) as p:
        p.push(rows(0, 8))
        p.save(path)
    with pytest.raises(ConfigError) as info:
        ExperienceDataPlane.load(path, seed=99)
    assert info.value.field == "seed"
    with ExperienceDataPlane.load(path, seed=3) as q:  # the saved seed is accepted
        assert q.config.seed == 3


def test_plane_close_stops_its_snapshotters(tmp_path):
    before = set(threading.enumerate())
    with ExperienceDataPlane(spec=spec_of(4), capacity=64, batch_size=2) as p:
        p.push(rows(0, 8))
        s = p.snapshots(tmp_path / "c.ckpt", every_s=float("inf"))
        s.request(wait=True)
    left = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not left, [t.name for t in left]
    s.close()  # closing it again is harmless
