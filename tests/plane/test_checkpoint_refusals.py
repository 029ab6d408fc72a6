"""Refused plane loads: a row part of another dtype is never cast, a refused load leaves a
caller's store as it was, out-of-range header values are named, and an override that does not
fit a sound file is the caller's error, not the file's (docs/design.md §8)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conduit import ExperienceDataPlane, ExperienceSpec, Schedule
from conduit.errors import ConfigError, SpecError
from conduit.spec import FieldSpec
from conduit.storage import (
    CheckpointError,
    ColumnStore,
    MemmapColumnStore,
    read_checkpoint,
    write_checkpoint,
)
from tests.conftest import make_rows


def _save(spec: ExperienceSpec, path: Path, rows: int = 12, start: int = 0,
          **kw: Any) -> Path:
    with ExperienceDataPlane(spec=spec, capacity=16, batch_size=4, **kw) as plane:
        plane.push(make_rows(spec, rows, start=start))
        return plane.save(path).path


def _rewrite(path: Path, edit: Callable[[dict[str, Any], dict[str, torch.Tensor]], None]
             ) -> None:
    """Rewrite ``path`` with ``edit`` applied to its metadata and parts (checksums hold)."""
    meta, parts = read_checkpoint(path)
    parts = dict(parts)
    edit(meta, parts)
    write_checkpoint(path, tensors=parts, meta=meta)


def _loads_as_saved(path: Path, ids: list[int]) -> None:
    with ExperienceDataPlane.load(path) as back:  # the file itself is fine
        assert back.buffer.store.column("id")[:len(ids)].tolist() == ids


# --- a row part is never cast to another dtype ---------------------------------------------

def test_a_spec_override_of_another_dtype_is_refused_naming_the_field(small_spec, tmp_path):
    """Defect: the saved int64 ids were copied into int32 columns, wrapping silently."""
    path = _save(small_spec, tmp_path / "p.ckpt", rows=4, start=2**33)
    narrow = small_spec.with_field("id", FieldSpec((), torch.int32))
    with pytest.raises(SpecError, match="int64") as ei:
        ExperienceDataPlane.load(path, spec=narrow)
    assert ei.value.field == "id" and not isinstance(ei.value, CheckpointError)
    _loads_as_saved(path, list(range(2**33, 2**33 + 4)))


@pytest.mark.parametrize(("part", "change"), [
    ("rows/0/id", lambda t: t.to(torch.float64)),  # another dtype: was cast silently
    ("rows/0/obs", lambda t: t.reshape(t.shape[0], 2, 2)),  # another row shape
], ids=["dtype", "shape"])
def test_a_row_part_that_disagrees_with_its_field_is_a_checkpoint_error_naming_it(
        small_spec, tmp_path, part, change):
    path = _save(small_spec, tmp_path / "p.ckpt")

    def edit(meta: dict[str, Any], parts: dict[str, torch.Tensor]) -> None:
        parts[part] = change(parts[part])

    _rewrite(path, edit)
    with pytest.raises(CheckpointError) as ei:
        ExperienceDataPlane.load(path)
    assert ei.value.part == part


# --- a refused load leaves a caller's store as it was ---------------------------------------

def _break_cursor(path: Path) -> None:
    _rewrite(path, lambda meta, parts: meta["state"]["buffer"]["writer"].update(cursor=99))


def _flip_a_row_byte(path: Path) -> None:
    from conduit.storage.checkpoint import _read_header  # the part offsets, for the test

    data = bytearray(path.read_bytes())
    with open(path, "rb") as f:
        _, parts, _ = _read_header(f, path, len(data))
    obs = next(p for p in parts if p.name == "rows/0/obs")
    data[obs.offset + 5] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("kind", "spoil", "override", "error"), [
    ("memmap", _break_cursor, {}, CheckpointError),
    ("host", _break_cursor, {}, CheckpointError),
    ("memmap", _flip_a_row_byte, {}, CheckpointError),
    ("host", _flip_a_row_byte, {}, CheckpointError),
    ("memmap", None, {"sampler": "prioritized"}, ConfigError),
], ids=["memmap-cursor", "host-cursor", "memmap-crc", "host-crc", "memmap-sampler"])
def test_a_refused_load_leaves_the_callers_store_as_it_was(small_spec, tmp_path, kind, spoil,
                                                           override, error):
    """Defect: the saved rows were read straight into the caller's store before the state
    was checked, so a refused load left the file's rows there (and in a memory-mapped
    store's files, under a manifest that still described the old rows)."""
    good = _save(small_spec, tmp_path / "good.ckpt", rows=16, start=1000)
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(good.read_bytes())
    if spoil is not None:
        spoil(bad)

    def make_store() -> ColumnStore:
        if kind == "memmap":
            return MemmapColumnStore(directory=tmp_path / "cols", spec=small_spec, capacity=16)
        return ColumnStore(spec=small_spec, capacity=16)

    store = make_store()
    mine = make_rows(small_spec, 16)
    store.set_range(0, mine)
    if kind == "memmap":
        store.flush()
    with pytest.raises(error):
        ExperienceDataPlane.load(bad, store=store, **override)
    assert all(torch.equal(store.column(f), mine[f]) for f in small_spec.fields)
    if kind == "memmap":
        reopened = MemmapColumnStore(directory=tmp_path / "cols", spec=small_spec, capacity=16)
        assert reopened.column("id").tolist() == list(range(16))
    with ExperienceDataPlane.load(good, store=store) as back:  # a sound load still works
        assert back.buffer.store is store and len(back.buffer) == 16
        assert store.column("id").tolist() == list(range(1000, 1016))
        assert back.pull()["id"].min() >= 1000


