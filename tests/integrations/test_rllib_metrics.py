"""The RLlib buffers' metrics logger reduces what RLlib's ``MetricsLogger`` reduces."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray.rllib")

from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from conduit.integrations.rllib.metrics import CachedMetricsLogger

#: Keys and ``log_value`` arguments of several kinds of Stats, nested at several depths.
_KEYS: list[tuple[Any, dict[str, Any]]] = [
    ("zeta", {"reduce": "mean", "window": 5}),
    (("agent", "b", "steps"), {"reduce": "sum"}),
    (("agent", "a", "steps"), {"reduce": "lifetime_sum"}),
    (("agent", "a", "n_step"), {"reduce": "ema", "ema_coeff": 0.1}),
    ("low", {"reduce": "min", "window": 4}),
    ("spread", {"reduce": "percentiles", "window": 6}),
    ("alpha", {"reduce": "max", "window": 3}),
    (("module", "default_policy", "last"), {"reduce": "item"}),
    ("count", {"reduce": "sum", "with_throughput": True}),
]


def _log(logger: MetricsLogger, rounds: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        for key, kwargs in _KEYS:
            logger.log_value(key, float(rng.integers(0, 50)), **kwargs)


def _shape(tree: Any) -> Any:
    """Keys in order, nested, with each leaf's type."""
    if isinstance(tree, dict):
        return [(k, _shape(v)) for k, v in tree.items()]
    return type(tree).__name__


def _values(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _values(v) for k, v in tree.items()}
    return tree.peek(compile=True) if hasattr(tree, "peek") else tree


@pytest.mark.parametrize("compile_", [False, True])
def test_reduce_returns_what_rllibs_reduce_returns(compile_: bool) -> None:
    """Same values, same nesting, same key order (the order keys were first logged, which
    dm-tree's sorted walk of ``MetricsLogger.reduce`` keeps too), over reduce cycles."""
    ours, theirs = CachedMetricsLogger(root=False), MetricsLogger(root=False)
    for cycle in range(3):
        for logger in (ours, theirs):
            _log(logger, rounds=4 + cycle, seed=cycle)
        a, b = ours.reduce(compile=compile_), theirs.reduce(compile=compile_)
        assert _shape(a) == _shape(b)
        assert _shape(a)[0][0] == "zeta"  # logged first, sorted last
        assert _values(a) == _values(b)
    assert list(a["agent"]) == ["b", "a"]


def test_reduce_of_an_unusual_stats_dict_is_rllibs() -> None:
    """A stats dict holding something other than dicts and Stats objects (here a list, which
    dm-tree maps into) is reduced by ``MetricsLogger.reduce``."""
    ours, theirs = CachedMetricsLogger(root=False), MetricsLogger(root=False)
    for logger in (ours, theirs):
        _log(logger, rounds=3, seed=7)
        logger.stats["listed"] = [logger.stats.pop("zeta")]
    a, b = ours.reduce(compile=True), theirs.reduce(compile=True)
    assert isinstance(a["listed"], list) and a == b


def test_a_stats_object_that_fails_to_reduce_is_named() -> None:
    ours = CachedMetricsLogger(root=False)
    _log(ours, rounds=2, seed=1)
    broken = ours.stats["agent"]["a"]["steps"]

    def fail(compile: bool = True) -> None:
        raise RuntimeError("broken")

    broken.reduce = fail
    with pytest.raises(ValueError, match=r"at path \('agent', 'a', 'steps'\)") as info:
        ours.reduce()
    assert isinstance(info.value.__cause__, RuntimeError)
