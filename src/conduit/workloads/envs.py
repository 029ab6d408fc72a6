"""Environments of the reference workloads, and the pool of copies an actor steps.

* :class:`ImagePayload` attaches a ``size×size×3`` uint8 image to every observation. The image is
  drawn from the environment's state with a few array fills, so the environment does not dominate
  the iteration. These workloads are **payload-size stand-ins** for Meta-World (128×128×3 ≈ 48 KB
  per observation) and Open X-Embodiment (256×256×3 ≈ 192 KB): they reproduce the bytes that
  cross the experience path, not the visual task.
* :class:`MultiAgentCartPole` stacks several independent CartPoles as agents, the way RLlib's
  ``MultiAgentCartPole`` example builds them: each agent acts in its own CartPole, an agent that
  is done stays done, and the episode ends when every agent is done.
* :class:`EnvPool` steps ``num_envs`` copies in lock-step with same-step auto-reset (like
  Gymnasium's ``SyncVectorEnv`` with ``AutoresetMode.SAME_STEP``) and flattens agents into rows,
  so actors see one row per (env, agent).

Observations are dicts: ``{"obs": float32 state vector}`` plus ``{"pixels": uint8 HxWx3}`` when
an image payload is attached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from conduit.errors import ConfigError

MULTI_AGENT_CARTPOLE = "MultiAgentCartPole"
METAWORLD_PREFIX = "metaworld/"


class ImagePayload(gym.ObservationWrapper):
    """Attach a ``size×size×3`` uint8 image, derived cheaply from the state, to each observation.

    A payload-size stand-in: a fixed background plus one bar per state dimension whose position
    follows that dimension (squashed by ``tanh``). It costs a copy and a few slice fills, and is
    a deterministic function of the state, so a convolutional encoder can learn from it.

    Args:
        env: An environment with a flat ``Box`` observation.
        size: Image side in pixels (128 -> 48 KB, 256 -> 192 KB per observation).
    """

    def __init__(self, env: gym.Env, size: int = 128) -> None:
        super().__init__(env)
        if size < 8:
            raise ValueError(f"size: must be at least 8 pixels, got {size}")
        self.size = int(size)
        state_space = env.observation_space
        if not isinstance(state_space, gym.spaces.Box):
            raise ValueError("ImagePayload needs a Box observation space")
        self.observation_space = gym.spaces.Dict({
            "obs": state_space,
            "pixels": gym.spaces.Box(0, 255, (self.size, self.size, 3), np.uint8)})
        yy, xx = np.mgrid[0:self.size, 0:self.size]
        self._background = np.stack(
            [(xx * 255 // self.size), (yy * 255 // self.size), np.full_like(xx, 32)],
            axis=-1).astype(np.uint8)
        self._dims = int(np.prod(state_space.shape))
        self._band = max(1, self.size // max(1, self._dims))
        self._bar = max(2, self.size // 32)

    def observation(self, observation: Any) -> dict[str, np.ndarray]:
        state = np.asarray(observation, dtype=np.float32).reshape(-1)
        img = self._background.copy()
        pos = ((np.tanh(state) + 1.0) * 0.5 * (self.size - self._bar)).astype(np.int64)
        for i, p in enumerate(pos[: self.size // self._band]):
            rows = slice(i * self._band, (i + 1) * self._band)
            img[rows, p:p + self._bar, :] = 255
        return {"obs": state.reshape(self.env.observation_space.shape), "pixels": img}


class MultiAgentCartPole:
    """Several independent CartPoles acting as agents (RLlib's ``MultiAgentCartPole`` layout).

    Observations, rewards and flags are arrays with a leading agent dimension. An agent that is
    done stays done (its ``active`` flag is False) until every agent is done, which ends the
    episode.

    Args:
        num_agents: Number of CartPoles.
    """

    def __init__(self, num_agents: int = 4) -> None:
        if num_agents < 1:
            raise ValueError(f"num_agents: must be >= 1, got {num_agents}")
        self.num_agents = num_agents
        self.envs = [gym.make("CartPole-v1") for _ in range(num_agents)]
        self.observation_space = self.envs[0].observation_space
        self.action_space = self.envs[0].action_space
        self.active = np.ones(num_agents, dtype=bool)
        self._last = np.zeros((num_agents, *self.observation_space.shape), np.float32)

    def reset(self, *, seed: int | None = None) -> tuple[np.ndarray, dict]:
        obs = []
        for i, env in enumerate(self.envs):
            o, _ = env.reset(seed=None if seed is None else seed + i)
            obs.append(o)
        self.active[:] = True
        self._last = np.stack(obs).astype(np.float32)
        return self._last.copy(), {}

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                 np.ndarray, dict]:
        n = self.num_agents
        rew = np.zeros(n, np.float32)
        term = np.zeros(n, bool)
        trunc = np.zeros(n, bool)
        was_active = self.active.copy()
        for i, env in enumerate(self.envs):
            if not self.active[i]:
                continue
            o, r, te, tr, _ = env.step(int(actions[i]))
            self._last[i] = o
            rew[i], term[i], trunc[i] = r, te, tr
            if te or tr:
                self.active[i] = False
        return self._last.copy(), rew, term, trunc, {"active": was_active,
                                                      "all_done": not self.active.any()}

    def close(self) -> None:
        for env in self.envs:
            env.close()


def _make_metaworld(task: str) -> gym.Env:
    try:
        import metaworld  # noqa: F401  - registers the Meta-World/* ids
    except ImportError as exc:
        raise ImportError("Meta-World workloads need the optional extra: "
                          "pip install 'metaworld==3.1.1' 'mujoco==3.3.0'") from exc
    return gym.make("Meta-World/MT1", env_name=task, disable_env_checker=True)


def make_env(env_id: str, *, image_size: int = 0, num_agents: int = 4) -> Any:
    """Build one environment.

    Args:
        env_id: A Gymnasium id (``CartPole-v1``, ``MountainCar-v0``, ``Pendulum-v1``...),
            ``MultiAgentCartPole``, or ``metaworld/<task>`` (e.g. ``metaworld/reach-v3``,
            needs the optional ``metaworld`` extra).
        image_size: 0 for state observations; otherwise attach an :class:`ImagePayload`.
        num_agents: Agents of ``MultiAgentCartPole``.

    Raises:
        ConfigError: Gymnasium cannot make ``env_id`` (field ``env``), or ``image_size`` is
            set for ``MultiAgentCartPole`` (field ``image_size``).
    """
    if env_id == MULTI_AGENT_CARTPOLE:
        if image_size:
            raise ConfigError("image_size", "image payloads are not supported on "
                                            "MultiAgentCartPole; pass --image-size 0")
        return MultiAgentCartPole(num_agents)
    if env_id.startswith(METAWORLD_PREFIX):
        env = _make_metaworld(env_id[len(METAWORLD_PREFIX):])
    else:
        try:
            env = gym.make(env_id)
        except gym.error.Error as exc:
            raise ConfigError("env", f"cannot make {env_id!r} ({exc}); pass a registered "
                                     f"Gymnasium id such as CartPole-v1, "
                                     f"{MULTI_AGENT_CARTPOLE} or {METAWORLD_PREFIX}<task>"
                              ) from exc
    return ImagePayload(env, image_size) if image_size else env


@dataclass(frozen=True)
class EnvInfo:
    """What networks and specs need to know about an environment.

    Attributes:
        obs_dim: Length of the state vector.
        image_size: Side of the attached image (0 when none).
        discrete: True for discrete actions.
        num_actions: Discrete actions (0 for continuous).
        action_dim: Continuous action dimensions (0 for discrete).
        action_low: Lower bound of continuous actions.
        action_high: Upper bound of continuous actions.
        agents: Rows one env contributes per step (1 unless multi-agent).
    """

    obs_dim: int
    image_size: int
    discrete: bool
    num_actions: int
    action_dim: int
    action_low: float
    action_high: float
    agents: int


FLAT_OBSERVATIONS = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete,
                     gym.spaces.MultiBinary)
"""Observation spaces the workloads take: each observation is one array, read as a flat state
vector (an image payload also needs a ``Box``)."""


def env_info(env_id: str, *, image_size: int = 0, num_agents: int = 4) -> EnvInfo:
    """Probe an environment's spaces without keeping it.

    Args:
        env_id: See :func:`make_env`.
        image_size: The image payload side the run will attach (0: none).
        num_agents: See :func:`make_env`.

    Raises:
        ConfigError: Gymnasium cannot make ``env_id``, or its observation is not one array
            (a ``Tuple`` or ``Dict`` space; field ``env``); ``image_size`` is set for
            ``MultiAgentCartPole`` or for an observation that is not a ``Box`` (field
            ``image_size``).
    """
    if env_id == MULTI_AGENT_CARTPOLE and image_size:
        raise ConfigError("image_size", "image payloads are not supported on "
                                        "MultiAgentCartPole; pass --image-size 0")
    env = make_env(env_id, image_size=0, num_agents=num_agents)
    try:
        obs_space, act_space = env.observation_space, env.action_space
        if not isinstance(obs_space, FLAT_OBSERVATIONS):
            raise ConfigError("env", f"{env_id} observes {obs_space}, not one array; pass an "
                                     "environment whose observation space is a Box or "
                                     "Discrete, such as CartPole-v1")
        if image_size and not isinstance(obs_space, gym.spaces.Box):
            raise ConfigError("image_size", f"the image payload is drawn from a Box "
                                            f"observation; {env_id} observes {obs_space}; "
                                            "pass --image-size 0")
        agents = env.num_agents if isinstance(env, MultiAgentCartPole) else 1
        obs_dim = int(np.prod(obs_space.shape))
        if isinstance(act_space, gym.spaces.Discrete):
            return EnvInfo(obs_dim, image_size, True, int(act_space.n), 0, 0.0, 0.0, agents)
        low, high = float(np.min(act_space.low)), float(np.max(act_space.high))
        return EnvInfo(obs_dim, image_size, False, 0, int(np.prod(act_space.shape)),
                       low, high, agents)
    finally:
        env.close()


@dataclass
class StepResult:
    """One lock-step of the pool; arrays have one row per (env, agent).

    Attributes:
        next_obs: Observation after the step (the final one where the episode ended).
        reward: Reward of the step.
        terminated: True where the MDP ended (no bootstrap).
        truncated: True where a time limit cut the episode.
        active: False for rows of agents that were already done before this step.
        episode_returns: Returns of the episodes that finished in this step (per env).
        episode_lengths: Lengths of the episodes that finished in this step.
    """

    next_obs: dict[str, np.ndarray]
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    active: np.ndarray
    episode_returns: list[float]
    episode_lengths: list[int]


class EnvPool:
    """``num_envs`` copies of one environment stepped in lock-step, auto-resetting in the step.

    Args:
        env_id: See :func:`make_env`.
        num_envs: Copies.
        seed: Seed of the first copy; copy ``i`` uses ``seed + 1000 * i``.
        image_size: See :func:`make_env`.
        num_agents: See :func:`make_env`.
    """

    def __init__(self, env_id: str, *, num_envs: int, seed: int, image_size: int = 0,
                 num_agents: int = 4) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs: must be >= 1, got {num_envs}")
        self.envs = [make_env(env_id, image_size=image_size, num_agents=num_agents)
                     for _ in range(num_envs)]
        self.multi_agent = isinstance(self.envs[0], MultiAgentCartPole)
        self.agents = self.envs[0].num_agents if self.multi_agent else 1
        self.num_rows = num_envs * self.agents
        self._seed = seed
        self._ep_return = np.zeros(num_envs)
        self._ep_len = np.zeros(num_envs, dtype=np.int64)
        self.obs = self._stack([self._reset(i, seed + 1000 * i) for i in range(num_envs)])

    def _reset(self, i: int, seed: int | None) -> dict[str, np.ndarray]:
        o, _ = self.envs[i].reset(seed=seed)
        return _as_dict(o)

    def _stack(self, per_env: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        out = {}
        for k in per_env[0]:
            arr = np.stack([d[k] for d in per_env])
            if self.multi_agent:  # (envs, agents, ...) -> (envs*agents, ...)
                arr = arr.reshape(-1, *arr.shape[2:])
            elif k == "obs":
                arr = arr.reshape(arr.shape[0], -1)
            out[k] = arr.astype(np.float32) if k == "obs" else arr
        return out

    def step(self, actions: np.ndarray) -> StepResult:
        """Step every copy with its row(s) of ``actions`` and reset finished episodes."""
        n = len(self.envs)
        acts = np.asarray(actions).reshape(n, self.agents, *np.asarray(actions).shape[1:])
        finals, nexts, rets, lens = [], [], [], []
        rew = np.zeros((n, self.agents), np.float32)
        term = np.zeros((n, self.agents), bool)
        trunc = np.zeros((n, self.agents), bool)
        active = np.ones((n, self.agents), bool)
        for i, env in enumerate(self.envs):
            if self.multi_agent:
                o, r, te, tr, info = env.step(acts[i])
                active[i] = info["active"]
                ended = info["all_done"]
                self._ep_return[i] += float(r.sum())
            else:
                a = acts[i, 0]
                o, r, te, tr, _ = env.step(a.item() if a.ndim == 0 else a)
                ended = te or tr
                self._ep_return[i] += float(r)
            rew[i], term[i], trunc[i] = r, te, tr
            self._ep_len[i] += 1
            final = _as_dict(o)
            finals.append(final)
            if ended:
                rets.append(float(self._ep_return[i]))
                lens.append(int(self._ep_len[i]))
                self._ep_return[i] = 0.0
                self._ep_len[i] = 0
                nexts.append(self._reset(i, None))
            else:
                nexts.append(final)
        next_obs = self._stack(finals)
        self.obs = self._stack(nexts)
        return StepResult(next_obs, rew.reshape(-1), term.reshape(-1), trunc.reshape(-1),
                          active.reshape(-1), rets, lens)

    def close(self) -> None:
        """Close every copy."""
        for env in self.envs:
            env.close()


def _as_dict(o: Any) -> dict[str, np.ndarray]:
    if isinstance(o, dict):
        return {k: np.asarray(v) for k, v in o.items()}
    return {"obs": np.asarray(o, dtype=np.float32)}
