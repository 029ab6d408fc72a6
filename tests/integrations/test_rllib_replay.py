"""Conduit's RLlib episode replay buffers against RLlib's own, fed the same episodes."""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

pytest.importorskip("ray.rllib")
gym = pytest.importorskip("gymnasium")

from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402
from ray.rllib.utils.replay_buffers import (  # noqa: E402
    EpisodeReplayBuffer,
    PrioritizedEpisodeReplayBuffer,
)

from conduit import Schedule  # noqa: E402
from conduit.errors import (  # noqa: E402
    ConfigError,
    EmptyBufferError,
    PriorityError,
    SpecError,
    StateError,
)
from conduit.integrations.rllib import (  # noqa: E402
    ConduitEpisodeReplayBuffer,
    ConduitPrioritizedEpisodeReplayBuffer,
)
from conduit.integrations.rllib import schedule as rllib_schedule  # noqa: E402
from conduit.integrations.rllib.windows import WindowRequest, deliver_windows  # noqa: E402
from conduit.storage import SampleInfo  # noqa: E402

N_STEP, GAMMA = 3, 0.9


def _run(env: gym.Env, eps: SingleAgentEpisode, rng: np.random.Generator, steps: int, *,
         truncate: bool = False) -> bool:
    """Step ``eps`` up to ``steps`` times; True when the episode ended."""
    for k in range(steps):
        action = int(rng.integers(2))
        obs, reward, terminated, truncated, _ = env.step(action)
        truncated = truncated or (truncate and k == steps - 1)
        eps.add_env_step(obs, action, float(reward) + k, {}, terminated=terminated,
                         truncated=truncated)
        if terminated or truncated:
            return True
    return False


def _episode(env: gym.Env, rng: np.random.Generator) -> SingleAgentEpisode:
    eps = SingleAgentEpisode(observation_space=env.observation_space,
                             action_space=env.action_space)
    obs, _ = env.reset(seed=int(rng.integers(1 << 30)))
    eps.add_env_reset(obs, {})
    return eps


@pytest.fixture(scope="module")
def adds() -> list[list[SingleAgentEpisode]]:
    """Two ``add`` calls: finished episodes (terminated and truncated), and an episode whose
    first chunk comes in the first call and its ongoing continuation in the second."""
    env, rng = gym.make("CartPole-v1"), np.random.default_rng(0)
    done = []
    while len(done) < 3:
        eps = _episode(env, rng)
        if _run(env, eps, rng, 200):
            done.append(eps)
    short = _episode(env, rng)
    while not _run(env, short, rng, 5, truncate=True):
        short = _episode(env, rng)
    ongoing = _episode(env, rng)
    while _run(env, ongoing, rng, 7):
        ongoing = _episode(env, rng)
    rest = ongoing.cut()
    _run(env, rest, rng, 4)
    first = [done[0], ongoing, short, done[1]]
    second = [done[2], rest]
    return [[e.to_numpy() for e in first], [e.to_numpy() for e in second]]


class _Draws:
    """A stand-in generator that returns scripted row positions (and, to RLlib's buffers, the
    scripted n-steps of a random n-step range)."""

    def __init__(self, positions: list[int], total: int = 0, n_steps: list[int] | None = None
                 ) -> None:
        self.positions, self.total, self.n_steps = list(positions), total, list(n_steps or ())

    def integers(self, low: int, high: int | None = None, size: int | None = None,
                 dtype: type = np.int64) -> object:
        if size is None:  # RLlib: a position, or with a range an n-step
            return self.positions.pop(0) if high is None else self.n_steps.pop(0)
        out = np.asarray(self.positions[:size], dtype=dtype)
        del self.positions[:size]
        return out

    def random(self) -> float:  # RLlib's prioritized buffer, all priorities equal
        return (self.positions.pop(0) + 0.5) / self.total


def _scripted(positions: list[int], *, weights: bool) -> Callable[[int, int], SampleInfo]:
    """A stand-in for an inner sampler's ``sample`` that draws the scripted slots in order."""
    queue = list(positions)

    def sample(size: int, batch_size: int) -> SampleInfo:
        take = torch.tensor(queue[:batch_size], dtype=torch.int64)
        del queue[:batch_size]
        return SampleInfo(take, torch.ones(len(take)) if weights else None)

    return sample


def _filled(buffer: EpisodeReplayBuffer, adds: list[list[SingleAgentEpisode]]
            ) -> EpisodeReplayBuffer:
    for episodes in adds:
        buffer.add(episodes)
    return buffer


def _positions(adds: list[list[SingleAgentEpisode]]) -> list[int]:
    """Row positions that cover window ends: episode starts, the last three steps of every
    chunk, and the chunk boundary of the continued episode."""
    out, row = [], 0
    for episodes in adds:
        for eps in episodes:
            n = len(eps)
            out += [row] + [row + k for k in range(max(0, n - 3), n)]
            row += n
    return sorted(set(out))


def _assert_same(ours: SingleAgentEpisode, theirs: SingleAgentEpisode, *, ids: bool) -> None:
    for k in (0, -1):
        a, b = ours.get_observations(k), theirs.get_observations(k)
        np.testing.assert_array_equal(a, b)
        assert np.asarray(a).dtype == np.asarray(b).dtype
    for get in ("get_actions", "get_rewards"):
        a, b = getattr(ours, get)(0), getattr(theirs, get)(0)
        assert a == b and type(a) is type(b), (get, a, b)
    assert (ours.is_terminated, ours.is_truncated, ours.t_started, len(ours)) == \
        (theirs.is_terminated, theirs.is_truncated, theirs.t_started, len(theirs))
    for key in ("n_step", "weights"):
        a, b = ours.get_extra_model_outputs(key, 0), theirs.get_extra_model_outputs(key, 0)
        assert a == pytest.approx(b) and type(a) is type(b), (key, a, b)
    if ids:
        assert ours.id_ == theirs.id_


