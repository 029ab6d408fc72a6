"""``conduit bench persist``: checkpoint throughput against the disk, the learner's stall
during periodic snapshots, and TorchRL's ``dumps``/``loads`` on the same buffer.

Three measurements in one run, all in one folder:

1. ``plane.save`` and ``ExperienceDataPlane.load`` of a full off-policy buffer, in GB/s of buffer
   rows, next to ``dd``'s own figures for a file of the same size (a write with
   ``conv=fdatasync``, a read to ``/dev/null``). Repetitions alternate Conduit, dd and TorchRL;
   medians are reported. Every write is on disk before its clock stops (TorchRL's files are
   synced after ``dumps``), and every read starts with the file dropped from the page cache
   (``posix_fadvise(POSIX_FADV_DONTNEED)``) where the OS allows it; otherwise the table says
   the reads were cached.
2. The synthetic training loop (push a rollout, pull a batch, a small MLP update) over the same
   full buffer, in segments that alternate without and with a
   :class:`~conduit.plane.checkpoint.Snapshotter` (without, with, with, without, ...), so
   that the host's drift lands on both alike. The stall is the median time an iteration that
   overlapped a snapshot's pause took beyond the median iteration without snapshots, as a
   percentage of the latter (target < 5 %); it is also given against the other iterations
   with snapshots, which tells a pause's own cost from the copy and write running beside the
   loop.
3. TorchRL's ``ReplayBuffer(storage=LazyTensorStorage(n))``: ``dumps`` and ``loads`` of the same
   rows, when the optional ``torchrl`` peer is installed.

Loaded rows are compared with the saved ones by a CRC-32 over every column.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import zlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil
import torch

from conduit.bench.common import PartialJSON, apply_quick, check_rows, parse_quick, progress
from conduit.cli_args import arg, command_parser
from conduit.errors import ConfigError
from conduit.plane import ExperienceDataPlane
from conduit.plane.synthetic import Workload, fill, make_step, register_ops, synthetic_spec
from conduit.report import pyplot, save_figure, table, write_json
from conduit.scheduling.space import Schedule

STALL_TARGET = 0.05
"""The learner's stall during a snapshot, as a fraction of an iteration, that the run aims at."""

PEERS_HINT = "pip install 'conduit-rl[peers]'"

_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


@dataclass(frozen=True)
class PersistBenchArgs:
    """Arguments of ``conduit bench persist``.

    Raises:
        ConfigError: ``segments`` is not an even number >= 2.
    """

    dim: int = arg(1000, "observation dimension (a row holds obs and next_obs: 2 x dim float32)",
                   min=1)
    capacity: int = arg(125_000, "buffer rows, all filled (the default is about 1 GB)", min=1)
    rollout_rows: int = arg(500, "rows per pushed rollout unit", min=1)
    batch_size: int = arg(256, "training batch size of the loop", min=1)
    hidden: int = arg(256, "hidden width of the loop's policy and learner MLPs", min=1)
    compute_threads: int = arg(1, "torch threads for the loop's rollout and update compute", min=1)
    repeats: int = arg(5, "repetitions of every save and load, each starting with the next "
                          "system (medians are reported)", min=1)
    loop_s: float = arg(20.0, "seconds of training without snapshots, and again with them",
                        positive=True)
    segments: int = arg(6, "segments the 2 x loop_s are cut into, alternating without and "
                           "with snapshots (an even number >= 2)", min=2)
    every_s: float = arg(1.0, "seconds between snapshots", positive=True)
    scratch: str = arg("", "folder for every checkpoint and dd file (default: a temporary "
                           "folder under --out, removed afterwards)", output="dir")
    out: str = arg("runs/bench/persist", "output directory for JSON and PNG", output="dir")
    quick: bool = arg(False, "a few MB and a few seconds, for a smoke run (flags given "
                             "explicitly win)")

    def __post_init__(self) -> None:
        s = self.segments
        if isinstance(s, bool) or not isinstance(s, int) or s < 2 or s % 2:
            raise ConfigError("segments", f"must be an even number >= 2, got {s!r}")


#: What ``--quick`` gives the flags left at their defaults.
QUICK = {"dim": 64, "capacity": 8000, "rollout_rows": 100, "batch_size": 64, "hidden": 32,
         "repeats": 2, "loop_s": 1.5, "every_s": 0.2, "segments": 4}


