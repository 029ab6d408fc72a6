"""Plane checkpoints on disk: ``plane.save(path)``, ``ExperienceDataPlane.load(path)`` and
periodic snapshots.

A checkpoint is one file of :mod:`conduit.storage.checkpoint`'s format (versioned, a checksum
per part, written atomically, no pickle). Its metadata holds:

* ``"format"`` (``"conduit-plane"``) and ``"version"`` (:data:`VERSION`);
* ``"config"``: the plane's constructor arguments (spec, capacity, mode, batch sizes, ...);
* ``"sampler"``: the sampler's class name and :meth:`~conduit.storage.Sampler.config`;
* ``"schedule"`` and ``"placement"`` in force when saved;
* ``"rows"``: the filled slots, as blocks ``{"start", "rows"}`` whose columns are the parts
  ``rows/<block>/<field>``;
* ``"state"``: writer, sampler, row ids, flow (iteration) state and counters, with tensors
  replaced by ``{"$tensor": part}`` references.

Rows are written straight from the buffer's memory (no copy) while the plane is paused; a
snapshot reads them out copy-on-write while training goes on (docs/design.md §8).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import numbers
import os
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from conduit._checks import check_bool
from conduit.errors import (
    ConduitError,
    ConfigError,
    PlacementError,
    PlaneClosedError,
    ScheduleError,
    SpecError,
    StateError,
    raised_again,
)
from conduit.scheduling.space import Schedule
from conduit.spec import ExperienceSpec
from conduit.storage import (
    CheckpointError,
    CheckpointInfo,
    ColumnStore,
    ExperienceBuffer,
    Placement,
    read_checkpoint,
    sampler_from_config,
    write_checkpoint,
)
from conduit.storage.checkpoint import Layout, check_path
from conduit.storage.snapshot import RowSnapshot, SnapshotAbandonedError, SnapshotSource
from conduit.storage.state import JSON, StateDict, StateValue

if TYPE_CHECKING:
    from conduit.plane.data_plane import ExperienceDataPlane

FORMAT = "conduit-plane"
#: The checkpoint layout version this module writes and reads.
VERSION = 1

_CONFIG_KEYS = ("capacity", "mode", "batch_size", "num_minibatches", "num_epochs", "min_size",
                "rollout_rows", "g_max", "max_priority_lag", "timeout", "seed")


def _to_parts(obj: object, name: str, parts: dict[str, torch.Tensor]) -> JSON:
    """``obj`` as strict JSON, every tensor (or numpy array) moved into ``parts``."""
    if isinstance(obj, np.ndarray):
        obj = torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, torch.Tensor):
        parts[name] = obj
        return {"$tensor": name}
    if isinstance(obj, Mapping):
        return {str(k): _to_parts(v, f"{name}/{k}", parts) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_parts(v, f"{name}/{i}", parts) for i, v in enumerate(obj)]
    return obj


def _from_parts(obj: JSON, parts: Mapping[str, torch.Tensor], path: Path) -> StateValue:
    if isinstance(obj, dict):
        if set(obj) == {"$tensor"}:
            if obj["$tensor"] not in parts:
                raise CheckpointError(path, "a part named in the header is missing",
                                      part=str(obj["$tensor"]))
            return parts[obj["$tensor"]]
        return {k: _from_parts(v, parts, path) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_parts(v, parts, path) for v in obj]
    return obj


def _layout(plane: ExperienceDataPlane, buffer: ExperienceBuffer, state: StateDict,
            blocks: list[tuple[int, dict[str, torch.Tensor]]]
            ) -> tuple[dict[str, JSON], dict[str, torch.Tensor]]:
    """The checkpoint's metadata and parts for ``plane``'s ``state`` and row ``blocks``, read
    from ``buffer``: its spec, sampler and placement describe the rows (a migration may have
    replaced ``plane.buffer`` since)."""
    parts: dict[str, torch.Tensor] = {}
    rows = []
    for b, (start, cols) in enumerate(blocks):
        for f, col in cols.items():
            parts[f"rows/{b}/{f}"] = col
        rows.append({"start": start, "rows": int(next(iter(cols.values())).shape[0])})
    cfg = plane.config
    sampler = buffer.sampler
    state = {**state, "spec": buffer.spec.to_dict()}
    meta = {"format": FORMAT, "version": VERSION,
            "config": {k: getattr(cfg, k) for k in _CONFIG_KEYS},
            "spec": buffer.spec.to_dict(),
            "rollout_spec": cfg.rollout_spec.to_dict() if cfg.rollout_spec else None,
            "sampler": {"kind": type(sampler).__name__, "config": sampler.config()},
            "schedule": state["schedule"],
            "placement": buffer.placement.to_dict(),
            "rows": rows, "state": _to_parts(state, "state", parts)}
    return meta, parts


def save(plane: ExperienceDataPlane, path: str | Path) -> CheckpointInfo:
    """Write ``plane`` to ``path`` (see :meth:`ExperienceDataPlane.save`).

    Raises:
        ConfigError: ``path`` does not name a file, or names something that exists and is
            not a regular file (a folder, a device, a FIFO): checked before the operators are
            held, and nothing is written.
    """
    path = check_path("path", path, file=True)
    with plane.frozen(rows=False) as state:
        buffer = plane.buffer
        meta, parts = _layout(plane, buffer, state, buffer.filled_blocks())
        return write_checkpoint(path, tensors=parts, meta=meta)


def _schedule(d: Any, path: Path) -> Schedule:
    """The schedule a header holds.

    Raises:
        CheckpointError: A value is missing, of the wrong type or out of range (the part
            names it, e.g. ``schedule.g_ing``).
    """
    if not isinstance(d, Mapping):
        raise CheckpointError(path, f"expected a mapping, got {type(d).__name__}",
                              part="schedule")
    values: dict[str, Any] = {}
    for key, kind in (("overlap_ing", int), ("g_ing", Fraction), ("overlap_del", int),
                      ("g_del", Fraction)):
        try:
            # taken as saved, never coerced: an overlap is an integer, a granularity an
            # integer or a fraction's text (a bool, or 1.5 for an overlap, is no value)
            value = d[key]
            text = kind is Fraction
            if isinstance(value, bool) or not isinstance(value, (int, str) if text else int):
                want = "an integer or a fraction as text" if text else "an integer"
                raise TypeError(f"expected {want}, got {type(value).__name__}")
            values[key] = kind(value)
            float(values[key])  # "1/0" or "1e999" parse (or not) but are no granularity
        except (KeyError, TypeError, ValueError, ArithmeticError) as exc:
            raise CheckpointError(path, f"{d.get(key)!r} is not a schedule value "
                                        f"({type(exc).__name__}: {exc})",
                                  part=f"schedule.{key}") from exc
    try:
        return Schedule(**values)
    except ScheduleError as exc:
        key = str(exc).partition(":")[0]
        raise CheckpointError(path, str(exc), part=f"schedule.{key}" if key in values
                              else "schedule") from exc


def load(cls: type[ExperienceDataPlane], path: str | Path,
         **overrides: Any) -> ExperienceDataPlane:
    """Build a ``cls`` plane from a checkpoint (see :meth:`ExperienceDataPlane.load`).

    The plane is built from the header before any row is read, so that the rows are read
    straight into its columns where they are host memory (no mapping, no second copy). A
    caller's ``store`` is written only once the whole file has been checked: a refused load
    changes nothing (its rows are mapped, then copied in).

    Raises:
        CheckpointError: The file is corrupt, of another version, or holds a value out of
            range or inconsistent with another, such as row parts of another dtype or shape
            than their fields or of a field the header's spec lacks, a state part of another
            kind of value than it holds (never cast), or a copy of the spec or schedule in
            the state that differs from the header's (named).
        ConfigError: An override is not a constructor argument or does not fit the file
            (``capacity``, ``mode``, ``seed``; a ``sampler`` of another kind than the saved
            one, or of another configuration where its state depends on it, see
            :func:`_check_sampler_override`; a ``num_epochs``, ``num_minibatches``,
            ``batch_size``, ``min_size`` or ``rollout_rows`` that the saved sampler or
            iteration state does not fit), or is refused by the constructor; ``field``
            names it.
        SpecError: A ``spec`` override differs from the saved spec (the field is named).
    """
    path = check_path("path", path)
    made: list[ExperienceDataPlane] = []
    in_place: set[str] = set()

    def destinations(meta: dict[str, Any], layout: Layout) -> dict[str, torch.Tensor]:
        made.append(_build(cls, meta, path, overrides))
        if "sampler" in overrides:
            _check_sampler_override(made[0], meta)
        _check_row_parts(made[0], layout, path)
        if "store" in overrides:
            return {}  # the caller's rows: written by _restore once everything is checked
        dest = _row_destinations(made[0], meta, layout)
        in_place.update(dest)
        return dest

    try:
        meta, parts = read_checkpoint(path, mmap=True, into=destinations)
        _restore(made[0], meta, parts, path, in_place=in_place, overrides=overrides)
    except BaseException:
        if made:
            made[0].close()
        raise
    return made[0]


_UNREAD = object()
"""What :func:`_saved` returns for a header it cannot read (a malformed header is reported
as such when the plane is built)."""


def _saved(meta: Mapping[str, Any], key: str) -> Any:
    """The header's ``config[key]``, or :data:`_UNREAD`."""
    try:
        return meta["config"][key]
    except (KeyError, TypeError):
        return _UNREAD