# --- out-of-range header values are named ---------------------------------------------------

@pytest.mark.parametrize("value", ["1/0", "1e999", "abc", "-1", None],
                         ids=["zero-div", "overflow", "text", "negative", "null"])
def test_an_out_of_range_schedule_in_the_header_is_a_checkpoint_error_naming_it(
        small_spec, tmp_path, value):
    """Defect: "1/0" raised ZeroDivisionError and "1e999" OverflowError, unnamed."""
    path = _save(small_spec, tmp_path / "p.ckpt")
    _rewrite(path, lambda meta, parts: meta["schedule"].update(g_ing=value))
    with pytest.raises(CheckpointError) as ei:
        ExperienceDataPlane.load(path)
    assert ei.value.part == "schedule.g_ing"
    # the header's schedule is checked even where an override replaces it
    with pytest.raises(CheckpointError):
        ExperienceDataPlane.load(path, schedule=Schedule(0, 1, 0, 1))


def test_a_saved_schedule_round_trips(small_spec, tmp_path):
    """What save writes for a schedule is what the load checks accept."""
    schedule = Schedule(1, 2, 1, 1)
    path = _save(small_spec, tmp_path / "p.ckpt", schedule=schedule)
    with ExperienceDataPlane.load(path) as back:
        assert back.state_dict(rows=False)["schedule"] == schedule.to_dict()


# --- an override that does not fit a sound file is the caller's error -----------------------

@pytest.mark.parametrize(("saved", "override", "error", "field"), [
    ({}, {"sampler": "prioritized"}, ConfigError, "sampler"),
    ({}, {"spec": "wider"}, SpecError, "obs"),
    ({}, {"spec": "extra"}, SpecError, "extra"),
    ({}, {"spec": "fewer"}, SpecError, "done"),
    ({}, {"mode": "on_policy", "num_minibatches": 2}, ConfigError, "mode"),
    ({"mode": "on_policy", "num_minibatches": 2}, {"mode": "off_policy"}, ConfigError, "mode"),
    ({"mode": "on_policy", "num_minibatches": 2}, {"num_minibatches": 4}, ConfigError,
     "num_minibatches"),
], ids=["sampler", "spec-wider", "spec-extra", "spec-fewer", "mode-on", "mode-off",
        "num-minibatches"])
