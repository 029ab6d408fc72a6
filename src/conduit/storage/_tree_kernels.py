"""Compiled sum-tree kernels (Numba), used by :class:`~conduit.storage.SumTree` when Numba is
importable.

The tree is 4-ary, stored as one ``[groups, 8]`` float64 array: row ``g`` holds the sums of
node ``g``'s four children, then their minima, so the eight values fill one 64-byte cache
line. Nodes are numbered breadth-first from the root (0); the children of node ``g`` are
``4g + 1 .. 4g + 4``, and leaf ``i`` is node ``first + i``, held in row ``(first + i - 1) >> 2``
at column ``(first + i - 1) & 3`` (``first`` counts the inner nodes).

Where vectorized numpy pays one array operation per tree level, these loops pay a memory
access. The descents and repairs advance a whole batch one level at a time (the inner loop
runs over the batch), so the independent cache misses of the lower levels overlap
(``docs/design.md §7``). Sums are added left to right, ``((a + b) + c) + d``, as the numpy
walk adds them, so both give identical trees and leaves.

The kernels are compiled on first use and cached next to this file (``cache=True``).
"""

from __future__ import annotations

import numba
import numpy as np

#: Children per node; a row holds their sums, then their minima.
FAN = 4


@numba.njit(cache=True, nogil=True)
def set_leaves(t: np.ndarray, depth: int, first: int, idx: np.ndarray, svals: np.ndarray,
               mvals: np.ndarray) -> None:  # pragma: no cover - compiled
    """Set leaf ``idx[k]`` to ``svals[k]`` (sum) and ``mvals[k]`` (minimum).

    Leaves are written in order (a repeated index keeps its last value); then the touched
    parents are repaired bottom-up, one level at a time over the whole batch, so the misses of
    the lower levels overlap. A parent shared by several leaves is recomputed once per leaf,
    from the same children: cheaper than sorting the batch to visit it once.
    """
    n = idx.shape[0]
    if n == 0:
        return
    row = np.empty(n, np.int64)
    for k in range(n):
        f = first + idx[k] - 1
        g = f >> 2
        c = f & 3
        t[g, c] = svals[k]
        t[g, FAN + c] = mvals[k]
        row[k] = g
    for _ in range(depth - 1):
        for k in range(n):
            g = row[k]
            s = ((t[g, 0] + t[g, 1]) + t[g, 2]) + t[g, 3]
            a = t[g, 4]
            b = t[g, 5]
            m = a if a < b else b
            b = t[g, 6]
            m = m if m < b else b
            b = t[g, 7]
            m = m if m < b else b
            f = g - 1
            p = f >> 2
            c = f & 3
            t[p, c] = s
            t[p, FAN + c] = m
            row[k] = p


@numba.njit(cache=True, nogil=True)
def set_checked(t: np.ndarray, depth: int, first: int, idx: np.ndarray, svals: np.ndarray,
                mvals: np.ndarray, capacity: int) -> int:  # pragma: no cover - compiled
    """:func:`set_leaves` after checking every ``idx[k]`` lies in ``[0, capacity)``.

    Returns:
        0 once set, or ``k + 1`` for the first index ``k`` out of range (nothing set).
    """
    for k in range(idx.shape[0]):
        if idx[k] < 0 or idx[k] >= capacity:
            return k + 1
    set_leaves(t, depth, first, idx, svals, mvals)
    return 0


@numba.njit(cache=True, nogil=True)
def total(t: np.ndarray) -> float:  # pragma: no cover - compiled
    """Sum of all leaves (the root's children, added left to right)."""
    return ((t[0, 0] + t[0, 1]) + t[0, 2]) + t[0, 3]


@numba.njit(cache=True, nogil=True)
def _descend(t: np.ndarray, depth: int, x: np.ndarray) -> np.ndarray:  # pragma: no cover
    """Node reached by each prefix-sum mass ``x[k]`` (consumed), the whole batch advanced one
    level at a time."""
    n = x.shape[0]
    node = np.zeros(n, np.int64)
    for _ in range(depth):
        for k in range(n):
            # Branch-free: the child a mass goes to is a coin flip the branch predictor
            # misses, which costs more than the memory access.
            g = node[k]
            xk = x[k]
            pre = 0.0
            acc = 0.0
            j = 0
            for c in range(FAN - 1):
                pre += t[g, c]  # (0.0 + a is a: the prefixes are a, a + b, (a + b) + c)
                right = xk >= pre
                j += right
                acc = pre if right else acc
            x[k] = xk - acc
            node[k] = 4 * g + 1 + j
    return node


