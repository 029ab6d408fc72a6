"""``conduit bench placement``: exposed delivery latency per placement, swept over d (Fig. 12).

For each transition dimension ``d`` (obs and next_obs of ``d`` float32 values, an int64 action,
a float32 reward and a bool done: ``8d + 13`` bytes per sample), every placement this machine
can execute holds a buffer of the same capacity, filled to the brim, and the learner pulls
batches of 512 through the plane. The reported latency is the median time of
``plane.pull()`` with delivery inline (sample, gather and copy onto the learner's device: the
latency the learner is exposed to without overlap), measured side by side in one run. With
``--overlap`` the same pull is also timed under an overlapped delivery schedule with a stand-in
learner update between pulls.

Placements measured:

* CPU-only machines: pageable, pinned (which falls back to pageable memory without CUDA, and is
  labelled so), and CPU-sharded storage over 2 and 4 shards (the sharding logic, not a faster
  memory tier).
* With CUDA: also one GPU (the learner's, ``cuda:0``) and, with several GPUs, sharded GPUs.

Next to the measurements, the planner (:func:`~conduit.placement.plan_placement` on
:meth:`Topology.detect() <conduit.placement.Topology.detect>`) says what it would pick at each
``d`` for the measured capacity and for the paper's buffer of 10^6 rows. The capacity is
reduced automatically so that a buffer fits the memory budget (``--max-buffer-gb`` and a
fraction of what is free); the capacity actually used is reported per ``d``.

Prints a table, writes ``placement.json`` and ``placement.png`` (log latency vs dimension, one
line per placement, a star on the planner's pick) under ``--out``. The JSON is rewritten with
``"partial": true`` after every placement measured at every ``d``, so an interrupted sweep keeps
what it measured.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from conduit.bench.common import PartialJSON, apply_quick, parse_quick, progress
from conduit.cli_args import arg, command_parser
from conduit.errors import CapacityError, ConfigError
from conduit.placement import Topology, plan_placement
from conduit.plane import ExperienceDataPlane
from conduit.report import pyplot, save_figure, table, write_json
from conduit.scheduling.space import Schedule
from conduit.spec import ExperienceSpec
from conduit.storage import Placement
from conduit.timing import repeat_times
from conduit.workloads.learner import resolve_device

PAPER_CAPACITY = 1_000_000


@dataclass(frozen=True)
class PlacementBenchArgs:
    """Arguments of ``conduit bench placement``."""

    dims: tuple[int, ...] = arg((128, 1000, 2000, 5000, 10000), "transition dimensions d", min=1)
    capacity: int = arg(100_000, "buffer capacity in rows (reduced per d to fit memory)", min=1)
    batch_size: int = arg(512, "training batch size pulled by the learner", min=1)
    repeats: int = arg(30, "timed pulls per placement and d (the median is reported)", min=1)
    warmup: int = arg(3, "untimed pulls before timing")
    max_buffer_gb: float = arg(2.0, "largest buffer allocated for one placement (GB)",
                               positive=True)
    mem_fraction: float = arg(0.3, "largest fraction of free host (or GPU) memory one buffer "
                                   "may take", positive=True, max=1)
    shards: tuple[int, ...] = arg((2, 4), "shard counts for CPU-sharded storage", min=1)
    overlap: bool = arg(True, "also time pull() under overlapped delivery with a stand-in "
                              "learner update between pulls")
    learner_device: str = arg("auto", "learner device: 'auto' (cuda:0 when available, else "
                                      "cpu), 'cpu' or 'cuda:N'")
    out: str = arg("runs/bench/placement", "output directory for JSON and PNG", output="dir")
    quick: bool = arg(False, "tiny sizes, for a smoke run (< 30 s)")
    seed: int = arg(0, "sampler seed")


def transition_spec(d: int) -> ExperienceSpec:
    """The Fig. 12 transition: obs and next_obs of ``d`` float32, action, reward, done."""
    return ExperienceSpec.of(obs=((d,), torch.float32), next_obs=((d,), torch.float32),
                             action=((), torch.int64), reward=((), torch.float32),
                             done=((), torch.bool))


@dataclass(frozen=True)
class _Target:
    label: str
    placement: Placement
    note: str = ""


def placements_available(learner: torch.device, shards: tuple[int, ...]) -> list[_Target]:
    """Every placement this machine can execute, in plot order."""
    cuda = torch.cuda.is_available()
    out = [_Target("pageable", Placement.pageable())]
    if cuda:
        out.append(_Target("pinned", Placement.pinned()))
    else:
        out.append(_Target("pinned (=pageable, no CUDA)", Placement.pinned(),
                           "page-locking needs CUDA; this store falls back to pageable memory"))
    for k in shards:
        out.append(_Target(f"cpu-sharded x{k}", Placement.sharded(["cpu"] * k),
                           "rows split over CPU shards: exercises sharded indexing"))
    if cuda:
        gpu0 = str(learner) if learner.type == "cuda" else "cuda:0"
        out.append(_Target(f"device[{gpu0}]", Placement.device(gpu0)))
        n = torch.cuda.device_count()
        if n > 1:
            devs = [f"cuda:{i}" for i in range(n)]
            out.append(_Target(f"sharded[{n} GPUs]", Placement.sharded(devs)))
    return out


def fit_capacity(args: PlacementBenchArgs, x: int, targets: list[_Target]) -> int:
    """Largest capacity <= ``args.capacity`` whose buffer fits every placement's budget, and
    at least one batch.

    The budget is ``--max-buffer-gb``, and ``--mem-fraction`` of the free host memory (and of
    the free memory of the emptiest GPU when a placement uses one).

    Raises:
        ConfigError: One batch of ``x``-byte rows does not fit the budget (field ``dims``).
    """
    host = args.mem_fraction * psutil.virtual_memory().available
    budget = min(args.max_buffer_gb * 1e9, host)
    if any(torch.device(d).type == "cuda" for t in targets for d in t.placement.devices):
        # a sharded GPU buffer needs less per device; budget for the single-GPU one
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
        budget = min(budget, args.mem_fraction * free)
    fit = int(budget // x)
    if fit < args.batch_size:
        raise ConfigError("dims", f"one batch of --batch-size {args.batch_size} rows of "
                                  f"{x:,} B ({args.batch_size * x / 1e9:.3g} GB) exceeds the "
                                  f"{budget / 1e9:.3g} GB one buffer may take (--max-buffer-gb "
                                  f"{args.max_buffer_gb:g}, --mem-fraction "
                                  f"{args.mem_fraction:g} of free memory); lower --dims or "
                                  "--batch-size, or raise --max-buffer-gb")
    return min(args.capacity, fit)


def _fill(plane: ExperienceDataPlane, spec: ExperienceSpec, capacity: int, seed: int) -> None:
    """Fill the buffer to capacity with random transitions, pushed in chunks of <= 64 MB."""
    x = spec.bytes_per_sample
    chunk = max(1, min(capacity, (64 << 20) // x))
    g = torch.Generator().manual_seed(seed)
    d = spec.fields["obs"].shape[0]
    obs = torch.randn(chunk, d, generator=g)
    rows = {"obs": obs, "next_obs": obs.roll(1, 0),
            "action": torch.randint(0, 8, (chunk,), generator=g),
            "reward": torch.randn(chunk, generator=g),
            "done": torch.zeros(chunk, dtype=torch.bool)}
    left = capacity
    while left > 0:
        n = min(chunk, left)
        plane.push({k: v[:n] for k, v in rows.items()})
        left -= n


def _sync(device: torch.device) -> Callable[[], None] | None:
    """Wait for the learner's stream: what a learner using the batch waits for. Not a
    device-wide synchronize, which would also wait for the copy of the next batch that the
    delivery worker has already started on its own stream."""
    if device.type == "cuda":
        return lambda: torch.cuda.current_stream(device).synchronize()
    return None


def measure(args: PlacementBenchArgs, target: _Target, spec: ExperienceSpec, capacity: int,
            learner: torch.device) -> dict[str, Any]:
    """Inline (and optionally overlapped) pull latency of one placement at one size."""
    t0 = time.perf_counter()
    plane = ExperienceDataPlane(spec=spec, capacity=capacity, batch_size=args.batch_size,
                                placement=target.placement, learner_device=learner,
                                schedule=Schedule(0, 1, 0, 1), seed=args.seed, timeout=120)
    try:
        _fill(plane, spec, capacity, args.seed)
        fill_s = time.perf_counter() - t0
        sync = _sync(learner)
        inline = statistics.median(repeat_times(plane.pull, repeats=args.repeats,
                                                warmup=args.warmup, sync=sync))
        row: dict[str, Any] = {"inline_s": inline, "fill_s": fill_s}
        if args.overlap:
            # Overlapped delivery: a background worker prefetches the next batch while a
            # stand-in learner update (a sleep twice the inline latency) runs.
            update_s = max(1e-3, 2 * inline)
            plane.set_schedule(Schedule(0, 1, 1, 1))
            times = []
            for k in range(args.warmup + args.repeats):
                t = time.perf_counter()
                plane.pull()
                if sync:
                    sync()
                if k >= args.warmup:
                    times.append(time.perf_counter() - t)
                time.sleep(update_s)
            row["overlap_s"] = statistics.median(times)
            row["update_stand_in_s"] = update_s
        row["placement_actual"] = plane.buffer.placement.to_dict()
        store = plane.buffer.store
        row["pinned_memory"] = bool(getattr(store, "pinned", False))
        return row
    finally:
        plane.close()
        del plane
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def planner_pick(topology: Topology, x: int, capacity: int, learner: str, *,
                 batch_size: int) -> dict[str, Any]:
    """What Alg. 1 picks on this machine's topology, or why nothing fits; its predicted time
    per sample and per batch of ``batch_size`` rows."""
    try:
        dec = plan_placement(spec_bytes=x, capacity=capacity, actor_device="cpu",
                             learner_device=learner, topology=topology)
    except CapacityError as exc:
        return {"chosen": None, "reason": str(exc)}
    return {"chosen": dec.placement.to_dict(), "label": dec.chosen.label(),
            "predicted_s_per_sample": dec.time_s,
            "predicted_batch_s": dec.time_s * batch_size}


def _match(targets: list[_Target], chosen: dict[str, Any] | None) -> str | None:
    if not chosen:
        return None
    p = Placement.from_dict(chosen)
    for t in targets:
        if t.placement == p:
            return t.label
    return None


QUICK: dict[str, Any] = {"dims": (128, 1000), "capacity": 4096, "repeats": 5, "warmup": 2,
                         "max_buffer_gb": 0.064, "shards": (2,)}
"""What ``--quick`` sets: tiny sizes for a smoke run."""


def effective(args: PlacementBenchArgs, given: Collection[str] | None = None
              ) -> PlacementBenchArgs:
    """The arguments after ``--quick``: :data:`QUICK` for the flags not given (see
    :func:`~conduit.bench.common.apply_quick`)."""
    return apply_quick(args, QUICK, given)


def plot(path: Path, result: dict[str, Any]) -> Path | None:
    """Fig. 12 style: latency (log) vs d, one line per placement, a star on the pick.

    Returns:
        The PNG written, or None when matplotlib is not installed.
    """
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    dims = result["dims"]
    for label in result["placements"]:
        ys = [e["inline_ms"] for d in dims for e in result["entries"]
              if e["dim"] == d and e["placement"] == label]
        if len(ys) == len(dims):
            ax.plot(dims, ys, marker="o", label=label)
    picked = [(p["dim"], p["measured_label"]) for p in result["planner"] if p["measured_label"]]
    if picked:
        xs = [d for d, _ in picked]
        ys = [e["inline_ms"] for d, lab in picked for e in result["entries"]
              if e["dim"] == d and e["placement"] == lab]
        ax.scatter(xs, ys, marker="*", s=220, color="black", zorder=5,
                   label="planner's pick")
    ax.set_yscale("log")
    ax.set_xlabel("transition dimension d")
    ax.set_ylabel(f"exposed delivery latency, batch {result['batch_size']} (ms)")
    ax.set_title(f"Delivery latency per placement (learner {result['learner_device']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def check(args: PlacementBenchArgs) -> None:
    """Refuse arguments the flags' own bounds let through.

    Raises:
        ConfigError: An unknown or absent learner device, a capacity below the batch
            size, or a dimension at which one batch does not fit the memory budget (see
            :func:`fit_capacity`).
    """
    learner = resolve_device(args.learner_device, field="learner_device")
    if args.capacity < args.batch_size:
        raise ConfigError("capacity", f"{args.capacity} rows hold less than one batch of "
                                      f"--batch-size {args.batch_size}")
    targets = placements_available(learner, args.shards)
    for d in args.dims:
        fit_capacity(args, transition_spec(d).bytes_per_sample, targets)


def run(args: PlacementBenchArgs) -> dict[str, Any]:
    """The whole sweep; returns the JSON payload, which :func:`main` writes. Until then the
    file holds what is measured so far, with ``"partial": true``.

    Args:
        args: The arguments to run with, ``--quick`` already applied (:func:`effective`).

    Raises:
        ConfigError: An argument :func:`check` refuses.
    """
    check(args)
    learner = resolve_device(args.learner_device, field="learner_device")
    targets = placements_available(learner, args.shards)
    topo = Topology.detect()
    plan_learner = str(learner) if learner.type == "cuda" else "cpu"
    entries: list[dict[str, Any]] = []
    planner: list[dict[str, Any]] = []
    caps: dict[int, int] = {}

    def result() -> dict[str, Any]:
        """The payload of what is measured so far."""
        ratios = {}
        for d in args.dims:
            by = {e["placement"]: e["inline_ms"] for e in entries if e["dim"] == d}
            base = by.get("pageable")
            ratios[str(d)] = {k: (base / v if base and v > 0 else None) for k, v in by.items()}
        return {"bench": "placement", "args": asdict(args), "dims": list(args.dims),
                "batch_size": args.batch_size, "learner_device": str(learner),
                "cuda": torch.cuda.is_available(), "topology_source": topo.source,
                "topology_estimated": topo.estimated,
                "placements": [t.label for t in targets],
                "capacity_requested": args.capacity,
                "capacity": {str(d): c for d, c in caps.items()},
                "capacity_reduced": any(c < args.capacity for c in caps.values()),
                "entries": entries, "planner": planner, "speedup_vs_pageable": ratios,
                "notes": [t.note and f"{t.label}: {t.note}" for t in targets if t.note]}

    with PartialJSON(Path(args.out) / "placement.json") as partial:
        # An untimed round on every placement first, so the allocators, the kernels and the
        # learner-side copy paths are warm before it is measured (otherwise the first line of
        # the table pays for them).
        first = transition_spec(max(args.dims))
        warm_cap = min(fit_capacity(args, first.bytes_per_sample, targets), 4 * args.batch_size)
        for t in targets:
            measure(args, t, first, warm_cap, learner)
        for d in args.dims:
            spec = transition_spec(d)
            x = spec.bytes_per_sample
            cap = fit_capacity(args, x, targets)
            caps[d] = cap
            reduced = cap < args.capacity
            progress(f"d={d}: {x:,} B/sample, capacity {cap:,} rows "
                     f"({cap * x / 1e9:.2f} GB){' (reduced to fit memory)' if reduced else ''}")
            for t in targets:
                r = measure(args, t, spec, cap, learner)
                e = {"dim": d, "bytes_per_sample": x, "capacity": cap, "placement": t.label,
                     "kind": t.placement.kind, "devices": list(t.placement.devices),
                     "note": t.note, "inline_ms": r["inline_s"] * 1e3,
                     "overlap_ms": r["overlap_s"] * 1e3 if "overlap_s" in r else None,
                     "fill_s": r["fill_s"], "pinned_memory": r["pinned_memory"]}
                entries.append(e)
                extra = (f", overlap {e['overlap_ms']:.3f} ms" if e["overlap_ms"] is not None
                         else "")
                progress(f"  {t.label:<28} inline {e['inline_ms']:.3f} ms{extra}")
                partial.write(result())
            pick = planner_pick(topo, x, cap, plan_learner, batch_size=args.batch_size)
            paper = planner_pick(topo, x, PAPER_CAPACITY, plan_learner,
                                 batch_size=args.batch_size)
            planner.append({"dim": d, "capacity": cap, **pick,
                            "measured_label": _match(targets, pick.get("chosen")),
                            "paper_capacity": PAPER_CAPACITY,
                            "paper_capacity_label": paper.get("label"),
                            "paper_capacity_reason": paper.get("reason")})
            progress(f"  planner picks {pick.get('label') or 'nothing'} "
                     f"(at 10^6 rows: {paper.get('label') or 'nothing fits'})")
            partial.write(result())
    return result()


def format_result(result: dict[str, Any]) -> str:
    """The table printed at the end: inline ms per placement, per d, and the planner's pick."""
    labels = result["placements"]
    rows = []
    for d in result["dims"]:
        by = {e["placement"]: e for e in result["entries"] if e["dim"] == d}
        pick = next(p for p in result["planner"] if p["dim"] == d)
        cells: list[Any] = [d, result["capacity"][str(d)]]
        for lab in labels:
            e = by.get(lab)
            cells.append(math.nan if e is None else e["inline_ms"])
        cells += [pick.get("label") or "-", pick.get("paper_capacity_label") or "none fits"]
        rows.append(cells)
    head = ["d", "capacity", *[f"{lab} ms" for lab in labels], "planner pick",
            "pick @1e6 rows"]
    out = [table(head, rows)]
    if result["args"]["overlap"]:
        orow = []
        for d in result["dims"]:
            by = {e["placement"]: e for e in result["entries"] if e["dim"] == d}
            orow.append([d, *[by[lab]["overlap_ms"] if lab in by else math.nan
                              for lab in labels]])
        out += ["", "overlapped delivery (pull with a prefetching worker):",
                table(["d", *[f"{lab} ms" for lab in labels]], orow)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``conduit bench placement``."""
    parser = command_parser("conduit bench placement", __doc__, PlacementBenchArgs)
    args = parse_quick(parser, PlacementBenchArgs, argv, effective, check=check)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        result = run(args)
        result["wall_s"] = time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png = plot(out / "placement.png", result)
    result["png"] = str(png) if png else None
    path = write_json(out / "placement.json", result, with_machine=True)
    print()
    print(format_result(result))
    for n in result["notes"]:
        print(f"note: {n}")
    if result["capacity_reduced"]:
        print(f"note: capacity reduced from {args.capacity:,} to fit memory: "
              f"{result['capacity']}")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
