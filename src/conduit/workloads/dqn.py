"""DQN on Ray actors, with the replay buffer behind Conduit's Experience Data Plane.

Reads top to bottom: arguments, the experience spec, the plane with its two operators, the
actors, then the training loop. ``--buffer inline`` runs every experience-path operator on the
caller's thread (the sequential baseline); ``--buffer conduit`` lets the plane place the buffer
and overlap the operators with rollout and update.

    conduit train --algo dqn --env CartPole-v1 --actors 2 --buffer conduit --iters 300
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from conduit.cli_args import arg
from conduit.storage import PrioritizedSampler
from conduit.workloads import runner
from conduit.workloads.actors import ActorGroup, init_ray
from conduit.workloads.envs import env_info
from conduit.workloads.nets import QNetwork


@dataclass(frozen=True)
class Args:
    """DQN arguments; each becomes a ``--flag`` of ``conduit train --algo dqn``."""

    env: str = arg("CartPole-v1", "environment id: a Gymnasium id (CartPole-v1, "
                   "MountainCar-v0) or MultiAgentCartPole")
    image_size: int = arg(0, "attach a size x size x 3 uint8 image to every observation "
                          "(0 off; 128 ~ 48 KB, 256 ~ 192 KB); a payload-size stand-in")
    num_agents: int = arg(4, "agents (CartPoles) of MultiAgentCartPole")
    actors: int = arg(2, "rollout actors (Ray actors unless --no-use-ray)")
    envs_per_actor: int = arg(4, "environment copies each actor steps in lock-step")
    steps_per_rollout: int = arg(16, "lock-steps per actor per iteration (one rollout unit)")
    iters: int = arg(300, "training iterations")
    buffer: Literal["inline", "conduit"] = arg("conduit", "experience path: 'inline' runs "
                                               "every operator on the caller's thread; "
                                               "'conduit' places and schedules it")
    schedule: str = arg("auto", "conduit schedule: auto, inline, or 'ov_ing,g_ing,ov_del,g_del'")
    placement: str = arg("auto", "conduit placement: auto, pageable, pinned, learner, cuda:0")
    seed: int = arg(1, "random seed")
    device: str = arg("auto", "learner device: auto (CUDA when present), cpu, cuda:0")
    learner_threads: int = arg(0, "torch threads of the learner (0: the cores the actors "
                               "leave free, at least 1)")
    use_ray: bool = arg(True, "run actors as Ray actors (otherwise in the driver process)")
    address: str = arg("", "Ray cluster address to attach to (empty: start a local Ray)")
    log_every: int = arg(10, "print a progress line every this many iterations (0: never)")
    out: str = arg("", "write the JSON log here (empty: do not write)")
    plot: str = arg("", "write the PNG breakdown here (empty: do not write)")
    buffer_size: int = arg(50_000, "replay capacity in transitions")
    batch_size: int = arg(128, "transitions per training batch")
    learning_rate: float = arg(5e-4, "Adam learning rate")
    gamma: float = arg(0.99, "discount factor")
    updates_per_iter: int = arg(16, "gradient steps per iteration")
    target_update_every: int = arg(250, "gradient steps between target-network copies")
    learning_starts: int = arg(1_000, "transitions stored before learning starts")
    start_e: float = arg(1.0, "initial exploration epsilon")
    end_e: float = arg(0.05, "final exploration epsilon")
    exploration_steps: int = arg(15_000, "transitions over which epsilon decays linearly")
    prioritized: bool = arg(False, "prioritized experience replay")
    per_alpha: float = arg(0.6, "PER priority exponent")
    per_beta: float = arg(0.4, "PER importance-weight exponent")


def train(args: Args, *, on_batch: Callable[[dict[str, torch.Tensor]], None] | None = None
          ) -> runner.RunResult:
    """Train DQN and return the per-iteration breakdown; ``on_batch`` sees each training
    batch (for tests)."""
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    runner.quiet_readonly_warning()
    device = runner.resolve_device(args.device)
    runner.set_learner_threads(args.learner_threads, actors=args.actors, use_ray=args.use_ray)
    info = env_info(args.env, image_size=args.image_size, num_agents=args.num_agents)
    if not info.discrete:
        raise ValueError(f"env: DQN needs discrete actions; {args.env} is continuous")

    # The experience spec: one transition (s, a, r, s', done), with the image payload if any.
    spec = runner.transition_spec(info)

    # The plane: a replay buffer of `buffer_size` transitions. Ingestion and delivery are the
    # identity here (the defaults), so they are not registered.
    sampler = (PrioritizedSampler(alpha=args.per_alpha, beta=args.per_beta, seed=args.seed)
               if args.prioritized else "uniform")
    plane, plan, auto = runner.make_plane(
        buffer=args.buffer, schedule=args.schedule, placement=args.placement,
        mode="off_policy", spec=spec, capacity=args.buffer_size, batch_size=args.batch_size,
        sampler=sampler, learner_device=str(device), min_size=args.learning_starts,
        seed=args.seed)

    q_network = QNetwork(info).to(device)
    target_network = copy.deepcopy(q_network)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate)

    started_ray = init_ray(args.address or None) if args.use_ray else False
    actors = ActorGroup(args.actors, use_ray=args.use_ray, algo="dqn", env_id=args.env,
                        info=info, num_envs=args.envs_per_actor, seed=args.seed,
                        num_agents=args.num_agents)
    rec = runner.BreakdownRecorder(plane, total_iters=args.iters, log_every=args.log_every,
                                   label=f"[dqn {args.buffer}] ")
    losses: list[float] = []
    transitions, updates = 0, 0
    try:
        with plane:
            for it in range(args.iters):
                with rec.iteration(it) as log:
                    epsilon = max(args.end_e, args.start_e - (args.start_e - args.end_e)
                                  * transitions / args.exploration_steps)
                    # Actor rollout with the latest weights; each rollout goes through the
                    # plane's actor port (ingestion runs inline or overlapped).
                    got = runner.rollout_and_push(plane, actors, args.steps_per_rollout,
                                                  runner.cpu_weights(q_network),
                                                  {"epsilon": epsilon})
                    transitions += got["rows"]
                    returns = got["episode_returns"]
                    log.update(env_steps=transitions, returns=returns, epsilon=epsilon)

                    # Learner update: sample, TD target, gradient step.
                    learning = transitions >= args.learning_starts
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
                        if args.prioritized:
                            plane.update_priorities(batch["_index"], td.abs() + 1e-3)
                    if learning and losses:
                        log["loss"] = losses[-1]
                if auto is not None:  # auto-schedule: cost model, then a measured trial
                    auto.step(rec.records[-1])
            plane.flush()
    finally:
        actors.close()
        if started_ray:
            import ray

            ray.shutdown()
    return runner.RunResult("dqn", args.env, args.buffer, plan, rec.summary(), rec.records,
                            rec.returns, asdict(args), runner.all_finite(losses))


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
