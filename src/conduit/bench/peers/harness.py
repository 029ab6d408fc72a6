"""``conduit bench peers``: Conduit side by side with the buffers users would pick instead.

The same workloads run through Conduit and through each peer's public API — TorchRL, cpprb,
RLlib, DeepMind Reverb (in its own virtualenv) and GEAR's placement — in one process run on one
machine. For every workload (an observation of dimension ``d`` plus action, reward and done)
the harness measures, as medians over repeated runs after a warm-up:

* ``insert_64`` / ``insert_1024``: insert throughput in rows/s for chunks of 64 and 1024 rows;
* ``sample_uniform``: latency of one uniform batch, for each batch size (256 and 1024 rows);
* ``sample_per_update``: latency of one prioritized batch plus its priority update, likewise;
* ``onpolicy_epoch``: time of one on-policy epoch of M=8 shuffled mini-batches over 8192 rows.

Inserts and epochs do not depend on the batch size, so they are measured with the first one.
Each peer runs in a phase of its own. The synchronous uniform samples the delivery fast path is
judged by (Conduit's buffer, its inline ``pull()``, cpprb, and the gather floor) are then also
timed side by side: all four buffers filled at once, their samples called in turn in one loop
(:func:`measure_side_by_side`); so are the prioritized samples with their updates of
Conduit's buffer on one thread and on two (``conduit-split``) and of cpprb
(:func:`measure_per_side_by_side`).
It prints one table, a line per (d, batch, peer), whose cells carry the ratio Conduit/peer
expressed as a speed-up (``×3.0`` means Conduit is three times faster at that operation,
whether the metric is a throughput or a latency), and the threads each peer ran on while it
sampled; then each peer's uniform sample over the floor, and the delivery fast path's targets
(:data:`FAST_PATH`); it writes ``peers.json`` and ``peers.png`` (bar chart of the speed-ups) under
``--out``. A peer that is not installed, or breaks, is reported as skipped or unavailable with
the reason; the benchmark itself never fails because of a peer.

Every in-process peer runs with the same torch intra-op thread count (``--torch-threads``,
default 1), the thread count of Conduit's data path (docs/design.md §7).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import torch

from conduit.bench.common import PartialJSON, apply_quick, parse_quick
from conduit.bench.peers.adapter import (
    Chunk,
    OperationSkipped,
    PeerAdapter,
    PeerUnavailable,
    Workload,
    make_chunk,
)
from conduit.bench.peers.conduit_peer import (
    ConduitPeer,
    ConduitPrefetchPeer,
    ConduitPullPeer,
    ConduitSplitPeer,
)
from conduit.bench.peers.cpprb_peer import CpprbPeer
from conduit.bench.peers.floor_peer import GatherFloorPeer
from conduit.bench.peers.gear_peer import GearPlacementPeer
from conduit.bench.peers.reverb_peer import ReverbPeer
from conduit.bench.peers.rllib_peer import RLlibPeer
from conduit.bench.peers.torchrl_peer import TorchRLPeer
from conduit.cli_args import arg, command_parser, usage_error
from conduit.errors import ConfigError
from conduit.report import machine, pyplot, save_figure, table, write_json
from conduit.timing import repeat_times

# ---------------------------------------------------------------------------------------------
# Metrics and results (plain data)

METRICS: dict[str, tuple[str, str]] = {
    "insert_64": ("insert 64", "rows/s"),
    "insert_1024": ("insert 1024", "rows/s"),
    "sample_uniform": ("uniform sample", "ms"),
    "sample_per_update": ("PER sample+update", "ms"),
    "onpolicy_epoch": ("on-policy epoch", "ms"),
}
"""Metric key -> (column title, unit). ``rows/s`` is higher-better, ``ms`` lower-better."""

ALL_PEERS = ("conduit", "conduit-pull", "conduit-prefetch", "conduit-split", "gather-floor",
             "gear-placement",
             "torchrl", "torchrl-prefetch", "cpprb", "rllib", "reverb")
REFERENCE = "conduit"


@dataclass
class MetricResult:
    """One metric of one row.

    Attributes:
        status: ``"ok"``, ``"skipped"``, ``"unavailable"`` or ``"error"``.
        value: Median in the metric's unit (rows/s or ms); ``None`` unless ok.
        unit: ``"rows/s"`` or ``"ms"``.
        median_s: Median seconds per operation.
        min_s: Fastest repetition (a hint at the noise other processes added to the median).
        samples: Timed repetitions behind the median.
        rows_per_op: Rows one operation moved.
        reason: Why there is no value.
    """

    status: str
    unit: str
    value: float | None = None
    median_s: float | None = None
    min_s: float | None = None
    samples: int = 0
    rows_per_op: int = 0
    reason: str | None = None

    @classmethod
    def from_times(cls, metric: str, times_s: Sequence[float], rows_per_op: int) -> MetricResult:
        """The median of ``times_s`` in ``metric``'s unit."""
        unit = METRICS[metric][1]
        if not times_s:
            return cls(status="error", unit=unit, reason="no timed repetition")
        med = statistics.median(times_s)
        value = rows_per_op / med if unit == "rows/s" else med * 1e3
        return cls(status="ok", unit=unit, value=value, median_s=med, min_s=min(times_s),
                   samples=len(times_s), rows_per_op=rows_per_op)

    @classmethod
    def missing(cls, metric: str, status: str, reason: str) -> MetricResult:
        """A metric with no value, and why."""
        return cls(status=status, unit=METRICS[metric][1], reason=reason)


