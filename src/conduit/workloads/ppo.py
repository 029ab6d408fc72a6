"""PPO on Ray actors, with the on-policy experience path behind Conduit's plane.

GAE is computed in **ingestion** (per actor rollout, as it arrives); **delivery** hands the
learner M shuffled mini-batches per epoch and normalizes advantages per mini-batch. The plane
guarantees that every update consumes only the current iteration's samples, each exactly once
per epoch, and that the batches are the same whatever the schedule.

    conduit train --algo ppo --env CartPole-v1 --actors 2 --buffer conduit --iters 150
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numba
import numpy as np
import torch
from torch import nn

from conduit import ExperienceSpec
from conduit.cli_args import arg
from conduit.errors import ConfigError
from conduit.scheduling.space import MAX_MINIBATCHES, ScheduleSpace, feasible_space
from conduit.storage import FifoSampler
from conduit.workloads.actor_port import rollout_and_push
from conduit.workloads.actors import cpu_weights, rollout_actors
from conduit.workloads.args import (
    TrainerArgs,
    check_learning_rate,
    check_trainer_args,
    probe_env,
)
from conduit.workloads.breakdown import BreakdownRecorder, RunResult
from conduit.workloads.envs import MULTI_AGENT_CARTPOLE, EnvInfo, env_info
from conduit.workloads.learner import LOSS_NOT_FINITE, policy_not_finite, setup_learner
from conduit.workloads.nets import PPOAgent
from conduit.workloads.planes import make_plane


@dataclass(frozen=True)
class Args(TrainerArgs):
    """PPO arguments; each becomes a ``--flag`` of ``conduit train --algo ppo``.

    The defaults are tuned for CartPole-v1 (the RL Baselines3 Zoo values: gamma 0.98, lambda
    0.8, 20 -> 10 epochs, lr 1e-3 annealed, no entropy bonus).
    """

    env: str = arg("CartPole-v1", "single-agent environment id (CartPole-v1; continuous "
                   "ids such as Pendulum-v1 also work)")
    steps_per_rollout: int = arg(32, "lock-steps per rollout fragment (one rollout unit; GAE "
                                 "bootstraps at its end, as with RLlib's rollout fragments)", min=1)
    iters: int = arg(150, "training iterations (one policy version each)", min=1)
    rollout_fragments: int = arg(4, "fragments each actor produces per iteration; the plane "
                                 "ingests one while the actors step the next", min=1)
    learning_rate: float = arg(1e-3, "Adam learning rate (annealed linearly to 0)",
                               positive=True)
    anneal_lr: bool = arg(True, "anneal the learning rate over the run")
    gamma: float = arg(0.98, "discount factor", min=0, max=1)
    gae_lambda: float = arg(0.8, "GAE lambda", min=0, max=1)
    num_minibatches: int = arg(4, "M: mini-batches per epoch", min=1)
    update_epochs: int = arg(10, "epochs over each iteration's samples", min=1)
    clip_coef: float = arg(0.2, "surrogate clipping coefficient", positive=True)
    ent_coef: float = arg(0.0, "entropy bonus coefficient", finite=True)
    vf_coef: float = arg(0.5, "value loss coefficient", finite=True)
    max_grad_norm: float = arg(0.5, "gradient clipping norm", positive=True)
    norm_adv: bool = arg(True, "normalize advantages per mini-batch (in delivery)")
    lead_first: bool = arg(True, "draw each iteration's first mini-batch from every rollout "
                           "unit but the last (FifoSampler first_within = 1 - 1/units), so the "
                           "first update need not wait for the last unit's ingestion; the "
                           "same mini-batches under every buffer and schedule")


def rollout_spec(info: EnvInfo) -> ExperienceSpec:
    """What actors push: time-major steps with values for bootstrapping."""
    action = ((), torch.int64) if info.discrete else ((info.action_dim,), torch.float32)
    fields = {"obs": ((info.obs_dim,), torch.float32), "action": action,
              "logprob": ((), torch.float32), "value": ((), torch.float32),
              "next_value": ((), torch.float32), "reward": ((), torch.float32),
              "terminated": ((), torch.bool), "truncated": ((), torch.bool)}
    if info.image_size:
        fields["pixels"] = ((info.image_size, info.image_size, 3), torch.uint8)
    return ExperienceSpec.of(**fields)


def buffer_spec(info: EnvInfo) -> ExperienceSpec:
    """What the buffer holds after ingestion: samples with advantages and returns."""
    action = ((), torch.int64) if info.discrete else ((info.action_dim,), torch.float32)
    fields = {"obs": ((info.obs_dim,), torch.float32), "action": action,
              "logprob": ((), torch.float32), "value": ((), torch.float32),
              "advantage": ((), torch.float32), "ret": ((), torch.float32)}
    if info.image_size:
        fields["pixels"] = ((info.image_size, info.image_size, 3), torch.uint8)
    return ExperienceSpec.of(**fields)


@numba.njit(cache=True, nogil=True)
def _gae_recursion(delta: np.ndarray, not_done: np.ndarray, decay: np.float32
                   ) -> np.ndarray:  # pragma: no cover - compiled
    """``adv[t] = delta[t] + decay * not_done[t] * adv[t + 1]``, backwards over time (rows) and
    for every environment (columns). Compiled: it runs in ingestion, on a thread beside the
    learner, and holds neither the GIL nor a per-step interpreter cost."""
    steps, envs = delta.shape
    adv = np.zeros((steps, envs), dtype=np.float32)
    for e in range(envs):
        last = np.float32(0.0)
        for t in range(steps - 1, -1, -1):
            last = delta[t, e] + decay * not_done[t, e] * last
            adv[t, e] = last
    return adv


def compute_gae(unit: dict[str, torch.Tensor], *, num_envs: int, gamma: float,
                lam: float) -> dict[str, torch.Tensor]:
    """GAE over one time-major rollout unit (row ``t * num_envs + e``), bootstrapped at its end.

    A terminated step does not bootstrap; a truncated one bootstraps from the value of its final
    observation (``next_value``); either ends the advantage recursion.
    """
    n = unit["reward"].shape[0]
    steps = n // num_envs
    shape = (steps, num_envs)
    reward = unit["reward"].numpy().reshape(shape)
    value = unit["value"].numpy().reshape(shape)
    next_value = unit["next_value"].numpy().reshape(shape)
    term = unit["terminated"].numpy().reshape(shape)
    not_done = (~(term | unit["truncated"].numpy().reshape(shape))).astype(np.float32)
    delta = reward + np.float32(gamma) * next_value * ~term - value
    adv = torch.from_numpy(_gae_recursion(delta, not_done, np.float32(gamma * lam)))
    adv = adv.reshape(-1)
    out = {k: unit[k] for k in ("obs", "action", "logprob", "value")}
    if "pixels" in unit:
        out["pixels"] = unit["pixels"]
    out["advantage"] = adv
    out["ret"] = adv + unit["value"]
    return out


def minibatch_sampler(args: Args) -> FifoSampler:
    """The consume-once sampler of a run: M shuffled mini-batches per epoch, the first of an
    iteration drawn from every rollout unit but the last when ``args.lead_first`` is set.

    Units land in (fragment, actor) order, so ``first_within = 1 - 1/units`` names the rows of
    every unit but the last whatever the schedule: the first mini-batch can be assembled while
    the last unit is still ingested (docs/design.md §2), and the mini-batches of a seed are the
    same inline and through Conduit.
    """
    units = args.actors * args.rollout_fragments if args.lead_first else 1
    return FifoSampler.leading(units=units, num_minibatches=args.num_minibatches,
                               seed=args.seed)


def rows_per_iteration(args: Args) -> int:
    """Samples of one PPO iteration: every actor's fragments of lock-steps over its envs."""
    return (args.actors * args.envs_per_actor * args.steps_per_rollout
            * args.rollout_fragments)


