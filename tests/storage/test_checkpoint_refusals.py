"""Persisted and restored values out of range, and bad path arguments, are refused with a
typed error naming the key (never a raw OverflowError, RecursionError, TypeError or
AttributeError), and a refused load or save changes nothing."""

from __future__ import annotations

import copy
import json
import struct
import zlib
from pathlib import Path

import pytest
import torch

from conduit import ExperienceDataPlane
from conduit.errors import CapacityError, ConfigError, StateError
from conduit.storage import ExperienceBuffer, PrioritizedSampler, UniformSampler
from conduit.storage.checkpoint import (
    CheckpointError,
    atomic_write,
    read_checkpoint,
    write_checkpoint,
)
from conduit.storage.memmap_store import MANIFEST, MemmapColumnStore
from conduit.storage.state import number
from conduit.storage.writer import RingWriter
from tests.conftest import make_rows

# -- a sealed header with values out of range ----------------------------------------------


def _reseal(path: Path, edit) -> None:
    """Replace the header text with ``edit(text)`` and re-seal it with a valid checksum."""
    data = bytearray(path.read_bytes())
    length = struct.unpack_from("<I", data, 12)[0]
    raw = bytes(data[20:20 + length]).decode()
    first = min((p["offset"] for p in json.loads(raw)["parts"]), default=len(data))
    new = edit(raw).encode()
    assert new != raw.encode() and 20 + len(new) <= first, "the edit must apply and fit"
    head = struct.pack("<8sII", bytes(data[:8]), 1, len(new))
    data[:first] = head + struct.pack("<I", zlib.crc32(new, zlib.crc32(head))) + new + bytes(
        first - 20 - len(new))
    path.write_bytes(bytes(data))


_NESTED = "[" * 1900 + "]" * 1900


@pytest.mark.parametrize(("edit", "part", "names"), [
    (lambda s: s.replace('"file_bytes":', '"file_bytes":Infinity,"_":'), None, "file_bytes"),
    (lambda s: s.replace('"file_bytes":', '"file_bytes":1e400,"_":'), None, "file_bytes"),
    (lambda s: s.replace('"offset":4096', '"offset":Infinity'), "a", "offset"),
    (lambda s: s.replace('"offset":4096', '"offset":-Infinity'), "a", "offset"),
    (lambda s: s.replace('"nbytes":80', '"nbytes":NaN'), "a", "nbytes"),
    (lambda s: s.replace('"meta":{"x":1}', '"meta":{"x":' + _NESTED + "}"), None, "nested"),
    (lambda s: s.replace('"shape":[10]', '"shape":[0,1e22]').replace('"nbytes":80',
                                                                     '"nbytes":0'),
     "a", "shape"),
    (lambda s: s.replace('"shape":[10]', f'"shape":[0,{10**22}]').replace('"nbytes":80',
                                                                          '"nbytes":0'),
     "a", "shape"),
    (lambda s: s.replace('"shape":[10]', f'"shape":[0,{2**62},{2**62}]')
     .replace('"nbytes":80', '"nbytes":0'), "a", "shape"),
], ids=["file_bytes inf", "file_bytes 1e400", "offset inf", "offset -inf", "nbytes nan",
        "nested meta", "shape float 1e22", "shape int 10**22", "shape strides overflow"])
@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
def test_a_sealed_header_with_values_out_of_range_is_a_checkpoint_error(tmp_path, edit, part,
                                                                        names, mmap):
    path = tmp_path / "ck"
    write_checkpoint(path, tensors={"a": torch.arange(10)}, meta={"x": 1})
    _reseal(path, edit)
    with pytest.raises(CheckpointError, match=names) as err:
        read_checkpoint(path, mmap=mmap)
    assert err.value.part == part and err.value.path == path
    write_checkpoint(path, tensors={"a": torch.arange(10)}, meta={"x": 1})  # a good file reads
    meta, tensors = read_checkpoint(path, mmap=mmap)
    assert meta == {"x": 1} and torch.equal(tensors["a"], torch.arange(10))


def test_meta_nested_too_deeply_to_write_is_a_config_error(tmp_path):
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ConfigError, match="meta") as err:
        write_checkpoint(tmp_path / "ck", tensors={}, meta={"x": deep})
    assert err.value.field == "meta" and list(tmp_path.iterdir()) == []


# -- numbers out of range in a state dict ------------------------------------------------------


@pytest.mark.parametrize("value", [10**400, -(10**400)])
def test_a_number_too_large_for_a_float_is_a_state_error(value):
    with pytest.raises(StateError, match="finite") as err:
        number({"p": value}, "p", "sampler")
    assert err.value.key == "sampler.p"


def _buffer(spec, sampler):
    buf = ExperienceBuffer(spec=spec, capacity=16, sampler=sampler)
    buf.extend(make_rows(spec, 16))
    return buf