@dataclass
class RowResult:
    """One peer on one workload.

    Attributes:
        peer: Row label (``"cpprb"``, ``"reverb-grpc-dataset"``...).
        dim: Observation dimension.
        capacity: Rows the replay buffers held.
        batch: Rows per sample.
        status: ``"ok"`` (some metrics measured), ``"skipped"`` or ``"unavailable"``.
        reason: Why a whole row is missing.
        description: What exactly was measured.
        version: Version of the peer's package.
        metrics: Metric key -> result.
        notes: Caveats shown next to the numbers.
        threads: Threads of this process that used CPU time while the peer sampled
            uniformly (``None``: not measured, e.g. out of process).
        side_ms: This peer's median uniform sample in the side-by-side loop
            (:func:`measure_side_by_side`; ``None``: not in it).
        floor_ms: The gather floor's median uniform sample in that loop.
        side_per_ms: This peer's median prioritized sample + update in the prioritized
            side-by-side loop (:func:`measure_per_side_by_side`; ``None``: not in it).
    """

    peer: str
    dim: int
    capacity: int
    batch: int = 0
    status: str = "ok"
    reason: str | None = None
    description: str = ""
    version: str | None = None
    metrics: dict[str, MetricResult] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    threads: int | None = None
    side_ms: float | None = None
    floor_ms: float | None = None
    side_per_ms: float | None = None


def speedup(metric: str, conduit: float, peer: float) -> float:
    """How many times faster Conduit is than the peer on ``metric`` (>1: Conduit faster).

    For throughputs (rows/s) this is Conduit/peer; for latencies (ms) it is peer/Conduit, so
    one reading rule holds for every column.
    """
    if conduit <= 0 or peer <= 0:
        raise ValueError(f"speedup: values must be positive, got {conduit} and {peer}")
    return conduit / peer if METRICS[metric][1] == "rows/s" else peer / conduit


def merge_rounds(rounds: Sequence[RowResult]) -> RowResult:
    """One row from the same peer measured in several rounds: per metric, the median of the
    rounds that measured it (a metric no round measured keeps the first round's status)."""
    if not rounds:
        raise ValueError("merge_rounds: no rounds")
    first = rounds[0]
    if len(rounds) == 1:
        return first
    metrics: dict[str, MetricResult] = {}
    for m, res in first.metrics.items():
        ok = [r.metrics[m] for r in rounds if m in r.metrics and r.metrics[m].status == "ok"]
        if not ok:
            metrics[m] = res
            continue
        metrics[m] = MetricResult(
            status="ok", unit=res.unit,
            value=statistics.median(x.value for x in ok if x.value is not None),
            median_s=statistics.median(x.median_s for x in ok if x.median_s is not None),
            min_s=min(x.min_s for x in ok if x.min_s is not None),
            samples=sum(x.samples for x in ok), rows_per_op=ok[0].rows_per_op)
    notes = list(dict.fromkeys(n for r in rounds for n in r.notes))
    threads = max((r.threads for r in rounds if r.threads is not None), default=None)
    return replace(first, metrics=metrics, notes=notes, threads=threads)


