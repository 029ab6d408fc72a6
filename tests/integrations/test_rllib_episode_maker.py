"""Sampled transitions made from a template are the episodes RLlib's constructor builds."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("ray.rllib")

from conduit.integrations.rllib.episodes import SampledEpisodes, _attributes
from conduit.integrations.rllib.windows import Transitions

BOX = gym.spaces.Box(-10.0, 10.0, (3,), np.float32)
DISC = gym.spaces.Discrete(4)
OTHER_BOX = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)


def _batch(size: int, episodes: list[int], dim: int = 3) -> Transitions:
    rng = np.random.default_rng(0)
    return Transitions(
        obs=rng.normal(size=(size, dim)).astype(np.float32),
        next_obs=rng.normal(size=(size, dim)).astype(np.float32),
        action=rng.integers(4, size=size).astype(np.int32),
        reward=rng.normal(size=size), terminated=np.arange(size) % 3 == 0,
        truncated=np.arange(size) % 5 == 1, n_step=1 + np.arange(size) % 3,
        episode=np.asarray(episodes, np.int64), t=np.arange(size, dtype=np.int64) * 7,
        index=np.arange(size, dtype=np.int64), weight=rng.random(size).astype(np.float32))


def _table(spaces: dict[int, tuple[Any, Any]]) -> dict[int, Any]:
    return {e: SimpleNamespace(id_=f"episode-{e}", agent_id=f"agent-{e}", module_id=f"m-{e}",
                               observation_space=o, action_space=a)
            for e, (o, a) in spaces.items()}


def _plain(value: Any) -> Any:
    """``value`` in a form ``==`` compares: lookback buffers by their attributes, arrays by
    dtype and contents."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tolist())
    if isinstance(value, np.generic):
        return ("scalar", value.dtype.str, value.item())
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "__dict__") and not isinstance(value, gym.Space):
        return (type(value).__name__, _plain(vars(value)))
    return value


def _assert_same_episode(made: Any, built: Any, *, ids: bool) -> None:
    assert type(made) is type(built)
    for name in _attributes(type(made)):
        if name == "id_" and not ids:
            continue
        assert _plain(getattr(made, name, None)) == _plain(getattr(built, name, None)), name


@pytest.mark.parametrize(("prioritized", "to_numpy"), [(False, False), (True, False),
                                                       (True, True)])
def test_made_episodes_hold_what_the_constructor_gives(prioritized: bool, to_numpy: bool) -> None:
    episodes = [0, 1, 0, 2, 1, 1, 0, 2]
    batch = _batch(len(episodes), episodes)
    table = _table({0: (BOX, DISC), 1: (BOX, DISC), 2: (BOX, DISC)})
    sampled = SampledEpisodes(prioritized=prioritized)
    made = sampled.episodes(batch, table, to_numpy=to_numpy)
    assert len(made) == len(episodes) and len(sampled._makers) == 1
    reference = SampledEpisodes(prioritized=prioritized)
    for i, eps in enumerate(made):
        built = reference._first(batch, table[episodes[i]], i, to_numpy)
        _assert_same_episode(eps, built, ids=not prioritized)
        if prioritized:
            assert len(eps.id_) == 32 and int(eps.id_, 16) >= 0
    if prioritized:
        assert len({e.id_ for e in made}) == len(made)
    # A second sample is made by the cached maker alone, to the same result.
    again = sampled.episodes(batch, table, to_numpy=to_numpy)
    for i, eps in enumerate(again):
        _assert_same_episode(eps, made[i], ids=not prioritized)


def test_made_episodes_own_their_buffers_and_containers() -> None:
    batch = _batch(4, [0, 0, 0, 0])
    made = SampledEpisodes(prioritized=False).episodes(batch, _table({0: (BOX, DISC)}),
                                                       to_numpy=False)
    a, b = made[1], made[2]
    for name in ("observations", "actions", "rewards", "infos"):
        assert getattr(a, name) is not getattr(b, name)
        assert getattr(a, name).data is not getattr(b, name).data
    assert a.extra_model_outputs is not b.extra_model_outputs
    assert a.extra_model_outputs["n_step"] is not b.extra_model_outputs["n_step"]
    assert a.custom_data is not b.custom_data
    a.custom_data["k"] = 1
    a.infos.data[0]["k"] = 1
    a.observations.data.append(a.observations.data[0])
    assert "k" not in b.custom_data and b.infos.data[0] == {} and len(b.observations) == 2


def test_rows_of_other_spaces_are_made_in_their_own_form_and_keep_their_order() -> None:
    episodes = [0, 1, 0, 1, 1]
    batch = _batch(5, episodes)
    table = _table({0: (BOX, DISC), 1: (OTHER_BOX, DISC)})
    sampled = SampledEpisodes(prioritized=False)
    made = sampled.episodes(batch, table, to_numpy=False)
    assert len(sampled._makers) == 2
    assert [e.id_ for e in made] == [f"episode-{e}" for e in episodes]
    assert [e.observation_space for e in made] == [table[e].observation_space for e in episodes]
    assert [int(e.get_actions(0)) for e in made] == batch.action.tolist()
    assert [e.t_started for e in made] == batch.t.tolist()