def schedule_space(args: Args) -> ScheduleSpace:
    """The schedules the run's on-policy plane can take (see
    :meth:`~conduit.plane.config.PlaneConfig.schedule_space`), for checking ``--schedule``
    before Ray starts."""
    unit = Fraction(args.envs_per_actor * args.steps_per_rollout, rows_per_iteration(args))
    return feasible_space(mode="on_policy", num_minibatches=args.num_minibatches,
                          unit_fraction_ing=unit if unit.denominator <= MAX_MINIBATCHES
                          else None)


def check(args: Args) -> None:
    """The checks of ``args`` that need more than one flag, run before Ray starts.

    Raises:
        ConfigError: ``MultiAgentCartPole`` (field ``env``): PPO here sizes an iteration with
            one row per env and step, while a multi-agent env yields one per live agent; the
            environment needs an optional extra that is not installed (field ``env``);
            ``--num-minibatches`` does not divide an iteration's samples, or leaves one
            sample per mini-batch with ``--norm-adv`` (field ``num_minibatches``); the
            environment's observation cannot be taken (see
            :func:`~conduit.workloads.envs.env_info`); ``--learning-rate`` overflows Adam's
            first step (see :func:`~conduit.workloads.args.check_learning_rate`); or a shared
            flag is refused (see :func:`~conduit.workloads.args.check_trainer_args`).
    """
    if args.env == MULTI_AGENT_CARTPOLE:
        raise ConfigError("env", f"PPO here supports single-agent envs; {args.env} has "
                                 "several agents per env (train it with --algo dqn)")
    check_trainer_args(args)
    check_learning_rate("learning_rate", args.learning_rate)
    rows = rows_per_iteration(args)
    if rows % args.num_minibatches:
        raise ConfigError("num_minibatches", f"{args.num_minibatches} does not divide the "
                                             f"{rows} samples of an iteration (--actors x "
                                             "--envs-per-actor x --steps-per-rollout x "
                                             "--rollout-fragments)")
    if args.norm_adv and rows // args.num_minibatches < 2:
        raise ConfigError("num_minibatches", f"{args.num_minibatches} splits the {rows} "
                                             "samples of an iteration into mini-batches of "
                                             f"{rows // args.num_minibatches} row, whose "
                                             "advantages --norm-adv cannot normalize (a "
                                             "standard deviation needs two); pass a smaller "
                                             "--num-minibatches, or --no-norm-adv")
    probe_env(args.env, image_size=args.image_size)  # an unknown id is left to env_info


