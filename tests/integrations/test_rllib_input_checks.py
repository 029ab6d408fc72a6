"""Bad input to the RLlib integration fails at once with a typed error naming what is wrong,
where RLlib's own classes raise (or accept) too: never an endless loop, never a raw error."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("ray.rllib")
pytest.importorskip("gymnasium")

from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator

from conduit.errors import ConfigError, SpecError
from conduit.integrations.rllib.ppo import ConduitMiniBatchIterator, cyclic_minibatches


def _bounded(fn: Callable[[], Any], seconds: float = 20.0) -> Any:
    """``fn()`` in a daemon thread: its result, or the error it raised; fails the test (rather
    than hanging it) when it is still running after ``seconds``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the test
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _batch(rows: int) -> MultiAgentBatch:
    return MultiAgentBatch({"p": SampleBatch({"obs": torch.zeros(rows, 4),
                                              "advantages": torch.zeros(rows)})}, rows)


def _iterate(rows: int, num_epochs: int, minibatch_size: int = 4) -> list[int]:
    it = ConduitMiniBatchIterator(_batch(rows), num_epochs=num_epochs,
                                  minibatch_size=minibatch_size, shuffle=True,
                                  device=torch.device("cpu"), overlap=False)
    return [len(mb.policy_batches["p"]) for mb in it]


# -- 2. PPO mini-batches -----------------------------------------------------------------------


def test_an_empty_module_batch_is_a_spec_error_naming_the_module() -> None:
    with pytest.raises(ValueError):  # RLlib's iterator refuses it too
        list(MiniBatchCyclicIterator(_batch(0), num_epochs=2, minibatch_size=4,
                                     shuffle_batch_per_epoch=True))
    with pytest.raises(SpecError) as exc:
        _bounded(lambda: _iterate(0, num_epochs=2))
    assert exc.value.field is None and "'p'" in str(exc.value) and "empty" in str(exc.value)


def test_no_epochs_yield_no_minibatches_as_rllib() -> None:
    rllib = list(MiniBatchCyclicIterator(_batch(8), num_epochs=0, minibatch_size=4,
                                         shuffle_batch_per_epoch=False))
    assert rllib == [] and _bounded(lambda: _iterate(8, num_epochs=0)) == []
    assert _bounded(lambda: _iterate(0, num_epochs=0)) == []


@pytest.mark.parametrize("size, minibatch_size, field", [(0, 4, "size"),
                                                         (8, 0, "minibatch_size")])
