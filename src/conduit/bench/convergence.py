"""``conduit bench convergence``: learning curves inline against Conduit (the paper's Fig. 17).

For each algorithm and seed, the same trainer runs with ``--buffer inline`` and
``--buffer conduit``. The benchmark records the mean return of the last 20 finished episodes
after every iteration, against the iteration and against wall-clock time, and reports when each
run first reaches the target return (PPO on CartPole-v1: 475; DQN on CartPole-v1: 195).
Same iterations to target means the algorithm is unchanged; less wall time means Conduit's
shorter iterations pay off. The JSON is rewritten with ``"partial": true`` after every seed
of an algorithm (both modes), so an interrupted run keeps the seeds it finished.

    conduit bench convergence --out runs/bench/convergence
    conduit bench convergence --algos ppo --seeds 1 2 3
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from conduit.bench.common import PartialJSON, progress
from conduit.cli_args import arg, command_parser, parse_command
from conduit.errors import ConfigError
from conduit.report import pyplot, save_figure, table, write_json
from conduit.workloads import dqn, ppo
from conduit.workloads.actors import ray_running
from conduit.workloads.args import TrainerArgs
from conduit.workloads.breakdown import RunResult, buffer_order
from conduit.workloads.figures import MODE_COLORS
from conduit.workloads.learner import resolve_device

TARGETS = {"ppo": 475.0, "dqn": 195.0}


@dataclass(frozen=True)
class ConvergenceArgs:
    """Arguments of ``conduit bench convergence``."""

    algos: tuple[str, ...] = arg(("ppo", "dqn"), "algorithms to run on CartPole-v1",
                                 choices=tuple(TARGETS))
    seeds: tuple[int, ...] = arg((1, 2, 3), "seeds; each runs inline and with Conduit", min=1)
    ppo_iters: int = arg(120, "PPO iterations per run (1,024 env steps each)", min=1)
    dqn_iters: int = arg(250, "DQN iterations per run (128 env steps each)", min=1)
    window: int = arg(20, "episodes in the moving mean of the return", min=1)
    actors: int = arg(2, "Ray rollout actors", min=1)
    device: str = arg("auto", "learner device: auto (CUDA when present), cpu, cuda:0")
    use_ray: bool = arg(True, "Ray actors (otherwise in-process workers)")
    out: str = arg("runs/bench/convergence", "folder for convergence.json / convergence.png",
                   output="dir")


def curve(result: RunResult, window: int) -> list[dict[str, float]]:
    """Per iteration: the moving mean return of the last ``window`` finished episodes.

    Wall time counts from the end of the first iteration, so the actors' start-up (process
    launch, imports) is not charged to either mode.
    """
    t0 = result.records[0].wall_time if result.records else 0.0
    by_iter: dict[int, list[float]] = {}
    for it, _, r in result.returns:
        by_iter.setdefault(it, []).append(r)
    recent: list[float] = []
    out = []
    for rec in result.records:
        recent = (recent + by_iter.get(rec.iteration, []))[-window:]
        out.append({"iteration": rec.iteration + 1, "wall_s": rec.wall_time - t0,
                    "return": sum(recent) / len(recent) if recent else float("nan")})
    return out


def first_reach(points: list[dict[str, float]], target: float) -> dict[str, float] | None:
    """The first point whose moving mean reaches ``target``."""
    for p in points:
        if not math.isnan(p["return"]) and p["return"] >= target:
            return p
    return None


def check(a: ConvergenceArgs) -> None:
    """Refuse arguments the flags' own checks let through.

    Raises:
        ConfigError: An unknown algorithm or learner device.
    """
    bad = [x for x in a.algos if x not in TARGETS]
    if bad:
        raise ConfigError("algos", f"{bad} not supported; choose from {sorted(TARGETS)}")
    resolve_device(a.device)


def run(a: ConvergenceArgs) -> dict[str, Any]:
    """Run every (algo, seed, mode) and write JSON + PNG; returns the JSON payload.

    Raises:
        ConfigError: An argument :func:`check` refuses.
    """
    check(a)
    runs: list[dict[str, Any]] = []
    out = Path(a.out)
    with PartialJSON(out / "convergence.json") as partial, ray_running(enabled=a.use_ray):
        for algo in a.algos:
            for k, seed in enumerate(a.seeds):
                # Alternate which mode runs first, so drift of the shared machine does not
                # land on one mode only.
                for buffer in buffer_order(k):
                    args: TrainerArgs
                    if algo == "ppo":
                        args = ppo.Args(iters=a.ppo_iters, steps_per_rollout=32,
                                        envs_per_actor=4)
                        train = ppo.train
                    else:
                        args = dqn.Args(iters=a.dqn_iters)
                        train = dqn.train
                    args = replace(args, env="CartPole-v1", buffer=buffer, seed=seed,
                                   actors=a.actors, device=a.device, use_ray=a.use_ray,
                                   log_every=0)
                    t0 = time.perf_counter()
                    res = train(args)
                    pts = curve(res, a.window)
                    hit = first_reach(pts, TARGETS[algo])
                    runs.append({"algo": algo, "seed": seed, "buffer": buffer, "curve": pts,
                                 "reached": hit, "final_return": pts[-1]["return"],
                                 "median_iteration_s": res.summary["end_to_end"],
                                 "losses_finite": res.losses_finite,
                                 "diverged": res.diverged or None, "plan": res.plan})
                    where = (f"reached {TARGETS[algo]:.0f} at iteration {hit['iteration']} "
                             f"({hit['wall_s']:.0f}s)" if hit else "did not reach the target")
                    progress(f"{algo} seed {seed} {buffer:<8} "
                             f"{time.perf_counter() - t0:5.0f}s  final {pts[-1]['return']:6.1f}  "
                             f"{where}")
                partial.write({"args": asdict(a), "targets": TARGETS, "runs": runs})
    rows = []
    for algo in a.algos:
        for buffer in ("inline", "conduit"):
            rs = [r for r in runs if r["algo"] == algo and r["buffer"] == buffer]
            hits = [r["reached"] for r in rs if r["reached"]]
            rows.append([algo, buffer, f"{len(hits)}/{len(rs)}",
                         _med([h["iteration"] for h in hits]), _med([h["wall_s"] for h in hits]),
                         _med([r["final_return"] for r in rs]),
                         _med([1000 * r["median_iteration_s"] for r in rs])])
    print(f"\nCartPole-v1, targets {TARGETS}; medians over seeds that reached the target")
    print(table(["algo", "buffer", "reached", "iters to target", "wall s to target",
                 "final return", "ms / iteration"], rows))
    payload = {"args": asdict(a), "targets": TARGETS, "runs": runs}
    write_json(out / "convergence.json", payload, with_machine=True)
    png = plot(runs, a.algos, out / "convergence.png")
    print(f"wrote {out / 'convergence.json'}" + (f" and {png}" if png else ""))
    return payload


def _med(xs: list[float]) -> float | str:
    return statistics.median(xs) if xs else "-"


def plot(runs: list[dict[str, Any]], algos: tuple[str, ...], path: Path) -> Path | None:
    """Return against iteration (left) and wall-clock time (right), one row per algorithm.

    Returns:
        The PNG written, or None without matplotlib.
    """
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(len(algos), 2, figsize=(10, 3.2 * len(algos)), squeeze=False)
    for row, algo in enumerate(algos):
        for r in (x for x in runs if x["algo"] == algo):
            label = ("inline (sequential)" if r["buffer"] == "inline" else "Conduit")
            first = r["seed"] == min(x["seed"] for x in runs if x["algo"] == algo)
            for col, key in ((0, "iteration"), (1, "wall_s")):
                axes[row][col].plot([p[key] for p in r["curve"]],
                                    [p["return"] for p in r["curve"]],
                                    color=MODE_COLORS[r["buffer"]], alpha=0.8, lw=1.2,
                                    label=label if first else None)
        for col, xlabel in ((0, "training iteration"), (1, "wall-clock time (s)")):
            ax = axes[row][col]
            ax.axhline(TARGETS[algo], ls="--", color="k", lw=0.8)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("episode return (moving mean)")
            ax.set_title(f"{algo.upper()} on CartPole-v1", fontsize=10)
            ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``conduit bench convergence``."""
    p = command_parser("conduit bench convergence", __doc__, ConvergenceArgs)
    run(parse_command(p, ConvergenceArgs, argv, check=check))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
