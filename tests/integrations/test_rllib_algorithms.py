"""DQN, SAC and PPO train with Conduit as their experience path, on a local Ray."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("ray.rllib")
pytest.importorskip("gymnasium")

from ray.rllib.algorithms.dqn import DQNConfig
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.algorithms.sac import SACConfig
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator

from conduit.integrations.rllib import (
    ConduitDQNConfig,
    ConduitEpisodeReplayBuffer,
    ConduitPPOTorchLearner,
    ConduitPrioritizedEpisodeReplayBuffer,
    ConduitSACConfig,
)
from conduit.integrations.rllib.ppo import (
    ColumnCache,
    ConduitMiniBatchIterator,
    delivery_overlaps,
)

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]

TINY = DefaultModelConfig(fcnet_hiddens=[16])
PREFIX = "conduit.integrations.rllib."


def _off_policy(config: DQNConfig, kind: str) -> DQNConfig:
    return (config.env_runners(num_env_runners=0, rollout_fragment_length=16)
            .training(replay_buffer_config={"type": PREFIX + kind, "capacity": 2000,
                                            "alpha": 0.6, "beta": 0.4},
                      train_batch_size=32, num_steps_sampled_before_learning_starts=32)
            .rl_module(model_config=TINY)
            .reporting(min_time_s_per_iteration=0, min_sample_timesteps_per_iteration=64)
            .debugging(seed=0))


def _train(config: DQNConfig, buffer_type: type, iterations: int = 2) -> None:
    algo = config.build_algo()
    try:
        for _ in range(iterations):
            result = algo.train()
        buffer = algo.local_replay_buffer
        assert type(buffer) is buffer_type
        assert len(buffer) == result["env_runners"]["num_env_steps_sampled_lifetime"] > 0
        assert buffer.plane.counters["delivered_batches"] >= 2
        assert np.isfinite(result["learners"]["default_policy"]["qf_loss"])
    finally:
        algo.stop()


@pytest.mark.parametrize("buffer_type", [ConduitEpisodeReplayBuffer,
                                         ConduitPrioritizedEpisodeReplayBuffer])
def test_dqn_trains_with_conduit_replay(buffer_type: type) -> None:
    config = _off_policy(DQNConfig().environment("CartPole-v1"), buffer_type.__name__)
    _train(config.training(n_step=3), buffer_type)


def test_sac_trains_with_conduit_replay() -> None:
    kind = ConduitPrioritizedEpisodeReplayBuffer.__name__
    with pytest.raises(ValueError, match="EpisodeReplayBuffer"):
        _off_policy(SACConfig().environment("Pendulum-v1"), kind).validate()
    _train(_off_policy(ConduitSACConfig().environment("Pendulum-v1"), kind),
           ConduitPrioritizedEpisodeReplayBuffer)


def test_checkpoint_keeps_the_buffer(tmp_path: Path) -> None:
    """A DQN checkpoint restored into a fresh algorithm resumes with the buffer's rows."""
    config = _off_policy(ConduitDQNConfig().environment("CartPole-v1"),
                         ConduitPrioritizedEpisodeReplayBuffer.__name__)
    algo, restored = config.build_algo(), config.build_algo()
    try:
        algo.train()
        algo.save_to_path(tmp_path)
        restored.restore_from_path(tmp_path)
        a, b = algo.local_replay_buffer, restored.local_replay_buffer
        assert len(b) == len(a) > 0
        rows_a, rows_b = (x.plane.state_dict()["buffer"]["store"]["columns"] for x in (a, b))
        assert rows_a.keys() == rows_b.keys()
        assert all(torch.equal(rows_a[k], rows_b[k]) for k in rows_a)
        restored.train()
        assert len(b) > len(a)
    finally:
        algo.stop()
        restored.stop()


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize(("size", "minibatch_size", "epochs", "shuffle"),
                         [(64, 16, 3, True), (50, 16, 2, True), (40, 8, 1, False)])
