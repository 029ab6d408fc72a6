"""GRPO on the CPU: a tiny random-init causal LM learns the digit task of
:mod:`conduit.workloads.grpo_task` with TRL's ``GRPOTrainer``, its experience path either TRL's
own (``--buffer trl``) or Conduit's (``--buffer conduit``: :class:`ConduitGRPOTrainer`).

``conduit train --algo grpo`` runs it, prints a progress line every ``--log-every`` steps and
the reward curve, and writes the curve (JSON) and a plot; an interrupted run writes the steps so
far. Needs the ``conduit-rl[trl]`` extra; TRL is imported when a run starts.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from conduit.cli_args import arg
from conduit.errors import ConduitError, ConfigError, interrupt_of
from conduit.report import check_output_path, pyplot, save_figure, write_json
from conduit.workloads import grpo_task
from conduit.workloads.args import MAX_SEED

BUFFERS = ("trl", "conduit")


@dataclass(frozen=True)
class Args:
    """Arguments of ``conduit train --algo grpo``."""

    task: str = arg("target", "reward: 'target' (emit the digit 7) or 'copy' (repeat the "
                    "prompt's first digit)", choices=grpo_task.TASKS)
    buffer: str = arg("conduit", "experience path: 'trl' (TRL alone) or 'conduit'",
                      choices=BUFFERS)
    steps: int = arg(60, "optimizer steps", min=1)
    batch_size: int = arg(16, "completions per mini-batch (per_device_train_batch_size)", min=1)
    num_generations: int = arg(8, "completions per prompt (the group size G), at least 2; "
                               "batch-size x steps-per-generation must be a multiple of it",
                               min=2)
    steps_per_generation: int = arg(4, "mini-batches per generation batch", min=1)
    num_iterations: int = arg(1, "passes over each generation batch", min=1)
    prompt_len: int = arg(4, "digits per prompt", min=1)
    max_completion_length: int = arg(16, "longest completion, in tokens", min=1)
    hidden: int = arg(64, "model width", min=1)
    layers: int = arg(2, "decoder layers", min=1)
    lr: float = arg(3e-3, "learning rate", positive=True)
    beta: float = arg(0.0, "KL coefficient (a reference model when > 0)", min=0, finite=True)
    seed: int = arg(0, "random seed", max=MAX_SEED)
    threads: int = arg(0, "torch CPU threads (0: leave as is)")
    log_every: int = arg(10, "print a progress line every this many optimizer steps (0: never)")
    out: str = arg("", "JSON path (default runs/train/grpo_<task>_<buffer>.json)",
                   output="file")
    plot: str = arg("", "PNG path (default next to the JSON)", output="file")


DIVERGED_GENERATION = ("probability tensor contains either", "invalid multinomial distribution")
"""Messages of ``torch.multinomial``'s errors on probabilities that are not a distribution
(non-finite or negative, or summing to 0): what sampling a completion from a diverged
policy's logits raises inside generation."""


@dataclass
class GRPOResult:
    """A finished run: per-step losses, the reward curve (one point per generation batch) and
    the final parameters. ``diverged`` says why a run stopped early because its policy
    diverged (empty when it ran every step)."""

    args: Args
    losses: list[float]
    rewards: list[float]
    wall_s: float
    params: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)
    trainer: Any = field(repr=False, default=None)
    diverged: str = ""

    def nonfinite_step(self) -> int | None:
        """The first step (from 1) whose loss was not finite, or None."""
        return next((i for i, x in enumerate(self.losses, 1) if not math.isfinite(x)), None)

    def divergence(self) -> str | None:
        """Why the run diverged: what stopped it (``diverged``) or, for a run that went on,
        the first step whose loss was not finite; None for a run that did not diverge."""
        if self.diverged:
            return self.diverged
        bad = self.nonfinite_step()
        return None if bad is None else f"the loss was not finite at step {bad}"

    def to_json(self) -> dict[str, Any]:
        """JSON-friendly summary (no tensors); ``"diverged"`` is :meth:`divergence`."""
        return {"args": dataclasses.asdict(self.args), "losses": self.losses,
                "rewards": self.rewards, "wall_s": self.wall_s,
                "reward_first": self.rewards[0] if self.rewards else None,
                "reward_last": self.rewards[-1] if self.rewards else None,
                "diverged": self.divergence()}


