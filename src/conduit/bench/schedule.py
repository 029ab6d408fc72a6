"""``conduit bench schedule``: every manual configuration against the auto pick (Fig. 15), and
the cost model's fidelity (Tab. 4), on the synthetic workload.

The sweep follows Fig. 14: batch size at a fixed transition dimension, and transition dimension
at a fixed batch size. At every point, in one run and side by side:

* every manual configuration available on this machine is measured: placement (pageable,
  pinned, sharded over CPU shards) × overlap (both operators inline, or both overlapped) ×
  granularity ``g = g_ing = g_del`` in a small set, like the paper's 32 manual points;
* the auto pick is the policy the trainers run: placement from Alg. 1 over this machine's
  topology, then the schedule :class:`conduit.plane.tuner.WarmupScheduleTuner` keeps
  (warm-up on the start schedule, the cost model's pick with the copy-time bound, and the
  measured trial against the best threadless schedule), then the same measurement as the
  manual configurations;
* the model's predicted ``T_iter`` for each manual configuration on the auto placement is
  compared with the measured one (Pearson r, MAPE, top-k ordering, as Tab. 4). The model is
  Eq. 2 with the copy-time bound, over a profile of every granularity measured after the auto
  pick (:func:`conduit.plane.autotune.profile_plane`), inline runs apart from overlapped ones.

``T_iter`` is measured as the mean wall time per iteration over a whole number of ``g`` cycles,
in a few rounds, reporting the median round. One tuner iteration is such a measurement of
``--iters`` iterations. The auto pick's gap to the best manual configuration (target: within
5 %) is not read off the sweep, whose configurations run minutes apart while the machine's
speed drifts: the auto pick and the sweep's best configuration, each on a plane of its own,
are measured again in alternating rounds (``--paired-rounds``; the one that goes first changes
every round), and the gap is the ratio of their median rounds. The JSON keeps every
measurement.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from conduit.bench.common import PartialJSON, apply_quick, parse_quick, progress
from conduit.cli_args import arg, command_parser
from conduit.errors import ConfigError
from conduit.plane import ExperienceDataPlane, synthetic
from conduit.plane.autotune import plane_copy_times, profile_plane
from conduit.plane.tuner import WarmupScheduleTuner
from conduit.report import pyplot, save_figure, table, write_json
from conduit.scheduling import Schedule, copy_bound, fidelity, predict, start_schedule
from conduit.storage import Placement

#: The auto pick's target: within 5 % of the best manual configuration (docs/design.md §9).
TARGET_GAP = 0.05
#: Manual placements this benchmark knows how to build on any machine.
PLACEMENTS = ("pageable", "pinned", "sharded-cpu")


#: Largest ``--g-max``: the auto-optimizer's search grows with the square of the cap (seconds
#: at 64, minutes past a few hundred), and every cycle of the tuner runs ``g_max`` iterations.
MAX_G_FLAG = 64


@dataclass(frozen=True)
class ScheduleBenchArgs:
    """Arguments of ``conduit bench schedule``."""

    batch_sizes: tuple[int, ...] = arg((32, 128, 512, 1024), "batch sizes swept at --base-dim",
                                       min=1)
    dims: tuple[int, ...] = arg((128, 1000, 10000), "transition dimensions swept at "
                                                    "--base-batch", min=1)
    base_dim: int = arg(1000, "transition dimension of the batch-size sweep", min=1)
    base_batch: int = arg(512, "batch size of the dimension sweep", min=1)
    granularities: tuple[int, ...] = arg((1, 2, 4, 8), "g of the manual configs (g_ing = g_del)",
                                         min=1)
    placements: tuple[str, ...] = arg((), "manual placements among pageable, pinned, "
                                          "sharded-cpu (default: all with CUDA; without it "
                                          "pinned is pageable memory, so it is left out)")
    g_max: int = arg(8, "granularity cap of the auto-optimizer's space (its search grows with "
                        f"the square of the cap, so at most {MAX_G_FLAG})", min=1,
                     max=MAX_G_FLAG)
    iters: int = arg(8, "measured iterations per round (rounded up to a multiple of g)", min=1)
    rounds: int = arg(3, "measurement rounds per configuration; the median round is reported",
                      min=1)
    paired_rounds: int = arg(6, "alternating rounds of the auto pick and the sweep's best "
                                "configuration, from which the gap is taken", min=1)
    warmup: int = arg(2, "unmeasured iterations after each switch (at least g)")
    profile_iters: int = arg(3, "measured operator invocations per g in the fidelity profile",
                             min=1)
    hidden: int = arg(32, "hidden width of the synthetic policy / learner MLPs", min=1)
    capacity: int = arg(20_000, "buffer capacity (rows), capped by --buffer-mb", min=1)
    buffer_mb: int = arg(512, "memory budget of one buffer (MB)", min=1)
    fill_units: int = arg(8, "rollout units pushed before measuring", min=1)
    compute_threads: int = arg(1, "torch threads for rollout/update compute", min=1)
    top_k: int = arg(8, "size of the ranking compared (Tab. 4 uses 8)", min=1)
    out: str = arg("runs/bench/schedule", "output directory for JSON and PNG", output="dir")
    quick: bool = arg(False, "tiny sweep for a smoke run (under a minute)")


#: Values ``--quick`` uses for fields left at their defaults.
_QUICK = {"batch_sizes": (32, 128), "dims": (128, 512), "base_dim": 128, "base_batch": 32,
          "granularities": (1, 2, 4), "g_max": 4, "iters": 4, "rounds": 1, "warmup": 1,
          "paired_rounds": 2,
          "profile_iters": 1, "hidden": 16, "capacity": 2000, "fill_units": 4}


def effective(args: ScheduleBenchArgs, given: Collection[str] | None = None
              ) -> ScheduleBenchArgs:
    """The arguments after ``--quick``: the quick values for the flags not given (see
    :func:`~conduit.bench.common.apply_quick`), the quick granularities only up to the
    ``g_max`` in force."""
    out = apply_quick(args, _QUICK, given)
    if out.granularities != args.granularities:  # the quick ones, within an explicit --g-max
        out = replace(out, granularities=tuple(g for g in out.granularities if g <= out.g_max))
    return out


def check_args(args: ScheduleBenchArgs) -> ScheduleBenchArgs:
    """The arguments the sweep runs with (with the default placements), or the value it would
    refuse, found before any work.

    Raises:
        ConfigError: An unknown placement (field ``placements``) or a granularity outside
            ``[1, g_max]`` (field ``granularities``).
    """
    if not args.placements:
        args = replace(args, placements=PLACEMENTS if torch.cuda.is_available()
                       else ("pageable", "sharded-cpu"))
    for name in args.placements:
        _placement(name)
    if any(g < 1 or g > args.g_max for g in args.granularities):
        raise ConfigError("granularities", f"must lie in [1, --g-max={args.g_max}], got "
                                           f"{list(args.granularities)}")
    return args


def sweep_points(args: ScheduleBenchArgs) -> list[tuple[int, int]]:
    """``(batch_size, dim)`` points: the batch sweep, then the dimension sweep (no repeats)."""
    pts = [(b, args.base_dim) for b in args.batch_sizes]
    pts += [(args.base_batch, d) for d in args.dims]
    seen: set[tuple[int, int]] = set()
    return [p for p in pts if not (p in seen or seen.add(p))]


def _placement(name: str) -> Placement:
    if name == "pageable":
        return Placement.pageable()
    if name == "pinned":
        return Placement.pinned()
    if name == "sharded-cpu":
        return Placement.sharded(("cpu", "cpu"))
    raise ConfigError("placements", f"unknown placement {name!r}; choose from {PLACEMENTS}")


def _cycles(n: int, g: int) -> int:
    return max(g, math.ceil(n / g) * g)


class _Point:
    """One sweep point: a workload and the planes built for it."""

    def __init__(self, args: ScheduleBenchArgs, batch: int, dim: int) -> None:
        self.args = args
        self.batch = batch
        self.dim = dim
        self.spec = synthetic.synthetic_spec(dim)
        budget = max(batch, (args.buffer_mb << 20) // self.spec.bytes_per_sample)
        self.capacity = max(batch, min(args.capacity, budget))
        self.work = synthetic.Workload(dim, args.hidden)
        self.step = synthetic.make_step(self.work, rollout_rows=batch)

    def plane(self, placement: Placement | Literal["auto"]) -> ExperienceDataPlane:
        """A filled plane on ``placement`` (``"auto"``: Alg. 1 over this machine)."""
        plane = ExperienceDataPlane(spec=self.spec, capacity=self.capacity,
                                    batch_size=self.batch, placement=placement,
                                    g_max=self.args.g_max, timeout=120.0)
        synthetic.register_ops(plane, on_policy=False)
        units = max(1, min(self.args.fill_units, self.capacity // self.batch))
        synthetic.fill(plane, self.work, rollout_rows=self.batch, units=units)
        return plane

    def _switch(self, plane: ExperienceDataPlane, schedule: Schedule) -> tuple[int, int]:
        """Switch ``plane`` to ``schedule`` and warm it up; returns ``(g, iters)``: the
        schedule's cycle length and the measured iterations per round (whole cycles)."""
        plane.flush()
        plane.set_schedule(schedule)
        g = max(int(schedule.g_ing), int(schedule.g_del))
        synthetic.measure(plane, self.step, iters=0, warmup=_cycles(self.args.warmup, g))
        return g, _cycles(self.args.iters, g)

    def run(self, plane: ExperienceDataPlane, schedule: Schedule) -> dict[str, float]:
        """Switch ``plane`` to ``schedule``, warm up, then measure ``rounds`` rounds of a whole
        number of ``g`` cycles; the median round is reported (:func:`_median_round`)."""
        iters = self._switch(plane, schedule)[1]
        rounds = [synthetic.measure(plane, self.step, iters=iters, warmup=0)
                  for _ in range(max(1, self.args.rounds))]
        return _median_round(rounds, iters)

    def paired(self, runs: list[tuple[ExperienceDataPlane, Schedule]]) -> list[dict[str, float]]:
        """Measure each ``(plane, schedule)`` of ``runs`` in ``--paired-rounds`` alternating
        rounds (the one that goes first moves on by one each round), each round one cycle of
        warm-up and a whole number of ``g`` cycles; the median round of each, as :meth:`run`
        reports it."""
        cycles = [self._switch(plane, schedule) for plane, schedule in runs]
        rounds: list[list[dict[str, float]]] = [[] for _ in runs]
        for r in range(self.args.paired_rounds):
            for k in range(len(runs)):
                i = (r + k) % len(runs)
                g, iters = cycles[i]
                rounds[i].append(synthetic.measure(runs[i][0], self.step, iters=iters,
                                                   warmup=g))
        return [_median_round(rs, c[1]) for rs, c in zip(rounds, cycles)]


