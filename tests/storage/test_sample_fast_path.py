"""The synchronous sample path: its draw, its delivery bookkeeping and its priority update."""


import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conduit import PriorityError, StateError
from conduit.storage import (
    ExperienceBuffer,
    FifoSampler,
    PrioritizedSampler,
    SampleInfo,
    Sampler,
    SumTree,
    UniformSampler,
    column_store,
    data_path_threads,
)
from conduit.storage.column_store import GatherOutputs
from conduit.storage.threads import GatherWorkers
from tests.conftest import make_rows, one_and_two_threads


@pytest.mark.parametrize("size", [1, 2, 3, 7, 2**20, 2**31 - 1, 2**32 + 5, 10**12 + 7])
def test_uniform_draw_stays_inside_the_filled_slots(size):
    s = UniformSampler(seed=1)
    idx = s.sample(size, 4096).indices
    assert idx.dtype == torch.int64 and idx.shape == (4096,)
    assert int(idx.min()) >= 0 and int(idx.max()) < size
    if size >= 2**20:  # a draw that ignored the top of the range would show here
        assert int(idx.max()) > size // 2


def test_a_state_without_the_torch_draws_continues_from_its_numpy_generator():
    a = UniformSampler(seed=5)
    a.sample(100, 8)
    numpy_only = {k: v for k, v in a.state_dict().items() if k != "draws"}
    b, c = UniformSampler(seed=1), UniformSampler(seed=2)
    b.load_state_dict(numpy_only)
    c.load_state_dict(numpy_only)
    assert torch.equal(b.sample(100, 8).indices, c.sample(100, 8).indices)
    other = UniformSampler(seed=5)  # another numpy state: another stream
    other.sample(100, 16)
    d = UniformSampler(seed=1)
    d.load_state_dict({k: v for k, v in other.state_dict().items() if k != "draws"})
    assert not torch.equal(d.sample(100, 64).indices, UniformSampler(seed=1).sample(100, 64)
                           .indices)


@pytest.mark.parametrize("bad", [torch.zeros(3, dtype=torch.uint8), "x",
                                 torch.zeros(5056, dtype=torch.float32)])
def test_a_malformed_draws_state_is_refused_by_name(bad):
    state = UniformSampler(seed=5).state_dict()
    with pytest.raises(StateError, match=r"sampler\.draws"):
        UniformSampler().load_state_dict({**state, "draws": bad})


def test_uniform_draw_is_uniform():
    s = UniformSampler(seed=3)
    n, size = 140_000, 7
    counts = np.bincount(s.sample(size, n).indices.numpy(), minlength=size)
    expect = n / size
    sigma = (expect * (1 - 1 / size)) ** 0.5
    assert counts.size == size and np.all(np.abs(counts - expect) < 5 * sigma), counts


def test_a_uniform_sampler_state_resumes_the_same_draws():
    a = UniformSampler(seed=5)
    a.sample(100, 8)
    state = a.state_dict()
    want = a.sample(100, 8).indices
    b = UniformSampler(seed=99)
    b.load_state_dict(state)
    assert torch.equal(b.sample(100, 8).indices, want)


def test_accepts_priorities_follows_update_priorities():
    class Custom(Sampler):
        def sample(self, size: int, batch_size: int) -> SampleInfo:
            return SampleInfo(torch.zeros(batch_size, dtype=torch.int64))

        def update_priorities(self, indices: torch.Tensor, priorities: torch.Tensor) -> None:
            return None

    assert PrioritizedSampler.accepts_priorities and Custom.accepts_priorities
    assert not UniformSampler.accepts_priorities and not FifoSampler.accepts_priorities


def test_only_samplers_with_priorities_record_delivered_rows(small_spec):
    for sampler, recorded in ((UniformSampler(seed=0), False), (PrioritizedSampler(), True)):
        buf = ExperienceBuffer(spec=small_spec, capacity=16, sampler=sampler)
        buf.extend(make_rows(small_spec, 16))
        idx = buf.sample(8)["_index"].numpy()
        assert (buf._delivered_id[idx] == buf._row_id[idx]).all() == recorded


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "numpy"])
def test_update_skips_exactly_the_overwritten_rows(small_spec, monkeypatch, compiled):
    if not compiled:
        monkeypatch.setattr("conduit.storage.compiled.load", lambda name: None)
    buf = ExperienceBuffer(spec=small_spec, capacity=8, sampler=PrioritizedSampler(seed=0))
    buf.extend(make_rows(small_spec, 8))
    got = buf.gather(torch.arange(8))
    buf.extend(make_rows(small_spec, 3, start=100))  # slots 0, 1, 2 now hold other rows
    before = buf.sampler.priorities(torch.arange(8)).clone()
    assert buf.update_priorities(got["_index"], torch.full((8,), 5.0)) == 5
    after = buf.sampler.priorities(torch.arange(8))
    assert torch.equal(after[:3], before[:3])
    assert torch.allclose(after[3:], torch.full((5,), (5.0 + 1e-6) ** 0.6, dtype=after.dtype))
    with pytest.raises(PriorityError, match=r"filled slots in \[0, 8\)"):
        buf.update_priorities(torch.tensor([0, 8]), torch.ones(2))
    assert buf.update_priorities(torch.tensor([], dtype=torch.int64), torch.ones(0)) == 0