def _check_capacity(meta: Mapping[str, Any], capacity: Any) -> None:
    """Refuse a ``capacity`` override: slot ids, priorities and the ring's cursor are laid out
    for the saved capacity.

    Raises:
        ConfigError: ``capacity`` differs from the checkpoint's.
    """
    try:
        saved = int(_saved(meta, "capacity"))
    except (TypeError, ValueError):
        return  # unread, or not a number: reported when the plane is built
    if capacity != saved:
        raise ConfigError("capacity", f"a checkpoint loads with the capacity it was saved "
                                      f"with ({saved} rows), got {capacity!r}; drop the "
                                      f"override or pass capacity={saved}")


def _check_seed(meta: Mapping[str, Any], seed: Any) -> None:
    """Refuse a ``seed`` override: the sampler's generator and the on-policy layout resume
    from their saved state, so another seed would be reported but never used.

    Raises:
        ConfigError: ``seed`` differs from the checkpoint's.
    """
    saved = _saved(meta, "seed")
    if saved is _UNREAD:
        return
    if seed != saved or isinstance(seed, bool):
        raise ConfigError("seed", f"a checkpoint resumes the saved random state (seed "
                                  f"{saved!r}: the sampler's generator and the on-policy "
                                  f"layout go on from where they were), got {seed!r}; drop "
                                  f"the override (the loaded plane draws as the saved one "
                                  f"would have, after the batches it had staged ahead)")


