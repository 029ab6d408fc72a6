"""``conduit train`` and ``conduit demo``.

``conduit train --algo {dqn,sac,ppo,grpo} [--flags of that trainer's Args]`` trains one
workload, prints a progress line with the per-iteration breakdown, and writes a JSON log and a
PNG of the breakdown (GRPO: its reward curve), by default under ``runs/train/``. ``conduit
demo`` runs a heavy-payload workload inline and then through Conduit, and prints the
exposed-path and end-to-end reductions and the plan Conduit chose.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from types import ModuleType
from typing import Literal

from conduit.cli_args import add_dataclass_args, arg, command_parser, parse_command, usage_error
from conduit.errors import ConduitError, ConfigError, interrupt_of
from conduit.report import check_figure_path, check_output_path, finite, write_json
from conduit.scheduling.space import feasible_space
from conduit.workloads import dqn, grpo, ppo, sac
from conduit.workloads.actors import ray_running, require_ray, sigterm_interrupts
from conduit.workloads.args import (
    MAX_SEED,
    MIN_IMAGE_SIZE,
    TrainerArgs,
    check_image_size,
    check_schedule_and_placement,
)
from conduit.workloads.breakdown import (
    BreakdownRecorder,
    RunResult,
    buffer_order,
    reduction,
    summarize_records,
)
from conduit.workloads.figures import plot_breakdown
from conduit.workloads.learner import resolve_device

TRAINERS: dict[str, ModuleType] = {"dqn": dqn, "sac": sac, "ppo": ppo, "grpo": grpo}
ALGOS = tuple(TRAINERS)

_DIVERGENCE_FIX = {"dqn": "lower --learning-rate",
                   "sac": "lower --q-lr and --policy-lr, or --reward-scale",
                   "ppo": "lower --learning-rate, or --vf-coef and --ent-coef"}
"""What the stop line of a diverged run tells the user to change, per algorithm."""

_TRAIN_HELP = """\
Train DQN, SAC or PPO with Ray rollout actors, or GRPO on a tiny causal LM with TRL
([trl] extra); the experience path runs inline (the sequential baseline) or through Conduit.
Prints a per-iteration breakdown (GRPO: the reward curve) and writes a JSON log and a PNG
(--out, --plot; by default under runs/train/).
Flags depend on --algo (see 'conduit train --algo sac --help').
Ctrl-C or SIGTERM stops the run cleanly (Ray shut down; the iterations, for GRPO the optimizer
steps, so far are written to --out, marked "interrupted"): one line, exit status 130 or 143."""

_DEMO_HELP = """\
Run a heavy-payload workload (image observations, a payload-size stand-in) with the inline
experience path and with Conduit (auto placement and schedule), in alternating rounds; print
the reductions and the plan; write a plot.
Ctrl-C or SIGTERM stops the demo cleanly (Ray shut down): one line, exit status 130 or 143."""


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def train_parser(algo: str) -> argparse.ArgumentParser:
    """The ``conduit train`` parser for one algorithm (its ``Args`` become the flags)."""
    p = command_parser("conduit train", _TRAIN_HELP)
    p.add_argument("--algo", choices=ALGOS, default=algo, help="algorithm (default: %(default)s)")
    add_dataclass_args(p, TRAINERS[algo].Args)
    return p


def _print_summary(result: RunResult) -> None:
    s = result.summary
    ms = lambda k: f"{1000 * s[k]:8.2f}"  # noqa: E731
    head = f"\n{result.algo} on {result.env}, buffer={result.buffer}: "
    if result.updates:
        print(f"{head}per-iteration medians over {s['iterations_measured']} learning "
              f"iterations (ms); {result.updates} updates")
    else:
        print(f"{head}0 learning iterations (no update ran); per-iteration medians over "
              f"{s['iterations_measured']} iterations (ms)")
    for k in ("rollout", "ingestion", "delivery", "update", "other", "end_to_end"):
        label = {"ingestion": "exposed ingestion", "delivery": "exposed delivery"}.get(k, k)
        print(f"  {label:<18} {ms(k)}")
    print(f"  {'exposed path':<18} {ms('exposed')}")
    print(f"  plan: {result.plan.get('placement')} | {result.plan.get('schedule')}")
    finite = result.losses_finite if result.updates else "n/a (no update ran)"
    print(f"  final mean return: {s['final_return']:.1f}   losses finite: {finite}")
    if result.diverged:
        print(f"  stopped after iteration {len(result.records)} of {result.config['iters']}: "
              f"{result.diverged} (the run diverged; {_DIVERGENCE_FIX[result.algo]})")


def _check_trainer(mod: ModuleType, args: TrainerArgs) -> None:
    """The trainer's own checks, then ``--schedule`` and ``--placement`` as the run reads them.

    Raises:
        ConfigError: Naming the field of the flag at fault (see the trainer's ``check`` and
            :func:`~conduit.workloads.args.check_schedule_and_placement`).
    """
    mod.check(args)
    try:
        device = resolve_device(args.device)
    except ConfigError:
        return  # train_main reports the device; --placement learner cannot be judged without
    space = (mod.schedule_space(args) if hasattr(mod, "schedule_space")
             else feasible_space(mode="off_policy"))  # the off-policy planes' default caps
    check_schedule_and_placement(args.schedule, args.placement, device, space=space)


def train_main(argv: list[str] | None = None) -> int:
    """Entry point of ``conduit train``; returns the exit status. SIGTERM stops the run as
    Ctrl-C does (:func:`~conduit.workloads.actors.sigterm_interrupts`)."""
    with sigterm_interrupts():
        return _train(argv)


def _write_interrupted(path: Path, algo: str, args: TrainerArgs) -> None:
    """Write what an interrupted run recorded (``"interrupted": true``) to ``--out``."""
    rec = BreakdownRecorder.latest
    if rec is None:  # interrupted before its first iteration
        return
    write_json(path, field="out", data={
        "algo": algo, "env": args.env, "buffer": args.buffer, "interrupted": True,
        "config": finite(dataclasses.asdict(args)), **rec.to_json()})
    print(f"wrote {path} (interrupted after {len(rec.records)} iterations)", flush=True)


def _check_outputs(parser: argparse.ArgumentParser, out: str, plot: str) -> None:
    """``--plot`` names a figure format, and ``--out`` and ``--plot`` two different files: a
    usage error naming ``--plot`` otherwise, before the run."""
    try:
        if plot:
            check_figure_path(plot, "plot")
    except ConfigError as exc:
        usage_error(parser, exc.field, exc.reason)
    if out and plot and Path(out).resolve() == Path(plot).resolve():
        usage_error(parser, "plot", f"{plot!r} is also the --out path (the JSON log); pass "
                                    "two different files")


def _train(argv: list[str] | None) -> int:
    pre = argparse.ArgumentParser(prog="conduit train", add_help=False)
    pre.add_argument("--algo", choices=ALGOS, default="ppo")
    known, _ = pre.parse_known_args(argv)
    parser = train_parser(known.algo)
    mod = TRAINERS[known.algo]
    # Checks that need several flags (or the environment) are usage errors naming the flag,
    # before any output and before Ray starts.
    if known.algo == "grpo":  # a workload that prints and saves its own result
        args = parse_command(parser, grpo.Args, argv, check=grpo.check)
        _check_outputs(parser, args.out, args.plot)
        grpo.require_trl()
        grpo.output_paths(args)  # the default paths too, before the run
        result = grpo.train(args, on_interrupt=lambda r: grpo.write_interrupted(r, args))
        return grpo.report(result, args)
    args = parse_command(parser, mod.Args, argv, check=lambda a: _check_trainer(mod, a))
    _check_outputs(parser, args.out, args.plot)
    # An unknown --device, or Ray missing, fails here (a ConfigError naming the flag).
    resolve_device(args.device)
    if args.use_ray:
        require_ray()
    stem = f"runs/train/{known.algo}_{_safe(args.env)}_{args.buffer}"
    out_path = check_output_path(args.out or f"{stem}.json", "out")
    png_path = check_output_path(args.plot or f"{stem}.png", "plot")
    BreakdownRecorder.latest = None
    try:
        result = mod.train(args)
    except (KeyboardInterrupt, ConduitError) as exc:
        if interrupt_of(exc) is not None:
            _write_interrupted(out_path, known.algo, args)
        raise
    _print_summary(result)
    out = write_json(out_path, result.to_json(), field="out")
    png = plot_breakdown(
        {f"{known.algo} {args.buffer}": result.summary}, png_path,
        title=f"{known.algo.upper()} on {args.env}"
              + (f" + {args.image_size}px image payload" if args.image_size else ""))
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    return 1 if result.diverged or not result.losses_finite else 0


@dataclasses.dataclass(frozen=True)
class DemoArgs:
    """Arguments of ``conduit demo``."""

    algo: Literal["dqn", "ppo", "sac"] = arg("dqn", "workload algorithm: dqn (CartPole-v1) or "
                                             "ppo (CartPole-v1) or sac (Pendulum-v1), each "
                                             "with the image payload")
    image_size: int = arg(128, f"image payload side, 0 (none) or at least {MIN_IMAGE_SIZE} "
                          "(128 ~ 48 KB, 256 ~ 192 KB per observation); a payload-size "
                          "stand-in")
    iters: int = arg(0, "iterations per run (0: sized for about 3 minutes in total); at "
                     "least enough for an update (DQN and SAC learn once 512 transitions are "
                     "stored)")
    rounds: int = arg(2, "runs per mode, alternating the order (inline, Conduit, Conduit, "
                      "inline, ...); the medians pool every run's iterations, so the shared "
                      "machine's drift does not land on one mode", min=1)
    actors: int = arg(2, "Ray rollout actors", min=1)
    seed: int = arg(1, "random seed", max=MAX_SEED)
    device: str = arg("auto", "learner device: auto (CUDA when present), cpu, cuda:0")
    use_ray: bool = arg(True, "Ray actors (otherwise in-process workers)")
    log_every: int = arg(10, "print a progress line every this many iterations of each run "
                         "(0: only the start and end of each run)")
    out: str = arg("runs/demo", "folder for demo.json and demo.png", output="dir")


def _demo_args(d: DemoArgs, buffer: str) -> TrainerArgs:
    gpu = resolve_device(d.device).type == "cuda"
    common = dict(image_size=d.image_size, actors=d.actors, buffer=buffer, seed=d.seed,
                  device=d.device, use_ray=d.use_ray, log_every=d.log_every)
    if d.algo == "dqn":
        iters = d.iters or (150 if gpu else 45)
        return dqn.Args(env="CartPole-v1", iters=iters, envs_per_actor=4, steps_per_rollout=16,
                        buffer_size=20_000 if gpu else 4_000, batch_size=128,
                        updates_per_iter=8, learning_starts=512, **common)
    if d.algo == "sac":
        iters = d.iters or (120 if gpu else 25)
        return sac.Args(env="Pendulum-v1", iters=iters, envs_per_actor=4, steps_per_rollout=16,
                        buffer_size=20_000 if gpu else 4_000, batch_size=128,
                        updates_per_iter=8, learning_starts=512, **common)
    if d.algo == "ppo":
        iters = d.iters or (60 if gpu else 12)
        return ppo.Args(env="CartPole-v1", iters=iters, envs_per_actor=4, steps_per_rollout=16,
                        num_minibatches=4, update_epochs=2, **common)
    raise ConfigError("algo", f"must be dqn, sac or ppo, got {d.algo!r}")


def iterations_to_learn(args: TrainerArgs) -> int:
    """Iterations a run takes up to and including its first update: the first that brings
    the stored transitions to ``--learning-starts`` (DQN, SAC), else the first (PPO)."""
    rows = args.actors * args.envs_per_actor * args.steps_per_rollout
    return max(1, -(-getattr(args, "learning_starts", 0) // rows))


def _check_demo(d: DemoArgs) -> None:
    """The demo's checks that need more than one flag, before Ray starts.

    Raises:
        ConfigError: The image payload is too small (field ``image_size``), or ``--iters`` is
            too few for the workload's first update, so there would be no learner to compare
            (field ``iters``).
    """
    check_image_size(d.image_size)
    if d.iters:
        args = _demo_args(dataclasses.replace(d, device="cpu"), "inline")
        need = iterations_to_learn(args)
        if d.iters < need:
            raise ConfigError("iters", f"{d.iters} is too few for an update: {d.algo.upper()} "
                                       f"learns from transition {args.learning_starts}, in "
                                       f"iteration {need} ({d.actors} actor(s) x "
                                       f"{args.envs_per_actor * args.steps_per_rollout} "
                                       "transitions an iteration); pass --iters "
                                       f"{need} or more, or 0 for the default")


def _change(red: float) -> str:
    return f"{100 * red:.0f}% lower" if red >= 0 else f"{-100 * red:.0f}% higher"


def slower_update(inline: dict[str, float], conduit: dict[str, float]) -> str | None:
    """Why an iteration that hid its experience path still took longer, from the pooled
    breakdowns (seconds): the learner update ran longer beside Conduit's workers by more
    than the exposed path they hid. None when end to end did not grow, or the update did not
    grow by more than what was hidden."""
    hidden = inline["exposed"] - conduit["exposed"]
    longer = conduit["update"] - inline["update"]
    if not conduit["end_to_end"] > inline["end_to_end"] or not longer > hidden > 0:
        return None
    return (f"the learner update took {1000 * longer:.1f} ms longer per iteration with "
            f"Conduit's worker threads beside it, more than the {1000 * hidden:.1f} ms of "
            f"experience path they hid")


def demo_main(argv: list[str] | None = None) -> int:
    """Entry point of ``conduit demo``: a heavy-payload workload, inline against Conduit.
    SIGTERM stops it as Ctrl-C does (:func:`~conduit.workloads.actors.sigterm_interrupts`)."""
    with sigterm_interrupts():
        return _demo(argv)


def _demo(argv: list[str] | None) -> int:
    p = command_parser("conduit demo", _DEMO_HELP, DemoArgs)
    d = parse_command(p, DemoArgs, argv, check=_check_demo)
    if d.rounds < 1:
        p.error(f"--rounds: must be >= 1, got {d.rounds}")
    device = resolve_device(d.device)
    image = (f"a {d.image_size}x{d.image_size}x3 uint8 image per observation (payload-size "
             "stand-in)" if d.image_size else "no image payload")
    actors = f"{d.actors} Ray actors" if d.use_ray else f"{d.actors} in-process workers"
    print(f"conduit demo: {d.algo.upper()} with {image}, {actors}, learner on {device}")
    runs: dict[str, list[RunResult]] = {"inline": [], "conduit": []}
    t_start = time.perf_counter()
    with ray_running(enabled=d.use_ray):
        for r in range(d.rounds):
            for buffer in buffer_order(r):
                args = _demo_args(d, buffer)
                tag = f"[{buffer}, round {r + 1}/{d.rounds}]"
                t0 = time.perf_counter()
                print(f"\n{tag} {args.iters} iterations ...", flush=True)
                res = TRAINERS[d.algo].train(args)
                runs[buffer].append(res)
                kept = (f"; schedule {res.plan.get('schedule')}" if buffer == "conduit"
                        else "")
                print(f"{tag} done in {time.perf_counter() - t0:.0f}s: exposed "
                      f"{1000 * res.summary['exposed']:.1f} ms, end to end "
                      f"{1000 * res.summary['end_to_end']:.1f} ms per iteration{kept}",
                      flush=True)
    results = {b: rs[-1] for b, rs in runs.items()}
    inline, conduit = (summarize_records([res.records for res in runs[b]])
                       for b in ("inline", "conduit"))
    red_exp = reduction(inline["exposed"], conduit["exposed"])
    red_e2e = reduction(inline["end_to_end"], conduit["end_to_end"])
    print(f"\nper-iteration medians over {d.rounds} run(s) per mode (ms)    inline    conduit")
    for k in ("rollout", "ingestion", "delivery", "update", "other", "exposed", "end_to_end"):
        print(f"  {k:<26} {1000 * inline[k]:8.2f}   {1000 * conduit[k]:8.2f}")
    print(f"\nexposed experience-path latency: {_change(red_exp)} with Conduit")
    print(f"end-to-end iteration latency:    {_change(red_e2e)} with Conduit")
    why = slower_update(inline, conduit)
    if why is not None:
        print(f"  {why}")
    plan = results["conduit"].plan
    print(f"\nplan Conduit chose (round {d.rounds}): placement {plan.get('placement')}, "
          f"schedule {plan.get('schedule')}")
    for key in ("placement_plan", "schedule_explain"):
        if isinstance(plan.get(key), str):
            print(plan[key])
    out = Path(d.out)
    label = f"{d.algo.upper()}-img{d.image_size}"
    png = plot_breakdown({f"{label} inline": inline, f"{label} Conduit": conduit},
                         out / "demo.png",
                         title=f"{label}: per-iteration breakdown, inline vs Conduit")
    write_json(out / "demo.json", field="out", data={
        "workload": label, "device": str(device), "exposed_reduction": red_exp,
        "end_to_end_reduction": red_e2e, "wall_s": time.perf_counter() - t_start,
        "rounds": d.rounds, "pooled": {"inline": inline, "conduit": conduit},
        "conduit_schedules": [res.plan.get("schedule") for res in runs["conduit"]],
        "inline": results["inline"].to_json(), "conduit": results["conduit"].to_json()})
    print(f"wrote {out / 'demo.json'}" + (f" and {png}" if png else "")
          + f"  ({time.perf_counter() - t_start:.0f}s)")
    return 0