def ratios(rows: Sequence[RowResult], reference: str = REFERENCE) -> list[dict[str, Any]]:
    """Conduit/peer speed-ups for every (dim, batch, peer, metric) measured on both sides."""
    ref = {(r.dim, r.batch): r for r in rows if r.peer == reference and r.status == "ok"}
    out = []
    for r in rows:
        base = ref.get((r.dim, r.batch))
        if r.peer == reference or base is None or r.status != "ok":
            continue
        for m, res in r.metrics.items():
            b = base.metrics.get(m)
            if res.status != "ok" or b is None or b.status != "ok":
                continue
            assert res.value is not None and b.value is not None
            out.append({"dim": r.dim, "batch": r.batch, "peer": r.peer, "metric": m,
                        "unit": res.unit,
                        "conduit": b.value, "peer_value": res.value,
                        "speedup": speedup(m, b.value, res.value)})
    return out


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class PeersConfig:
    """Options of ``conduit bench peers`` (each field is a ``--flag``)."""

    dims: tuple[int, ...] = arg((128, 1000, 3000, 5000, 10_000),
                                "observation dimensions d to run", min=1)
    capacity: int = arg(100_000, "replay capacity in rows; lowered automatically (and "
                                 "reported) when the machine's free memory cannot hold it", min=1)
    batches: tuple[int, ...] = arg((256, 1024), "rows per uniform / prioritized sample; "
                                                "every size is a workload of its own", min=1)
    epoch_rows: int = arg(8192, "rows of one on-policy rollout", min=1)
    minibatches: int = arg(8, "shuffled mini-batches per on-policy epoch (M)", min=1)
    warmup: int = arg(5, "untimed repetitions before each metric", min=0)
    repeats: int = arg(50, "timed repetitions per sampling metric (the median is reported)", min=1)
    insert_64_repeats: int = arg(200, "timed inserts of 64-row chunks", min=1)
    epoch_repeats: int = arg(10, "timed on-policy epochs", min=1)
    rounds: int = arg(1, "measure every in-process peer this many times, alternating the "
                         "order each round, and report the median of the round medians (a "
                         "shared machine drifts; rounds spread the drift over all peers)", min=1)
    peers: tuple[str, ...] = arg(ALL_PEERS, f"peers to run, from {', '.join(ALL_PEERS)}")
    quick: bool = arg(False, "short development run: d in (128, 1000), batch 256, capacity "
                             "16384, few repetitions, Reverb in-process only (flags given "
                             "explicitly win)")
    out: str = arg("runs/bench/peers", "output directory for peers.json and peers.png",
                   output="dir")
    torch_threads: int = arg(1, "torch intra-op threads for every in-process peer", min=1)
    memory_fraction: float = arg(0.5, "share of available memory one buffer (with the peers' "
                                      "overheads) may take when sizing the capacity",
                                 positive=True, max=1)
    reverb_python: str = arg("", "Python of the Reverb virtualenv (default: .venv-reverb/bin/"
                                 "python)")
    reverb_modes: tuple[str, ...] = arg(("inproc", "grpc"), "Reverb server modes: inproc "
                                        "(same process) and/or grpc (separate process)")
    reverb_timeout_s: float = arg(3600.0, "wall-clock limit of one Reverb worker run",
                                  positive=True)
    plot: bool = arg(True, "write the PNG bar chart")
    seed: int = arg(0, "seed of every random draw")

    def __post_init__(self) -> None:
        unknown = [p for p in self.peers if p not in ALL_PEERS]
        if unknown:
            raise ValueError(f"peers: unknown {unknown}; choose from {list(ALL_PEERS)}")
        if not self.dims or any(d < 1 for d in self.dims):
            raise ValueError(f"dims: need positive dimensions, got {self.dims}")
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"batches: need positive batch sizes, got {self.batches}")
        for name in ("capacity", "epoch_rows", "minibatches", "repeats",
                     "insert_64_repeats", "epoch_repeats", "torch_threads", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup: must be >= 0, got {self.warmup}")
        bad_modes = [m for m in self.reverb_modes if m not in ("inproc", "grpc")]
        if bad_modes:
            raise ValueError(f"reverb_modes: {bad_modes} not in ('inproc', 'grpc')")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction: must be in (0, 1], got {self.memory_fraction}")
        if not 0 < self.reverb_timeout_s < float("inf"):
            raise ValueError(f"reverb_timeout_s: must be a finite number > 0, got "
                             f"{self.reverb_timeout_s}")


QUICK = {"dims": (128, 1000), "batches": (256,), "capacity": 16384, "warmup": 2, "repeats": 15,
         "insert_64_repeats": 40, "epoch_repeats": 3, "reverb_modes": ("inproc",)}
"""What ``--quick`` changes (only for flags left at their defaults)."""


def effective(cfg: PeersConfig, given: Collection[str] | None = None) -> PeersConfig:
    """The configuration after ``--quick``: :data:`QUICK` for the flags not given (see
    :func:`~conduit.bench.common.apply_quick`)."""
    return apply_quick(cfg, QUICK, given)


# Bytes a peer may hold per stored byte: a margin for RLlib (episode objects, deep copies on add,
# sampled copies) and Reverb (chunks on the server, items in flight, the client's copies).
PEER_OVERHEAD = 3.0


def fit_capacity(requested: int, bytes_per_row: int, available_bytes: int, *,
                 fraction: float, minimum: int,
                 overhead: float = PEER_OVERHEAD) -> tuple[int, str | None]:
    """The capacity to use: ``requested`` if it fits in memory, else the largest that does.

    Args:
        requested: Rows asked for.
        bytes_per_row: Bytes of one stored row.
        available_bytes: Memory free on the machine.
        fraction: Share of ``available_bytes`` one buffer (times ``overhead``) may use.
        minimum: Smallest acceptable capacity (at least one sampled batch).
        overhead: Bytes held per stored byte while one peer runs (default
            :data:`PEER_OVERHEAD`).

    Returns:
        ``(capacity, note)``; ``note`` says why and how much it was lowered, else ``None``.
    """
    budget = available_bytes * fraction / overhead
    if requested * bytes_per_row <= budget:
        return requested, None
    fit = int(budget // bytes_per_row)
    fit = max(minimum, fit - fit % 1024 if fit >= 2048 else fit)
    return fit, (f"capacity lowered from {requested} to {fit} rows: {requested} rows of "
                 f"{bytes_per_row} B (x{overhead:g} peer overhead) exceed "
                 f"{fraction:.0%} of the {available_bytes / 2**30:.1f} GiB available")


# ---------------------------------------------------------------------------------------------
# Measurement


def _status_of(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, OperationSkipped):
        return "skipped", str(exc)
    if isinstance(exc, PeerUnavailable):
        return "unavailable", str(exc)
    return "error", f"{type(exc).__name__}: {exc}"


def busy_threads(before: dict[int, float], after: dict[int, float]) -> int:
    """Threads whose CPU time grew between two :func:`thread_times` snapshots."""
    return sum(1 for tid, t in after.items() if t > before.get(tid, 0.0))


def thread_times() -> dict[int, float]:
    """CPU seconds per thread of this process: exact per-thread CPU clocks on Linux, else
    psutil's clock-tick times (too coarse for phases of a few milliseconds)."""
    out = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            # The kernel's CPU-clock id of thread ``tid`` (CPUCLOCK_SCHED | CPUCLOCK_PERTHREAD).
            with contextlib.suppress(OSError, ValueError):
                out[int(tid)] = time.clock_gettime((~int(tid) << 3) | 6)
    return out or {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}


def interleaved_times(fns: Mapping[str, Callable[[], object]], *, repeats: int,
                      warmup: int, seed: int = 0) -> dict[str, list[float]]:
    """Wall seconds of ``repeats`` calls of each of ``fns``, called in turn in one loop, in a
    fresh random order each round (from ``seed``), after ``warmup`` untimed rounds.

    A shared machine's speed drifts within seconds, so operations timed in phases of their own
    are timed on different machines, in effect; called in turn, all see the same drift, and
    each evicts the others' data from the caches, as a training step would. What a call finds
    in the caches depends on the call before it (one that runs the same code leaves it warm),
    so no call keeps one predecessor: a rotation of a fixed order would (docs/design.md §9).

    Returns:
        Name -> its times, in call order.
    """
    names = list(fns)
    order = random.Random(seed)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    out: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):
        for name in order.sample(names, len(names)):
            t0 = time.perf_counter()
            fns[name]()
            out[name].append(time.perf_counter() - t0)
    return out


def fill(adapter: PeerAdapter, big: Chunk, rows: int) -> list[float]:
    """Insert ``rows`` rows into ``adapter`` in chunks of ``big``'s 1024 rows (the last may be
    shorter); returns the seconds of each full chunk's insert."""
    times, filled = [], 0
    while filled < rows:
        n = min(1024, rows - filled)
        chunk = adapter.prepare(big if n == 1024 else {k: v[:n] for k, v in big.items()})
        t0 = time.perf_counter()
        adapter.insert(chunk)
        if n == 1024:
            times.append(time.perf_counter() - t0)
        filled += n
    return times


def measure_adapter(adapter: PeerAdapter, w: Workload, cfg: PeersConfig,
                    progress: Callable[[str], None],
                    only: Sequence[str] | None = None) -> RowResult:
    """Run the metrics of one in-process adapter on one workload (never raises).

    Args:
        adapter: The peer.
        w: The workload.
        cfg: Repetitions and warm-up.
        progress: Receives one line per step.
        only: Measure only these metrics (default: all the adapter offers).
    """
    row = RowResult(peer=adapter.name, dim=w.dim, capacity=w.capacity, batch=w.batch,
                    description=adapter.description, version=adapter.version())
    try:
        row.notes = adapter.notes()
    except Exception as exc:
        row.notes = [f"notes() failed: {exc!r}"]
    wanted = getattr(adapter, "metrics", None) or tuple(METRICS)
    if only is not None:
        wanted = tuple(m for m in wanted if m in only)
    big = make_chunk(1024, w.dim, seed=w.seed)
    small = {k: v[:64].copy() for k, v in big.items()}
    label = f"d={w.dim} {adapter.name}"

    def phase(keys: tuple[str, ...], body: Callable[[], dict[str, MetricResult]]) -> None:
        if not any(k in wanted for k in keys):
            return
        try:
            got = body()
        except Exception as exc:
            status, reason = _status_of(exc)
            got = {k: MetricResult.missing(k, status, reason) for k in keys}
        for k in keys:
            if k in wanted and k in got:
                row.metrics[k] = got[k]
        gc.collect()

    def uniform() -> dict[str, MetricResult]:
        progress(f"{label}: filling {w.capacity} rows in chunks of 1024")
        adapter.setup(w)
        t1024 = fill(adapter, big, w.capacity)
        out = {"insert_1024": MetricResult.from_times(
            "insert_1024", t1024[min(cfg.warmup, len(t1024) - 1):], 1024)}
        if "insert_64" in wanted:
            progress(f"{label}: {cfg.insert_64_repeats} inserts of 64 rows")
            t64 = []
            for i in range(cfg.warmup + cfg.insert_64_repeats):
                chunk = adapter.prepare(small)
                t0 = time.perf_counter()
                adapter.insert(chunk)
                if i >= cfg.warmup:
                    t64.append(time.perf_counter() - t0)
            out["insert_64"] = MetricResult.from_times("insert_64", t64, 64)
        progress(f"{label}: uniform sampling, batch {w.batch}")
        before = thread_times()
        times = repeat_times(adapter.sample_uniform, repeats=cfg.repeats, warmup=cfg.warmup)
        row.threads = busy_threads(before, thread_times())
        out["sample_uniform"] = MetricResult.from_times("sample_uniform", times, w.batch)
        return out

    def prioritized() -> dict[str, MetricResult]:
        adapter.setup_prioritized(w)
        progress(f"{label}: prioritized buffer, filling {w.capacity} rows")
        fill(adapter, big, w.capacity)
        progress(f"{label}: prioritized sample + update, batch {w.batch}")
        return {"sample_per_update": MetricResult.from_times(
            "sample_per_update",
            repeat_times(adapter.sample_prioritized_and_update, repeats=cfg.repeats,
                         warmup=cfg.warmup), w.batch)}

    def on_policy() -> dict[str, MetricResult]:
        adapter.setup_on_policy(w)
        progress(f"{label}: on-policy epochs ({w.epoch_rows} rows, {w.minibatches} "
                 f"mini-batches)")
        times = []
        for i in range(cfg.warmup + cfg.epoch_repeats):
            fill(adapter, big, w.epoch_rows)
            t0 = time.perf_counter()
            rows = adapter.on_policy_epoch()
            dt = time.perf_counter() - t0
            if rows != w.epoch_rows:
                raise RuntimeError(f"an epoch delivered {rows} rows, expected {w.epoch_rows}")
            if i >= cfg.warmup:
                times.append(dt)
        return {"onpolicy_epoch": MetricResult.from_times("onpolicy_epoch", times,
                                                          w.epoch_rows)}

    # Inserts are timed while filling the uniform buffer, so that phase runs if any of its
    # metrics is wanted (the prefetch variant wants only sampling, and still needs the fill).
    phase(("insert_1024", "insert_64", "sample_uniform"), uniform)
    phase(("sample_per_update",), prioritized)
    phase(("onpolicy_epoch",), on_policy)
    try:
        adapter.close()
    except Exception as exc:
        row.notes.append(f"close() failed: {exc!r}")
    gc.collect()
    return row


def rows_from_worker(doc_rows: list[dict[str, Any]], version: str | None) -> list[RowResult]:
    """Turn the Reverb worker's raw timings into :class:`RowResult`s."""
    out = []
    for d in doc_rows:
        row = RowResult(peer=str(d.get("peer", "reverb")), dim=int(d.get("dim", 0)),
                        capacity=int(d.get("capacity", 0)), batch=int(d.get("batch", 0)),
                        status=d.get("status", "ok"),
                        reason=d.get("reason"), description=d.get("description", ""),
                        version=version, notes=list(d.get("notes", [])))
        for m, v in (d.get("metrics") or {}).items():
            if m not in METRICS:
                continue
            if "times_s" in v:
                row.metrics[m] = MetricResult.from_times(m, v["times_s"], int(v["rows_per_op"]))
            else:
                row.metrics[m] = MetricResult.missing(m, v.get("status", "skipped"),
                                                      v.get("reason", ""))
        out.append(row)
    return out


SIDE_BY_SIDE = ("conduit", "conduit-pull", "cpprb")
"""The synchronous uniform samples timed side by side with the gather floor (and each other)."""

PER_SIDE_BY_SIDE = ("conduit", "conduit-split", "cpprb")
"""The prioritized samples + updates timed side by side with each other."""

SPLIT_PEER = "conduit-split"
"""Conduit's buffer with two data-path threads (a target of its own in the fast-path table)."""


def _interleaved_medians(w: Workload, names: Sequence[str], cfg: PeersConfig,
                         progress: Callable[[str], None], *, what: str,
                         setup: Callable[[PeerAdapter, Workload], None],
                         call: Callable[[PeerAdapter], Callable[[], object]],
                         required: str | None) -> dict[str, float]:
    """Median (ms) of ``call(adapter)()`` for each of ``names`` that can run here, timed in
    turn in one loop (:func:`interleaved_times`) with every buffer set up by ``setup`` and
    filled to ``w.capacity`` rows. Empty unless ``required`` (if given) and at least two
    peers run. Never raises."""
    made: dict[str, PeerAdapter] = {}
    try:
        for name in names:
            adapter = _make(name)
            try:
                adapter.check()
                setup(adapter, w)
            except Exception:
                continue
            made[name] = adapter
        if (required is not None and required not in made) or len(made) < 2:
            return {}
        progress(f"d={w.dim} batch={w.batch}: {what} side by side ({', '.join(made)}): "
                 f"filling {w.capacity} rows each")
        big = make_chunk(1024, w.dim, seed=w.seed)
        for adapter in made.values():
            fill(adapter, big, w.capacity)
        progress(f"d={w.dim} batch={w.batch}: {what} side by side: "
                 f"{cfg.repeats * cfg.rounds} rounds")
        times = interleaved_times({k: call(a) for k, a in made.items()},
                                  repeats=cfg.repeats * cfg.rounds, warmup=cfg.warmup)
        return {k: statistics.median(t) * 1e3 for k, t in times.items()}
    except Exception as exc:
        progress(f"d={w.dim} batch={w.batch}: {what} side by side failed: {exc!r}")
        return {}
    finally:
        for adapter in made.values():
            with contextlib.suppress(Exception):
                adapter.close()
        gc.collect()


def measure_side_by_side(w: Workload, names: Sequence[str], cfg: PeersConfig,
                         progress: Callable[[str], None]) -> dict[str, float]:
    """Median uniform sample (ms) of each of ``names`` and of the gather floor, timed in turn
    in one loop (:func:`interleaved_times`) with every buffer filled to ``w.capacity`` rows.

    A peer that cannot run here is left out (its own phase reports why); without the floor or
    with nothing next to it, the result is empty. Never raises.
    """
    return _interleaved_medians(w, (FLOOR, *names), cfg, progress, what="uniform",
                                setup=lambda a, wl: a.setup(wl),
                                call=lambda a: a.sample_uniform, required=FLOOR)


def measure_per_side_by_side(w: Workload, names: Sequence[str], cfg: PeersConfig,
                             progress: Callable[[str], None]) -> dict[str, float]:
    """Median prioritized sample + priority update (ms) of each of ``names``, timed in turn in
    one loop with every prioritized buffer filled to ``w.capacity`` rows, as
    :func:`measure_side_by_side` times the uniform samples. Empty unless two can run here.
    Never raises."""
    return _interleaved_medians(w, names, cfg, progress, what="prioritized",
                                setup=lambda a, wl: a.setup_prioritized(wl),
                                call=lambda a: a.sample_prioritized_and_update, required=None)


def build_adapters(names: Sequence[str]) -> list[tuple[str, PeerAdapter | None, str | None]]:
    """``(name, adapter or None, reason)`` for each in-process peer in ``names``.

    A peer that cannot be built or fails its check (its package is missing) comes back with
    ``None`` and the reason.
    """
    out: list[tuple[str, PeerAdapter | None, str | None]] = []
    for name in names:
        if name == "reverb":
            continue
        try:
            adapter = _make(name)
            adapter.check()
        except PeerUnavailable as exc:
            out.append((name, None, str(exc)))
            continue
        except Exception as exc:
            out.append((name, None, f"{type(exc).__name__}: {exc}"))
            continue
        out.append((name, adapter, None))
    return out


_ADAPTERS: dict[str, Callable[[], PeerAdapter]] = {
    "conduit": ConduitPeer,
    "conduit-pull": ConduitPullPeer,
    "conduit-prefetch": ConduitPrefetchPeer,
    "conduit-split": ConduitSplitPeer,
    "gather-floor": GatherFloorPeer,
    "gear-placement": GearPlacementPeer,
    "torchrl": TorchRLPeer,
    "torchrl-prefetch": partial(TorchRLPeer, prefetch=4),
    "cpprb": CpprbPeer,
    "rllib": RLlibPeer,
}
"""In-process peer name -> adapter factory (each adapter imports its package lazily)."""


def _make(name: str) -> PeerAdapter:
    if name not in _ADAPTERS:
        raise ValueError(f"unknown peer {name!r}")
    return _ADAPTERS[name]()


# ---------------------------------------------------------------------------------------------
# Machine description


# ---------------------------------------------------------------------------------------------
# Reporting


def _fmt(value: float, unit: str) -> str:
    if unit == "rows/s":
        return f"{value / 1e6:.2f}M/s" if value >= 1e6 else f"{value / 1e3:.1f}k/s"
    return f"{value:.3f} ms" if value < 10 else f"{value:.1f} ms"


def format_table(rows: Sequence[RowResult]) -> str:
    """The results table: per dimension and batch size, one line per peer, one column per
    metric, and the threads the peer sampled on.

    Conduit's cells hold its values; a peer's cells hold the peer's value and the Conduit
    speed-up ``×N`` (N > 1: Conduit faster).
    """
    rat = {(r["dim"], r["batch"], r["peer"], r["metric"]): r["speedup"] for r in ratios(rows)}
    cols = list(METRICS)
    head = (["d", "batch", "peer"] + [f"{METRICS[m][0]} ({METRICS[m][1]})" for m in cols]
            + ["threads"])
    body: list[list[str]] = []
    for r in sorted(rows, key=lambda r: (r.dim, r.batch, r.peer != REFERENCE, r.peer)):
        line = [str(r.dim), str(r.batch or "-"), r.peer]
        if r.status != "ok":
            line += [r.status] + [""] * (len(cols) - 1)
        else:
            for m in cols:
                res = r.metrics.get(m)
                if res is None:
                    line.append("-")
                elif res.status != "ok" or res.value is None:
                    line.append(res.status)
                else:
                    cell = _fmt(res.value, res.unit)
                    s = rat.get((r.dim, r.batch, r.peer, m))
                    line.append(cell if s is None else f"{cell} ×{s:.2g}" if s < 10
                                else f"{cell} ×{s:.0f}")
        line.append("-" if r.threads is None else str(r.threads))
        body.append(line)
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*b) for b in body]
    return "\n".join(lines)