def test_ppo_minibatches_match_rllib(size: int, minibatch_size: int, epochs: int,
                                     shuffle: bool, device: str, overlap: bool) -> None:
    gen = torch.Generator().manual_seed(size)
    columns = {"obs": torch.randn(size, 4, generator=gen),
               "actions": torch.randint(0, 2, (size,), generator=gen),
               "advantages": torch.randn(size, generator=gen),
               "loss_mask": torch.rand(size, generator=gen) > 0.2}
    columns = {k: v.to(device) for k, v in columns.items()}

    def batch() -> MultiAgentBatch:
        return MultiAgentBatch({"p": SampleBatch({k: v.clone() for k, v in columns.items()})},
                               size)

    def run(iterator: object) -> tuple[list[dict[str, torch.Tensor]], float]:
        out = [{k: v.clone() for k, v in mb.policy_batches["p"].items()} for mb in iterator]
        return out, np.random.random()  # the global generator moved on alike

    kwargs = {"num_epochs": epochs, "minibatch_size": minibatch_size}
    np.random.seed(3)
    theirs = run(MiniBatchCyclicIterator(batch(), shuffle_batch_per_epoch=shuffle, **kwargs))
    np.random.seed(3)
    ours = run(ConduitMiniBatchIterator(batch(), shuffle=shuffle, device=torch.device(device),
                                        overlap=overlap, **kwargs))
    assert len(ours[0]) == len(theirs[0]) and ours[1] == theirs[1]
    for a, b in zip(ours[0], theirs[0]):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].device == b[k].device, k
            assert torch.equal(a[k], b[k]), k


def _train_batch(size: int, seed: int, obs_dim: int = 4) -> MultiAgentBatch:
    gen = torch.Generator().manual_seed(seed)
    return MultiAgentBatch({"p": SampleBatch({
        "obs": torch.randn(size, obs_dim, generator=gen),
        "actions": torch.randint(0, 2, (size,), generator=gen),
        "advantages": torch.randn(size, generator=gen)})}, size)


def _minibatches(iterator: object, *, stop: int | None = None) -> list[dict[str, torch.Tensor]]:
    out = []
    for k, mb in enumerate(iterator):
        if stop is not None and k == stop:
            break
        out.append({key: v.clone() for key, v in mb.policy_batches["p"].items()})
    return out


def _same(ours: list[dict[str, torch.Tensor]], theirs: list[dict[str, torch.Tensor]]) -> bool:
    return len(ours) == len(theirs) and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        for a, b in zip(ours, theirs))


def _rllib_minibatches(batch: MultiAgentBatch, seed: int, **kwargs: object
                       ) -> list[dict[str, torch.Tensor]]:
    np.random.seed(seed)
    return _minibatches(MiniBatchCyclicIterator(batch, **kwargs))


def _column_ptrs(cache: ColumnCache) -> set[int]:
    assert cache._kept is not None
    return {t.data_ptr() for t in cache._kept.tensors.values()}


@pytest.mark.parametrize("overlap", [True, False])
def test_updates_share_their_planes_columns_and_keep_rllibs_minibatches(overlap: bool) -> None:
    cache = ColumnCache()
    ptrs = []
    for update, size in enumerate((32, 30, 35)):  # RLlib's batches differ by a few rows
        kwargs = {"num_epochs": 2, "minibatch_size": 8}
        theirs = _rllib_minibatches(_train_batch(size, update), update,
                                    shuffle_batch_per_epoch=True, **kwargs)
        np.random.seed(update)
        ours = ConduitMiniBatchIterator(_train_batch(size, update), shuffle=True,
                                        device=torch.device("cpu"), overlap=overlap,
                                        columns=cache, **kwargs)
        assert _same(_minibatches(ours), theirs)
        ptrs.append(_column_ptrs(cache))
    assert ptrs[0] == ptrs[1] == ptrs[2]  # 35 rows fit the 32 + 4 kept


