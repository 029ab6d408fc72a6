"""A column store whose columns are files: rows can outgrow RAM and outlive the process.

A store folder holds one file per field, ``<field>.bin`` (``capacity`` rows of the field's
elements, C order, in the host's byte order), and ``manifest.json``::

    {"format": "conduit-memmap-store", "version": 1, "byte_order": "little",
     "spec": ExperienceSpec.to_dict(), "capacity": int, "meta": {...}}

The files are mapped shared into memory, so the page cache holds the rows: writes reach the
file without a copy, and reads of cold rows fault pages in from disk. ``meta`` is strict
JSON owned by whoever owns the cursor (for example a buffer's writer state); it describes
the rows as of the last :meth:`MemmapColumnStore.flush`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from conduit.errors import CapacityError, ConfigError, PlacementError, SpecError
from conduit.spec import ExperienceSpec
from conduit.storage.checkpoint import CheckpointError, atomic_write, check_path
from conduit.storage.column_store import ColumnStore, _check_capacity, _check_state
from conduit.storage.layout import Placement

MANIFEST = "manifest.json"
"""Name of the manifest file in a store folder."""

_FORMAT = "conduit-memmap-store"
_VERSION = 1

#: Errors of a column file that does not fit: larger than a file there may be, than the disk
#: holds, or than this process can map.
_TOO_LARGE = (errno.EFBIG, errno.ENOSPC, errno.EOVERFLOW, errno.ENOMEM, errno.EINVAL)


class MemmapColumnStore(ColumnStore):
    """A :class:`ColumnStore` whose columns are memory-mapped files in ``directory``.

    Opening a folder that holds a manifest reopens its rows; otherwise the folder is
    created and the columns are sparse zero-filled files, so disk blocks are only taken as
    rows are written. Reads and writes are :class:`ColumnStore`'s own methods; the
    placement is pageable host memory.

    Rows written since the last :meth:`flush` are visible to other processes that map the
    same files and survive the process exiting, but not necessarily an operating-system
    crash. The files stay mapped until the store and every tensor taken from
    :meth:`column` are freed.

    Args:
        directory: The store folder (created if missing).
        spec: Fields to store; must match the manifest when reopening.
        capacity: Rows; must match the manifest when reopening.

    Raises:
        ConfigError: ``capacity`` is not a positive integer, or ``directory`` is not a
            non-empty ``str`` or :class:`os.PathLike`, names an existing file or a path
            under one, holds a ``manifest.json`` that is not a file, or cannot be created.
        SpecError: Reopening with a spec whose fields differ from the manifest's (the
            message names the field).
        CapacityError: Reopening with another capacity; or creating columns larger than a file
            of that folder may be, than its disk holds or than this process can map (the
            message names ``capacity``; the files and folders the call made are removed).
        CheckpointError: The manifest is not valid or was written on a host of the other
            byte order, or a column file is missing or has the wrong size (``part`` names
            the field).
    """

    def __init__(self, *, directory: str | os.PathLike[str], spec: ExperienceSpec,
                 capacity: int) -> None:
        self.spec = spec
        self.capacity = _check_capacity(capacity)
        self.placement = Placement.pageable()
        self.device = torch.device("cpu")
        self.pinned = False
        self.directory = check_path("directory", directory)
        self.meta: dict[str, Any] = {}
        manifest = self.directory / MANIFEST
        if manifest.exists() and not manifest.is_file():
            raise ConfigError("directory", f"{manifest} exists but is not a file; pass a store "
                                           f"folder or a new one")
        if manifest.exists():
            self.meta = self._check_manifest(manifest)
            self._maps, self._cols = self._map_columns(create=False)
        else:
            folders = []  # the folders this call makes, deepest first
            for folder in (self.directory, *self.directory.parents):
                if os.path.lexists(folder):
                    break
                folders.append(folder)
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError) as exc:
                raise ConfigError("directory", f"{self.directory} is, or lies under, a file "
                                               f"that is not a folder; pass a folder "
                                               f"({exc.strerror})") from None
            except OSError as exc:
                raise ConfigError("directory", f"cannot create {self.directory}: "
                                               f"{exc.strerror or exc}") from None
            files: list[Path] = []  # the column files this call makes
            try:
                self._maps, self._cols = self._map_columns(create=True, made=files)
                self._write_manifest()
            except BaseException:
                self._maps, self._cols = {}, {}
                for path in files:
                    with contextlib.suppress(OSError):
                        path.unlink()
                for folder in folders:
                    with contextlib.suppress(OSError):
                        folder.rmdir()  # (only while empty)
                raise
        self._make_views()

    def _moved(self, name: str) -> None:
        """Refuse a column moved off its file (see :meth:`ColumnStore._views`).

        Raises:
            PlacementError: Always (``share_memory_()``, as :mod:`torch.multiprocessing`
                does to a tensor it sends, moved it): its rows would no longer reach the file.
        """
        raise PlacementError(f"columns.{name}: the column was moved off its file "
                             f"(share_memory_(), as torch.multiprocessing does to a tensor "
                             f"it sends); send a copy of the rows instead "
                             f"(store.column(name).clone())")

    def column_path(self, name: str) -> Path:
        """The file that holds field ``name``."""
        return self.directory / f"{name}.bin"

    def flush(self, meta: Mapping[str, Any] | None = None) -> None:
        """Write changed rows to disk, then the manifest (with ``meta`` when given).

        The data is synced before the manifest is replaced, so a manifest on disk never
        describes rows that are not.

        Args:
            meta: Strict-JSON state to keep with the rows, for example the writer's cursor;
                ``None`` keeps the current :attr:`meta`.

        Raises:
            ConfigError: ``meta`` is not strict JSON (nothing is written).
        """
        if meta is not None:
            meta = _json_roundtrip(meta)
        for region in self._maps.values():
            region.flush()
        if meta is not None:
            self.meta = meta
        self._write_manifest()

    def _map_columns(self, *, create: bool, made: list[Path] | None = None
                     ) -> tuple[dict[str, mmap.mmap], dict[str, torch.Tensor]]:
        """Map every column's file (``create``: made first, sparse, its path added to
        ``made`` where it did not exist).

        Raises:
            CapacityError: ``create`` and a column does not fit (see the class).
            CheckpointError: Not ``create``, and a column file is missing or of another size.
        """
        maps, cols = {}, {}
        for name, fs in self.spec.fields.items():
            shape = (self.capacity, *fs.shape)
            nbytes = self.capacity * fs.nbytes
            path = self.column_path(name)
            if create:
                if made is not None and not os.path.lexists(path):
                    made.append(path)
                try:
                    with open(path, "wb") as f:
                        f.truncate(nbytes)
                    if nbytes:
                        with open(path, "r+b") as f:
                            maps[name] = mmap.mmap(f.fileno(), nbytes)
                except (OSError, OverflowError) as exc:
                    if isinstance(exc, OSError) and exc.errno not in _TOO_LARGE:
                        raise
                    reason = exc.strerror if isinstance(exc, OSError) else str(exc)
                    raise CapacityError(f"capacity: {self.capacity:,} rows of field {name!r} "
                                        f"take {nbytes:,} bytes, which {self.directory} "
                                        f"cannot hold or this process cannot map ({reason}); "
                                        f"reduce capacity or the field's size",
                                        needed=nbytes) from None
            elif not path.exists():
                raise CheckpointError(path, "column file is missing", part=name)
            elif path.stat().st_size != nbytes:
                raise CheckpointError(path, f"column file has {path.stat().st_size} bytes, "
                                            f"the manifest needs {nbytes}", part=name)
            if nbytes == 0:  # mmap refuses empty files
                cols[name] = torch.empty(shape, dtype=fs.dtype)
                continue
            if name not in maps:
                with open(path, "r+b") as f:
                    maps[name] = mmap.mmap(f.fileno(), nbytes)
            cols[name] = torch.frombuffer(maps[name], dtype=fs.dtype,
                                          count=nbytes // fs.dtype.itemsize).view(shape)
        return maps, cols

    def _check_manifest(self, path: Path) -> dict[str, Any]:
        try:
            manifest = json.loads(path.read_bytes())
            found = (manifest["format"], manifest["version"], manifest["byte_order"])
            if found != (_FORMAT, _VERSION, sys.byteorder):
                raise ValueError(f"format, version and byte order are {found}, expected "
                                 f"{(_FORMAT, _VERSION, sys.byteorder)}")
            saved = {"spec": manifest["spec"], "capacity": manifest["capacity"]}
            if isinstance(saved["capacity"], bool) or not isinstance(saved["capacity"], int):
                raise TypeError(f"capacity {saved['capacity']!r} is not an integer")
            ExperienceSpec.from_dict(saved["spec"])  # parses, so _check_state only compares
            meta = dict(manifest["meta"])
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
            raise CheckpointError(path, f"not a memory-mapped store manifest: {exc!r}") from exc
        _check_state(self.spec, self.capacity, saved)
        extra = [n for n in saved["spec"] if n not in self.spec.fields]
        if extra:
            raise SpecError(extra[0], f"is stored in {self.directory} but not in the spec")
        return meta

    def _write_manifest(self) -> None:
        manifest = {"format": _FORMAT, "version": _VERSION, "byte_order": sys.byteorder,
                    "spec": self.spec.to_dict(), "capacity": self.capacity, "meta": self.meta}
        with atomic_write(self.directory / MANIFEST) as f:
            f.write(json.dumps(manifest, indent=1, allow_nan=False).encode())


def _json_roundtrip(meta: Mapping[str, Any]) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(dict(meta), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ConfigError("meta", f"must be strict JSON (no NaN, infinity or objects): "
                                  f"{exc}") from exc