@pytest.mark.parametrize("n_step", [N_STEP, (1, 4)])
def test_uniform_buffer_returns_what_rllib_returns(adds: list[list[SingleAgentEpisode]],
                                                   n_step: int | tuple[int, int]) -> None:
    positions = _positions(adds)
    n_steps = [1 + k % 3 for k in range(len(positions))]
    ours = _filled(ConduitEpisodeReplayBuffer(capacity=1000, batch_size_B=len(positions),
                                              seed=1, schedule="inline"), adds)
    theirs = _filled(EpisodeReplayBuffer(capacity=1000), adds)
    assert len(ours) == len(theirs) and ours.get_num_episodes() == theirs.get_num_episodes()
    theirs.rng = _Draws(positions, n_steps=n_steps)
    ours._replay.sampler.inner.sample = _scripted(positions, weights=False)
    ours._replay.sampler._rng = _Draws(n_steps)
    kwargs = {"num_items": len(positions), "n_step": n_step, "gamma": GAMMA,
              "batch_length_T": 0, "sample_episodes": True}
    a, b = ours.sample(**kwargs), theirs.sample(**kwargs)
    assert len(a) == len(b) == len(positions)
    for x, y in zip(a, b):
        _assert_same(x, y, ids=True)
    metrics = ours.get_metrics()
    assert metrics["num_env_steps_sampled"] == len(positions)


@pytest.mark.parametrize("n_step", [N_STEP, (1, 4)])
def test_prioritized_buffer_returns_what_rllib_returns(adds: list[list[SingleAgentEpisode]],
                                                       n_step: int | tuple[int, int]) -> None:
    """Equal priorities; rows whose window the end of the stored episode cuts short are
    redrawn by both buffers, from the same scripted positions."""
    complete = 8
    ours = _filled(ConduitPrioritizedEpisodeReplayBuffer(capacity=1000, batch_size_B=complete,
                                                         alpha=0.6, seed=1, schedule="inline"),
                   adds)
    theirs = _filled(PrioritizedEpisodeReplayBuffer(capacity=1000, alpha=0.6), adds)
    positions = _positions(adds)
    n_steps = [3 - k % 3 for k in range(len(positions))]
    theirs.rng = _Draws(positions, len(theirs), n_steps)
    ours._replay.sampler._rng = _Draws(n_steps)
    ours._replay.sampler.inner.sample = _scripted(positions, weights=True)
    a = ours.sample(num_items=complete, n_step=n_step, gamma=GAMMA, beta=0.4)
    b = theirs.sample(num_items=complete, n_step=n_step, gamma=GAMMA, beta=0.4)
    for x, y in zip(a, b):
        _assert_same(x, y, ids=False)
    assert ours.get_metrics()["num_resamples"] == theirs.get_metrics()["num_resamples"] > 0


def test_priorities_reach_the_sum_tree_and_shape_weights(
        adds: list[list[SingleAgentEpisode]]) -> None:
    buffer = _filled(ConduitPrioritizedEpisodeReplayBuffer(capacity=1000, alpha=0.5,
                                                           eps=1e-6, seed=3), adds)
    first = buffer.sample(num_items=32, n_step=1, beta=1.0)
    assert all(e.get_extra_model_outputs("weights", 0) == 1.0 for e in first)
    slots = torch.from_numpy(buffer._priorities.index.copy())
    td = np.linspace(0.1, 3.2, 32)
    buffer.update_priorities(td, "default_policy")
    tree = buffer._replay.sampler.inner
    expected = {int(s): (p + 1e-6) ** 0.5 for s, p in zip(slots, td)}  # last update wins
    assert tree.priorities(torch.tensor(list(expected))).numpy() == pytest.approx(
        list(expected.values()))
    with pytest.raises(PriorityError, match="no sample"):
        buffer.update_priorities(td)
    # Weights: (N·P(i))^-β over the largest possible, so the smallest priority has weight 1.
    leaves = tree.priorities(torch.arange(len(buffer))).numpy()
    sampled = buffer.sample(num_items=64, n_step=1, beta=1.0)
    index = buffer._priorities.index
    want = (leaves.min() / leaves[index])
    got = np.array([e.get_extra_model_outputs("weights", 0) for e in sampled])
    assert got == pytest.approx(want, rel=1e-5)
    with pytest.raises(PriorityError, match="2 values"):
        buffer.update_priorities(np.ones(2))


def test_state_round_trips_through_pickle(adds: list[list[SingleAgentEpisode]]) -> None:
    """An RLlib checkpoint pickles ``get_state``; a restored buffer holds the same rows,
    priorities and sampler, and continues ongoing episodes."""
    buffer = ConduitPrioritizedEpisodeReplayBuffer(capacity=1000, alpha=0.6, seed=5,
                                                   schedule="inline")
    buffer.add(adds[0])
    buffer.sample(num_items=8, n_step=N_STEP)
    buffer.update_priorities(np.arange(1, 9, dtype=np.float64))
    state = pickle.loads(pickle.dumps(buffer.get_state()))
    restored = ConduitPrioritizedEpisodeReplayBuffer(capacity=1000, alpha=0.6, seed=99,
                                                     schedule="inline")
    restored.set_state(state)
    assert len(restored) == len(buffer) and restored.get_num_episodes() == \
        buffer.get_num_episodes()
    for b in (buffer, restored):
        b.add(adds[1])
    kwargs = {"num_items": 16, "n_step": N_STEP, "gamma": GAMMA, "beta": 0.4}
    for x, y in zip(buffer.sample(**kwargs), restored.sample(**kwargs)):
        _assert_same(x, y, ids=False)
        assert x.get_extra_model_outputs("weights", 0) == y.get_extra_model_outputs(
            "weights", 0)