def format_reasons(rows: Sequence[RowResult]) -> str:
    """Every missing row or metric with its reason, and every caveat, without repeats."""
    seen: dict[str, list[int]] = {}
    for r in rows:
        items = []
        if r.status != "ok":
            items.append(f"{r.peer}: {r.status}: {r.reason}")
        else:
            items += [f"{r.peer} / {m}: {res.status}: {res.reason}"
                      for m, res in r.metrics.items() if res.status != "ok"]
            items += [f"{r.peer}: note: {n}" for n in r.notes]
        for it in items:
            seen.setdefault(it, []).append(r.dim)
    return "\n".join(f"- {k} (d={','.join(map(str, sorted(set(v))))})" for k, v in seen.items())


TARGETS = (  # (peer, metric, minimum speed-up) at d = 1000, from the issue
    ("torchrl", "sample_uniform", 2.0), ("cpprb", "sample_uniform", 2.0),
    ("rllib", "sample_uniform", 10.0), ("cpprb", "sample_per_update", 1.5),
)


def check_targets(rows: Sequence[RowResult], dim: int = 1000) -> list[dict[str, Any]]:
    """The targets at ``dim``, per batch size: measured speed-up and whether it is met (or
    unmeasured)."""
    rat = {(r["batch"], r["peer"], r["metric"]): r["speedup"] for r in ratios(rows)
           if r["dim"] == dim}
    out = []
    for batch in sorted({r.batch for r in rows if r.dim == dim}):
        for peer, metric, need in TARGETS:
            got = rat.get((batch, peer, metric))
            out.append({"dim": dim, "batch": batch, "peer": peer, "metric": metric,
                        "target": need, "speedup": got,
                        "met": None if got is None else got >= need})
    return out


