"""The sum tree's 4-ary layout: aligned rows that survive copies, the memory it reports, and
capacities on either side of a power of four."""

import copy
import pickle

import numpy as np
import pytest

from conduit.storage import PrioritizedSampler, SumTree

BACKENDS = ["numba", "numpy"]


@pytest.mark.parametrize("capacity", [1, 5, 1000, 100_000])
def test_rows_start_on_cache_lines_and_copies_are_their_own(capacity):
    tree = SumTree(capacity=capacity)
    tree.set(np.arange(capacity), np.arange(capacity) + 1.0)
    assert tree._nodes.ctypes.data % 64 == 0 and tree._nodes.shape[1] == 8
    for other in (copy.deepcopy(tree), pickle.loads(pickle.dumps(tree))):
        assert other._nodes.ctypes.data % 64 == 0
        np.testing.assert_array_equal(other._nodes, tree._nodes)
        other.set(np.array([0]), np.array([1000.0]))  # a copy's write is its own, everywhere
        assert other.get(np.array([0]))[0] == 1000.0 and tree.get(np.array([0]))[0] == 1.0
        assert other.total == tree.total + 999.0
        other.clear(np.array([capacity - 1]))
        assert not other.is_set()[capacity - 1] and tree.is_set()[capacity - 1]


@pytest.mark.parametrize("capacity", [1, 4, 5, 16, 17, 1000, 2**20 + 1])
def test_the_memory_a_sampler_reports_is_its_trees(capacity):
    sampler = PrioritizedSampler()
    sampler.bind(capacity)
    nodes = sampler.tree._nodes.nbytes
    assert nodes <= sampler.bind_bytes(capacity) <= nodes + 64
    assert sampler.tree._nodes.shape[0] * 4 >= capacity  # one inner node per four leaves


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("capacity", [1, 3, 4, 5, 15, 16, 17, 63, 64, 65, 257])
def test_capacities_around_a_power_of_four(backend, capacity):
    rng = np.random.default_rng(capacity)
    values = rng.random(capacity) + 0.01
    tree = SumTree(capacity=capacity, backend=backend)
    tree.set(np.arange(capacity), values)
    assert tree.total == pytest.approx(values.sum(), rel=1e-12)
    assert tree.min == values.min()
    np.testing.assert_array_equal(tree.get(np.arange(capacity)), values)
    assert tree.is_set().all() and len(tree.is_set()) == capacity
    cum = np.cumsum(values)
    mass = rng.random(200) * cum[-1]
    want = np.minimum(np.searchsorted(cum, mass, side="right"), capacity - 1)
    np.testing.assert_array_equal(tree.find(mass), want)
    idx, w = tree.stratified_draw(rng.random(64), size=capacity, beta=0.4)
    assert idx.min() >= 0 and idx.max() < capacity and (w > 0).all() and (w <= 1).all()
    state = tree.state_dict()
    again = SumTree(capacity=capacity, backend=backend)
    again.load_state_dict(state)
    np.testing.assert_array_equal(again._nodes, tree._nodes)
    tree.set(np.arange(capacity), values + 1.0)  # a state is a copy, not a view of the tree
    tree.clear(np.array([0]))
    np.testing.assert_array_equal(state["leaves"].numpy(), values)
    assert state["set"].numpy().all()
