"""Snapshot threads that outlived their bounds, temporary files nobody removed, and files or
overrides whose inconsistency loaded silently or blamed the wrong party. Each test names the
defect it guards."""

from __future__ import annotations

import copy
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from conduit import CheckpointError, ConfigError, ExperienceDataPlane, ExperienceSpec, StateError
from conduit.plane import checkpoint
from conduit.storage import PrioritizedSampler, read_checkpoint, write_checkpoint
from conduit.storage import checkpoint as files
from conduit.storage.state import array
from tests.conftest import make_rows

SRC = str(Path(__file__).parents[2] / "src")
WIDE_ROW = ExperienceSpec.of(x=((1024,), torch.float32), id=((), torch.int64))


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def _wait_until(check, seconds: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + seconds
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


# --- close() is bounded while a snapshot is being written ------------------------------------

def test_plane_close_is_bounded_by_its_timeout_while_a_snapshot_write_does_not_return(
        tmp_path, monkeypatch):
    """Defect: Snapshotter.close joined its thread, and the thread waited on the write,
    without a timeout, so plane.close() blocked for as long as the write did (12.7 s with
    timeout=2 on a loaded machine)."""
    path = tmp_path / "s.ckpt"
    plane = ExperienceDataPlane(spec=WIDE_ROW, capacity=64, batch_size=4, timeout=1)
    release = threading.Event()
    try:
        plane.push(make_rows(WIDE_ROW, 16))
        snap = plane.snapshots(path, every_s=3600)
        snap.request(wait=True)  # the previous snapshot: 16 rows
        plane.push(make_rows(WIDE_ROW, 16, start=16))
        entered = threading.Event()
        real = checkpoint.write_checkpoint

        def stuck(*args, **kwargs):  # type: ignore[no-untyped-def]
            entered.set()
            release.wait(30)  # a write that does not return (a hung disk)
            return real(*args, **kwargs)

        monkeypatch.setattr(checkpoint, "write_checkpoint", stuck)
        snap.request()
        assert entered.wait(30)
        t0 = time.monotonic()
        with pytest.warns(RuntimeWarning, match="abandoned"):
            plane.close()
        took = time.monotonic() - t0
    finally:
        release.set()
        plane.close()
    assert took < 15  # the plane's timeout is 1 s; the write was held for 30
    with ExperienceDataPlane.load(path) as back:  # the previous snapshot, intact
        assert sorted(back.buffer.store.column("id")[:len(back.buffer)].tolist()) == \
            list(range(16))
    assert _wait_until(lambda: not _temporaries(tmp_path))  # the worker removed its file


def test_a_snapshot_unfinished_at_close_is_abandoned_and_its_temporary_file_removed(
        tmp_path, monkeypatch):
    """Defect: close() let a slow snapshot run to its end however long it took; the write is
    now abandoned at the deadline: the previous file stays, the temporary file goes."""
    path = tmp_path / "s.ckpt"
    plane = ExperienceDataPlane(spec=WIDE_ROW, capacity=4096, batch_size=4, timeout=1)
    try:
        plane.push(make_rows(WIDE_ROW, 16))
        snap = plane.snapshots(path, every_s=3600)
        snap.request(wait=True)  # the previous snapshot: 16 rows
        plane.push(make_rows(WIDE_ROW, 4000, start=16))  # 16 MiB: several chunks per column
        plane.flush()
        real, started = files.crc32, threading.Event()

        def slow_crc(data, value=0):  # type: ignore[no-untyped-def]
            if threading.current_thread().name == "conduit-snapshot-io":
                started.set()
                time.sleep(0.3)  # a slow disk: each chunk takes 0.3 s
            return real(data, value)

        monkeypatch.setattr(files, "crc32", slow_crc)
        snap.request()
        assert started.wait(30)
        with pytest.warns(RuntimeWarning, match="abandoned"):
            plane.close()
        monkeypatch.setattr(files, "crc32", real)
    finally:
        plane.close()
    assert _wait_until(lambda: not _temporaries(tmp_path))
    with ExperienceDataPlane.load(path) as back:  # not the abandoned snapshot's 4016 rows
        assert len(back.buffer) == 16
    assert snap.stats.failures == 0 and snap.last_error is None  # abandoned, not failed


# --- snapshots go on after the main thread returns ------------------------------------------

_TRAINER = textwrap.dedent("""
    import threading, time, tempfile, os, torch, conduit
    spec = conduit.ExperienceSpec.of(x=((2,), torch.float32))
    plane = conduit.ExperienceDataPlane(spec=spec, capacity=1000, batch_size=4)
    path = os.path.join(tempfile.mkdtemp(), "s.ckpt")
    snap = plane.snapshots(path, every_s=0.2)
    started = threading.Event()
    def trainer():
        started.set()
        time.sleep(0.5)  # the main thread has returned by now
        for i in range(10):
            plane.push({"x": torch.full((4, 2), float(i))}); time.sleep(0.1)
        try:
            snap.request(wait=True, timeout=60)
            with conduit.ExperienceDataPlane.load(path) as back:
                rows = len(back.buffer)
        except Exception as exc:
            rows = repr(exc)
        print("RESULT", rows, snap.stats.failures, repr(snap.last_error), flush=True)
        plane.close()
    threading.Thread(target=trainer).start()
    started.wait()
""")


def test_snapshots_go_on_after_the_main_thread_returns_while_training_goes_on():
    """Defect: the snapshot writer was a ThreadPoolExecutor, which the interpreter shuts down
    once the main thread returns: every later snapshot failed ("cannot schedule new futures
    after shutdown") while non-daemon threads went on training."""
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, "-W", "ignore::RuntimeWarning", "-c", _TRAINER],
                          capture_output=True, text=True, timeout=240, env=env)
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert result == ["RESULT 40 0 None"], (done.stdout, done.stderr[-2000:])


