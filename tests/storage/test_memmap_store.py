"""Memory-mapped column store: same rows as ColumnStore, on disk, across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch

from conduit.errors import CapacityError, ConfigError, SpecError
from conduit.spec import ExperienceSpec, FieldSpec
from conduit.storage import ColumnStore, ExperienceBuffer, UniformSampler
from conduit.storage.checkpoint import CheckpointError
from conduit.storage.memmap_store import MANIFEST, MemmapColumnStore
from tests.conftest import make_rows


@pytest.fixture
def spec(small_spec) -> ExperienceSpec:
    """``small_spec`` plus a field numpy cannot view and an empty one."""
    return small_spec.with_field("h", FieldSpec((2,), torch.bfloat16)).with_field(
        "nothing", FieldSpec((0,), torch.float32))


def test_same_rows_as_a_column_store(tmp_path, spec):
    mem = MemmapColumnStore(directory=tmp_path / "s", spec=spec, capacity=20)
    ram = ColumnStore(spec=spec, capacity=20)
    for store in (mem, ram):
        store.set_range(0, make_rows(spec, 12))
        store.set(torch.tensor([19, 3, 12]), make_rows(spec, 3, start=100))
    idx = torch.tensor([[19, 0], [3, 12], [11, 11]])
    got, want = mem.get(idx), ram.get(idx)
    assert set(got) == set(want) == set(spec.fields)
    for name in spec.fields:
        assert torch.equal(got[name], want[name]), name
    assert mem.nbytes == ram.nbytes and mem.placement.kind == "pageable"


def test_columns_are_the_files(tmp_path, small_spec):
    store = MemmapColumnStore(directory=tmp_path, spec=small_spec, capacity=8)
    store.set_range(2, make_rows(small_spec, 3, start=40))
    store.column("id")[7] = 99  # the column is the mapping itself, not a copy

    def ids() -> list[int]:
        raw = bytearray(store.column_path("id").read_bytes())
        return torch.frombuffer(raw, dtype=torch.int64).tolist()

    assert ids() == [0, 0, 40, 41, 42, 0, 0, 99]


def test_state_dict_moves_rows_between_memory_and_disk(tmp_path, spec):
    ram = ColumnStore(spec=spec, capacity=10)
    ram.set_range(0, make_rows(spec, 10))
    mem = MemmapColumnStore(directory=tmp_path, spec=spec, capacity=10)
    mem.load_state_dict(ram.state_dict())
    back = ColumnStore(spec=spec, capacity=10)
    back.load_state_dict(mem.state_dict())
    for name in spec.fields:
        assert torch.equal(back.column(name), ram.column(name)), name


_READER = textwrap.dedent("""
    import json, sys, torch
    from conduit.spec import ExperienceSpec
    from conduit.storage.memmap_store import MemmapColumnStore
    spec = ExperienceSpec.from_dict(json.loads(sys.argv[2]))
    store = MemmapColumnStore(directory=sys.argv[1], spec=spec, capacity=30)
    rows = store.get(torch.arange(30))
    print(json.dumps({"meta": store.meta, "id": rows["id"].tolist(),
                      "h": rows["h"].float().tolist(), "done": rows["done"].tolist()}))
