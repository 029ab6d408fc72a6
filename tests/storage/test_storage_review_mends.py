"""Storage refusals and contracts: per-slot memory, priority updates after a clear, ragged
state checks, failed writes, memory-mapped column limits, stale draws and sequence slices."""

from __future__ import annotations

import os
import types

import numpy as np
import psutil
import pytest
import torch

from conduit import CapacityError, ConfigError, ExperienceSpec, PriorityError, StateError
from conduit.errors import PlacementError
from conduit.spec import RaggedFieldSpec
from conduit.storage import (
    ExperienceBuffer,
    MemmapColumnStore,
    PrioritizedSampler,
    SequenceSampler,
    UniformSampler,
)
from conduit.storage.ragged import RaggedStore

EMPTY_ROWS = ExperienceSpec.of(pad=((0,), torch.float32))
IDS = ExperienceSpec.of(id=((), torch.int64))
SEQ = ExperienceSpec.of(id=((), torch.int64), done=((), torch.bool))


# -- 1: the per-slot state besides the columns is counted against host memory ----------------


@pytest.mark.parametrize("sampler", [None, PrioritizedSampler()], ids=["uniform", "prioritized"])
def test_a_capacity_whose_row_ids_do_not_fit_is_refused_before_allocating(sampler):
    with pytest.raises(CapacityError, match="capacity") as err:
        ExperienceBuffer(spec=EMPTY_ROWS, capacity=10**12, sampler=sampler)
    assert err.value.needed >= 16 * 10**12 and err.value.available < err.value.needed


def test_a_memmap_store_larger_than_memory_still_needs_room_for_its_row_ids(tmp_path):
    spec = ExperienceSpec.of(b=((), torch.uint8))
    store = MemmapColumnStore(directory=tmp_path / "store", spec=spec, capacity=10**11)
    with pytest.raises(CapacityError, match="capacity"):
        ExperienceBuffer(spec=spec, capacity=10**11, store=store)