def test_ring_counts_timesteps_and_windows_stay_in_their_episode(
        adds: list[list[SingleAgentEpisode]]) -> None:
    """Past capacity the oldest timesteps are overwritten; every sampled transition still
    matches its source episode."""
    capacity = 40
    buffer = ConduitEpisodeReplayBuffer(capacity=capacity, seed=7)
    source: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
    for episodes in adds:
        buffer.add(episodes)
        for eps in episodes:
            obs = eps.get_observations(slice(0, len(eps) + 1))
            for i in range(len(eps)):
                source[eps.id_, eps.t_started + i] = obs[i], obs[i + 1]
    total = sum(len(e) for episodes in adds for e in episodes)
    assert total > capacity and len(buffer) == capacity
    for eps in buffer.sample(num_items=capacity, n_step=1, gamma=GAMMA):
        obs, next_obs = source[eps.id_, eps.t_started]
        np.testing.assert_array_equal(eps.get_observations(0), obs)
        np.testing.assert_array_equal(eps.get_observations(-1), next_obs)
    assert buffer.get_metrics()["num_env_steps_evicted"] == total - capacity


def _assert_stored(sampled: list[SingleAgentEpisode],
                   episodes: list[SingleAgentEpisode]) -> None:
    """Every sampled one-step transition is a step of ``episodes``: its time, observation and
    next observation (the prioritized buffer, as RLlib's, gives sampled episodes new ids)."""
    stored = set()
    for eps in episodes:
        obs = eps.get_observations(slice(0, len(eps) + 1))
        stored |= {(eps.t_started + i, obs[i].tobytes(), obs[i + 1].tobytes())
                   for i in range(len(eps))}
    for eps in sampled:
        assert (eps.t_started, eps.get_observations(0).tobytes(),
                eps.get_observations(-1).tobytes()) in stored


def _with_actions(eps: SingleAgentEpisode, actions: np.ndarray) -> SingleAgentEpisode:
    n = len(eps)
    return SingleAgentEpisode(
        observations=list(eps.get_observations(slice(0, n + 1))), actions=list(actions),
        rewards=list(eps.get_rewards(slice(0, n))), terminated=eps.is_terminated,
        observation_space=eps.observation_space, action_space=eps.action_space,
        len_lookback_buffer=0).to_numpy()


@pytest.mark.parametrize("prioritized", [False, True])
def test_an_add_with_a_bad_episode_changes_nothing(adds: list[list[SingleAgentEpisode]],
                                                   prioritized: bool) -> None:
    """A chunk that cannot be stored (actions of another dtype, dict observations, not an
    episode) raises SpecError before the links change: the rows counted stay the rows in the
    ring, and every sampled transition still matches its source episode."""
    cls = ConduitPrioritizedEpisodeReplayBuffer if prioritized else ConduitEpisodeReplayBuffer
    buffer = cls(capacity=60, seed=3, schedule="inline")
    first, second = adds
    buffer.add(first[:2])
    rows = len(buffer)
    good = first[2]
    floats = _with_actions(first[3], np.linspace(0, 1, len(first[3])))
    box = gym.spaces.Dict({"x": good.observation_space})
    nested = SingleAgentEpisode(observations=[{"x": o} for o in good.get_observations()],
                                actions=list(good.get_actions()),
                                rewards=list(good.get_rewards()), observation_space=box,
                                action_space=good.action_space, len_lookback_buffer=0)
    for bad, field in ((floats, "action"), (nested, "obs"), ("episode", None)):
        with pytest.raises(SpecError) as ei:
            buffer.add([good, bad])  # the good chunk first: it must not be half-added
        assert ei.value.field == field
        assert len(buffer) == rows and len(buffer.plane.buffer) == rows
    buffer.add(second)
    _assert_stored(buffer.sample(num_items=60, n_step=1, gamma=GAMMA), [*first[:2], *second])


def test_unsupported_sampling_is_refused(adds: list[list[SingleAgentEpisode]]) -> None:
    buffer = _filled(ConduitEpisodeReplayBuffer(capacity=1000), adds[:1])
    with pytest.raises(ConfigError, match="batch_length_T"):
        buffer.sample(num_items=4, n_step=1, batch_length_T=8)


@pytest.mark.parametrize("length", [8, 1, -1])
def test_a_prioritized_buffer_refuses_sequence_lengths_as_documented(
        adds: list[list[SingleAgentEpisode]], length: int) -> None:
    buffer = _filled(ConduitPrioritizedEpisodeReplayBuffer(capacity=1000, schedule="inline"),
                     adds[:1])
    with pytest.raises(ConfigError) as ei:
        buffer.sample(num_items=4, n_step=1, batch_length_T=length)
    assert ei.value.field == "batch_length_T"
    for none in (0, None):
        assert len(buffer.sample(num_items=4, n_step=1, batch_length_T=none)) == 4
    buffer.plane.close()


