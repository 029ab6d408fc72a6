"""``conduit bench workloads``: per-iteration breakdown of every reference workload, inline
against Conduit, in the same run (the paper's Fig. 11).

For each workload the same trainer runs twice with the same seed and budget: ``--buffer inline``
(every operator on the caller's thread, pageable CPU memory) and ``--buffer conduit`` (auto
placement and schedule). The table reports per-iteration medians of the actor rollout, the
exposed experience path (ingestion + delivery, the time the caller spent inside push/pull), the
learner update and the end-to-end iteration, and the reductions. With ``--rounds`` > 1 the
medians pool every round, and the end-to-end reduction is also given per round (each Conduit
run against the inline run of its round), whose spread shows how much the machine's drift
moves it. The image workloads are payload-size stand-ins (128×128×3 ≈ 48 KB like Meta-World,
256×256×3 ≈ 192 KB like Open X-Embodiment), not the real tasks.

    conduit bench workloads --rounds 3 --out runs/bench/workloads
    conduit bench workloads --only DQN-CP PPO-img128 --iters 10
    conduit bench workloads --quick

The JSON is rewritten with ``"partial": true`` after every workload, so an interrupted sweep
keeps the workloads it finished.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from conduit._checks import check_int
from conduit.bench.common import PartialJSON, apply_quick, parse_quick, progress
from conduit.cli_args import arg, command_parser
from conduit.errors import ConfigError
from conduit.report import table, write_json
from conduit.workloads.actors import ray_running
from conduit.workloads.breakdown import (
    IterationRecord,
    buffer_order,
    reduction,
    summarize_records,
)
from conduit.workloads.cli import TRAINERS
from conduit.workloads.figures import plot_comparison
from conduit.workloads.learner import resolve_device


@dataclass(frozen=True)
class Workload:
    """One row of the table: a trainer and its arguments (without the buffer mode)."""

    name: str
    algo: str
    heavy: bool
    kwargs: dict[str, Any]


def workloads(*, gpu: bool) -> list[Workload]:
    """The sweep of the issue: DQN on MountainCar, CartPole and multi-agent CartPole; SAC on
    Pendulum (and Meta-World reach-v3 when installed); PPO on CartPole; each algorithm with
    the 48 KB and 192 KB image payloads."""
    off = dict(envs_per_actor=4, steps_per_rollout=16, updates_per_iter=8, batch_size=128,
               learning_starts=512)
    buf = 50_000 if gpu else 20_000
    img_buf = {128: 20_000 if gpu else 3_000, 256: 10_000 if gpu else 1_500}
    # PPO at the trainer's defaults (M = 4, 10 epochs, the RL Zoo CartPole setting), and the
    # heavy rows again with 2 epochs: fewer epochs leave less delivery to hide, so the
    # exposed-path reduction is lower there.
    ppo = dict(envs_per_actor=4, num_minibatches=4, update_epochs=10)
    out = [
        Workload("DQN-MC", "dqn", False, dict(env="MountainCar-v0", buffer_size=buf, **off)),
        Workload("DQN-CP", "dqn", False, dict(env="CartPole-v1", buffer_size=buf, **off)),
        Workload("DQN-MACP", "dqn", False, dict(env="MultiAgentCartPole", num_agents=4,
                                                buffer_size=buf, **off)),
        Workload("DQN-img128", "dqn", True, dict(env="CartPole-v1", image_size=128,
                                                 buffer_size=img_buf[128], **off)),
        Workload("DQN-img256", "dqn", True, dict(env="CartPole-v1", image_size=256,
                                                 buffer_size=img_buf[256], **off)),
        Workload("SAC-Pendulum", "sac", False, dict(env="Pendulum-v1", buffer_size=buf, **off)),
        Workload("SAC-img128", "sac", True, dict(env="Pendulum-v1", image_size=128,
                                                 buffer_size=img_buf[128], **off)),
        Workload("SAC-img256", "sac", True, dict(env="Pendulum-v1", image_size=256,
                                                 buffer_size=img_buf[256], **off)),
        Workload("PPO-CP", "ppo", False, dict(env="CartPole-v1", steps_per_rollout=32, **ppo)),
        Workload("PPO-img128", "ppo", True, dict(env="CartPole-v1", image_size=128,
                                                 steps_per_rollout=16, **ppo)),
        Workload("PPO-img256", "ppo", True, dict(env="CartPole-v1", image_size=256,
                                                 steps_per_rollout=8, **ppo)),
        Workload("PPO-img128-2ep", "ppo", True, dict(env="CartPole-v1", image_size=128,
                                                     steps_per_rollout=16,
                                                     **{**ppo, "update_epochs": 2})),
        Workload("PPO-img256-2ep", "ppo", True, dict(env="CartPole-v1", image_size=256,
                                                     steps_per_rollout=8,
                                                     **{**ppo, "update_epochs": 2})),
    ]
    try:
        import metaworld  # noqa: F401

        out.insert(8, Workload("SAC-MW-reach", "sac", False,
                               dict(env="metaworld/reach-v3", buffer_size=buf, **off)))
    except ImportError:
        pass
    return out


@dataclass(frozen=True)
class WorkloadBenchArgs:
    """Arguments of ``conduit bench workloads``."""

    only: tuple[str, ...] = arg((), "run only these workloads (names as in the table)")
    iters: int = arg(0, "iterations per run (0: per-algorithm defaults)")
    actors: int = arg(2, "Ray rollout actors", min=1)
    seed: int = arg(1, "random seed (the same for both modes)")
    device: str = arg("auto", "learner device: auto (CUDA when present), cpu, cuda:0")
    use_ray: bool = arg(True, "Ray actors (otherwise in-process workers)")
    rounds: int = arg(1, "runs per mode and workload, alternating the order (inline first, "
                         "then Conduit first, ...); medians pool every run's iterations", min=1)
    out: str = arg("runs/bench/workloads", "folder for workloads.json and workloads.png",
                   output="dir")
    quick: bool = arg(False, "one light workload (DQN-CP), one actor, few iterations: a smoke "
                             "run (flags given explicitly win)")


#: What ``--quick`` gives the flags not given.
QUICK = {"only": ("DQN-CP",), "iters": 12, "actors": 1}


def effective(a: WorkloadBenchArgs, given: Collection[str] | None = None) -> WorkloadBenchArgs:
    """The arguments after ``--quick``: :data:`QUICK` for the flags not given (see
    :func:`~conduit.bench.common.apply_quick`)."""
    return apply_quick(a, QUICK, given)


def _iters(algo: str, requested: int, gpu: bool) -> int:
    if requested:
        return requested
    # PPO: 3 warm-up + 8 trial iterations of the schedule tuner, then the chosen schedule.
    return {"dqn": 40, "sac": 40, "ppo": 20}[algo] * (3 if gpu else 1)


def round_reductions(inline: Sequence[Sequence[IterationRecord]],
                     conduit: Sequence[Sequence[IterationRecord]], *,
                     key: str = "end_to_end") -> list[float]:
    """Per round, Conduit's reduction of the median ``key`` against the inline run of the
    same round (``1 - conduit/inline``): the spread of these paired figures shows how much
    of a pooled reduction the machine's drift could account for.

    Args:
        inline: Each round's inline run, as its iteration records.
        conduit: Each round's Conduit run, in the same order.
        key: A field of :func:`~conduit.workloads.breakdown.summarize_records`.

    Raises:
        ValueError: The two sequences differ in length.
    """
    if len(inline) != len(conduit):
        raise ValueError(f"rounds: {len(inline)} inline runs but {len(conduit)} Conduit runs")
    return [reduction(summarize_records([i])[key], summarize_records([c])[key])
            for i, c in zip(inline, conduit)]


def _spread(values: Sequence[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{100 * lo:.0f}..{100 * hi:.0f}%"


def check(a: WorkloadBenchArgs) -> None:
    """Refuse arguments the flags' own bounds let through.

    Raises:
        ConfigError: An unknown workload (``SAC-MW-reach`` is one without Meta-World) or
            learner device.
    """
    resolve_device(a.device)
    known = [w.name for w in workloads(gpu=False)]  # (the names do not depend on it)
    unknown = [name for name in a.only if name not in known]
    if unknown:
        raise ConfigError("only", f"unknown workloads {unknown}; choose from {known}")
    check_int("rounds", a.rounds, minimum=1)


def run(a: WorkloadBenchArgs) -> dict[str, Any]:
    """Run the sweep and write JSON + PNG; returns the JSON payload.

    Args:
        a: The arguments to run with, ``--quick`` already applied (:func:`effective`).

    Raises:
        ConfigError: An argument :func:`check` refuses.
    """
    check(a)
    gpu = resolve_device(a.device).type == "cuda"
    chosen = [w for w in workloads(gpu=gpu) if not a.only or w.name in a.only]
    rows: dict[str, dict[str, Any]] = {}
    out = Path(a.out)
    with PartialJSON(out / "workloads.json") as partial, ray_running(enabled=a.use_ray):
        for w in chosen:
            mod = TRAINERS[w.algo]
            base = mod.Args(**w.kwargs, actors=a.actors, seed=a.seed, device=a.device,
                            use_ray=a.use_ray, log_every=0,
                            iters=_iters(w.algo, a.iters, gpu))
            rows[w.name] = {"heavy": w.heavy, "algo": w.algo}
            records: dict[str, list[list[IterationRecord]]] = {"inline": [], "conduit": []}
            for r in range(a.rounds):
                for buffer in buffer_order(r):
                    t0 = time.perf_counter()
                    res = mod.train(replace(base, buffer=buffer))
                    records[buffer].append(res.records)
                    rows[w.name][f"{buffer}_plan"] = res.plan
                    # Each run's own choice: the tuner decides afresh in every Conduit run.
                    rows[w.name].setdefault("runs", []).append(
                        {"buffer": buffer, "schedule": res.plan.get("schedule", ""),
                         "summary": res.summary,
                         "schedule_trial_ms": res.plan.get("schedule_trial_ms"),
                         "copy_ms_per_unit": res.plan.get("copy_ms_per_unit"),
                         "schedule_explain": res.plan.get("schedule_explain")})
                    rows[w.name][f"{buffer}_losses_finite"] = (
                        rows[w.name].get(f"{buffer}_losses_finite", True)
                        and res.losses_finite)
                    if res.diverged:
                        rows[w.name][f"{buffer}_diverged"] = res.diverged
                    progress(f"{w.name:<13} {buffer:<8} {time.perf_counter() - t0:5.0f}s  "
                             f"exposed {1000 * res.summary['exposed']:7.2f} ms  e2e "
                             f"{1000 * res.summary['end_to_end']:8.2f} ms"
                             + (f"  {res.plan.get('schedule', '')}" if buffer == "conduit"
                                else ""))
            r = rows[w.name]
            for buffer, runs in records.items():
                r[buffer] = summarize_records(runs)
            r["end_to_end_reduction_per_round"] = round_reductions(
                records["inline"], records["conduit"])
            r["exposed_reduction"] = reduction(r["inline"]["exposed"], r["conduit"]["exposed"])
            r["end_to_end_reduction"] = reduction(r["inline"]["end_to_end"],
                                                  r["conduit"]["end_to_end"])
            partial.write({"args": asdict(a), "workloads": rows})
    table_rows = []
    for name, r in rows.items():
        i, c = r["inline"], r["conduit"]
        table_rows.append([
            name, f"{1000 * i['rollout']:.1f}/{1000 * c['rollout']:.1f}",
            f"{1000 * i['ingestion']:.2f}/{1000 * c['ingestion']:.2f}",
            f"{1000 * i['delivery']:.2f}/{1000 * c['delivery']:.2f}",
            f"{1000 * i['update']:.1f}/{1000 * c['update']:.1f}",
            f"{1000 * i['end_to_end']:.1f}/{1000 * c['end_to_end']:.1f}",
            f"{100 * reduction(i['exposed'], c['exposed']):.0f}%",
            f"{100 * reduction(i['end_to_end'], c['end_to_end']):.0f}%",
            _spread(r["end_to_end_reduction_per_round"]),
            r["conduit_plan"].get("schedule", "")])
    print("\nper-iteration medians, inline/conduit (ms); reductions are Conduit vs inline "
          "(pooled over rounds; 'per round': lowest..highest of each round's paired runs)")
    print(table(["workload", "rollout", "exp. ingestion", "exp. delivery", "update",
                 "end to end", "exposed -", "e2e -", "e2e - per round", "conduit schedule"],
                table_rows))
    payload = {"args": asdict(a), "workloads": rows}
    write_json(out / "workloads.json", payload, with_machine=True)
    png = plot_comparison({n: {"inline": r["inline"], "conduit": r["conduit"]}
                           for n, r in rows.items()}, out / "workloads.png")
    print(f"wrote {out / 'workloads.json'}" + (f" and {png}" if png else ""))
    return payload


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``conduit bench workloads``."""
    p = command_parser("conduit bench workloads", __doc__, WorkloadBenchArgs)
    run(parse_quick(p, WorkloadBenchArgs, argv, effective, check=check))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