# -- rows and files ----------------------------------------------------------------------------


def plane_rows(plane: ExperienceDataPlane) -> dict[str, torch.Tensor]:
    """Views of the plane's filled rows, one per field (its buffer on one pageable store)."""
    n = len(plane.buffer)
    return {f: plane.buffer.store.column(f)[:n] for f in plane.spec.fields}


def rows_checksum(columns: Mapping[str, torch.Tensor]) -> int:
    """CRC-32 over every column's name and bytes, in name order."""
    crc = 0
    for name in sorted(columns):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(columns[name].contiguous().numpy(), crc)
    return crc


def nbytes(columns: Mapping[str, torch.Tensor]) -> int:
    """Bytes held by ``columns``."""
    return sum(c.numel() * c.element_size() for c in columns.values())


def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def sync_tree(path: Path) -> None:
    """``fsync`` every file under ``path`` (or ``path`` itself), then their folders."""
    files = _files(path)
    for p in [*files, *{f.parent for f in files}]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_page_cache(path: Path) -> bool:
    """Ask the OS to drop the cached pages of ``path`` (every file under a folder); False
    where it cannot (no ``posix_fadvise``, or the call fails)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        for f in _files(path):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    except OSError:
        return False
    return True


def filesystem(folder: Path) -> str:
    """The file system type of the mount holding ``folder`` (``"unknown"`` if not found)."""
    folder = folder.resolve()
    mounts = [p for p in psutil.disk_partitions(all=True)
              if folder.is_relative_to(p.mountpoint)]
    return max(mounts, key=lambda p: len(p.mountpoint)).fstype if mounts else "unknown"


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


# -- the three systems -------------------------------------------------------------------------


class Persister(Protocol):
    """One way to write the rows to ``path`` and read them back.

    Attributes:
        name: Row label.
        how: What is timed, for the table.
        path: The file or folder written (dropped from the page cache before reads).
        nbytes: Bytes moved per save or load, for GB/s.
        file_bytes: Bytes on disk after the latest save.
        warmup_saves: Unmeasured saves before the timed ones, so that every file the timed
            saves write over has been written before.
    """

    name: str
    how: str
    path: Path
    nbytes: int
    file_bytes: int
    warmup_saves: int

    def save(self) -> float:
        """Seconds to write, synced to disk."""

    def load(self, *, check: bool = False) -> tuple[float, int | None]:
        """Seconds to read back, and with ``check`` the :func:`rows_checksum` of what was read
        (None where nothing is checked)."""


class DiskDD:
    """``dd``'s write and read figures for a file of ``mib`` MiB at ``path``."""

    name = "dd"
    how = "dd bs=1M conv=fdatasync / dd of=/dev/null"
    warmup_saves = 1

    def __init__(self, path: Path, mib: int) -> None:
        self.path = path
        self.nbytes = self.file_bytes = mib << 20
        self._mib = mib

    def _dd(self, *operands: str) -> None:
        subprocess.run(["dd", *operands, "bs=1M"], check=True, capture_output=True)

    def save(self) -> float:
        """Seconds to write the file from ``/dev/zero`` and sync it."""
        return _timed(lambda: self._dd("if=/dev/zero", f"of={self.path}", f"count={self._mib}",
                                       "conv=fdatasync"))[0]

    def load(self, *, check: bool = False) -> tuple[float, None]:
        """Seconds to read the file to ``/dev/null`` (nothing to check)."""
        return _timed(lambda: self._dd(f"if={self.path}", "of=/dev/null"))[0], None


def disk_dd(path: Path, mib: int) -> DiskDD | str:
    """A :class:`DiskDD` whose write works here, or the reason it cannot run."""
    if shutil.which("dd") is None:
        return "dd is not on PATH"
    dd = DiskDD(path, mib)
    try:
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", "count=1",
                        "conv=fdatasync"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"dd conv=fdatasync failed: {exc}"
    return dd


