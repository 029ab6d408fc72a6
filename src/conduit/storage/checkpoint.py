"""Checkpoint files: named tensors and JSON metadata in one versioned, checksummed file.

No pickle is involved in writing or reading, so loading a checkpoint never runs code from
the file. Layout, version 1 (all integers little-endian)::

    offset  size  content
    0       8     magic b"\\x89CONDUIT"
    8       4     uint32 format version (1)
    12      4     uint32 header length H
    16      4     uint32 CRC-32 of bytes [0, 16) followed by the header
    20      H     header: UTF-8 strict JSON (see below)
    ...           zero padding to the first part's offset
    offset        part bytes: the tensor's elements, C order, little-endian, then zero
                  padding to the next part's offset; the file ends where the last part
                  ends (with no parts, at the first multiple of the alignment after the
                  header)

The header is ``{"alignment": 4096, "checksum": "crc32", "file_bytes": int, "meta": {...},
"parts": [{"name", "dtype", "shape", "offset", "nbytes", "crc32"}, ...]}``: ``dtype`` is the
torch name without ``torch.`` (``"bfloat16"``), ``offset`` a multiple of ``alignment`` (so a
part can be memory-mapped), ``nbytes`` equals the shape's element count times the element
size, and ``crc32`` is the part's CRC-32 as 8 lowercase hex digits. Every byte of a file is
checked on read: the preamble and header by the header checksum, padding must be zero, and
each part by its own checksum.

Writes are atomic: the file is written under a temporary name
(``.<name>.<host>-<pid>.<random>.tmp``: ``<host>`` tags the machine and process-id namespace,
``<pid>`` the writing process) in the target's folder, synced, renamed onto the target, and
the folder is synced. The preamble is written last, so an interrupted temporary file never
carries the magic bytes. A write removes the temporary files of the same target that a killed
writer left: those its own host tag names, of a process that no longer runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap as _mmap
import os
import re
import secrets
import socket
import stat
import struct
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from conduit.errors import ConduitError, ConfigError

try:  # ISA-L's CRC-32 (the same polynomial and values as zlib's), several times faster
    from isal.isal_zlib import crc32
except ImportError:  # no wheel for this platform
    from zlib import crc32

MAGIC = b"\x89CONDUIT"
"""First 8 bytes of every checkpoint file."""

FORMAT_VERSION = 1
"""The layout version this module writes and reads."""

ALIGNMENT = 4096
"""Byte alignment of every part's offset (a page, so parts can be memory-mapped)."""

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32,
    torch.float64, torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu)
"""Element types a part may have (sub-byte, quantized and complex32 types are refused)."""

_DTYPES = {str(d).removeprefix("torch."): d for d in SUPPORTED_DTYPES}
_PREAMBLE = struct.Struct("<8sIII")
_INT64_MAX = 2**63 - 1
_CHUNK = 8 << 20  # bytes hashed and written per step: bounds the extra memory of a save