def test_updates_gather_their_minibatches_into_the_same_memory() -> None:
    cache = ColumnCache()
    kwargs = {"num_epochs": 1, "minibatch_size": 8, "shuffle": True,
              "device": torch.device("cpu"), "overlap": False, "columns": cache}
    seen = []
    for update in range(2):
        ptrs = set()
        for mb in ConduitMiniBatchIterator(_train_batch(32, update), **kwargs):
            ptrs.add(mb.policy_batches["p"]["obs"].data_ptr())  # then dropped, as RLlib does
        seen.append(ptrs)
    assert seen[0] & seen[1]  # the second update reused the first one's batch memory


def test_columns_are_made_anew_for_more_rows_or_other_fields_and_survive_a_cut() -> None:
    cache = ColumnCache()
    kwargs = {"num_epochs": 1, "minibatch_size": 8, "shuffle": False,
              "device": torch.device("cpu")}
    _minibatches(ConduitMiniBatchIterator(_train_batch(32, 0), columns=cache, **kwargs))
    first = _column_ptrs(cache)
    cut = ConduitMiniBatchIterator(_train_batch(32, 1), columns=cache, **kwargs)
    assert len(_minibatches(cut, stop=2)) == 2  # the learner stops after two mini-batches
    assert _column_ptrs(cache) == first  # given back once that plane was closed
    theirs = _rllib_minibatches(_train_batch(32, 2), 0, num_epochs=1, minibatch_size=8)
    ours = ConduitMiniBatchIterator(_train_batch(32, 2), columns=cache, **kwargs)
    assert _same(_minibatches(ours), theirs)
    _minibatches(ConduitMiniBatchIterator(_train_batch(40, 3), columns=cache, **kwargs))
    assert _column_ptrs(cache) != first  # 40 rows do not fit 32 + 4
    _minibatches(ConduitMiniBatchIterator(_train_batch(40, 4, obs_dim=6), columns=cache,
                                          **kwargs))
    assert cache._kept is not None and cache._kept.spec.fields["obs"].shape == (6,)


def test_ppo_delivers_on_a_worker_only_where_the_worker_has_a_core(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)  # the update computes on every core
        assert not delivery_overlaps(None, torch.device("cpu"))
        assert delivery_overlaps(None, torch.device("cuda", 0))  # it computes on the device
        assert delivery_overlaps(True, torch.device("cpu"))  # a setting is kept
        torch.set_num_threads(3)
        assert delivery_overlaps(None, torch.device("cpu"))
        assert not delivery_overlaps(False, torch.device("cpu"))
    finally:
        torch.set_num_threads(before)
    assert ConduitPPOTorchLearner.overlap is None  # the default decides per machine


def _ppo_weights(learner_class: type | None
                 ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """PPO's weights after building and after two iterations."""
    config = (PPOConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=0)
              .training(train_batch_size_per_learner=256, minibatch_size=64, num_epochs=2)
              .rl_module(model_config=TINY).debugging(seed=0))
    if learner_class is not None:
        config = config.learners(learner_class=learner_class)
    algo = config.build_algo()
    try:
        first = algo.learner_group.get_weights()["default_policy"]
        for _ in range(2):
            algo.train()
        return first, algo.learner_group.get_weights()["default_policy"]
    finally:
        algo.stop()


def test_ppo_trains_as_rllib_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """For a seed, PPO with Conduit's mini-batch path ends with RLlib's own weights."""
    delivered = []
    iterate = ConduitMiniBatchIterator.__iter__

    def counted(self: ConduitMiniBatchIterator) -> object:
        for minibatch in iterate(self):
            delivered.append(len(minibatch))
            yield minibatch

    monkeypatch.setattr(ConduitMiniBatchIterator, "__iter__", counted)
    (start, ours), (_, theirs) = _ppo_weights(ConduitPPOTorchLearner), _ppo_weights(None)
    assert len(delivered) >= 2 * 2 * 4  # iterations x epochs x about 256 / 64
    assert ours.keys() == theirs.keys()
    assert any(not np.array_equal(np.asarray(start[k]), np.asarray(ours[k])) for k in ours)
    for k in ours:
        np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(theirs[k]), err_msg=k)