def _set_rng(value):
    def corrupt(state):
        state["rng"]["state"]["state"] = value
    return corrupt


def _uniform():
    return UniformSampler(replacement=False, seed=1)  # draws from the NumPy generator


def _prioritized():
    return PrioritizedSampler(seed=1)


@pytest.mark.parametrize(("make", "corrupt", "key"), [
    (_uniform, _set_rng(2**200), "sampler.rng"),
    (_uniform, _set_rng(-1), "sampler.rng"),
    (_uniform, lambda s: s["rng"].update(uinteger=2**200), "sampler.rng"),
    (_prioritized, _set_rng(2**200), "sampler.rng"),
    (_prioritized, _set_rng(-1), "sampler.rng"),
    (_prioritized, lambda s: s.update(max_priority=10**400), "sampler.max_priority"),
], ids=["uniform rng 2**200", "uniform rng -1", "uniform uinteger 2**200",
        "prioritized rng 2**200", "prioritized rng -1", "prioritized max_priority 10**400"])
def test_huge_numbers_in_a_sampler_state_are_refused_and_change_nothing(small_spec, make,
                                                                         corrupt, key):
    untouched, refused, other = (_buffer(small_spec, make()) for _ in range(3))
    other.sample(8)
    good = other.sampler.state_dict()
    bad = copy.deepcopy(good)
    corrupt(bad)
    with pytest.raises(StateError) as err:
        refused.sampler.load_state_dict(bad)
    assert err.value.key == key
    assert refused.sampler.state_dict()["rng"] == untouched.sampler.state_dict()["rng"]
    assert torch.equal(refused.sample(8)["_index"], untouched.sample(8)["_index"])
    refused.sampler.load_state_dict(good)  # a good state still loads
    assert refused.sampler.state_dict()["rng"] == good["rng"]


# -- a memory-mapped store's manifest with a malformed spec ------------------------------------


@pytest.mark.parametrize("mutate", [
    lambda m: m.update(spec=5),
    lambda m: m.update(spec=[1, 2]),
    lambda m: m["spec"].update(obs=5),
    lambda m: m["spec"]["obs"].pop("dtype"),
    lambda m: m["spec"]["obs"].update(shape=4),
    lambda m: m["spec"]["obs"].update(shape=["a"]),
    lambda m: m["spec"]["obs"].update(dtype="float99"),
    lambda m: m.update(capacity="5"),
], ids=["spec 5", "spec list", "field 5", "no dtype", "shape 4", "shape text", "dtype",
        "capacity text"])
def test_a_manifest_with_a_malformed_spec_is_a_checkpoint_error(tmp_path, small_spec, mutate):
    folder = tmp_path / "store"
    store = MemmapColumnStore(directory=folder, spec=small_spec, capacity=5)
    store.set_range(0, make_rows(small_spec, 5))
    store.flush()
    del store
    good = (folder / MANIFEST).read_text()
    manifest = json.loads(good)
    mutate(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=MANIFEST) as err:
        MemmapColumnStore(directory=folder, spec=small_spec, capacity=5)
    assert err.value.path == folder / MANIFEST
    (folder / MANIFEST).write_text(good)  # the rows are still there for a good manifest
    again = MemmapColumnStore(directory=folder, spec=small_spec, capacity=5)
    assert torch.equal(again.column("id"), torch.arange(5))


# -- the writer's count of rows ever written ---------------------------------------------------


@pytest.mark.parametrize("total", [2**63, 2**64 + 3, 10**30])
def test_a_total_written_past_int64_is_refused_and_changes_nothing(total):
    writer = RingWriter(capacity=8)
    writer.reserve(5)
    before = writer.state_dict()
    with pytest.raises(StateError, match="total_written") as err:
        writer.load_state_dict({"cursor": 5, "size": 5, "total_written": total})
    assert err.value.key == "writer.total_written"
    assert writer.state_dict() == before
    writer.load_state_dict({"cursor": 5, "size": 5, "total_written": 2**63 - 1})
    assert writer.total_written == 2**63 - 1


def test_a_write_that_would_take_row_ids_past_int64_is_refused():
    writer = RingWriter(capacity=8)
    writer.load_state_dict({"cursor": 5, "size": 5, "total_written": 2**63 - 2})
    before = writer.state_dict()
    with pytest.raises(CapacityError, match="row ids"):
        writer.reserve(3)
    assert writer.state_dict() == before
    assert writer.reserve(2) == [(5, 0, 2)]
    assert writer.total_written == 2**63


