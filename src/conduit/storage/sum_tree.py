"""Vectorized sum tree (and min tree) for prioritized sampling.

Leaves hold priorities; every update and every prefix-sum query walks the tree level by level
with numpy array operations over the whole batch, so the cost is O(B·log N) with no per-row
Python loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class SumTree:
    """Binary tree over ``capacity`` leaves keeping subtree sums and minima.

    Args:
        capacity: Number of leaves.
    """

    def __init__(self, *, capacity: int) -> None:
        self.capacity = capacity
        p = 2
        while p < capacity:
            p *= 2
        self._p = p
        self._levels = p.bit_length() - 1
        self._sum = np.zeros(2 * p, dtype=np.float64)
        self._min = np.full(2 * p, np.inf, dtype=np.float64)

    @property
    def total(self) -> float:
        """Sum of all leaves."""
        return float(self._sum[1])

    @property
    def min(self) -> float:
        """Smallest leaf that was ever set (inf when none)."""
        return float(self._min[1])

    def get(self, idx: np.ndarray) -> np.ndarray:
        """Leaf values at ``idx``."""
        return self._sum[self._p + np.asarray(idx)]

    def set(self, idx: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``idx`` to ``values`` and repair both trees (last write wins)."""
        node = self._p + np.asarray(idx, dtype=np.int64)
        vals = np.asarray(values, dtype=np.float64)
        self._sum[node] = vals
        self._min[node] = vals
        self._repair(node)

    def clear(self, idx: np.ndarray | None = None) -> None:
        """Reset leaves (all when ``idx`` is None) to empty."""
        if idx is None:
            self._sum[:] = 0.0
            self._min[:] = np.inf
            return
        node = self._p + np.asarray(idx, dtype=np.int64)
        self._sum[node] = 0.0
        self._min[node] = np.inf
        self._repair(node)

    def _repair(self, node: np.ndarray) -> None:
        # Duplicate parents are harmless (each recomputes the same value from its children),
        # so no level deduplicates: np.unique costs more than the redundant arithmetic.
        # Column gathers, not axis-1 reductions, for the same reason.
        s, m = self._sum, self._min
        node = node // 2
        for _ in range(self._levels):
            left = 2 * node
            right = left + 1
            s[node] = s[left] + s[right]
            m[node] = np.minimum(m[left], m[right])
            node //= 2

    def find(self, mass: np.ndarray) -> np.ndarray:
        """Leaf index whose prefix-sum interval contains each ``mass`` (vectorized descent)."""
        mass = np.array(mass, dtype=np.float64)
        node = np.ones(mass.shape, dtype=np.int64)
        s = self._sum
        for _ in range(self._levels):
            node *= 2
            lsum = s[node]
            right = mass >= lsum
            np.subtract(mass, lsum, out=mass, where=right)
            node += right
        leaf = node - self._p
        return np.minimum(leaf, self.capacity - 1)

    def state_dict(self) -> dict[str, Any]:
        """Leaves only; inner nodes are rebuilt on load."""
        return {"leaves": self._sum[self._p:self._p + self.capacity].copy(),
                "set": np.isfinite(self._min[self._p:self._p + self.capacity])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        self.clear()
        idx = np.nonzero(state["set"])[0]
        if idx.size:
            self.set(idx, state["leaves"][idx])