# --- a closed snapshotter frees its second buffer --------------------------------------------

def test_a_closed_snapshotter_frees_the_copy_of_the_rows_it_kept(tmp_path):
    """Defect: the double buffer (a full copy of the rows, kept between snapshots) stayed
    alive with the closed snapshotter until the object was dropped."""
    with ExperienceDataPlane(spec=WIDE_ROW, capacity=256, batch_size=4) as plane:
        plane.push(make_rows(WIDE_ROW, 256))
        snap = plane.snapshots(tmp_path / "s.ckpt", every_s=3600)
        snap.request(wait=True)
        kept = [weakref.ref(t) for t in snap._spare.values()]
        assert kept  # the copy, kept for the next snapshot
        snap.close()
        gc.collect()
        assert all(ref() is None for ref in kept)
        assert (tmp_path / "s.ckpt").exists()


# --- temporary files of killed saves are removed --------------------------------------------

_KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    from conduit.storage.checkpoint import atomic_write
    with atomic_write(sys.argv[1]) as f:
        f.write(b"\\0" * 65536)
        f.flush()
        if sys.argv[2] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)  # preempted mid-save
        print("writing", flush=True)
        sys.stdin.read()  # a live writer: holds its temporary file until told to stop
        raise SystemExit(3)
""")


def test_a_save_removes_the_temporary_files_killed_saves_of_its_path_left(small_spec,
                                                                          tmp_path):
    """Defect: each save killed part way left its full-size temporary file behind, and none
    was ever removed."""
    env = {**os.environ, "PYTHONPATH": SRC}
    path, other = tmp_path / "buf.ckpt", tmp_path / "other.ckpt"
    live = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path), "live"],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout is not None and live.stdout.readline() == "writing\n"
        for target in (path, other):
            killed = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(target),
                                     "kill"], env=env, timeout=120)
            assert killed.returncode == -signal.SIGKILL
        assert len(_temporaries(tmp_path)) == 3
        with ExperienceDataPlane(spec=small_spec, capacity=16, batch_size=4) as plane:
            plane.push(make_rows(small_spec, 8))
            plane.save(path)
        left = _temporaries(tmp_path)
        # the live writer's file and the other path's stay; the dead one of path goes
        assert len(left) == 2
        assert all(name.startswith(".other.ckpt.") or f"-{live.pid}." in name
                   for name in left)
    finally:
        assert live.stdin is not None
        live.stdin.close()
        live.wait(timeout=60)
    with ExperienceDataPlane.load(path) as back:
        assert len(back.buffer) == 8


# --- overrides that do not fit the saved state name themselves ------------------------------

ADV = ExperienceSpec.of(adv=((), torch.float32))


def _saved_mid_second_epoch(path: Path) -> Path:
    with ExperienceDataPlane(spec=ADV, capacity=64, mode="on_policy", batch_size=16,
                             num_minibatches=4, num_epochs=2, seed=3) as plane:
        plane.push({"adv": torch.arange(64.0)})
        for _ in range(5):  # the first mini-batch of the second epoch
            plane.pull()
        plane.save(path)
    return path


def test_a_num_epochs_override_that_the_saved_iteration_has_passed_is_named(tmp_path):
    """Defect: loading a file saved part way through epoch 2 with num_epochs=1 raised
    CheckpointError (part 'flow.delivered_in_iter'), blaming a sound file."""
    path = _saved_mid_second_epoch(tmp_path / "ck")
    with pytest.raises(ConfigError) as err:
        ExperienceDataPlane.load(path, num_epochs=1)
    assert not isinstance(err.value, CheckpointError) and err.value.field == "num_epochs"
    assert "num_epochs=2" in str(err.value)
    with ExperienceDataPlane.load(path, num_epochs=2) as back:  # the saved value loads
        assert back.pull()["adv"].numel() == 16
    # a corrupt iteration state under an override of the saved value is the file's fault
    meta, parts = read_checkpoint(path)
    meta["state"]["flow"]["delivered_in_iter"] = 99
    write_checkpoint(path, tensors=parts, meta=meta)
    with pytest.raises(CheckpointError) as err:
        ExperienceDataPlane.load(path, num_epochs=2)
    assert err.value.part == "flow.delivered_in_iter"


def test_the_override_that_does_not_fit_the_saved_sampler_is_the_one_named(tmp_path):
    """Defect: with num_minibatches=2 and batch_size=32 the error named batch_size (the first
    changed key in a fixed order) while its message said num_minibatches differs."""
    path = _saved_mid_second_epoch(tmp_path / "ck")
    for overrides in ({"num_minibatches": 2, "batch_size": 32},
                      {"batch_size": 32, "num_minibatches": 2}, {"num_minibatches": 2}):
        with pytest.raises(ConfigError) as err:
            ExperienceDataPlane.load(path, **overrides)
        assert err.value.field == "num_minibatches", overrides


# --- well-formed but inconsistent files are refused, naming the part ------------------------

SPEC = ExperienceSpec.of(obs=((3,), torch.float32), r=((), torch.float32))


@pytest.fixture
def saved(tmp_path):  # type: ignore[no-untyped-def]
    src = tmp_path / "ok.ckpt"
    with ExperienceDataPlane(spec=SPEC, capacity=50, batch_size=8,
                             sampler="prioritized") as plane:
        plane.push({"obs": torch.randn(20, 3), "r": torch.arange(20.0)})
        plane.save(src)
    return read_checkpoint(src)


def _refused(tmp_path: Path, meta: dict, parts: dict) -> CheckpointError:
    bad = tmp_path / "bad.ckpt"
    write_checkpoint(bad, tensors=parts, meta=meta)  # checksums hold
    with pytest.raises(CheckpointError) as err:
        ExperienceDataPlane.load(bad)
    return err.value


def test_a_saved_column_the_header_spec_lacks_is_refused_not_dropped(saved, tmp_path):
    meta, parts = copy.deepcopy(saved[0]), saved[1]
    del meta["spec"]["obs"]
    del meta["state"]["spec"]["obs"]
    assert _refused(tmp_path, meta, parts).part == "rows/0/obs"


@pytest.mark.parametrize(("part", "named"), [("state/buffer/row_id", "buffer.row_id"),
                                             ("state/buffer/delivered_id",
                                              "buffer.delivered_id"),
                                             ("state/buffer/sampler/tree/set", "tree.set")])
def test_a_state_part_of_another_kind_is_refused_not_cast(saved, tmp_path, part, named):
    """Defect: a float64 NaN id part was cast to int64 (and a float flag part to bool)."""
    meta, parts = saved
    parts = {**parts, part: parts[part].double() * float("nan")}
    assert _refused(tmp_path, meta, parts).part == named


@pytest.mark.parametrize(("key", "value"), [("overlap_ing", 1.5), ("overlap_ing", True),
                                            ("overlap_del", "1"), ("g_ing", True),
                                            ("g_del", 0.5)])
def test_a_schedule_value_of_another_type_is_refused_not_coerced(saved, tmp_path, key, value):
    """Defect: int() coerced overlap_ing=1.5 to 1 and true to 1."""
    meta = copy.deepcopy(saved[0])
    meta["schedule"][key] = value
    meta["state"]["schedule"][key] = value
    assert _refused(tmp_path, meta, saved[1]).part == f"schedule.{key}"


def test_a_version_of_true_is_refused(saved, tmp_path):
    """Defect: "version": true passed (True == 1)."""
    meta = copy.deepcopy(saved[0])
    meta["version"] = True
    assert _refused(tmp_path, meta, saved[1]).part == "version"


@pytest.mark.parametrize("key", ["spec", "schedule"])
def test_a_state_whose_copy_of_the_spec_or_schedule_differs_is_refused(saved, tmp_path, key):
    """Defect: the spec and schedule are stored twice (header and state) and the copies were
    never compared."""
    meta = copy.deepcopy(saved[0])
    if key == "spec":
        meta["state"]["spec"]["r"]["dtype"] = "float64"
    else:
        meta["state"]["schedule"]["g_del"] = "1/2"
    assert _refused(tmp_path, meta, saved[1]).part == f"state.{key}"


def test_state_arrays_take_values_as_they_are():
    """The typed lookup refuses a cast that would change values."""
    n = 4
    with pytest.raises(StateError) as err:
        array({"ids": np.full(n, np.nan)}, "ids", "buffer", length=n, dtype=np.int64)
    assert err.value.key == "buffer.ids"
    with pytest.raises(StateError):
        array({"set": np.ones(n)}, "set", "tree", length=n, dtype=bool)
    with pytest.raises(StateError):
        array({"ids": np.full(n, 2**63, dtype=np.uint64)}, "ids", "buffer", length=n,
              dtype=np.int64)
    ok = array({"ids": torch.arange(n, dtype=torch.int32)}, "ids", "buffer", length=n,
               dtype=np.int64)
    assert ok.dtype == np.int64 and ok.tolist() == list(range(n))
    leaves = array({"leaves": np.ones(n, dtype=np.float32)}, "leaves", "tree", length=n,
                   dtype=np.float64)
    assert leaves.dtype == np.float64


# --- a sampler override that would misread the saved priorities is refused ------------------

def _prioritized(path: Path) -> tuple[Path, float, np.ndarray]:
    with ExperienceDataPlane(spec=SPEC, capacity=32, batch_size=8,
                             sampler=PrioritizedSampler(alpha=0.6, seed=7)) as plane:
        plane.push({"obs": torch.randn(32, 3), "r": torch.arange(32.0)})
        batch = plane.pull()
        plane.update_priorities(batch["_index"], torch.linspace(1.0, 9.0, 8))
        plane.save(path)
        sampler = plane.buffer.sampler
        assert sampler.max_priority == 9.0
        return path, sampler.max_priority, sampler.tree.state_dict()["leaves"].numpy().copy()


def test_a_sampler_override_that_would_drop_or_misread_priorities_is_refused(tmp_path):
    """Defect: sampler="uniform" dropped the saved priorities, and alpha=0.9 took leaves
    computed under alpha 0.6, both silently. ``beta`` weighs draws only: an override with
    another beta (annealed) loads the saved priorities as they were."""
    path, max_priority, leaves = _prioritized(tmp_path / "ck")
    for override in ("uniform", PrioritizedSampler(alpha=0.9, seed=7),
                     PrioritizedSampler(eps=1e-2, seed=7)):
        with pytest.raises(ConfigError) as err:
            ExperienceDataPlane.load(path, sampler=override)
        assert not isinstance(err.value, CheckpointError) and err.value.field == "sampler"
        assert "drop the override" in str(err.value)
    with ExperienceDataPlane.load(path, sampler=PrioritizedSampler(alpha=0.6, beta=0.9,
                                                                   seed=7)) as back:
        sampler = back.buffer.sampler
        assert sampler.beta == 0.9 and sampler.max_priority == max_priority
        assert np.array_equal(sampler.tree.state_dict()["leaves"].numpy(), leaves)
