import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conduit import ConfigError, EmptyBufferError, PriorityError
from conduit.storage import (
    ExperienceBuffer,
    FifoSampler,
    Placement,
    PrioritizedSampler,
    SequenceSampler,
    SumTree,
    UniformSampler,
)
from tests.conftest import make_rows


def test_uniform_is_deterministic_and_in_range(small_spec):
    def draw(seed):
        buf = ExperienceBuffer(spec=small_spec, capacity=50, sampler=UniformSampler(seed=seed))
        buf.extend(make_rows(small_spec, 30))
        return [buf.sample(16)["id"] for _ in range(3)]
    a, b, c = draw(0), draw(0), draw(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    assert all(int(x.max()) < 30 for x in a)


def test_uniform_without_replacement(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=50,
                           sampler=UniformSampler(replacement=False, seed=0))
    buf.extend(make_rows(small_spec, 20))
    for _ in range(20):
        ids = buf.sample(20)["id"].tolist()
        assert sorted(ids) == list(range(20))
    with pytest.raises(EmptyBufferError):
        buf.sample(21)


def test_empty_buffer_raises(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=5)
    with pytest.raises(EmptyBufferError, match="empty"):
        buf.sample(2)


@pytest.mark.parametrize("backend", ["numba", "numpy"])
@given(values=st.lists(st.floats(0, 100), min_size=1, max_size=40), seed=st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_sum_tree_matches_numpy(backend, values, seed):
    tree = SumTree(capacity=len(values), backend=backend)
    tree.set(np.arange(len(values)), np.array(values))
    assert tree.total == pytest.approx(sum(values), rel=1e-9, abs=1e-9)
    assert tree.min == pytest.approx(min(values))
    if tree.total > 0:
        rng = np.random.default_rng(seed)
        mass = rng.random(64) * tree.total
        got = tree.find(mass)
        cum = np.cumsum(values)
        want = np.minimum(np.searchsorted(cum, mass, side="right"), len(values) - 1)
        # Equal prefix sums (zero leaves) may resolve to any index of the same mass interval.
        assert np.allclose(cum[got], cum[want])


@given(capacity=st.integers(1, 300), seed=st.integers(0, 2**31),
       ops=st.lists(st.sampled_from(["set", "clear", "set_dup", "find", "draw", "check"]),
                    min_size=1,
                    max_size=25))
@settings(max_examples=80, deadline=None)
def test_sum_tree_backends_agree_bit_for_bit(capacity, seed, ops):
    """The compiled and the numpy walk leave identical trees and find identical leaves."""
    rng = np.random.default_rng(seed)
    a, b = SumTree(capacity=capacity, backend="numba"), SumTree(capacity=capacity,
                                                                 backend="numpy")
    for op in ops:
        if op in ("set", "set_dup"):
            n = int(rng.integers(1, 2 * capacity + 2))
            idx = rng.integers(0, capacity, n)
            if op == "set_dup":  # repeated indices: the last write must win in both
                idx[-1] = idx[0]
            vals = rng.random(n) * 10
            a.set(idx, vals)
            b.set(idx, vals)
        elif op == "clear":
            idx = rng.integers(0, capacity, int(rng.integers(1, capacity + 1)))
            a.clear(idx)
            b.clear(idx)
        elif op == "check":
            idx = rng.integers(-1, capacity + 1, 5)
            pr = rng.choice([0.0, 1.5, -1.0, np.nan, np.inf], 5)
            assert a.check(idx, pr) == b.check(idx, pr)
        elif a.total > 0 and op == "find":
            mass = rng.random(int(rng.integers(1, 70))) * a.total
            assert np.array_equal(a.find(mass), b.find(mass))
        elif a.total > 0:
            u, size = rng.random(int(rng.integers(1, 70))), int(rng.integers(1, capacity + 1))
            with np.errstate(over="ignore"):  # cleared leaves clamped into a draw: weight inf
                (ia, wa), (ib, wb) = (t.stratified_draw(u, size=size, beta=0.4)
                                      for t in (a, b))
            assert np.array_equal(ia, ib) and ia.max() < size
            assert wa.dtype == wb.dtype == np.float32
            np.testing.assert_allclose(wa, wb, rtol=1e-6)
        assert np.array_equal(a._sum, b._sum)
        assert np.array_equal(a._min, b._min)
    assert a.total == b.total and a.min == b.min


def test_sum_tree_backend_is_validated():
    with pytest.raises(ConfigError, match="backend"):
        SumTree(capacity=4, backend="cuda")


def test_prioritized_weights_and_updates(small_spec):
    s = PrioritizedSampler(alpha=1.0, beta=1.0, seed=0)
    buf = ExperienceBuffer(spec=small_spec, capacity=8, sampler=s)
    buf.extend(make_rows(small_spec, 8))
    buf.update_priorities(torch.arange(8), torch.tensor([1.0, 1, 1, 1, 1, 1, 1, 9]))
    counts = np.bincount(buf.sample(4000)["_index"].numpy(), minlength=8)
    assert counts[7] > 2000  # 9/16 of the mass
    b = buf.sample(64)
    p = s.priorities(b["_index"]).numpy()
    # w_i ∝ (N·P(i))^-β normalized by the max: the rarest row has weight 1.
    expect = (p.min() / p)
    assert np.allclose(b["_weight"].numpy(), expect, rtol=1e-4)


def test_priority_update_visible_to_next_sample(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=32, sampler=PrioritizedSampler(seed=0))
    buf.extend(make_rows(small_spec, 32))
    pr = torch.zeros(32)
    pr[5] = 1.0
    buf.sampler.eps = 1e-12
    buf.update_priorities(torch.arange(32), pr)
    assert set(buf.sample(64)["id"].tolist()) == {5}


@pytest.mark.parametrize("bad", [[float("nan")], [-1.0], [float("inf")]])
def test_bad_priorities(small_spec, bad):
    buf = ExperienceBuffer(spec=small_spec, capacity=4, sampler=PrioritizedSampler())
    buf.extend(make_rows(small_spec, 4))
    with pytest.raises(PriorityError, match="priorities"):
        buf.update_priorities(torch.tensor([0]), torch.tensor(bad))


def test_priority_length_mismatch_and_range(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=4, sampler=PrioritizedSampler())
    buf.extend(make_rows(small_spec, 4))
    with pytest.raises(PriorityError, match="2 values for 1"):
        buf.update_priorities(torch.tensor([0]), torch.tensor([1.0, 2.0]))
    with pytest.raises(PriorityError, match="indices"):
        buf.update_priorities(torch.tensor([9]), torch.tensor([1.0]))
    with pytest.raises(PriorityError):
        ExperienceBuffer(spec=small_spec, capacity=4).update_priorities(
            torch.tensor([0]), torch.tensor([1.0]))


def test_a_sampler_used_directly_refuses_updates_for_slots_without_rows():
    s = PrioritizedSampler(seed=0)
    s.bind(8)
    s.on_write(torch.arange(3), {}, size=3)
    with pytest.raises(PriorityError, match="hold no row"):
        s.update_priorities(torch.tensor([1, 5]), torch.tensor([2.0, 9.0]))
    assert s.tree.total == pytest.approx(3 * (1 + 1e-6) ** 0.6)  # nothing was set
    assert set(s.sample(3, 512).indices.tolist()) <= {0, 1, 2}
    with pytest.raises(PriorityError, match="integer slots"):
        s.update_priorities(torch.tensor([1.7]), torch.tensor([2.0]))
    s.update_priorities(torch.tensor([1]), torch.tensor([2.0]))
    s.reset()
    with pytest.raises(PriorityError, match="hold no row"):
        s.update_priorities(torch.tensor([1]), torch.tensor([2.0]))


@given(n=st.integers(1, 200), m=st.integers(1, 16), seed=st.integers(0, 1000))
@settings(max_examples=80, deadline=None)
def test_fifo_exactly_once_per_epoch(n, m, seed):
    if m > n:
        m = n
    s = FifoSampler(num_minibatches=m, seed=seed)
    for epoch in range(2):
        s.begin_epoch(n, iteration=3, epoch=epoch)
        parts = [s.sample(n).indices for _ in range(m)]
        sizes = [p.numel() for p in parts]
        assert max(sizes) - min(sizes) <= 1
        assert sorted(torch.cat(parts).tolist()) == list(range(n))
        with pytest.raises(EmptyBufferError):
            s.sample(n)


def test_fifo_depends_only_on_seed_iteration_epoch():
    a, b = FifoSampler(num_minibatches=4, seed=7), FifoSampler(num_minibatches=4, seed=7)
    a.begin_epoch(40, iteration=2, epoch=1)
    b.sample  # noqa: B018 - b has drawn nothing else; the layout may not depend on history
    b.begin_epoch(40, iteration=0, epoch=0)
    b.begin_epoch(40, iteration=2, epoch=1)
    assert all(torch.equal(a.sample(40).indices, b.sample(40).indices) for _ in range(4))


def test_sequence_slices_stay_inside_episodes(small_spec):
    s = SequenceSampler(length=3, seed=0)
    buf = ExperienceBuffer(spec=small_spec, capacity=20, sampler=s)
    buf.extend(make_rows(small_spec, 15))
    buf.extend(make_rows(small_spec, 12, start=15))  # wraps; done where id % 7 == 6
    b = buf.sample(200)
    ids, done = b["id"], b["done"]
    assert ids.shape == (200, 3)
    assert torch.all(ids[:, 1:] - ids[:, :-1] == 1)  # contiguous in time, never across the head
    assert not torch.any(done[:, :-1])               # an episode may end only at the last step
    assert int(ids.min()) >= 7                        # only rows still stored


def test_sequence_not_enough_data(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=20, sampler=SequenceSampler(length=10))
    buf.extend(make_rows(small_spec, 8))
    with pytest.raises(EmptyBufferError, match="length 10"):
        buf.sample(2)


@pytest.mark.parametrize("make", [lambda: UniformSampler(seed=4),
                                  lambda: PrioritizedSampler(seed=4),
                                  lambda: SequenceSampler(length=2, seed=4)])
def test_same_seed_same_batches_on_every_store(small_spec, make):
    outs = []
    for placement in [Placement.pageable(), Placement.pinned(),
                      Placement.sharded(["cpu", "cpu", "cpu", "cpu"])]:
        buf = ExperienceBuffer(spec=small_spec, capacity=64, sampler=make(), placement=placement)
        buf.extend(make_rows(small_spec, 50))
        outs.append([buf.sample(32) for _ in range(3)])
    for other in outs[1:]:
        for x, y in zip(outs[0], other):
            for k in x:
                assert torch.equal(x[k], y[k]), k


@given(n=st.integers(1, 200), m=st.integers(1, 16), within=st.floats(0.01, 1.0),
       seed=st.integers(0, 1000))
@settings(max_examples=80, deadline=None)
def test_fifo_first_within_keeps_exactly_once_and_leads_from_the_head(n, m, within, seed):
    m = min(m, n)
    s = FifoSampler(num_minibatches=m, seed=seed, first_within=within)
    for epoch in range(2):
        parts = s.layout(n, iteration=1, epoch=epoch)
        sizes = [p.numel() for p in parts]
        assert len(parts) == m and max(sizes) - min(sizes) <= 1
        assert sorted(torch.cat(parts).tolist()) == list(range(n))
    head = max(sizes[0], int(within * n))
    assert int(s.layout(n, iteration=1, epoch=0)[0].max()) < head


def test_fifo_first_within_one_is_the_plain_shuffle():
    a = FifoSampler(num_minibatches=4, seed=7)
    b = FifoSampler(num_minibatches=4, seed=7, first_within=1.0)
    for epoch in range(2):
        assert all(torch.equal(x, y) for x, y in zip(a.layout(40, iteration=2, epoch=epoch),
                                                      b.layout(40, iteration=2, epoch=epoch)))
    c = FifoSampler(num_minibatches=4, seed=7, first_within=0.5)
    assert all(torch.equal(x, y) for x, y in zip(a.layout(40, iteration=2, epoch=1),
                                                  c.layout(40, iteration=2, epoch=1)))
    assert c.config()["first_within"] == 0.5


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, float("nan")])
def test_fifo_first_within_is_validated(bad):
    with pytest.raises(ConfigError, match="first_within"):
        FifoSampler(num_minibatches=4, first_within=bad)


