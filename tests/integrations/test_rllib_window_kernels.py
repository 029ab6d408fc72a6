"""The compiled n-step window kernels against the NumPy formulation they replace."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ray.rllib")
from hypothesis import given, settings
from hypothesis import strategies as st

from conduit.integrations.rllib import _window_kernels as kernels


def _links(rng: np.random.Generator, capacity: int) -> np.ndarray:
    """Successor links of episodes laid in ring order: each slot links to the next one, and
    an episode's last stored row links to -1."""
    succ = np.arange(1, capacity + 1, dtype=np.int64)
    ends = rng.random(capacity) < 0.2
    ends[-1] = True
    succ[ends] = -1
    return succ


def _numpy_windows(succ, starts, n):
    size = len(starts)
    width = int(n.max()) if size else 1
    slots = np.empty((size, width), dtype=np.int64)
    valid = np.zeros((size, width), dtype=bool)
    cur, alive, last = starts.astype(np.int64), np.ones(size, dtype=bool), starts
    for k in range(width):
        alive &= (k < n) & (cur >= 0)
        last = np.where(alive, cur, last)
        slots[:, k], valid[:, k] = last, alive
        cur = np.where(alive, succ[np.maximum(cur, 0)], -1)
    return slots, valid, valid.sum(axis=1)


def _numpy_complete(succ, starts, n):
    cur = starts.astype(np.int64)
    for k in range(1, int(n.max()) if len(n) else 1):
        step = (k < n) & (cur >= 0)
        cur = np.where(step, succ[np.maximum(cur, 0)], cur)
    return cur >= 0


def _numpy_sums(reward, slots, valid, gamma):
    acc = np.zeros(len(slots), dtype=np.float64)
    for k in reversed(range(slots.shape[1])):
        acc = np.where(valid[:, k], reward[slots[:, k]] + gamma * acc, acc)
    return acc


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), capacity=st.integers(1, 300),
       batch=st.integers(0, 64), low=st.integers(1, 6), span=st.integers(0, 4),
       gamma=st.floats(0.0, 1.0))
def test_kernels_match_the_numpy_formulation_element_for_element(seed, capacity, batch, low,
                                                                 span, gamma):
    rng = np.random.default_rng(seed)
    succ = _links(rng, capacity)
    reward = rng.standard_normal(capacity) * 10
    starts = rng.integers(0, capacity, size=batch)
    n = rng.integers(low, low + span + 1, size=batch)
    width = int(n.max()) if batch else 1

    slots, valid, length = kernels.lay_windows(succ, starts, n, width)
    want = _numpy_windows(succ, starts, n)
    for got, expected in zip((slots, valid, length), want):
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(kernels.complete(succ, starts, n),
                                  _numpy_complete(succ, starts, n))
    # Bit for bit: the same float64 terms, added in the same order.
    np.testing.assert_array_equal(kernels.discounted_sums(reward, slots, valid, gamma),
                                  _numpy_sums(reward, slots, valid, gamma))


def test_a_window_stops_at_the_episode_end_and_repeats_its_last_slot():
    succ = np.array([1, 2, -1, 4, -1], dtype=np.int64)  # episodes [0, 1, 2] and [3, 4]
    starts = np.array([0, 1, 3, 4], dtype=np.int64)
    n = np.array([3, 3, 3, 1], dtype=np.int64)
    slots, valid, length = kernels.lay_windows(succ, starts, n, 3)
    assert slots.tolist() == [[0, 1, 2], [1, 2, 2], [3, 4, 4], [4, 4, 4]]
    assert length.tolist() == [3, 2, 2, 1]
    assert kernels.complete(succ, starts, n).tolist() == [True, False, False, True]
    reward = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    sums = kernels.discounted_sums(reward, slots, valid, 0.5)
    assert sums.tolist() == [1 + 0.5 * (2 + 0.5 * 4), 2 + 0.5 * 4, 8 + 0.5 * 16, 16.0]
