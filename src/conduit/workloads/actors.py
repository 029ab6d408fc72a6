"""Rollout actors: each steps an :class:`~conduit.workloads.envs.EnvPool` with the current policy
and returns one rollout unit as numpy arrays, ready for ``plane.push``.

:class:`RolloutWorker` is a plain class; :class:`ActorGroup` runs several of them as Ray actors
(the default) or in the driver process (``use_ray=False``, for debugging); :func:`ray_running`
starts or attaches to Ray for them. Ray is imported only here, lazily, and its security
settings are left as they are (token authentication by default).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import numpy as np
import torch

from conduit.workloads import nets
from conduit.workloads.args import TrainerArgs
from conduit.workloads.envs import EnvInfo, EnvPool

ALGOS = ("dqn", "sac", "ppo")


class RolloutWorker:
    """Runs ``num_envs`` environment copies with a local copy of the policy.

    Args:
        algo: ``"dqn"``, ``"sac"`` or ``"ppo"``: which policy network and which fields.
        env_id: Environment id (see :func:`conduit.workloads.envs.make_env`).
        info: The environment's :class:`EnvInfo`.
        num_envs: Environment copies.
        seed: Base seed; this worker uses ``seed + 7919 * rank``.
        rank: Index of this worker.
        num_agents: Agents of ``MultiAgentCartPole``.
    """

    def __init__(self, *, algo: str, env_id: str, info: EnvInfo, num_envs: int, seed: int,
                 rank: int = 0, num_agents: int = 4) -> None:
        torch.set_num_threads(1)
        if algo not in ALGOS:
            raise ValueError(f"algo: must be one of {ALGOS}, got {algo!r}")
        self.algo, self.info, self.num_envs = algo, info, num_envs
        s = seed + 7919 * rank
        self.pool = EnvPool(env_id, num_envs=num_envs, seed=s, image_size=info.image_size,
                            num_agents=num_agents)
        self.rng = np.random.default_rng(s)
        self.gen = torch.Generator().manual_seed(s)
        if algo == "dqn":
            self.policy: torch.nn.Module = nets.QNetwork(info)
        elif algo == "sac":
            self.policy = nets.SACActor(info)
        else:
            self.policy = nets.PPOAgent(info)
        self.policy.eval()

    def rollout(self, num_steps: int, weights: dict[str, torch.Tensor] | None = None,
                params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Load ``weights`` (if given), step ``num_steps`` times, return the rollout unit.

        Args:
            num_steps: Lock-steps of the pool (rows = ``num_steps × rows per step``).
            weights: Policy ``state_dict`` from the learner.
            params: Exploration parameters: ``epsilon`` (DQN), ``random`` (SAC warm-up).

        Returns:
            ``{"rollout": dict of numpy arrays, "stats": dict}``.
        """
        t0 = time.perf_counter()
        if weights is not None:
            self.policy.load_state_dict(weights)
        params = params or {}
        with torch.no_grad():
            if self.algo == "ppo":
                out = self._rollout_ppo(num_steps)
            else:
                out = self._rollout_transitions(num_steps, params)
        out["stats"]["actor_s"] = time.perf_counter() - t0
        out["stats"]["pid"] = os.getpid()
        return out

    def _obs_tensors(self, obs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(v) for k, v in obs.items()}

    def _act(self, obs: dict[str, np.ndarray], params: dict[str, Any]) -> np.ndarray:
        n = self.pool.num_rows
        if self.algo == "dqn":
            greedy = self.policy(**self._obs_tensors(obs)).argmax(-1).numpy()
            explore = self.rng.random(n) < float(params.get("epsilon", 0.0))
            return np.where(explore, self.rng.integers(0, self.info.num_actions, n),
                            greedy).astype(np.int64)
        if params.get("random", False):
            return self.rng.uniform(self.info.action_low, self.info.action_high,
                                    (n, self.info.action_dim)).astype(np.float32)
        action, _ = self.policy(**self._obs_tensors(obs), generator=self.gen)
        return action.numpy().astype(np.float32)

    def _rollout_transitions(self, num_steps: int, params: dict[str, Any]) -> dict[str, Any]:
        cols: dict[str, list[np.ndarray]] = {}
        rets: list[float] = []
        lens: list[int] = []
        for _ in range(num_steps):
            obs = self.pool.obs
            action = self._act(obs, params)
            res = self.pool.step(action)
            keep = res.active
            row = {"action": action, "reward": res.reward, "done": res.terminated}
            for k, v in obs.items():
                row[k] = v
                row[_next_name(k)] = res.next_obs[k]
            for k, v in row.items():
                cols.setdefault(k, []).append(v[keep] if not keep.all() else v)
            rets += res.episode_returns
            lens += res.episode_lengths
        rollout = {k: np.concatenate(v) for k, v in cols.items()}
        return {"rollout": rollout, "stats": {"episode_returns": rets, "episode_lengths": lens,
                                              "rows": len(rollout["reward"])}}

    def _rollout_ppo(self, num_steps: int) -> dict[str, Any]:
        agent: nets.PPOAgent = self.policy  # type: ignore[assignment]
        cols: dict[str, list[np.ndarray]] = {}
        rets: list[float] = []
        lens: list[int] = []
        for _ in range(num_steps):
            obs = self.pool.obs
            t = self._obs_tensors(obs)
            h = agent.enc(**t)
            dist = agent.dist(h)
            if self.info.discrete:
                action = torch.multinomial(dist.probs, 1, generator=self.gen).squeeze(-1)
            else:
                action = _normal_sample(dist, self.gen)
            logp = dist.log_prob(action)
            if not self.info.discrete:
                logp = logp.sum(-1)
            value = agent.critic(h).squeeze(-1)
            res = self.pool.step(action.numpy())
            # Bootstrap values: V(final obs) where a time limit cut the episode; filled with
            # V(next obs) of the following step below.
            next_value = np.zeros(self.pool.num_rows, np.float32)
            if res.truncated.any():
                fin = self._obs_tensors({k: v[res.truncated] for k, v in res.next_obs.items()})
                next_value[res.truncated] = agent.value(**fin).numpy()
            row = {**obs, "action": action.numpy(), "logprob": logp.numpy().astype(np.float32),
                   "value": value.numpy().astype(np.float32), "next_value": next_value,
                   "reward": res.reward, "terminated": res.terminated,
                   "truncated": res.truncated}
            for k, v in row.items():
                cols.setdefault(k, []).append(v)
            rets += res.episode_returns
            lens += res.episode_lengths
        last_value = agent.value(**self._obs_tensors(self.pool.obs)).numpy()
        values = [*cols["value"][1:], last_value]
        for t_, nv in enumerate(values):
            cut = cols["truncated"][t_]
            cols["next_value"][t_] = np.where(cut, cols["next_value"][t_], nv)
        rollout = {k: np.concatenate(v) for k, v in cols.items()}  # time-major: row t*E + e
        if self.info.discrete:
            rollout["action"] = rollout["action"].astype(np.int64)
        return {"rollout": rollout, "stats": {"episode_returns": rets, "episode_lengths": lens,
                                              "rows": len(rollout["reward"])}}

    def close(self) -> None:
        """Close the environments."""
        self.pool.close()


