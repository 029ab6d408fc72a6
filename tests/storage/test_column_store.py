import pytest
import torch

from conduit import CapacityError, ConfigError, PlacementError, SpecError
from conduit.storage import (
    ColumnStore,
    ExperienceBuffer,
    GatherOutputs,
    Placement,
    UniformSampler,
    make_store,
)
from tests.conftest import make_rows

PLACEMENTS = [Placement.pageable(), Placement.pinned(), Placement.device("cpu"),
              Placement.sharded(["cpu", "cpu", "cpu"]),
              Placement.sharded(["cpu", "cpu"], shares=(0.25, 0.75))]


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.label())
def test_set_get_round_trip_every_placement(small_spec, placement):
    store = make_store(spec=small_spec, capacity=20, placement=placement)
    rows = make_rows(small_spec, 20)
    store.set_range(0, rows)
    idx = torch.tensor([19, 0, 7, 7, 13])
    got = store.get(idx)
    for k in rows:
        assert torch.equal(got[k], rows[k][idx])
    got2 = store.get(idx.reshape(5, 1))
    assert got2["obs"].shape == (5, 1, 4)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.label())
def test_rows_with_autograd_history_are_stored_as_values(small_spec, placement):
    # A column that joined the caller's graph would make every later gather (index_select
    # with out=) fail: both writes store the values and leave the columns plain tensors.
    store = make_store(spec=small_spec, capacity=10, placement=placement)
    rows = make_rows(small_spec, 4, start=100)
    w = torch.ones(4, 4, requires_grad=True)
    rows["obs"] = rows["obs"] * w
    store.set_range(0, rows)
    store.set(torch.tensor([9, 8]), {k: v[:2] for k, v in rows.items()})
    got = store.get(torch.tensor([0, 3, 9]))
    assert got["obs"][:, 0].tolist() == [100.0, 103.0, 100.0] and not got["obs"].requires_grad
    assert w.grad is None and rows["obs"].requires_grad  # the caller's graph is untouched
    assert store.get(torch.tensor([1]))["obs"][0, 0] == 101.0  # and gathers keep working


def test_a_host_store_larger_than_the_memory_left_is_refused_before_allocating(
        small_spec, monkeypatch):
    from types import SimpleNamespace

    from conduit.storage import column_store

    allocated = []

    def zeros(shape, dtype, **_k):
        allocated.append(shape)
        return torch.zeros(shape, dtype=dtype)

    monkeypatch.setattr(column_store, "host_zeros", zeros)
    row = small_spec.bytes_per_sample
    monkeypatch.setattr(column_store.psutil, "virtual_memory",
                        lambda: SimpleNamespace(available=100 * row))
    with pytest.raises(CapacityError, match="capacity: 101 rows") as ei:
        ColumnStore(spec=small_spec, capacity=101)
    assert (ei.value.needed, ei.value.available) == (101 * row, 100 * row) and not allocated
    assert ColumnStore(spec=small_spec, capacity=100).capacity == 100

    def no_memory(*_a, **_k):
        raise OSError(12, "Cannot allocate memory")  # what mmap raises past the overcommit

    monkeypatch.setattr(column_store, "host_zeros", no_memory)
    with pytest.raises(CapacityError, match="Cannot allocate memory"):
        ColumnStore(spec=small_spec, capacity=100)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.label())
def test_scattered_set(small_spec, placement):
    store = make_store(spec=small_spec, capacity=10, placement=placement)
    rows = make_rows(small_spec, 3, start=100)
    idx = torch.tensor([9, 0, 5])
    store.set(idx, rows)
    assert store.get(idx)["id"].tolist() == [100, 101, 102]


def test_sharded_locate(small_spec):
    store = make_store(spec=small_spec, capacity=10,
                       placement=Placement.sharded(["cpu", "cpu"], shares=(0.3, 0.7)))
    shard, local = store.locate(torch.tensor([0, 2, 3, 9]))
    assert shard.tolist() == [0, 0, 1, 1] and local.tolist() == [0, 2, 0, 6]


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.label())
def test_state_dict_round_trip_across_placements(small_spec, placement):
    a = make_store(spec=small_spec, capacity=12, placement=Placement.pageable())
    a.set_range(0, make_rows(small_spec, 12))
    b = make_store(spec=small_spec, capacity=12, placement=placement)
    b.load_state_dict(a.state_dict())
    idx = torch.arange(12)
    for k, v in a.get(idx).items():
        assert torch.equal(b.get(idx)[k], v)