class CheckpointError(ConduitError):
    """A persisted file (a checkpoint, or a memory-mapped store's manifest or column) is
    truncated, corrupted, or of an unknown version.

    A missing checkpoint raises :class:`FileNotFoundError` instead, as ``open`` does.

    Attributes:
        path: The file at fault.
        part: The name of the corrupted part, or ``None`` when the file as a whole (its size,
            preamble, header or padding) is at fault.
    """

    def __init__(self, path: str | os.PathLike[str], message: str, *,
                 part: str | None = None) -> None:
        self.path = Path(path)
        self.part = part
        where = f" (part {part!r})" if part is not None else ""
        super().__init__(f"{self.path}{where}: {message}")


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`write_checkpoint` wrote.

    Attributes:
        path: The checkpoint file.
        nbytes: Size of the file in bytes.
        parts: Names of the tensors, in file order.
        seconds: Wall time of the whole write, syncs included.
    """

    path: Path
    nbytes: int
    parts: tuple[str, ...]
    seconds: float


@dataclass(frozen=True)
class _Part:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int

    def entry(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": str(self.dtype).removeprefix("torch."),
                "shape": list(self.shape), "offset": self.offset, "nbytes": self.nbytes,
                "crc32": f"{self.crc32:08x}"}


def write_checkpoint(path: str | os.PathLike[str], *, tensors: Mapping[str, torch.Tensor],
                     meta: Mapping[str, Any],
                     sources: Mapping[str, Callable[[], Iterable[torch.Tensor | np.ndarray]]]
                     | None = None) -> CheckpointInfo:
    """Write ``tensors`` and ``meta`` to ``path`` atomically.

    Each tensor is streamed from its own memory in chunks of 8 MiB (CPU tensors are not
    copied; other devices are copied to the host a chunk at a time), so a save needs at most
    one chunk beyond the tensors themselves. Until the final rename, a file already at
    ``path`` is left untouched; if the write fails, the temporary file is removed.

    Args:
        path: Target file (a ``str`` or :class:`os.PathLike`); its folder must exist.
        tensors: Part name -> dense tensor of a :data:`SUPPORTED_DTYPES` dtype, on any device
            that holds data (a conjugate or negative view is written as the values it shows).
            They must not change until the call returns (hold the lock that guards them, or
            pass a snapshot): a byte changed mid-write fails the part's checksum when the
            file is read.
        meta: Strict-JSON data (no NaN or infinity) stored in the header.
        sources: Part name -> a callable making that part's bytes as consecutive chunks
            (CPU tensors or numpy arrays, C order), used instead of reading ``tensors[name]``,
            which then gives only the part's dtype and shape (a copy-on-write snapshot reads
            its rows out this way, see :class:`~conduit.storage.snapshot.RowSnapshot`).

    Returns:
        What was written.

    Raises:
        ConfigError: ``path`` is not a non-empty ``str`` or :class:`os.PathLike`, names a
            folder or something else that is not a regular file, ``meta`` is not strict
            JSON, or a tensor is not dense, holds no data or has an unsupported dtype, or a
            source names no part (nothing is written).
        CheckpointError: A source made more or fewer bytes than its part holds (the
            temporary file is removed).
        OSError: The file system refused the write (the temporary file is removed).
    """
    t0 = time.perf_counter()
    path = check_path("path", path, file=True)
    _require_little_endian(path)
    _check_tensors(tensors)
    sources = dict(sources or {})
    if not set(sources) <= set(tensors):
        raise ConfigError("sources", f"names parts that are not in tensors: "
                                     f"{sorted(set(sources) - set(tensors))}")
    parts, file_bytes = _layout(meta, tensors)
    header = _header(meta, parts, file_bytes)
    with atomic_write(path) as f:
        done = []
        for p in parts:
            f.seek(p.offset)
            crc = written = 0
            chunks = (map(_bytes_of_chunk, sources[p.name]()) if p.name in sources
                      else _byte_chunks(tensors[p.name]))
            for chunk in chunks:
                crc = crc32(chunk, crc)
                f.write(chunk)
                written += chunk.nbytes
            if written != p.nbytes:
                raise CheckpointError(path, f"its source made {written} bytes, the part holds "
                                            f"{p.nbytes}", part=p.name)
            done.append(_Part(p.name, p.dtype, p.shape, p.offset, p.nbytes, crc))
        f.truncate(file_bytes)
        final = _header(meta, done, file_bytes)
        assert len(final) == len(header), "checksums are fixed-width, so the header size is"
        f.seek(0)
        f.write(_preamble(final) + final)
    return CheckpointInfo(path=path, nbytes=file_bytes, parts=tuple(p.name for p in parts),
                          seconds=time.perf_counter() - t0)


Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]
"""Part name -> ``(dtype, shape)``, in file order."""

Destinations = Callable[[dict[str, Any], Layout], Mapping[str, torch.Tensor]]
"""Given a checkpoint's metadata and layout, the tensors some of its parts are read into."""


