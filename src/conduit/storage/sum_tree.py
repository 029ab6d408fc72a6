"""Vectorized sum tree (and min tree) for prioritized sampling.

Leaves hold priorities; an update or a batch of prefix-sum queries costs O(B·log N) with no
per-row Python loop. The tree is 4-ary: one ``[groups, 8]`` float64 array whose row ``g``
holds the sums of node ``g``'s four children, then their minima, one 64-byte cache line per
node (layout in :mod:`conduit.storage._tree_kernels`; why in ``docs/design.md §7``). Two
interchangeable backends do the walking:

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
FAN = 4
"""Children per node."""

_ALIGN = 64
"""Bytes a node's row (four sums, four minima) is aligned to: one cache line."""


def _load_kernels() -> ModuleType | None:
    """The compiled tree kernels, or None where Numba cannot be imported."""
    return compiled.load("_tree_kernels")


def tree_shape(capacity: int) -> tuple[int, int]:
    """``(depth, inner nodes)`` of the 4-ary tree over ``capacity`` leaves: the fewest levels
    whose ``4 ** depth`` leaves hold them (at least one), and the nodes above the leaves."""
    depth = 1
    while FAN ** depth < capacity:
        depth += 1
    return depth, (FAN ** depth - 1) // (FAN - 1)


def tree_bytes(capacity: int) -> int:
    """Bytes of the tree over ``capacity`` leaves: 64 per inner node, plus a line of
    alignment."""
    return _ALIGN * (tree_shape(capacity)[1] + 1)


