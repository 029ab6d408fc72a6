"""``conduit bench rllib``: RLlib alone against RLlib + Conduit, side by side in one run.

For DQN, SAC and PPO, on CartPole and on its heavy-payload variant (the 128×128×3 image of
``conduit bench workloads``, as float32 in [0, 1] since RLlib's CNN encoders take float input:
≈ 192 KB per observation; registered with RLlib's tune registry as ``conduit-CartPole-img128``),
the same RLlib config is built twice per seed: with RLlib's own experience path, and with
Conduit's (DQN and SAC: the ``replay_buffer_config`` type
``conduit.integrations.rllib.ConduitPrioritizedEpisodeReplayBuffer``; PPO:
``learner_class=ConduitPPOTorchLearner``). Both are built at once and interleaved, one
training iteration each per round, the order alternating between rounds (RLlib first in the
first round on even seeds, Conduit on odd ones), on local env runners and a local learner, so
that the host's drift during a run falls on both alike; the end-to-end ratio is the median
over rounds of Conduit's iteration time over RLlib's in the same round. Per iteration it
records

* the wall time of ``Algorithm.train()`` (the first iteration is a warm-up, not counted);
* DQN, SAC: the time inside the replay buffer, measured by wrapping the buffer instance's
  ``add``, ``sample`` and ``update_priorities`` (RLlib's own buffer timers are exponential
  moving averages, not per-call times); with prefetch it is the time the training step waited,
  not the time the delivery worker spent;
* PPO: the time to produce the learner's mini-batches (each ``next()`` of the iterator
  ``Learner._create_iterator_if_necessary`` returns, wrapped on the learner instance);
* the last mean episode return RLlib reported (of the latest iteration that completed an
  episode), per seed. The two Algorithms share the process's global random generators, so a
  run's returns differ from those of the same seed run alone; they are compared across seeds.

The ``-full`` rows (DQN and SAC on CartPole; DQN also with 10^6 timesteps) first fill both
replay buffers to capacity with the same random-policy episodes: the state a long run spends
nearly all its time in, where every few adds evict an episode. Before the measured rounds the
objects that exist (both Algorithms, the fill) are frozen out of garbage collection, so that a
full collection over them does not land inside either variant's calls.

A standalone microbenchmark (no Algorithm) fills RLlib's ``EpisodeReplayBuffer`` and
``PrioritizedEpisodeReplayBuffer`` and Conduit's two buffers to capacity with CartPole-sized
episodes (4 float32 observations) and times ``add`` (two 100-step episodes, evicting once
full), ``sample`` (32 transitions, n_step 3) and ``update_priorities`` at each capacity,
alternating the buffers; Conduit's buffers run ``schedule="inline"`` there (nothing to overlap).

    conduit bench rllib                       # full run (about 15 minutes on 2 cores)
    conduit bench rllib --quick               # a smoke run (about a minute)
    conduit bench rllib --only DQN-CP PPO-img128 --seeds 1
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from conduit.bench.common import PartialJSON, apply_quick, parse_quick, progress
from conduit.cli_args import arg, command_parser
from conduit.errors import ConfigError
from conduit.report import pyplot, save_figure, table, write_json
from conduit.workloads.envs import ImagePayload

HEAVY_ENV = "conduit-CartPole-img128"
PREFIX = "conduit.integrations.rllib."
VARIANTS = ("rllib", "conduit")
#: Length of the microbenchmark's episodes: its capacities are multiples of it.
EPISODE_STEPS = 100
#: The smallest microbenchmark capacity: the two episodes each timed ``add`` inserts.
MIN_CAPACITY = 2 * EPISODE_STEPS


@dataclass(frozen=True)
class Workload:
    """One row of the table: an algorithm on an environment, and its run lengths.

    Attributes:
        full: Fill the replay buffer to capacity before the warm-up iteration (DQN, SAC on
            CartPole): the state a long run spends nearly all its time in, where adds evict.
        capacity: Timesteps the replay buffer holds (0: 50 000 on CartPole, 2000 on the
            image env).
    """

    name: str
    algo: str
    heavy: bool
    iters: int
    full: bool = False
    capacity: int = 0


def workloads() -> list[Workload]:
    """DQN, SAC and PPO on CartPole and on the 128 px image variant, with the measured
    iterations per run: about 10 s of training per run, and at least 6 iterations, so that
    one slow iteration does not make a seed's median; and DQN and SAC on CartPole again with
    the replay buffer full, DQN also with a full buffer of 10^6 timesteps (the size of the
    Atari DQN setups)."""
    return [Workload("DQN-CP", "dqn", False, 6), Workload("DQN-img128", "dqn", True, 10),
            Workload("SAC-CP", "sac", False, 6), Workload("SAC-img128", "sac", True, 8),
            Workload("PPO-CP", "ppo", False, 6), Workload("PPO-img128", "ppo", True, 8),
            Workload("DQN-CP-full", "dqn", False, 6, full=True),
            Workload("SAC-CP-full", "sac", False, 6, full=True),
            Workload("DQN-CP-1M-full", "dqn", False, 6, full=True, capacity=1_000_000)]


#: What ``--quick`` runs unless ``--only`` says otherwise.
QUICK = ("DQN-CP", "SAC-CP", "PPO-CP")

#: The values of ``--schedule`` (``replay_buffer_config['schedule']``).
SCHEDULES = ("auto", "inline", "prefetch")


@dataclass(frozen=True)
class RllibBenchArgs:
    """Arguments of ``conduit bench rllib``."""

    quick: bool = arg(False, "a smoke run: 1 seed, 1 measured iteration of small size, replay "
                             "buffers of 2000 timesteps, the CartPole workloads, capacities "
                             "1e3 and 1e4, 3 repeats (flags given explicitly win)")
    seeds: int = arg(3, "seeds per workload and variant (returns are compared across them)", min=1)
    iters: int = arg(0, "measured training iterations per run (0: per-workload defaults)")
    only: tuple[str, ...] = arg((), "run only these workloads (names as in the table)",
                                choices=[w.name for w in workloads()])
    schedule: str = arg("auto", "replay_buffer_config['schedule'] of Conduit's buffers",
                        choices=SCHEDULES)
    capacities: tuple[int, ...] = arg((10_000, 1_000_000), "microbenchmark capacities (rows): "
                                      "multiples of 100, the length of its episodes (RLlib's "
                                      "buffers evict whole episodes), and at least 200",
                                      min=MIN_CAPACITY)
    repeats: int = arg(30, "microbenchmark calls per buffer and capacity", min=1)
    num_cpus: int = arg(2, "CPUs of the local Ray it starts (unless Ray is already up)", min=1)
    out: str = arg("runs/bench/rllib", "folder for rllib.json and rllib.png", output="dir")


#: What ``--quick`` gives the flags left at their defaults (besides :data:`QUICK`'s workloads
#: and one measured iteration of small size).
QUICK_ARGS = {"seeds": 1, "capacities": (1_000, 10_000), "repeats": 3}


class PixelObservation(gym.ObservationWrapper):
    """Only the image of an :class:`~conduit.workloads.envs.ImagePayload` observation, as
    float32 in ``[0, 1]``: RLlib's default models take a ``Box``, not a ``Dict``, and its CNN
    encoders take float input (as its Atari wrappers give them)."""

    def __init__(self, env: ImagePayload) -> None:
        super().__init__(env)
        self.observation_space = gym.spaces.Box(0.0, 1.0, env.observation_space["pixels"].shape,
                                                np.float32)

    def observation(self, observation: dict[str, np.ndarray]) -> np.ndarray:
        return observation["pixels"].astype(np.float32) * np.float32(1 / 255)


def register_envs() -> None:
    """Register :data:`HEAVY_ENV` with RLlib's tune registry."""
    from ray.tune.registry import register_env

    register_env(HEAVY_ENV, lambda _: PixelObservation(ImagePayload(gym.make("CartPole-v1"),
                                                                    128)))