def _check_mode(meta: Mapping[str, Any], mode: Any) -> None:
    """Refuse a ``mode`` override: the sampler, the iteration state and the rows are those of
    the saved mode.

    Raises:
        ConfigError: ``mode`` differs from the checkpoint's.
    """
    saved = _saved(meta, "mode")
    if saved is not _UNREAD and mode != saved:
        raise ConfigError("mode", f"a checkpoint loads in the mode it was saved in "
                                  f"({saved!r}: its sampler, iteration state and rows are "
                                  f"laid out for it), got {mode!r}; drop the override or "
                                  f"pass mode={saved!r}")


def _check_spec(meta: Mapping[str, Any], spec: Any) -> None:
    """Refuse a ``spec`` override that does not describe the saved rows: a load neither
    converts a field's dtype nor reshapes it (``plane.migrate(..., spec=)`` widens a loaded
    plane).

    Raises:
        SpecError: A field of ``spec`` differs from the saved one, or is missing from either
            (named).
    """
    try:
        saved = ExperienceSpec.from_dict(meta["spec"]).fields
    except (KeyError, TypeError, ValueError, AttributeError):
        return  # a malformed header is reported as such when the plane is built
    if not isinstance(spec, ExperienceSpec):
        return  # the constructor names it
    for name in {**saved, **spec.fields}:
        old, new = saved.get(name), spec.fields.get(name)
        if old == new:
            continue
        if new is None:
            raise SpecError(name, f"is saved in the checkpoint ({old}) but missing from the "
                                  f"spec override; drop the override to load the saved spec")
        if old is None:
            raise SpecError(name, "is in the spec override but not in the checkpoint; load "
                                  "with the saved spec (drop the override), then add it with "
                                  "plane.migrate(..., spec=spec)")
        if old.dtype != new.dtype:
            raise SpecError(name, f"saved as {old.dtype}, the spec override gives {new.dtype}; "
                                  f"a load does not convert rows (as migrate() refuses dtype "
                                  f"changes): pass dtype {old.dtype} or drop the override")
        raise SpecError(name, f"saved with shape {old.shape}, the spec override gives "
                              f"{new.shape}; load with the saved spec (drop the override), "
                              f"then widen it with plane.migrate(..., spec=spec)")


def _build(cls: type[ExperienceDataPlane], meta: Mapping[str, Any], path: Path,
           overrides: Mapping[str, Any]) -> ExperienceDataPlane:
    """The plane a checkpoint's header describes, with ``overrides``, holding no rows yet.

    Raises:
        CheckpointError: The header does not describe a plane.
        ConfigError, SpecError: An override does not fit the file or is refused by the
            constructor (named).
    """
    version = meta.get("version")
    bad = ("format" if meta.get("format") != FORMAT
           else "version" if type(version) is not int or version != VERSION else None)
    if bad is not None:  # (a bool is no version, though True == 1)
        raise CheckpointError(path, f"not a {FORMAT} checkpoint of version {VERSION} "
                                    f"(format {meta.get('format')!r}, version "
                                    f"{version!r})", part=bad)
    if "capacity" in overrides:
        _check_capacity(meta, overrides["capacity"])
    if "mode" in overrides:
        _check_mode(meta, overrides["mode"])
    if "seed" in overrides:
        _check_seed(meta, overrides["seed"])
    if "spec" in overrides:
        _check_spec(meta, overrides["spec"])
    known = inspect.signature(cls).parameters
    for name in overrides:
        if name not in known:
            raise ConfigError(name, f"is not an argument of {cls.__name__}; overrides are "
                                    f"constructor arguments ({', '.join(known)})")
    try:
        config = dict(meta["config"])
        if config.get("mode") == "off_policy":
            # ignored off-policy, and refused other than 1 since: files saved with another
            # value load as they did
            config["num_epochs"] = 1
        kwargs: dict[str, Any] = {
            **config, "spec": ExperienceSpec.from_dict(meta["spec"]),
            "rollout_spec": (ExperienceSpec.from_dict(meta["rollout_spec"])
                             if meta["rollout_spec"] else None),
            "schedule": _schedule(meta["schedule"], path),
            "placement": Placement.from_dict(meta["placement"])}
        if "sampler" not in overrides:
            kwargs["sampler"] = sampler_from_config(meta["sampler"]["kind"],
                                                    meta["sampler"]["config"])
        return cls(**{**kwargs, **overrides})
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        if _blames_override(exc, overrides):
            raise  # the caller's argument, not the file
        name = _refuses_saved_sampler(exc, meta, overrides)
        if name is not None:
            raise ConfigError(name, f"{overrides[name]!r} does not fit the saved sampler "
                                    f"({exc}); drop the override, or pass a sampler= made "
                                    f"for it") from exc
        raise CheckpointError(path, f"the header does not describe a plane: {exc}") from exc


def _blames_override(exc: BaseException, overrides: Mapping[str, Any]) -> bool:
    """Whether ``exc``, raised building a plane from a header and ``overrides``, names one of
    the overrides (a typed error for the field, schedule or placement it concerns)."""
    if not isinstance(exc, ConduitError):
        return False
    field = getattr(exc, "field", None)
    if isinstance(field, str):
        return field.split(".")[0].split("[")[0] in overrides
    return ((isinstance(exc, ScheduleError) and "schedule" in overrides)
            or (isinstance(exc, PlacementError) and "placement" in overrides))