def read_checkpoint(path: str | os.PathLike[str], *, mmap: bool = False, verify: bool = True,
                    into: Destinations | None = None
                    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a file written by :func:`write_checkpoint`.

    Args:
        path: The checkpoint file.
        mmap: Map the parts copy-on-write instead of reading them: tensors are backed by
            the file's pages, loaded on first touch, and writes to them stay private to this
            process. The mapping keeps the file's data alive even if ``path`` is later
            replaced by a new checkpoint.
        verify: Check every part's checksum (with ``mmap=True`` this reads every page once).
            The header and padding are always checked.
        into: Called once with the header's metadata and layout (part name -> dtype and
            shape), before any part is read; returns tensors (CPU, contiguous, of the part's
            dtype and shape) that the parts of those names are read straight into, in large
            sequential reads, instead of into new memory or a mapping. The returned dict
            holds those same tensors. A part that fails its checksum may have been written
            into its tensor already.

    Returns:
        ``(meta, tensors)``: the header's metadata and part name -> CPU tensor, in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: The file is truncated or extended, has a bad magic number, an
            unknown version, a header that fails its checksum or does not describe a valid
            layout, non-zero padding, or a part whose bytes fail their checksum.
        ConfigError: ``path`` is not a non-empty ``str`` or :class:`os.PathLike`, or a tensor
            from ``into`` names no part, or does not fit its part (named).
    """
    path = check_path("path", path)
    _require_little_endian(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        meta, parts, header_end = _read_header(f, path, size)
        layout = {p.name: (p.dtype, p.shape) for p in parts}
        dest = dict(into(meta, layout)) if into is not None else {}
        _check_destinations(parts, dest)
        if mmap:
            tensors = _map_parts(f, path, parts, header_end, size, verify, skip=set(dest))
            for p in parts:
                if p.name in dest:  # read, not mapped
                    f.seek(p.offset)
                    tensors[p.name] = _read_into(f, path, p, dest[p.name], verify)
            tensors = {p.name: tensors[p.name] for p in parts}  # file order
        else:
            tensors = _read_parts(f, path, parts, header_end, size, verify, dest)
    return meta, tensors


def _check_destinations(parts: list[_Part], dest: Mapping[str, torch.Tensor]) -> None:
    """Raise ConfigError for a destination that names no part or does not fit it."""
    by_name = {p.name: p for p in parts}
    for name, t in dest.items():
        p = by_name.get(name)
        if p is None:
            raise ConfigError("into", f"{name!r} is not a part of this checkpoint")
        if (t.device.type != "cpu" or t.dtype != p.dtype or tuple(t.shape) != p.shape
                or not t.is_contiguous()):
            raise ConfigError("into", f"{name!r}: a {t.dtype} {tuple(t.shape)} tensor on "
                                      f"{t.device}; the part is a contiguous CPU {p.dtype} "
                                      f"{p.shape}")


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """Open a temporary file that replaces ``path`` only once it is complete and synced.

    On normal exit the file is flushed, ``fsync``-ed, renamed onto ``path`` and the folder is
    synced; on an exception it is removed and ``path`` is left as it was. The file ``path``
    holds already keeps its bytes on disk but leaves the page cache first (where the OS can
    say so), so that its memory serves the new file.

    The temporary file's name holds the writing process's id and a tag of its host and
    process-id namespace. Before it is created, the temporary files of ``path`` that a killed
    writer left behind are removed: those whose tag is this process's and whose process no
    longer runs (POSIX only). A temporary file of a live process, of another host or
    namespace (a shared folder), or named otherwise is never touched.

    Yields:
        The temporary file, open for binary writing (seekable).

    Raises:
        ConfigError: ``path`` is not a non-empty ``str`` or :class:`os.PathLike`, or names a
            folder (nothing is written).
    """
    path = check_path("path", path, file=True)
    _drop_cached(path)
    _remove_abandoned(path)
    tmp = path.with_name(f".{_short(path.name)}.{_host_tag()}-{os.getpid()}."
                         f"{secrets.token_hex(6)}.tmp")
    # O_EXCL: never share a temporary file; mode 0o666 less the umask, as open() gives.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _sync_folder(path.parent)


_NAME_BYTES = 255 - len(".." + "0" * 12 + "-" + "0" * 10 + "." + "0" * 12 + ".tmp")
"""Bytes of a file's name kept in its temporary name (most file systems allow 255)."""

_HOST_TAG: list[str] = []


def _host_tag() -> str:
    """12 hex digits naming this machine's boot and this process's process-id namespace
    (the host name where ``/proc`` does not say): a process id in a temporary file's name
    means a process of this tag only."""
    if not _HOST_TAG:
        parts = []
        for source in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
            with contextlib.suppress(OSError):
                parts.append(os.readlink(source) if source.endswith("/pid")
                             else Path(source).read_text().strip())
        parts.append(socket.gethostname())
        _HOST_TAG.append(hashlib.blake2s("\n".join(parts).encode(), digest_size=6).hexdigest())
    return _HOST_TAG[0]


def _process_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs (a zombie, or one of another user, still runs)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: it runs, as another user
        return False
    return False