def test_state_dict_rejects_other_spec(small_spec):
    a = make_store(spec=small_spec, capacity=4)
    other = small_spec.with_field("obs", small_spec.fields["id"])
    b = make_store(spec=other, capacity=4)
    with pytest.raises(SpecError, match="obs"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(CapacityError):
        make_store(spec=small_spec, capacity=5).load_state_dict(a.state_dict())


def test_bad_placements():
    with pytest.raises(PlacementError, match="kind"):
        Placement(kind="tape")  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match="devices"):
        Placement.device("not-a-device")
    with pytest.raises(PlacementError, match="shares"):
        Placement.sharded(["cpu", "cpu"], shares=(0.5, 0.6))
    with pytest.raises(PlacementError, match="cuda"):
        if torch.cuda.is_available():
            pytest.skip("CUDA present")
        make_store(spec=_spec(), capacity=4, placement=Placement.device("cuda:0"))


def _spec():
    from conduit import ExperienceSpec
    return ExperienceSpec.of(x=((1,), torch.float32))


def test_ring_buffer_wraps_and_keeps_newest(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=10, sampler=UniformSampler(seed=1))
    buf.extend(make_rows(small_spec, 7))
    idx = buf.extend(make_rows(small_spec, 6, start=7))
    assert idx.tolist() == [7, 8, 9, 0, 1, 2]
    assert len(buf) == 10 and buf.total_written == 13
    all_ids = buf.gather(torch.arange(10))["id"].tolist()
    assert sorted(all_ids) == list(range(3, 13))


def test_write_larger_than_capacity_rejected(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=4)
    with pytest.raises(CapacityError) as ei:
        buf.extend(make_rows(small_spec, 5))
    assert ei.value.needed == 5 and ei.value.available == 4


def test_buffer_state_round_trip(small_spec):
    from conduit.storage import PrioritizedSampler
    a = ExperienceBuffer(spec=small_spec, capacity=16, sampler=PrioritizedSampler(seed=3))
    a.extend(make_rows(small_spec, 12))
    a.extend(make_rows(small_spec, 8, start=12))
    a.update_priorities(torch.tensor([1, 2, 3]), torch.tensor([5.0, 0.0, 2.0]))
    b = ExperienceBuffer(spec=small_spec, capacity=16, sampler=PrioritizedSampler(seed=99),
                         placement=Placement.sharded(["cpu", "cpu"]))
    b.load_state_dict(a.state_dict())
    assert len(b) == len(a) and b.writer.cursor == a.writer.cursor
    for _ in range(3):
        x, y = a.sample(8), b.sample(8)
        assert torch.equal(x["_index"], y["_index"]) and torch.equal(x["obs"], y["obs"])
        assert torch.allclose(x["_weight"], y["_weight"])


def test_a_store_over_given_columns_writes_and_reads_them(small_spec):
    blocks = {n: torch.zeros((30, *fs.shape), dtype=fs.dtype)
              for n, fs in small_spec.fields.items()}
    store = ColumnStore.over(spec=small_spec, columns={k: v[:20] for k, v in blocks.items()})
    assert store.capacity == 20 and store.placement == Placement.pageable()
    buf = ExperienceBuffer(spec=small_spec, capacity=20, store=store,
                           sampler=UniformSampler(seed=0))
    rows = make_rows(small_spec, 25)
    buf.extend({k: v[:15] for k, v in rows.items()})
    buf.extend({k: v[15:] for k, v in rows.items()})  # wraps: slots 0..4 hold rows 20..24
    for k, v in rows.items():
        assert torch.equal(blocks[k][5:20], v[5:20]) and torch.equal(blocks[k][:5], v[20:])
        assert not blocks[k][20:].any()  # past the store's rows: untouched
    got = buf.sample(8)
    for k in rows:
        assert torch.equal(got[k], blocks[k][got["_index"]])