def _check_row_parts(plane: ExperienceDataPlane, layout: Layout, path: Path) -> None:
    """Every saved row part is of a field of the plane's spec and holds its dtype and row
    shape (before any is read: a part of another dtype would be cast, or its bytes read as
    another type; a column the spec lacks would be dropped).

    Raises:
        CheckpointError: A row part does not (named).
    """
    fields = plane.spec.fields
    for name, (dtype, shape) in layout.items():
        block, _, f = name.rpartition("/")
        if not block.startswith("rows/"):
            continue
        if f not in fields:
            raise CheckpointError(path, f"a saved column of field {f!r}, which the header's "
                                        f"spec ({sorted(fields)}) lacks", part=name)
        fs = fields[f]
        if dtype != fs.dtype or tuple(shape[1:]) != fs.shape or len(shape) != len(fs.shape) + 1:
            raise CheckpointError(path, f"saved as {dtype} of shape {tuple(shape)}, but field "
                                        f"{f!r} holds {fs.dtype} rows of shape {fs.shape}",
                                  part=name)


def _refuses_saved_sampler(exc: BaseException, meta: Mapping[str, Any],
                           overrides: Mapping[str, Any]) -> str | None:
    """The override that made the plane refuse the header's sampler (a ``ConfigError`` for
    ``sampler``, where the header's configuration was changed by an override), if any."""
    if not isinstance(exc, ConfigError) or exc.field != "sampler" or "sampler" in overrides:
        return None
    return _changed_override(exc, meta, overrides, _CONFIG_KEYS)


_LAYOUT_KEYS = ("num_epochs", "num_minibatches", "batch_size", "min_size", "rollout_rows")
"""Constructor arguments that lay out the saved sampler and iteration state."""


def _changed_override(exc: BaseException, meta: Mapping[str, Any],
                      overrides: Mapping[str, Any], keys: tuple[str, ...]) -> str | None:
    """Of the ``overrides`` among ``keys`` that differ from the header's configuration, the
    one ``exc``'s message names, else the first the caller gave; None where none differs."""
    saved = meta.get("config")
    if not isinstance(saved, Mapping):
        return None
    changed = [k for k in overrides if k in keys and k in saved and saved[k] != overrides[k]]
    named = [k for k in changed if k in str(exc)]
    return (named or changed or [None])[0]


def _row_destinations(plane: ExperienceDataPlane, meta: Mapping[str, Any],
                      layout: Layout) -> dict[str, torch.Tensor]:
    """The slices of ``plane``'s host columns that the saved row blocks fill, for the parts
    that fit them exactly; the others are read as usual and checked by :func:`_restore`."""
    store = plane.buffer.store
    if not isinstance(store, ColumnStore) or store.device.type != "cpu":
        return {}
    out: dict[str, torch.Tensor] = {}
    blocks = meta.get("rows")
    for b, block in enumerate(blocks if isinstance(blocks, list) else []):
        try:
            start, rows = int(block["start"]), int(block["rows"])
        except (KeyError, TypeError, ValueError):
            continue
        if not 0 <= start <= start + rows <= store.capacity:
            continue
        for f, fs in plane.spec.fields.items():
            name = f"rows/{b}/{f}"
            if layout.get(name) == (fs.dtype, (rows, *fs.shape)):
                out[name] = store.column(f)[start:start + rows]
    return out


def _restore(plane: ExperienceDataPlane, meta: Mapping[str, JSON],
             parts: Mapping[str, torch.Tensor], path: Path, *, in_place: set[str],
             overrides: Mapping[str, Any]) -> None:
    """Put a checkpoint's rows and state into a freshly built ``plane``; the row parts named
    in ``in_place`` were read into its columns already. The other rows are copied in last,
    once every part and value has been checked, so a refused load leaves a caller's store
    as it was.

    Raises:
        CheckpointError: A part or a state value is missing or out of range, or the state's
            copy of the spec or schedule is not the header's (the message names it).
        ConfigError: A ``sampler`` override of another kind or configuration than the saved
            sampler cannot take its state, or an override of a constructor argument that lays
            out the sampler and iteration state (:data:`_LAYOUT_KEYS`) differs from the saved
            one and the saved state does not fit it (``field`` names the override).
    """
    try:
        state = _from_parts(meta["state"], parts, path)
        _check_copies(meta, state, path)
        _check_tiling(meta["rows"], plane.capacity)
        copies: list[tuple[int, dict[str, torch.Tensor]]] = []
        for b, block in enumerate(meta["rows"]):
            names = {f: f"rows/{b}/{f}" for f in plane.spec.fields}
            cols = {f: parts[name] for f, name in names.items()}
            if any(c.shape[0] != block["rows"] for c in cols.values()):
                raise StateError(f"rows.{b}", "blocks disagree on their row count")
            if not in_place.issuperset(names.values()):
                copies.append((int(block["start"]), cols))
        filled = sum(int(b["rows"]) for b in meta["rows"])
        writer = state["buffer"]["writer"]
        if not isinstance(writer, dict) or writer.get("size") != filled:
            raise StateError("buffer.writer.size", f"{writer.get('size')!r}, but {filled} "
                                                   f"rows are saved")
        with plane.paused():  # no operator runs between the state and its rows
            plane.load_state_dict(state, rows=False)  # all or nothing, and before any row
            for start, cols in copies:
                plane.buffer.store.set_range(start, cols)
    except KeyError as exc:
        raise CheckpointError(path, f"missing {exc}", part=str(exc.args[0])) from exc
    except ConduitError as exc:
        if isinstance(exc, CheckpointError):
            raise
        part = getattr(exc, "key", None) or getattr(exc, "field", None)
        saved = (_other_sampler(plane, meta) if "sampler" in overrides
                 and isinstance(part, str) and (part.split(".")[0] == "sampler"
                                                or part == "flow.layout") else None)
        if saved is not None:  # the override's fault, not the file's
            raise ConfigError("sampler", f"a {type(plane.buffer.sampler).__name__} cannot "
                                         f"take the saved sampler's state ({exc}); the file "
                                         f"holds {saved}: drop the override or pass a sampler "
                                         f"like it") from exc
        name = (_changed_override(exc, meta, overrides, _LAYOUT_KEYS)
                if isinstance(part, str) and part.split(".")[0] in ("flow", "sampler")
                else None)
        if name is not None:  # a state laid out for the saved configuration
            was = meta["config"][name]
            raise ConfigError(name, f"{overrides[name]!r} does not fit the saved state "
                                    f"({exc}): the file was saved with {name}={was!r} and "
                                    f"its iteration and sampler state are laid out for it; "
                                    f"drop the override or pass {name}={was!r}") from exc
        raise CheckpointError(path, str(exc), part=part) from exc
    except (TypeError, ValueError, AttributeError, IndexError, RecursionError) as exc:
        # a header whose checksum holds but whose values have the wrong types (or nest deeper
        # than any state does)
        raise CheckpointError(path, f"the saved state does not fit the plane: "
                                    f"{type(exc).__name__}: {exc}") from exc