def _remove_abandoned(path: Path) -> None:
    """Remove the temporary files of ``path`` that a killed writer of this host left (see
    :func:`atomic_write`); others, and any that cannot be read or removed, stay."""
    if os.name != "posix":  # os.kill(pid, 0) is no probe elsewhere
        return
    pattern = re.compile(re.escape(f".{_short(path.name)}.{_host_tag()}-") +
                         r"([0-9]{1,10})\.[0-9a-f]{12}\.tmp")
    me = os.getpid()
    try:
        names = [e.name for e in os.scandir(path.parent or ".")
                 if e.name.endswith(".tmp") and e.is_file(follow_symlinks=False)]
    except OSError:  # an unreadable folder: the write itself reports it
        return
    for name in names:
        match = pattern.fullmatch(name)
        if match is None or int(match.group(1)) in (0, me):
            continue
        if _process_gone(int(match.group(1))):
            with contextlib.suppress(OSError):
                os.unlink(path.with_name(name))


def _short(name: str) -> str:
    """``name``, cut to :data:`_NAME_BYTES` bytes (UTF-8) where it is longer, so that the
    temporary name of a name near the file system's limit is not too long."""
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) <= _NAME_BYTES:
        return name
    return raw[:_NAME_BYTES].decode("utf-8", "ignore")


def check_path(field: str, value: Any, *, file: bool = False) -> Path:
    """``value``, a ``str`` or :class:`os.PathLike`, as a :class:`~pathlib.Path`.

    Args:
        field: Name the error gives (``"path"``, ``"directory"``).
        value: The path argument.
        file: The path is a file to write, so it must name one (``"."`` and ``"/"`` do not),
            and what exists there already must be a regular file (the write replaces it).

    Raises:
        ConfigError: ``value`` is not a ``str`` or an :class:`os.PathLike` of one, is empty or
            holds a NUL character, or (with ``file``) names no file or names something that
            exists and is not a regular file (a folder, a device, a FIFO, a socket).
    """
    try:
        text = os.fspath(value)
    except TypeError:
        text = None
    if not isinstance(text, str) or not text or "\0" in text:
        raise ConfigError(field, f"must be a path (a non-empty str or os.PathLike), got "
                                 f"{value!r}")
    path = Path(text)
    if file and not path.name:
        raise ConfigError(field, f"{value!r} names a folder, not a file to write")
    if file:
        try:
            mode = os.stat(path).st_mode
        except (OSError, ValueError):
            mode = None  # nothing there yet (or not reachable: the write reports it)
        if mode is not None and not stat.S_ISREG(mode):
            kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
            raise ConfigError(field, f"{value!r} exists and is {kind}; a checkpoint replaces "
                                     f"only a regular file: pass a file path (for a folder, "
                                     f"a name inside it)")
    return path


