"""Writes of large, block-aligned file ranges that bypass the page cache (``O_DIRECT``).

A buffered ``write`` copies every byte into the page cache on the calling thread and leaves
the kernel to write it back; for a checkpoint of a gigabyte that costs seconds of CPU on the
saving thread, beside the learner (``docs/design.md §8``). :class:`DirectRangeWriter` stages
bytes in one page-aligned buffer and writes it straight to the device, block-padded, where the
operating system and file system allow ``O_DIRECT``; elsewhere it writes through the ordinary
buffered file, with the same bytes in the file either way.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from pathlib import Path
from typing import IO

import numpy as np

BLOCK = 4096
"""Alignment of every direct write's offset, length and memory (a page: at least the logical
block size of the devices Linux supports for ``O_DIRECT``)."""

_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


class DirectRangeWriter:
    """Writes byte ranges of an open file, each starting at a multiple of :data:`BLOCK`.

    Bytes given to :meth:`write` are copied into a staging buffer of ``staging_bytes`` (one
    anonymous mapping, page-aligned, reused) and written out whenever it fills, and at
    :meth:`end_range`. A direct write covers whole blocks, so the last block of a range is
    written with zeros after the range's bytes: ranges must therefore start at least that far
    apart (checkpoint parts start on a multiple of :data:`BLOCK` and their padding is zero), and
    the caller truncates the file to its length afterwards. Where ``O_DIRECT`` is missing, or
    the file system refuses it (at open or at any write), the rest of the bytes go through
    ``file`` instead, unpadded.

    Args:
        path: The file ``file`` writes (opened again, write-only, with ``O_DIRECT``).
        file: The file's buffered binary writer, used where direct writes are not possible.
        staging_bytes: Size of the staging buffer, a positive multiple of :data:`BLOCK`.
        direct: Try ``O_DIRECT`` at all (False: always buffered).

    Raises:
        ValueError: ``staging_bytes`` is not a positive multiple of :data:`BLOCK`.
    """

    def __init__(self, path: str | os.PathLike[str], file: IO[bytes], *,
                 staging_bytes: int = 8 << 20, direct: bool = True) -> None:
        if staging_bytes < BLOCK or staging_bytes % BLOCK:
            raise ValueError(f"staging_bytes: must be a positive multiple of {BLOCK}, got "
                             f"{staging_bytes}")
        self._file = file
        self._fd = _open_direct(Path(path)) if direct else None
        self._staging = mmap.mmap(-1, staging_bytes)
        self._view = memoryview(self._staging)
        self._bytes = np.frombuffer(self._staging, dtype=np.uint8)
        self._filled = 0
        self._pos = -1  # file offset of the staging buffer's first byte; -1: no range open

    @property
    def direct(self) -> bool:
        """Whether writes still bypass the page cache."""
        return self._fd is not None

    def start_range(self, offset: int) -> None:
        """Begin a range at ``offset`` (a multiple of :data:`BLOCK`), ending the one open.

        Raises:
            ValueError: ``offset`` is not a multiple of :data:`BLOCK`.
        """
        if offset < 0 or offset % BLOCK:
            raise ValueError(f"offset: must be a non-negative multiple of {BLOCK}, got {offset}")
        self.end_range()
        self._pos = offset

    def write(self, data: memoryview) -> None:
        """Append ``data`` (a C-contiguous buffer) to the open range."""
        if self._pos < 0:
            raise ValueError("write: no range is open; call start_range first")
        src = np.frombuffer(data, dtype=np.uint8)
        size = self._bytes.size
        at = 0
        while at < src.size:
            k = min(size - self._filled, src.size - at)
            # numpy copies without the GIL (a memoryview slice assignment holds it), so the
            # learner's thread runs on while a background save stages its bytes.
            np.copyto(self._bytes[self._filled:self._filled + k], src[at:at + k])
            self._filled += k
            at += k
            if self._filled == size:
                self._flush()

    def end_range(self) -> None:
        """Write what is staged of the open range (zero-padded to a block when direct)."""
        if self._pos >= 0 and self._filled:
            self._flush()
        self._pos = -1

    def close(self) -> None:
        """End the open range and release the direct descriptor and the staging buffer."""
        try:
            self.end_range()
        finally:
            self._close_direct()
            # A slice still referenced (by an exception's traceback) keeps the mapping
            # exported; it is then unmapped when that last reference goes.
            del self._bytes
            with contextlib.suppress(BufferError):
                self._view.release()
                self._staging.close()

    def _flush(self) -> None:
        n, done = self._filled, 0
        if self._fd is not None:
            padded = -(-n // BLOCK) * BLOCK
            self._view[n:padded] = bytes(padded - n)
            done = min(self._write_direct(padded), n)
        if done < n:  # refused or cut short: the rest goes through the page cache
            self._file.seek(self._pos + done)
            self._file.write(self._view[done:n])
        self._pos += n
        self._filled = 0

    def _write_direct(self, padded: int) -> int:
        """Direct-write the first ``padded`` staged bytes; returns how many whole blocks'
        bytes were written (fewer than ``padded`` when the file system refused or cut the
        write short, which turns direct writes off for the rest of the file)."""
        assert self._fd is not None
        done = 0
        while done < padded:
            try:
                k = os.pwrite(self._fd, self._view[done:padded], self._pos + done)
            except OSError as exc:
                if exc.errno not in _REFUSED:
                    raise
                k = 0
            done += k - k % BLOCK
            if k <= 0 or k % BLOCK:
                self._close_direct()
                break
        return done

    def _close_direct(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def _open_direct(path: Path) -> int | None:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError as exc:
        if exc.errno in _REFUSED:
            return None
        raise
