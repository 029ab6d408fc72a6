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


def _abandoned(iterator: object, stops: tuple[int, ...]) -> Minibatches:
    """Iterations of ``iterator`` that each stop (``break``) after ``stops[i]`` mini-batches,
    then one to the end."""
    out = []
    for stop in stops:
        for n, mb in enumerate(iterator, 1):
            out.append({k: v.clone() for k, v in mb.policy_batches["p"].items()})
            if n == stop:
                break
    rest, draw = _run(iterator)
    return out + rest, draw


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("size", "minibatch_size", "epochs", "total", "stops"), [
    (5, 2, 3, 0, (3, 1)),   # 8 mini-batches, spanning wraps; abandoned twice
    (64, 16, 2, 0, (8,)),   # abandoned at the last mini-batch: none is left
    (7, 3, 4, 6, (2, 2)),   # num_total_minibatches: RLlib's count lags one per abandonment
    (5, 2, 1, 4, (4,)),
])
def test_an_abandoned_iteration_is_taken_up_where_it_stopped_as_rllibs(
        size: int, minibatch_size: int, epochs: int, total: int, stops: tuple[int, ...],
        overlap: bool) -> None:
    # Defect: an iteration stopped part-way left the iterator spent: the next one yielded no
    # mini-batch, where RLlib's iterator yields those not handed out yet.
    columns = _columns(size)
    kwargs = {"num_epochs": epochs, "minibatch_size": minibatch_size,
              "num_total_minibatches": total}
    np.random.seed(size)
    theirs = _abandoned(MiniBatchCyclicIterator(_batch(columns), shuffle_batch_per_epoch=True,
                                                **kwargs), stops)
    np.random.seed(size)
    ours = _abandoned(ConduitMiniBatchIterator(_batch(columns), shuffle=True,
                                               device=torch.device("cpu"), overlap=overlap,
                                               columns=ColumnCache(), **kwargs), stops)
    planned = len(cyclic_minibatches(size, num_epochs=epochs, minibatch_size=minibatch_size,
                                     shuffle=False))
    assert len(theirs[0]) == (total + len(stops) if total else planned)
    _assert_same(ours, theirs)


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


def _copy(value: object) -> object:
    import tree
    return tree.map_structure(
        lambda v: v.clone() if isinstance(v, torch.Tensor) else np.array(v, copy=True), value)


def _nested_batch(columns: dict[str, object], env_steps: int,
                  module_id: str = "p") -> MultiAgentBatch:
    return MultiAgentBatch({module_id: SampleBatch({k: _copy(v) for k, v in columns.items()})},
                           env_steps)


def _run_nested(iterator: object, module_id: str = "p") -> tuple[list[dict[str, object]], float]:
    out = [{k: _copy(v) for k, v in mb.policy_batches[module_id].items()} for mb in iterator]
    return out, float(np.random.random())


def _assert_same_nested(ours: tuple[list[dict[str, object]], float],
                        theirs: tuple[list[dict[str, object]], float]) -> None:
    import tree
    assert len(ours[0]) == len(theirs[0]) and ours[1] == theirs[1]
    for a, b in zip(ours[0], theirs[0], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            tree.assert_same_structure(a[k], b[k])
            for x, y in zip(tree.flatten(a[k]), tree.flatten(b[k]), strict=True):
                assert type(x) is type(y), k
                if isinstance(x, torch.Tensor):
                    assert x.dtype == y.dtype and torch.equal(x, y), k
                else:
                    assert x.dtype == y.dtype and np.array_equal(x, y), k


def _nested_columns(size: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(size)
    return {"obs": {"pos": torch.randn(size, 3, generator=gen),
                    "mask": np.arange(size * 2, dtype=np.int32).reshape(size, 2)},
            "actions": (torch.randint(0, 4, (size,), generator=gen),
                        torch.randn(size, 2, generator=gen)),
            "advantages": torch.randn(size, generator=gen),
            "np_col": np.arange(size) * 10.0}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("size", "minibatch_size", "epochs", "shuffle"), [
    (10, 4, 2, True), (10, 4, 2, False), (5, 2, 3, True), (16, 4, 2, True)])
def test_nested_columns_are_cut_per_minibatch_as_rllib_cuts_them(
        size: int, minibatch_size: int, epochs: int, shuffle: bool, overlap: bool) -> None:
    columns = _nested_columns(size)
    np.random.seed(3)
    theirs = _run_nested(MiniBatchCyclicIterator(
        _nested_batch(columns, size), num_epochs=epochs, minibatch_size=minibatch_size,
        shuffle_batch_per_epoch=shuffle))
    np.random.seed(3)
    ours = _run_nested(ConduitMiniBatchIterator(
        _nested_batch(columns, size), num_epochs=epochs, minibatch_size=minibatch_size,
        shuffle=shuffle, device=torch.device("cpu"), overlap=overlap))
    assert all(len(mb["obs"]["pos"]) == minibatch_size and len(mb["actions"][0])
               == minibatch_size for mb in ours[0])
    _assert_same_nested(ours, theirs)


def test_the_learner_cuts_nested_action_columns_per_minibatch(
        learner: ConduitPPOTorchLearner) -> None:
    size, mid = 10, "default_policy"
    gen = torch.Generator().manual_seed(0)
    columns = {"obs": torch.randn(size, 4, generator=gen),
               "actions": {"move": torch.arange(size), "fire": torch.arange(size) % 2},
               "advantages": torch.randn(size, generator=gen)}
    kwargs = {"num_epochs": 2, "minibatch_size": 4}
    np.random.seed(4)
    theirs = _run_nested(MiniBatchCyclicIterator(_nested_batch(columns, size, mid),
                                                 shuffle_batch_per_epoch=True, **kwargs), mid)
    np.random.seed(4)
    ours = learner._create_iterator_if_necessary(
        training_data=TrainingData(batch=_nested_batch(columns, size, mid)),
        shuffle_batch_per_epoch=True, **kwargs)
    assert isinstance(ours, ConduitMiniBatchIterator)
    _assert_same_nested(_run_nested(ours, mid), theirs)


@pytest.fixture(scope="module")
def rllib_learner() -> object:
    import gymnasium as gym
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    config = (PPOConfig().environment("CartPole-v1")
              .learners(learner_class=PPOTorchLearner)
              .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[8])))
    return config.build_learner(env=gym.make("CartPole-v1"))


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("rows", "env_steps"), [(12, 6), (6, 12), (7, 3)])
def test_without_minibatch_size_epochs_are_cut_by_env_steps_as_rllibs_learner(
        learner: ConduitPPOTorchLearner, rllib_learner: object, rows: int, env_steps: int,
        shuffle: bool) -> None:
    # Two agents sharing one module: more module rows than env steps (or fewer).
    columns, mid = _columns(rows), "default_policy"
    out = []
    for which in (rllib_learner, learner):
        np.random.seed(9)
        iterator = which._create_iterator_if_necessary(  # type: ignore[attr-defined]
            training_data=TrainingData(batch=_nested_batch(columns, env_steps, mid)),
            num_epochs=2, minibatch_size=None, shuffle_batch_per_epoch=shuffle)
        out.append(_run_nested(iterator, mid))
    assert all(len(mb["obs"]) == env_steps for mb in out[1][0])
    _assert_same_nested(out[1], out[0])