def test_a_store_over_columns_refuses_columns_that_do_not_fit_the_spec(small_spec):
    good = {n: torch.zeros((6, *fs.shape), dtype=fs.dtype) for n, fs in small_spec.fields.items()}
    name = next(iter(small_spec.fields))
    cases = [({k: v for k, v in good.items() if k != name}, "has no column"),
             ({**good, "extra": torch.zeros(6)}, "not a field"),
             ({**good, name: good[name].to(torch.float64)}, "expected a contiguous"),
             ({**good, name: good[name][:5]}, "expected a contiguous"),
             ({**good, name: torch.zeros((*good[name].shape[1:], 6)).T}, "not contiguous")]
    for columns, match in cases:
        with pytest.raises(SpecError, match=match):
            ColumnStore.over(spec=small_spec, columns=columns)
    with pytest.raises(PlacementError, match="one device"):
        ColumnStore.over(spec=small_spec, columns={**good, name: good[name].to("meta")})
    with pytest.raises(PlacementError, match="the CPU or a GPU"):
        ColumnStore.over(spec=small_spec, columns={k: v.to("meta") for k, v in good.items()})


def test_stores_over_the_same_outputs_gather_into_the_same_memory(small_spec):
    outputs = GatherOutputs(small_spec.fields)
    rows = make_rows(small_spec, 20)
    ptrs, held = [], []
    for _ in range(2):  # two stores in turn, as one update's plane after another's
        store = ColumnStore.over(spec=small_spec, outputs=outputs,
                                 columns={k: v.clone() for k, v in rows.items()})
        idx = torch.arange(6)
        got = store.get(idx)
        ptrs.append(got["obs"].data_ptr())
        assert all(torch.equal(got[k], rows[k][:6]) for k in rows)
        del got
    assert ptrs[0] == ptrs[1]  # the second store reused the first one's batch memory
    store = ColumnStore.over(spec=small_spec, outputs=outputs,
                             columns={k: v.clone() for k, v in rows.items()})
    held = store.get(torch.arange(6))
    again = store.get(torch.arange(6, 12))
    assert again["obs"].data_ptr() != held["obs"].data_ptr()  # a held batch is never reused
    assert all(torch.equal(held[k], rows[k][:6]) for k in rows)


def test_a_store_over_columns_refuses_outputs_of_other_fields(small_spec):
    good = {n: torch.zeros((6, *fs.shape), dtype=fs.dtype) for n, fs in small_spec.fields.items()}
    name = next(iter(small_spec.fields))
    other = GatherOutputs({k: v for k, v in small_spec.fields.items() if k != name})
    with pytest.raises(ConfigError, match="outputs"):
        ColumnStore.over(spec=small_spec, columns=good, outputs=other)


def test_drop_newest_takes_rows_back_as_if_never_written(small_spec):
    from conduit.storage import PrioritizedSampler

    buf = ExperienceBuffer(spec=small_spec, capacity=8, sampler=UniformSampler(seed=0))
    buf.extend(make_rows(small_spec, 6))
    buf.drop_newest(2)
    assert len(buf) == 4 and buf.total_written == 4
    buf.extend(make_rows(small_spec, 4, start=100))  # into the dropped slots, then on
    assert buf.store.get(torch.arange(8))["id"].tolist() == [0, 1, 2, 3, 100, 101, 102, 103]
    buf.drop_newest(8)  # a full ring whose cursor is back at slot 0
    assert len(buf) == 0
    buf.extend(make_rows(small_spec, 8))
    buf.extend(make_rows(small_spec, 2, start=8))  # wraps part way: slots 0, 1 hold 8, 9
    with pytest.raises(ConfigError, match="wrapped"):
        buf.drop_newest(1)
    for bad in (-1, 9, 1.5, True):
        with pytest.raises(ConfigError):
            buf.drop_newest(bad)
    prio = ExperienceBuffer(spec=small_spec, capacity=8, sampler=PrioritizedSampler())
    prio.extend(make_rows(small_spec, 3))
    with pytest.raises(ConfigError) as ei:
        prio.drop_newest(1)
    assert ei.value.field == "sampler" and len(prio) == 3
