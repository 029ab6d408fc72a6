"""SAC (continuous actions) on Ray actors, with the replay buffer behind Conduit's plane.

Ingestion scales rewards (a framework-defined transform that runs where the plane decides);
delivery is the identity. ``--buffer inline`` is the sequential baseline, ``--buffer conduit``
the planned and overlapped experience path.

    conduit train --algo sac --env Pendulum-v1 --actors 2 --buffer conduit --iters 200
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from conduit.cli_args import arg
from conduit.errors import ConfigError
from conduit.workloads.actor_port import rollout_and_push
from conduit.workloads.actors import cpu_weights, rollout_actors
from conduit.workloads.args import (
    TrainerArgs,
    check_learning_rate,
    check_replay,
    check_trainer_args,
    probe_env,
)
from conduit.workloads.breakdown import BreakdownRecorder, RunResult
from conduit.workloads.envs import env_info
from conduit.workloads.learner import LOSS_NOT_FINITE, policy_not_finite, setup_learner
from conduit.workloads.nets import SACActor, SoftQNetwork
from conduit.workloads.planes import make_plane, transition_spec


@dataclass(frozen=True)
class Args(TrainerArgs):
    """SAC arguments; each becomes a ``--flag`` of ``conduit train --algo sac``."""

    env: str = arg("Pendulum-v1", "environment id with continuous actions: Pendulum-v1, or "
                   "metaworld/reach-v3 (needs the optional metaworld extra)")
    envs_per_actor: int = arg(2, "environment copies each actor steps in lock-step", min=1)
    iters: int = arg(200, "training iterations", min=1)
    buffer_size: int = arg(100_000, "replay capacity in transitions", min=1)
    batch_size: int = arg(256, "transitions per training batch", min=1)
    q_lr: float = arg(1e-3, "critic learning rate", positive=True)
    policy_lr: float = arg(3e-4, "actor learning rate", positive=True)
    gamma: float = arg(0.99, "discount factor", min=0, max=1)
    tau: float = arg(0.005, "target smoothing coefficient (1: copy the critics every step)",
                     positive=True, max=1.0)
    reward_scale: float = arg(1.0, "reward multiplier applied in ingestion", finite=True)
    updates_per_iter: int = arg(32, "gradient steps per iteration", min=1)
    learning_starts: int = arg(1_000, "transitions stored (random actions) before learning "
                               "(0: learn from the first rollout); at most --buffer-size")
    autotune: bool = arg(True, "tune the entropy coefficient automatically")
    alpha: float = arg(0.2, "entropy coefficient when not autotuned", min=0, finite=True)


def check(args: Args) -> None:
    """The checks of ``args`` that need more than one flag (or the environment), run before
    Ray starts.

    Raises:
        ConfigError: The environment has discrete actions or needs an extra that is not
            installed (field ``env``), or has an observation the workloads cannot take, alone
            or with the image payload (see :func:`~conduit.workloads.envs.env_info`), the
            replay flags conflict (see
            :func:`~conduit.workloads.args.check_replay`), ``--q-lr`` or ``--policy-lr``
            overflows Adam's first step (see
            :func:`~conduit.workloads.args.check_learning_rate`), or a shared flag is refused
            (see :func:`~conduit.workloads.args.check_trainer_args`).
    """
    check_trainer_args(args)
    check_learning_rate("q_lr", args.q_lr)
    check_learning_rate("policy_lr", args.policy_lr)
    check_replay(buffer_size=args.buffer_size, batch_size=args.batch_size,
                 learning_starts=args.learning_starts)
    info = probe_env(args.env, image_size=args.image_size)
    if info is not None and info.discrete:
        raise ConfigError("env", f"SAC here needs continuous actions; {args.env} is discrete "
                                 "(train it with --algo dqn or ppo)")


def train(args: Args, *, on_batch: Callable[[dict[str, torch.Tensor]], None] | None = None
          ) -> RunResult:
    """Train SAC and return the per-iteration breakdown; ``on_batch`` sees each batch.

    A diverging run stops after the iteration in which a loss, or the policy's output (its
    action) in the rollout, was not finite (an iteration whose rollout met a non-finite policy
    output runs no update); the result says which (``diverged``).
    """
    check(args)
    device = setup_learner(args)
    info = env_info(args.env, image_size=args.image_size)

    # The plane: a replay buffer of `buffer_size` transitions (s, a, r, s', done).
    plane, plan, tuner = make_plane(
        args, learner_device=device, mode="off_policy", spec=transition_spec(info),
        capacity=args.buffer_size, batch_size=args.batch_size, sampler="uniform",
        min_size=max(1, args.learning_starts), seed=args.seed)

    # Ingestion: a framework-defined transform of each rollout before it is stored.
    @plane.register_ingestion(input="Actor", output="ExperienceBuffer")
    def ingestion(actor_in, exp_out):
        rows = actor_in.read()
        if args.reward_scale != 1.0:
            rows["reward"] = rows["reward"] * args.reward_scale
        exp_out.write(rows)

    actor = SACActor(info).to(device)
    qf1, qf2 = SoftQNetwork(info).to(device), SoftQNetwork(info).to(device)
    qf1_target, qf2_target = copy.deepcopy(qf1), copy.deepcopy(qf2)
    q_optimizer = torch.optim.Adam([*qf1.parameters(), *qf2.parameters()], lr=args.q_lr)
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=args.policy_lr)
    target_entropy = -float(info.action_dim)
    log_alpha = torch.zeros(1, requires_grad=True, device=device)
    a_optimizer = torch.optim.Adam([log_alpha], lr=args.q_lr)
    alpha = log_alpha.exp().item() if args.autotune else args.alpha

    losses: list[float] = []
    transitions = 0
    diverged = ""  # why the run diverged: it stops after this iteration and its result says so
    with rollout_actors(args, algo="sac", info=info) as actors, plane:
        rec = BreakdownRecorder.for_run(plane, args, algo="sac")
        for it in range(args.iters):
            with rec.iteration(it) as log:
                # Actor rollout (random actions until learning starts) through the actor port.
                got = rollout_and_push(plane, actors, args.steps_per_rollout,
                                       cpu_weights(actor),
                                       {"random": transitions < args.learning_starts})
                transitions += got["rows"]
                log.update(env_steps=transitions, returns=got["episode_returns"])
                if got["nonfinite"]:  # a diverged policy: no update, the run stops here
                    diverged = policy_not_finite(got["nonfinite"])

                learning = transitions >= args.learning_starts and not diverged
                log["learning"] = learning
                for _ in range(args.updates_per_iter if learning else 0):
                    b = plane.pull()
                    if on_batch is not None:
                        on_batch(b)
                    with plane.timed("update"):
                        obs, px = b["obs"], b.get("pixels")
                        nobs, npx = b["next_obs"], b.get("next_pixels")
                        # Critic: soft Bellman target from the target critics.
                        with torch.no_grad():
                            na, nlogp = actor(nobs, npx)
                            nq = torch.min(qf1_target(nobs, na, npx),
                                           qf2_target(nobs, na, npx)) - alpha * nlogp
                            target = b["reward"] + args.gamma * (~b["done"]).float() * nq
                        qf_loss = (F.mse_loss(qf1(obs, b["action"], px), target)
                                   + F.mse_loss(qf2(obs, b["action"], px), target))
                        q_optimizer.zero_grad(set_to_none=True)
                        qf_loss.backward()
                        q_optimizer.step()
                        # Actor: maximize Q - alpha * log pi.
                        a, logp = actor(obs, px)
                        actor_loss = (alpha * logp
                                      - torch.min(qf1(obs, a, px), qf2(obs, a, px))).mean()
                        actor_optimizer.zero_grad(set_to_none=True)
                        actor_loss.backward()
                        actor_optimizer.step()
                        if args.autotune:
                            alpha_loss = (-log_alpha.exp()
                                          * (logp.detach() + target_entropy)).mean()
                            a_optimizer.zero_grad(set_to_none=True)
                            alpha_loss.backward()
                            a_optimizer.step()
                            alpha = log_alpha.exp().item()
                        with torch.no_grad():
                            for net, tgt in ((qf1, qf1_target), (qf2, qf2_target)):
                                for p, tp in zip(net.parameters(), tgt.parameters()):
                                    tp.lerp_(p, args.tau)
                        losses += [qf_loss.item(), actor_loss.item()]
                    if not (math.isfinite(losses[-2]) and math.isfinite(losses[-1])):
                        diverged = LOSS_NOT_FINITE
                        break
                if learning and losses:
                    log.update(qf_loss=losses[-2], actor_loss=losses[-1], alpha=alpha)
            if tuner is not None:  # auto schedule: the cost model's pick, then a trial
                tuner.step(rec.records[-1])
            if diverged:
                break
        plane.flush()
    # Two losses (critic, actor) per gradient step.
    return RunResult.of("sac", args, plan, rec, losses, actors, updates=len(losses) // 2,
                        diverged=diverged)