def test_cyclic_minibatches_refuse_sizes_that_never_end_an_epoch(
        size: int, minibatch_size: int, field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _bounded(lambda: cyclic_minibatches(size, num_epochs=2, minibatch_size=minibatch_size,
                                            shuffle=False))
    assert exc.value.field == field
    assert cyclic_minibatches(size, num_epochs=0, minibatch_size=minibatch_size,
                              shuffle=False) == []
    assert [len(p) for p in cyclic_minibatches(8, num_epochs=1, minibatch_size=4,
                                               shuffle=False)] == [4, 4]


def test_a_zero_minibatch_size_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as exc:
        _bounded(lambda: _iterate(8, num_epochs=1, minibatch_size=0))
    assert exc.value.field == "minibatch_size"


# -- 3. replay buffers' constructor arguments --------------------------------------------------


def _episode(steps: int = 5) -> Any:
    import gymnasium as gym
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    box, disc = gym.spaces.Box(-1e6, 1e6, (2,), np.float32), gym.spaces.Discrete(2)
    return SingleAgentEpisode(
        observations=[np.array([0, t], np.float32) for t in range(steps + 1)],
        actions=[0] * steps, rewards=[1.0] * steps, terminated=True, observation_space=box,
        action_space=disc, len_lookback_buffer=0).to_numpy()


def _buffers() -> list[type]:
    from conduit.integrations.rllib import (
        ConduitEpisodeReplayBuffer,
        ConduitPrioritizedEpisodeReplayBuffer,
    )

    return [ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer]


@pytest.mark.parametrize("cls", _buffers(), ids=lambda c: c.__name__)
def test_an_integral_float_capacity_is_taken_as_rllib_takes_it(cls: type) -> None:
    from ray.rllib.utils.replay_buffers import EpisodeReplayBuffer

    EpisodeReplayBuffer(capacity=1e5).add([_episode()])  # RLlib's own buffer takes it
    buffer = cls(capacity=1e5, batch_size_B=4.0, schedule="inline")
    assert buffer.capacity == 100_000 and isinstance(buffer.capacity, int)
    buffer.add([_episode()])
    assert len(buffer) == 5 and len(buffer.sample(n_step=1)) == 4


@pytest.mark.parametrize("cls", _buffers(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("kwargs, field", [
    ({"capacity": 0}, "capacity"), ({"capacity": -5}, "capacity"),
    ({"capacity": 2.5}, "capacity"), ({"capacity": "100"}, "capacity"),
    ({"capacity": True}, "capacity"), ({"capacity": float("inf")}, "capacity"),
    ({"capacity": 100, "seed": -1}, "seed"), ({"capacity": 100, "seed": "x"}, "seed"),
    ({"capacity": 100, "batch_size_B": 0}, "batch_size_B"),
    ({"capacity": 100, "batch_size_B": -3}, "batch_size_B"),
])
def test_bad_sizes_and_seeds_are_refused_at_construction(cls: type, kwargs: dict[str, Any],
                                                         field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        cls(schedule="inline", **kwargs)
    assert exc.value.field == field


def test_priorities_that_are_not_numbers_are_a_priority_error() -> None:
    from conduit.errors import PriorityError

    buffer = _buffers()[1](capacity=100, schedule="inline", seed=0)
    buffer.add([_episode()])
    buffer.sample(num_items=2, n_step=1)
    with pytest.raises(PriorityError, match="priorities"):
        buffer.update_priorities(["a", "b"])
    buffer.update_priorities(np.array([1.0, 2.0]))  # the failed call left the sample in place


@pytest.mark.parametrize("make", [
    lambda: torch.full((2,), 3.0, requires_grad=True) * 1.0,  # TD errors still in the graph
    lambda: torch.full((2,), 3.0, requires_grad=True),
    lambda: torch.full((2, 1), 3.0, dtype=torch.bfloat16),
], ids=["grad", "grad-leaf", "bfloat16"])
def test_priorities_in_any_torch_tensor_are_taken(make: Callable[[], torch.Tensor]) -> None:
    """Defect: a tensor that requires grad failed with torch's raw RuntimeError."""
    buffer = _buffers()[1](capacity=100, schedule="inline", seed=0, alpha=1.0, eps=1e-9)
    buffer.add([_episode()])
    buffer.sample(num_items=2, n_step=1)
    index = torch.from_numpy(buffer._priorities.index.copy())
    buffer.update_priorities(make())
    assert buffer._replay.sampler.inner.priorities(index).tolist() == pytest.approx([3.0, 3.0])


# -- 8. a prioritized buffer's state given to a uniform one ---------------------------------------


def _filled(cls: type, episodes: int = 2) -> Any:
    buffer = cls(capacity=20, schedule="inline", seed=0)
    buffer.add([_episode(10) for _ in range(episodes)])
    return buffer


def test_a_uniform_buffer_refuses_a_prioritized_state_and_keeps_its_own() -> None:
    from conduit.errors import StateError

    uniform, prioritized = _buffers()
    source = _filled(prioritized)
    source.sample(num_items=20, n_step=1)
    source.update_priorities(np.where(source._priorities.index < 10, 1000.0, 1e-3))
    target = _filled(uniform, episodes=1)
    with pytest.raises(StateError, match="prioritized"):
        target.set_state(source.get_state())
    assert len(target) == 10 and len(target.sample(num_items=4, n_step=1)) == 4
    # the other direction is refused too (by the prioritized sampler), and each kind's own
    # state is taken
    with pytest.raises(StateError):
        _filled(prioritized).set_state(_filled(uniform).get_state())
    restored = prioritized(capacity=20, schedule="inline")
    restored.set_state(source.get_state())
    assert len(restored) == 20
    again = uniform(capacity=20, schedule="inline")
    again.set_state(_filled(uniform).get_state())
    assert len(again) == 20
