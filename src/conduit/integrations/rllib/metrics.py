"""RLlib's ``MetricsLogger`` with a shorter path for keys logged before.

RLlib's episode buffers log about 25 values per ``add`` and per ``sample``. Each
``MetricsLogger.log_value`` flattens its key, walks the nested stats dict twice and checks its
arguments before it pushes the value to the key's ``Stats`` object. The buffers log the same
keys with the same arguments on every call, so :class:`CachedMetricsLogger` keeps each key's
``Stats`` object after its first ``log_value`` and pushes later values to it directly: the
values pushed, their order and hence every reduced metric are the same.

RLlib's DQN and SAC call the buffer's ``get_metrics`` (``MetricsLogger.reduce``) once per
training step. ``MetricsLogger.reduce`` maps over the stats dict with ``dm-tree``, which
flattens it, sorts every level's keys and packs the result again: more time than reducing
the ``Stats`` objects themselves. :class:`CachedMetricsLogger` walks the nested dicts instead.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from ray.rllib.utils.metrics.metrics_logger import MetricsLogger
from ray.rllib.utils.metrics.stats import StatsBase


class CachedMetricsLogger(MetricsLogger):
    """A ``MetricsLogger`` whose ``log_value`` of a known key pushes to its ``Stats`` object.

    A cached object is used only while the logger's stats dict is the one it was found in
    (``reset`` and ``set_state`` replace that dict); setting or deleting any key clears the
    cache. Arguments other than the value are those of the key's first ``log_value``, as in
    ``MetricsLogger``, which creates a key's ``Stats`` object once.

    ``reduce`` returns what ``MetricsLogger.reduce`` returns: every ``Stats`` object reduced
    once, in dicts of the stats dict's nesting and key order.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._cached: dict[Hashable, tuple[dict[str, Any], Any]] = {}

    def log_value(self, key: Any, value: Any, **kwargs: Any) -> None:
        hit = self._cached.get(key)
        if hit is not None and hit[0] is self.stats:
            hit[1].push(value)
            return
        super().log_value(key, value, **kwargs)
        self._cached[key] = (self.stats, self._get_key(key))

    def reduce(self, compile: bool = False) -> dict[str, Any]:
        """Every logged key's ``Stats`` reduced, as ``MetricsLogger.reduce`` reduces them.

        Args:
            compile: Reduce each to a value where it can be (see ``MetricsLogger.reduce``).

        Returns:
            A dict of the stats dict's nesting, with the reduced stats as leaves.

        Raises:
            ValueError: A ``Stats`` object failed to reduce (from it), naming its path.
        """
        with self._threading_lock:
            if not _nested_stats(self.stats):  # something dm-tree maps otherwise: as RLlib
                return super().reduce(compile=compile)
            return _reduced(self.stats, (), compile)

    def _set_key(self, flat_key: Any, stats: Any) -> None:
        self._cached.clear()
        super()._set_key(flat_key, stats)

    def _del_key(self, flat_key: Any, key_error: bool = False) -> None:
        self._cached.clear()
        super()._del_key(flat_key, key_error)


def _nested_stats(node: dict[str, Any]) -> bool:
    """Whether ``node`` holds only plain dicts of the same kind and ``Stats`` objects."""
    return all(isinstance(v, StatsBase) or (type(v) is dict and _nested_stats(v))
               for v in node.values())


def _reduced(node: dict[str, Any], path: tuple[str, ...], compile: bool) -> dict[str, Any]:
    """``node`` (see :func:`_nested_stats`) with each ``Stats`` object reduced."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if type(value) is dict:
            out[key] = _reduced(value, (*path, key), compile)
            continue
        try:
            out[key] = value.reduce(compile=compile)
        except Exception as exc:  # MetricsLogger.reduce's error
            raise ValueError(f"Error reducing stats {value} with compile={compile} at path "
                             f"{(*path, key)}.") from exc
    return out