@given(capacity=st.integers(1, 200), seed=st.integers(0, 2**31),
       kind=st.sampled_from(["ok", "nan", "negative", "index", "huge", "unset"]))
@settings(max_examples=60, deadline=None)
def test_set_priorities_backends_agree_bit_for_bit(capacity, seed, kind):
    rng = np.random.default_rng(seed)
    a, b = SumTree(capacity=capacity, backend="numba"), SumTree(capacity=capacity,
                                                                 backend="numpy")
    filled = capacity - 1 if kind == "unset" else capacity  # the last leaf never set
    base = np.arange(filled)
    for t in (a, b):
        t.set(base, np.ones(filled))
    n = int(rng.integers(1, 2 * capacity + 2))
    idx = rng.integers(0, capacity, n)
    pr = rng.random(n) * 10
    if kind == "nan":
        pr[-1] = np.nan
    elif kind == "negative":
        pr[0] = -1.0
    elif kind == "index":
        idx[-1] = capacity
    elif kind == "huge":
        pr[n // 2] = 1e300
    elif kind == "unset":
        idx[-1] = capacity - 1
    got = [t.set_priorities(idx, pr, alpha=0.6, eps=1e-6, bound=1e100) for t in (a, b)]
    want = {"ok": None, "nan": "not finite", "negative": "negative", "index": "index",
            "huge": "too large", "unset": "unset"}[kind]
    assert got[0][0] == got[1][0] == want
    if want is None:
        assert got[0][1] == got[1][1] == pr.max()
    assert np.array_equal(a._sum, b._sum) and np.array_equal(a._min, b._min)
    if want is not None:  # nothing set
        assert a.total == filled


@pytest.mark.skipif(column_store._storage_use_count is None,
                    reason="this torch exposes no storage use count")
def test_holding_one_field_keeps_the_whole_set(small_spec):
    pool = GatherOutputs(small_spec.fields, keep=2)
    first = pool.take(5)
    for v in first.values():
        v.fill_(1)
    done = first["done"]
    del first
    for _ in range(4):
        for v in pool.take(5).values():
            v.fill_(0)
    assert done.all()


def test_data_path_threads_sets_and_restores():
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    with data_path_threads(want):
        assert torch.get_num_threads() == want
        with data_path_threads(want):
            assert torch.get_num_threads() == want
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), data_path_threads(want):
        raise RuntimeError("the body failed")
    assert torch.get_num_threads() == before


def test_split_gathers_return_the_same_rows(small_spec):
    one, two = one_and_two_threads(small_spec, lambda: UniformSampler(seed=1))
    two._reader.workers = GatherWorkers(threads=2, min_bytes=0, trials=3)
    for _ in range(12):  # trials of both kinds, then the chosen one
        a, b = one.sample(33), two.sample(33)
        for k in a:
            assert torch.equal(a[k], b[k]), k
    assert two._reader.workers.split is not None


def test_split_gather_runs_every_range_and_reraises():
    workers = GatherWorkers(threads=3)
    seen = []
    workers.run([lambda k=k: seen.append(k) for k in range(3)])
    assert sorted(seen) == [0, 1, 2]

    def boom() -> None:
        raise ValueError("range failed")

    with pytest.raises(ValueError, match="range failed"):
        workers.run([lambda: seen.append(3), boom])
    assert 3 in seen
    workers.run([lambda: seen.append(4), lambda: seen.append(5)])  # still usable
    assert {4, 5} <= set(seen)
    with pytest.raises(ValueError, match="jobs"):
        workers.run([lambda: None] * 4)


def test_split_is_kept_only_where_it_measured_faster(monkeypatch):
    from conduit.storage import threads as threads_module

    now = [0.0]
    monkeypatch.setattr(threads_module, "time", type("Clock", (), {
        "perf_counter": staticmethod(lambda: now[0])}))  # moved only by the fake gathers
    workers = GatherWorkers(threads=2, min_bytes=10, trials=2)

    def slow() -> None:
        now[0] += 1.0

    def whole() -> None:  # slow on torch's intra-op threads, fast on one
        now[0] += 1.0 if torch.get_num_threads() > 1 else 0.1

    with data_path_threads(1):  # as a buffer calls it
        for _ in range(6):
            workers.gather(100, whole, [slow, lambda: None])
        assert workers.split is False and workers.mode == "one"
        calls = []
        workers.gather(100, lambda: calls.append("whole"), [lambda: calls.append("part")] * 2)
        workers.gather(5, lambda: calls.append("small"), [lambda: calls.append("part")] * 2)
    assert calls == ["whole", "small"]
