"""RLlib's ``MetricsLogger`` with a shorter path for keys logged before.

RLlib's episode buffers log about 25 values per ``add`` and per ``sample``. Each
``MetricsLogger.log_value`` flattens its key, walks the nested stats dict twice and checks its
arguments before it pushes the value to the key's ``Stats`` object. The buffers log the same
keys with the same arguments on every call, so :class:`CachedMetricsLogger` keeps each key's
``Stats`` object after its first ``log_value`` and pushes later values to it directly: the
values pushed, their order and hence every reduced metric are the same.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from ray.rllib.utils.metrics.metrics_logger import MetricsLogger


class CachedMetricsLogger(MetricsLogger):
    """A ``MetricsLogger`` whose ``log_value`` of a known key pushes to its ``Stats`` object.

    A cached object is used only while the logger's stats dict is the one it was found in
    (``reset`` and ``set_state`` replace that dict); setting or deleting any key clears the
    cache. Arguments other than the value are those of the key's first ``log_value``, as in
    ``MetricsLogger``, which creates a key's ``Stats`` object once.
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

    def _set_key(self, flat_key: Any, stats: Any) -> None:
        self._cached.clear()
        super()._set_key(flat_key, stats)

    def _del_key(self, flat_key: Any, key_error: bool = False) -> None:
        self._cached.clear()
        super()._del_key(flat_key, key_error)
