"""Rollout actors: each steps an :class:`~conduit.workloads.envs.EnvPool` with the current policy
and returns one rollout unit as numpy arrays, ready for ``plane.push``.

:class:`RolloutWorker` is a plain class; :class:`ActorGroup` runs several of them as Ray actors
(the default) or in the driver process (``use_ray=False``, for debugging), and re-creates a Ray
actor that dies; :func:`ray_running` starts or attaches to Ray for them. Ray is imported only
here, lazily, and its security settings are left as they are (token authentication by default).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

import numpy as np
import torch

from conduit.errors import ConfigError
from conduit.workloads import nets
from conduit.workloads.args import TrainerArgs
from conduit.workloads.envs import EnvInfo, EnvPool

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

ALGOS = ("dqn", "sac", "ppo")

Params = dict[str, float | bool]
"""Exploration parameters of a rollout: ``epsilon`` (DQN), ``random`` (SAC warm-up)."""


class RolloutStats(TypedDict):
    """What a worker reports with a rollout unit.

    ``nonfinite`` counts the actions for which the policy's output (logits, Q-values or the
    action itself) was not finite, as a diverged policy's is; each was replaced by a stand-in
    (see :meth:`RolloutWorker.rollout`).
    """

    episode_returns: list[float]
    episode_lengths: list[int]
    rows: int
    nonfinite: NotRequired[int]
    actor_s: NotRequired[float]
    pid: NotRequired[int]


class Rollout(TypedDict):
    """One rollout unit as numpy arrays (ready for ``plane.push``) and its statistics."""

    rollout: dict[str, np.ndarray]
    stats: RolloutStats


class RolloutWorker:
    """Runs ``num_envs`` environment copies with a local copy of the policy.

    Args:
        algo: ``"dqn"``, ``"sac"`` or ``"ppo"``: which policy network and which fields.
        env_id: Environment id (see :func:`conduit.workloads.envs.make_env`).
        info: The environment's :class:`EnvInfo`.
        num_envs: Environment copies.
        seed: Base seed; this worker uses ``seed + 7919 * rank + 104729 * restart``.
        rank: Index of this worker.
        restart: How many times the worker of this rank was re-created before this one, so
            that a replacement does not replay the episodes of the worker it replaces.
        num_agents: Agents of ``MultiAgentCartPole``.
        single_thread: Set torch to one intra-op thread in this process: right for a Ray
            actor's own process, wrong for an in-process worker, which would take the
            learner's threads away (:class:`ActorGroup` passes it only for Ray actors).
    """

    def __init__(self, *, algo: str, env_id: str, info: EnvInfo, num_envs: int, seed: int,
                 rank: int = 0, restart: int = 0, num_agents: int = 4,
                 single_thread: bool = True) -> None:
        if single_thread:
            torch.set_num_threads(1)
        if algo not in ALGOS:
            raise ValueError(f"algo: must be one of {ALGOS}, got {algo!r}")
        self.algo, self.info, self.num_envs = algo, info, num_envs
        s = seed + 7919 * rank + 104_729 * restart
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
        self._nonfinite = 0  # actions of the current rollout given a stand-in

    def rollout(self, num_steps: int, weights: dict[str, torch.Tensor] | None = None,
                params: Params | None = None) -> Rollout:
        """Load ``weights`` (if given), step ``num_steps`` times, return the rollout unit.

        Args:
            num_steps: Lock-steps of the pool (rows = ``num_steps × rows per step``).
            weights: Policy ``state_dict`` from the learner.
            params: Exploration parameters: ``epsilon`` (DQN), ``random`` (SAC warm-up).

        Returns:
            The rollout unit and its statistics. An action for which the policy's output is
            not finite (a diverged policy: NaN or infinite weights, or outputs that overflow)
            is replaced by a stand-in that the environment takes (uniform over the discrete
            actions; 0 clipped to the bounds of continuous ones), and counted in
            ``stats["nonfinite"]``, so the rollout completes and the learner can stop the run.
        """
        t0 = time.perf_counter()
        if weights is not None:
            self.policy.load_state_dict(weights)
        params = params or {}
        self._nonfinite = 0
        with torch.no_grad():
            if self.algo == "ppo":
                out = self._rollout_ppo(num_steps)
            else:
                out = self._rollout_transitions(num_steps, params)
        out["stats"]["nonfinite"] = self._nonfinite
        out["stats"]["actor_s"] = time.perf_counter() - t0
        out["stats"]["pid"] = os.getpid()
        return out

    def _obs_tensors(self, obs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(v) for k, v in obs.items()}

    def _nonfinite_rows(self, out: torch.Tensor) -> torch.Tensor | None:
        """Which rows of the policy's output ``out`` hold a value that is not finite (None
        when none does); counts them in this rollout's ``nonfinite``."""
        bad = ~torch.isfinite(out).reshape(out.shape[0], -1).all(-1)
        count = int(bad.sum())
        if not count:
            return None
        self._nonfinite += count
        return bad

    def _finite_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs`` with each row that is not finite made uniform (the stand-in draw)."""
        bad = self._nonfinite_rows(probs)
        if bad is None:
            return probs
        return torch.where(bad.unsqueeze(-1), torch.ones_like(probs), probs)

    def _finite_actions(self, action: torch.Tensor) -> torch.Tensor:
        """``action`` with each row that is not finite replaced by 0 clipped to the action
        bounds (the stand-in)."""
        bad = self._nonfinite_rows(action)
        if bad is None:
            return action
        stand_in = min(max(0.0, self.info.action_low), self.info.action_high)
        return torch.where(bad.unsqueeze(-1), torch.full_like(action, stand_in), action)

    def _act(self, obs: dict[str, np.ndarray], params: Params) -> np.ndarray:
        n = self.pool.num_rows
        if self.algo == "dqn":
            q = self.policy(**self._obs_tensors(obs))
            self._nonfinite_rows(q)  # argmax still names an action: no stand-in needed
            greedy = q.argmax(-1).numpy()
            explore = self.rng.random(n) < float(params.get("epsilon", 0.0))
            return np.where(explore, self.rng.integers(0, self.info.num_actions, n),
                            greedy).astype(np.int64)
        if params.get("random", False):
            return self.rng.uniform(self.info.action_low, self.info.action_high,
                                    (n, self.info.action_dim)).astype(np.float32)
        action, _ = self.policy(**self._obs_tensors(obs), generator=self.gen)
        return self._finite_actions(action).numpy().astype(np.float32)

    def _rollout_transitions(self, num_steps: int, params: Params) -> Rollout:
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

    def _rollout_ppo(self, num_steps: int) -> Rollout:
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
                action = torch.multinomial(self._finite_probs(dist.probs), 1,
                                           generator=self.gen).squeeze(-1)
            else:
                action = self._finite_actions(_normal_sample(dist, self.gen))
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


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as an interrupt (see :func:`sigterm_interrupts`), so
    a run stops as on Ctrl-C; ``signum`` tells the command line which signal it was."""

    signum = int(signal.SIGTERM)


