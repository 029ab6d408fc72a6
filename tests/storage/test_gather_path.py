"""The gather path: rows into reused host outputs, never over a batch someone still holds."""

import threading

import numpy as np
import pytest
import torch

from conduit import ExperienceDataPlane, Schedule
from conduit.plane.ports import LearnerOut
from conduit.spec import ExperienceSpec
from conduit.storage import ExperienceBuffer, Placement, SequenceSampler, column_store, make_store
from conduit.storage.column_store import GatherOutputs
from tests.conftest import make_rows

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.uint8, torch.bool]
PLACEMENTS = [Placement.pageable(), Placement.sharded(["cpu", "cpu", "cpu"]),
              Placement.sharded(["cpu", "cpu"], shares=(0.25, 0.75))]


def wide_spec() -> ExperienceSpec:
    """Every dtype, as a scalar and as a multi-dimensional row."""
    fields = {}
    for k, dt in enumerate(DTYPES):
        fields[f"s{k}"] = ((), dt)
        fields[f"m{k}"] = ((2, 3), dt)
    return ExperienceSpec.of(**fields)


def filled(placement: Placement, capacity: int = 40) -> tuple:
    spec = wide_spec()
    store = make_store(spec=spec, capacity=capacity, placement=placement)
    rows = make_rows(spec, capacity, start=3)
    store.set_range(0, rows)
    return store, rows


def data_ptrs(batch: dict) -> set[int]:
    return {v.data_ptr() for v in batch.values() if v.numel()}


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.label())
@pytest.mark.parametrize("shape", [(7,), (3, 4), (1,)], ids=str)
def test_get_returns_the_indexed_rows_for_every_dtype_and_shape(placement, shape):
    store, rows = filled(placement)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):  # later calls run on reused outputs
        idx = torch.randint(0, 40, shape, generator=gen)
        got = store.get(idx)
        assert set(got) == set(rows)
        for k, v in rows.items():
            want = v[idx.reshape(-1)].reshape(*shape, *v.shape[1:])
            assert got[k].dtype == v.dtype and got[k].shape == want.shape
            assert torch.equal(got[k], want), k


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.label())
def test_a_held_batch_is_never_overwritten(placement):
    store, rows = filled(placement)
    gen = torch.Generator().manual_seed(2)
    held = []
    for _ in range(12):  # more batches held than the pool keeps
        idx = torch.randint(0, 40, (9,), generator=gen)
        held.append((idx, store.get(idx)))
    for idx, got in held:
        for k, v in rows.items():
            assert torch.equal(got[k], v[idx]), k


@pytest.mark.parametrize("keep_alive", ["field", "view", "numpy"])
def test_any_reference_into_a_batch_keeps_it(keep_alive):
    store, _ = filled(Placement.pageable())
    got = store.get(torch.arange(10))
    ref = {"field": lambda b: b["m0"], "view": lambda b: b["m0"][2:5, 1],
           "numpy": lambda b: b["m0"].numpy()}[keep_alive](got)
    expect = ref.copy() if isinstance(ref, np.ndarray) else ref.clone()
    del got
    for _ in range(8):
        store.get(torch.arange(30, 40))
    assert (ref == expect).all()


needs_use_count = pytest.mark.skipif(column_store._storage_use_count is None,
                                     reason="this torch exposes no storage use count")


@needs_use_count
def test_a_dropped_batch_is_reused():
    store, _ = filled(Placement.pageable())
    idx = torch.arange(5)
    first = store.get(idx)
    mem = data_ptrs(first)
    second = store.get(idx)
    assert not mem & data_ptrs(second)  # the first is still held
    del first
    third = store.get(idx)
    assert data_ptrs(third) == mem
    assert not data_ptrs(second) & data_ptrs(third)


@needs_use_count
def test_outputs_of_another_size_and_beyond_keep():
    pool = GatherOutputs(wide_spec().fields, keep=2)
    a, b = pool.take(4), pool.take(4)
    c = pool.take(4)  # both kept sets are held: new memory
    assert len({data_ptrs(x).pop() for x in (a, b, c)}) == 3
    assert all(v.shape[0] == 4 for v in c.values())
    del a
    d = pool.take(6)  # a free set of another size makes room
    assert all(v.shape[0] == 6 for v in d.values())
    del b, c, d
    assert all(v.shape[0] == 6 for v in pool.take(6).values())


def test_buffer_sample_and_gather_match_the_rows(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=32)
    buf.extend(make_rows(small_spec, 32))
    held = [buf.sample(16) for _ in range(6)]
    for b in held:
        assert torch.equal(b["id"], b["_index"])
        assert torch.equal(b["obs"][:, 0].long(), b["_index"])
    info = buf.draw(8)
    assert torch.equal(buf.gather(info)["id"], info.indices)
    assert torch.equal(buf.gather(info.indices)["id"], info.indices)


