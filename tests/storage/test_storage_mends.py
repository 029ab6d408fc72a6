"""Storage contracts that a reference-model review found broken: the rows a priority update
reaches, consume-once layouts over rows taken back, draws over forgotten slots, samplers that
served another buffer, and refusals of out-of-range rows and pad values."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

from conduit.errors import ConfigError, EmptyBufferError, PriorityError, SpecError, StateError
from conduit.spec import ExperienceSpec, RaggedFieldSpec
from conduit.storage import (
    ExperienceBuffer,
    FifoSampler,
    Placement,
    PrioritizedSampler,
    SequenceSampler,
    make_store,
)
from conduit.storage.column_store import ColumnStore, copy_rows
from conduit.storage.ragged import RaggedStore

SPEC = ExperienceSpec.of(a=((), torch.int64))
EPISODES = ExperienceSpec.of(a=((), torch.int64), done=((), torch.bool))


def _prioritized(capacity: int = 4) -> ExperienceBuffer:
    buf = ExperienceBuffer(spec=SPEC, capacity=capacity, sampler=PrioritizedSampler(alpha=1.0))
    buf.extend({"a": torch.arange(capacity)})
    return buf


def test_a_tensor_gathered_twice_keeps_each_batch_matched_to_its_own_rows():
    buf = _prioritized()
    slots = torch.tensor([0])
    first = buf.gather(slots)
    assert first["_index"] is not slots
    buf.extend({"a": torch.tensor([4])})  # row 4 takes slot 0
    second = buf.gather(slots)
    assert second["a"].tolist() == [4]
    # the first batch's row is gone: its update is skipped, not given to row 4
    assert buf.update_priorities(first["_index"], torch.tensor([100.0])) == 0
    assert buf.sampler.priorities(torch.tensor([0])).tolist() == pytest.approx([1.0], abs=1e-3)
    assert buf.update_priorities(second["_index"], torch.tensor([7.0])) == 1


def test_a_draw_gathered_twice_gives_each_batch_its_own_index():
    buf = _prioritized()
    info = buf.draw(2)
    first = buf.gather(info)
    buf.extend({"a": torch.arange(4, 8)})  # every row of the first batch is overwritten
    second = buf.gather(info)
    assert first["_index"] is not second["_index"]
    assert buf.update_priorities(first["_index"], torch.tensor([5.0, 5.0])) == 0
    assert buf.update_priorities(second["_index"], torch.tensor([5.0, 5.0])) == 2


def test_a_changed_slot_tensor_does_not_change_the_batch_it_gave():
    buf = _prioritized()
    slots = torch.tensor([1, 2])
    batch = buf.gather(slots)
    slots += 1
    assert batch["_index"].tolist() == [1, 2]


def test_a_consume_once_epoch_over_rows_taken_back_is_not_drawn():
    sampler = FifoSampler(num_minibatches=2, shuffle=False)
    buf = ExperienceBuffer(spec=SPEC, capacity=8, sampler=sampler)
    buf.extend({"a": torch.arange(8)})
    sampler.begin_epoch(len(buf), iteration=0, epoch=0)
    buf.drop_newest(4)
    with pytest.raises(EmptyBufferError, match="laid out over 8 rows"):
        buf.sample(1)
    sampler.begin_epoch(len(buf), iteration=0, epoch=0)  # a new epoch over the rows left
    assert sorted(buf.sample(1)["a"].tolist() + buf.sample(1)["a"].tolist()) == [0, 1, 2, 3]


def test_changing_a_delivered_index_leaves_the_epoch_layout_alone():
    sampler = FifoSampler(num_minibatches=2, seed=3)
    buf = ExperienceBuffer(spec=SPEC, capacity=8, sampler=sampler)
    buf.extend({"a": torch.arange(8)})
    sampler.begin_epoch(8, iteration=0, epoch=0)
    before = [p.clone() for p in sampler.state_dict()["parts"]]
    batch = buf.sample(1)
    batch["_index"] += 100
    after = sampler.state_dict()["parts"]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    other = ExperienceBuffer(spec=SPEC, capacity=8, sampler=FifoSampler(num_minibatches=2,
                                                                         seed=3))
    other.load_state_dict(buf.state_dict())  # the checkpoint still loads
    assert sorted(other.sample(1)["a"].tolist()) == sorted(
        set(range(8)) - set(batch["a"].tolist()))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_bad_priorities_are_refused_where_they_fall_on_rows_gone(bad):
    buf = _prioritized()
    batch = buf.gather(torch.tensor([0, 1, 2]))
    buf.extend({"a": torch.tensor([9])})  # slot 0's row is gone
    with pytest.raises(PriorityError, match="priorities"):
        buf.update_priorities(batch["_index"], torch.tensor([bad, 1.0, 1.0]))
    with pytest.raises(PriorityError, match="priorities"):  # even when every row is gone
        buf.update_priorities(batch["_index"][:1], torch.tensor([bad]))


def test_a_prioritized_state_with_filled_slots_lacking_a_priority_is_refused():
    small = _prioritized()
    small.clear()
    small.extend({"a": torch.arange(2)})  # priorities for slots 0 and 1 only
    state = _prioritized().state_dict()  # 4 rows
    state["sampler"] = small.state_dict()["sampler"]
    fresh = _prioritized()
    with pytest.raises(StateError, match=r"sampler\.tree\.set") as info:
        fresh.load_state_dict(state)
    assert "slot 2" in str(info.value)
    assert len(fresh) == 4 and fresh.sampler.tree.is_set().all()  # nothing changed


def test_a_sampler_that_served_another_buffer_starts_empty_in_a_new_one():
    sampler = PrioritizedSampler(alpha=1.0, beta=1.0)
    old = ExperienceBuffer(spec=SPEC, capacity=8, sampler=sampler)
    old.extend({"a": torch.arange(8)})
    old.update_priorities(old.gather(torch.arange(8))["_index"], torch.full((8,), 1000.0))
    new = ExperienceBuffer(spec=SPEC, capacity=8, sampler=sampler)
    new.extend({"a": torch.tensor([100, 101])})
    assert sampler.tree.is_set().tolist() == [True, True] + [False] * 6
    weights = new.sample(64)["_weight"]
    assert torch.allclose(weights, torch.ones_like(weights))  # two rows, equal priorities

    seq = SequenceSampler(length=2)
    ExperienceBuffer(spec=EPISODES, capacity=8, sampler=seq).extend(
        {"a": torch.arange(8), "done": torch.zeros(8, dtype=torch.bool)})
    with pytest.raises(EmptyBufferError):
        ExperienceBuffer(spec=EPISODES, capacity=8, sampler=seq).sample(4)


def test_a_draw_over_slots_forgotten_since_is_refused():
    buf = ExperienceBuffer(spec=SPEC, capacity=8)
    buf.extend({"a": torch.arange(8)})
    info = buf.draw(16)
    buf.clear()
    with pytest.raises(ConfigError, match="indices"):
        buf.gather(info)
    buf.extend({"a": torch.arange(8)})
    info = buf.draw(64)
    buf.drop_newest(6)
    assert int(info.indices.max()) >= 2  # (64 draws over 8 slots)
    with pytest.raises(ConfigError, match="only \\[0, 2\\) hold rows"):
        buf.gather(info)
    assert buf.gather(buf.draw(4))["a"].max() < 2  # a new draw is fine


def test_copy_rows_refuses_negative_rows_and_mismatched_counts():
    dst, src = torch.zeros(4, 2), torch.ones(3, 2)
    with pytest.raises(IndexError, match="destination rows"):
        copy_rows(dst, torch.tensor([-1]), src[:1])
    with pytest.raises(IndexError, match="source rows"):
        copy_rows(dst, torch.tensor([0]), src, torch.tensor([-1]))
    with pytest.raises(IndexError, match="2 destination rows for 3"):
        copy_rows(dst, torch.tensor([0, 1]), src)
    assert not dst.any()  # nothing copied
    big_dst, big_src = torch.zeros(2, 8192), torch.ones(2, 8192)  # large rows: compiled path
    with pytest.raises(IndexError, match="2 destination rows for 1"):
        copy_rows(big_dst, torch.tensor([0, 1]), big_src, torch.tensor([0]))
    store = ColumnStore(spec=SPEC, capacity=4)
    with pytest.raises(IndexError):
        store.set(torch.tensor([-1]), {"a": torch.tensor([7])})
    assert store.get(torch.arange(4))["a"].tolist() == [0, 0, 0, 0]


def _ragged(dtype: torch.dtype) -> RaggedStore:
    store = RaggedStore(fields={"t": RaggedFieldSpec(dtype, 8)}, capacity=4)
    store.extend({"t": [torch.tensor([1, 2, 3], dtype=dtype), torch.tensor([4], dtype=dtype)]})
    return store


@pytest.mark.parametrize(("dtype", "pad"), [(torch.uint8, -1), (torch.uint8, 256),
                                            (torch.uint8, 0.5), (torch.int64, -0.5),
                                            (torch.int64, float("nan")), (torch.int64, "x"),
                                            (torch.bool, 2)])
def test_a_pad_value_the_field_cannot_hold_is_refused(dtype, pad):
    with pytest.raises(ConfigError, match="pad_value"):
        _ragged(dtype).padded("t", torch.tensor([0, 1]), pad_value=pad)


def test_pad_values_the_field_holds_pad_as_given():
    assert _ragged(torch.uint8).padded("t", torch.tensor([0, 1]), pad_value=255).tolist() == [
        [1, 2, 3], [4, 255, 255]]
    assert _ragged(torch.int64).padded("t", torch.tensor([1]), pad_value=-1.0,
                                       width=2).tolist() == [[4, -1]]
    assert _ragged(torch.float32).padded("t", torch.tensor([1]), pad_value=0.5,
                                         width=2).tolist() == [[4.0, 0.5]]


@pytest.mark.parametrize("slots", [torch.tensor([0.9, 1.7]), [0.5], torch.tensor([True]),
                                   torch.tensor([[0, 1]]), np.array([[0], [1]])])
def test_ragged_slots_must_be_integers_in_one_dimension(slots):
    with pytest.raises(SpecError, match="_slot"):
        _ragged(torch.int64).padded("t", slots)


# --- the host gather path, second review ---------------------------------------------------

def _int_store(capacity: int = 64) -> ColumnStore:
    spec = ExperienceSpec.of(x=((), torch.int64), v=((2,), torch.float32))
    st = ColumnStore(spec=spec, capacity=capacity)
    st.set_range(0, {"x": torch.arange(capacity) + 100,
                     "v": torch.arange(2.0 * capacity).view(capacity, 2)})
    return st


def test_a_column_moved_to_shared_memory_is_still_read_and_written():
    # Defect: the numpy views kept of each column pointed at the freed memory once
    # share_memory_() (as torch.multiprocessing does to a column it sends) moved it: a gather
    # returned another tensor's memory, a write landed in freed memory.
    st = _int_store()
    st.column("x").share_memory_()
    junk = [torch.full((64,), -7, dtype=torch.int64) for _ in range(4)]
    assert st.get(torch.tensor([0, 1, 2, 3]))["x"].tolist() == [100, 101, 102, 103]
    st.set_range(4, {"x": torch.tensor([7, 8]), "v": torch.zeros(2, 2)})
    assert st.column("x")[4:6].tolist() == [7, 8]
    assert st.get(torch.tensor([5, 4]))["x"].tolist() == [8, 7]
    del junk


def test_a_deep_copy_reads_and_writes_its_own_columns():
    st = _int_store()
    twin = copy.deepcopy(st)
    st.set_range(0, {"x": torch.tensor([-1, -2]), "v": torch.zeros(2, 2)})
    twin.set_range(2, {"x": torch.tensor([-3]), "v": torch.zeros(1, 2)})
    assert twin.get(torch.tensor([0, 1, 2]))["x"].tolist() == [100, 101, -3]
    assert twin.get(torch.tensor([[0, 1, 2]]))["x"].tolist() == [[100, 101, -3]]
    assert st.get(torch.tensor([0, 1, 2]))["x"].tolist() == [-1, -2, 102]


def test_a_gathered_batch_cannot_be_resized_in_place_and_later_batches_stay_right():
    # A set is written through numpy arrays, so its memory is fixed in size: growing or
    # re-allocating a batch's memory (which would leave the arrays over freed memory) is
    # refused, never silently done.
    st = _int_store()
    b = st.get(torch.tensor([1, 2, 3]))
    with pytest.raises(RuntimeError):
        b["v"].resize_(100, 2)
    storage = b["x"].untyped_storage()
    with pytest.raises(RuntimeError):
        storage.resize_(0)
    del b, storage
    for _ in range(3):
        got = st.get(torch.tensor([9, 8]))
        assert got["x"].tolist() == [109, 108] and got["v"][0].tolist() == [18.0, 19.0]


def test_a_column_handed_out_is_an_alias_that_set_cannot_swap():
    # Defect: set_() on the store's own column (after share_memory_() freed its memory)
    # could put it over other memory at the address its numpy view recorded.
    st = _int_store(capacity=8)
    col = st.column("x")
    col.share_memory_()
    col.set_(torch.arange(100, 104))
    assert st.get(torch.tensor([6, 7]))["x"].tolist() == [106, 107]
    with pytest.raises(IndexError):
        st.get(torch.tensor([8]))
    st.set_range(0, {"x": torch.full((8,), 5), "v": torch.zeros(8, 2)})
    assert st.column("x").tolist() == [5] * 8 and col.tolist() == [100, 101, 102, 103]


def test_a_pickled_or_deep_copied_store_writes_where_it_reads():
    # Defects: an unpickled store wrote through copies of the old views (its gathers read
    # them, its columns and state_dict did not); a store that had gathered once could not be
    # deep-copied or pickled (its gather pool holds a lock).
    st = _int_store()
    st.get(torch.tensor([0, 1]))
    for twin in (pickle.loads(pickle.dumps(st)), copy.deepcopy(st)):
        twin.set_range(0, {"x": torch.tensor([7]), "v": torch.zeros(1, 2)})
        assert twin.get(torch.tensor([0]))["x"].tolist() == [7]
        assert twin.column("x")[0] == 7 and twin.state_dict()["columns"]["x"][0] == 7
        assert st.get(torch.tensor([0]))["x"].tolist() == [100]


def test_a_memmap_column_moved_off_its_file_is_refused(tmp_path):
    # Defect: after share_memory_() moved a column into anonymous memory, writes landed
    # there and never reached the file (a reopened store read zeros).
    from conduit.errors import PlacementError
    from conduit.storage.memmap_store import MemmapColumnStore
    spec = ExperienceSpec.of(x=((4,), torch.float32))
    m = MemmapColumnStore(directory=tmp_path / "m", spec=spec, capacity=8)
    m.set_range(0, {"x": torch.full((8, 4), 5.0)})
    m.column("x").share_memory_()
    with pytest.raises(PlacementError):
        m.set_range(0, {"x": torch.full((8, 4), 6.0)})
    with pytest.raises(PlacementError):
        m.get(torch.tensor([0]))
    m.flush()
    del m
    reopened = MemmapColumnStore(directory=tmp_path / "m", spec=spec, capacity=8)
    assert reopened.get(torch.tensor([0]))["x"][0].tolist() == [5.0] * 4


@pytest.mark.parametrize("placement", [Placement.pageable(), Placement.sharded(["cpu", "cpu"])],
                         ids=lambda p: p.kind)
@pytest.mark.parametrize("idx", [torch.tensor(1), torch.tensor([[1], [4]])], ids=["0-d", "2-D"])
def test_a_write_at_indices_that_are_not_1d_is_refused(placement, idx):
    # Defect: a sharded store wrote nothing for a 0-d index and the wrong rows for 2-D ones.
    spec = ExperienceSpec.of(x=((2,), torch.float32))
    st = make_store(spec=spec, capacity=6, placement=placement)
    with pytest.raises(ConfigError) as err:
        st.set(idx, {"x": torch.full((*idx.shape, 2), 9.0)})
    assert err.value.field == "indices"
    assert st.state_dict()["columns"]["x"].abs().sum() == 0


@pytest.mark.parametrize("bad", [[0, 4], [0, -1], [0, 1000]])
def test_a_sharded_store_refuses_rows_outside_it(bad):
    # Defect: out-of-range indices mapped to no shard: a gather returned an earlier batch's
    # leftovers, a write was dropped.
    spec = ExperienceSpec.of(x=((), torch.int64))
    st = make_store(spec=spec, capacity=4, placement=Placement.sharded(["cpu", "cpu"]))
    st.set_range(0, {"x": torch.tensor([10, 11, 12, 13])})
    with pytest.raises(IndexError):
        st.get(torch.tensor(bad))
    with pytest.raises(IndexError):
        st.set(torch.tensor(bad), {"x": torch.tensor([1, 2])})
    with pytest.raises(IndexError):
        st.set_range(3, {"x": torch.tensor([77, 88])})
    assert st.state_dict()["columns"]["x"].tolist() == [10, 11, 12, 13]


def test_a_column_store_write_past_its_rows_is_an_index_error():
    st = _int_store(capacity=4)
    with pytest.raises(IndexError):
        st.set_range(3, {"x": torch.tensor([1, 2]), "v": torch.zeros(2, 2)})
    with pytest.raises(IndexError):
        st.set_range(-1, {"x": torch.tensor([1]), "v": torch.zeros(1, 2)})


@pytest.mark.parametrize("idx", [torch.tensor([0, 9]), torch.tensor([0, 9], dtype=torch.int32),
                                 torch.tensor([[0, 9]]), torch.tensor([0, -1], dtype=torch.int32)],
                         ids=["int64", "int32", "2-D", "int32-negative"])
def test_every_host_gather_outside_the_rows_is_an_index_error(idx):
    # A store whose first field holds no elements raised torch's RuntimeError off the
    # 1-D int64 path.
    spec = ExperienceSpec.of(e=((0,), torch.float32), x=((), torch.int64))
    st = ColumnStore(spec=spec, capacity=4)
    with pytest.raises(IndexError):
        st.get(idx)


@pytest.mark.parametrize("placement", [Placement.pageable(), Placement.sharded(["cpu", "cpu"])],
                         ids=lambda p: p.kind)
def test_a_0d_index_gathers_one_row_without_a_batch_dimension(placement):
    spec = ExperienceSpec.of(r=((), torch.float32), v=((2,), torch.float32))
    st = make_store(spec=spec, capacity=4, placement=placement)
    st.set_range(0, {"r": torch.arange(4.0), "v": torch.arange(8.0).view(4, 2)})
    got = st.get(torch.tensor(2))
    assert got["r"].shape == () and float(got["r"]) == 2.0
    assert got["v"].tolist() == [4.0, 5.0]


@pytest.mark.parametrize("column", [torch.randn(4, 2).requires_grad_(),
                                    torch.randn(4, 2, dtype=torch.complex64).conj()],
                         ids=["requires_grad", "conj"])
def test_columns_that_are_not_plain_memory_are_refused_by_name(column):
    spec = ExperienceSpec.of(x=((2,), column.dtype))
    with pytest.raises(SpecError) as err:
        ColumnStore.over(spec=spec, columns={"x": column})
    assert err.value.field == "x"


@pytest.mark.parametrize("prioritized", [False, True])
def test_a_batch_size_past_2_to_the_31_is_a_config_error(prioritized):
    buf = ExperienceBuffer(spec=ExperienceSpec.of(x=((), torch.float32)), capacity=4,
                           sampler=PrioritizedSampler() if prioritized else None)
    buf.extend({"x": torch.arange(4.0)})
    for rows in (2**63, 2**31):
        with pytest.raises(ConfigError) as err:
            buf.sample(rows)
        assert err.value.field == "batch_size"