FLOOR = "gather-floor"

FAST_PATH = {"over_floor": 1.10, "per_vs_cpprb": 1.5, "prefetch_ms": 0.05}
"""The delivery fast path's targets: a synchronous uniform sample within this factor of the
gather floor and no slower than cpprb's (side by side); a prioritized sample and update this
many times faster than cpprb's; a prefetched pull of at most this many ms."""


def fast_path_targets(rows: Sequence[RowResult]) -> list[dict[str, Any]]:
    """The :data:`FAST_PATH` targets per (d, batch): the measured value, the bound, and
    whether it is met (``None``: a side was not measured).

    The uniform sample's targets read the side-by-side loop (:func:`measure_side_by_side`),
    the prioritized one its own loop (:func:`measure_per_side_by_side`) where it ran, and the
    two peers' phases otherwise.
    """
    floor = {(g["dim"], g["batch"], g["peer"]): g for g in over_floor(rows)}
    rat = {(r["dim"], r["batch"], r["peer"], r["metric"]): r["speedup"] for r in ratios(rows)}
    by = {(r.dim, r.batch, r.peer): r for r in rows if r.status == "ok"}
    out = []
    for d, b in sorted({(r.dim, r.batch) for r in rows}):
        mine, pull = (floor.get((d, b, p)) for p in (REFERENCE, "conduit-pull"))
        mine = mine if mine and mine["side_by_side"] else None
        pull = pull if pull and pull["side_by_side"] else None
        side = {p: by[d, b, p].side_ms for p in (REFERENCE, "cpprb") if (d, b, p) in by}
        per = {p: by[d, b, p].side_per_ms for p in (REFERENCE, SPLIT_PEER, "cpprb")
               if (d, b, p) in by}
        per_side, per_split = (per.get(p) and per.get("cpprb") and per["cpprb"] / per[p]
                               for p in (REFERENCE, SPLIT_PEER))
        pre = by.get((d, b, "conduit-prefetch"))
        pre_res = pre.metrics.get("sample_uniform") if pre is not None else None
        checks = [
            ("uniform over floor", mine and mine["over_floor"], FAST_PATH["over_floor"],
             "<="),
            ("inline pull over floor", pull and pull["over_floor"], FAST_PATH["over_floor"],
             "<="),
            ("uniform vs cpprb's", side.get(REFERENCE) and side.get("cpprb")
             and side[REFERENCE] / side["cpprb"], 1.0, "<="),
            ("PER sample+update speed-up vs cpprb", per_side or rat.get(
                (d, b, "cpprb", "sample_per_update")), FAST_PATH["per_vs_cpprb"], ">="),
            ("PER speed-up vs cpprb, 2 threads (conduit-split)", per_split,
             FAST_PATH["per_vs_cpprb"], ">="),
            ("prefetched pull ms", pre_res.value if pre_res is not None
             and pre_res.status == "ok" else None, FAST_PATH["prefetch_ms"], "<="),
        ]
        for name, got, bound, rule in checks:
            met = None if not got else (got <= bound if rule == "<=" else got >= bound)
            out.append({"dim": d, "batch": b, "target": name, "value": got or None,
                        "bound": bound, "rule": rule, "met": met})
    return out