def check(args: Args) -> None:
    """The checks of ``args`` that TRL's ``GRPOConfig`` makes, run before any output (``conduit
    train --algo grpo`` reports them as usage errors naming the flag).

    Raises:
        ConfigError: ``num_generations`` is below 2 (a group needs two completions to have a
            spread), or the generation batch (``batch_size x steps_per_generation``
            completions) does not split into whole groups of ``num_generations`` (field
            ``batch_size``), or ``hidden`` does not split into the model's attention heads of
            an even width (field ``hidden``).
    """
    if args.hidden % (2 * grpo_task.HEADS):
        raise ConfigError("hidden", f"must be a multiple of {2 * grpo_task.HEADS} (the model's "
                                    f"{grpo_task.HEADS} attention heads, each of an even width "
                                    f"for the rotary embedding), got {args.hidden}")
    if args.num_generations < 2:
        raise ConfigError("num_generations", f"must be at least 2 (GRPO normalizes rewards "
                                             f"within a group), got {args.num_generations}")
    gen_batch = args.batch_size * args.steps_per_generation
    if gen_batch % args.num_generations:
        raise ConfigError("batch_size", f"the generation batch of --batch-size "
                                        f"{args.batch_size} x --steps-per-generation "
                                        f"{args.steps_per_generation} = {gen_batch} completions "
                                        f"must be a multiple of --num-generations "
                                        f"{args.num_generations}")


def require_trl() -> None:
    """Import TRL, which a run needs (the ``conduit-rl[trl]`` extra).

    Raises:
        ConfigError: TRL, or a library it needs, is not installed (field ``algo``).
    """
    try:
        import trl  # noqa: F401
    except ImportError as exc:
        raise ConfigError("algo", f"grpo needs the optional trl extra, which is not installed "
                                  f"({exc}); pip install 'conduit-rl[trl]'") from exc


def output_paths(args: Args) -> tuple[Path, Path]:
    """The JSON and PNG paths of a run: ``--out`` (default
    ``runs/train/grpo_<task>_<buffer>.json``) and ``--plot`` (default next to the JSON),
    checked before the run.

    Raises:
        ConfigError: A path cannot be written (field ``out`` or ``plot``).
    """
    out = check_output_path(args.out or f"runs/train/grpo_{args.task}_{args.buffer}.json",
                            "out")
    return out, check_output_path(args.plot or out.with_suffix(".png"), "plot")


def build_trainer(args: Args, *, output_dir: str, **trainer_kwargs: Any) -> Any:
    """A ``GRPOTrainer`` (``buffer="trl"``) or ``ConduitGRPOTrainer`` for ``args``, printing
    a progress line every ``args.log_every`` optimizer steps.

    Raises:
        ValueError: Unknown ``buffer`` or ``task``.
        ConfigError: :func:`check` refuses ``args``, or TRL is not installed (see
            :func:`require_trl`).
    """
    if args.buffer not in BUFFERS:
        raise ValueError(f"buffer: must be one of {BUFFERS}, got {args.buffer!r}")
    check(args)
    require_trl()
    from trl import GRPOConfig, GRPOTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = grpo_task.digit_tokenizer()
    model = grpo_task.tiny_llama(vocab_size=len(tok), hidden=args.hidden, layers=args.layers,
                                 max_positions=args.prompt_len + args.max_completion_length + 8,
                                 seed=args.seed)
    gen_batch = args.batch_size * args.steps_per_generation
    rows = gen_batch * args.steps // (args.steps_per_generation * args.num_iterations) + gen_batch
    data = grpo_task.prompt_dataset(n=rows // args.num_generations + 1,
                                    prompt_len=args.prompt_len, seed=args.seed)
    cfg = GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations, steps_per_generation=args.steps_per_generation,
        num_iterations=args.num_iterations, max_completion_length=args.max_completion_length,
        learning_rate=args.lr, beta=args.beta, max_steps=args.steps, logging_steps=1,
        report_to="none", use_cpu=True, seed=args.seed, data_seed=args.seed,
        save_strategy="no", disable_tqdm=True, bf16=False, dataloader_num_workers=0,
        log_level="error", lr_scheduler_type="constant")
    if args.beta:  # TRL builds the reference model from the policy's path
        init = Path(output_dir) / "init"
        model.save_pretrained(init)
        model = str(init)
    cls = GRPOTrainer
    if args.buffer == "conduit":
        from conduit.integrations.trl import ConduitGRPOTrainer
        cls = ConduitGRPOTrainer
    from transformers import PrinterCallback

    trainer = cls(model=model, args=cfg, reward_funcs=grpo_task.reward_fn(args.task),
                  train_dataset=data, processing_class=tok, **trainer_kwargs)
    trainer.remove_callback(PrinterCallback)  # the log dicts stay in trainer.state.log_history
    if args.log_every:
        trainer.add_callback(progress_printer(args))
    return trainer