def test_a_buffer_refuses_a_total_written_past_int64_and_keeps_its_ids(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=16)
    buf.extend(make_rows(small_spec, 10))
    state = buf.state_dict()
    bad = {**state, "writer": {**state["writer"], "total_written": 2**63}}
    with pytest.raises(StateError, match="total_written"):
        buf.load_state_dict(bad)
    assert buf.total_written == 10
    buf.extend(make_rows(small_spec, 2, start=10))
    assert buf._row_id[8:12].tolist() == [8, 9, 10, 11]


# -- path arguments ----------------------------------------------------------------------------

_BAD_PATHS = [None, 123, "", b"ck", "a\0b", 1.5]
_BAD_IDS = ["None", "int", "empty", "bytes", "nul", "float"]


@pytest.mark.parametrize("bad", [*_BAD_PATHS, ".", "/"], ids=[*_BAD_IDS, "dot", "root"])
def test_write_checkpoint_refuses_a_bad_path_and_writes_nothing(tmp_path, monkeypatch, bad):
    monkeypatch.chdir(tmp_path)
    write_checkpoint(tmp_path / "ck", tensors={"a": torch.arange(3)}, meta={"n": 1})
    with pytest.raises(ConfigError) as err:
        write_checkpoint(bad, tensors={"a": torch.arange(5)}, meta={"n": 2})
    assert err.value.field == "path"
    with pytest.raises(ConfigError) as err, atomic_write(bad):
        pass
    assert err.value.field == "path"
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary file is left
    meta, tensors = read_checkpoint(tmp_path / "ck")
    assert meta == {"n": 1} and torch.equal(tensors["a"], torch.arange(3))


@pytest.mark.parametrize("bad", _BAD_PATHS, ids=_BAD_IDS)
def test_read_checkpoint_refuses_a_bad_path(bad):
    with pytest.raises(ConfigError) as err:
        read_checkpoint(bad)
    assert err.value.field == "path"


def test_a_path_like_still_works(tmp_path):
    class Where:
        def __fspath__(self) -> str:
            return str(tmp_path / "ck")

    write_checkpoint(Where(), tensors={"a": torch.arange(3)}, meta={})
    assert torch.equal(read_checkpoint(str(tmp_path / "ck"))[1]["a"], torch.arange(3))


@pytest.mark.parametrize("bad", [None, 5, "", b"store"], ids=["None", "int", "empty", "bytes"])
def test_memmap_store_refuses_a_bad_directory(tmp_path, monkeypatch, small_spec, bad):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        MemmapColumnStore(directory=bad, spec=small_spec, capacity=4)
    assert err.value.field == "directory"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", [None, 123, ""], ids=["None", "int", "empty"])
def test_plane_save_refuses_a_bad_path_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch,
                                                                         small_spec, bad):
    monkeypatch.chdir(tmp_path)
    with ExperienceDataPlane(spec=small_spec, capacity=8, batch_size=4) as plane:
        plane.push(make_rows(small_spec, 4))
        plane.save(tmp_path / "ck")
        before = (tmp_path / "ck").read_bytes()
        with pytest.raises(ConfigError) as err:
            plane.save(bad)
        assert err.value.field == "path"
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    assert (tmp_path / "ck").read_bytes() == before


# -- conjugate and negative views ---------------------------------------------------------------


def _views() -> dict[str, torch.Tensor]:
    z = torch.tensor([[1 + 2j, 3 - 4j], [-5 + 0.5j, 0j]], dtype=torch.complex64)
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {"conj": z.conj(), "conj_t": z.conj().t(), "neg": torch._neg_view(x),
            "neg_t": torch._neg_view(x).t(), "neg_conj": torch._neg_view(z.conj()),
            "plain": x}


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
def test_conjugate_and_negative_views_are_written_as_the_values_they_show(tmp_path, mmap):
    views = _views()
    write_checkpoint(tmp_path / "ck", tensors=views, meta={})
    _, got = read_checkpoint(tmp_path / "ck", mmap=mmap)
    for name, t in views.items():
        want = t.resolve_conj().resolve_neg()
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name], want), name
        assert not got[name].is_conj() and not got[name].is_neg(), name
    assert views["conj"].is_conj() and views["neg"].is_neg()  # the caller's views are kept


def test_sources_may_make_conjugate_and_negative_chunks(tmp_path):
    z = torch.tensor([1 + 2j, 3 - 4j, 5 + 6j, -7j], dtype=torch.complex64)
    x = torch.arange(6, dtype=torch.float64)
    write_checkpoint(tmp_path / "ck", tensors={"z": z, "x": x}, meta={},
                     sources={"z": lambda: [z[:2].conj(), z[2:].conj()],
                              "x": lambda: [torch._neg_view(x)]})
    _, got = read_checkpoint(tmp_path / "ck")
    assert torch.equal(got["z"], z.conj().resolve_conj())
    assert torch.equal(got["x"], -x)