@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize(("kwargs", "field"), [
    ({"num_items": -3}, "num_items"), ({"num_items": 2.5}, "num_items"),
    ({"num_items": None, "batch_size_B": -1}, "batch_size_B"),
    ({"n_step": -1}, "n_step"), ({"n_step": 2.5}, "n_step"), ({"n_step": (3, 1)}, "n_step"),
    ({"n_step": (0, 2)}, "n_step"), ({"n_step": (1, 3, 5)}, "n_step"),
    ({"n_step": 0}, "n_step"), ({"n_step": False}, "n_step"), ({"n_step": ()}, "n_step"),
    ({"n_step": []}, "n_step"), ({"gamma": float("nan")}, "gamma")])
def test_a_bad_sample_argument_is_refused_and_changes_nothing(
        adds: list[list[SingleAgentEpisode]], prioritized: bool, kwargs: dict,
        field: str) -> None:
    # A sample of another size rebuilds the plane over the same rows; a bad size used to
    # close the plane first and fail after, leaving a buffer that reported nothing added.
    cls = ConduitPrioritizedEpisodeReplayBuffer if prioritized else ConduitEpisodeReplayBuffer
    buffer = _filled(cls(capacity=1000, schedule="inline"), adds[:1])
    rows = len(buffer)
    with pytest.raises(ConfigError) as ei:
        buffer.sample(**({"num_items": 4, "n_step": 3, "gamma": 0.99} | kwargs))
    assert ei.value.field == field
    assert len(buffer) == rows
    got = buffer.sample(num_items=6, n_step=[1, 3], gamma=0.99)
    assert len(got) == 6 and all(1 <= e.get_extra_model_outputs("n_step")[0] < 3 for e in got)


def _wait_staged(buffer: ConduitEpisodeReplayBuffer, timeout: float = 10.0) -> None:
    """Wait until the delivery worker has staged a batch ahead of the next sample."""
    deadline = time.monotonic() + timeout
    while buffer.plane.stats()["staged_batches"] < 1:
        assert time.monotonic() < deadline, "the delivery worker staged nothing"
        time.sleep(0.005)


@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize("n_step", [N_STEP, (1, 4)])
def test_prefetched_samples_return_what_rllib_returns(adds: list[list[SingleAgentEpisode]],
                                                      prioritized: bool,
                                                      n_step: int | tuple[int, int]) -> None:
    """Batches drawn ahead on the delivery worker: for the rows and n-steps they hold,
    RLlib's buffer (scripted to draw the same) returns the same fields and reward sums."""
    kind = ConduitPrioritizedEpisodeReplayBuffer if prioritized else ConduitEpisodeReplayBuffer
    ours = _filled(kind(capacity=1000, batch_size_B=24, alpha=0.6, seed=2,
                        schedule="prefetch"), adds)
    assert ours.plane.schedule.overlap_del == 1
    kwargs = ({"num_items": 24, "n_step": n_step, "gamma": GAMMA, "beta": 0.4} if prioritized
              else {"num_items": 24, "n_step": n_step, "gamma": GAMMA, "batch_length_T": 0,
                    "sample_episodes": True})
    for _ in range(3):
        _wait_staged(ours)
        sampled = ours.sample(**kwargs)
        positions = ours._priorities.index.tolist()  # no wrap: slot = row position
        n_steps = [int(e.get_extra_model_outputs("n_step", 0)) for e in sampled]
        rllib = PrioritizedEpisodeReplayBuffer if prioritized else EpisodeReplayBuffer
        theirs = _filled(rllib(capacity=1000, alpha=0.6), adds)
        theirs.rng = _Draws(positions, len(theirs), n_steps)
        for x, y in zip(sampled, theirs.sample(**kwargs), strict=True):
            _assert_same(x, y, ids=not prioritized)
    # The first batch, drawn before any sample() named its arguments, was thrown away.
    assert ours.discarded_batches >= 1
    assert ours.plane.counters["delivered_batches"] >= 4
    ours.plane.close()


@pytest.mark.parametrize(("threads", "cuda", "tried"), [
    (4, False, False), (3, False, True), (4, True, True)])