def progress_printer(args: Args) -> Any:
    """A ``TrainerCallback`` that prints a progress line every ``args.log_every`` optimizer
    steps and after the last: the step, the latest mean reward, the loss and the time."""
    from transformers import TrainerCallback

    t0 = time.perf_counter()

    class ProgressPrinter(TrainerCallback):
        def on_log(self, _args: Any, state: Any, _control: Any,
                   logs: dict[str, float] | None = None, **_kw: Any) -> None:
            step = state.global_step
            if "loss" not in (logs or {}) or (step % args.log_every and step != args.steps):
                return
            reward = next((h["reward"] for h in reversed(state.log_history) if "reward" in h),
                          float("nan"))
            print(f"[grpo {args.buffer}] step {step:>4}/{args.steps} | reward {reward:.3f} | "
                  f"loss {logs['loss']:.3g} | {time.perf_counter() - t0:.1f}s", flush=True)

    return ProgressPrinter()


def train(args: Args, *, trainer_kwargs: dict[str, Any] | None = None, hook: Any = None,
          on_interrupt: Callable[[GRPOResult], None] | None = None) -> GRPOResult:
    """Run GRPO for ``args.steps`` optimizer steps, or until the policy diverges: when
    sampling a completion finds the next-token probabilities are not a distribution (the
    logits overflowed or are NaN), the run stops there and its result says so
    (``diverged``), with the steps so far.

    Args:
        args: The run.
        trainer_kwargs: Extra keyword arguments of the trainer class.
        hook: Called with the trainer before training (e.g. to time its methods).
        on_interrupt: Called with the steps so far when the run is interrupted (Ctrl-C, also
            inside a Conduit operator), before the interrupt propagates.
    """
    with tempfile.TemporaryDirectory(prefix="conduit-grpo-") as tmp:
        trainer = build_trainer(args, output_dir=tmp, **(trainer_kwargs or {}))
        if hook is not None:
            hook(trainer)
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():  # TRL's calls of names transformers deprecated
                warnings.filterwarnings("ignore", message=".*gradient_checkpointing",
                                        category=FutureWarning)
                trainer.train()
        except (KeyboardInterrupt, ConduitError) as exc:
            if on_interrupt is not None and interrupt_of(exc) is not None:
                on_interrupt(_result(args, trainer, time.perf_counter() - t0))
            raise
        except RuntimeError as exc:
            if not any(m in str(exc) for m in DIVERGED_GENERATION):
                raise
            result = _result(args, trainer, time.perf_counter() - t0)
            result.diverged = ("the policy's next-token probabilities were not a "
                               f"distribution when sampling completions (torch: {exc})")
            return result
        wall = time.perf_counter() - t0
    return _result(args, trainer, wall)


def _result(args: Args, trainer: Any, wall_s: float) -> GRPOResult:
    """The losses, rewards and parameters ``trainer`` holds after ``wall_s`` seconds."""
    hist = trainer.state.log_history
    losses = [float(h["loss"]) for h in hist if "loss" in h]
    rewards = [float(h["reward"]) for h in hist if "reward" in h]
    params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return GRPOResult(args, losses, rewards, wall_s, params, trainer)


def plot_rewards(curves: dict[str, list[float]], path: str | Path, *, title: str
                 ) -> Path | None:
    """Reward per generation batch, one line per curve; None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=label, marker="." if len(ys) < 40 else None)
    ax.set_xlabel("generation batch")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def report(result: GRPOResult, args: Args) -> int:
    """Print and save a finished run (``conduit train --algo grpo``) to
    :func:`output_paths`; the exit status."""
    r = result.rewards
    curve = (f"mean reward {r[0]:.3f} -> {r[-1]:.3f} over {len(r)} generation batches" if r
             else "no generation batch scored")
    print(f"GRPO ({args.task}, {args.buffer}): {len(result.losses)} steps in "
          f"{result.wall_s:.1f}s; {curve}")
    if result.diverged:
        print(f"stopped after step {len(result.losses)} of {args.steps}: {result.diverged} "
              f"(the run diverged; lower --lr)")
    out_path, png_path = output_paths(args)
    out = write_json(out_path, result.to_json(), field="out")
    png = plot_rewards({args.buffer: r}, png_path,
                       title=f"GRPO on the digit task '{args.task}'")
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    bad = result.nonfinite_step()
    if bad is not None:
        print(f"the loss was not finite at step {bad} (the run diverged; lower --lr)")
    return 0 if result.divergence() is None else 1


def write_interrupted(result: GRPOResult, args: Args) -> None:
    """Write the steps an interrupted run made (``"interrupted": true``) to the JSON path of
    :func:`output_paths`."""
    out, _ = output_paths(args)
    write_json(out, {**result.to_json(), "interrupted": True}, field="out")
    print(f"wrote {out} (interrupted after {len(result.losses)} steps)", flush=True)