def build_config(w: Workload, variant: str, *, seed: int, quick: bool, schedule: str) -> Any:
    """The RLlib config of ``w``; ``variant`` ``"conduit"`` differs by one line."""
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.algorithms.sac import SACConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    from conduit.integrations.rllib import ConduitPPOTorchLearner, ConduitSACConfig

    conduit = variant == "conduit"
    model = (DefaultModelConfig(conv_filters=[[16, [8, 8], 8], [32, [4, 4], 4],
                                              [64, [4, 4], 4]], head_fcnet_hiddens=[64])
             if w.heavy else DefaultModelConfig(fcnet_hiddens=[64, 64]))
    env = HEAVY_ENV if w.heavy else "CartPole-v1"
    if w.algo == "ppo":
        config = PPOConfig().training(
            train_batch_size_per_learner=128 if quick else (256 if w.heavy else 1000),
            minibatch_size=32 if quick else (64 if w.heavy else 128),
            num_epochs=2 if quick or w.heavy else 6)
        if conduit:
            config = config.learners(learner_class=ConduitPPOTorchLearner)
        steps = 0
    else:
        kind = "PrioritizedEpisodeReplayBuffer"
        buffer: dict[str, Any] = {"type": PREFIX + "Conduit" + kind if conduit else kind,
                                  "capacity": replay_capacity(w, quick=quick),
                                  "alpha": 0.6, "beta": 0.4}
        if conduit:
            buffer["schedule"] = schedule
        steps = 32 if quick else (64 if w.heavy else 256)
        if w.algo == "dqn":
            config = DQNConfig().training(n_step=3)
        else:
            config = ConduitSACConfig() if conduit else SACConfig()
        config = config.training(replay_buffer_config=buffer, train_batch_size_per_learner=32,
                                 num_steps_sampled_before_learning_starts=steps)
        config = config.env_runners(rollout_fragment_length=4)
    return (config.environment(env).env_runners(num_env_runners=0)
            .rl_module(model_config=model)
            .reporting(min_time_s_per_iteration=0,
                       min_sample_timesteps_per_iteration=max(steps, 1))
            .debugging(seed=seed, log_level="ERROR"))