def train(args: Args, *, on_batch: Callable[[dict[str, torch.Tensor]], None] | None = None
          ) -> RunResult:
    """Train PPO and return the per-iteration breakdown; ``on_batch`` sees each mini-batch.

    A diverging run stops after the iteration in which a loss, or the policy's output in the
    rollout, was not finite (an iteration whose rollout met a non-finite policy output runs no
    update); the result says which (``diverged``).
    """
    check(args)
    device = setup_learner(args)
    info = env_info(args.env, image_size=args.image_size)
    rows_per_iter = rows_per_iteration(args)

    # The plane: each iteration's samples, delivered as M mini-batches per epoch.
    plane, plan, tuner = make_plane(
        args, learner_device=device, mode="on_policy", num_minibatches=args.num_minibatches,
        spec=buffer_spec(info), rollout_spec=rollout_spec(info), capacity=rows_per_iter,
        batch_size=rows_per_iter // args.num_minibatches, num_epochs=args.update_epochs,
        rollout_rows=args.envs_per_actor * args.steps_per_rollout, seed=args.seed,
        sampler=minibatch_sampler(args))

    # Ingestion: GAE per actor rollout, as soon as it is pushed.
    @plane.register_ingestion(input="Actor", output="ExperienceBuffer")
    def ingestion(actor_in, exp_out):
        for unit in actor_in.read_units():
            exp_out.write(compute_gae(unit, num_envs=args.envs_per_actor, gamma=args.gamma,
                                      lam=args.gae_lambda))

    # Delivery: shuffled mini-batches (the plane's sampler), advantages normalized per batch.
    @plane.register_delivery(input="ExperienceBuffer", output="Learner")
    def delivery(exp_in, learn_out):
        rows = exp_in.read()
        if args.norm_adv:
            adv = rows["advantage"].reshape(exp_in.batches, -1)
            adv = (adv - adv.mean(1, keepdim=True)) / (adv.std(1, keepdim=True) + 1e-8)
            rows = {**rows, "advantage": adv.reshape(-1)}
        learn_out.write(rows)

    agent = PPOAgent(info).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    losses: list[float] = []
    env_steps = 0
    diverged = ""  # why the run diverged: it stops after this iteration and its result says so
    with rollout_actors(args, algo="ppo", info=info) as actors, plane:
        rec = BreakdownRecorder.for_run(plane, args, algo="ppo")
        for it in range(args.iters):
            with rec.iteration(it) as log:
                if args.anneal_lr:
                    optimizer.param_groups[0]["lr"] = args.learning_rate * (1.0 - it / args.iters)
                # Rollouts are pushed in actor order with the current policy version;
                # ingestion (GAE) runs per rollout, inline or overlapped with the others.
                got = rollout_and_push(plane, actors, args.steps_per_rollout,
                                       cpu_weights(agent), on_policy=True,
                                       fragments=args.rollout_fragments)
                env_steps += rows_per_iter
                log.update(env_steps=env_steps, returns=got["episode_returns"])
                if got["nonfinite"]:  # a diverged policy: no update, the run stops here
                    diverged = policy_not_finite(got["nonfinite"])
                    log["learning"] = False
                    break

                for _ in range(args.num_minibatches * args.update_epochs):
                    mb = plane.pull()
                    if on_batch is not None:
                        on_batch(mb)
                    with plane.timed("update"):
                        loss, stats = _ppo_loss(agent, mb, args)
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                        nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                        optimizer.step()
                        losses.append(loss.item())
                    if not math.isfinite(losses[-1]):
                        diverged = LOSS_NOT_FINITE
                        break
                log.update(loss=losses[-1], **stats)
            if tuner is not None:  # auto schedule: the cost model's pick, then a trial
                tuner.step(rec.records[-1])
            if diverged:
                break
        plane.flush()
    return RunResult.of("ppo", args, plan, rec, losses, actors, diverged=diverged)


def _ppo_loss(agent: PPOAgent, mb: dict[str, torch.Tensor], args: Args
              ) -> tuple[torch.Tensor, dict[str, float]]:
    logp, entropy, value = agent.evaluate(mb["obs"], mb["action"], mb.get("pixels"))
    log_ratio = logp - mb["logprob"]
    ratio = log_ratio.exp()
    adv = mb["advantage"]
    pg_loss = torch.max(-adv * ratio,
                        -adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
    v_loss = 0.5 * (value - mb["ret"]).pow(2).mean()
    loss = pg_loss - args.ent_coef * entropy.mean() + args.vf_coef * v_loss
    with torch.no_grad():
        approx_kl = ((ratio - 1) - log_ratio).mean().item()
    return loss, {"pg_loss": pg_loss.item(), "v_loss": v_loss.item(), "approx_kl": approx_kl}