def _check_copies(meta: Mapping[str, Any], state: Any, path: Path) -> None:
    """The spec and schedule the saved state repeats are the header's.

    Raises:
        CheckpointError: A copy differs from the header's (``state.spec`` or
            ``state.schedule`` is named).
    """
    if not isinstance(state, Mapping):
        return  # reported where the state is read
    for key in ("spec", "schedule"):
        if key in state and state[key] != meta.get(key):
            raise CheckpointError(path, f"the state's {key} ({state[key]!r}) is not the "
                                        f"header's ({meta.get(key)!r})", part=f"state.{key}")


_STATE_FREE_CONFIG = {"PrioritizedSampler": frozenset({"beta"}),
                      "UniformSampler": frozenset({"replacement"}),
                      "SequenceSampler": frozenset({"length"}),
                      "FifoSampler": frozenset({"shuffle", "first_within"})}
"""Per built-in sampler kind, the configuration keys (besides ``seed``) that its saved state
does not depend on: ``beta`` only weighs draws (a PrioritizedSampler's leaves are priorities
raised under ``alpha`` and ``eps``); a FifoSampler's epoch layout is checked by the flow's
state part way through an epoch."""


def _check_sampler_override(plane: ExperienceDataPlane, meta: Mapping[str, Any]) -> None:
    """Refuse a ``sampler`` override that would drop or reinterpret the saved sampler's
    state: one of another kind, or one whose configuration differs where the state depends on
    it (every key but ``seed``, whose generator state the file restores, and those of
    :data:`_STATE_FREE_CONFIG`).

    Raises:
        ConfigError: The override does not fit the saved sampler (``field`` is ``sampler``).
    """
    saved = meta.get("sampler")
    if not isinstance(saved, Mapping) or not isinstance(saved.get("config"), Mapping):
        return  # a malformed header is the file's fault, reported where it is read
    sampler = plane.buffer.sampler
    kind, config, was = type(sampler).__name__, sampler.config(), saved["config"]
    if kind != saved.get("kind"):
        raise ConfigError("sampler", f"a {kind} cannot take the saved state of a "
                                     f"{saved.get('kind')} with {dict(was)} (it would drop "
                                     f"or misread it: priorities, say); drop the override to "
                                     f"load the saved sampler")
    free = _STATE_FREE_CONFIG.get(kind, frozenset()) | {"seed"}
    differ = sorted(k for k in {**config, **was} if k not in free
                    and (k not in config or k not in was or config[k] != was[k]))
    if differ:
        raise ConfigError("sampler", f"the saved {kind} state was made with "
                                     f"{ {k: was.get(k) for k in differ} }, the override has "
                                     f"{ {k: config.get(k) for k in differ} }, under which it "
                                     f"would be misread; drop the override or pass a {kind} "
                                     f"with the saved values")


def _other_sampler(plane: ExperienceDataPlane, meta: Mapping[str, Any]) -> str | None:
    """The header's sampler (``"a <kind> with <config>"``) where ``plane``'s is of another
    kind or configuration, else None."""
    saved = meta.get("sampler")
    if not isinstance(saved, dict):
        return None  # a malformed header is the file's fault
    sampler = plane.buffer.sampler
    if type(sampler).__name__ == saved.get("kind") and sampler.config() == saved.get("config"):
        return None
    return f"a {saved.get('kind')} with {saved.get('config')}"


def _check_tiling(blocks: Any, capacity: int) -> None:
    """The saved row blocks cover slots ``[0, size)`` in order, as a save lays them out.

    Raises:
        StateError: They do not (the message names the first block that is off).
    """
    if not isinstance(blocks, list):
        raise StateError("rows", f"expected a list of row blocks, got {type(blocks).__name__}")
    at = 0
    for b, block in enumerate(blocks):
        start = block.get("start") if isinstance(block, dict) else None
        n = block.get("rows") if isinstance(block, dict) else None
        if (not isinstance(start, int) or not isinstance(n, int) or isinstance(start, bool)
                or isinstance(n, bool) or start != at or n < 0):
            raise StateError(f"rows.{b}", f"starts at {start!r} with {n!r} rows; saved "
                                          f"blocks tile the filled slots from 0 (it should "
                                          f"start at {at})")
        at += n
    if at > capacity:
        raise StateError("rows", f"{at} rows saved for a capacity of {capacity}")


