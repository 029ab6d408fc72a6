"""Defects a review of the RLlib buffers found: each test fails on the code before its fix."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray.rllib")
gym = pytest.importorskip("gymnasium")

from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402
from ray.rllib.utils.replay_buffers import (  # noqa: E402
    EpisodeReplayBuffer,
    PrioritizedEpisodeReplayBuffer,
)

from conduit.errors import ConfigError, EmptyBufferError, PlaneClosedError, SpecError  # noqa: E402
from conduit.integrations.rllib import (  # noqa: E402
    ConduitEpisodeReplayBuffer,
    ConduitPrioritizedEpisodeReplayBuffer,
    ConduitSACConfig,
)
from conduit.integrations.rllib import schedule as rllib_schedule  # noqa: E402
from conduit.integrations.rllib.episode_rows import _numeric  # noqa: E402

BOX = gym.spaces.Box(-1e6, 1e6, (1,), np.float32)
DISC = gym.spaces.Discrete(2)


def _episode(id_: str, steps: int, *, start: float = 0.0, terminated: bool = True
             ) -> SingleAgentEpisode:
    """``steps`` steps whose observations count up from ``start``."""
    eps = SingleAgentEpisode(id_=id_, observation_space=BOX, action_space=DISC)
    eps.add_env_reset(np.full(1, start, np.float32), {})
    for k in range(steps):
        eps.add_env_step(np.full(1, start + k + 1, np.float32), 0, 1.0, {},
                         terminated=terminated and k == steps - 1)
    return eps


def _continued(eps: SingleAgentEpisode, steps: int) -> SingleAgentEpisode:
    """``eps``'s ``cut()`` successor with ``steps`` more steps, observations counting on."""
    nxt = eps.cut()
    for _ in range(steps):
        nxt.add_env_step(np.full(1, float(nxt.get_observations(-1)[0]) + 1, np.float32), 0,
                         1.0, {})
    return nxt


def _in_step(buffer: ConduitEpisodeReplayBuffer) -> bool:
    return buffer._replay.sampler.ring_rows == buffer._rows.written == len(buffer.plane.buffer)


# -- D1: a failed draw made ahead never costs an add its rows -----------------------------------