def replay_capacity(w: Workload, *, quick: bool) -> int:
    """Timesteps the replay buffer of ``w`` (DQN or SAC) holds (2000 in a smoke run)."""
    if quick:
        return 2_000
    return w.capacity or (2_000 if w.heavy else 50_000)


def random_episodes(steps: int, seed: int) -> list[Any]:
    """CartPole episodes of a uniformly random policy, ``steps`` timesteps or a few more in
    all, as RLlib's env runners hand them to a replay buffer (numpy-ized, no lookback; int32
    actions and float64 rewards, as its torch modules and CartPole give them).

    Raises:
        ConfigError: ``steps`` is not a positive integer.
    """
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError("steps", f"must be a positive integer, got {steps!r}")
    env, rng = gym.make("CartPole-v1"), np.random.default_rng(seed)
    out, total = [], 0
    while total < steps:
        obs, _ = env.reset(seed=int(rng.integers(1 << 31)))
        observations, actions, rewards = [obs], [], []
        terminated = truncated = False
        while not (terminated or truncated):
            actions.append(int(rng.integers(2)))
            obs, reward, terminated, truncated, _ = env.step(actions[-1])
            observations.append(obs)
            rewards.append(float(reward))
        out.append(SingleAgentEpisode(
            observations=observations, actions=list(np.asarray(actions, np.int32)),
            rewards=rewards, terminated=terminated,
            truncated=truncated, observation_space=env.observation_space,
            action_space=env.action_space, len_lookback_buffer=0).to_numpy())
        total += len(actions)
    env.close()
    return out


def fill(buffer: Any, episodes: list[Any], chunk: int = 10) -> None:
    """Add ``episodes`` to ``buffer``, ``chunk`` at a time (as several env runner reports;
    RLlib's prioritized buffer fails on an add of more timesteps than its capacity)."""
    for k in range(0, len(episodes), chunk):
        buffer.add(episodes[k:k + chunk])


