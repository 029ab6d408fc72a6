"""``conduit bench plane``: exposed experience-path latency, inline against overlapped.

A synthetic actor → plane → learner loop with real compute on both sides: the rollout runs a
policy MLP forward over freshly generated observations, the update runs an MLP forward and
backward on the delivered batch. Ingestion (transition assembly and normalisation) and delivery
(sample, gather, reshape) are registered as operators. The same loop runs under the inline
schedule (Fig. 5a) and under an overlapped one, side by side, and reports per iteration

    exposed = wall − rollout − update

(docs/design.md §9), plus the time to sample a batch of 512 at dimension 1000 from a
100 000-slot buffer next to a plain ``copy_`` of the same bytes and to the gather floor.

On-policy, both schedules use the same consume-once layout; by default its first mini-batch is
drawn from every rollout unit but the last (``--no-lead-first`` for a plain shuffle), so an
overlapped plane can assemble it while the last unit is still being ingested.

The JSON is rewritten with ``"partial": true`` after every loop (mode and schedule), so an
interrupted run keeps the loops it finished.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from conduit.bench.common import PartialJSON, apply_quick, check_rows, parse_quick, progress
from conduit.cli_args import arg, command_parser
from conduit.errors import ConfigError
from conduit.plane import ExperienceDataPlane
from conduit.plane.config import PlaneConfig
from conduit.plane.synthetic import Workload, fill, make_step, register_ops, synthetic_spec
from conduit.report import pyplot, save_figure, table, write_json
from conduit.scheduling.space import Schedule
from conduit.spec import ExperienceSpec
from conduit.storage import ExperienceBuffer, FifoSampler, UniformSampler
from conduit.storage.threads import data_path_threads
from conduit.timing import repeat_times


@dataclass(frozen=True)
class PlaneBenchArgs:
    """Arguments of ``conduit bench plane``."""

    dim: int = arg(1000, "transition (observation) dimension", min=1)
    rollout_rows: int = arg(512, "rows per rollout unit (one actor push)", min=1)
    batch_size: int = arg(512, "off-policy training batch size", min=1)
    capacity: int = arg(100_000, "off-policy buffer capacity (rows)", min=1)
    iters: int = arg(40, "measured iterations per configuration", min=1)
    warmup: int = arg(5, "unmeasured iterations per configuration")
    hidden: int = arg(512, "hidden width of the synthetic policy / learner MLPs", min=1)
    onpolicy_units: int = arg(8, "rollout units per on-policy iteration", min=1)
    minibatches: int = arg(8, "on-policy mini-batches per epoch (M)", min=1)
    compute_threads: int = arg(1, "torch threads for rollout/update compute (the data path "
                                  "always uses its own single thread)", min=1)
    repeats: int = arg(50, "repetitions for the gather-vs-copy measurement", min=1)
    lead_first: bool = arg(True, "on-policy: draw each iteration's first mini-batch from every "
                                 "unit but the last (FifoSampler.leading), "
                                 "the same layout under both schedules")
    out: str = arg("runs/bench/plane", "output directory for JSON and PNG", output="dir")
    quick: bool = arg(False, "tiny sizes, for a smoke run (flags given explicitly win)")


#: What ``--quick`` gives the flags left at their defaults.
QUICK = {"dim": 64, "rollout_rows": 64, "batch_size": 64, "capacity": 2000, "iters": 5,
         "warmup": 1, "hidden": 32, "onpolicy_units": 2, "minibatches": 4, "repeats": 5}


def fill_units(args: PlaneBenchArgs) -> int:
    """Rollout units pushed before an off-policy loop measures: up to ``20·rollout_rows`` rows
    within ``capacity``, and always at least one batch of rows (in whole units), so the first
    sample does not wait for rows no one pushes."""
    units = min(args.capacity, 20 * args.rollout_rows) // args.rollout_rows
    return max(1, units, -(-args.batch_size // args.rollout_rows))


def run_loop(args: PlaneBenchArgs, *, on_policy: bool, schedule: Schedule) -> dict[str, Any]:
    """Run the synthetic loop under ``schedule``; returns per-iteration breakdown medians, and
    each operator's median time and number of records over the measured iterations (the fill
    and the warm-up left out)."""
    work = Workload(args.dim, args.hidden)
    spec = synthetic_spec(args.dim)
    if on_policy:
        n = args.onpolicy_units * args.rollout_rows
        sampler = FifoSampler.leading(units=args.onpolicy_units if args.lead_first else 1,
                                      num_minibatches=args.minibatches)
        plane = ExperienceDataPlane(spec=spec, capacity=n, mode="on_policy",
                                    num_minibatches=args.minibatches, schedule=schedule,
                                    sampler=sampler)
    else:
        plane = ExperienceDataPlane(spec=spec, capacity=args.capacity, batch_size=args.batch_size,
                                    schedule=schedule)
    register_ops(plane, on_policy=on_policy)
    step = make_step(work, rollout_rows=args.rollout_rows, on_policy=on_policy,
                     onpolicy_units=args.onpolicy_units)
    rows: list[dict[str, float]] = []
    before = torch.get_num_threads()
    torch.set_num_threads(args.compute_threads)
    try:
        with plane:
            if not on_policy:  # fill to a realistic replay size before measuring
                fill(plane, work, rollout_rows=args.rollout_rows, units=fill_units(args))
            for it in range(args.warmup + args.iters):
                if it == args.warmup:  # the operator figures cover the measured iterations
                    plane.timings.clear()
                t0 = time.perf_counter()
                compute = step(plane)
                wall = time.perf_counter() - t0
                if it >= args.warmup:
                    rows.append({"wall": wall, **compute, "exposed": max(
                        0.0, wall - compute["rollout"] - compute["update"])})
            timing = plane.timings.summary()
    finally:
        torch.set_num_threads(before)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {"schedule": schedule.to_dict(), "label": schedule.label(),
            "median_ms": {k: v * 1e3 for k, v in med.items()},
            "operator_median_ms": {k: v["median_s"] * 1e3 for k, v in timing.items()},
            "operator_counts": {k: v["count"] for k, v in timing.items()}}


def gather_vs_copy(*, dim: int, capacity: int, batch: int, repeats: int) -> dict[str, float]:
    """Median time to gather and to sample ``batch`` rows through the buffer, next to a plain
    ``copy_`` of the same bytes and to the gather floor (one ``index_select`` of random rows
    into a new tensor).

    Raises:
        ConfigError: ``batch`` exceeds ``capacity`` (field ``batch_size``).
    """
    if batch > capacity:
        raise ConfigError("batch_size", f"{batch} exceeds --capacity {capacity}")
    spec = ExperienceSpec.of(obs=((dim,), torch.float32))
    buf = ExperienceBuffer(spec=spec, capacity=capacity, sampler=UniformSampler(seed=0))
    chunk = 10_000
    for s in range(0, capacity, chunk):
        n = min(chunk, capacity - s)
        buf.extend({"obs": torch.randn(n, dim)}, validate=False)
    src = buf.store.column("obs")
    dst = torch.empty(batch, dim)
    # Rotate over different rows every repetition for both, so neither reads from a warm cache.
    offsets = iter([(k * 7919 * batch) % (capacity - batch + 1)
                    for k in range(10 * repeats + 100)])
    draws = iter([buf.draw(batch) for _ in range(10 * repeats + 100)])
    def median_s(fn: Callable[[], object]) -> float:
        return statistics.median(repeat_times(fn, repeats=repeats, warmup=3))

    with data_path_threads(1):
        t_copy = median_s(lambda: dst.copy_(src[(o := next(offsets)):o + batch]))
        t_floor = median_s(lambda: torch.index_select(src, 0, next(draws).indices))
        t_gather = median_s(lambda: buf.store.get(next(draws).indices))
    t_sample = median_s(lambda: buf.sample(batch))
    return {"copy_ms": t_copy * 1e3, "floor_ms": t_floor * 1e3, "gather_ms": t_gather * 1e3,
            "sample_ms": t_sample * 1e3, "gather_over_copy": t_gather / t_copy,
            "sample_over_copy": t_sample / t_copy, "sample_over_floor": t_sample / t_floor,
            "bytes": batch * dim * 4}


def plot(result: dict[str, Any], path: Path) -> Path | None:
    """Stacked bars of the per-iteration breakdown; None when matplotlib is absent."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, parts = [], {"rollout": [], "exposed": [], "update": []}
    for mode in ("off_policy", "on_policy"):
        for cfg in result["loops"][mode]:
            labels.append(f"{mode.split('_')[0]}\n{cfg['name']}")
            for k in parts:
                parts[k].append(cfg["median_ms"][k])
    bottom = [0.0] * len(labels)
    colors = {"rollout": "#8fb3d9", "exposed": "#d9534f", "update": "#9ccc65"}
    for k, vals in parts.items():
        ax.bar(labels, vals, bottom=bottom, label=k if k != "exposed" else
               "exposed experience path", color=colors[k])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per iteration (median)")
    ax.set_title("Per-iteration breakdown: inline vs Conduit overlap")
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def effective(args: PlaneBenchArgs, given: Collection[str] | None = None) -> PlaneBenchArgs:
    """The arguments after ``--quick``: :data:`QUICK` for the flags not given (see
    :func:`~conduit.bench.common.apply_quick`)."""
    return apply_quick(args, QUICK, given)