@pytest.mark.parametrize("schedule", ["prefetch", "auto"])
def test_a_failed_draw_ahead_does_not_cost_the_next_add_its_rows(
        schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect: after a sample found no complete 3-step window, the worker drew again, failed
    and latched the failure; the next add linked its episodes, then its push raised that
    failure, so links and ring disagreed and later samples were corrupt. (``"auto"`` on a
    machine where a worker has a core: it starts overlapped.)"""
    monkeypatch.setattr(rllib_schedule, "worker_has_core", lambda **_: True)
    buffer = ConduitPrioritizedEpisodeReplayBuffer(capacity=1000, seed=0, schedule=schedule)
    chunks = [_episode(f"e{i}", 2, terminated=False) for i in range(4)]
    buffer.add(chunks)
    with pytest.raises(EmptyBufferError, match="3-step"):
        buffer.sample(num_items=8, n_step=3)
    deadline = time.monotonic() + 10  # the worker draws again for n_step 3 (and fails)
    while (buffer.plane.failed is None and buffer.plane.stats()["staged_batches"] < 1
           and time.monotonic() < deadline):
        time.sleep(0.005)
    buffer.add([_continued(e, 10) for e in chunks])
    assert len(buffer) == 48 and _in_step(buffer)
    for eps in buffer.sample(num_items=64, n_step=3):
        assert eps.get_observations(-1)[0] == eps.get_observations(0)[0] + 3
    buffer.plane.close()


def test_an_add_whose_push_raises_leaves_the_links_as_they_were() -> None:
    """Defect: the links were committed before the push, so a push that raised left the
    buffer counting rows its ring never received."""
    buffer = ConduitEpisodeReplayBuffer(capacity=100, seed=0, schedule="inline")
    buffer.add([_episode("a", 5)])
    buffer.plane.close()
    with pytest.raises(PlaneClosedError):
        buffer.add([_episode("b", 5)])
    assert buffer._rows.written == 5 and buffer.get_num_episodes() == 1


def test_an_add_whose_plane_cannot_be_built_leaves_no_rows_behind() -> None:
    """Defect: the first add linked its episodes before building the plane; a plane refused
    (here its placement) left episodes counted that no plane held."""
    buffer = ConduitEpisodeReplayBuffer(capacity=100, placement="nowhere", schedule="inline")
    with pytest.raises(ConfigError) as ei:
        buffer.add([_episode("a", 5)])
    assert ei.value.field == "placement"
    assert buffer._rows.written == 0 and buffer.get_num_episodes() == 0


# -- D2: rare complete windows are drawn, not given up on ---------------------------------------


def _sparse() -> list[SingleAgentEpisode]:
    """2000 one-step episodes and one of three steps: one row starts a complete 3-step
    window, two a complete 2-step window."""
    return [_episode(f"e{i}", 1, start=-10.0 * i) for i in range(2000)] + [
        _episode("long", 3, start=5000.0)]


def test_rare_complete_windows_are_drawn_as_rllib_draws_them() -> None:
    """Defect: after 1000 redraw rounds the buffer raised EmptyBufferError though a row
    with a complete window existed; RLlib's buffer returns a batch."""
    episodes = _sparse()
    theirs = PrioritizedEpisodeReplayBuffer(capacity=5000)
    theirs.add(episodes)
    want = theirs.sample(num_items=16, n_step=3)
    buffer = ConduitPrioritizedEpisodeReplayBuffer(capacity=5000, seed=0, schedule="inline")
    buffer.add(episodes)
    got = buffer.sample(num_items=16, n_step=3)
    assert len(got) == len(want) == 16
    for eps in (*got, *want):
        assert (eps.get_observations(0)[0], eps.get_observations(-1)[0]) == (5000.0, 5003.0)
        assert eps.get_extra_model_outputs("weights", 0) == pytest.approx(1.0)
    got = buffer.sample(num_items=32, n_step=(2, 4))
    assert {(float(e.get_observations(0)[0]), int(e.get_extra_model_outputs("n_step", 0)))
            for e in got} <= {(5000.0, 2), (5000.0, 3), (5001.0, 2)}


def test_rows_drawn_among_complete_windows_keep_their_priorities_and_weights() -> None:
    """Rows taken among those with a complete window follow their priorities, with the
    importance weights RLlib gives a redrawn row: ``(P_min / P(i))^β`` over all rows."""
    buffer = ConduitPrioritizedEpisodeReplayBuffer(capacity=1000, alpha=1.0, eps=1e-9,
                                                   seed=0, schedule="inline")
    buffer.add([_episode("a", 3, start=0.0), _episode("b", 3, start=100.0),
                *(_episode(f"e{i}", 1, start=1000.0 + 10 * i) for i in range(50))])
    buffer.sample(num_items=56, n_step=1)
    index = buffer._priorities.index
    buffer.update_priorities(np.where(index == 0, 1.0, np.where(index == 3, 9.0, 0.5)))
    buffer._replay.sampler.max_rounds = 0  # every row is drawn among the complete ones
    got = buffer.sample(num_items=1000, n_step=3, beta=0.5)
    starts = np.array([float(e.get_observations(0)[0]) for e in got])
    assert set(starts.tolist()) == {0.0, 100.0}
    assert np.mean(starts == 100.0) == pytest.approx(0.9, abs=0.05)
    for eps in got:
        leaf = 1.0 if eps.get_observations(0)[0] == 0.0 else 9.0
        assert eps.get_extra_model_outputs("weights", 0) == pytest.approx(
            (0.5 / leaf) ** 0.5, rel=1e-5)


def test_no_complete_window_at_all_is_an_empty_buffer_error_saying_so() -> None:
    buffer = ConduitPrioritizedEpisodeReplayBuffer(capacity=100, seed=0, schedule="inline")
    buffer.add([_episode(f"e{i}", 2) for i in range(5)])
    with pytest.raises(EmptyBufferError, match=r"no row among the 10 .* complete 3-step"):
        buffer.sample(num_items=4, n_step=3)
    assert len(buffer.sample(num_items=4, n_step=2)) == 4


# -- D3: a chunk that does not continue its stored episode is refused ---------------------------


@pytest.mark.parametrize("prioritized", [False, True])
def test_a_chunk_that_does_not_continue_its_episode_is_refused(prioritized: bool) -> None:
    """Defect: a chunk added twice (or after a lost one) was linked to the stored episode,
    so n-step windows ran into the wrong steps; RLlib's buffer refuses it."""
    first = _episode("A", 6, terminated=False).to_numpy()
    rllib = EpisodeReplayBuffer(capacity=100)
    rllib.add(first)
    with pytest.raises(AssertionError):
        rllib.add(first)
    cls = ConduitPrioritizedEpisodeReplayBuffer if prioritized else ConduitEpisodeReplayBuffer
    buffer = cls(capacity=100, seed=0, schedule="inline")
    buffer.add(first)
    second = _continued(first, 3)
    gap = _continued(second, 2)
    for bad in (first, gap):
        with pytest.raises(SpecError) as ei:
            buffer.add([_episode("other", 2), bad])
        assert ei.value.field == "t_started"
        assert len(buffer) == 6 and buffer.get_num_episodes() == 1
    buffer.add([second, _continued(second, 2)])  # in order, in one add: accepted
    assert len(buffer) == 11
    for eps in buffer.sample(num_items=50, n_step=3, gamma=1.0):  # steps in the window
        assert eps.get_observations(-1)[0] - eps.get_observations(0)[0] == \
            pytest.approx(eps.get_rewards(0))


# -- D4: Tuple and Dict spaces, and values numpy cannot stack -----------------------------------


def _tuple_episode(space: Any) -> SingleAgentEpisode:
    obs_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    obs_space.seed(0)
    space.seed(0)
    eps = SingleAgentEpisode(observation_space=obs_space, action_space=space)
    eps.add_env_reset(obs_space.sample(), {})
    for k in range(4):
        eps.add_env_step(obs_space.sample(), space.sample(), 1.0, {}, terminated=k == 3)
    return eps


@pytest.mark.parametrize("space", [
    gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Box(-1, 1, (3,), np.float32))),
    gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(3))),
], ids=["ragged", "stackable"])
def test_a_tuple_action_space_is_a_spec_error(space: Any) -> None:
    """Defect: a ragged Tuple gave numpy's bare ValueError; a stackable one was stored and
    sampled as one array where RLlib returns the tuple."""
    buffer = ConduitEpisodeReplayBuffer(capacity=100, schedule="inline")
    with pytest.raises(SpecError) as ei:
        buffer.add(_tuple_episode(space))
    assert ei.value.field == "action" and "Tuple" in str(ei.value)
    assert len(buffer) == 0 and buffer.plane is None