def _drop_cached(path: Path) -> None:
    """Drop the clean cached pages of an existing ``path`` (``posix_fadvise(DONTNEED)``),
    a file about to be replaced, so that their memory serves its successor
    (``docs/design.md §8``). Its bytes on disk are untouched; dirty or mapped pages stay.
    Does nothing where the OS has no ``posix_fadvise`` or the file does not exist."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no file yet (or unreadable): nothing to drop
        return
    try:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # platforms that cannot open a folder (Windows) do not need this
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _require_little_endian(path: Path) -> None:
    if sys.byteorder != "little":
        raise CheckpointError(path, "checkpoints are little-endian; this host is big-endian")


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _check_tensors(tensors: Mapping[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise ConfigError("tensors", f"part names must be strings, got {name!r}")
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise ConfigError(f"tensors[{name!r}]", f"expected a dense tensor, got "
                                                    f"{type(t).__name__}")
        if t.device.type == "meta":
            raise ConfigError(f"tensors[{name!r}]", "is on the 'meta' device, which holds "
                                                    "no data")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"tensors[{name!r}]", f"dtype {t.dtype} cannot be stored; "
                                                    f"supported: {sorted(_DTYPES)}")


def _layout(meta: Mapping[str, Any],
            tensors: Mapping[str, torch.Tensor]) -> tuple[list[_Part], int]:
    """Parts at their offsets (checksums 0) and the file size.

    The header holds the offsets and sits before them, so its length and the offsets
    depend on each other: place the parts, measure the header, and move the parts past it
    until it fits (the header only grows by a few digits, so this settles in two rounds).
    """
    start = 0
    while True:
        parts, pos = [], start
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            parts.append(_Part(name, t.dtype, tuple(t.shape), pos, nbytes, 0))
            pos = _align(pos + nbytes)
        file_bytes = parts[-1].offset + parts[-1].nbytes if parts else start
        header_end = _PREAMBLE.size + len(_header(meta, parts, file_bytes))
        if header_end <= start:
            return parts, file_bytes
        start = _align(header_end)


def _header(meta: Mapping[str, Any], parts: list[_Part], file_bytes: int) -> bytes:
    try:
        return json.dumps({"alignment": ALIGNMENT, "checksum": "crc32",
                           "file_bytes": file_bytes, "meta": dict(meta),
                           "parts": [p.entry() for p in parts]},
                          allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise ConfigError("meta", f"must be strict JSON (no NaN, infinity or objects): "
                                  f"{exc}") from exc


def _preamble(header: bytes) -> bytes:
    head = struct.pack("<8sII", MAGIC, FORMAT_VERSION, len(header))
    return head + struct.pack("<I", crc32(header, crc32(head)))


def _byte_chunks(t: torch.Tensor) -> Iterator[memoryview]:
    """The bytes of ``t`` in C order, a chunk of about :data:`_CHUNK` bytes at a time (a
    conjugate or negative view is resolved a chunk at a time)."""
    t = t.detach()
    if t.is_contiguous():
        flat = t.reshape(-1)
        step = max(1, _CHUNK // t.element_size())
        for i in range(0, flat.numel(), step):
            yield _bytes_of(_resolved(flat[i:i + step].cpu()))
    else:
        step = max(1, _CHUNK // max(1, t[0].numel() * t.element_size()))
        for i in range(0, t.shape[0], step):
            yield _bytes_of(_resolved(t[i:i + step].cpu()).contiguous())


def _bytes_of_chunk(chunk: torch.Tensor | np.ndarray) -> memoryview:
    if isinstance(chunk, np.ndarray):
        return memoryview(np.ascontiguousarray(chunk)).cast("B")
    return _bytes_of(_resolved(chunk.detach().cpu()).contiguous())


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its conjugate and negative bits applied (a copy only where one is set):
    the bytes of such a view are not the values it shows."""
    return t.resolve_conj().resolve_neg()


def _bytes_of(t: torch.Tensor) -> memoryview:
    # Through a uint8 view, since numpy has no bfloat16 or float8.
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _read_header(f: IO[bytes], path: Path,
                 size: int) -> tuple[dict[str, Any], list[_Part], int]:
    """Check the preamble and header; returns ``(meta, parts, end of the header)``."""
    if size < _PREAMBLE.size:
        raise CheckpointError(path, f"truncated: {size} bytes, shorter than the "
                                    f"{_PREAMBLE.size}-byte preamble")
    head = f.read(_PREAMBLE.size)
    magic, version, length, crc = _PREAMBLE.unpack(head)
    if magic != MAGIC:
        raise CheckpointError(path, f"bad magic bytes {magic!r}: not a Conduit checkpoint "
                                    f"(or an unfinished temporary file)")
    if version != FORMAT_VERSION:
        raise CheckpointError(path, f"format version {version} is unknown; this reader "
                                    f"reads version {FORMAT_VERSION}")
    header_end = _PREAMBLE.size + length
    if header_end > size:
        raise CheckpointError(path, f"truncated: {size} bytes, but the header alone ends at "
                                    f"byte {header_end}")
    raw = f.read(length)
    if crc32(raw, crc32(head[:16])) != crc:
        raise CheckpointError(path, "header checksum mismatch: the header is corrupted")
    try:
        header = json.loads(raw)
        if header["alignment"] != ALIGNMENT or header["checksum"] != "crc32":
            raise ValueError(f"alignment {header['alignment']!r} and checksum "
                             f"{header['checksum']!r}, expected {ALIGNMENT} and 'crc32'")
        file_bytes = _header_int(header["file_bytes"], "file_bytes")
        meta = dict(header["meta"])
        entries = []
        for e in header["parts"]:
            name = str(e["name"])
            try:
                entries.append((name, str(e["dtype"]),
                                tuple(_header_int(s, "shape") for s in e["shape"]),
                                _header_int(e["offset"], "offset"),
                                _header_int(e["nbytes"], "nbytes"), int(e["crc32"], 16)))
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(path, f"header does not describe a version "
                                            f"{FORMAT_VERSION} layout: {exc!r}",
                                      part=name) from exc
    except RecursionError as exc:  # json.loads of deeply nested lists or objects
        raise CheckpointError(path, f"header does not describe a version {FORMAT_VERSION} "
                                    f"layout: its JSON is nested too deeply to read") from exc
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(path, f"header does not describe a version "
                                    f"{FORMAT_VERSION} layout: {exc!r}") from exc
    if size != file_bytes:
        what = "truncated" if size < file_bytes else "has trailing bytes"
        raise CheckpointError(path, f"{what}: {size} bytes, the header says {file_bytes}")
    parts, pos = [], header_end
    for name, dtype_name, shape, offset, nbytes, part_crc in entries:
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise CheckpointError(path, f"unknown dtype {dtype_name!r}", part=name)
        if math.prod(max(s, 1) for s in shape) > _INT64_MAX:  # torch's strides overflow
            raise CheckpointError(path, f"shape {shape} is too large for a tensor (its "
                                        f"dimensions multiply past 2**63 - 1)", part=name)
        if nbytes != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(path, f"shape {shape} of {dtype_name} needs "
                                        f"{math.prod(shape) * dtype.itemsize} bytes, the "
                                        f"header says {nbytes}", part=name)
        if offset % ALIGNMENT or offset < pos or offset + nbytes > file_bytes:
            raise CheckpointError(path, f"bytes [{offset}, {offset + nbytes}) are unaligned, "
                                        f"overlap the previous part or leave the file",
                                  part=name)
        if any(p.name == name for p in parts):
            raise CheckpointError(path, "appears twice in the header", part=name)
        parts.append(_Part(name, dtype, shape, offset, nbytes, part_crc))
        pos = offset + nbytes
    return meta, parts, header_end