def format_fast_path(rows: Sequence[RowResult]) -> str:
    """:func:`fast_path_targets` as a table: a line per (d, batch), a column per target."""
    got = fast_path_targets(rows)
    names = list(dict.fromkeys(g["target"] for g in got))
    cells = {(g["dim"], g["batch"], g["target"]): g for g in got}
    keys = sorted({(g["dim"], g["batch"]) for g in got})

    def cell(g: dict[str, Any]) -> str:
        if g["met"] is None:
            return "-"
        return f"{g['value']:.3g} {'met' if g['met'] else 'NOT met'}"

    head = [f"{n} ({r} {b:g})" for n, r, b in dict.fromkeys(
        (g["target"], g["rule"], g["bound"]) for g in got)]
    return table(["d", "batch", *head], [[d, b, *(cell(cells[d, b, n]) for n in names)]
                                         for d, b in keys])


def over_floor(rows: Sequence[RowResult]) -> list[dict[str, Any]]:
    """Every peer's uniform sample latency over the gather floor's, per (d, batch): 1.0 is
    the least work a uniform sample can do on the machine.

    A peer timed side by side with the floor (``side_ms`` set) is its median there over the
    floor's there (``"side_by_side": True``); any other, its own phase's median over the
    ``gather-floor`` row's.
    """
    def uniform(r: RowResult) -> float | None:
        res = r.metrics.get("sample_uniform")
        return res.value if r.status == "ok" and res is not None and res.status == "ok" else None

    floor = {(r.dim, r.batch): uniform(r) for r in rows if r.peer == FLOOR}
    out = []
    for r in rows:
        side = bool(r.side_ms and r.floor_ms)
        value, base = (r.side_ms, r.floor_ms) if side else (uniform(r),
                                                            floor.get((r.dim, r.batch)))
        if r.peer != FLOOR and base and value is not None:
            out.append({"dim": r.dim, "batch": r.batch, "peer": r.peer,
                        "over_floor": value / base, "side_by_side": side})
    return out