class ConduitPlane:
    """``plane.save(path)`` and ``ExperienceDataPlane.load(path)``."""

    name = "conduit"
    how = "plane.save / ExperienceDataPlane.load"
    warmup_saves = 2  # each save writes beside the previous file: two files' worth of blocks

    def __init__(self, plane: ExperienceDataPlane, path: Path) -> None:
        self.plane, self.path = plane, path
        self.nbytes = nbytes(plane_rows(plane))
        self.file_bytes = 0

    def save(self) -> float:
        """Seconds of ``plane.save`` (atomic and synced)."""
        seconds, info = _timed(lambda: self.plane.save(self.path))
        self.file_bytes = info.nbytes
        return seconds

    def load(self, *, check: bool = False) -> tuple[float, int | None]:
        """Seconds of ``ExperienceDataPlane.load``, and the loaded rows' checksum if ``check``."""
        seconds, plane = _timed(lambda: ExperienceDataPlane.load(self.path))
        try:
            return seconds, rows_checksum(plane_rows(plane)) if check else None
        finally:
            plane.close()


class TorchRLBuffer:
    """TorchRL's ``ReplayBuffer(storage=LazyTensorStorage(n))`` holding the same rows.

    Raises:
        ImportError: torchrl or tensordict is not installed.
    """

    name = "torchrl"
    how = "ReplayBuffer(LazyTensorStorage).dumps + fsync / .loads"
    warmup_saves = 1

    def __init__(self, columns: Mapping[str, torch.Tensor], folder: Path) -> None:
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, ReplayBuffer

        logging.getLogger("torchrl").setLevel(logging.WARNING)  # it logs every allocation
        n = next(iter(columns.values())).shape[0]
        self._new = lambda: ReplayBuffer(storage=LazyTensorStorage(n))
        self.rb = self._new()
        self.rb.extend(TensorDict(dict(columns), batch_size=[n]))
        self.fields = tuple(columns)
        self.nbytes = nbytes(columns)
        self.folder = folder
        self.file_bytes = 0
        self._round = 0

    @property
    def path(self) -> Path:
        """The folder of the latest ``dumps``."""
        return self.folder / f"torchrl-{self._round}"

    def save(self) -> float:
        """Seconds of ``dumps`` into a fresh folder plus an ``fsync`` of its files."""
        shutil.rmtree(self.path, ignore_errors=True)
        self._round += 1
        seconds, _ = _timed(lambda: (self.rb.dumps(self.path), sync_tree(self.path)))
        self.file_bytes = sum(f.stat().st_size for f in _files(self.path))
        return seconds

    def load(self, *, check: bool = False) -> tuple[float, int | None]:
        """Seconds of ``loads`` into a new buffer, and the loaded rows' checksum if ``check``."""
        rb = self._new()
        seconds, _ = _timed(lambda: rb.loads(self.path))
        if not check:
            return seconds, None
        data = rb[:len(rb)]
        return seconds, rows_checksum({f: data[f] for f in self.fields})


def torchrl_buffer(columns: Mapping[str, torch.Tensor], folder: Path) -> TorchRLBuffer | str:
    """A :class:`TorchRLBuffer`, or the reason it is skipped."""
    try:
        return TorchRLBuffer(columns, folder)
    except ImportError as exc:
        return f"{exc.name or 'torchrl'} is not installed: {PEERS_HINT}"


# -- measurements ------------------------------------------------------------------------------


def _summary(seconds: list[float], nbytes: int) -> dict[str, Any]:
    med = statistics.median(seconds)
    return {"seconds": seconds, "median_s": med, "gb_per_s": nbytes / 1e9 / med}