def _header_int(value: Any, key: str) -> int:
    """A header integer in ``[0, 2**63)``; ValueError naming ``key`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _INT64_MAX:
        raise ValueError(f"{key} must be an integer in [0, 2**63), got {value!r}")
    return value


def _read_parts(f: IO[bytes], path: Path, parts: list[_Part], pos: int, size: int,
                verify: bool, dest: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for p in parts:
        _check_padding(path, f.read(p.offset - pos))
        out[p.name] = _read_into(f, path, p, dest.get(p.name), verify)
        pos = p.offset + p.nbytes
    _check_padding(path, f.read(size - pos))
    return out


def _read_into(f: IO[bytes], path: Path, p: _Part, t: torch.Tensor | None,
               verify: bool) -> torch.Tensor:
    """Read part ``p`` (``f`` is at its offset) into ``t``, or into a new tensor."""
    t = torch.empty(p.shape, dtype=p.dtype) if t is None else t
    view, crc = _bytes_of(t), 0
    for i in range(0, p.nbytes, _CHUNK):
        chunk = view[i:i + _CHUNK]
        if f.readinto(chunk) != len(chunk):
            raise CheckpointError(path, "file shrank while it was read", part=p.name)
        if verify:  # while the chunk is still in cache
            crc = crc32(chunk, crc)
    if verify:
        _check_crc(path, p, crc)
    return t


def _map_parts(f: IO[bytes], path: Path, parts: list[_Part], pos: int, size: int,
               verify: bool, skip: set[str]) -> dict[str, torch.Tensor]:
    """Map every part but those in ``skip`` (whose bytes are not touched here)."""
    region = _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_COPY)
    out = {}
    with memoryview(region) as view:
        for p in parts:
            _check_padding(path, view[pos:p.offset])
            pos = p.offset + p.nbytes
            if p.name in skip:
                continue
            if verify:
                _check_crc(path, p, crc32(view[p.offset:p.offset + p.nbytes]))
            if p.nbytes:
                t = torch.frombuffer(region, dtype=p.dtype, count=p.nbytes // p.dtype.itemsize,
                                     offset=p.offset)
                out[p.name] = t.view(p.shape)
            else:  # frombuffer refuses zero elements
                out[p.name] = torch.empty(p.shape, dtype=p.dtype)
        _check_padding(path, view[pos:size])
    return out


def _check_padding(path: Path, data: bytes | memoryview) -> None:
    if bytes(data).count(0) != len(data):
        raise CheckpointError(path, "padding between parts is not zero: the file is corrupted")


def _check_crc(path: Path, part: _Part, crc: int) -> None:
    if crc != part.crc32:
        raise CheckpointError(path, f"checksum mismatch (crc32 {crc:08x}, the header says "
                                    f"{part.crc32:08x}): its bytes are corrupted",
                              part=part.name)