def test_auto_tries_overlap_only_where_a_worker_has_a_core(
        adds: list[list[SingleAgentEpisode]], monkeypatch: pytest.MonkeyPatch, threads: int,
        cuda: bool, tried: bool) -> None:
    """On 4 cores: a CPU learner on 4 torch threads leaves a worker no core, so ``"auto"``
    delivers inline, untried, and says why; on 3 threads, or with a CUDA device (where the
    learner is taken to compute), it starts overlapped and tunes."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        buffer = _filled(ConduitPrioritizedEpisodeReplayBuffer(capacity=1000, seed=0), adds)
    finally:
        torch.set_num_threads(before)
    assert buffer.schedule.deciding == tried
    if tried:
        assert buffer.plane.schedule.overlap_ing and "note" not in buffer.schedule.report
    else:
        assert buffer.plane.schedule == Schedule(0, 1, 0, 1)
        assert buffer.schedule.report["schedule"] == Schedule(0, 1, 0, 1).label()
        assert "no core of its own" in buffer.schedule.report["note"]
        for _ in range(3):
            buffer.sample(num_items=8, n_step=1, beta=0.4)
        assert buffer.plane.stats()["staged_batches"] == 0  # nothing drawn ahead
        assert not buffer.schedule.deciding
    buffer.plane.close()


@pytest.mark.parametrize("prioritized", [False, True])
def test_auto_delivers_one_batch_at_a_time_for_a_prioritized_buffer(
        adds: list[list[SingleAgentEpisode]], monkeypatch: pytest.MonkeyPatch,
        prioritized: bool) -> None:
    """Defect: a prioritized buffer's ``"auto"`` started on prefetching two batches per
    invocation and could keep a threadless schedule that drew two per sample; each priority
    update then discarded the one drawn beside the sampled one. It now delivers one batch per
    invocation throughout its tuning; a uniform buffer, whose staged batches stay valid,
    still starts on two."""
    monkeypatch.setattr(rllib_schedule, "worker_has_core", lambda **_: True)
    cls = ConduitPrioritizedEpisodeReplayBuffer if prioritized else ConduitEpisodeReplayBuffer
    buffer = _filled(cls(capacity=1000, seed=0), adds)
    assert buffer.schedule.deciding
    assert buffer.plane.schedule.overlap_del
    assert buffer.plane.schedule.g_del == (1 if prioritized else 2)
    seen = set()
    for _ in range(40):
        buffer.sample(num_items=8, n_step=1, beta=0.4)
        seen.add(buffer.plane.schedule.g_del)
        if prioritized:
            buffer.update_priorities(np.ones(8), "default_policy")
    assert not buffer.schedule.deciding  # tuned, on one granularity where prioritized
    if prioritized:
        assert seen == {1}
    else:
        assert max(seen) == 2
    buffer.plane.close()


def test_priorities_after_a_prefetched_sample_reach_its_rows(
        adds: list[list[SingleAgentEpisode]]) -> None:
    """update_priorities applies to the rows the last sample returned, not to the batch the
    worker staged meanwhile; that batch, drawn before the update, is not served."""
    buffer = _filled(ConduitPrioritizedEpisodeReplayBuffer(capacity=1000, alpha=0.5, eps=1e-6,
                                                           seed=4, schedule="prefetch"), adds)
    kwargs = {"num_items": 16, "n_step": 1, "beta": 1.0}
    buffer.sample(**kwargs)
    _wait_staged(buffer)
    sampled = buffer._priorities.index.copy()
    tree = buffer._replay.sampler.inner
    before = tree.priorities(torch.arange(len(buffer))).numpy()
    td = np.linspace(0.5, 8.0, 16)
    discarded = buffer.plane.counters["discarded_batches"]
    buffer.update_priorities(td, "default_policy")
    after = tree.priorities(torch.arange(len(buffer))).numpy()
    expected = before.copy()
    expected[sampled] = (td + 1e-6) ** 0.5  # a slot drawn twice keeps its last value
    assert after == pytest.approx(expected)
    nxt = buffer.sample(**kwargs)
    assert buffer.plane.counters["discarded_batches"] > discarded
    # Drawn after the update: weights follow the new priorities.
    want = after.min() / after[buffer._priorities.index]
    got = np.array([e.get_extra_model_outputs("weights", 0) for e in nxt])
    assert got == pytest.approx(want, rel=1e-5)
    buffer.plane.close()


def _ten_step_episodes(count: int, start: int) -> list[SingleAgentEpisode]:
    box, disc = gym.spaces.Box(-1e6, 1e6, (2,), np.float32), gym.spaces.Discrete(2)
    return [SingleAgentEpisode(
        observations=[np.array([e, t], np.float32) for t in range(11)], actions=[0] * 10,
        rewards=[1.0] * 10, terminated=True, observation_space=box, action_space=disc,
        len_lookback_buffer=0).to_numpy() for e in range(start, start + count)]


@pytest.mark.parametrize("schedule", ["inline", "prefetch"])
def test_priorities_skip_rows_an_add_overwrote_after_the_sample(schedule: str) -> None:
    """Defect: with prefetch, the draw made after the add marked the overwritten slots
    delivered again, so the update of the earlier sample landed on the new rows there."""
    buffer = ConduitPrioritizedEpisodeReplayBuffer(capacity=20, alpha=1.0, eps=1e-9, seed=0,
                                                   schedule=schedule)
    buffer.add(_ten_step_episodes(2, 0))  # slots 0..19
    buffer.sample(num_items=20, n_step=1)
    sampled = buffer._priorities.index.copy()
    buffer.add(_ten_step_episodes(1, 2))  # new rows in slots 0..9
    if schedule == "prefetch":
        _wait_staged(buffer)  # the next draw, made after the add
    buffer.update_priorities(np.full(20, 1e-3), "default_policy")
    pr = buffer._replay.sampler.inner.priorities(torch.arange(20)).numpy()
    for slot in set(sampled.tolist()):
        assert pr[slot] == pytest.approx(1.0 if slot < 10 else 1e-3), slot
    buffer.plane.close()


def test_a_failed_draw_ahead_for_earlier_arguments_does_not_fail_the_next_sample() -> None:
    """Defect: with prefetch, after a sample that found no complete 3-step window the worker
    drew again for those arguments and failed; the next sample, for n_step 1, raised that
    failure instead of being served."""
    buffer = ConduitPrioritizedEpisodeReplayBuffer(capacity=12, seed=0, schedule="prefetch")
    box = gym.spaces.Box(-1e6, 1e6, (2,), np.float32)
    buffer.add([SingleAgentEpisode(observations=[np.array([e, 0], np.float32)] * 2,
                                   actions=[0], rewards=[1.0], terminated=True,
                                   observation_space=box, action_space=gym.spaces.Discrete(2),
                                   len_lookback_buffer=0).to_numpy() for e in range(12)])
    with pytest.raises(EmptyBufferError, match="3-step"):  # one-step episodes only
        buffer.sample(num_items=4, n_step=3)
    _wait_staged(buffer)  # the worker's own draw for n_step 3 fails too (and is staged)
    assert buffer.plane.failed is None  # a failed draw is not an operator failure
    assert len(buffer.sample(num_items=4, n_step=1)) == 4
    buffer.plane.close()


def test_the_state_of_an_empty_buffer_leaves_no_priorities_behind() -> None:
    """Defect: restoring an empty buffer's state kept the sampler's priorities and ring
    count, so new rows got the old largest priority."""
    used = ConduitPrioritizedEpisodeReplayBuffer(capacity=40, seed=0, schedule="inline")
    used.add(_ten_step_episodes(5, 0))
    used.sample(num_items=8, n_step=1)
    used.update_priorities(np.full(8, 100.0), "default_policy")
    used.set_state(ConduitPrioritizedEpisodeReplayBuffer(capacity=40, seed=0).get_state())
    used.add(_ten_step_episodes(1, 10))
    assert len(used) == 10 and used._replay.sampler.ring_rows == 10
    pr = used._replay.sampler.inner.priorities(torch.arange(10)).numpy()
    assert pr == pytest.approx(np.ones(10))


def test_delivery_lays_windows_over_the_links_it_finds(
        adds: list[list[SingleAgentEpisode]]) -> None:
    """A draw delivered after an add continued its episode gets the longer window, as RLlib
    returns after that add; a drawn row that an add overwrote is marked invalid."""
    buffer = _filled(ConduitEpisodeReplayBuffer(capacity=1000, seed=6, schedule="inline"),
                     adds[:1])
    sampler, plane = buffer._replay.sampler, buffer.plane
    ongoing = adds[0][1]  # its continuation comes in the second add
    end = len(adds[0][0]) + len(ongoing)  # its last row + 1
    positions = [end - 2, end - 1, 0]
    sampler.set_request(WindowRequest(n_step=N_STEP, gamma=GAMMA))
    sampler.inner.sample = _scripted(positions, weights=False)
    info = plane.buffer.draw(len(positions))
    rows = plane.buffer.gather(info)
    buffer.add(adds[1])

    def gather(slots: np.ndarray) -> torch.Tensor:
        return plane.buffer.gather(torch.from_numpy(slots))["obs"]

    out = deliver_windows(sampler, rows, gather)
    theirs = _filled(EpisodeReplayBuffer(capacity=1000), adds)
    theirs.rng = _Draws(positions)
    for i, eps in enumerate(theirs.sample(num_items=3, n_step=N_STEP, gamma=GAMMA,
                                          batch_length_T=0, sample_episodes=True)):
        np.testing.assert_array_equal(out["next_obs"][i].numpy(), eps.get_observations(-1))
        assert float(out["reward"][i]) == pytest.approx(eps.get_rewards(0))
    assert bool(out["_valid"].all())

    full = len(adds[0][0])
    small = _filled(ConduitEpisodeReplayBuffer(capacity=full, seed=6, schedule="inline"),
                    [adds[0][:1]])
    small._replay.sampler.set_request(WindowRequest(n_step=1))
    small._replay.sampler.inner.sample = _scripted([0, full - 1], weights=False)
    info = small.plane.buffer.draw(2)
    rows = small.plane.buffer.gather(info)
    small.add([adds[0][2]])  # overwrites the oldest slots, 0 included
    out = deliver_windows(small._replay.sampler, rows,
                          lambda slots: small.plane.buffer.gather(torch.from_numpy(slots))["obs"])
    assert out["_valid"].tolist() == [False, True]


class _Chunks:
    """Episode chunks from ``envs`` interleaved envs, each observation ``(episode, t, 0, 0)``
    and each reward ``t + episode / 8``, so a sampled transition names its source. Episodes
    end terminated or truncated after 1 to 12 steps; chunks hold 1 to 5 steps."""

    def __init__(self, envs: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.space = gym.spaces.Box(-1e6, 1e6, (4,), np.float32)
        # Per env: its episode, the episode's number and its length (None: to be reset).
        self.live: list[tuple[SingleAgentEpisode, int, int] | None] = [None] * envs
        self.envs, self.count = envs, 0
        self.steps: dict[int, int] = {}  # episode number -> steps added
        self.ended: dict[int, tuple[bool, bool]] = {}  # -> (terminated, truncated)

    def _obs(self, number: int, t: int) -> np.ndarray:
        return np.array([number, t, 0, 0], dtype=np.float32)

    def add(self) -> list[SingleAgentEpisode]:
        """One ``add`` call's chunks: one per env, from 1 to ``envs`` envs."""
        for k in range(self.envs):
            if self.live[k] is None:
                eps = SingleAgentEpisode(observation_space=self.space,
                                         action_space=gym.spaces.Discrete(2))
                eps.add_env_reset(self._obs(self.count, 0), {})
                self.live[k] = (eps, self.count, int(self.rng.integers(1, 13)))
                self.steps[self.count] = 0
                self.count += 1
        out = []
        for k in sorted(self.rng.choice(self.envs, int(self.rng.integers(1, self.envs + 1)),
                                        replace=False)):
            live = self.live[k]
            assert live is not None
            eps, number, length = live
            for _ in range(int(self.rng.integers(1, 6))):
                t = len(eps) + eps.t_started + 1
                done = t == length
                terminated = done and bool(self.rng.integers(2))
                eps.add_env_step(self._obs(number, t), int(self.rng.integers(2)),
                                 float(t - 1 + number / 8), {}, terminated=terminated,
                                 truncated=done and not terminated)
                if done:
                    self.ended[number] = terminated, not terminated
                    break
            self.steps[number] = eps.t_started + len(eps)
            if eps.is_done:
                out.append(eps.to_numpy())
                self.live[k] = None
            else:
                self.live[k] = (eps.cut(), number, length)
                out.append(eps.to_numpy())
        return out

    def check(self, eps: SingleAgentEpisode, *, complete: bool, ahead: bool) -> None:
        """``eps`` is the n-step transition from its first observation's row, as RLlib's
        buffer lays it over the steps added so far (``ahead``: over the steps added when a
        batch drawn ahead was delivered, which may be fewer)."""
        number, t = (int(x) for x in eps.get_observations(0)[:2])
        n = int(eps.get_extra_model_outputs("n_step", 0))
        k = int(eps.get_observations(-1)[1]) - t
        assert 1 <= k <= min(n, self.steps[number] - t)
        assert eps.t_started == t and (k == n or not complete)
        assert ahead or k == min(n, self.steps[number] - t)
        np.testing.assert_array_equal(eps.get_observations(-1), self._obs(number, t + k))
        want = sum(GAMMA ** j * (t + j + number / 8) for j in range(k))
        assert eps.get_rewards(0) == pytest.approx(want)
        ends = k == n and t + k == self.steps[number] and number in self.ended
        terminated, truncated = self.ended[number] if ends else (False, False)
        assert (eps.is_terminated, eps.is_truncated) == (terminated, truncated)