def test_the_sum_tree_is_counted_as_well(monkeypatch):
    capacity = 2**20 + 1  # row ids 16 MiB; a 4-ary tree of 4**11 leaves, 85 MiB
    real = psutil.virtual_memory

    def sixty_mib() -> object:
        return types.SimpleNamespace(**{**real()._asdict(), "available": 60 << 20})

    monkeypatch.setattr(psutil, "virtual_memory", sixty_mib)
    ExperienceBuffer(spec=EMPTY_ROWS, capacity=capacity, sampler=UniformSampler())
    with pytest.raises(CapacityError, match=r"capacity.*PrioritizedSampler") as err:
        ExperienceBuffer(spec=EMPTY_ROWS, capacity=capacity, sampler=PrioritizedSampler())
    assert err.value.needed == 16 * capacity + 64 * ((4**11 - 1) // 3 + 1)


# -- 2: an update for rows delivered before a clear is skipped -------------------------------


def _cleared_after_a_sample() -> tuple[ExperienceBuffer, dict]:
    buf = ExperienceBuffer(spec=IDS, capacity=16, sampler=PrioritizedSampler(seed=0))
    buf.extend({"id": torch.arange(10)})
    batch = buf.sample(8)
    assert int(batch["_index"].max()) >= 3  # (some slot past the refill below)
    buf.clear()
    buf.extend({"id": torch.arange(100, 103)})
    return buf, batch


def test_an_update_for_rows_delivered_before_a_clear_is_skipped():
    buf, batch = _cleared_after_a_sample()
    before = buf.sampler.priorities(torch.arange(16)).clone()
    assert buf.update_priorities(batch["_index"], torch.ones(8)) == 0
    # given as other indices (a list), matched to the rows each slot last delivered
    assert buf.update_priorities(batch["_index"].tolist(), torch.ones(8)) == 0
    assert torch.equal(buf.sampler.priorities(torch.arange(16)), before)
    fresh = buf.sample(4)
    assert buf.update_priorities(fresh["_index"], torch.full((4,), 3.0)) == 4


def test_an_update_still_refuses_slots_that_are_not_the_buffers():
    buf, batch = _cleared_after_a_sample()
    for bad in (torch.tensor([16]), torch.tensor([-1]), torch.tensor([1.5])):
        with pytest.raises(PriorityError, match="indices"):
            buf.update_priorities(bad, torch.ones(1))
    never = sorted(set(range(3, 16)) - set(batch["_index"].tolist()))[0]
    with pytest.raises(PriorityError, match=r"filled slots in \[0, 3\)"):
        buf.update_priorities(torch.tensor([never]), torch.ones(1))  # no row, none delivered
    with pytest.raises(PriorityError, match="negative"):
        buf.update_priorities(batch["_index"], -torch.ones(8))  # checked though skipped


# -- 3: a ragged state is checked against the fields before anything is loaded ---------------


def _ragged() -> RaggedStore:
    store = RaggedStore(fields={"tokens": RaggedFieldSpec(torch.int64, 4)}, capacity=8)
    store.extend({"tokens": [[1, 2, 3], [4]]})
    return store


@pytest.mark.parametrize(("change", "part"), [
    (lambda f: {**f, "values": f["values"].double() + 0.5}, "values"),
    (lambda f: {**f, "values": f["values"].reshape(1, -1)}, "values"),
    (lambda f: {"values": torch.arange(9), "offsets": torch.tensor([0, 3, 9])}, "offsets"),
    (lambda f: {**f, "offsets": f["offsets"].tolist()}, "offsets"),
    (lambda f: {**f, "offsets": f["offsets"].double()}, "offsets"),
], ids=["float-values", "2d-values", "row-too-long", "list-offsets", "float-offsets"])
def test_a_ragged_state_that_does_not_fit_the_field_is_refused(change, part):
    store = _ragged()
    state = store.state_dict()
    state["fields"]["tokens"] = change(state["fields"]["tokens"])
    with pytest.raises(StateError) as err:
        _ragged().load_state_dict(state)
    assert err.value.key == f"ragged.fields.tokens.{part}"
    target = _ragged()
    target.extend({"tokens": [[7, 7]]})
    with pytest.raises(StateError):
        target.load_state_dict(state)
    assert len(target) == 3  # nothing changed
    assert target.rows("tokens", torch.tensor([2]))[0].tolist() == [7, 7]
    target.load_state_dict(store.state_dict())  # the store's own state loads
    assert target.padded("tokens", torch.tensor([0, 1])).tolist() == [[1, 2, 3], [4, 0, 0]]


# -- 4: a write the store refuses leaves the buffer as it was --------------------------------


def test_a_refused_write_changes_nothing(tmp_path):
    spec = ExperienceSpec.of(x=((2,), torch.float32), id=((), torch.int64))
    store = MemmapColumnStore(directory=tmp_path / "store", spec=spec, capacity=8)
    buf = ExperienceBuffer(spec=spec, capacity=8, store=store,
                           sampler=PrioritizedSampler(seed=0))
    buf.extend({"x": torch.zeros(6, 2), "id": torch.arange(6)})
    ids = buf.state_dict(rows=False)
    store.column("x").share_memory_()  # moved off its file: every later write is refused
    with pytest.raises(PlacementError):
        buf.extend({"x": torch.ones(4, 2), "id": torch.arange(6, 10)})
    assert (len(buf), buf.writer.cursor, buf.total_written) == (6, 6, 6)
    assert torch.equal(buf.state_dict(rows=False)["row_id"], ids["row_id"])
    assert buf.sampler.tree.is_set().sum() == 6


# -- 5: a column file too large for its folder is refused, and nothing is left ---------------


def test_a_memmap_column_too_large_for_a_file_is_refused_and_cleaned_up(tmp_path):
    spec = ExperienceSpec.of(x=((), torch.float32), y=((), torch.float32))
    folder = tmp_path / "new" / "store"
    with pytest.raises(CapacityError, match="capacity"):
        MemmapColumnStore(directory=folder, spec=spec, capacity=10**13)
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(CapacityError, match="capacity"):
        MemmapColumnStore(directory=kept, spec=spec, capacity=10**13)
    assert sorted(os.listdir(kept)) == ["notes.txt"]


def test_a_column_too_large_to_count_in_a_file_is_refused(tmp_path):
    spec = ExperienceSpec.of(x=((1 << 20,), torch.float64))
    with pytest.raises(CapacityError, match="capacity"):
        MemmapColumnStore(directory=tmp_path / "s", spec=spec, capacity=10**13)
    assert not (tmp_path / "s").exists()


# -- 6: adopt invalidates earlier draws, as clear does ---------------------------------------


def test_a_draw_made_before_adopt_is_refused_where_its_slots_hold_no_row():
    buf = ExperienceBuffer(spec=IDS, capacity=16, sampler=UniformSampler(seed=0))
    buf.extend({"id": torch.arange(10)})
    info = buf.draw(64)
    assert int(info.indices.max()) >= 3
    other = ExperienceBuffer(spec=IDS, capacity=16, sampler=UniformSampler(seed=1))
    other.extend({"id": torch.arange(3)})
    buf.store.set_range(0, {"id": torch.arange(3)})
    buf.adopt(other)
    with pytest.raises(ConfigError) as err:
        buf.gather(info)
    assert err.value.field == "indices"


# -- 7: smaller refusals; sequence slices reached by writes after their draw -----------------


def test_a_sequence_longer_than_the_buffer_is_refused_at_bind():
    with pytest.raises(ConfigError) as err:
        ExperienceBuffer(spec=SEQ, capacity=4, sampler=SequenceSampler(length=5))
    assert err.value.field == "length"
    ExperienceBuffer(spec=SEQ, capacity=5, sampler=SequenceSampler(length=5))


def test_a_ragged_capacity_must_be_a_positive_integer():
    for capacity in (True, 2.0, 0):
        with pytest.raises(ConfigError) as err:
            RaggedStore(fields={"t": RaggedFieldSpec(torch.int64, 4)}, capacity=capacity)
        assert err.value.field == "capacity"
    assert RaggedStore(fields={"t": RaggedFieldSpec(torch.int64, 4)},
                       capacity=np.int64(3)).capacity == 3


def test_a_slice_reached_by_a_write_after_its_draw_is_drawn_again():
    buf = ExperienceBuffer(spec=SEQ, capacity=8, sampler=SequenceSampler(length=4, seed=0))
    buf.extend({"id": torch.arange(8), "done": torch.zeros(8, dtype=torch.bool)})
    info = buf.draw(64)
    drawn = info.indices.clone()
    assert bool((info.indices[:, 0] <= 1).any())  # slices over slots 0 and 1
    buf.extend({"id": torch.arange(8, 10), "done": torch.zeros(2, dtype=torch.bool)})
    ids = buf.gather(info)["id"]
    assert bool((ids[:, 1:] - ids[:, :-1] == 1).all())  # no slice mixes old and new rows
    assert int(ids.min()) >= 2  # (rows 0 and 1 are gone)
    assert torch.equal(info.indices, drawn)  # the draw itself is left as it was
    untouched = (drawn[:, 0] >= 2)
    assert torch.equal(ids[untouched], drawn[untouched])  # (id = slot before the write)
    # writes into empty slots reach no slice: the draw is gathered as drawn
    buf = ExperienceBuffer(spec=SEQ, capacity=8, sampler=SequenceSampler(length=3, seed=0))
    buf.extend({"id": torch.arange(5), "done": torch.zeros(5, dtype=torch.bool)})
    info = buf.draw(16)
    buf.extend({"id": torch.arange(5, 7), "done": torch.zeros(2, dtype=torch.bool)})
    assert torch.equal(buf.gather(info)["id"], info.indices)