class CallTimer:
    """Wraps methods of one object (on the instance, not its class) and sums their time."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, obj: Any, name: str) -> None:
        """Time every call of ``obj.name``."""
        inner = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(obj, name, timed)

    def wrap_iterator_factory(self, obj: Any, name: str) -> None:
        """Time every ``next()`` of the iterables ``obj.name(...)`` returns."""
        inner = getattr(obj, name)

        def timed_iterable(*args: Any, **kwargs: Any) -> Iterator[Any]:
            t0 = time.perf_counter()
            made = inner(*args, **kwargs)
            self.seconds += time.perf_counter() - t0
            return self._timed(iter(made))

        setattr(obj, name, timed_iterable)

    def _timed(self, it: Iterator[Any]) -> Iterator[Any]:
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                self.seconds += time.perf_counter() - t0
                return
            self.seconds += time.perf_counter() - t0
            yield item

    def take(self) -> float:
        """The time summed since the last call."""
        s, self.seconds = self.seconds, 0.0
        return s


class AlgorithmRun:
    """One variant of one workload and seed: its Algorithm, the timer around its experience
    path, and a record per measured iteration."""

    def __init__(self, w: Workload, variant: str, *, seed: int, quick: bool,
                 schedule: str, filled: list[Any] | None = None) -> None:
        self.w, self.variant = w, variant
        self.algo = build_config(w, variant, seed=seed, quick=quick,
                                 schedule=schedule).build_algo()
        if filled:  # before any timing: the run starts with a full buffer
            fill(self.algo.local_replay_buffer, filled)
        self.timer = CallTimer()
        self.records: list[dict[str, float]] = []
        self.last_return = math.nan
        self._iteration = 0
        if w.algo == "ppo":
            self.timer.wrap_iterator_factory(self.algo.learner_group._learner,
                                             "_create_iterator_if_necessary")

    def train(self) -> float:
        """One ``Algorithm.train()``; the first is a warm-up and is not recorded. Returns its
        wall time in seconds."""
        if self._iteration == 1 and self.w.algo != "ppo":  # the buffer exists by now
            buf = self.algo.local_replay_buffer
            for name in ("add", "sample", "update_priorities"):
                self.timer.wrap(buf, name)
        self.timer.take()
        t0 = time.perf_counter()
        result = self.algo.train()
        wall = time.perf_counter() - t0
        ret = float(result["env_runners"].get("episode_return_mean", math.nan))
        if math.isfinite(ret):  # (NaN in an iteration that completed no episode)
            self.last_return = ret
        if self._iteration:
            self.records.append({"iter_s": wall, "path_s": self.timer.take()})
        self._iteration += 1
        return wall

    def summary(self) -> dict[str, Any]:
        """The records, the last mean episode return RLlib reported (from the latest
        iteration that completed an episode), the timesteps the replay buffer holds (DQN,
        SAC) and, for Conduit's buffers, the schedule they ran."""
        out: dict[str, Any] = {"records": self.records, "return": self.last_return}
        if self.w.algo != "ppo":
            buf = self.algo.local_replay_buffer
            out["buffer_timesteps"] = buf.get_num_timesteps()
            if self.variant == "conduit":
                out["schedule"] = buf.plane.schedule.label()
                out["discarded_batches"] = buf.discarded_batches
        return out

    def stop(self) -> None:
        """Stop the Algorithm (its env runners, learner and buffer)."""
        self.algo.stop()