def format_over_floor(rows: Sequence[RowResult]) -> str:
    """:func:`over_floor` as a table: a line per (d, batch), a column per peer; ``*`` marks a
    ratio between two phases instead of one side-by-side loop."""
    got = over_floor(rows)
    peers = sorted({g["peer"] for g in got}, key=lambda p: (p != REFERENCE, p))
    cells = {(g["dim"], g["batch"], g["peer"]): g["over_floor"] for g in got}
    keys = sorted({(g["dim"], g["batch"]) for g in got})
    side = {(g["dim"], g["batch"], g["peer"]) for g in got if g["side_by_side"]}
    return table(["d", "batch", *peers],
                 [[d, b, *(f"{cells[d, b, p]:.2f}" + ("" if (d, b, p) in side else "*")
                           if (d, b, p) in cells else "-" for p in peers)]
                  for d, b in keys])


def write_plot(rows: Sequence[RowResult], path: Path) -> str | None:
    """Bar chart of Conduit speed-ups per metric (log scale); returns an error or ``None``."""
    rat = ratios(rows)
    if not rat:
        return "no ratio to plot (Conduit or every peer missing)"
    plt = pyplot()
    if plt is None:
        return "matplotlib is not installed"
    metrics = [m for m in METRICS if any(r["metric"] == m for r in rat)]
    groups = sorted({(r["dim"], r["batch"]) for r in rat})
    ncols = min(3, len(metrics))
    nrows = -(-len(metrics) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 4.2 * nrows), squeeze=False)
    flat = [ax for line in axes for ax in line]
    for ax in flat[len(metrics):]:
        ax.set_visible(False)
    for ax, m in zip(flat, metrics):
        sel = [r for r in rat if r["metric"] == m]
        peers = sorted({r["peer"] for r in sel})
        width = 0.8 / max(1, len(groups))
        for j, (d, b) in enumerate(groups):
            vals = {r["peer"]: r["speedup"] for r in sel if (r["dim"], r["batch"]) == (d, b)}
            xs = [i + j * width for i, p in enumerate(peers) if p in vals]
            ys = [vals[p] for p in peers if p in vals]
            ax.bar(xs, ys, width=width, label=f"d={d} b={b}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(peers))])
        ax.set_xticklabels(peers, rotation=35, ha="right", fontsize=8)
        ax.set_title(f"{METRICS[m][0]}", fontsize=10)
        ax.set_ylabel("Conduit speed-up (×, >1 = Conduit faster)", fontsize=8)
    flat[0].legend(fontsize=8)
    fig.suptitle("conduit bench peers: Conduit vs peer, same run, same machine", fontsize=11)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    return None


# ---------------------------------------------------------------------------------------------
# Entry point


def run(cfg: PeersConfig, *, progress: Callable[[str], None] | None = None,
        partial: PartialJSON | None = None) -> tuple[dict[str, Any], list[RowResult]]:
    """Run the benchmark described by ``cfg``.

    Args:
        cfg: What to run, ``--quick`` already applied (:func:`effective`).
        progress: Receives one line per step (default: printed to stderr).
        partial: Where the rows measured so far are written after every workload and after
            Reverb's (none by default).

    Returns:
        The JSON-ready report and the rows it was built from.
    """
    log = progress or (lambda s: print(f"[peers] {s}", file=sys.stderr, flush=True))
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.torch_threads)
    try:
        host = machine()
        started = time.time()
        workloads = []
        capacity_notes = {}
        side_peers = ([p for p in SIDE_BY_SIDE if p in cfg.peers] if FLOOR in cfg.peers
                      else [])
        per_peers = [p for p in PER_SIDE_BY_SIDE if p in cfg.peers]
        # One peer's phase holds up to PEER_OVERHEAD buffers' worth; the side-by-side loop
        # holds the floor and each of its peers at once.
        overhead = max(PEER_OVERHEAD, 1 + len(side_peers))
        for d in cfg.dims:
            w0 = Workload(dim=d, capacity=cfg.capacity, batch=cfg.batches[0],
                          epoch_rows=cfg.epoch_rows, minibatches=cfg.minibatches, seed=cfg.seed)
            cap, note = fit_capacity(cfg.capacity, w0.bytes_per_row,
                                     psutil.virtual_memory().available,
                                     fraction=cfg.memory_fraction,
                                     minimum=max(*cfg.batches, 1024),
                                     overhead=overhead)
            if note:
                log(f"d={d}: {note}")
                capacity_notes[d] = note
            workloads += [replace(w0, capacity=cap, batch=b) for b in cfg.batches]

        rows: list[RowResult] = []
        adapters = build_adapters(cfg.peers)
        config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()}

        def save() -> None:
            if partial is not None:
                partial.write({"benchmark": "conduit bench peers", "config": config,
                               "machine": host,
                               "capacity_notes": {str(k): v for k, v in capacity_notes.items()},
                               "rows": [asdict(r) for r in rows]})

        for w in workloads:
            # Inserts and epochs do not depend on the batch size: measured with the first.
            only = None if w.batch == cfg.batches[0] else ("sample_uniform", "sample_per_update")
            measured: dict[str, list[RowResult]] = {}
            for r in range(cfg.rounds):
                order = adapters if r % 2 == 0 else adapters[::-1]
                for name, adapter, _ in order:
                    if adapter is None:
                        continue
                    log(f"d={w.dim} batch={w.batch} {name}: start"
                        + (f" (round {r + 1}/{cfg.rounds})" if cfg.rounds > 1 else ""))
                    measured.setdefault(name, []).append(
                        measure_adapter(adapter, w, cfg, log, only=only))
            side = measure_side_by_side(w, side_peers, cfg, log) if side_peers else {}
            per = (measure_per_side_by_side(w, per_peers, cfg, log) if len(per_peers) > 1
                   else {})
            for name, adapter, reason in adapters:
                if adapter is None:
                    rows.append(RowResult(peer=name, dim=w.dim, capacity=w.capacity,
                                          batch=w.batch, status="skipped", reason=reason))
                else:
                    rows.append(merge_rounds(measured[name]))
                    if name in side:
                        rows[-1].side_ms, rows[-1].floor_ms = side[name], side[FLOOR]
                    rows[-1].side_per_ms = per.get(name)
            save()

        versions: dict[str, Any] = {}
        if "reverb" in cfg.peers:
            reverb = ReverbPeer(python=cfg.reverb_python or None, modes=cfg.reverb_modes,
                                timeout_s=cfg.reverb_timeout_s)
            missing = reverb.availability()
            if missing is not None:
                status, reason = missing
                log(f"reverb: {status}: {reason}")
                rows += [RowResult(peer="reverb", dim=w.dim, capacity=w.capacity,
                                   batch=w.batch, status=status, reason=reason)
                         for w in workloads]
            else:
                log(f"reverb: running in {reverb.python} ({reverb.versions})")
                doc_rows = reverb.run(workloads, warmup=cfg.warmup, repeats=cfg.repeats,
                                      insert_64_repeats=cfg.insert_64_repeats,
                                      epoch_repeats=cfg.epoch_repeats, progress=log)
                versions["reverb"] = reverb.versions
                rows += rows_from_worker(doc_rows, reverb.versions.get("dm-reverb"))
                save()

        host["load_average_end"] = (list(os.getloadavg()) if hasattr(os, "getloadavg")
                                    else None)
        report = {
            "benchmark": "conduit bench peers",
            "config": config,
            "machine": host,
            "elapsed_s": round(time.time() - started, 1),
            "capacity_notes": {str(k): v for k, v in capacity_notes.items()},
            "versions": versions,
            "metrics": {k: {"title": t, "unit": u} for k, (t, u) in METRICS.items()},
            "speedup_rule": "speedup = Conduit/peer for rows/s and peer/Conduit for ms; "
                            ">1 means Conduit is faster",
            "rows": [asdict(r) for r in rows],
            "ratios": ratios(rows),
            "over_floor": over_floor(rows),
            "targets_d1000": check_targets(rows),
            "targets_fast_path": fast_path_targets(rows),
        }
        return report, rows
    finally:
        torch.set_num_threads(threads_before)


