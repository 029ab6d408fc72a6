"""Conduit's PPO mini-batches stay RLlib's where RLlib's iterator draws, stops and cuts.

RLlib's ``MiniBatchCyclicIterator`` draws each epoch's shuffle from NumPy's global generator
while it cuts the mini-batch that reaches the wrap, stops after ``num_total_minibatches``
where the ``LearnerGroup`` sets it, and slices every column as it is. Conduit's iterator is
compared with it directly, mini-batch by mini-batch, with an update loop that draws from the
same generator between mini-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("ray.rllib")
pytest.importorskip("gymnasium")

import tree
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator

from conduit import ExperienceDataPlane
from conduit.integrations.rllib import ConduitPPOTorchLearner
from conduit.integrations.rllib import ppo as ppo_module
from conduit.integrations.rllib.ppo import (
    ColumnCache,
    ConduitMiniBatchIterator,
    cyclic_minibatches,
    plane_epoch,
)

Run = tuple[list[tuple[dict[str, Any], float]], float]


def _columns(size: int, **extra: Any) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(size)
    return {"obs": torch.randn(size, 3, generator=gen),
            "actions": torch.randint(0, 2, (size,), generator=gen),
            "advantages": torch.randn(size, generator=gen), **extra}


def _copy(value: Any) -> Any:
    if isinstance(value, list):
        return [dict(v) if isinstance(v, dict) else v for v in value]
    return tree.map_structure(
        lambda v: v.detach().clone().requires_grad_(v.requires_grad)
        if isinstance(v, torch.Tensor) else np.array(v, copy=True), value)


def _batch(columns: dict[str, Any], module_id: str = "p") -> MultiAgentBatch:
    rows = SampleBatch({k: _copy(v) for k, v in columns.items()})
    return MultiAgentBatch({module_id: rows}, len(rows))


def _snapshot(value: Any) -> Any:
    """A column as the consumer sees it: its container type, and per leaf the type, dtype,
    requires_grad and values."""
    leaves = []
    for leaf in tree.flatten(value):
        if isinstance(leaf, torch.Tensor):
            leaves.append(("Tensor", leaf.dtype, leaf.requires_grad, leaf.device,
                           leaf.detach().cpu().numpy().tolist()))
        elif isinstance(leaf, np.ndarray):
            leaves.append(("ndarray", leaf.dtype, None, None, leaf.tolist()))
        else:
            leaves.append((type(leaf).__name__, None, None, None, leaf))
    return type(value).__name__, leaves


def _update_loop(iterator: Iterable[MultiAgentBatch], module_id: str = "p", *,
                 draw: bool = True) -> Run:
    """Take every mini-batch as an update would, with ``draw`` drawing from NumPy's global
    generator after each (a loss with NumPy noise); then one more draw."""
    out = []
    for minibatch in iterator:
        rows = minibatch.policy_batches[module_id]
        out.append(({k: _snapshot(v) for k, v in rows.items()},
                    float(np.random.random()) if draw else 0.0))
    return out, float(np.random.random())


def _rllib(columns: dict[str, Any], seed: int, *, draw: bool = True, **kwargs: Any) -> Run:
    np.random.seed(seed)
    return _update_loop(MiniBatchCyclicIterator(_batch(columns), **kwargs), draw=draw)


def _conduit(columns: dict[str, Any], seed: int, *, overlap: bool,
             cache: ColumnCache | None = None, draw: bool = True, **kwargs: Any) -> Run:
    kwargs["shuffle"] = kwargs.pop("shuffle_batch_per_epoch")
    np.random.seed(seed)
    return _update_loop(ConduitMiniBatchIterator(_batch(columns), device=torch.device("cpu"),
                                                 overlap=overlap, columns=cache, **kwargs),
                        draw=draw)


def _assert_same(ours: Run, theirs: Run) -> None:
    assert len(ours[0]) == len(theirs[0])
    for k, (a, b) in enumerate(zip(ours[0], theirs[0], strict=True)):
        assert a[0] == b[0], f"mini-batch {k}"
        assert a[1] == b[1], f"the update's draw after mini-batch {k}"
    assert ours[1] == theirs[1]


LAYOUTS = [
    (16, 4, 3),   # whole epochs: each epoch's last mini-batch ends at the wrap
    (10, 4, 4),   # mini-batches that span a wrap
    (5, 2, 3),    # a wrap every two and a half mini-batches
    (3, 8, 5),    # mini-batches longer than the batch: several wraps in one
    (64, 8, 3),   # eight mini-batches per epoch
]


# -- 1. shuffles drawn where RLlib draws them ------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("size", "minibatch_size", "epochs"), LAYOUTS)
def test_shuffles_interleave_with_the_updates_draws_as_under_rllib(
        size: int, minibatch_size: int, epochs: int, overlap: bool) -> None:
    columns = _columns(size)
    kwargs = {"num_epochs": epochs, "minibatch_size": minibatch_size,
              "shuffle_batch_per_epoch": True}
    _assert_same(_conduit(columns, 7, overlap=overlap, **kwargs), _rllib(columns, 7, **kwargs))


@pytest.mark.parametrize(("size", "minibatch_size", "epochs"), LAYOUTS)
def test_each_shuffle_is_drawn_when_its_minibatch_is_reached(size: int, minibatch_size: int,
                                                             epochs: int) -> None:
    np.random.seed(1)
    rllib = iter(MiniBatchCyclicIterator(_batch(_columns(size)), num_epochs=epochs,
                                         minibatch_size=minibatch_size,
                                         shuffle_batch_per_epoch=True))
    theirs = []
    for minibatch in rllib:
        theirs.append((minibatch.policy_batches["p"]["obs"].clone(), np.random.get_state()[2]))
    layout_class = ppo_module.CyclicLayout
    np.random.seed(1)
    layout = layout_class(size, num_epochs=epochs, minibatch_size=minibatch_size, shuffle=True)
    assert np.random.get_state()[2] == 624  # nothing is drawn before the first mini-batch
    obs = _columns(size)["obs"]
    assert layout.count == len(theirs)
    for k, (mb, position) in enumerate(theirs):
        assert torch.equal(obs[torch.from_numpy(layout.reach(k))], mb)
        assert np.random.get_state()[2] == position, f"mini-batch {k}"
        assert len(layout.parts) > k
    unshuffled = layout_class(size, num_epochs=epochs, minibatch_size=minibatch_size,
                              shuffle=False)
    assert len(unshuffled.parts) == unshuffled.count  # no draw to wait for: all laid out
    eager = cyclic_minibatches(size, num_epochs=epochs, minibatch_size=minibatch_size,
                               shuffle=False)
    assert all(np.array_equal(a, b) for a, b in zip(eager, unshuffled.parts, strict=True))


def test_the_worker_delivers_ahead_except_just_before_a_wrap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    modes: list[int] = []

    class Recording(ExperienceDataPlane):
        def pull(self, **kwargs: Any) -> Any:
            modes.append(self.schedule.overlap_del)
            return super().pull(**kwargs)

    monkeypatch.setattr(ppo_module, "ExperienceDataPlane", Recording)
    columns = _columns(64)
    kwargs = {"num_epochs": 3, "minibatch_size": 8, "shuffle_batch_per_epoch": True}
    _assert_same(_conduit(columns, 2, overlap=True, **kwargs), _rllib(columns, 2, **kwargs))
    assert len(modes) == 24
    # 8 mini-batches per epoch: only the one taken while the worker could reach the next
    # epoch's first (whose rows follow the shuffle its last mini-batch draws) is inline.
    assert [k for k, overlapped in enumerate(modes) if not overlapped] == [6, 14]


# -- 2. num_total_minibatches (several learners) ---------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("size", "minibatch_size", "epochs", "total", "shuffle"), [
    (16, 4, 3, 9, True),    # 2.25 epochs of 4
    (10, 4, 2, 9, True),    # 3.6 epochs, wraps inside mini-batches
    (64, 16, 1, 9, True),   # more mini-batches than num_epochs asks for
    (64, 16, 3, 5, True),   # fewer
    (5, 2, 3, 7, False),
    (8, 4, 0, 3, True),     # num_epochs does not count where the total is set
])
def test_num_total_minibatches_stops_as_rllib(size: int, minibatch_size: int, epochs: int,
                                              total: int, shuffle: bool,
                                              overlap: bool) -> None:
    columns = _columns(size)
    kwargs = {"num_epochs": epochs, "minibatch_size": minibatch_size,
              "shuffle_batch_per_epoch": shuffle, "num_total_minibatches": total}
    theirs = _rllib(columns, 4, **kwargs)
    assert len(theirs[0]) == total
    cache = ColumnCache()
    _assert_same(_conduit(columns, 4, overlap=overlap, cache=cache, **kwargs), theirs)
    assert cache._kept is not None  # delivered by a plane


def test_plane_epochs_divide_a_total_that_is_not_whole_epochs() -> None:
    assert 9 % plane_epoch(9, size=16, minibatch_size=4) == 0
    assert plane_epoch(8, size=16, minibatch_size=4) == 4


@pytest.fixture(scope="module")
def learners() -> tuple[ConduitPPOTorchLearner, Any]:
    import gymnasium as gym
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    def build(cls: type) -> Any:
        config = (PPOConfig().environment("CartPole-v1").learners(learner_class=cls)
                  .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[8])))
        return config.build_learner(env=gym.make("CartPole-v1"))

    return build(ConduitPPOTorchLearner), build(PPOTorchLearner)


def _sharded_kwargs() -> dict[str, Any]:
    """What RLlib's LearnerGroup passes each of two learners for 400 env steps (64 rows a
    mini-batch, 3 epochs)."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    episodes = [SingleAgentEpisode(observations=[np.zeros(4, np.float32)] * 101,
                                   actions=[0] * 100, rewards=[1.0] * 100,
                                   len_lookback_buffer=0) for _ in range(4)]
    shards = TrainingData(episodes=episodes).shard(num_shards=2, minibatch_size=64,
                                                   num_epochs=3, len_lookback_buffer=0)
    (_, kwargs), _ = shards
    return kwargs