@pytest.mark.parametrize("schedule", ["inline", "prefetch"])
@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize("n_step", [1, N_STEP])
def test_next_observations_stay_in_their_episode_through_wrap_around(
        schedule: str, prioritized: bool, n_step: int) -> None:
    """Each observation is stored once; a transition's next observation is the next row's or,
    at the end of its stored episode, the episode's tail. Many times around a small ring, with
    interleaved envs, continued, terminated and truncated episodes, every sampled transition
    reads its next observation, reward sum and end flags from its own episode at the right
    step, never from another episode or a newer row."""
    capacity = 37
    kind = ConduitPrioritizedEpisodeReplayBuffer if prioritized else ConduitEpisodeReplayBuffer
    buffer = kind(capacity=capacity, alpha=0.6, seed=11, schedule=schedule)
    source = _Chunks(envs=3, seed=n_step + 2 * prioritized)
    kwargs = {"num_items": 8, "n_step": n_step, "gamma": GAMMA, "beta": 0.4}
    sampled = 0
    for step in range(120):
        buffer.add(source.add())
        if prioritized and step < 6:
            continue  # too few complete windows yet
        for eps in buffer.sample(**kwargs):
            source.check(eps, complete=prioritized, ahead=schedule == "prefetch")
            sampled += 1
        if prioritized:
            buffer.update_priorities(np.linspace(0.1, 2.0, 8))
    assert sum(source.steps.values()) > 10 * capacity and sampled >= 8 * 100
    assert set(buffer.plane.spec.names) == {"obs", "action"}
    # Tails are held for the episodes in the buffer only: their array stays small.
    assert buffer.get_num_episodes() <= capacity
    assert len(buffer._rows.tails.data) <= 2 * capacity
    if schedule == "prefetch":
        buffer.plane.close()


