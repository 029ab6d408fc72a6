"""Defects a second review of the RLlib buffers found: each test fails on the code before its
fix."""

from __future__ import annotations

import copy
import gc
import threading
import time
import weakref

import numpy as np
import pytest

pytest.importorskip("ray.rllib")
gym = pytest.importorskip("gymnasium")

from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402
from ray.rllib.utils.replay_buffers import PrioritizedEpisodeReplayBuffer  # noqa: E402

from conduit import Schedule  # noqa: E402
from conduit.errors import BackpressureTimeout, SpecError, StateError  # noqa: E402
from conduit.integrations.rllib import (  # noqa: E402
    ConduitEpisodeReplayBuffer,
    ConduitPrioritizedEpisodeReplayBuffer,
)

BOX = gym.spaces.Box(-1e6, 1e6, (1,), np.float32)
DISC = gym.spaces.Discrete(2)


def _episode(id_: str, steps: int, *, start: float = 0.0, reward: object = 1.0,
             terminated: bool = True) -> SingleAgentEpisode:
    """``steps`` steps whose observations count up from ``start``."""
    eps = SingleAgentEpisode(id_=id_, observation_space=BOX, action_space=DISC)
    eps.add_env_reset(np.full(1, start, np.float32), {})
    for k in range(steps):
        eps.add_env_step(np.full(1, start + k + 1, np.float32), 0, reward, {},
                         terminated=terminated and k == steps - 1)
    return eps


def _check_transitions(sampled: list[SingleAgentEpisode]) -> None:
    """Every sampled transition stays inside one episode: the episodes below count their
    observations up by one per step, each from its own multiple of 1000, so the next
    observation lies 1 to n steps on within the same thousand (windows cut short by the
    episode's end hold fewer steps)."""
    for e in sampled:
        obs, nxt = (float(o[0]) for o in e.get_observations())
        n = int(e.get_extra_model_outputs("n_step")[0])
        assert 0 < nxt - obs <= n and obs // 1000 == nxt // 1000, (obs, nxt, n)


def _conduit_threads() -> int:
    return sum(t.name.startswith("conduit-") for t in threading.enumerate())


def test_a_dropped_buffer_is_collected_with_its_plane_and_threads() -> None:
    # Defect: the plane's delivery operator held the plane and the buffer, and the plane's
    # finalizer holds the operator: no buffer was ever freed, nor its worker threads.
    before = _conduit_threads()
    refs = []
    for k in range(3):
        buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=1000, schedule="prefetch")
        buf.add(_episode(f"e{k}", 8, start=100.0 * k))
        buf.sample(batch_size_B=4, n_step=1)
        refs.append((weakref.ref(buf), weakref.ref(buf.plane)))
        del buf
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
            any(b() is not None or p() is not None for b, p in refs)
            or _conduit_threads() > before):
        gc.collect()
        time.sleep(0.05)
    assert all(b() is None and p() is None for b, p in refs)
    assert _conduit_threads() <= before  # (threads of earlier tests may end meanwhile)


def test_rows_an_add_acknowledged_before_its_flush_raised_are_linked_when_stored() -> None:
    # Defect: under overlapped ingestion the rows of an add whose flush raised (a timeout, an
    # interrupt) landed after the add gave up on them, without links; later adds linked the
    # wrong slots and samples raised KeyError or mixed episodes.
    buf = ConduitEpisodeReplayBuffer(capacity=10_000, seed=0, schedule="prefetch")
    buf.add(_episode("a", 10))
    buf.sample(batch_size_B=4)
    plane = buf.plane
    plane.set_schedule(Schedule(1, 1, 1, 1))  # overlapped ingestion, as "auto" starts
    real_flush = plane.flush
    plane.flush = lambda timeout=None: real_flush(timeout=0.0)
    # The rows are acknowledged, not stored, when the flush gives up.
    with plane.paused(), pytest.raises(BackpressureTimeout):
        buf.add([_episode(f"b{k}", 10, start=1000.0 * (k + 1)) for k in range(20)])
    plane.flush = real_flush
    buf.add(_episode("c", 10, start=90_000.0))
    assert buf._rows.written == buf._replay.sampler.ring_rows == 220 and len(buf) == 220
    for _ in range(20):
        _check_transitions(buf.sample(batch_size_B=32, n_step=3))