def test_a_learner_of_several_keeps_the_plane_path_and_rllibs_minibatches(
        learners: tuple[ConduitPPOTorchLearner, Any]) -> None:
    sharded = _sharded_kwargs()
    assert sharded["num_total_minibatches"] > 0
    ours, theirs = learners
    columns, mid = _columns(200), "default_policy"
    runs = []
    for learner in (theirs, ours):
        np.random.seed(6)
        iterator = learner._create_iterator_if_necessary(
            training_data=TrainingData(batch=_batch(columns, mid)), num_epochs=3,
            minibatch_size=64, shuffle_batch_per_epoch=True, **sharded)
        runs.append((iterator, _update_loop(iterator, mid)))
    assert isinstance(runs[1][0], ConduitMiniBatchIterator) and runs[1][0].rllib is None
    assert len(runs[0][1][0]) == sharded["num_total_minibatches"]
    _assert_same(runs[1][1], runs[0][1])


# -- 3. rows of columns kept outside the plane, whatever device the delivery is on ------------


def _nested_numpy_columns(size: int) -> dict[str, Any]:
    return _columns(size, np_col=np.arange(size) * 10.0,
                    obs_dict={"pos": np.arange(size * 2, dtype=np.int32).reshape(size, 2),
                              "vel": torch.arange(size, dtype=torch.float32)},
                    **{"not/a/name": torch.arange(size)})


