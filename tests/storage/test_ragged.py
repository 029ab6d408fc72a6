"""Ragged fields: stored without padding, padded per read, bad input refused with a typed error."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conduit.errors import CapacityError, ConfigError, SpecError, StateError
from conduit.spec import RaggedFieldSpec
from conduit.storage.ragged import RaggedStore


def _store(capacity=16, max_length=8, min_length=1):
    return RaggedStore(fields={
        "tokens": RaggedFieldSpec(torch.int64, max_length=max_length, min_length=min_length),
        "logps": RaggedFieldSpec(torch.float32, max_length=max_length, min_length=min_length)},
        capacity=capacity)


def _rows(lengths, start=0):
    toks = [list(range(start + 10 * i, start + 10 * i + n)) for i, n in enumerate(lengths)]
    return {"tokens": toks, "logps": [torch.tensor(t, dtype=torch.float32) / 7 for t in toks]}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(1, 8), min_size=1, max_size=5), min_size=1, max_size=4))
def test_round_trip_in_chunks(chunks):
    store = _store(capacity=sum(len(c) for c in chunks))
    expected = []
    for k, lengths in enumerate(chunks):
        rows = _rows(lengths, start=1000 * k)
        slots = store.extend(rows)
        assert slots.tolist() == list(range(len(expected), len(expected) + len(lengths)))
        expected += rows["tokens"]
    all_slots = torch.arange(len(expected))
    assert [r.tolist() for r in store.rows("tokens", all_slots)] == expected
    assert store.tokens("tokens") == sum(map(len, expected))  # nothing padded in storage
    assert store.lengths("tokens").tolist() == [len(t) for t in expected]


def test_padded_to_the_longest_row_of_the_read():
    store = _store()
    store.extend(_rows([3, 1, 5, 2]))
    slots = torch.tensor([3, 1])
    right = store.padded("tokens", slots, pad_value=-1)
    assert right.tolist() == [[30, 31], [10, -1]]  # width 2: the longest of these two rows
    left = store.padded("tokens", slots, pad_value=-1, side="left", width=4)
    assert left.tolist() == [[-1, -1, 30, 31], [-1, -1, -1, 10]]
    logps = store.padded("logps", torch.tensor([2]), pad_value=0.0)
    assert torch.equal(logps, torch.tensor([[20, 21, 22, 23, 24]], dtype=torch.float32) / 7)
    with pytest.raises(SpecError, match="does not fit width 3"):
        store.padded("tokens", torch.tensor([2]), width=3)
    with pytest.raises(ConfigError, match="side"):
        store.padded("tokens", slots, side="middle")


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_with_mask_marks_the_values(dtype, side):
    store = RaggedStore(fields={"x": RaggedFieldSpec(dtype, max_length=8)}, capacity=8)
    rows = [torch.arange(1, n + 1).to(dtype) for n in (3, 1, 5, 2)]
    store.extend({"x": rows})
    slots = torch.tensor([2, 0, 1])
    out, mask = store.padded_with_mask("x", slots, pad_value=0, side=side, width=6)
    assert out.dtype == dtype and out.shape == mask.shape == (3, 6) and mask.dtype == torch.bool
    for i, s in enumerate(slots.tolist()):
        n = rows[s].numel()
        got, pad = (out[i, 6 - n:], out[i, :6 - n]) if side == "left" else (out[i, :n],
                                                                            out[i, n:])
        assert torch.equal(got, rows[s]) and not bool(pad.any())
        assert int(mask[i].sum()) == n and bool(mask[i, 6 - n:].all() if side == "left"
                                                 else mask[i, :n].all())


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32, torch.int16])
@pytest.mark.parametrize("lengths", [(3, 1, 5, 2), (2, 2, 2, 2)])
def test_the_mask_comes_in_the_dtype_asked_for(mask_dtype, lengths):
    store = RaggedStore(fields={"x": RaggedFieldSpec(torch.int64, max_length=8)}, capacity=8)
    store.extend({"x": [list(range(1, n + 1)) for n in lengths]})
    slots = torch.tensor([2, 0, 1])
    _, want = store.padded_with_mask("x", slots, side="left", width=6)
    _, got = store.padded_with_mask("x", slots, side="left", width=6, mask_dtype=mask_dtype)
    assert got.dtype == mask_dtype and torch.equal(got, want.to(mask_dtype))
    _, got = store.padded_with_mask("x", slots, mask_dtype=mask_dtype)  # width: the longest
    assert got.dtype == mask_dtype and int(got.sum()) == sum(lengths[s] for s in (2, 0, 1))


@pytest.mark.parametrize(("tokens", "match"), [
    ([[1, 2], [3, 2.5]], "sample 1.*dtype"),
    ([[1, 2], [3, "4"]], "sample 1"),
    ([[1, 2], [3, 2 ** 70]], "sample 1"),
    ([[1, [2]]], "sample 0"),
    ([[1, 2], [True, False]], "sample 1.*dtype"),  # bools were packed as 1, 0 by the list path
])
def test_int_lists_that_are_not_int64_are_refused_naming_the_sample(tokens, match):
    store = _store()
    with pytest.raises(SpecError, match=match) as err:
        store.extend({"tokens": tokens, "logps": [[0.0] * len(t) for t in tokens]})
    assert err.value.field == "tokens"
    assert len(store) == 0


def test_int_lists_pack_as_int64_values():
    store = _store()
    slots = store.extend({"tokens": [[5, -3, 2 ** 40], [7]], "logps": [[0.0] * 3, [1.0]]})
    assert store.padded("tokens", slots, pad_value=0).tolist() == [[5, -3, 2 ** 40], [7, 0, 0]]


@pytest.mark.parametrize("side", ["left", "right"])
def test_rows_of_one_length_read_as_rows_of_many(side):
    uniform = RaggedStore(fields={"x": RaggedFieldSpec(torch.int64, max_length=8)}, capacity=8)
    mixed = RaggedStore(fields={"x": RaggedFieldSpec(torch.int64, max_length=8)}, capacity=8)
    rows = [[10 * i + j for j in range(3)] for i in range(6)]
    uniform.extend({"x": rows[:4]})
    uniform.extend({"x": rows[4:]})  # still one length
    mixed.extend({"x": [*rows, [7]]})
    slots = torch.tensor([5, 0, 3, 3])
    for width in (None, 3, 5):
        got = uniform.padded_with_mask("x", slots, pad_value=-1, side=side, width=width)
        want = mixed.padded_with_mask("x", slots, pad_value=-1, side=side, width=width)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    uniform.extend({"x": [[1, 2]]})  # another length: reads pad again
    out, mask = uniform.padded_with_mask("x", torch.tensor([6, 1]), pad_value=0, side=side)
    assert out.tolist() == ([[1, 2, 0], [10, 11, 12]] if side == "right"
                            else [[0, 1, 2], [10, 11, 12]])
    assert mask.sum().item() == 5
    restored = RaggedStore(fields={"x": RaggedFieldSpec(torch.int64, max_length=8)}, capacity=8)
    restored.load_state_dict(uniform.state_dict())
    assert torch.equal(restored.padded("x", torch.arange(7), side=side),
                       uniform.padded("x", torch.arange(7), side=side))
    with pytest.raises(SpecError, match="slots must lie in"):
        uniform.padded("x", torch.tensor([7]))
    uniform.clear()
    uniform.extend({"x": [[4, 4], [5, 5]]})
    assert uniform.padded("x", torch.tensor([1, 0])).tolist() == [[5, 5], [4, 4]]


def test_pools_grow_and_clear_keeps_capacity():
    store = _store(capacity=4, max_length=64)
    store.extend(_rows([64, 64, 64, 64]))  # beyond the initial pool of 4 x 4 elements
    assert store.tokens("tokens") == 256
    with pytest.raises(CapacityError, match="holds 4 rows"):
        store.extend(_rows([1]))
    store.clear()
    assert len(store) == 0
    store.extend(_rows([2]))
    assert store.rows("tokens", torch.tensor([0]))[0].tolist() == [0, 1]


def test_state_dict_round_trip():
    store = _store()
    store.extend(_rows([3, 1, 5]))
    state = store.state_dict()
    other = _store()
    other.load_state_dict(state)
    for name in ("tokens", "logps"):
        assert torch.equal(other.padded(name, torch.arange(3)), store.padded(name, torch.arange(3)))
    bad = {"rows": 3, "fields": {**state["fields"], "tokens": {
        "values": state["fields"]["tokens"]["values"][:-1],
        "offsets": state["fields"]["tokens"]["offsets"]}}}
    with pytest.raises(StateError, match=r"tokens\.offsets"):
        other.load_state_dict(bad)


@pytest.mark.parametrize(("rows", "field", "match"), [
    ({"tokens": [[1], []], "logps": [[0.5], []]}, "tokens", r"length 0.*drop or fill"),
    ({"tokens": [list(range(9))], "logps": [[0.0] * 9]}, "tokens", r"length 9.*raise max_length"),
    ({"tokens": [[[1, 2]]], "logps": [[0.0, 0.0]]}, "tokens", "1-D"),
    ({"tokens": [torch.tensor([1.5])], "logps": [[0.0]]}, "tokens", "dtype"),
    ({"tokens": [[1], [2]], "logps": [[0.0]]}, "logps", "has 1 rows"),
    ({"tokens": [[1]]}, "logps", "missing"),
    ({"tokens": [[1]], "logps": [[0.0]], "other": [[1]]}, "other", "unknown"),
    ({"tokens": "12", "logps": [[0.0]]}, "tokens", "list of 1-D sequences"),
])
def test_bad_rows_get_a_spec_error_naming_the_field(rows, field, match):
    store = _store()
    with pytest.raises(SpecError, match=match) as err:
        store.extend(rows)
    assert err.value.field == field
    assert len(store) == 0  # nothing half-written


def test_bad_configuration_and_slots():
    with pytest.raises(ConfigError, match="max_length"):
        RaggedFieldSpec(torch.int64, max_length=0)
    with pytest.raises(ConfigError, match="dtype"):
        RaggedFieldSpec("int64")
    with pytest.raises(ConfigError, match="fields"):
        RaggedStore(fields={}, capacity=4)
    with pytest.raises(ConfigError, match="capacity"):
        _store(capacity=0)
    store = _store()
    store.extend(_rows([2]))
    for bad in ([1], [-1], [0, -5], [0, 1 << 62]):
        with pytest.raises(SpecError, match="slots must lie in"):
            store.padded("tokens", torch.tensor(bad))
    with pytest.raises(SpecError, match="unknown ragged field"):
        store.lengths("nope")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=12), st.data())
def test_small_reads_equal_the_numpy_path(lengths, data):
    """An int64 read of few values is built with Python lists; it must equal the numpy path."""
    import conduit.storage.ragged as ragged

    store = RaggedStore(fields={"x": RaggedFieldSpec(torch.int64, max_length=8)},
                        capacity=len(lengths))
    store.extend({"x": [[7 * i + j for j in range(n)] for i, n in enumerate(lengths)]})
    slots = torch.tensor(data.draw(st.lists(st.integers(0, len(lengths) - 1), max_size=6)),
                         dtype=torch.int64)
    side = data.draw(st.sampled_from(["left", "right"]))
    width = data.draw(st.sampled_from([None, 8, 11]))
    mask_dtype = data.draw(st.sampled_from([torch.bool, torch.int64, torch.float32]))
    kw = {"pad_value": -3, "side": side, "width": width, "mask_dtype": mask_dtype}
    small = store.padded_with_mask("x", slots, **kw)
    saved, ragged.SMALL_READ = ragged.SMALL_READ, 0
    try:
        large = store.padded_with_mask("x", slots, **kw)
    finally:
        ragged.SMALL_READ = saved
    for a, b in zip(small, large):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