def run_pair(w: Workload, *, seed: int, iters: int, quick: bool,
             schedule: str) -> dict[str, dict[str, Any]]:
    """Both variants of ``w`` for one seed, interleaved: one warm-up iteration each, then
    ``iters`` rounds of one iteration each, the order alternating between rounds, so that the
    host's drift falls on both alike. Each variant's summary carries ``paired`` (this
    variant's iteration time over the other's, per round) besides its records. With
    ``w.full`` both buffers are first given the same random-policy episodes, up to capacity.
    The objects that exist when the rounds start are frozen out of garbage collection
    (``gc.freeze``) until they end."""
    order = VARIANTS if seed % 2 == 0 else VARIANTS[::-1]
    filled = random_episodes(replay_capacity(w, quick=quick), seed) if w.full else None
    runs: dict[str, AlgorithmRun] = {}
    try:
        for variant in order:
            runs[variant] = AlgorithmRun(w, variant, seed=seed, quick=quick, schedule=schedule,
                                         filled=filled)
        del filled
        # The objects built so far (both Algorithms, the fill) are left out of the collector's
        # later passes: otherwise a full pass over them lands inside either variant's calls.
        gc.collect()
        gc.freeze()
        for i in range(iters + 1):
            for variant in (order if i % 2 == 0 else order[::-1]):
                runs[variant].train()
        out = {v: r.summary() for v, r in runs.items()}
    finally:
        gc.unfreeze()
        for r in runs.values():
            r.stop()
    walls = {v: [rec["iter_s"] for rec in out[v]["records"]] for v in VARIANTS}
    for v, other in zip(VARIANTS, VARIANTS[::-1]):
        out[v]["paired"] = [a / b for a, b in zip(walls[v], walls[other])]
    return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over every measured iteration of ``runs`` (one run per seed); ``paired`` is
    the median of the per-round ratios :func:`run_pair` recorded."""
    recs = [r for run in runs for r in run["records"]]
    returns = [run["return"] for run in runs]
    finite = [x for x in returns if math.isfinite(x)]
    return {"iterations": len(recs), "iter_s": _median([r["iter_s"] for r in recs]),
            "path_s": _median([r["path_s"] for r in recs]),
            "path_share": _median([r["path_s"] / r["iter_s"] for r in recs]),
            "returns": returns, "return_mean": statistics.fmean(finite) if finite else math.nan,
            "return_std": statistics.stdev(finite) if len(finite) > 1 else math.nan,
            "paired": _median([x for run in runs for x in run.get("paired", [])]),
            "schedules": [run.get("schedule") for run in runs if run.get("schedule")]}


def within_noise(a: dict[str, Any], b: dict[str, Any]) -> bool | None:
    """Whether two variants' mean returns differ by less than twice their standard error
    (None with fewer than two seeds each)."""
    n_a, n_b = len(a["returns"]), len(b["returns"])
    if n_a < 2 or n_b < 2 or not math.isfinite(a["return_std"] + b["return_std"]):
        return None
    se = math.sqrt(a["return_std"] ** 2 / n_a + b["return_std"] ** 2 / n_b)
    return abs(a["return_mean"] - b["return_mean"]) <= 2 * se


# -- microbenchmark ----------------------------------------------------------------------------


_BOX, _DISCRETE = gym.spaces.Box(-5, 5, (4,), np.float32), gym.spaces.Discrete(2)


def _episodes(rng: np.random.Generator, count: int, length: int = 100) -> list[Any]:
    """``count`` terminated CartPole-sized episodes; they share their spaces, as the episodes
    of one env runner do."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    box, disc = _BOX, _DISCRETE
    out = []
    for _ in range(count):
        obs = rng.standard_normal((length + 1, 4), dtype=np.float32)
        eps = SingleAgentEpisode(observations=list(obs), actions=list(rng.integers(2, size=length)),
                                 rewards=list(np.ones(length, np.float32)), terminated=True,
                                 observation_space=box, action_space=disc, len_lookback_buffer=0)
        out.append(eps.to_numpy())
    return out


def check_capacity(capacity: int) -> int:
    """``capacity`` if the microbenchmark can fill a buffer of that many rows: a multiple of
    :data:`EPISODE_STEPS` (RLlib's buffers evict whole episodes, so they never hold more than
    the largest multiple) and at least :data:`MIN_CAPACITY` (below it RLlib's prioritized
    buffer fails in the timed ``add``).

    Raises:
        ConfigError: It is not (field ``capacities``).
    """
    if (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < MIN_CAPACITY
            or capacity % EPISODE_STEPS):
        raise ConfigError("capacities", f"each must be a multiple of {EPISODE_STEPS} (the "
                                        f"microbenchmark's episode length) and at least "
                                        f"{MIN_CAPACITY}, got {capacity!r}")
    return capacity