def test_fifo_leading_draws_the_first_minibatch_from_every_unit_but_the_last():
    assert FifoSampler.leading(units=4, num_minibatches=2, seed=3).first_within == 0.75
    assert FifoSampler.leading(units=1, num_minibatches=2).first_within == 1.0  # plain shuffle
    first = FifoSampler.leading(units=4, num_minibatches=4, seed=5).layout(
        64, iteration=0, epoch=0)[0]
    assert int(first.max()) < 48  # none of the last unit's 16 rows
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="units"):
            FifoSampler.leading(units=bad)


def test_a_late_update_skips_rows_that_took_its_slots_even_once_they_were_delivered():
    # Defect: a slot remembered only the row last delivered from it, so once the row that
    # overwrote a sampled one was delivered too, the older batch's update landed on it.
    from conduit import ExperienceDataPlane, ExperienceSpec
    spec = ExperienceSpec.of(id=((), torch.int64))
    buf = ExperienceBuffer(spec=spec, capacity=8, sampler=PrioritizedSampler(seed=0))
    buf.extend({"id": torch.arange(8)})
    a = buf.sample(8)
    buf.extend({"id": torch.arange(100, 104)})  # takes slots 0..3
    b = buf.sample(8)
    assert set(b["_index"].tolist()) & {0, 1, 2, 3}
    before = buf.sampler.priorities(torch.arange(8)).clone()
    kept = set(range(4, 8)) & set(a["_index"].tolist())
    assert buf.update_priorities(a["_index"], torch.full((8,), 50.0)) == sum(
        1 for s in a["_index"].tolist() if s in kept)
    after = buf.sampler.priorities(torch.arange(8))
    assert torch.equal(after[:4], before[:4])  # the new rows keep their own priorities
    assert buf.update_priorities(b["_index"], torch.full((8,), 7.0)) == 8
    half = b["_index"][:4]  # a slice of a delivered _index (a mini-batch of it) matches too
    assert buf.update_priorities(half, torch.full((4,), 9.0)) == 4

    with ExperienceDataPlane(spec=spec, capacity=8, batch_size=8, sampler="prioritized",
                             timeout=5) as plane:
        plane.push({"id": torch.arange(8)})
        first = plane.pull()
        plane.push({"id": torch.arange(100, 108)})  # every row of the first batch goes
        plane.pull()  # the learner pulls the next batch before updating the first
        leaves = plane.buffer.sampler.priorities(torch.arange(8)).clone()
        plane.update_priorities(first["_index"], torch.full((8,), 1e6))
        assert torch.equal(plane.buffer.sampler.priorities(torch.arange(8)), leaves)