def test_values_numpy_cannot_stack_are_a_spec_error() -> None:
    with pytest.raises(SpecError) as ei:
        _numeric("obs", [np.zeros(2), np.zeros(3)], 2)
    assert ei.value.field == "obs"


# -- D5: t_started counts from the stored episode's first chunk ---------------------------------


@pytest.mark.parametrize("prioritized", [False, True])
def test_t_started_is_the_index_in_the_stored_episode_as_in_rllib(prioritized: bool) -> None:
    """Defect: a transition of an episode whose first stored chunk is a ``cut()`` successor
    carried the episode's global t; RLlib's buffers give its index in the stored episode."""
    chunk = _continued(_episode("A", 10, terminated=False), 5).to_numpy()  # t_started 10
    more = _continued(chunk, 2).to_numpy()
    theirs = (PrioritizedEpisodeReplayBuffer(capacity=100) if prioritized
              else EpisodeReplayBuffer(capacity=100))
    cls = ConduitPrioritizedEpisodeReplayBuffer if prioritized else ConduitEpisodeReplayBuffer
    ours = cls(capacity=100, seed=0, schedule="inline")
    kwargs: dict[str, Any] = {"num_items": 100, "n_step": 1}
    if not prioritized:
        kwargs |= {"batch_length_T": 0, "sample_episodes": True}
    for buffer in (theirs, ours):
        buffer.add(chunk)
        buffer.add(more)
    want = {(float(e.get_observations(0)[0]), e.t_started) for e in theirs.sample(**kwargs)}
    got = {(float(e.get_observations(0)[0]), e.t_started) for e in ours.sample(**kwargs)}
    assert got == want == {(10.0 + k, k) for k in range(7)}


# -- D6: include_infos ----------------------------------------------------------------------------


@pytest.mark.parametrize("prioritized", [False, True])
def test_include_infos_is_refused_as_the_other_unsupported_options(prioritized: bool) -> None:
    """Defect: include_infos=True was ignored, and the sampled infos silently empty."""
    cls = ConduitPrioritizedEpisodeReplayBuffer if prioritized else ConduitEpisodeReplayBuffer
    buffer = cls(capacity=100, seed=0, schedule="inline")
    buffer.add(_episode("a", 5))
    with pytest.raises(ConfigError) as ei:
        buffer.sample(num_items=2, n_step=1, include_infos=True)
    assert ei.value.field == "include_infos"
    assert len(buffer.sample(num_items=2, n_step=1)) == 2


# -- D7: ConduitSACConfig takes the buffer as a class or by any module path ---------------------


class _MyBuffer(ConduitPrioritizedEpisodeReplayBuffer):
    pass


@pytest.mark.parametrize("kind", [
    "conduit.integrations.rllib.replay.ConduitPrioritizedEpisodeReplayBuffer",
    "conduit.integrations.rllib.replay.ConduitEpisodeReplayBuffer",
    ConduitPrioritizedEpisodeReplayBuffer, _MyBuffer,
])
def test_sac_config_accepts_a_conduit_buffer_class_or_module_path(kind: Any) -> None:
    """Defect: only the two exact strings of the package's namespace were accepted."""
    config = ConduitSACConfig().environment("Pendulum-v1").training(
        replay_buffer_config={"type": kind, "capacity": 1000})
    config.validate()
    assert config.replay_buffer_config["type"] is kind
    with pytest.raises(ValueError):  # anything else is still left to SAC's validation
        ConduitSACConfig().environment("Pendulum-v1").training(
            replay_buffer_config={"type": "conduit.integrations.rllib.NoSuchBuffer",
                                  "capacity": 1000}).validate()