def throughput(plane: ExperienceDataPlane, folder: Path, *, repeats: int) -> dict[str, Any]:
    """Save and load GB/s of Conduit, dd and TorchRL, alternating (each repetition starts
    with the next system), with row checks."""
    rows = plane_rows(plane)
    payload, expected = nbytes(rows), rows_checksum(rows)
    systems: list[Persister] = [ConduitPlane(plane, folder / "plane.ckpt")]
    skipped: dict[str, str] = {}
    for name, made in (("dd", disk_dd(folder / "dd.bin", math.ceil(payload / 2**20))),
                       ("torchrl", torchrl_buffer(rows, folder))):
        if isinstance(made, str):
            skipped[name] = made
        else:
            systems.append(made)
    times: dict[str, dict[str, list[float]]] = {s.name: {"save": [], "load": []}
                                                for s in systems}
    match: dict[str, bool] = {}
    dropped = True
    # Unmeasured saves first: the first writes of a run can cost several times the later
    # ones, which would time the machine's state, not the system.
    progress("save warm-up: " + ", ".join(s.name for s in systems))
    for s in systems:
        for _ in range(s.warmup_saves):
            s.save()
    for r in range(repeats):
        # Each repetition starts with another system, so that none always writes first.
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        progress(f"save and load, repetition {r + 1}/{repeats}: "
                 + ", ".join(s.name for s in order))
        for s in order:
            times[s.name]["save"].append(s.save())
        for s in order:
            dropped = drop_page_cache(s.path) and dropped
        for s in order:
            seconds, crc = s.load(check=r == 0)
            times[s.name]["load"].append(seconds)
            if crc is not None:
                match[s.name] = crc == expected
    fs = filesystem(folder)
    cache = ("dropped before every read (posix_fadvise DONTNEED)"
             if dropped and fs not in _MEMORY_FILESYSTEMS else
             f"cached: reads may come from memory ({fs} file system)" if dropped else
             "cached: posix_fadvise is unavailable, reads may come from memory")
    out: dict[str, Any] = {"folder": str(folder), "filesystem": fs, "page_cache": cache,
                           "rows": len(plane.buffer), "bytes": payload, "checksum": expected,
                           "systems": {}}
    for s in systems:
        out["systems"][s.name] = {
            "how": s.how, "file_bytes": s.file_bytes,
            **{op: _summary(t, s.nbytes) for op, t in times[s.name].items()},
            **({"rows_match": match[s.name]} if s.name in match else {})}
    for name, reason in skipped.items():
        out["systems"][name] = {"skipped": reason}
    return out


def training_loop(plane: ExperienceDataPlane, step: Callable[[ExperienceDataPlane], Any], *,
                  seconds: float, warmup: int = 5, snapshot: Path | None = None,
                  every_s: float = 1.0) -> dict[str, Any]:
    """Run ``step`` for ``seconds`` (after ``warmup`` steps), with periodic snapshots to
    ``snapshot`` when given; returns every iteration's seconds, the indices of those during
    which a snapshot's pause ended, and the snapshots' stats."""
    for _ in range(warmup):
        step(plane)
    snaps = plane.snapshots(snapshot, every_s=every_s) if snapshot is not None else None
    iters: list[float] = []
    overlapped: list[int] = []
    try:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            before = len(snaps.stats.pause_s) if snaps else 0
            dt, _ = _timed(lambda: step(plane))
            iters.append(dt)
            if snaps and len(snaps.stats.pause_s) > before:
                overlapped.append(len(iters) - 1)
    finally:
        if snaps is not None:
            snaps.close()
    out: dict[str, Any] = {"iterations_s": iters, "overlapped": overlapped}
    if snaps is not None:
        st = snaps.stats
        out |= {"snapshots": st.snapshots, "pause_s": list(st.pause_s),
                "write_s": list(st.write_s), "failures": st.failures}
    return out


