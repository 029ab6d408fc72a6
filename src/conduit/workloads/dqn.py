"""DQN on Ray actors, with the replay buffer behind Conduit's Experience Data Plane.

Reads top to bottom: arguments, the experience spec, the plane with its two operators, the
actors, then the training loop. ``--buffer inline`` runs every experience-path operator on the
caller's thread (the sequential baseline); ``--buffer conduit`` lets the plane place the buffer
and overlap the operators with rollout and update.

    conduit train --algo dqn --env CartPole-v1 --actors 2 --buffer conduit --iters 300
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
from conduit.storage import PrioritizedSampler
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
from conduit.workloads.nets import QNetwork
from conduit.workloads.planes import make_plane, transition_spec


@dataclass(frozen=True)
class Args(TrainerArgs):
    """DQN arguments; each becomes a ``--flag`` of ``conduit train --algo dqn``."""

    env: str = arg("CartPole-v1", "environment id: a Gymnasium id (CartPole-v1, "
                   "MountainCar-v0) or MultiAgentCartPole")
    num_agents: int = arg(4, "agents (CartPoles) of MultiAgentCartPole", min=1)
    buffer_size: int = arg(50_000, "replay capacity in transitions", min=1)
    batch_size: int = arg(128, "transitions per training batch", min=1)
    learning_rate: float = arg(5e-4, "Adam learning rate", positive=True)
    gamma: float = arg(0.99, "discount factor", min=0, max=1)
    updates_per_iter: int = arg(16, "gradient steps per iteration", min=1)
    target_update_every: int = arg(250, "gradient steps between target-network copies", min=1)
    learning_starts: int = arg(1_000, "transitions stored before learning starts (0: learn "
                               "from the first rollout); at most --buffer-size")
    start_e: float = arg(1.0, "initial exploration epsilon", min=0, max=1)
    end_e: float = arg(0.05, "final exploration epsilon", min=0, max=1)
    exploration_steps: int = arg(15_000, "transitions over which epsilon goes linearly from "
                                 "--start-e to --end-e", min=1)
    prioritized: bool = arg(False, "prioritized experience replay")
    per_alpha: float = arg(0.6, "PER priority exponent", min=0, finite=True)
    per_beta: float = arg(0.4, "PER importance-weight exponent", min=0, finite=True)


def check(args: Args) -> None:
    """The checks of ``args`` that need more than one flag (or the environment), run before
    Ray starts.

    Raises:
        ConfigError: The environment has continuous actions (field ``env``), or an
            observation the workloads cannot take, alone or with the image payload (see
            :func:`~conduit.workloads.envs.env_info`), the replay flags conflict (see
            :func:`~conduit.workloads.args.check_replay`), ``--learning-rate`` overflows
            Adam's first step (see :func:`~conduit.workloads.args.check_learning_rate`), or a
            shared flag is refused (see :func:`~conduit.workloads.args.check_trainer_args`).
    """
    check_trainer_args(args)
    check_learning_rate("learning_rate", args.learning_rate)
    check_replay(buffer_size=args.buffer_size, batch_size=args.batch_size,
                 learning_starts=args.learning_starts)
    info = probe_env(args.env, image_size=args.image_size, num_agents=args.num_agents)
    if info is not None and not info.discrete:
        raise ConfigError("env", f"DQN needs discrete actions; {args.env} is continuous "
                                 "(train it with --algo sac or ppo)")


def train(args: Args, *, on_batch: Callable[[dict[str, torch.Tensor]], None] | None = None
          ) -> RunResult:
    """Train DQN and return the per-iteration breakdown; ``on_batch`` sees each training
    batch (for tests).

    A diverging run stops after the iteration in which a loss, or the policy's output (its
    Q-values) in the rollout, was not finite (an iteration whose rollout met a non-finite
    policy output runs no update); the result says which (``diverged``).
    """
    check(args)
    device = setup_learner(args)
    info = env_info(args.env, image_size=args.image_size, num_agents=args.num_agents)

    # The plane: a replay buffer of `buffer_size` transitions (s, a, r, s', done), with the
    # image payload if any. Ingestion and delivery are the identity here (the defaults), so
    # they are not registered.
    sampler = (PrioritizedSampler(alpha=args.per_alpha, beta=args.per_beta, seed=args.seed)
               if args.prioritized else "uniform")
    plane, plan, tuner = make_plane(
        args, learner_device=device, mode="off_policy", spec=transition_spec(info),
        capacity=args.buffer_size, batch_size=args.batch_size, sampler=sampler,
        min_size=max(1, args.learning_starts), seed=args.seed)

    q_network = QNetwork(info).to(device)
    target_network = copy.deepcopy(q_network)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate)

    losses: list[float] = []
    transitions, updates = 0, 0
    diverged = ""  # why the run diverged: it stops after this iteration and its result says so
    with rollout_actors(args, algo="dqn", info=info, num_agents=args.num_agents) as actors, plane:
        rec = BreakdownRecorder.for_run(plane, args, algo="dqn")
        for it in range(args.iters):
            with rec.iteration(it) as log:
                epsilon = args.start_e + (min(1.0, transitions / args.exploration_steps)
                                          * (args.end_e - args.start_e))
                # Actor rollout with the latest weights; each rollout goes through the
                # plane's actor port (ingestion runs inline or overlapped).
                got = rollout_and_push(plane, actors, args.steps_per_rollout,
                                       cpu_weights(q_network), {"epsilon": epsilon})
                transitions += got["rows"]
                log.update(env_steps=transitions, returns=got["episode_returns"],
                           epsilon=epsilon)
                if got["nonfinite"]:  # a diverged policy: no update, the run stops here
                    diverged = policy_not_finite(got["nonfinite"])

                # Learner update: sample, TD target, gradient step.
                learning = transitions >= args.learning_starts and not diverged
                log["learning"] = learning
                for _ in range(args.updates_per_iter if learning else 0):
                    batch = plane.pull()  # delivery: inline or prefetched
                    if on_batch is not None:
                        on_batch(batch)
                    with plane.timed("update"):
                        loss, td = _dqn_loss(q_network, target_network, batch, args.gamma)
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                        optimizer.step()
                        updates += 1
                        if updates % args.target_update_every == 0:
                            target_network.load_state_dict(q_network.state_dict())
                        losses.append(loss.item())
                    if not math.isfinite(losses[-1]):
                        diverged = LOSS_NOT_FINITE
                        break
                    if args.prioritized:
                        plane.update_priorities(batch["_index"], td.abs() + 1e-3)
                if learning and losses:
                    log["loss"] = losses[-1]
            if tuner is not None:  # auto schedule: the cost model's pick, then a trial
                tuner.step(rec.records[-1])
            if diverged:
                break
        plane.flush()
    return RunResult.of("dqn", args, plan, rec, losses, actors, updates=updates,
                        diverged=diverged)


def _dqn_loss(q_network: QNetwork, target_network: QNetwork, b: dict[str, torch.Tensor],
              gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        next_q = target_network(b["next_obs"], b.get("next_pixels")).max(-1).values
        target = b["reward"] + gamma * next_q * (~b["done"]).float()
    q = q_network(b["obs"], b.get("pixels")).gather(1, b["action"].unsqueeze(-1)).squeeze(-1)
    per_sample = F.smooth_l1_loss(q, target, reduction="none")
    if "_weight" in b:  # importance weights of prioritized replay
        per_sample = per_sample * b["_weight"].to(per_sample.dtype)
    return per_sample.mean(), (target - q).detach()