def check_args(args: PlaneBenchArgs) -> PlaneBenchArgs:
    """``args``, once the planes the benchmark builds would take them.

    Off-policy, a buffer of ``--capacity`` rows sampled ``--batch-size`` at a time, filled one
    rollout unit of ``--rollout-rows`` at a time; on-policy, ``--onpolicy-units`` units of
    ``--rollout-rows`` per iteration, cut into ``--minibatches``.

    Raises:
        ConfigError: Naming the flag's field (``batch_size``, ``rollout_rows`` or
            ``minibatches``).
    """
    spec = synthetic_spec(1)
    check_rows(batch_size=args.batch_size, capacity=args.capacity,
               rollout_rows=args.rollout_rows)
    rows = args.onpolicy_units * args.rollout_rows
    if args.minibatches > rows:
        raise ConfigError("minibatches", f"{args.minibatches} mini-batches cannot be cut from "
                                         f"{rows} rows per on-policy iteration (--onpolicy-units"
                                         " × --rollout-rows); lower --minibatches")
    try:
        PlaneConfig(spec=spec, capacity=args.capacity, batch_size=args.batch_size)
        PlaneConfig(spec=spec, capacity=rows, mode="on_policy",
                    num_minibatches=args.minibatches)
    except ConfigError as exc:
        field = "minibatches" if exc.field == "num_minibatches" else exc.field
        raise ConfigError(field, exc.reason) from exc
    return args