@pytest.mark.parametrize("overlap", [False, True])
def test_kept_columns_are_cut_with_host_rows_wherever_the_delivered_index_lives(
        monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    # The plane delivers its rows on the learner's device (there: CUDA). A delivered index
    # that is not in host memory (here: on the meta device, which holds no values) must not
    # be what numpy leaves are cut with.
    class Elsewhere(ExperienceDataPlane):
        def pull(self, **kwargs: Any) -> Any:
            batch = dict(super().pull(**kwargs))
            batch["_index"] = batch["_index"].to("meta")
            return batch

    monkeypatch.setattr(ppo_module, "ExperienceDataPlane", Elsewhere)
    columns = _nested_numpy_columns(10)
    kwargs = {"num_epochs": 2, "minibatch_size": 4, "shuffle_batch_per_epoch": True,
              "draw": False}
    cache = ColumnCache()
    _assert_same(_conduit(columns, 5, overlap=overlap, cache=cache, **kwargs),
                 _rllib(columns, 5, **kwargs))
    assert cache._kept is not None  # delivered by a plane


# -- 5. columns RLlib cuts otherwise take RLlib's iterator -----------------------------------


ODD: dict[str, Callable[[int], dict[str, Any]]] = {
    "infos": lambda n: {"infos": [{"i": i} for i in range(n)]},
    "requires_grad": lambda n: {"r": torch.arange(n, dtype=torch.float32).requires_grad_()},
    "requires_grad_nested": lambda n: {
        "d": {"a": torch.arange(n, dtype=torch.float32).requires_grad_(),
              "b": np.arange(n)}},
    "numpy_of_other_length": lambda n: {"short": np.arange(n - 3)},
    "tensor_of_other_length": lambda n: {"long": torch.arange(n + 2)},
    "nested_leaf_of_other_length": lambda n: {"t": (torch.arange(n), np.arange(n + 1))},
}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("case", sorted(ODD))
def test_columns_rllib_cuts_otherwise_come_out_as_rllibs(case: str, overlap: bool) -> None:
    size = 10
    columns = _columns(size, **ODD[case](size))
    kwargs = {"num_epochs": 2, "minibatch_size": 4, "shuffle_batch_per_epoch": True,
              "draw": False}
    cache = ColumnCache()
    theirs, ours = (_outcome(lambda: _rllib(columns, 8, **kwargs)),
                    _outcome(lambda: _conduit(columns, 8, overlap=overlap, cache=cache,
                                              **kwargs)))
    if isinstance(theirs, str):  # RLlib's shuffle cannot index a shorter column
        assert ours == theirs
    else:
        _assert_same(ours, theirs)  # type: ignore[arg-type]
    assert cache._kept is None  # RLlib's iterator cut it


def _outcome(run: Callable[[], Run]) -> Run | str:
    try:
        return run()
    except Exception as exc:  # compared with RLlib's own
        return f"{type(exc).__name__}: {exc}"


def test_stock_ppo_columns_and_nested_arrays_keep_the_plane_path() -> None:
    size = 24
    gen = torch.Generator().manual_seed(0)
    columns = {  # the columns RLlib's PPO learner connector hands the learner (CartPole)
        "obs": torch.randn(size, 4, generator=gen),
        "actions": torch.randint(0, 2, (size,), generator=gen, dtype=torch.int32),
        "rewards": torch.ones(size), "terminateds": torch.zeros(size, dtype=torch.bool),
        "truncateds": torch.zeros(size, dtype=torch.bool),
        "loss_mask": torch.ones(size, dtype=torch.bool),
        "action_dist_inputs": torch.randn(size, 2, generator=gen),
        "action_logp": torch.randn(size, generator=gen),
        "weights_seq_no": torch.zeros(size, dtype=torch.int64),
        "advantages": torch.randn(size, generator=gen),
        "value_targets": torch.randn(size, generator=gen),
        "mask": {"a": np.arange(size), "b": (torch.arange(size),)},
    }
    kwargs = {"num_epochs": 3, "minibatch_size": 8, "shuffle_batch_per_epoch": True,
              "draw": False}
    cache = ColumnCache()
    _assert_same(_conduit(columns, 3, overlap=True, cache=cache, **kwargs),
                 _rllib(columns, 3, **kwargs))
    assert cache._kept is not None


def test_a_second_iteration_yields_nothing_as_rllibs() -> None:
    kwargs = {"num_epochs": 2, "minibatch_size": 4}
    rllib = MiniBatchCyclicIterator(_batch(_columns(10)), shuffle_batch_per_epoch=True,
                                    **kwargs)
    ours = ConduitMiniBatchIterator(_batch(_columns(10)), shuffle=True,
                                    device=torch.device("cpu"), overlap=False, **kwargs)
    assert len(list(rllib)) == len(list(ours)) == 5
    assert list(rllib) == list(ours) == []
