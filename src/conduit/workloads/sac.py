"""SAC (continuous actions) on Ray actors, with the replay buffer behind Conduit's plane.

Ingestion scales rewards (a framework-defined transform that runs where the plane decides);
delivery is the identity. ``--buffer inline`` is the sequential baseline, ``--buffer conduit``
the planned and overlapped experience path.

    conduit train --algo sac --env Pendulum-v1 --actors 2 --buffer conduit --iters 200
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
from conduit.workloads import runner
from conduit.workloads.actors import ActorGroup, init_ray
from conduit.workloads.envs import env_info
from conduit.workloads.nets import SACActor, SoftQNetwork


@dataclass(frozen=True)
class Args:
    """SAC arguments; each becomes a ``--flag`` of ``conduit train --algo sac``."""

    env: str = arg("Pendulum-v1", "environment id with continuous actions: Pendulum-v1, or "
                   "metaworld/reach-v3 (needs the optional metaworld extra)")
    image_size: int = arg(0, "attach a size x size x 3 uint8 image to every observation "
                          "(0 off; 128 ~ 48 KB, 256 ~ 192 KB); a payload-size stand-in")
    actors: int = arg(2, "rollout actors (Ray actors unless --no-use-ray)")
    envs_per_actor: int = arg(2, "environment copies each actor steps in lock-step")
    steps_per_rollout: int = arg(16, "lock-steps per actor per iteration (one rollout unit)")
    iters: int = arg(200, "training iterations")
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
    buffer_size: int = arg(100_000, "replay capacity in transitions")
    batch_size: int = arg(256, "transitions per training batch")
    q_lr: float = arg(1e-3, "critic learning rate")
    policy_lr: float = arg(3e-4, "actor learning rate")
    gamma: float = arg(0.99, "discount factor")
    tau: float = arg(0.005, "target smoothing coefficient")
    reward_scale: float = arg(1.0, "reward multiplier applied in ingestion")
    updates_per_iter: int = arg(32, "gradient steps per iteration")
    learning_starts: int = arg(1_000, "transitions stored (random actions) before learning")
    autotune: bool = arg(True, "tune the entropy coefficient automatically")
    alpha: float = arg(0.2, "entropy coefficient when not autotuned")


def train(args: Args, *, on_batch: Callable[[dict[str, torch.Tensor]], None] | None = None
          ) -> runner.RunResult:
    """Train SAC and return the per-iteration breakdown; ``on_batch`` sees each batch."""
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    runner.quiet_readonly_warning()
    device = runner.resolve_device(args.device)
    runner.set_learner_threads(args.learner_threads, actors=args.actors, use_ray=args.use_ray)
    info = env_info(args.env, image_size=args.image_size)
    if info.discrete:
        raise ValueError(f"env: SAC here needs continuous actions; {args.env} is discrete")

    spec = runner.transition_spec(info)
    plane, plan, auto = runner.make_plane(
        buffer=args.buffer, schedule=args.schedule, placement=args.placement,
        mode="off_policy", spec=spec, capacity=args.buffer_size, batch_size=args.batch_size,
        sampler="uniform", learner_device=str(device), min_size=args.learning_starts,
        seed=args.seed)

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

    started_ray = init_ray(args.address or None) if args.use_ray else False
    actors = ActorGroup(args.actors, use_ray=args.use_ray, algo="sac", env_id=args.env,
                        info=info, num_envs=args.envs_per_actor, seed=args.seed)
    rec = runner.BreakdownRecorder(plane, total_iters=args.iters, log_every=args.log_every,
                                   label=f"[sac {args.buffer}] ")
    losses: list[float] = []
    transitions = 0
    try:
        with plane:
            for it in range(args.iters):
                with rec.iteration(it) as log:
                    got = runner.rollout_and_push(
                        plane, actors, args.steps_per_rollout, runner.cpu_weights(actor),
                        {"random": transitions < args.learning_starts})
                    transitions += got["rows"]
                    returns = got["episode_returns"]
                    log.update(env_steps=transitions, returns=returns)

                    learning = transitions >= args.learning_starts
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
                    if learning and losses:
                        log.update(qf_loss=losses[-2], actor_loss=losses[-1], alpha=alpha)
                if auto is not None:  # auto-schedule: cost model, then a measured trial
                    auto.step(rec.records[-1])
            plane.flush()
    finally:
        actors.close()
        if started_ray:
            import ray

            ray.shutdown()
    return runner.RunResult("sac", args.env, args.buffer, plan, rec.summary(), rec.records,
                            rec.returns, asdict(args), runner.all_finite(losses))
