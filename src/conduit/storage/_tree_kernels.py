"""Compiled sum-tree kernels (Numba), used by :class:`~conduit.storage.SumTree` when Numba is
importable.

Where vectorized numpy pays one array operation per tree level, these loops pay a memory
access. The descents advance a whole batch one level at a time (the inner loop runs over the
batch), so the independent cache misses of the lower levels overlap (``docs/design.md §7``).

The kernels are compiled on first use and cached next to this file (``cache=True``).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def set_leaves(s: np.ndarray, m: np.ndarray, p: int, idx: np.ndarray, svals: np.ndarray,
               mvals: np.ndarray) -> None:  # pragma: no cover - compiled
    """Set leaf ``idx[k]`` to ``svals[k]`` (sum tree) and ``mvals[k]`` (min tree).

    Leaves are written in order (a repeated index keeps its last value); then the touched
    parents are repaired bottom-up, one level at a time over the whole batch, so the misses of
    the lower levels overlap. A parent shared by several leaves is recomputed once per leaf,
    from the same children: cheaper than sorting the batch to visit it once.
    """
    n = idx.shape[0]
    if n == 0:
        return
    for k in range(n):
        s[p + idx[k]] = svals[k]
        m[p + idx[k]] = mvals[k]
    node = (idx + p) >> 1
    while node[0] >= 1:
        for k in range(n):
            c = node[k]
            left = 2 * c
            s[c] = s[left] + s[left + 1]
            a = m[left]
            b = m[left + 1]
            m[c] = a if a < b else b
            node[k] = c >> 1


@numba.njit(cache=True, nogil=True)
def set_checked(s: np.ndarray, m: np.ndarray, p: int, idx: np.ndarray, svals: np.ndarray,
                mvals: np.ndarray, capacity: int) -> int:  # pragma: no cover - compiled
    """:func:`set_leaves` after checking every ``idx[k]`` lies in ``[0, capacity)``.

    Returns:
        0 once set, or ``k + 1`` for the first index ``k`` out of range (nothing set).
    """
    for k in range(idx.shape[0]):
        if idx[k] < 0 or idx[k] >= capacity:
            return k + 1
    set_leaves(s, m, p, idx, svals, mvals)
    return 0


@numba.njit(cache=True, nogil=True)
def _descend(s: np.ndarray, p: int, x: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """Node reached by each prefix-sum mass ``x[k]`` (consumed), the whole batch advanced one
    level at a time."""
    n = x.shape[0]
    node = np.ones(n, np.int64)
    width = 1
    while width < p:
        for k in range(n):
            # Branch-free: which child a mass goes to is a coin flip the branch predictor
            # misses half the time, which costs more than the memory access.
            c = node[k] * 2
            ls = s[c]
            xk = x[k]
            right = xk >= ls
            x[k] = xk - ls if right else xk
            node[k] = c + right
        width *= 2
    return node


@numba.njit(cache=True, nogil=True)
def find(s: np.ndarray, p: int, mass: np.ndarray,
         out: np.ndarray) -> None:  # pragma: no cover - compiled
    """Leaf whose prefix-sum interval holds each ``mass[k]``, written to ``out[k]``."""
    node = _descend(s, p, mass.copy())
    for k in range(mass.shape[0]):
        out[k] = node[k] - p


@numba.njit(cache=True, nogil=True)
def stratified_draw(s: np.ndarray, m: np.ndarray, p: int, last: int, u: np.ndarray,
                    mass_cap: float, beta: float, size: int, out_idx: np.ndarray,
                    out_w: np.ndarray) -> None:  # pragma: no cover - compiled
    """One stratified proportional draw with importance weights, in a single pass.

    Row ``k`` takes the mass ``(k + u[k]) · total / B`` (capped below ``total``), descends to
    its leaf (clamped to ``last``), and gets ``(size · P(i))^-β`` normalized by the largest
    weight over the buffer, ``(size · P_min)^-β``.
    """
    n = u.shape[0]
    total = s[1]
    step = total / n
    x = np.empty(n)
    for k in range(n):
        v = (k + u[k]) * step
        x[k] = v if v < mass_cap else mass_cap
    node = _descend(s, p, x)
    w_max = (size * (m[1] / total)) ** -beta
    for k in range(n):
        leaf = node[k] - p
        if leaf > last:
            leaf = last
        out_idx[k] = leaf
        prob = s[p + leaf] / total
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
def set_priorities(s: np.ndarray, m: np.ndarray, p: int, idx: np.ndarray, pr: np.ndarray,
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
        if not m[p + idx[k]] < np.inf:
            return 5, pmax
    for k in range(leaves.shape[0]):
        if not leaves[k] <= bound:
            return 4, pmax
    set_leaves(s, m, p, idx, leaves, leaves)
    return 0, pmax