@numba.njit(cache=True, nogil=True)
def find(t: np.ndarray, depth: int, first: int, mass: np.ndarray,
         out: np.ndarray) -> None:  # pragma: no cover - compiled
    """Leaf whose prefix-sum interval holds each ``mass[k]``, written to ``out[k]``."""
    node = _descend(t, depth, mass.copy())
    for k in range(mass.shape[0]):
        out[k] = node[k] - first


@numba.njit(cache=True, nogil=True)
def stratified_draw(t: np.ndarray, depth: int, first: int, last: int, u: np.ndarray,
                    beta: float, size: int, out_idx: np.ndarray,
                    out_w: np.ndarray) -> None:  # pragma: no cover - compiled
    """One stratified proportional draw with importance weights, in a single pass.

    Row ``k`` takes the mass ``(k + u[k]) · total / B`` (capped at the float below
    ``total``), descends to its leaf (clamped to ``last``), and gets ``(size · P(i))^-β``
    normalized by the largest weight over the buffer, ``(size · P_min)^-β``.
    """
    n = u.shape[0]
    tot = total(t)
    mass_cap = np.nextafter(tot, 0.0)
    step = tot / n
    x = np.empty(n)
    for k in range(n):
        v = (k + u[k]) * step
        x[k] = v if v < mass_cap else mass_cap
    node = _descend(t, depth, x)
    least = t[0, 4]
    for c in range(5, 8):
        least = least if least < t[0, c] else t[0, c]
    w_max = (size * (least / tot)) ** -beta
    for k in range(n):
        leaf = node[k] - first
        if leaf > last:
            leaf = last
        out_idx[k] = leaf
        f = first + leaf - 1
        prob = t[f >> 2, f & 3] / tot
        if prob < 1e-300:
            prob = 1e-300
        out_w[k] = ((size * prob) ** -beta) / w_max


@numba.njit(cache=True, nogil=True)
def check_priorities(idx: np.ndarray, pr: np.ndarray,
                     capacity: int) -> tuple[int, float]:  # pragma: no cover - compiled
    """(0, max) when every priority is finite and >= 0 and every index in range; otherwise a
    code: 1 not finite, 2 negative, 3 index out of range."""
    for k in range(pr.shape[0]):
        if not np.isfinite(pr[k]):
            return 1, 0.0
    pmax = 0.0
    for k in range(pr.shape[0]):
        v = pr[k]
        if v < 0:
            return 2, 0.0
        if v > pmax:
            pmax = v
    for k in range(idx.shape[0]):
        if idx[k] < 0 or idx[k] >= capacity:
            return 3, 0.0
    return 0, pmax


@numba.njit(cache=True, nogil=True)
def set_priorities(t: np.ndarray, depth: int, first: int, idx: np.ndarray, pr: np.ndarray,
                   leaves: np.ndarray, bound: float,
                   capacity: int) -> tuple[int, float]:  # pragma: no cover - compiled
    """Check raw priorities ``pr`` for leaves ``idx`` and, when all are valid, set leaf
    ``idx[k]`` to ``leaves[k]`` (see :func:`set_leaves`), all in one call.

    Returns:
        ``(0, max priority)`` after setting, or a code with nothing set: 1 not finite,
        2 negative, 3 index out of range, 4 a leaf above ``bound`` (with the largest priority),
        5 a leaf that was never set (a slot holding no row).
    """
    code, pmax = check_priorities(idx, pr, capacity)
    if code != 0:
        return code, 0.0
    for k in range(idx.shape[0]):
        f = first + idx[k] - 1
        if not t[f >> 2, FAN + (f & 3)] < np.inf:
            return 5, pmax
    for k in range(leaves.shape[0]):
        if not leaves[k] <= bound:
            return 4, pmax
    set_leaves(t, depth, first, idx, leaves, leaves)
    return 0, pmax