def _aligned_rows(rows: int) -> np.ndarray:
    """An uninitialised ``[rows, 8]`` float64 array whose rows start on 64-byte lines."""
    width = 2 * FAN
    raw = np.empty(rows * width + _ALIGN // 8, dtype=np.float64)
    skip = (-raw.ctypes.data % _ALIGN) // 8
    return raw[skip:skip + rows * width].reshape(rows, width)


class SumTree:
    """4-ary tree over ``capacity`` leaves keeping subtree sums and minima.

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
        self._depth, self._first = tree_shape(capacity)
        self._nodes = _aligned_rows(self._first)
        self._nodes[:, :FAN] = 0.0
        self._nodes[:, FAN:] = np.inf

    def __setstate__(self, state: dict[str, object]) -> None:
        """Unpickled or deep-copied: the nodes copied into aligned rows again."""
        self.__dict__.update(state)
        nodes = _aligned_rows(self._first)
        nodes[:] = self._nodes
        self._nodes = nodes

    @property
    def _sum(self) -> np.ndarray:
        """The children's sums, ``[inner nodes, 4]`` (a view)."""
        return self._nodes[:, :FAN]

    @property
    def _min(self) -> np.ndarray:
        """The children's minima, ``[inner nodes, 4]`` (a view)."""
        return self._nodes[:, FAN:]

    @property
    def total(self) -> float:
        """Sum of all leaves."""
        a, b, c, d = self._nodes[0, :FAN].tolist()  # (added as the kernels add them)
        return ((a + b) + c) + d

    @property
    def min(self) -> float:
        """Smallest leaf that was ever set (inf when none)."""
        return min(self._nodes[0, FAN:].tolist())

    def _cells(self, leaf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Row and column of each leaf (int64 in ``[0, capacity)``)."""
        f = leaf + (self._first - 1)
        return f >> 2, f & 3

    def _leaf_run(self, part: np.ndarray) -> np.ndarray:
        """Every leaf's value in ``part`` (:attr:`_sum` or :attr:`_min`), in leaf order (a
        copy): the leaves are the last level, so they fill consecutive rows from the first
        column of row ``(first - 1) / 4`` on."""
        return part[(self._first - 1) >> 2:].flatten()[:self.capacity]

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
        row, col = self._cells(self._leaves(idx))
        return self._sum[row, col]

    def set(self, idx: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``idx`` to ``values`` and repair both trees (last write wins).

        Raises:
            ConfigError: A leaf outside ``[0, capacity)`` (field ``idx``; nothing is set).
        """
        vals = np.asarray(values, dtype=np.float64)
        if self.backend == "numba":
            leaf = np.ascontiguousarray(idx, dtype=np.int64).reshape(-1)
            vals = vals.reshape(-1)
            if vals.shape != leaf.shape:  # (a value for every leaf needs no broadcast)
                vals = np.broadcast_to(vals, leaf.shape)
            vals = np.ascontiguousarray(vals)
            if _load_kernels().set_checked(self._nodes, self._depth, self._first, leaf, vals,
                                           vals, self.capacity):
                raise self._out_of_range(leaf)
            return
        leaf = self._leaves(idx).reshape(-1)
        vals = np.broadcast_to(vals.reshape(-1), leaf.shape)
        self._write(leaf, vals, vals)

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
            if _load_kernels().set_checked(self._nodes, self._depth, self._first, leaf,
                                           np.zeros(leaf.shape), np.full(leaf.shape, np.inf),
                                           self.capacity):
                raise self._out_of_range(leaf)
            return
        leaf = self._leaves(idx).reshape(-1)
        self._write(leaf, np.zeros(leaf.shape), np.full(leaf.shape, np.inf))

    def _write(self, leaf: np.ndarray, svals: np.ndarray, mvals: np.ndarray) -> None:
        """Set checked leaves and repair their parents (the numpy walk of the kernels'
        ``set_leaves``).

        Duplicate parents are harmless (each recomputes the same value from its children), so
        no level deduplicates: np.unique costs more than the redundant arithmetic."""
        if not leaf.size:
            return
        s, m = self._sum, self._min
        row, col = self._cells(leaf)
        s[row, col] = svals
        m[row, col] = mvals
        for _ in range(self._depth - 1):
            total = ((s[row, 0] + s[row, 1]) + s[row, 2]) + s[row, 3]
            least = m[row].min(axis=1)
            f = row - 1
            row, col = f >> 2, f & 3
            s[row, col] = total
            m[row, col] = least

    def _descend(self, mass: np.ndarray) -> np.ndarray:
        """Leaf reached by each mass (the numpy walk of the kernels' ``_descend``)."""
        node = np.zeros(mass.shape, dtype=np.int64)
        s = self._sum
        for _ in range(self._depth):
            p1 = s[node, 0]
            p2 = p1 + s[node, 1]
            p3 = p2 + s[node, 2]
            j1, j2, j3 = mass >= p1, mass >= p2, mass >= p3
            acc = np.where(j3, p3, np.where(j2, p2, np.where(j1, p1, 0.0)))
            mass = mass - acc
            node = 4 * node + 1 + j1 + j2 + j3
        return node - self._first

    def find(self, mass: np.ndarray) -> np.ndarray:
        """Leaf index whose prefix-sum interval contains each ``mass`` (vectorized descent)."""
        mass = np.array(mass, dtype=np.float64)
        if self.backend == "numba":
            leaf = np.empty(mass.size, dtype=np.int64)
            _load_kernels().find(self._nodes, self._depth, self._first, mass.reshape(-1), leaf)
            return np.minimum(leaf.reshape(mass.shape), self.capacity - 1)
        return np.minimum(self._descend(mass), self.capacity - 1)

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
        u = np.ascontiguousarray(u, dtype=np.float64)
        if self.backend == "numba":
            idx = np.empty(u.size, dtype=np.int64)
            w = np.empty(u.size, dtype=np.float32)  # rounded from float64 in the kernel
            _load_kernels().stratified_draw(self._nodes, self._depth, self._first, size - 1,
                                            u, float(beta), size, idx, w)
            return idx, w
        total = self.total
        cap = math.nextafter(total, 0.0)
        mass = np.minimum((np.arange(u.size) + u) * (total / u.size), cap)
        idx = np.minimum(self._descend(mass), size - 1)
        p = self._sum[self._cells(idx)] / total
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
            code, pmax = _load_kernels().set_priorities(self._nodes, self._depth, self._first,
                                                        idx, priorities, leaves, float(bound),
                                                        self.capacity)
            return ((None, "not finite", "negative", "index", "too large", "unset")[code],
                    float(pmax))
        problem, pmax = self.check(idx, priorities)
        if problem is not None:
            return problem, pmax
        row, col = self._cells(idx)
        if not np.all(self._min[row, col] < np.inf):
            return "unset", pmax
        leaves = (priorities + eps) ** alpha
        if not np.all(leaves <= bound):
            return "too large", pmax
        self.set(idx, leaves)
        return None, pmax

    def is_set(self) -> np.ndarray:
        """Per leaf, whether it holds a value (set since the tree was created or cleared)."""
        return np.isfinite(self._leaf_run(self._min))

    def state_dict(self) -> StateDict:
        """Leaves only (as tensors); inner nodes are rebuilt on load."""
        return {"leaves": tensor(self._leaf_run(self._sum)),
                "set": tensor(np.isfinite(self._leaf_run(self._min)))}

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