""")


def test_rows_and_meta_survive_into_a_fresh_process(tmp_path, spec):
    store = MemmapColumnStore(directory=tmp_path / "s", spec=spec, capacity=30)
    rows = make_rows(spec, 25, start=7)
    store.set_range(0, rows)
    store.flush(meta={"writer": {"cursor": 25, "size": 25}})
    del store
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    out = subprocess.run([sys.executable, "-c", _READER, str(tmp_path / "s"),
                          json.dumps(spec.to_dict())], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    seen = json.loads(out)
    assert seen["meta"] == {"writer": {"cursor": 25, "size": 25}}
    assert seen["id"] == [*rows["id"].tolist(), 0, 0, 0, 0, 0]
    assert seen["h"][:25] == rows["h"].float().tolist()
    assert seen["done"][:25] == rows["done"].tolist()


def test_rows_written_after_a_flush_are_kept_and_meta_is_the_flushed_one(tmp_path, small_spec):
    store = MemmapColumnStore(directory=tmp_path, spec=small_spec, capacity=5)
    store.flush(meta={"n": 1})
    store.set_range(0, make_rows(small_spec, 5, start=3))
    del store
    again = MemmapColumnStore(directory=tmp_path, spec=small_spec, capacity=5)
    assert again.meta == {"n": 1}
    assert again.get(torch.arange(5))["id"].tolist() == [3, 4, 5, 6, 7]


@pytest.mark.parametrize("change, field", [
    (lambda s: s.with_field("obs", FieldSpec((5,), torch.float32)), "obs"),
    (lambda s: s.with_field("id", FieldSpec((), torch.int32)), "id"),
    (lambda s: s.with_field("extra", FieldSpec((), torch.float32)), "extra"),
    (lambda s: ExperienceSpec(fields={k: v for k, v in s.fields.items() if k != "done"}),
     "done"),
], ids=["shape", "dtype", "new field", "dropped field"])
def test_reopening_with_another_spec_names_the_field(tmp_path, small_spec, change, field):
    MemmapColumnStore(directory=tmp_path, spec=small_spec, capacity=5)
    with pytest.raises(SpecError) as err:
        MemmapColumnStore(directory=tmp_path, spec=change(small_spec), capacity=5)
    assert err.value.field == field


def test_reopening_with_another_capacity_raises(tmp_path, small_spec):
    MemmapColumnStore(directory=tmp_path, spec=small_spec, capacity=5)
    with pytest.raises(CapacityError, match="capacity 5"):
        MemmapColumnStore(directory=tmp_path, spec=small_spec, capacity=6)


def test_damaged_store_folders_raise(tmp_path, small_spec):
    MemmapColumnStore(directory=tmp_path, spec=small_spec, capacity=5)
    obs = tmp_path / "obs.bin"
    obs.write_bytes(obs.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=r"obs\.bin") as err:
        MemmapColumnStore(directory=tmp_path, spec=small_spec, capacity=5)
    assert err.value.part == "obs"
    obs.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        MemmapColumnStore(directory=tmp_path, spec=small_spec, capacity=5)
    (tmp_path / MANIFEST).write_text("{")
    with pytest.raises(CheckpointError, match="manifest"):
        MemmapColumnStore(directory=tmp_path, spec=small_spec, capacity=5)


def test_a_manifest_of_another_byte_order_raises(tmp_path, small_spec):
    MemmapColumnStore(directory=tmp_path, spec=small_spec, capacity=5)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["byte_order"] = "big" if sys.byteorder == "little" else "little"
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="byte order"):
        MemmapColumnStore(directory=tmp_path, spec=small_spec, capacity=5)


def test_meta_must_be_strict_json(tmp_path, small_spec):
    store = MemmapColumnStore(directory=tmp_path, spec=small_spec, capacity=5)
    with pytest.raises(ConfigError, match="meta"):
        store.flush(meta={"x": float("nan")})
    assert store.meta == {}
    with pytest.raises(ConfigError, match="capacity"):
        MemmapColumnStore(directory=tmp_path / "b", spec=small_spec, capacity=0)


def test_as_the_store_of_an_experience_buffer(tmp_path, small_spec):
    def buffer(store=None):
        buf = ExperienceBuffer(spec=small_spec, capacity=16, sampler=UniformSampler(seed=3))
        if store is not None:
            buf.store = store
        return buf

    ram, disk = buffer(), buffer(MemmapColumnStore(directory=tmp_path, spec=small_spec,
                                                   capacity=16))
    for buf in (ram, disk):
        buf.extend(make_rows(small_spec, 12))
        buf.extend(make_rows(small_spec, 8, start=12))  # wraps
    for _ in range(3):
        a, b = ram.sample(8), disk.sample(8)
        assert all(torch.equal(a[k], b[k]) for k in a)
    disk.store.flush(meta={"writer": disk.writer.state_dict()})
    del disk

    store = MemmapColumnStore(directory=tmp_path, spec=small_spec, capacity=16)
    again = buffer(store)
    again.writer.load_state_dict(store.meta["writer"])
    assert len(again) == 16
    order = again.writer.logical_order()
    assert again.gather(order)["id"].tolist() == list(range(4, 20))


def test_a_store_larger_than_its_resident_memory(tmp_path):
    spec = ExperienceSpec.of(obs=((256,), torch.float32))  # 1 KiB rows
    proc = psutil.Process()
    before = proc.memory_info().rss
    store = MemmapColumnStore(directory=tmp_path, spec=spec, capacity=1 << 20)  # 1 GiB
    store.set_range((1 << 20) - 4, {"obs": torch.ones(4, 256)})
    assert store.get(torch.tensor([(1 << 20) - 1, 0]))["obs"][:, 0].tolist() == [1.0, 0.0]
    assert proc.memory_info().rss - before < 64 << 20
    on_disk = (tmp_path / "obs.bin").stat().st_blocks * 512
    assert on_disk < 64 << 20, "columns are sparse until rows are written"