def test_cached_metrics_logger_reports_what_rllibs_logger_reports() -> None:
    """The buffers' metrics logger pushes known keys straight to their Stats objects; what
    ``get_metrics`` reports is what RLlib's own ``MetricsLogger`` reports for the same calls,
    also after the logger was reset."""
    from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

    from conduit.integrations.rllib.metrics import CachedMetricsLogger

    ours, theirs = (ConduitPrioritizedEpisodeReplayBuffer(capacity=50, alpha=0.6, seed=3,
                                                          schedule="inline")
                    for _ in range(2))
    theirs.metrics = MetricsLogger(root=False)
    assert isinstance(ours.metrics, CachedMetricsLogger)
    sources = [_Chunks(envs=2, seed=5), _Chunks(envs=2, seed=5)]
    reports = 0
    for step in range(40):
        for buffer, source in zip((ours, theirs), sources, strict=True):
            buffer.add(source.add())
            if step >= 6:
                buffer.sample(num_items=4, n_step=(1, 3), gamma=GAMMA, beta=0.4)
                buffer.update_priorities(np.linspace(0.1, 1.0, 4))
        if step == 20:
            ours.metrics.reset()
            theirs.metrics.reset()
        if step % 5 == 4:
            a, b = ours.get_metrics(), theirs.get_metrics()
            assert a == b and float(a["num_env_steps_added"]) > 0
            assert step < 6 or float(a["num_env_steps_sampled"]) > 0
            reports += 1
    assert reports == 8


def test_a_state_of_another_row_layout_is_refused(
        adds: list[list[SingleAgentEpisode]]) -> None:
    buffer = ConduitEpisodeReplayBuffer(capacity=64, schedule="inline")
    buffer.add(adds[0])
    state = buffer.get_state()
    state["spec"] = {**state["spec"], "next_obs": state["spec"]["obs"]}
    with pytest.raises(StateError, match="spec"):
        ConduitEpisodeReplayBuffer(capacity=64, schedule="inline").set_state(state)


def test_a_state_with_links_outside_the_ring_or_a_missing_key_changes_nothing(
        adds: list[list[SingleAgentEpisode]]) -> None:
    buffer = ConduitEpisodeReplayBuffer(capacity=64, schedule="inline", seed=3)
    buffer.add(adds[0])
    state = buffer.get_state()
    target = ConduitEpisodeReplayBuffer(capacity=64, schedule="inline", seed=3)
    target.set_state(state)
    before = target.get_state()["rows"]["succ"].copy()
    for bad in (64, -2):
        broken = {**state, "rows": {**state["rows"], "succ": state["rows"]["succ"].copy()}}
        broken["rows"]["succ"][5] = bad
        with pytest.raises(StateError, match=r"episode_rows\.succ"):
            target.set_state(broken)
    missing = {k: v for k, v in state.items() if k != "plane"}
    with pytest.raises(StateError, match=r"rllib_buffer\.plane"):
        target.set_state(missing)
    np.testing.assert_array_equal(target._rows.succ, before)
    assert len(target.sample(num_items=8, n_step=N_STEP, gamma=GAMMA)) == 8