@pytest.mark.parametrize("prioritized", [False, True])
def test_an_episode_that_ended_in_the_buffer_cannot_be_added_again(prioritized: bool) -> None:
    # Defect: a finished episode added twice became a second episode (its rows twice);
    # RLlib's buffers refuse it.
    cls = ConduitPrioritizedEpisodeReplayBuffer if prioritized else ConduitEpisodeReplayBuffer
    buf = cls(capacity=100, schedule="inline")
    eps = _episode("a", 5)
    buf.add(eps)
    with pytest.raises(SpecError) as err:
        buf.add(eps)
    assert err.value.field == "id_" and len(buf) == 5 and buf.get_num_episodes() == 1
    with pytest.raises(SpecError):  # twice within one add
        cls(capacity=100, schedule="inline").add([_episode("x", 3), _episode("x", 3)])


def test_a_reward_of_shape_1_is_one_number_and_other_shapes_are_refused_before_storing() -> None:
    # Defect: a (1,)-shaped reward failed in link() after the rows were pushed: a raw
    # ValueError, rows without links, and a KeyError on the next sample. RLlib samples them.
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=1000, seed=0, schedule="inline")
    buf.add(_episode("a", 10))
    buf.add(_episode("b", 10, start=100.0, reward=np.array([2.0], np.float32)))
    rllib = PrioritizedEpisodeReplayBuffer(capacity=1000)
    rllib.add(_episode("b", 10, start=100.0, reward=np.array([2.0], np.float32)))
    assert len(buf) == 20 and buf._rows.written == buf._replay.sampler.ring_rows == 20
    got = {float(e.get_rewards()[0]) for e in buf.sample(batch_size_B=64, n_step=1)}
    assert got <= {1.0, 2.0} and 2.0 in got
    for bad in (np.array([1.0, 2.0]), "1.0", None):
        with pytest.raises(SpecError) as err:
            buf.add(_episode(f"bad{bad!s:.3}", 3, start=500.0, reward=bad))
        assert err.value.field == "reward"
        assert buf._rows.written == buf._replay.sampler.ring_rows == 20


def test_a_refused_state_leaves_no_plane_or_thread_behind() -> None:
    uniform = ConduitEpisodeReplayBuffer(capacity=50, schedule="inline")
    uniform.add(_episode("a", 8))
    wrong = uniform.get_state()
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=50, schedule="prefetch")
    buf.add(_episode("a", 8))
    buf.sample(batch_size_B=4)
    before = _conduit_threads()
    for _ in range(3):
        with pytest.raises(StateError):
            buf.set_state(wrong)
    gc.collect()
    assert _conduit_threads() <= before  # (each refusal left one more before)


@pytest.mark.parametrize("corrupt", ["written", "episode"])
def test_an_inconsistent_state_is_refused_at_set_state(corrupt: str) -> None:
    # Defect: links that disagree with the ring, or rows of episodes the table lacks, loaded
    # and failed later with a raw KeyError on sample.
    buf = ConduitEpisodeReplayBuffer(capacity=100, seed=0, schedule="inline")
    buf.add(_episode("a", 10))
    state = copy.deepcopy(buf.get_state())
    if corrupt == "written":
        state["rows"]["written"] += 5
    else:
        state["rows"]["episode"][:] = 77
    fresh = ConduitEpisodeReplayBuffer(capacity=100, seed=0, schedule="inline")
    with pytest.raises(StateError):
        fresh.set_state(state)
    assert len(fresh) == 0


@pytest.mark.parametrize("prioritized", [False, True])
def test_episodes_with_equal_spaces_of_their_own_share_one_episode_maker(prioritized: bool) -> None:
    # Defect: episodes from remote env runners each carry their own (equal) space objects;
    # sampled transitions were built per space object, so nearly every row took RLlib's
    # episode constructor (~0.1 ms each) and the makers' cache churned.
    cls = ConduitPrioritizedEpisodeReplayBuffer if prioritized else ConduitEpisodeReplayBuffer
    buf = cls(capacity=1000, seed=0, schedule="inline")
    for k in range(40):
        eps = SingleAgentEpisode(id_=f"e{k}", observation_space=copy.deepcopy(BOX),
                                 action_space=copy.deepcopy(DISC))
        eps.add_env_reset(np.full(1, 1000.0 * k, np.float32), {})
        for t in range(5):
            eps.add_env_step(np.full(1, 1000.0 * k + t + 1, np.float32), 0, 1.0, {},
                             terminated=t == 4)
        buf.add(eps)
    buf.set_state(buf.get_state())  # (a restored table shares its spaces too)
    for _ in range(5):
        _check_transitions(buf.sample(batch_size_B=32, n_step=1))
    assert len(buf._build._makers) == 1