def test_an_override_that_does_not_fit_the_file_is_the_callers_error(small_spec, tmp_path,
                                                                     saved, override, error,
                                                                     field):
    """Defect: these were CheckpointErrors blaming a sound file ("the saved state does not
    fit the plane", "the header does not describe a plane")."""
    specs = {"wider": small_spec.with_field("obs", FieldSpec((6,), torch.float32)),
             "extra": small_spec.with_field("extra", FieldSpec((), torch.float32)),
             "fewer": ExperienceSpec(fields={k: v for k, v in small_spec.fields.items()
                                             if k != "done"})}
    if "spec" in override:
        override = {**override, "spec": specs[override["spec"]]}
    path = _save(small_spec, tmp_path / "p.ckpt", rows=16, **saved)
    with pytest.raises(error) as ei:
        ExperienceDataPlane.load(path, **override)
    assert not isinstance(ei.value, CheckpointError) and ei.value.field == field
    _loads_as_saved(path, list(range(16)))


def test_an_override_that_fits_still_loads(small_spec, tmp_path):
    path = _save(small_spec, tmp_path / "p.ckpt", sampler="prioritized")
    with ExperienceDataPlane.load(path, spec=small_spec, mode="off_policy",
                                  sampler="prioritized") as back:
        assert len(back.buffer) == 12


def test_a_corrupt_sampler_state_under_a_like_override_is_still_the_files_fault(small_spec,
                                                                                tmp_path):
    """A sampler override of the saved kind and configuration does not take the blame for
    the file's sampler state."""
    path = _save(small_spec, tmp_path / "p.ckpt", sampler="prioritized")
    _rewrite(path, lambda meta, parts: meta["state"]["buffer"]["sampler"].pop("max_priority"))
    with pytest.raises(CheckpointError) as ei:
        ExperienceDataPlane.load(path, sampler="prioritized")
    assert ei.value.part == "sampler.max_priority"


@pytest.mark.parametrize("store", [False, True], ids=["sharded", "callers-store"])
def test_rows_copied_in_are_there_before_a_background_delivery_reads_them(small_spec,
                                                                          tmp_path, store):
    """The rows that are copied in (not read in place) land before the operators resume."""
    from conduit import Placement

    path = _save(small_spec, tmp_path / "p.ckpt", rows=16, start=1000)
    over: dict[str, Any] = ({"store": ColumnStore(spec=small_spec, capacity=16)} if store
                            else {"placement": Placement.sharded(["cpu", "cpu"])})
    for _ in range(5):
        with ExperienceDataPlane.load(path, schedule=Schedule(1, 1, 1, 2), **over) as back:
            for _ in range(4):
                assert back.pull()["id"].min() >= 1000


@pytest.mark.parametrize("path", [None, "", 123], ids=["None", "empty", "int"])
def test_load_and_snapshots_refuse_what_is_not_a_path(small_spec, tmp_path, path):
    _save(small_spec, tmp_path / "c.ckpt")
    with pytest.raises(ConfigError) as err:
        ExperienceDataPlane.load(path)
    assert err.value.field == "path"
    with ExperienceDataPlane(spec=small_spec, capacity=8, batch_size=2, timeout=5) as plane:
        with pytest.raises(ConfigError) as err:
            plane.snapshots(path, every_s=60)
        assert err.value.field == "path"
        with pytest.raises(ConfigError) as err:
            plane.save(path)
        assert err.value.field == "path"
    _loads_as_saved(tmp_path / "c.ckpt", list(range(12)))


@pytest.mark.parametrize(("kw", "field"), [
    (dict(every_s="60"), "every_s"), (dict(every_s=True), "every_s"),
    (dict(every_s=float("nan")), "every_s"), (dict(every_s=0), "every_s"),
    (dict(every_s=60, double_buffer="no"), "double_buffer"),
    (dict(every_s=60, path=Path(".")), "path")])
def test_snapshots_refuse_bad_arguments(small_spec, tmp_path, kw, field):
    kw = {"path": tmp_path / "s.ckpt", **kw}
    with ExperienceDataPlane(spec=small_spec, capacity=8, batch_size=2, timeout=5) as plane:
        with pytest.raises(ConfigError) as err:
            plane.snapshots(**kw)
        assert err.value.field == field
        with plane.snapshots(tmp_path / "s.ckpt", every_s=float("inf")) as snap:  # on request
            plane.push(make_rows(small_spec, 4))
            snap.request(wait=True)
    _loads_as_saved(tmp_path / "s.ckpt", [0, 1, 2, 3])