def run(args: PlaneBenchArgs) -> dict[str, Any]:
    """Run the whole benchmark; prints tables, writes JSON and PNG.

    Args:
        args: The arguments to run with, ``--quick`` already applied (:func:`effective`).

    Raises:
        ConfigError: As :func:`check_args` raises it, before any work.
    """
    args = check_args(args)
    m = args.minibatches
    configs = {
        "off_policy": [("inline", Schedule(0, 1, 0, 1)), ("overlap", Schedule(1, 1, 1, 1))],
        "on_policy": [("inline", Schedule(0, 1, 0, Fraction(1, m))),
                      ("overlap", Schedule(1, Fraction(1, m), 1, Fraction(1, m)))],
    }
    out = Path(args.out)
    loops: dict[str, list[dict[str, Any]]] = {}
    with PartialJSON(out / "plane.json") as partial:
        for mode, cfgs in configs.items():
            loops[mode] = []
            for name, sched in cfgs:
                progress(f"{mode} {name}: {sched.label()} ({args.iters} iterations)")
                r = run_loop(args, on_policy=mode == "on_policy", schedule=sched)
                r["name"] = name
                loops[mode].append(r)
                partial.write({"args": asdict(args), "loops": loops})
        rows = []
        reductions = {}
        for mode, cfgs in loops.items():
            base = cfgs[0]["median_ms"]["exposed"]
            for c in cfgs:
                md = c["median_ms"]
                red = 1 - md["exposed"] / base if base > 0 else 0.0
                rows.append([mode, c["name"], c["label"], md["rollout"], md["update"],
                             md["exposed"], md["wall"], f"{100 * red:.1f}%"])
            reductions[mode] = 1 - cfgs[1]["median_ms"]["exposed"] / base if base > 0 else 0.0
        print("\nPer-iteration medians (ms), measured side by side in one run")
        print(table(["mode", "config", "schedule", "rollout", "update", "exposed", "end-to-end",
                     "exposed reduction"], rows))
        progress(f"gather vs copy: batch {args.batch_size}, dim {args.dim}, "
                 f"capacity {args.capacity}")
        gc = gather_vs_copy(dim=args.dim, capacity=args.capacity, batch=args.batch_size,
                            repeats=args.repeats)
        print(f"\nSample batch {args.batch_size} × dim {args.dim} from {args.capacity} slots "
              f"({gc['bytes'] / 1e6:.1f} MB)")
        print(table(["plain copy_ (ms)", "floor (ms)", "gather (ms)", "draw+gather (ms)",
                     "gather/copy", "sample/copy", "sample/floor"],
                    [[gc["copy_ms"], gc["floor_ms"], gc["gather_ms"], gc["sample_ms"],
                      gc["gather_over_copy"], gc["sample_over_copy"], gc["sample_over_floor"]]]))
    result = {"args": asdict(args), "loops": loops, "exposed_reduction": reductions,
              "gather_vs_copy": gc}
    jp = write_json(out / "plane.json", result, with_machine=True)
    png = plot(result, out / "plane.png")
    print(f"\nwrote {jp}" + (f" and {png}" if png else ""))
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``conduit bench plane``."""
    p = command_parser("conduit bench plane", __doc__, PlaneBenchArgs)
    run(parse_quick(p, PlaneBenchArgs, argv, effective, check=check_args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
