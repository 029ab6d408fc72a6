"""Conduit's PPO mini-batches are RLlib's for every layout RLlib's cyclic iterator cuts.

RLlib's post-GAE batch sizes are rarely multiples of ``minibatch_size``; then mini-batches
span epoch wraps, there can be more of them than rows, or more than the plane's
``MAX_MINIBATCHES``. Batches a plane cannot hold (a ``uint16`` column) take RLlib's iterator.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("ray.rllib")
pytest.importorskip("gymnasium")

from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator

from conduit.integrations.rllib import ConduitPPOTorchLearner
from conduit.integrations.rllib.ppo import (
    ColumnCache,
    ConduitMiniBatchIterator,
    cyclic_minibatches,
    plane_epoch,
)
from conduit.scheduling import MAX_MINIBATCHES

Minibatches = tuple[list[dict[str, torch.Tensor]], float]


def _columns(size: int, extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(size)
    return {"obs": torch.randn(size, 4, generator=gen),
            "actions": torch.randint(0, 2, (size,), generator=gen),
            "advantages": torch.randn(size, generator=gen), **(extra or {})}


def _batch(columns: dict[str, torch.Tensor], module_id: str = "p") -> MultiAgentBatch:
    return MultiAgentBatch({module_id: SampleBatch({k: v.clone() for k, v in columns.items()})},
                           len(next(iter(columns.values()))))


def _run(iterator: object, module_id: str = "p") -> Minibatches:
    out = [{k: v.clone() for k, v in mb.policy_batches[module_id].items()} for mb in iterator]
    return out, float(np.random.random())  # the global generator moved on alike


def _assert_same(ours: Minibatches, theirs: Minibatches) -> None:
    assert len(ours[0]) == len(theirs[0])
    assert ours[1] == theirs[1]
    for a, b in zip(ours[0], theirs[0], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].device == b[k].device, k
            assert torch.equal(a[k], b[k]), k


def _rllib(columns: dict[str, torch.Tensor], seed: int, *, num_epochs: int,
           minibatch_size: int, shuffle: bool) -> Minibatches:
    np.random.seed(seed)
    return _run(MiniBatchCyclicIterator(_batch(columns), num_epochs=num_epochs,
                                        minibatch_size=minibatch_size,
                                        shuffle_batch_per_epoch=shuffle))


def _conduit(columns: dict[str, torch.Tensor], seed: int, *, num_epochs: int,
             minibatch_size: int, shuffle: bool, overlap: bool,
             cache: ColumnCache | None = None) -> Minibatches:
    np.random.seed(seed)
    return _run(ConduitMiniBatchIterator(_batch(columns), num_epochs=num_epochs,
                                         minibatch_size=minibatch_size, shuffle=shuffle,
                                         device=torch.device("cpu"), overlap=overlap,
                                         columns=cache))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("size", "minibatch_size", "epochs", "shuffle"), [
    (5, 2, 3, True),       # 8 mini-batches from 5 rows, each spanning or ending at a wrap
    (5, 2, 3, False),
    (7, 3, 4, True),       # 10 mini-batches over 7 rows
    (4000, 128, 40, True),  # 1250 mini-batches (> MAX_MINIBATCHES), none at an epoch's end
    (1031, 1, 1, False),   # 1031 (prime) mini-batches of one row (> MAX_MINIBATCHES)
    (2048, 256, 2, True),  # a multiple: the plane's epochs are RLlib's
])
def test_minibatches_match_rllib_for_any_layout(size: int, minibatch_size: int, epochs: int,
                                                shuffle: bool, overlap: bool) -> None:
    columns = _columns(size)
    kwargs = {"num_epochs": epochs, "minibatch_size": minibatch_size, "shuffle": shuffle}
    theirs = _rllib(columns, size, **kwargs)
    _assert_same(_conduit(columns, size, overlap=overlap, **kwargs), theirs)


def test_a_cache_serves_updates_of_awkward_layouts() -> None:
    cache = ColumnCache()
    for size, minibatch_size, epochs in ((5, 2, 3), (4000, 128, 40), (4001, 128, 3)):
        columns = _columns(size)
        kwargs = {"num_epochs": epochs, "minibatch_size": minibatch_size, "shuffle": True}
        _assert_same(_conduit(columns, 7, overlap=False, cache=cache, **kwargs),
                     _rllib(columns, 7, **kwargs))


@pytest.mark.parametrize(("size", "minibatch_size", "epochs"),
                         [(5, 2, 3), (3, 16, 4), (64, 16, 3), (4000, 128, 40), (2048, 1, 1),
                          (1031, 1, 1), (1, 1, 2), (50, 16, 2)])
def test_plane_epochs_divide_the_minibatches_within_the_planes_limits(
        size: int, minibatch_size: int, epochs: int) -> None:
    count = len(cyclic_minibatches(size, num_epochs=epochs, minibatch_size=minibatch_size,
                                   shuffle=False))
    m = plane_epoch(count, size=size, minibatch_size=minibatch_size)
    assert count % m == 0 and 1 <= m <= min(size, MAX_MINIBATCHES)
    if size % minibatch_size == 0 and size // minibatch_size <= MAX_MINIBATCHES:
        assert m == size // minibatch_size  # RLlib's own epochs


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("size", "minibatch_size", "epochs"), [(16, 4, 2), (5, 2, 3)])
def test_a_column_the_plane_refuses_takes_rllibs_iterator(size: int, minibatch_size: int,
                                                         epochs: int, overlap: bool) -> None:
    columns = _columns(size, {"h": torch.arange(size).to(torch.uint16)})
    kwargs = {"num_epochs": epochs, "minibatch_size": minibatch_size, "shuffle": True}
    theirs = _rllib(columns, 11, **kwargs)
    cache = ColumnCache()
    _assert_same(_conduit(columns, 11, overlap=overlap, cache=cache, **kwargs), theirs)
    assert cache._kept is None  # no plane was made


@pytest.fixture(scope="module")
def learner() -> ConduitPPOTorchLearner:
    import gymnasium as gym
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    config = (PPOConfig().environment("CartPole-v1")
              .learners(learner_class=ConduitPPOTorchLearner)
              .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[8])))
    return config.build_learner(env=gym.make("CartPole-v1"))


@pytest.mark.parametrize(("size", "minibatch_size", "epochs", "extra"), [
    (5, 2, 3, False), (4000, 128, 40, False), (16, 4, 2, True), (5, 2, 3, True)])
def test_the_learner_cuts_rllibs_minibatches(learner: ConduitPPOTorchLearner, size: int,
                                             minibatch_size: int, epochs: int,
                                             extra: bool) -> None:
    columns = _columns(size, {"h": torch.arange(size).to(torch.uint16)} if extra else None)
    mid = "default_policy"
    np.random.seed(5)
    theirs = _run(MiniBatchCyclicIterator(_batch(columns, mid), num_epochs=epochs,
                                          minibatch_size=minibatch_size,
                                          shuffle_batch_per_epoch=True), mid)
    np.random.seed(5)
    ours = learner._create_iterator_if_necessary(
        training_data=TrainingData(batch=_batch(columns, mid)), num_epochs=epochs,
        minibatch_size=minibatch_size, shuffle_batch_per_epoch=True)
    assert isinstance(ours, ConduitMiniBatchIterator)
    _assert_same(_run(ours, mid), theirs)
