"""Direct (page-cache-bypassing) writes of block-aligned ranges, and their buffered fallback."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from conduit.storage import read_checkpoint, write_checkpoint
from conduit.storage.direct_write import BLOCK, DirectRangeWriter

RANGES = [(0, 5), (BLOCK, 3 * BLOCK + 17), (5 * BLOCK, 70_001), (24 * BLOCK, BLOCK)]


def _payloads(seed: int = 0) -> list[tuple[int, bytes]]:
    rng = np.random.default_rng(seed)
    return [(off, rng.integers(1, 256, n, dtype=np.uint8).tobytes()) for off, n in RANGES]


def _write(path: Path, *, direct: bool, chunk: int, staging: int = 4 * BLOCK,
           end: int | None = None) -> bool:
    payloads = _payloads()
    with open(path, "xb") as f:
        out = DirectRangeWriter(path, f, staging_bytes=staging, direct=direct)
        try:
            for off, data in payloads:
                out.start_range(off)
                for i in range(0, len(data), chunk):
                    out.write(memoryview(data[i:i + chunk]))
            was_direct = out.direct
        finally:
            out.close()
        f.truncate(end if end is not None else RANGES[-1][0] + RANGES[-1][1])
    return was_direct


def _expected() -> bytes:
    end = RANGES[-1][0] + RANGES[-1][1]
    buf = bytearray(end)
    for off, data in _payloads():
        buf[off:off + len(data)] = data
    return bytes(buf)


def _direct_supported(folder: Path) -> bool:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    probe = folder / "probe"
    probe.write_bytes(b"")
    try:
        os.close(os.open(probe, os.O_WRONLY | flag))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.mark.parametrize("chunk", [1, 999, BLOCK, 3 * BLOCK + 1, 1 << 20])
def test_ranges_land_byte_for_byte_with_zero_padding(tmp_path: Path, chunk: int) -> None:
    """Whatever the chunking (across the staging buffer's edge or not), the file holds each
    range at its offset and zeros between them, direct or buffered."""
    for direct in (True, False):
        path = tmp_path / f"f{int(direct)}"
        _write(path, direct=direct, chunk=chunk)
        assert path.read_bytes() == _expected(), (direct, chunk)


def test_direct_writes_are_used_where_the_file_system_allows(tmp_path: Path) -> None:
    if not _direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    assert _write(tmp_path / "f", direct=True, chunk=5000)
    assert not _write(tmp_path / "g", direct=False, chunk=5000)


@pytest.mark.parametrize("refusal", ["error", "short"])
def test_a_refused_direct_write_falls_back_with_the_same_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: str) -> None:
    """A file system that opens with O_DIRECT but refuses the write (EINVAL) or writes an
    unaligned part of it: the rest of the file goes through the page cache, nothing lost."""
    real = os.pwrite
    calls = {"n": 0}

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] == 2:  # the second direct write
            if refusal == "error":
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, data[:BLOCK + 100], offset)  # cut short, unaligned
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    if not _direct_supported(tmp_path):  # fake the open too: the writes are what is refused
        monkeypatch.setattr("conduit.storage.direct_write._open_direct",
                            lambda path: os.open(path, os.O_WRONLY))
    path = tmp_path / "f"
    assert not _write(path, direct=True, chunk=3000)  # direct writes are off by the end
    assert calls["n"] == 2
    assert path.read_bytes() == _expected()


def test_other_write_errors_propagate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr("conduit.storage.direct_write._open_direct",
                        lambda path: os.open(path, os.O_WRONLY))
    with pytest.raises(OSError, match="No space"):
        _write(tmp_path / "f", direct=True, chunk=BLOCK)


def test_refuses_unaligned_ranges_and_staging(tmp_path: Path) -> None:
    with open(tmp_path / "f", "xb") as f:
        with pytest.raises(ValueError, match="staging_bytes"):
            DirectRangeWriter(tmp_path / "f", f, staging_bytes=BLOCK + 1)
        out = DirectRangeWriter(tmp_path / "f", f, staging_bytes=BLOCK)
        try:
            with pytest.raises(ValueError, match="offset"):
                out.start_range(100)
            with pytest.raises(ValueError, match="no range is open"):
                out.write(memoryview(b"x"))
        finally:
            out.close()


def _resident_share(path: Path, start: int) -> float:
    """Share of the file's pages from byte ``start`` on that are in the page cache, read with
    ``mincore`` over a mapping that touches no page."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            pytest.skip("mmap failed")
        try:
            if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                pytest.skip(f"mincore failed: {os.strerror(ctypes.get_errno())}")
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    first = start // mmap.PAGESIZE
    return sum(v & 1 for v in vec[first:]) / max(1, pages - first)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs Linux (mincore)")
def test_a_checkpoint_save_leaves_its_parts_out_of_the_page_cache(tmp_path: Path) -> None:
    """Saved direct, the rows never pass through the page cache (no CPU spent copying them
    there, no memory taken); saved buffered, they stay cached. Both files are the same."""
    if not _direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    g = torch.Generator().manual_seed(0)
    tensors = {"obs": torch.randn(16_000, 1000, generator=g),  # 64 MB
               "reward": torch.randn(16_000, generator=g)}
    files = {}
    for direct in (True, False):
        path = files[direct] = tmp_path / f"c{int(direct)}.ckpt"
        write_checkpoint(path, tensors=tensors, meta={"n": 1}, direct=direct)
    parts_start = 4096  # the header fits in the first block
    assert _resident_share(files[True], parts_start) < 0.1
    assert _resident_share(files[False], parts_start) > 0.5
    assert files[True].read_bytes() == files[False].read_bytes()
    _, got = read_checkpoint(files[True])
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
