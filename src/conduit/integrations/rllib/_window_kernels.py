"""Compiled n-step window kernels (Numba) for
:class:`~conduit.integrations.rllib.episode_rows.EpisodeRows`.

A sample of ``B`` transitions follows up to ``n`` successor links per row. In NumPy that is a
dozen array operations per step on arrays of ``B`` elements, each costing more in dispatch than
its arithmetic; these loops walk each row's links directly. Their results are the NumPy
formulation's, element for element: the reward sums add the same float64 terms in the same
order (last step first).

The kernels are compiled on first use and cached next to this file (``cache=True``).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def lay_windows(succ: np.ndarray, starts: np.ndarray, n: np.ndarray, width: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """Slots ``[B, width]`` of each window of ``n[i]`` steps from ``starts[i]`` (the last
    slot repeated past the window's end), which of them belong to it, and its length: the
    window stops where ``succ`` is -1 (the stored episode ends)."""
    size = starts.shape[0]
    slots = np.empty((size, width), np.int64)
    valid = np.zeros((size, width), np.bool_)
    length = np.zeros(size, np.int64)
    for i in range(size):
        cur = np.int64(starts[i])
        last = cur
        alive = True
        count = 0
        for k in range(width):
            alive = alive and k < n[i] and cur >= 0
            if alive:
                last = cur
                valid[i, k] = True
                count += 1
                cur = succ[cur]
            slots[i, k] = last
        length[i] = count
    return slots, valid, length


@numba.njit(cache=True, nogil=True)
def complete(succ: np.ndarray, starts: np.ndarray, n: np.ndarray
             ) -> np.ndarray:  # pragma: no cover - compiled
    """Whether each window of ``n[i]`` steps from ``starts[i]`` holds all of them."""
    size = starts.shape[0]
    out = np.empty(size, np.bool_)
    for i in range(size):
        cur = np.int64(starts[i])
        for _ in range(1, n[i]):
            if cur < 0:
                break
            cur = succ[cur]
        out[i] = cur >= 0
    return out


@numba.njit(cache=True, nogil=True)
def discounted_sums(reward: np.ndarray, slots: np.ndarray, valid: np.ndarray, gamma: float
                    ) -> np.ndarray:  # pragma: no cover - compiled
    """``Σ_k γ^k r`` over each window's valid steps, accumulated last step first
    (``acc = r_k + γ·acc``), in float64."""
    size, width = slots.shape
    out = np.zeros(size, np.float64)
    for i in range(size):
        acc = 0.0
        for k in range(width - 1, -1, -1):
            if valid[i, k]:
                acc = reward[slots[i, k]] + gamma * acc
        out[i] = acc
    return out