@pytest.mark.parametrize("schedule", ["inline", "prefetch"])
def test_a_state_refused_part_way_leaves_the_buffer_as_it_was(
        adds: list[list[SingleAgentEpisode]], schedule: str) -> None:
    """Defect: the links were loaded and the plane closed before the plane's entry was
    checked, so a state refused there (a missing entry, a uniform buffer's state given to a
    prioritized one) left links of 27 rows over no plane: the next add wrote at slot 0 while
    the links placed it further on, and every transition paired one episode's observations
    with another's rewards. A refused state now leaves rows and links as they were."""
    first, second = adds
    target = ConduitPrioritizedEpisodeReplayBuffer(capacity=40, schedule=schedule, seed=3)
    target.add(first)
    size, episodes = len(target), target.get_num_episodes()
    source = ConduitEpisodeReplayBuffer(capacity=40, schedule="inline", seed=3)
    source.add(first[:2])
    uniform = source.get_state()  # no priorities: refused by the prioritized sampler
    no_rows = {**uniform, "plane": {k: v for k, v in uniform["plane"].items() if k != "buffer"}}
    bad_table = {**uniform, "rows": {**uniform["rows"], "table": [("x",)]}}
    for state in (uniform, no_rows, bad_table):
        with pytest.raises(StateError):
            target.set_state(state)
        assert (len(target), target.get_num_episodes()) == (size, episodes)
        assert target.plane is not None and len(target.plane.buffer) == size
    target.add(second)
    _assert_stored(target.sample(num_items=40, n_step=1, gamma=GAMMA), [*first, *second])


def _chunks(end: str) -> tuple[SingleAgentEpisode, SingleAgentEpisode]:
    """Episode "A" in two chunks: three steps, then no step but the end flag ``end``."""
    box, disc = gym.spaces.Box(-1e6, 1e6, (2,), np.float32), gym.spaces.Discrete(3)
    obs = [np.array([0, t], np.float32) for t in range(4)]
    first = SingleAgentEpisode(id_="A", observations=obs, actions=[0, 1, 2],
                               rewards=[1.0, 2.0, 3.0], observation_space=box,
                               action_space=disc, len_lookback_buffer=0).to_numpy()
    last = SingleAgentEpisode(id_="A", observations=[obs[3]], actions=[], rewards=[],
                              t_started=3, terminated=end == "terminated",
                              truncated=end == "truncated", observation_space=box,
                              action_space=disc, len_lookback_buffer=0).to_numpy()
    return first, last


def _by_t(sampled: list[SingleAgentEpisode]) -> dict[int, tuple]:
    return {e.t_started: (e.is_terminated, e.is_truncated, float(e.get_rewards(0)),
                          tuple(np.asarray(e.get_observations(-1)).tolist())) for e in sampled}


@pytest.mark.parametrize("n_step", [1, 2, 3])
@pytest.mark.parametrize("end", ["terminated", "truncated"])
@pytest.mark.parametrize("prioritized", [False, True])
def test_a_zero_length_final_chunk_ends_the_stored_episode_as_in_rllib(
        end: str, prioritized: bool, n_step: int) -> None:
    """Defect: a final chunk without timesteps was skipped, so the stored episode never
    ended and its last transitions bootstrapped past the terminal."""
    theirs = EpisodeReplayBuffer(capacity=100)
    cls = ConduitPrioritizedEpisodeReplayBuffer if prioritized else ConduitEpisodeReplayBuffer
    ours = cls(capacity=100, seed=0, schedule="inline")
    for buffer in (theirs, ours):
        first, last = _chunks(end)
        buffer.add([first])
        buffer.add([last])
    want = _by_t(theirs.sample(num_items=60, n_step=n_step, gamma=GAMMA, batch_length_T=0,
                               sample_episodes=True))
    got = _by_t(ours.sample(num_items=60, n_step=n_step, gamma=GAMMA))
    # (prioritized: only rows whose n-step window is complete are drawn)
    rows = set(range(4 - n_step)) if prioritized else set(range(3))
    assert got.keys() == rows and rows <= want.keys()
    for t, value in got.items():
        assert value[:2] == want[t][:2] and value[3] == want[t][3], t
        assert value[2] == pytest.approx(want[t][2]), t
    assert got[3 - n_step][:2] == (end == "terminated", end == "truncated")
    ours.plane.close()


def test_a_zero_length_final_chunk_leaves_a_row_that_overwrote_its_episode_alone() -> None:
    first, last = _chunks("terminated")
    buffer = ConduitEpisodeReplayBuffer(capacity=3, seed=0, schedule="inline")
    buffer.add([first])
    box, disc = gym.spaces.Box(-1e6, 1e6, (2,), np.float32), gym.spaces.Discrete(3)
    other = SingleAgentEpisode(id_="B", observations=[np.array([1, t], np.float32)
                                                      for t in range(4)],
                               actions=[0, 0, 0], rewards=[1.0] * 3, observation_space=box,
                               action_space=disc, len_lookback_buffer=0).to_numpy()
    buffer.add([other, last])  # B overwrites all of A's rows before A's end arrives
    assert {(e.t_started, e.is_terminated)
            for e in buffer.sample(num_items=3, n_step=1)} <= {(0, False), (1, False),
                                                                (2, False)}
    assert buffer.get_num_episodes() == 1
    buffer.plane.close()
