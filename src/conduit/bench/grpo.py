"""``conduit bench grpo``: TRL's GRPOTrainer alone against TRL + Conduit (ConduitGRPOTrainer),
side by side on the CPU GRPO workload, at two completion lengths.

Both trainers run the same seed in alternating rounds (TRL, Conduit, Conduit, TRL, ...). For
every optimizer step the benchmark times:

* time per step: the run's wall time over its steps;
* exposed experience path: on a generation step, from the end of generation to the start of
  the update (``compute_loss``); on the other steps, from the start of ``_prepare_inputs`` to
  the start of the update (the time between mini-batches);
* how much of the exposed path falls on the generation steps;
* the reward curve (one point per generation batch), and whether per-step losses, rewards and
  final parameters are identical between the two trainers.

    conduit bench grpo
    conduit bench grpo --lengths 16 64 --steps 48 --rounds 2
    conduit bench grpo --quick

The JSON is rewritten with ``"partial": true`` after every run, so an interrupted comparison
keeps the runs it finished.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from conduit.bench.common import PartialJSON, apply_quick, parse_quick, progress
from conduit.cli_args import arg, command_parser
from conduit.errors import ConfigError
from conduit.report import pyplot, save_figure, table, write_json
from conduit.workloads import grpo, grpo_task

#: The values of ``--pad`` (``ConduitGRPOTrainer``'s ``pad_completions_to``).
PADS = ("minibatch", "iteration")


@dataclass(frozen=True)
class GRPOBenchArgs:
    """Arguments of ``conduit bench grpo``."""

    lengths: tuple[int, ...] = arg((16, 64), "max completion lengths (tokens) to compare", min=1)
    steps: int = arg(48, "optimizer steps per run", min=1)
    rounds: int = arg(2, "runs per trainer and length, alternating which goes first", min=1)
    steps_per_generation: int = arg(4, "mini-batches per generation batch", min=1)
    batch_size: int = arg(16, "completions per mini-batch", min=1)
    task: str = arg("target", "digit task", choices=grpo_task.TASKS)
    seed: int = arg(0, "seed (the same for both trainers)")
    pad: str = arg("minibatch", "Conduit pads completions to each mini-batch's longest "
                   "('minibatch') or, as TRL, to the generation batch's ('iteration': bitwise "
                   "identical losses)", choices=PADS)
    quick: bool = arg(False, "a smoke run: one length of 8, 8 steps, one round (flags given "
                             "explicitly win)")
    out: str = arg("runs/bench/grpo", "folder for grpo.json / grpo.png", output="dir")


#: Completions per prompt in every run (``conduit train --algo grpo``'s default).
GROUP_SIZE = grpo.Args().num_generations

#: What ``--quick`` gives the flags left at their defaults.
QUICK = {"lengths": (8,), "steps": 8, "rounds": 1}


class StepTimer:
    """Times a trainer's experience path per optimizer step by wrapping three of its methods
    on the instance (TRL is not patched)."""

    def __init__(self) -> None:
        self.exposed: list[float] = []
        self.on_generation_step: list[bool] = []  # per entry of ``exposed``
        self.generation: list[float] = []
        self._gen_end: float | None = None
        self._prep_start = 0.0

    def attach(self, trainer: Any) -> None:
        """Wrap ``_generate``, ``_prepare_inputs`` and ``compute_loss`` of ``trainer``."""
        gen, prep, loss = trainer._generate, trainer._prepare_inputs, trainer.compute_loss

        def timed_generate(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = gen(*a, **k)
            self._gen_end = time.perf_counter()
            self.generation.append(self._gen_end - t0)
            return out

        def timed_prepare(*a: Any, **k: Any) -> Any:
            self._prep_start, self._gen_end = time.perf_counter(), None
            return prep(*a, **k)

        def timed_loss(*a: Any, **k: Any) -> Any:
            if trainer.model.training:
                since = self._gen_end if self._gen_end is not None else self._prep_start
                self.exposed.append(time.perf_counter() - since)
                self.on_generation_step.append(self._gen_end is not None)
            return loss(*a, **k)

        trainer._generate, trainer._prepare_inputs = timed_generate, timed_prepare
        trainer.compute_loss = timed_loss


def one_run(args: grpo.Args, *, pad: str = "minibatch") -> dict[str, Any]:
    """One training run with its per-step timings."""
    timer = StepTimer()
    kwargs = {"pad_completions_to": pad} if args.buffer == "conduit" else {}
    res = grpo.train(args, trainer_kwargs=kwargs, hook=timer.attach)
    res.trainer = None
    return {"buffer": args.buffer, "max_completion_length": args.max_completion_length,
            "wall_s": res.wall_s, "step_s": res.wall_s / args.steps,
            "exposed_s": sum(timer.exposed), "exposed_per_step_s": sum(timer.exposed) / args.steps,
            "exposed_generation_steps_s": sum(
                t for t, g in zip(timer.exposed, timer.on_generation_step) if g),
            "generation_s": sum(timer.generation), "losses": res.losses,
            "rewards": res.rewards, "params": res.params}


def check(a: GRPOBenchArgs) -> None:
    """Refuse arguments the flags' own checks let through (for callers of :func:`run`).

    Raises:
        ConfigError: An unknown task or padding, or a generation batch (``batch_size x
            steps_per_generation`` completions) that does not split into whole groups of
            :data:`GROUP_SIZE` completions (field ``batch_size``), as TRL's ``GRPOConfig``
            requires.
    """
    if a.task not in grpo_task.TASKS:
        raise ConfigError("task", f"must be one of {', '.join(grpo_task.TASKS)}, got {a.task!r}")
    if a.pad not in PADS:
        raise ConfigError("pad", f"must be one of {', '.join(PADS)}, got {a.pad!r}")
    gen_batch = a.batch_size * a.steps_per_generation
    if gen_batch % GROUP_SIZE:
        raise ConfigError("batch_size", f"the generation batch of --batch-size {a.batch_size} x "
                                        f"--steps-per-generation {a.steps_per_generation} = "
                                        f"{gen_batch} completions must be a multiple of the "
                                        f"group size {GROUP_SIZE}")


def effective(args: GRPOBenchArgs, given: Collection[str] | None = None) -> GRPOBenchArgs:
    """The arguments after ``--quick``: :data:`QUICK` for the flags not given (see
    :func:`~conduit.bench.common.apply_quick`)."""
    return apply_quick(args, QUICK, given)


def summarize(runs: list[dict[str, Any]], length: int) -> tuple[dict[str, Any], list[Any]]:
    """The comparison at one completion length: medians over its rounds, and whether the
    first TRL and the first Conduit run have identical losses, rewards and parameters.

    Args:
        runs: The runs so far, each from :func:`one_run` with its ``"round"``.
        length: The completion length to summarize (every round of both trainers finished).

    Returns:
        The length's entry of the JSON summary and its row of the printed table.
    """
    by = {b: [x for x in runs if x["max_completion_length"] == length and x["buffer"] == b]
          for b in ("trl", "conduit")}
    med = {b: {k: statistics.median(x[k] for x in rs) for k in (
        "step_s", "exposed_per_step_s", "exposed_generation_steps_s", "exposed_s")}
           for b, rs in by.items()}
    ref, got = by["trl"][0], by["conduit"][0]
    same_losses = ref["losses"] == got["losses"]
    same_rewards = ref["rewards"] == got["rewards"]
    same_params = all(torch.equal(ref["params"][k], got["params"][k]) for k in ref["params"])
    loss_diff = max((abs(x - y) for x, y in zip(ref["losses"], got["losses"])), default=0.0)
    param_diff = max(float((ref["params"][k] - got["params"][k]).abs().max())
                     for k in ref["params"])
    red = 1 - med["conduit"]["exposed_per_step_s"] / med["trl"]["exposed_per_step_s"]
    step_red = 1 - med["conduit"]["step_s"] / med["trl"]["step_s"]
    summary = {"max_completion_length": length, "median": med,
               "exposed_reduction": red, "step_time_reduction": step_red,
               "identical_losses": same_losses, "identical_rewards": same_rewards,
               "identical_params": same_params, "max_loss_diff": loss_diff,
               "max_param_diff": param_diff, "rewards": {
                   "trl": ref["rewards"], "conduit": got["rewards"]}}
    row = [length, f"{1000 * med['trl']['step_s']:.1f}",
           f"{1000 * med['conduit']['step_s']:.1f}", f"{100 * step_red:+.0f}%",
           f"{1000 * med['trl']['exposed_per_step_s']:.2f}",
           f"{1000 * med['conduit']['exposed_per_step_s']:.2f}",
           f"{100 * red:.0f}%", "yes" if same_rewards else "NO",
           "yes" if same_losses else f"max diff {loss_diff:.1e}",
           "yes" if same_params else f"max diff {param_diff:.1e}"]
    return summary, row


def run(a: GRPOBenchArgs) -> dict[str, Any]:
    """Every (length, round, trainer), then the table, JSON and PNG; returns the payload.

    Args:
        a: The arguments to run with, ``--quick`` already applied (:func:`effective`).

    Raises:
        ConfigError: An argument :func:`check` refuses (before any model is built).
    """
    check(a)
    runs: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    # two mini-batches per generation where they hold whole groups
    warm_spg = 2 if a.batch_size * 2 % GROUP_SIZE == 0 else a.steps_per_generation
    for buffer in ("trl", "conduit"):  # first-run costs (imports, allocator, threads) untimed
        grpo.train(grpo.Args(task=a.task, buffer=buffer, steps=2, seed=a.seed,
                             batch_size=a.batch_size, max_completion_length=min(a.lengths),
                             steps_per_generation=warm_spg, log_every=0))
    progress("warm-up done")
    out = Path(a.out)
    rows: list[list[Any]] = []
    summary: list[dict[str, Any]] = []

    def payload() -> dict[str, Any]:
        """The JSON payload of the runs so far (their parameters left out)."""
        return {"args": asdict(a), "summary": summary,
                "runs": [{k: v for k, v in x.items() if k != "params"} for x in runs],
                "wall_s": time.perf_counter() - t_start}

    with PartialJSON(out / "grpo.json") as partial:
        for length in a.lengths:
            for r in range(a.rounds):
                for buffer in (("trl", "conduit") if r % 2 == 0 else ("conduit", "trl")):
                    args = grpo.Args(task=a.task, buffer=buffer, steps=a.steps, seed=a.seed,
                                     batch_size=a.batch_size, max_completion_length=length,
                                     steps_per_generation=a.steps_per_generation, log_every=0)
                    res = one_run(args, pad=a.pad)
                    runs.append({**res, "round": r})
                    progress(f"length {length} round {r + 1}/{a.rounds} {buffer:<8} "
                             f"{1000 * res['step_s']:7.1f} ms/step, exposed "
                             f"{1000 * res['exposed_per_step_s']:6.2f} ms/step")
                    partial.write(payload())
            sm, row = summarize(runs, length)
            summary.append(sm)
            rows.append(row)
            partial.write(payload())
    print(f"\nGRPO on the CPU digit task, {a.steps} steps, batch {a.batch_size} x "
          f"{a.steps_per_generation} mini-batches per generation, Conduit padding to the "
          f"{a.pad}; medians over {a.rounds} round(s)")
    print(table(["max len", "TRL ms/step", "Conduit ms/step", "step time lower",
                 "TRL exposed ms/step", "Conduit exposed ms/step", "exposed lower",
                 "same rewards", "same losses", "same params"], rows))
    for sm in summary:
        share = {b: m["exposed_generation_steps_s"] / m["exposed_s"] if m["exposed_s"] else 0.0
                 for b, m in sm["median"].items()}
        print(f"length {sm['max_completion_length']}: share of the exposed path on generation "
              f"steps: TRL {100 * share['trl']:.0f} %, Conduit {100 * share['conduit']:.0f} %")
    result = payload()
    write_json(out / "grpo.json", result, with_machine=True)
    png = plot(summary, out / "grpo.png")
    print(f"wrote {out / 'grpo.json'}" + (f" and {png}" if png else ""))
    return result


def plot(summary: list[dict[str, Any]], path: Path) -> Path | None:
    """Exposed experience path per step (left) and the reward curves (right), per length."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.6))
    labels = [str(s["max_completion_length"]) for s in summary]
    xs = range(len(summary))
    for off, b, color in ((-0.2, "trl", "tab:gray"), (0.2, "conduit", "tab:blue")):
        ax0.bar([x + off for x in xs], [1000 * s["median"][b]["exposed_per_step_s"]
                                        for s in summary], width=0.4, color=color,
                label="TRL" if b == "trl" else "TRL + Conduit")
    ax0.set_xticks(list(xs), labels)
    ax0.set_xlabel("max completion length (tokens)")
    ax0.set_ylabel("exposed experience path (ms / step)")
    ax0.legend(fontsize=8)
    for s in summary:
        for b, ls in (("trl", "-"), ("conduit", "--")):
            ys = s["rewards"][b]
            name = "TRL" if b == "trl" else "Conduit"
            ax1.plot(range(1, len(ys) + 1), ys, ls=ls,
                     label=f"{name}, len {s['max_completion_length']}")
    ax1.set_xlabel("generation batch")
    ax1.set_ylabel("mean reward")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``conduit bench grpo``."""
    p = command_parser("conduit bench grpo", __doc__, GRPOBenchArgs)
    run(parse_quick(p, GRPOBenchArgs, argv, effective, check=check))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