def micro_buffers(capacity: int) -> dict[str, Any]:
    """RLlib's and Conduit's uniform and prioritized buffers of ``capacity`` rows."""
    from ray.rllib.utils.replay_buffers import EpisodeReplayBuffer, PrioritizedEpisodeReplayBuffer

    from conduit.integrations.rllib import (
        ConduitEpisodeReplayBuffer,
        ConduitPrioritizedEpisodeReplayBuffer,
    )

    return {"rllib-uniform": EpisodeReplayBuffer(capacity=capacity),
            "conduit-uniform": ConduitEpisodeReplayBuffer(capacity=capacity, seed=0,
                                                          schedule="inline"),
            "rllib-prioritized": PrioritizedEpisodeReplayBuffer(capacity=capacity, alpha=0.6),
            "conduit-prioritized": ConduitPrioritizedEpisodeReplayBuffer(
                capacity=capacity, alpha=0.6, beta=0.4, seed=0, schedule="inline")}


def microbench(capacity: int, repeats: int) -> dict[str, dict[str, float]]:
    """Fill each buffer to ``capacity`` rows, then time ``add``, ``sample`` and
    ``update_priorities`` ``repeats`` times, alternating the buffers; medians in ms.

    Raises:
        ConfigError: ``capacity`` is refused by :func:`check_capacity`.
    """
    check_capacity(capacity)
    rng = np.random.default_rng(capacity)
    buffers = micro_buffers(capacity)
    out: dict[str, dict[str, float]] = {}
    chunk = 100  # episodes per fill call
    for name, buf in buffers.items():
        t0 = time.perf_counter()
        added = 0  # counted here, not read back: a buffer that evicts never loops the fill
        while added < capacity:
            count = min(chunk, math.ceil((capacity - added) / EPISODE_STEPS))
            buf.add(_episodes(rng, count, EPISODE_STEPS))
            added += count * EPISODE_STEPS
        out[name] = {"fill_s": time.perf_counter() - t0}
    times: dict[str, dict[str, list[float]]] = {n: {"add": [], "sample": [], "update": []}
                                                for n in buffers}
    kwargs = {"num_items": 32, "n_step": 3, "gamma": 0.99, "batch_length_T": 0,
              "sample_episodes": True}
    for r in range(repeats):
        order = list(buffers) if r % 2 == 0 else list(reversed(buffers))
        for name in order:
            buf, adds = buffers[name], _episodes(rng, 2)
            t0 = time.perf_counter()
            buf.add(adds)
            t1 = time.perf_counter()
            if "prioritized" in name:
                buf.sample(num_items=32, n_step=3, gamma=0.99, beta=0.4)
            else:
                buf.sample(**kwargs)
            t2 = time.perf_counter()
            times[name]["add"].append(t1 - t0)
            times[name]["sample"].append(t2 - t1)
            if "prioritized" in name:
                td = np.abs(rng.standard_normal(32))
                t3 = time.perf_counter()
                buf.update_priorities(td, "default_policy")
                times[name]["update"].append(time.perf_counter() - t3)
    for name, t in times.items():
        out[name].update({f"{k}_ms": 1000 * _median(v) for k, v in t.items() if v})
        out[name]["add_sample_ms"] = out[name]["add_ms"] + out[name]["sample_ms"]
    for buf in buffers.values():
        plane = getattr(buf, "plane", None)
        if plane is not None:
            plane.close()
    return out


# -- report ------------------------------------------------------------------------------------


def _ms(x: float) -> str:
    return f"{1000 * x:.1f}" if math.isfinite(x) else "-"


def _ret(s: dict[str, Any]) -> str:
    if not math.isfinite(s["return_mean"]):
        return "-"
    std = f"±{s['return_std']:.0f}" if math.isfinite(s["return_std"]) else ""
    return f"{s['return_mean']:.0f}{std}"