def build_parser() -> argparse.ArgumentParser:
    """The ``conduit bench peers`` argument parser. Flags are not abbreviated (``--dim`` is
    not ``--dims``)."""
    parser = command_parser("conduit bench peers", __doc__, PeersConfig)
    parser.allow_abbrev = False
    return parser


def check_config(cfg: PeersConfig) -> None:
    """Refuse what a workload of ``cfg`` would refuse (after ``--quick``), before any run.

    Raises:
        ConfigError: A batch of ``--batches`` exceeds ``--capacity`` (field ``capacity``), or
            ``--epoch-rows`` is not a positive multiple of ``--minibatches`` (field
            ``epoch_rows``).
    """
    big = max(cfg.batches)
    if big > cfg.capacity:
        raise ConfigError("capacity", f"{cfg.capacity} rows cannot hold one batch of "
                                      f"--batches {big}; raise --capacity or lower --batches")
    if cfg.epoch_rows % cfg.minibatches:
        raise ConfigError("epoch_rows", f"{cfg.epoch_rows} rows are not a multiple of "
                                        f"--minibatches {cfg.minibatches} (each mini-batch "
                                        "takes an equal share); change --epoch-rows or "
                                        "--minibatches")


def main(argv: list[str] | None = None) -> int:
    """Run ``conduit bench peers``; returns the process exit code (0 unless misused).

    Args:
        argv: Arguments after ``conduit bench peers`` (default: ``sys.argv[1:]``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    names = {f.name for f in fields(PeersConfig)}
    try:
        cfg = parse_quick(parser, PeersConfig, argv, effective, check=check_config)
    except ValueError as exc:
        name, _, reason = str(exc).partition(": ")
        if name in names and reason:
            usage_error(parser, name, reason)
        parser.error(str(exc))
    out = Path(cfg.out)
    command = " ".join(["conduit bench peers", *argv])
    with PartialJSON(out / "peers.json", with_machine=False) as partial:
        report, rows = run(cfg, partial=partial)
    report["command"] = command
    write_json(out / "peers.json", report)
    plot_error = write_plot(rows, out / "peers.png") if cfg.plot else "disabled (--no-plot)"

    m = report["machine"]
    print(f"\nconduit bench peers — {m['cpu']}, {m['cores']} CPUs, "
          f"{m['memory_gib']} GiB, torch {m['torch']} ({cfg.torch_threads} thread(s)), "
          f"load average {m['load_average']} -> {m['load_average_end']}")
    for d, note in report["capacity_notes"].items():
        print(f"d={d}: {note}")
    print("cells: peer value ×(Conduit speed-up; >1 = Conduit faster)\n")
    print(format_table(rows))
    if report["over_floor"]:
        print("\nuniform sample over the gather floor (1.00 = the floor; side by side in one "
              "loop, * = over the gather-floor row's phase)\n"
              + format_over_floor(rows))
    if any(t["met"] is not None for t in report["targets_fast_path"]):
        print("\nfast-path targets\n" + format_fast_path(rows))
    reasons = format_reasons(rows)
    if reasons:
        print("\nnot measured, and caveats:\n" + reasons)
    targets = [t for t in report["targets_d1000"] if t["speedup"] is not None]
    if targets:
        print("\ntargets at d=1000:")
        for t in targets:
            verdict = "met" if t["met"] else "NOT met"
            print(f"- {t['metric']} vs {t['peer']}, batch {t['batch']}: ×{t['speedup']:.2f} "
                  f"(target ×{t['target']:g}): {verdict}")
    print(f"\nwrote {out / 'peers.json'}"
          + (f" and {out / 'peers.png'}" if plot_error is None else f" (no plot: {plot_error})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