def _median_round(rounds: list[dict[str, float]], iters: int) -> dict[str, Any]:
    """The median round by wall time (robust to a neighbour process stealing the CPU for part
    of a round), in ms, with every round's wall time. With an even number of rounds it is the
    mean of the two middle rounds, field by field, so its wall time is the median
    (``statistics.median``) of the rounds' wall times."""
    by_wall = sorted(rounds, key=lambda r: r["wall"])
    n = len(by_wall)
    middle = by_wall[(n - 1) // 2:n // 2 + 1]

    def ms(key: str) -> float:
        return statistics.fmean(r[key] * 1e3 for r in middle)

    return {"wall_ms": ms("wall"), "exposed_ms": ms("exposed"),
            "rollout_ms": ms("rollout"), "update_ms": ms("update"),
            "iters": iters, "rounds": len(rounds),
            "round_wall_ms": [r["wall"] * 1e3 for r in rounds]}


@dataclass(frozen=True)
class _Timed:
    """One tuner iteration of the synthetic loop (see ``IterationTiming``)."""

    end_to_end: float
    rollout: float
    learning: bool = True


def tune(pt: _Point, plane: ExperienceDataPlane) -> WarmupScheduleTuner:
    """Choose ``plane``'s schedule as the trainers do: from the start schedule, one tuner
    iteration per ``--iters`` steps (a whole number of ``g_max`` cycles), until the tuner is
    done."""
    plane.flush()
    plane.set_schedule(start_schedule(plane.space))
    tuner = WarmupScheduleTuner(plane)
    steps = _cycles(pt.args.iters, pt.args.g_max)
    while not tuner.done:
        m = synthetic.measure(plane, pt.step, iters=steps, warmup=0)
        tuner.step(_Timed(end_to_end=m["wall"], rollout=m["rollout"]))
    return tuner


def run_point(args: ScheduleBenchArgs, batch: int, dim: int) -> dict[str, Any]:
    """Measure every manual configuration and the auto pick at one point."""
    pt = _Point(args, batch, dim)
    manual: list[dict[str, Any]] = []
    schedules: list[Schedule] = []
    for pname in args.placements:
        placement = _placement(pname)
        progress(f"B={batch} d={dim}: manual configs on {pname}")
        with pt.plane(placement) as plane:
            for ov in (0, 1):
                for g in args.granularities:
                    s = Schedule(ov, g, ov, g)
                    r = pt.run(plane, s)
                    schedules.append(s)
                    manual.append({"placement": pname, "placement_label": placement.label(),
                                   "schedule": s.to_dict(), "label": s.label(), **r})
    i_best = min(range(len(manual)), key=lambda i: manual[i]["wall_ms"])
    best = manual[i_best]
    # Auto: Alg. 1 placement, the trainers' tuner, then the same measurement; then a profile
    # of every granularity for the model's predictions.
    progress(f"B={batch} d={dim}: auto (placement, tuner, run, profile)")
    with pt.plane("auto") as plane:
        auto_place = plane.buffer.placement
        t0 = time.perf_counter()
        tuner = tune(pt, plane)
        tuning_s = time.perf_counter() - t0
        chosen = plane.schedule
        r = pt.run(plane, chosen)
        t0 = time.perf_counter()
        profile = copy_bound(profile_plane(plane, pt.step, iterations_per_g=args.profile_iters,
                                           granularities=args.granularities),
                             plane_copy_times(plane))
        profile_s = time.perf_counter() - t0
        progress(f"B={batch} d={dim}: auto pick against {best['placement']} {best['label']}, "
                 f"alternating rounds")
        with pt.plane(_placement(best["placement"])) as best_plane:
            auto_paired, best_paired = pt.paired([(plane, chosen),
                                                  (best_plane, schedules[i_best])])
    model = tuner.model_plan
    auto_row = {"placement": auto_place.label(), "schedule": chosen.to_dict(),
                "label": chosen.label(), "tuning_s": tuning_s,
                "model_pick": None if model is None else model.schedule.to_dict(),
                "top_candidates": [] if model is None else [c.to_dict() for c in model.ranked],
                **{k: tuner.report.get(k) for k in ("schedule_trial_ms", "copy_ms_per_unit",
                                                    "schedule_explain", "note")},
                "predicted_ms": predict(profile, chosen, mode=plane.mode).t_iter * 1e3,
                "profile_s": profile_s, "profile": profile.to_dict(), **r,
                "paired": auto_paired}
    same = [m for m in manual if m["placement_label"] == auto_place.label()]
    for m in same:
        s = Schedule(m["schedule"]["overlap_ing"], int(m["schedule"]["g_ing"]),
                     m["schedule"]["overlap_del"], int(m["schedule"]["g_del"]))
        m["predicted_ms"] = predict(profile, s, mode=plane.mode).t_iter * 1e3
    fid = None
    if len(same) >= 2:
        fid = fidelity([m["predicted_ms"] for m in same], [m["wall_ms"] for m in same],
                       k=min(args.top_k, len(same)))
        fid["configs"] = [f"{m['placement']} {m['label']}" for m in same]
    gap = auto_paired["wall_ms"] / best_paired["wall_ms"] - 1.0
    return {"batch_size": batch, "dim": dim, "capacity": pt.capacity,
            "bytes_per_sample": pt.spec.bytes_per_sample, "manual": manual, "auto": auto_row,
            "best_manual": {"placement": best["placement"], "label": best["label"],
                            "wall_ms": best["wall_ms"], "exposed_ms": best["exposed_ms"],
                            "paired": best_paired},
            "gap": gap, "gap_sweep": r["wall_ms"] / best["wall_ms"] - 1.0,
            "within_target": gap <= TARGET_GAP, "fidelity": fid}


def summarize(points: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """Sweep-wide figures: gaps, pooled fidelity, per-point ranking agreement."""
    pred = [m["predicted_ms"] for p in points for m in p["manual"] if "predicted_ms" in m]
    meas = [m["wall_ms"] for p in points for m in p["manual"] if "predicted_ms" in m]
    pooled = fidelity(pred, meas, k=min(k, len(pred))) if len(pred) >= 2 else None
    fids = [p["fidelity"] for p in points if p["fidelity"]]
    gaps = [p["gap"] for p in points]
    return {"n_points": len(points), "target_gap": TARGET_GAP,
            "max_gap": max(gaps) if gaps else None,
            "mean_gap": sum(gaps) / len(gaps) if gaps else None,
            "points_within_target": sum(p["within_target"] for p in points),
            "fidelity_pooled": pooled,
            "top_k_matches": sum(f["top_k_match"] for f in fids),
            "best_matches": sum(f["best_match"] for f in fids), "fidelity_points": len(fids)}


def _plot(result: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    args = result["args"]
    panels = [("batch size", "batch_size", [p for p in result["points"]
                                            if p["dim"] == args["base_dim"]],
               f"dim {args['base_dim']}"),
              ("transition dimension", "dim", [p for p in result["points"]
                                               if p["batch_size"] == args["base_batch"]],
               f"batch {args['base_batch']}")]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), squeeze=False)
    floor = 1e-3
    for col, (xlabel, key, pts, fixed) in enumerate(panels):
        for row, (metric, ylabel) in enumerate((("exposed_ms", "exposed experience path (ms)"),
                                                ("wall_ms", "T_iter (ms)"))):
            ax = axes[row][col]
            for i, p in enumerate(pts):
                ys = [max(m[metric], floor) for m in p["manual"]]
                ax.scatter([p[key]] * len(ys), ys, c="0.6", s=14,
                           label="manual configurations" if i == 0 else None)
                ax.scatter([p[key]], [max(p["auto"][metric], floor)], marker="*", c="red",
                           s=140, zorder=3, label="Conduit auto pick" if i == 0 else None)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(f"{xlabel} ({fixed})")
            ax.set_ylabel(ylabel)
            if pts:
                ax.legend(fontsize=8)
    fig.suptitle("Auto vs manual over placement x overlap x granularity (cf. Fig. 15)")
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


def _fmt_fid(f: dict[str, Any] | None) -> list[Any]:
    if not f:
        return ["-", "-", "-"]
    r = "nan" if f["pearson_r"] != f["pearson_r"] else f"{f['pearson_r']:.3f}"
    return [r, f"{f['mape']:.1f}%", f"{'yes' if f['top_k_match'] else 'no'} "
                                    f"(best {'yes' if f['best_match'] else 'no'})"]


def run(args: ScheduleBenchArgs) -> dict[str, Any]:
    """Run the sweep; prints a table, writes JSON and PNG under ``args.out``. The JSON is
    written with ``"partial": true`` after every point, then whole at the end.

    Args:
        args: The arguments to run with, ``--quick`` already applied (:func:`effective`).

    Raises:
        ConfigError: As :func:`check_args` raises it.
    """
    args = check_args(args)
    before = torch.get_num_threads()
    torch.set_num_threads(args.compute_threads)
    points: list[dict[str, Any]] = []
    out = Path(args.out)
    t0 = time.perf_counter()
    try:
        with PartialJSON(out / "schedule.json") as partial:
            pts = sweep_points(args)
            for i, (b, d) in enumerate(pts, 1):
                progress(f"point {i}/{len(pts)}: batch {b}, dim {d}")
                points.append(run_point(args, b, d))
                p = points[-1]
                progress(f"  alternating: best manual {p['best_manual']['placement']} "
                         f"{p['best_manual']['label']} {p['best_manual']['paired']['wall_ms']:.2f} "
                         f"ms; auto {p['auto']['label']} {p['auto']['paired']['wall_ms']:.2f} ms "
                         f"(gap {100 * p['gap']:+.1f}%)")
                partial.write({"args": asdict(args), "target_gap": TARGET_GAP, "points": points})
    finally:
        torch.set_num_threads(before)
    summary = summarize(points, args.top_k)
    summary["elapsed_s"] = time.perf_counter() - t0
    rows = []
    for p in points:
        bm, au = p["best_manual"], p["auto"]
        rows.append([p["batch_size"], p["dim"], f"{bm['placement']} {bm['label']}",
                     bm["wall_ms"], bm["paired"]["wall_ms"], f"{au['placement']} {au['label']}",
                     au["paired"]["wall_ms"], au["predicted_ms"], f"{100 * p['gap']:+.1f}%",
                     *_fmt_fid(p["fidelity"])])
    n_cfg = len(points[0]["manual"]) if points else 0
    print(f"\nAuto pick vs {n_cfg} manual configurations per point (T_iter = mean wall ms per "
          f"iteration). 'sweep ms': the best manual configuration in the sweep; 'ms': it and "
          f"the auto pick in {args.paired_rounds} alternating rounds, from which the gap is "
          f"taken")
    print(table(["batch", "dim", "best manual", "sweep ms", "ms", "auto pick", "ms",
                 "predicted", "gap", "pearson r", "MAPE", f"top-{args.top_k} match"], rows))
    pooled = summary["fidelity_pooled"]
    if pooled:
        print(f"\ncost model, pooled over {pooled['n']} configurations: Pearson r "
              f"{pooled['pearson_r']:.3f}, MAPE {pooled['mape']:.1f}%; top-k ordering matched "
              f"at {summary['top_k_matches']}/{summary['fidelity_points']} points, best "
              f"config at {summary['best_matches']}/{summary['fidelity_points']}")
    if summary["max_gap"] is not None:
        print(f"auto pick within {100 * TARGET_GAP:.0f}% of the best manual config at "
              f"{summary['points_within_target']}/{summary['n_points']} points (max gap "
              f"{100 * summary['max_gap']:+.1f}%)")
    result = {"args": asdict(args), "target_gap": TARGET_GAP, "points": points,
              "summary": summary}
    jp = write_json(out / "schedule.json", result, with_machine=True)
    png = _plot(result, out / "schedule.png")
    print(f"\nwrote {jp}" + (f" and {png}" if png else "") + f" ({summary['elapsed_s']:.0f} s)")
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``conduit bench schedule``."""
    p = command_parser("conduit bench schedule", __doc__, ScheduleBenchArgs)
    run(parse_quick(p, ScheduleBenchArgs, argv, effective, check=check_args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