def _next_name(k: str) -> str:
    return "next_obs" if k == "obs" else f"next_{k}"


def _normal_sample(dist: torch.distributions.Normal, gen: torch.Generator) -> torch.Tensor:
    return dist.mean + dist.stddev * torch.randn(dist.mean.shape, generator=gen)


@contextmanager
def ray_running(address: str = "", *, enabled: bool = True) -> Iterator[None]:
    """Ray for the duration of the block: a local Ray is started (or ``address`` attached to)
    unless one is running already, and shut down at the end only when started here.

    Args:
        address: Ray cluster address to attach to (empty: start a local Ray).
        enabled: False makes this a no-op (in-process actors).
    """
    if not enabled:
        yield
        return
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def cpu_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of ``module``'s ``state_dict``, for broadcasting to the actors."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


class ActorGroup:
    """Several :class:`RolloutWorker` s, as Ray actors or in-process; a context manager that
    closes them on exit.

    Args:
        num_actors: Workers.
        use_ray: Ray actors (True) or in-process workers (False).
        actor_cpus: Ray CPU resource each actor asks for (fractions let many actors share
            a small machine).
        **worker_kw: Passed to :class:`RolloutWorker`.
    """

    def __init__(self, num_actors: int, *, use_ray: bool = True, actor_cpus: float = 0.25,
                 **worker_kw: Any) -> None:
        if num_actors < 1:
            raise ValueError(f"num_actors: must be >= 1, got {num_actors}")
        self.use_ray = use_ray
        if use_ray:
            import ray

            remote = ray.remote(num_cpus=actor_cpus)(RolloutWorker)
            self.workers = [remote.remote(rank=i, **worker_kw) for i in range(num_actors)]
        else:
            self.workers = [RolloutWorker(rank=i, **worker_kw) for i in range(num_actors)]

    def __len__(self) -> int:
        return len(self.workers)

    def __enter__(self) -> ActorGroup:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def submit(self, num_steps: int, weights: dict[str, torch.Tensor] | None,
               params: dict[str, Any] | None = None) -> list[Any]:
        """Start one rollout on every worker; returns handles for :meth:`result`."""
        if self.use_ray:
            import ray

            ref = ray.put(weights) if weights is not None else None
            return [w.rollout.remote(num_steps, ref, params) for w in self.workers]
        return [(w, num_steps, weights, params) for w in self.workers]

    def result(self, handle: Any) -> dict[str, Any]:
        """Wait for one rollout (in-process workers run it now)."""
        if self.use_ray:
            import ray

            return ray.get(handle)
        w, n, weights, params = handle
        return w.rollout(n, weights, params)

    def close(self) -> None:
        """Stop the workers."""
        if self.use_ray:
            import ray

            for w in self.workers:
                ray.kill(w)
        else:
            for w in self.workers:
                w.close()
        self.workers = []


@contextmanager
def rollout_actors(args: TrainerArgs, *, algo: str, info: EnvInfo,
                   **worker_kw: Any) -> Iterator[ActorGroup]:
    """``args.actors`` rollout workers of ``algo`` for the duration of the block, each stepping
    ``args.envs_per_actor`` copies of ``args.env``: Ray actors (Ray started or attached to as
    :func:`ray_running` does) unless ``args.use_ray`` is off.

    Args:
        args: The run's arguments.
        algo: ``"dqn"``, ``"sac"`` or ``"ppo"``.
        info: The environment's :class:`EnvInfo`.
        **worker_kw: More :class:`RolloutWorker` arguments (``num_agents``).
    """
    with (ray_running(args.address, enabled=args.use_ray),
          ActorGroup(args.actors, use_ray=args.use_ray, algo=algo, env_id=args.env, info=info,
                     num_envs=args.envs_per_actor, seed=args.seed, **worker_kw) as group):
        yield group