_SIGTERM_INTERRUPTS = 0  # open sigterm_interrupts() blocks


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """For the duration of the block, SIGTERM raises :class:`Terminated` (a
    ``KeyboardInterrupt``) in the main thread, so the interrupt path runs (the plane closed,
    Ray shut down); :func:`ray_running` installs it again after ``ray.init``, which sets a
    SIGTERM handler of its own. The previous handler is restored at the end. A no-op off the
    main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _SIGTERM_INTERRUPTS
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    _SIGTERM_INTERRUPTS += 1
    try:
        yield
    finally:
        _SIGTERM_INTERRUPTS -= 1
        signal.signal(signal.SIGTERM, previous)


def check_actor_cpus(actors: int, actor_cpus: float, cluster_cpus: float) -> None:
    """Refuse more Ray actors than the cluster's CPUs can place (Ray would wait for them
    forever).

    Raises:
        ConfigError: ``actors x actor_cpus`` exceeds ``cluster_cpus`` (field ``actors``).
    """
    if actors * actor_cpus > cluster_cpus + 1e-9:
        raise ConfigError("actors", f"{actors} Ray actors ask {actor_cpus:g} CPU each, "
                                    f"{actors * actor_cpus:g} in all, but the Ray cluster has "
                                    f"{cluster_cpus:g} CPUs (at most "
                                    f"{int(cluster_cpus / actor_cpus + 1e-9)} actors); pass a "
                                    "smaller --actors")


def require_ray() -> Any:
    """The ``ray`` module (the ``conduit-rl[ray]`` extra), imported.

    Raises:
        ConfigError: Ray is not installed (field ``use_ray``).
    """
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("use_ray", f"Ray is not installed ({exc}); pip install "
                                     "'conduit-rl[ray]', or pass --no-use-ray") from exc
    return ray


@contextmanager
def ray_running(address: str = "", *, enabled: bool = True) -> Iterator[None]:
    """Ray for the duration of the block: a local Ray is started (or ``address`` attached to)
    unless one is running already, and shut down at the end only when started here.

    Args:
        address: Ray cluster address to attach to (empty: start a local Ray).
        enabled: False makes this a no-op (in-process actors).

    Raises:
        ConfigError: Ray is not installed (see :func:`require_ray`).
    """
    if not enabled:
        yield
        return
    ray = require_ray()
    if ray.is_initialized():
        yield
        return
    ray.init(address=address or "local", include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    if _SIGTERM_INTERRUPTS and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)  # ray.init set handlers of its own
    try:
        yield
    finally:
        ray.shutdown()


def cpu_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of ``module``'s ``state_dict``, for broadcasting to the actors."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


@dataclass(eq=False)
class RolloutCall:
    """One rollout asked of one worker of an :class:`ActorGroup`: the handle that
    :meth:`ActorGroup.result` takes.

    Attributes:
        rank: The worker asked.
        num_steps: Lock-steps of the rollout.
        params: Exploration parameters.
        weights: In-process workers: the weights the worker loads first, or None.
        ref: Ray actors: the rollout's result to come.
        out: The rollout, once collected.
    """

    rank: int
    num_steps: int
    params: Params | None
    weights: dict[str, torch.Tensor] | None = None
    ref: ObjectRef | None = None
    out: Rollout | None = None


class ActorGroup:
    """Several :class:`RolloutWorker` s, as Ray actors or in-process; a context manager that
    closes them on exit.

    A Ray actor that dies (its process crashed or was killed) is re-created by :meth:`result`:
    the replacement has the same rank and environments, a seed of its own (see
    :class:`RolloutWorker`) and the latest weights sent. It collects again every rollout the
    dead actor did not deliver, in the order they were asked for, so every call still returns
    one rollout of the policy it was asked with. Each re-creation prints one progress line.

    Args:
        num_actors: Workers.
        use_ray: Ray actors (True) or in-process workers (False).
        actor_cpus: Ray CPU resource each actor asks for (fractions let many actors share
            a small machine).
        max_restarts: Re-creations of one worker in a row, with no rollout delivered in
            between, before :meth:`result` gives up and raises.
        label: Prefix of the progress line.
        **worker_kw: Passed to :class:`RolloutWorker`.

    Attributes:
        rollouts_lost: Rollouts that dead actors did not deliver (each collected again).
        actors_restarted: Ray actors re-created after they died.
    """

    def __init__(self, num_actors: int, *, use_ray: bool = True, actor_cpus: float = 0.25,
                 max_restarts: int = 3, label: str = "", **worker_kw: Any) -> None:
        if num_actors < 1:
            raise ValueError(f"num_actors: must be >= 1, got {num_actors}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts: must be >= 0, got {max_restarts}")
        self.use_ray, self.max_restarts, self.label = use_ray, max_restarts, label
        self.rollouts_lost = 0
        self.actors_restarted = 0
        self._worker_kw = worker_kw
        self._restarts = [0] * num_actors  # re-creations of each rank
        self._failed = [0] * num_actors  # deaths of each rank since its last delivered rollout
        self._pending: list[RolloutCall] = []  # Ray calls not collected yet
        self._weights: ObjectRef | None = None  # the latest weights sent to the Ray actors
        if use_ray:
            import ray

            check_actor_cpus(num_actors, actor_cpus, ray.cluster_resources().get("CPU", 0.0))
            self._remote = ray.remote(num_cpus=actor_cpus)(RolloutWorker)
        self.workers: list[RolloutWorker | ActorHandle] = [
            self._start(rank) for rank in range(num_actors)]

    def __len__(self) -> int:
        return len(self.workers)

    def __enter__(self) -> ActorGroup:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _start(self, rank: int) -> RolloutWorker | ActorHandle:
        # A Ray actor has a process of its own: one torch thread there. An in-process worker
        # shares the driver's torch with the learner, whose thread count it must keep.
        kw = {**self._worker_kw, "rank": rank, "restart": self._restarts[rank],
              "single_thread": self.use_ray}
        return self._remote.remote(**kw) if self.use_ray else RolloutWorker(**kw)

    def submit(self, num_steps: int, weights: dict[str, torch.Tensor] | None,
               params: Params | None = None) -> list[RolloutCall]:
        """Start one rollout on every worker, loading ``weights`` first when given; returns
        the calls for :meth:`result`."""
        calls = [RolloutCall(rank, num_steps, params) for rank in range(len(self.workers))]
        if not self.use_ray:
            for call in calls:
                call.weights = weights
            return calls
        import ray

        if weights is not None:
            self._weights = ray.put(weights)
        for call in calls:
            self._send(call, self._weights if weights is not None else None)
        self._pending += calls
        return calls

    def _send(self, call: RolloutCall, weights: ObjectRef | None) -> None:
        actor: ActorHandle = self.workers[call.rank]
        call.ref = actor.rollout.remote(call.num_steps, weights, call.params)

    def result(self, call: RolloutCall) -> Rollout:
        """Wait for one rollout (in-process workers run it now), re-creating its Ray actor
        as often as it dies.

        Raises:
            RuntimeError: The worker died more than ``max_restarts`` times in a row.
            ray.exceptions.RayActorError: The worker's constructor failed.
            Whatever the rollout raised.
        """
        if not self.use_ray:
            worker: RolloutWorker = self.workers[call.rank]
            return worker.rollout(call.num_steps, call.weights, call.params)
        import ray

        while call.out is None:
            try:
                call.out = ray.get(call.ref)
            except ray.exceptions.RayActorError as exc:
                if exc.actor_init_failed:
                    raise  # the worker cannot be built: a replacement would fail alike
                self._replace(call.rank, exc)
        self._pending.remove(call)
        self._failed[call.rank] = 0
        return call.out

    def _replace(self, rank: int, exc: Exception) -> None:
        """Re-create the worker of ``rank``, which died (``exc``), and send it again every
        call the dead one did not deliver, the latest weights with the first."""
        import ray

        ray.kill(self.workers[rank])  # also stops an actor that is unreachable, not dead
        lost: list[RolloutCall] = []
        for call in self._pending:
            if call.rank != rank or call.out is not None:
                continue
            try:
                call.out = ray.get(call.ref)  # delivered before the actor died
            except ray.exceptions.RayActorError:
                lost.append(call)
            except ray.exceptions.RayTaskError:
                pass  # the rollout itself failed: result() raises it for that call
        self._failed[rank] += 1
        if self._failed[rank] > self.max_restarts:
            raise RuntimeError(f"rollout actor {rank}: died {self._failed[rank]} times in a "
                               f"row without delivering a rollout (max_restarts="
                               f"{self.max_restarts})") from exc
        self._restarts[rank] += 1
        self.workers[rank] = self._start(rank)
        self.actors_restarted += 1
        self.rollouts_lost += len(lost)
        for i, call in enumerate(lost):
            self._send(call, self._weights if i == 0 else None)
        print(f"{self.label}rollout actor {rank} died ({type(exc).__name__}); re-created it, "
              f"collecting its {len(lost)} lost rollout(s) again "
              f"({self.actors_restarted} restarted, {self.rollouts_lost} lost in this run)",
              flush=True)

    def close(self) -> None:
        """Stop the workers."""
        if self.use_ray:
            import ray

            for actor in self.workers:
                ray.kill(actor)
        else:
            for worker in self.workers:
                worker.close()
        self.workers = []
        self._pending = []


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
          ActorGroup(args.actors, use_ray=args.use_ray, label=f"[{algo} {args.buffer}] ",
                     algo=algo, env_id=args.env, info=info, num_envs=args.envs_per_actor,
                     seed=args.seed, **worker_kw) as group):
        yield group