def stall(plane: ExperienceDataPlane, args: PersistBenchArgs, folder: Path) -> dict[str, Any]:
    """The training loop in segments alternating without and with periodic snapshots; the
    learner's stall."""
    step = make_step(Workload(args.dim, args.hidden), rollout_rows=args.rollout_rows)
    seconds = args.loop_s / (args.segments // 2)
    plain: dict[str, Any] = {"iterations_s": [], "overlapped": []}
    snap: dict[str, Any] = {"iterations_s": [], "overlapped": [], "snapshots": 0,
                            "pause_s": [], "write_s": [], "failures": 0}
    before = torch.get_num_threads()
    torch.set_num_threads(args.compute_threads)
    try:
        for k in range(args.segments):
            with_snapshots = k % 4 in (1, 2)
            progress(f"segment {k + 1}/{args.segments}: training loop "
                     + (f"with a snapshot every {args.every_s:g} s" if with_snapshots
                        else "without snapshots") + f" ({seconds:g} s)")
            got = training_loop(plane, step, seconds=seconds,
                                snapshot=folder / "snap.ckpt" if with_snapshots else None,
                                every_s=args.every_s)
            into = snap if with_snapshots else plain
            offset = len(into["iterations_s"])
            into["iterations_s"] += got["iterations_s"]
            into["overlapped"] += [offset + i for i in got["overlapped"]]
            if with_snapshots:
                for key in ("snapshots", "failures", "pause_s", "write_s"):
                    snap[key] += got[key]
    finally:
        torch.set_num_threads(before)
    base = statistics.median(plain["iterations_s"])
    over = [snap["iterations_s"][i] for i in snap["overlapped"]]
    stalled = max(0.0, statistics.median(over) - base) if over else math.nan
    hit = set(snap["overlapped"])
    rest = [t for i, t in enumerate(snap["iterations_s"]) if i not in hit]
    # Against the other iterations with snapshots: a pause's own cost, without the copy's and
    # the write's beside the loop.
    same_run = (max(0.0, statistics.median(over) - statistics.median(rest))
                if over and rest else math.nan)
    return {
        "without": plain, "with": snap,
        "median_iteration_s": base,
        "median_iteration_with_snapshots_s": statistics.median(snap["iterations_s"]),
        "median_overlapped_s": statistics.median(over) if over else math.nan,
        "median_pause_s": statistics.median(snap["pause_s"]) if snap["pause_s"] else math.nan,
        "stall_s": stalled, "stall_fraction": stalled / base,
        "stall_same_run_s": same_run, "stall_same_run_fraction": same_run / base,
        "slowdown": (statistics.fmean(snap["iterations_s"])
                     / statistics.fmean(plain["iterations_s"]) - 1),
        "target_fraction": STALL_TARGET, "target_met": stalled / base < STALL_TARGET,
    }


# -- output ------------------------------------------------------------------------------------


def print_tables(result: dict[str, Any]) -> None:
    """The throughput and stall tables."""
    tp = result["throughput"]
    print(f"\nSave and load of {tp['rows']} rows ({tp['bytes'] / 1e9:.2f} GB) in {tp['folder']} "
          f"({tp['filesystem']}); medians of {result['args']['repeats']}; page cache: "
          f"{tp['page_cache']}")
    dd = tp["systems"].get("dd", {})
    rows = []
    for name, s in tp["systems"].items():
        if "skipped" in s:
            rows.append([name, "-", "-", "-", "-", "-", f"skipped: {s['skipped']}"])
            continue
        ratio = ["-", "-"] if name == "dd" or "skipped" in dd else [
            f"{s[op]['gb_per_s'] / dd[op]['gb_per_s']:.2f}" for op in ("save", "load")]
        rows.append([name, s["save"]["gb_per_s"], s["load"]["gb_per_s"], *ratio,
                     {True: "yes", False: "NO"}.get(s.get("rows_match"), "-"), s["how"]])
    print(table(["system", "save GB/s", "load GB/s", "save / dd", "load / dd", "rows equal",
                 "how"], rows))
    st = result["stall"]
    w = st["with"]
    print(f"\nTraining loop over the same buffer, {result['args']['loop_s']:g} s without and "
          f"{result['args']['loop_s']:g} s with snapshots, in "
          f"{result['args']['segments']} alternating segments; {w['snapshots']} snapshots, "
          f"every {result['args']['every_s']:g} s ({w['failures']} failed)")
    print(table(["iterations", "median iter (ms)", "overlapped iters", "overlapped median (ms)",
                 "pause median (ms)", "stall (ms)", "stall / iter", "vs other snapshot iters",
                 "mean slowdown"],
                [[len(st["without"]["iterations_s"]) + len(w["iterations_s"]),
                  1e3 * st["median_iteration_s"], len(w["overlapped"]),
                  1e3 * st["median_overlapped_s"], 1e3 * st["median_pause_s"],
                  1e3 * st["stall_s"], f"{100 * st['stall_fraction']:.1f}%",
                  f"{100 * st['stall_same_run_fraction']:.1f}%",
                  f"{100 * st['slowdown']:+.1f}%"]]))
    verdict = ("no iteration overlapped a snapshot" if not w["overlapped"] else
               "met" if st["target_met"] else "not met")
    print(f"stall target < {100 * STALL_TARGET:.0f}% of an iteration: {verdict}")


def plot(result: dict[str, Any], path: Path) -> Path | None:
    """GB/s bars and the loop's iteration times; None when matplotlib is absent."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    systems = {n: s for n, s in result["throughput"]["systems"].items() if "skipped" not in s}
    for k, op in enumerate(("save", "load")):
        ax1.bar([i + 0.4 * k for i in range(len(systems))],
                [s[op]["gb_per_s"] for s in systems.values()], width=0.4, label=op)
    ax1.set_xticks([i + 0.2 for i in range(len(systems))], list(systems))
    ax1.set_ylabel("GB/s (median)")
    ax1.set_title("Save and load throughput")
    ax1.legend()
    st = result["stall"]
    for key, label in (("without", "no snapshots"), ("with", "snapshots")):
        ms = [1e3 * t for t in st[key]["iterations_s"]]
        ends = list(itertools.accumulate(st[key]["iterations_s"]))
        ax2.plot(ends, ms, lw=0.8, label=label)
    hit = st["with"]["overlapped"]  # ends and ms are the "with" phase's here
    ax2.plot([ends[i] for i in hit], [ms[i] for i in hit], "rv", label="a snapshot's pause")
    ax2.axhline(1e3 * st["median_iteration_s"] * (1 + STALL_TARGET), color="k", ls="--", lw=0.8,
                label=f"median without + {100 * STALL_TARGET:.0f}%")
    ax2.set_yscale("log")
    ax2.set_xlabel("seconds into the phase")
    ax2.set_ylabel("iteration (ms)")
    ax2.set_title("Learner iterations with and without snapshots")
    ax2.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def effective(args: PersistBenchArgs, given: Collection[str] | None = None
              ) -> PersistBenchArgs:
    """The arguments after ``--quick``: :data:`QUICK` for the flags not given (see
    :func:`~conduit.bench.common.apply_quick`)."""
    return apply_quick(args, QUICK, given)


def fill_units(args: PersistBenchArgs) -> int:
    """Rollout units of ``rollout_rows`` pushed to fill the buffer (the most that fit)."""
    return max(1, args.capacity // args.rollout_rows)


def check_args(args: PersistBenchArgs) -> PersistBenchArgs:
    """``args``, once the plane the benchmark builds and fills would take them.

    Raises:
        ConfigError: ``--batch-size`` exceeds ``--capacity`` (field ``batch_size``), or one
            rollout unit exceeds it or the whole units that fit hold less than one batch
            (field ``rollout_rows``).
    """
    check_rows(batch_size=args.batch_size, capacity=args.capacity,
               rollout_rows=args.rollout_rows)
    filled = fill_units(args) * args.rollout_rows
    if filled < args.batch_size:
        raise ConfigError("rollout_rows", f"the whole units of {args.rollout_rows} rows that "
                                          f"fit in --capacity {args.capacity} hold {filled} "
                                          f"rows, less than one batch of --batch-size "
                                          f"{args.batch_size}; pick a --rollout-rows that "
                                          "divides --capacity")
    return args


def run(args: PersistBenchArgs) -> dict[str, Any]:
    """Run the whole benchmark; prints tables, writes JSON and PNG. The JSON is written with
    ``"partial": true`` once the throughput is measured, then whole at the end.

    Args:
        args: The arguments to run with, ``--quick`` already applied (:func:`effective`).

    Raises:
        ConfigError: As :func:`check_args` raises it, before any work.
    """
    args = check_args(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plane = ExperienceDataPlane(spec=synthetic_spec(args.dim), capacity=args.capacity,
                                batch_size=args.batch_size, schedule=Schedule(1, 1, 1, 1))
    register_ops(plane, on_policy=False)
    with (PartialJSON(out / "persist.json") as partial, plane,
          tempfile.TemporaryDirectory(prefix="persist-", dir=args.scratch or out) as tmp):
        folder = Path(tmp)
        units = fill_units(args)
        progress(f"filling {units * args.rollout_rows} rows of dim {args.dim}")
        fill(plane, Workload(args.dim, args.hidden), rollout_rows=args.rollout_rows, units=units)
        result: dict[str, Any] = {"args": asdict(args),
                                  "throughput": throughput(plane, folder, repeats=args.repeats)}
        partial.write(result)
        result["stall"] = stall(plane, args, folder)
    print_tables(result)
    jp = write_json(out / "persist.json", result, with_machine=True)
    png = plot(result, out / "persist.png")
    print(f"\nwrote {jp}" + (f" and {png}" if png else ""))
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``conduit bench persist``."""
    p = command_parser("conduit bench persist", __doc__, PersistBenchArgs)
    run(parse_quick(p, PersistBenchArgs, argv, effective, check=check_args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