def test_sequence_gather_through_the_buffer(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=64,
                           sampler=SequenceSampler(length=5, seed=3))
    buf.extend(make_rows(small_spec, 64))
    batches = [buf.sample(4) for _ in range(5)]
    for b in batches:
        assert b["obs"].shape == (4, 5, 4) and b["id"].shape == (4, 5)
        assert torch.equal(b["id"], b["_index"])


def test_concurrent_gathers_never_share_memory():
    store, rows = filled(Placement.pageable(), capacity=64)
    errors = []

    def reader(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(200):
            idx = torch.randint(0, 64, (16,), generator=gen)
            got = store.get(idx)
            snapshot = {k: v.clone() for k, v in got.items()}
            for k, v in rows.items():
                if not torch.equal(snapshot[k], v[idx]) or not torch.equal(got[k], snapshot[k]):
                    errors.append(k)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_learner_out_stages_one_host_batch_without_copies():
    batch = {"x": torch.arange(6.0), "_index": torch.arange(6)}
    one = LearnerOut(batches=1, device=torch.device("cpu"))
    one.write(batch)
    assert [b["x"].data_ptr() for b in one.staged] == [batch["x"].data_ptr()]
    two = LearnerOut(batches=2, device=torch.device("cpu"))
    two.write(batch)
    assert [b["x"].tolist() for b in two.staged] == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("schedule", [Schedule(0, 1, 0, 1), Schedule(0, 1, 1, 4)],
                         ids=lambda s: s.label())
def test_a_pulled_batch_stays_intact_after_later_pulls(small_spec, schedule):
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=8, seed=4,
                             schedule=schedule, timeout=20) as plane:
        plane.push(make_rows(small_spec, 64))
        kept = []
        for _ in range(10):
            batch = plane.pull()
            kept.append((batch, {k: v.clone() for k, v in batch.items()}))
        for batch, copy in kept:
            for k in copy:
                assert torch.equal(batch[k], copy[k]), k
            assert torch.equal(batch["id"], batch["_index"])


@needs_use_count
def test_prefetched_pull_hands_over_the_gathered_memory(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=8, seed=4,
                             schedule=Schedule(0, 1, 1, 1), timeout=20) as plane:
        plane.push(make_rows(small_spec, 64))
        seen = set()
        for _ in range(6):
            batch = plane.pull()
            seen.add(batch["obs"].data_ptr())
            del batch
        # Dropped batches go back to the store's outputs: a few buffers, not one per pull.
        assert len(seen) <= 4


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.kind)
@pytest.mark.parametrize("indices", [[6], [8], [-1], [1, 9], [1.0]])
def test_a_gather_of_slots_that_hold_no_row_is_refused(small_spec, placement, indices):
    # Defect: an unfilled slot came back as its leftovers, and on a sharded store an index
    # no shard holds came back as an output row nothing wrote (uninitialised memory).
    from conduit import ConfigError
    buf = ExperienceBuffer(spec=small_spec, capacity=8, placement=placement)
    buf.extend(make_rows(small_spec, 4, start=100))
    buf.sample(3)
    with pytest.raises(ConfigError) as ei:
        buf.gather(torch.tensor(indices))
    assert ei.value.field == "indices"
    got = buf.gather(torch.tensor([3, 0], dtype=torch.int32))
    assert got["id"].tolist() == [103, 100] and got["_index"].dtype == torch.int64


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "torch"])
@pytest.mark.parametrize("indices", [[-1], [40], [0, 40], [3, -40], [[0, 1], [40, 2]],
                                     [[-1, 0]]])
def test_a_store_gather_outside_its_rows_raises_index_error(monkeypatch, compiled, indices):
    # The host gather takes rows with numpy after one range check; an index outside
    # [0, capacity) must raise as torch's index_select does, never wrap to another row.
    if not compiled:
        monkeypatch.setattr(column_store, "_row_kernels", lambda: None)
    store, rows = filled(Placement.pageable())
    with pytest.raises(IndexError):
        store.get(torch.tensor(indices))
    got = store.get(torch.tensor([39, 0]))
    for k, v in rows.items():
        assert torch.equal(got[k], v[[39, 0]]), k


def test_without_numba_the_host_gather_returns_the_same_rows(monkeypatch):
    store, rows = filled(Placement.pageable())
    idx = torch.randint(0, 40, (25,), generator=torch.Generator().manual_seed(2))
    fast = {k: v.clone() for k, v in store.get(idx).items()}
    monkeypatch.setattr(column_store, "_row_kernels", lambda: None)
    slow = store.get(idx)
    for k, v in rows.items():
        assert torch.equal(fast[k], v[idx]) and torch.equal(slow[k], fast[k]), k