@dataclass(frozen=True)
class SnapshotStats:
    """What a :class:`Snapshotter` did.

    Attributes:
        snapshots: Snapshots written.
        pause_s: Seconds the operators that change rows were held for each one.
        write_s: Seconds each background write took.
        failures: Snapshots that could not be written (the last error is kept).
    """

    snapshots: int
    pause_s: tuple[float, ...]
    write_s: tuple[float, ...]
    failures: int


COPY_DUTY = 0.25
"""Share of its time a snapshot's worker spends reading rows out of the buffer (see
:meth:`~conduit.storage.snapshot.RowSnapshot.stream_rows`)."""


def _lowest_priority() -> None:
    """Give the calling OS thread the lowest scheduling priority the OS allows: Linux's
    ``SCHED_IDLE`` (per thread), where a waking thread of normal priority always preempts it,
    else nice 19 (docs/design.md §8)."""
    tid = threading.get_native_id()
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, tid, 19)


def _normal_priority(tid: int) -> None:
    """Give the OS thread ``tid`` normal scheduling priority again, where the OS lets this
    process raise it (leaving ``SCHED_IDLE`` or nice 19 may need ``CAP_SYS_NICE`` or a
    ``RLIMIT_NICE``); otherwise it keeps its priority."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, tid, 0)


class _IdleWorker:
    """One plain daemon thread at the lowest OS priority (:func:`_lowest_priority`) that runs
    the calls submitted to it, in order, until :meth:`shutdown`.

    It belongs to its snapshotter alone: unlike a ``concurrent.futures`` executor, which the
    interpreter shuts down once the main thread returns, it runs for as long as its
    snapshotter is open, with training going on in other threads.
    """

    def __init__(self, name: str) -> None:
        self._jobs: collections.deque[tuple[Future[Any], Any, tuple[Any, ...]]] = \
            collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on the worker; its future holds the result or the error.

        Raises:
            RuntimeError: The worker was shut down.
        """
        future: Future[Any] = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the snapshot worker is shut down")
            self._jobs.append((future, fn, args))
            self._cv.notify()
        return future

    def _loop(self) -> None:
        _lowest_priority()
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            self._run_one(*job)
            del job  # keep nothing alive between calls

    @staticmethod
    def _run_one(future: Future[Any], fn: Any, args: tuple[Any, ...]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def raise_priority(self) -> None:
        """Let the worker run at normal priority from now on (where the OS allows it), so
        that load from other threads and processes no longer starves it."""
        tid = self._thread.native_id
        if tid is not None and self._thread.is_alive():
            _normal_priority(tid)

    def shutdown(self) -> None:
        """Stop the worker once the calls submitted so far have run; does not wait."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end; whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _drop_locals(exc: BaseException) -> None:
    """Clear the locals of the finished frames of ``exc``'s own traceback (the snapshot
    thread's calls into the plane), so that keeping the error keeps none of the objects they
    referred to; the lines stay. Its causes' frames (an operator's, say) are left as they
    are: the same objects may be reported elsewhere, where their locals help debugging."""
    traceback.clear_frames(exc.__traceback__)


class Snapshotter:
    """Periodic snapshots of a plane that hardly stall the learner.

    Every ``every_s`` seconds (and on :meth:`request`) a background thread ingests the units
    pushed so far, then reads the small sampler, writer and iteration state and starts a
    copy-on-write snapshot of the rows and slot ids, copying nothing: off-policy under the
    buffer's lock alone (no operator waits), on-policy with both operators held, since the
    iteration state must match the rows. A worker then copies the rows while training goes
    on (a write copies aside the old rows it overwrites before the worker reaches them;
    ``double_buffer`` chooses where the worker copies to), writes them into ``path`` and
    renames the file into place: a crash at any point leaves the previous snapshot intact.
    The file holds the plane exactly as it was at that instant. A snapshot that cannot be
    written (a missing folder, a full disk) warns with a ``RuntimeWarning``, is counted in
    :attr:`stats` and kept in ``last_error``, and the next one is tried on schedule;
    ``request(wait=True)`` raises it. Closing the plane closes its snapshotters.

    Both threads are the snapshotter's own: snapshots go on for as long as it is open, also
    once the main thread has returned while training goes on in other threads. The worker
    is a daemon thread: at interpreter exit a snapshot still being written is cut short (the
    previous file stays intact, and the next save to ``path`` removes the temporary file).

    A snapshotter holds its plane weakly (its thread too): a plane dropped without ``close()``
    is collected and closed by its finaliser, which tells its snapshotters to stop (a
    snapshot being written finishes). Their calls then raise ``PlaneClosedError``, except
    :meth:`close`, which still stops the snapshotter.

    Args:
        plane: The plane to snapshot.
        path: The checkpoint file (replaced by each snapshot).
        every_s: Seconds between snapshots (``math.inf``: only on :meth:`request`).
        double_buffer: First copy every row into a second buffer kept between snapshots,
            racing ahead of the writes, then write from it (default): memory for one more
            copy of the rows, and writes rarely copy anything. False streams from the live
            rows: extra memory only for the rows overwritten before the worker reaches them,
            each copied by the write that overwrites it (cheaper when writes are slower than
            the disk).

    Raises:
        ConfigError: ``path`` does not name a file (or names a folder, a device or a FIFO),
            ``every_s`` is not a number > 0, or ``double_buffer`` is not a bool.

    Example:
        >>> with Snapshotter(plane, "buffer.ckpt", every_s=60):
        ...     train(plane)
    """

    def __init__(self, plane: ExperienceDataPlane, path: str | Path, *, every_s: float,
                 double_buffer: bool = True) -> None:
        if isinstance(every_s, bool) or not isinstance(every_s, numbers.Real) or not every_s > 0:
            raise ConfigError("every_s", f"must be a number of seconds > 0 (math.inf: only on "
                                         f"request), got {every_s!r}")
        self._plane, self.path = weakref.ref(plane), check_path("path", path, file=True)
        bound = getattr(plane, "_snapshotters", None)  # plane.close() closes this one
        config = getattr(plane, "config", None)
        self._timeout = float(getattr(config, "timeout", _CLOSE_TIMEOUT))  # close()'s bound
        self.every_s = float(every_s)
        self.double_buffer = check_bool("double_buffer", double_buffer)
        self._wake = threading.Event()
        self._stop = False
        self._pause: list[float] = []
        self._spare: dict[tuple[int, str], torch.Tensor] = {}  # memory for rows set aside
        self._writes: list[float] = []
        self._failures = 0
        self.last_error: BaseException | None = None
        self._done = threading.Condition()
        self._started = 0  # snapshots begun
        self._count = 0  # snapshots attempted (finished or failed)
        self._ok = 0  # the number of the last one written
        self._rows: RowSnapshot | None = None  # the snapshot being read out (under _done)
        self._abandoning = False  # close() gave up waiting (under _done)
        self._abandoned = 0  # snapshots abandoned by close()
        self._closed = False
        # Reading out and writing run on a worker at the lowest OS priority, so they take only
        # the cores training leaves idle; the short hold runs on the normal-priority thread.
        self._io = _IdleWorker("conduit-snapshot-io")
        self._thread = threading.Thread(target=self._run, name="conduit-snapshot", daemon=True)
        self._thread.start()
        if bound is not None:
            bound.add(self)

    @property
    def plane(self) -> ExperienceDataPlane:
        """The plane this snapshotter takes snapshots of.

        Raises:
            PlaneClosedError: The plane was dropped (collected, and closed by its finaliser).
        """
        plane = self._plane()
        if plane is None:
            raise PlaneClosedError(f"the plane was dropped without close() and closed when "
                                   f"collected; no snapshot to {self.path} is taken")
        return plane

    def _plane_closed(self) -> bool:
        """Whether the plane is closed, or was dropped."""
        plane = self._plane()
        return plane is None or plane.closed

    def stop_soon(self) -> None:
        """Tell the snapshot thread to stop after the snapshot in progress, without waiting
        for it (the finaliser of a dropped plane calls it, from any thread)."""
        self._stop = True
        self._wake.set()

    def request(self, *, wait: bool = False, timeout: float = 60.0) -> None:
        """Take a snapshot now.

        Args:
            wait: Return once a snapshot begun after this call is on disk (so it holds every
                row pushed before the call; a snapshot already in progress does not count),
                or the snapshotter was closed.
            timeout: Seconds to wait.

        Raises:
            Exception: (``wait``) What taking or writing the snapshot raised (an ``OSError``
                where :meth:`ExperienceDataPlane.save` would have raised one), also kept in
                ``last_error``; the previous snapshot is intact.
            TimeoutError: (``wait``) The snapshot was not written within ``timeout``.
            ConfigError: (``wait``) Called from inside one of the plane's operators, which the
                snapshot would wait for.
            PlaneClosedError: The plane is closed, or was dropped (a closed plane takes no
                snapshot).
        """
        if self.plane.closed:
            raise PlaneClosedError(f"the plane is closed; no snapshot to {self.path} is taken")
        if wait:  # the snapshot holds the operators, this caller's invocation included
            self.plane._engine.refuse_inside_operator("request")
        with self._done:
            target = self._started + 1  # the first snapshot to begin from now on
        self._wake.set()
        if wait:
            with self._done:
                if not self._done.wait_for(lambda: self._count >= target or self._stop,
                                           timeout):
                    raise TimeoutError(f"snapshot to {self.path} not written within "
                                       f"{timeout} s")
                if self._count < target and self._plane_closed():
                    raise PlaneClosedError(f"the plane closed before the snapshot to "
                                           f"{self.path} was taken")
                if self._ok < target <= self._count and self.last_error is not None:
                    raise raised_again(self.last_error)

    @property
    def stats(self) -> SnapshotStats:
        """Counts and timings so far."""
        return SnapshotStats(len(self._writes), tuple(self._pause), tuple(self._writes),
                             self._failures)

    def _mark(self) -> tuple[ExperienceBuffer, RowSnapshot, dict[str, JSON],
                             dict[str, torch.Tensor]]:
        """Read the small state and start a copy-on-write snapshot of the rows and ids (the
        pause): on-policy with the operators held, off-policy under the buffer's lock alone."""
        plane = self.plane
        if plane.failed is None:
            plane.flush()
        t0 = time.perf_counter()
        with plane.frozen(rows=False, flush=False, reads=True, buffer=False) as state:
            buffer = plane.buffer
            rows = buffer.begin_snapshot(spare=self._spare)
        self._pause.append(time.perf_counter() - t0)
        try:
            meta, parts = _layout(plane, buffer, {"buffer": rows.state, **state},
                                  rows.blocks)
        except BaseException:
            buffer.drop_snapshot(rows)  # or every later write would copy into it
            raise
        return buffer, rows, meta, parts

    def _write(self, buffer: ExperienceBuffer, rows: RowSnapshot, meta: dict[str, JSON],
               parts: dict[str, torch.Tensor]) -> float:
        """Stream the snapshot into the file while training goes on (on the low-priority
        worker); returns the write's seconds.

        Raises:
            SnapshotAbandonedError: :meth:`close` gave up waiting for it (the temporary file is
                removed).
        """
        sources: dict[str, SnapshotSource] = {
            f"state/buffer/{name}": (lambda name=name: rows.stream_ids(name))
            for name in ("row_id", "delivered_id")}
        for b, (_, cols) in enumerate(rows.blocks):
            for f in cols:
                sources[f"rows/{b}/{f}"] = (lambda b=b, f=f: rows.stream_rows(
                    b, f, duty=1.0 if self.double_buffer else COPY_DUTY))
        with self._done:
            self._rows = rows
            if self._abandoning:
                rows.abandon()
        try:
            if self.double_buffer:
                rows.copy_ahead(duty=COPY_DUTY)
            return write_checkpoint(self.path, tensors=parts, meta=meta, sources=sources).seconds
        finally:
            with self._done:
                self._rows = None
            buffer.drop_snapshot(rows)
            # kept for the next snapshot; a closed snapshotter takes none
            self._spare = {} if self._stop else rows.kept

    def _run(self) -> None:
        # Holds the plane only inside ``_mark`` (a weak reference between snapshots), so a
        # plane its user dropped is collected, and closed by its finaliser.
        try:
            while not self._stop:
                self._wake.wait(None if self.every_s == float("inf") else self.every_s)
                self._wake.clear()
                if self._stop or self._plane_closed():
                    break
                ok = abandoned = False
                with self._done:
                    self._started += 1
                try:
                    marked = self._mark()
                    self._writes.append(self._io.submit(self._write, *marked).result())
                    ok = True
                except SnapshotAbandonedError:
                    abandoned = True  # close() gave up on it, and says so
                except Exception as exc:
                    if isinstance(exc, PlaneClosedError) and self._plane_closed():
                        break  # closed or dropped meanwhile: no snapshot, as above
                    _drop_locals(exc)  # its frames would keep the plane alive
                    self._failures += 1
                    self.last_error = exc
                    warnings.warn(f"snapshot {self._count + 1} to {self.path} failed "
                                  f"({type(exc).__name__}: {exc}); the previous snapshot is "
                                  f"intact (failures so far: {self._failures})",
                                  RuntimeWarning, stacklevel=1)
                with self._done:
                    self._count += 1
                    if ok:
                        self._ok = self._count
                    if abandoned:
                        self._abandoned += 1
                    self._done.notify_all()
        finally:
            with self._done:  # a closed plane takes no snapshot: waiting requests end
                self._stop = True
                self._done.notify_all()
            self._spare = {}
            self._io.shutdown()  # its thread ends after the call it runs, if any

    def close(self, timeout: float | None = None) -> None:
        """Stop taking snapshots, waiting up to ``timeout`` seconds for a snapshot being
        written to finish. Idempotent.

        While close waits, the snapshot's worker runs at normal priority where the OS lets
        the process raise it (so that load on the machine does not hold close back). A
        snapshot not written by the deadline is abandoned: it stops before its next chunk,
        its temporary file is removed, the previous snapshot at :attr:`path` stays as it was,
        and close warns with a ``RuntimeWarning`` and returns (a worker still inside a chunk,
        or inside a write that does not return, ends on its own; it is a daemon thread). The
        memory kept for the next snapshot (``double_buffer``'s copy of the rows) is freed.

        Args:
            timeout: Seconds to wait; None: the plane's ``timeout`` (as
                :meth:`ExperienceDataPlane.close` waits).

        Raises:
            ConfigError: Called from inside one of the plane's operators, which a snapshot in
                progress may wait for, or ``timeout`` is not a number >= 0 (nothing changes).
        """
        plane = self._plane()
        if plane is not None:
            plane._engine.refuse_inside_operator("close")
        del plane
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, numbers.Real)
                                    or not timeout >= 0):
            raise ConfigError("timeout", f"must be a number of seconds >= 0, got {timeout!r}")
        wait = self._timeout if timeout is None else float(timeout)
        first, self._closed = not self._closed, True
        deadline = time.monotonic() + wait
        self._stop = True
        self._wake.set()
        self._io.raise_priority()  # training no longer comes first: the write should end
        grace = min(1.0, wait / 10)  # for an abandoned write to stop and remove its file
        self._thread.join(max(0.0, deadline - grace - time.monotonic()))
        if self._thread.is_alive():
            with self._done:
                self._abandoning = True
                if self._rows is not None:
                    self._rows.abandon()
            self._thread.join(max(0.0, deadline - time.monotonic()))
        stuck = self._thread.is_alive()
        self._io.shutdown()
        if not stuck:
            self._io.join(max(0.0, deadline - time.monotonic()))
        self._spare = {}
        with self._done:
            self._done.notify_all()
            abandoned, self._abandoned = self._abandoned, 0
        if first and (stuck or abandoned):
            warnings.warn(f"the snapshot to {self.path} being written was not finished within "
                          f"{wait:g} s of close() and is abandoned"
                          + (" (its worker stops before its next chunk and removes the "
                             "temporary file)" if stuck else "")
                          + f"; the previous snapshot at {self.path} is intact",
                          RuntimeWarning, stacklevel=2)

    def __enter__(self) -> Snapshotter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_CLOSE_TIMEOUT = 60.0
"""Seconds :meth:`Snapshotter.close` waits by default for a plane without a ``timeout``."""


__all__ = ["FORMAT", "VERSION", "SnapshotStats", "Snapshotter", "load", "save"]
