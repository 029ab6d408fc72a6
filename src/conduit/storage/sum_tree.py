"""Vectorized sum tree (and min tree) for prioritized sampling.

Leaves hold priorities; an update or a batch of prefix-sum queries costs O(B·log N) with no
per-row Python loop. Two interchangeable backends do the walking:

* ``"numba"`` (used when Numba is importable): compiled loops from
  :mod:`conduit.storage._tree_kernels`;
* ``"numpy"``: the same walk level by level with numpy array operations over the whole batch.

Both give identical trees and identical search results; the tests check one against the other.
"""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np

from conduit._checks import check_int
from conduit.errors import ConfigError, StateError
from conduit.storage import compiled
from conduit.storage.state import StateDict, array, tensor

BACKENDS = ("auto", "numba", "numpy")


def _load_kernels() -> ModuleType | None:
    """The compiled tree kernels, or None where Numba cannot be imported."""
    return compiled.load("_tree_kernels")


class SumTree:
    """Binary tree over ``capacity`` leaves keeping subtree sums and minima.

    Args:
        capacity: Number of leaves.
        backend: ``"numba"``, ``"numpy"``, or ``"auto"`` (Numba when importable).

    Raises:
        ConfigError: ``capacity`` is not a positive integer, an unknown backend, or
            ``"numba"`` requested without Numba.
    """

    def __init__(self, *, capacity: int, backend: str = "auto") -> None:
        capacity = check_int("capacity", capacity, minimum=1)
        if backend not in BACKENDS:
            raise ConfigError("backend", f"must be one of {BACKENDS}, got {backend!r}")
        kernels = _load_kernels() if backend != "numpy" else None
        if backend == "numba" and kernels is None:
            raise ConfigError("backend", "'numba' requested but numba cannot be imported; "
                                         "pip install numba or use backend='numpy'")
        if backend == "auto":
            backend = "numba" if kernels is not None else "numpy"
        self.backend = backend
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

    def _out_of_range(self, idx: np.ndarray) -> ConfigError:
        """The error for leaves ``idx`` of which some lie outside ``[0, capacity)``."""
        return ConfigError("idx", f"leaves must lie in [0, {self.capacity}), got "
                                  f"[{idx.min()}, {idx.max()}]")

    def _leaves(self, idx: np.ndarray) -> np.ndarray:
        """``idx`` as int64 leaves in ``[0, capacity)`` (numpy backend's check)."""
        leaf = np.asarray(idx, dtype=np.int64)
        if leaf.size and (leaf.min() < 0 or leaf.max() >= self.capacity):
            raise self._out_of_range(leaf)
        return leaf

    def get(self, idx: np.ndarray) -> np.ndarray:
        """Leaf values at ``idx``.

        Raises:
            ConfigError: A leaf outside ``[0, capacity)`` (field ``idx``).
        """
        return self._sum[self._p + self._leaves(idx)]

    def set(self, idx: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``idx`` to ``values`` and repair both trees (last write wins).

        Raises:
            ConfigError: A leaf outside ``[0, capacity)`` (field ``idx``; nothing is set).
        """
        vals = np.asarray(values, dtype=np.float64)
        if self.backend == "numba":
            leaf = np.ascontiguousarray(idx, dtype=np.int64).reshape(-1)
            vals = np.ascontiguousarray(np.broadcast_to(vals.reshape(-1), leaf.shape))
            if _load_kernels().set_checked(self._sum, self._min, self._p, leaf, vals, vals,
                                           self.capacity):
                raise self._out_of_range(leaf)
            return
        node = self._p + self._leaves(idx)
        self._sum[node] = vals
        self._min[node] = vals
        self._repair(node)

    def clear(self, idx: np.ndarray | None = None) -> None:
        """Reset leaves (all when ``idx`` is None) to empty.

        Raises:
            ConfigError: A leaf outside ``[0, capacity)`` (field ``idx``; nothing is reset).
        """
        if idx is None:
            self._sum[:] = 0.0
            self._min[:] = np.inf
            return
        if self.backend == "numba":
            leaf = np.ascontiguousarray(idx, dtype=np.int64).reshape(-1)
            if _load_kernels().set_checked(self._sum, self._min, self._p, leaf,
                                           np.zeros(leaf.shape), np.full(leaf.shape, np.inf),
                                           self.capacity):
                raise self._out_of_range(leaf)
            return
        node = self._p + self._leaves(idx)
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
        if self.backend == "numba":
            leaf = np.empty(mass.size, dtype=np.int64)
            _load_kernels().find(self._sum, self._p, mass.reshape(-1), leaf)
            return np.minimum(leaf.reshape(mass.shape), self.capacity - 1)
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

    def stratified_draw(self, u: np.ndarray, *, size: int,
                        beta: float) -> tuple[np.ndarray, np.ndarray]:
        """Stratified proportional draw over the first ``size`` leaves, with IS weights.

        Row ``k`` of the batch takes the prefix-sum mass ``(k + u[k]) · total / B``; its
        importance weight is ``(size · P(i))^-β`` divided by the largest possible one,
        ``(size · P_min)^-β``.

        Args:
            u: ``B`` uniform numbers in ``[0, 1)``.
            size: Filled leaves (draws are clamped below it).
            beta: Importance-weight exponent.

        Returns:
            ``(indices int64, weights float32)``, each of length ``B``.
        """
        total = self.total
        u = np.ascontiguousarray(u, dtype=np.float64)
        cap = math.nextafter(total, 0.0)
        if self.backend == "numba":
            idx = np.empty(u.size, dtype=np.int64)
            w = np.empty(u.size, dtype=np.float32)  # rounded from float64 in the kernel
            _load_kernels().stratified_draw(self._sum, self._min, self._p, size - 1, u, cap,
                                            float(beta), size, idx, w)
            return idx, w
        mass = np.minimum((np.arange(u.size) + u) * (total / u.size), cap)
        idx = np.minimum(self.find(mass), size - 1)
        p = self._sum[self._p + idx] / total
        w = np.power(size * np.maximum(p, 1e-300), -beta)
        with np.errstate(divide="ignore", over="ignore"):  # as the kernel: inf, weights 0
            w_max = np.power(np.float64(size * (self.min / total)), -beta)
        return idx.astype(np.int64), (w / w_max).astype(np.float32)

    def check(self, idx: np.ndarray, priorities: np.ndarray) -> tuple[str | None, float]:
        """Validate leaves and raw priorities before :meth:`set`.

        Returns:
            ``(problem, max priority)``: ``problem`` is ``None`` when every priority is finite
            and non-negative and every index lies in ``[0, capacity)``, otherwise one of
            ``"not finite"``, ``"negative"``, ``"index"``.
        """
        if self.backend == "numba":
            code, pmax = _load_kernels().check_priorities(idx, priorities, self.capacity)
            return (None, "not finite", "negative", "index")[code], float(pmax)
        if not np.all(np.isfinite(priorities)):
            return "not finite", 0.0
        if np.any(priorities < 0):
            return "negative", 0.0
        if idx.size and (idx.min() < 0 or idx.max() >= self.capacity):
            return "index", 0.0
        return None, float(priorities.max()) if priorities.size else 0.0

    def set_priorities(self, idx: np.ndarray, priorities: np.ndarray, *, alpha: float,
                       eps: float, bound: float) -> tuple[str | None, float]:
        """Validate raw priorities and, when all are valid, set leaves ``idx`` to
        ``(priority + eps) ** alpha`` (one compiled call on the ``"numba"`` backend).

        Args:
            idx: Leaves, int64.
            priorities: Raw priorities, float64, one per leaf.
            alpha: Priority exponent.
            eps: Added to every priority.
            bound: Largest leaf value accepted.

        Returns:
            ``(problem, max priority)``: ``problem`` is ``None`` once the leaves are set,
            otherwise (nothing set) one of :meth:`check`'s problems, ``"too large"`` (a leaf
            above ``bound``) or ``"unset"`` (a leaf never set since the tree was created or
            cleared: a slot that holds no row).
        """
        if self.backend == "numba":
            # numpy's power, not the kernel's, so that both backends give the same leaves.
            # abs() keeps invalid priorities, which the kernel refuses, from warning.
            leaves = (np.abs(priorities) + eps) ** alpha
            code, pmax = _load_kernels().set_priorities(self._sum, self._min, self._p, idx,
                                                        priorities, leaves, float(bound),
                                                        self.capacity)
            return ((None, "not finite", "negative", "index", "too large", "unset")[code],
                    float(pmax))
        problem, pmax = self.check(idx, priorities)
        if problem is not None:
            return problem, pmax
        if not np.all(self._min[self._p + idx] < np.inf):
            return "unset", pmax
        leaves = (priorities + eps) ** alpha
        if not np.all(leaves <= bound):
            return "too large", pmax
        self.set(idx, leaves)
        return None, pmax

    def is_set(self) -> np.ndarray:
        """Per leaf, whether it holds a value (set since the tree was created or cleared)."""
        return np.isfinite(self._min[self._p:self._p + self.capacity])

    def state_dict(self) -> StateDict:
        """Leaves only (as tensors); inner nodes are rebuilt on load."""
        return {"leaves": tensor(self._sum[self._p:self._p + self.capacity].copy()),
                "set": tensor(np.isfinite(self._min[self._p:self._p + self.capacity]))}

    def load_state_dict(self, state: StateDict, *, bound: float | None = None) -> None:
        """Restore from :meth:`state_dict`; a refused state changes nothing.

        Args:
            state: What :meth:`state_dict` returned.
            bound: Largest leaf accepted (default: any finite leaf whose sum over the tree
                stays finite).

        Raises:
            StateError: A missing key, a wrong length, or a set leaf that is not finite and
                positive (a leaf of 0 makes every importance weight 0), above ``bound``, or
                whose sum with the others is not finite.
        """
        leaves = array(state, "leaves", "tree", length=self.capacity, dtype=np.float64)
        used = array(state, "set", "tree", length=self.capacity, dtype=bool)
        limit = math.inf if bound is None else bound
        bad = used & ~(np.isfinite(leaves) & (leaves > 0) & (leaves <= limit))
        if bad.any():
            k = int(np.nonzero(bad)[0][0])
            within = "" if bound is None else f" and <= {bound:.6g}"
            raise StateError("tree.leaves", f"slot {k} has priority {leaves[k]}; the priority "
                                            f"of a set slot must be finite and > 0{within}")
        with np.errstate(over="ignore"):
            total = float(leaves[used].sum())
        if not math.isfinite(total):
            raise StateError("tree.leaves", f"sum to {total}; the priorities of the set slots "
                                            f"must have a finite sum")
        self.clear()
        idx = np.nonzero(used)[0]
        if idx.size:
            self.set(idx, leaves[idx])