def targets(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, each with the figures it was judged on."""
    out: dict[str, Any] = {}
    for name, r in rows.items():
        rl, co = r["rllib"], r["conduit"]
        # Per round of the interleaved runs, then the median: drift between rounds cancels.
        entry: dict[str, Any] = {"e2e_ratio": co["paired"]}
        if r["algo"] != "ppo":
            entry["buffer_share_ratio"] = rl["path_share"] / co["path_share"]
            entry["buffer_share_5x"] = entry["buffer_share_ratio"] >= 5
        entry["e2e_met"] = (entry["e2e_ratio"] < 1) if r["heavy"] else (entry["e2e_ratio"] <= 1)
        entry["returns_within_noise"] = within_noise(rl, co)
        out[name] = entry
    return out


def print_tables(rows: dict[str, dict[str, Any]], micro: dict[int, Any],
                 goals: dict[str, Any]) -> None:
    """The training table, the targets and the microbenchmark table."""
    body = []
    for name, r in rows.items():
        rl, co = r["rllib"], r["conduit"]
        body.append([name, rl["iterations"], f"{_ms(rl['iter_s'])}/{_ms(co['iter_s'])}",
                     f"{_ms(rl['path_s'])}/{_ms(co['path_s'])}",
                     f"{100 * rl['path_share']:.1f}/{100 * co['path_share']:.1f}",
                     f"{_ret(rl)}/{_ret(co)}", ",".join(sorted(set(co["schedules"]))) or "-"])
    print("\nper training iteration, medians, RLlib/RLlib+Conduit (path: time inside the replay "
          "buffer for DQN and SAC, in PPO's mini-batch iterator for PPO)")
    print(table(["workload", "iters", "iteration ms", "path ms", "path share %",
                 "return", "conduit schedule"], body))
    print("\ntargets")
    print(table(["workload", "e2e conduit/rllib per round", "met", "buffer share rllib/conduit",
                 ">= 5x", "returns within noise"],
                [[n, f"{g['e2e_ratio']:.2f}", g["e2e_met"],
                  f"{g['buffer_share_ratio']:.1f}" if "buffer_share_ratio" in g else "-",
                  g.get("buffer_share_5x", "-"), g["returns_within_noise"]]
                 for n, g in goals.items()]))
    print("\nbuffer microbenchmark at capacity (medians, ms; CartPole-sized rows)")
    body = []
    for cap, res in micro.items():
        for name, m in res.items():
            body.append([f"{cap:,}", name, f"{m['fill_s']:.1f}", f"{m['add_ms']:.3f}",
                         f"{m['sample_ms']:.3f}", f"{m.get('update_ms', math.nan):.3f}",
                         f"{m['add_sample_ms']:.3f}"])
    print(table(["capacity", "buffer", "fill s", "add", "sample", "update_prio",
                 "add+sample"], body))


def plot(rows: dict[str, dict[str, Any]], micro: dict[int, Any], path: Path) -> Path | None:
    """Iteration and buffer time per workload, and add+sample cost against capacity."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    names = list(rows)
    x = np.arange(len(names))
    for k, variant in enumerate(VARIANTS):
        it = [1000 * rows[n][variant]["iter_s"] for n in names]
        path_ms = [1000 * rows[n][variant]["path_s"] for n in names]
        a.bar(x + (k - 0.5) * 0.4, it, 0.4, label=f"{variant}: iteration", alpha=0.5)
        a.bar(x + (k - 0.5) * 0.4, path_ms, 0.4, label=f"{variant}: buffer / mini-batches")
    a.set_xticks(x, names, rotation=30)
    a.set_yscale("log")
    a.set_ylabel("ms per training iteration (median)")
    a.legend(fontsize=7)
    caps = sorted(micro)
    for name in next(iter(micro.values())):
        b.plot(caps, [micro[c][name]["add_sample_ms"] for c in caps], marker="o", label=name)
    b.set_xscale("log")
    b.set_yscale("log")
    b.set_xlabel("capacity (rows)")
    b.set_ylabel("add + sample, ms (median)")
    b.legend(fontsize=7)
    return save_figure(fig, path)


def effective(a: RllibBenchArgs, given: Collection[str] | None = None) -> RllibBenchArgs:
    """The arguments after ``--quick``: :data:`QUICK_ARGS` for the flags not given (see
    :func:`~conduit.bench.common.apply_quick`; the workloads and their sizes follow
    ``quick`` in :func:`run`)."""
    return apply_quick(a, QUICK_ARGS, given)


def check(a: RllibBenchArgs) -> None:
    """Refuse arguments the flags' own bounds let through.

    Raises:
        ConfigError: An unknown workload or schedule, or a capacity the microbenchmark
            cannot fill (:func:`check_capacity`).
    """
    known = [w.name for w in workloads()]
    unknown = [name for name in a.only if name not in known]
    if unknown:
        raise ConfigError("only", f"unknown workloads {unknown}; choose from {known}")
    if a.schedule not in SCHEDULES:
        raise ConfigError("schedule", f"must be one of {', '.join(SCHEDULES)}, got "
                                      f"{a.schedule!r}")
    for cap in a.capacities:
        check_capacity(cap)


def run(a: RllibBenchArgs) -> dict[str, Any]:
    """Run the side-by-side training runs and the microbenchmark; write JSON and PNG. The JSON
    is written with ``"partial": true`` after every (seed, workload) pair and every
    microbenchmark capacity, then whole at the end.

    Args:
        a: The arguments to run with, ``--quick`` already applied (:func:`effective`).

    Raises:
        ConfigError: An argument :func:`check` refuses.
    """
    check(a)
    only = a.only or (QUICK if a.quick else ())
    chosen = [w for w in workloads() if not only or w.name in only]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {w.name: {v: [] for v in VARIANTS}
                                                        for w in chosen}
    micro: dict[int, Any] = {}
    out = Path(a.out)

    def workload_rows() -> dict[str, dict[str, Any]]:
        return {w.name: {"algo": w.algo, "heavy": w.heavy,
                         **{v: summarize(runs[w.name][v]) for v in VARIANTS},
                         "runs": runs[w.name]}
                for w in chosen if any(runs[w.name].values())}

    partial = PartialJSON(out / "rllib.json")
    with partial:
        _run_all(a, chosen, runs, micro,
                 lambda: partial.write({"args": asdict(a), "workloads": workload_rows(),
                                        "micro": {str(c): m for c, m in micro.items()}}))
    rows = workload_rows()
    goals = targets(rows)
    print_tables(rows, micro, goals)
    payload = {"args": asdict(a), "workloads": rows, "targets": goals,
               "micro": {str(c): m for c, m in micro.items()}}
    write_json(out / "rllib.json", payload, with_machine=True)
    png = plot(rows, micro, out / "rllib.png")
    print(f"wrote {out / 'rllib.json'}" + (f" and {png}" if png else ""))
    return payload


def _run_all(a: RllibBenchArgs, chosen: list[Workload],
             runs: dict[str, dict[str, list[dict[str, Any]]]], micro: dict[int, Any],
             save: Callable[[], object]) -> None:
    """The training runs of every seed and workload into ``runs``, then the microbenchmark
    at every capacity into ``micro``, calling ``save`` after each."""
    import ray

    own_ray = not ray.is_initialized()  # a caller's Ray (e.g. a test's) is used as it is
    if own_ray:
        ray.init(address="local", num_cpus=a.num_cpus, include_dashboard=False,
                 log_to_driver=False)
    try:
        register_envs()
        for seed in range(a.seeds):
            for w in chosen:
                iters = a.iters or (1 if a.quick else w.iters)
                t0 = time.perf_counter()
                pair = run_pair(w, seed=seed, iters=iters, quick=a.quick, schedule=a.schedule)
                for variant, res in pair.items():
                    runs[w.name][variant].append(res)
                    it = _median([r["iter_s"] for r in res["records"]])
                    progress(f"seed {seed} {w.name:<10} {variant:<7} iteration "
                             f"{1000 * it:7.1f} ms  return {res['return']:.1f}  "
                             f"{res.get('schedule', '')}")
                progress(f"seed {seed} {w.name:<10} both variants "
                         f"{time.perf_counter() - t0:5.1f}s  conduit/rllib per round "
                         f"{_median(pair['conduit']['paired']):.3f}")
                save()
    finally:
        if own_ray:
            ray.shutdown()
    for cap in a.capacities:
        t0 = time.perf_counter()
        micro[cap] = microbench(cap, a.repeats)
        progress(f"microbenchmark at capacity {cap:,}: {time.perf_counter() - t0:.1f}s")
        save()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``conduit bench rllib``."""
    p = command_parser("conduit bench rllib", __doc__, RllibBenchArgs)
    run(parse_quick(p, RllibBenchArgs, argv, effective, check=check))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
