"""Checkpoint files: round trips, corruption detection, atomic replacement, no pickle."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
import torch

from conduit.errors import ConduitError, ConfigError
from conduit.storage import checkpoint
from conduit.storage.checkpoint import (
    ALIGNMENT,
    FORMAT_VERSION,
    MAGIC,
    SUPPORTED_DTYPES,
    CheckpointError,
    read_checkpoint,
    write_checkpoint,
)

SHAPES = [(0,), (0, 3), (), (7,), (3, 4, 2)]


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bytes of every bit pattern (NaNs included), or 0/1 for bool."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN payloads compared exactly)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


def _three(seed: int = 0) -> dict[str, torch.Tensor]:
    return {"obs": _random((50, 8), torch.float32, seed), "act": _random((50,), torch.int64),
            "mask": _random((50, 3), torch.bool)}


def _header_end(path: Path) -> int:
    return 20 + struct.unpack_from("<I", path.read_bytes(), 12)[0]


def _rewrite_header(path: Path, edit, *, version: int = FORMAT_VERSION) -> None:
    """Change the header with ``edit(header_dict)`` and re-seal it with a valid checksum."""
    data = bytearray(path.read_bytes())
    end = _header_end(path)
    header = json.loads(data[20:end])
    first = min((p["offset"] for p in header["parts"]), default=len(data))
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    head = struct.pack("<8sII", MAGIC, version, len(raw))
    assert 20 + len(raw) <= first, "the edited header must still fit before the parts"
    data[:first] = head + struct.pack("<I", zlib.crc32(raw, zlib.crc32(head))) + raw + bytes(
        first - 20 - len(raw))
    path.write_bytes(bytes(data))


# Round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_round_trip_every_dtype_and_shape(tmp_path, dtype, mmap):
    tensors = {f"t{i}": _random(s, dtype, seed=i) for i, s in enumerate(SHAPES)}
    tensors["strided"] = _random((6, 5), dtype).t()  # not contiguous
    path = tmp_path / "ck"
    info = write_checkpoint(path, tensors=tensors, meta={"dtype": str(dtype)})
    meta, got = read_checkpoint(path, mmap=mmap)
    assert meta == {"dtype": str(dtype)}
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        assert _same(got[name], t), name
    assert info.nbytes == path.stat().st_size and info.parts == tuple(tensors)


def test_layout_matches_the_documented_format(tmp_path):
    path = tmp_path / "ck"
    write_checkpoint(path, tensors=_three(), meta={"step": 3})
    data = path.read_bytes()
    assert data[:8] == MAGIC and struct.unpack_from("<I", data, 8)[0] == FORMAT_VERSION
    header = json.loads(data[20:_header_end(path)])
    assert header["meta"] == {"step": 3} and header["file_bytes"] == len(data)
    for p in header["parts"]:
        assert p["offset"] % ALIGNMENT == 0 and len(p["crc32"]) == 8
        body = data[p["offset"]:p["offset"] + p["nbytes"]]
        assert int(p["crc32"], 16) == zlib.crc32(body)
    obs = header["parts"][0]
    assert obs["name"] == "obs" and obs["dtype"] == "float32" and obs["shape"] == [50, 8]
    raw = data[obs["offset"]:obs["offset"] + obs["nbytes"]]
    assert raw == _three()["obs"].numpy().astype("<f4").tobytes()  # little-endian, C order


def test_the_file_gets_the_usual_permissions(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    write_checkpoint(tmp_path / "ck", tensors={}, meta={})
    assert (tmp_path / "ck").stat().st_mode & 0o777 == 0o666 & ~umask


def test_meta_and_no_parts(tmp_path):
    meta = {"name": "ppo ✓", "nested": {"a": [1, 2.5, None, True]}, "big": 2**62}
    write_checkpoint(tmp_path / "ck", tensors={}, meta=meta)
    assert read_checkpoint(tmp_path / "ck") == (meta, {})


def test_large_meta_moves_the_parts_past_the_header(tmp_path):
    meta = {"long": "x" * (3 * ALIGNMENT)}
    write_checkpoint(tmp_path / "ck", tensors=_three(), meta=meta)
    got_meta, got = read_checkpoint(tmp_path / "ck")
    assert got_meta == meta and all(_same(got[k], v) for k, v in _three().items())


@pytest.mark.parametrize("meta", [{"x": float("nan")}, {"x": float("inf")}, {"x": object()}])
def test_meta_must_be_strict_json(tmp_path, meta):
    with pytest.raises(ConfigError, match="meta"):
        write_checkpoint(tmp_path / "ck", tensors=_three(), meta=meta)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("bad", [lambda: torch.ones(3).to_sparse(),
                                 lambda: torch.zeros(3, dtype=torch.uint4), lambda: [1, 2],
                                 lambda: torch.empty(3, device="meta")],
                         ids=["sparse", "sub-byte", "list", "meta device"])
def test_unsupported_tensors_are_refused(tmp_path, bad):
    with pytest.raises(ConfigError, match="tensors\\['bad'\\]"):
        write_checkpoint(tmp_path / "ck", tensors={"ok": torch.ones(2), "bad": bad()}, meta={})
    assert os.listdir(tmp_path) == []


def test_mmap_tensors_are_private_and_outlive_a_replacement(tmp_path):
    path = tmp_path / "ck"
    write_checkpoint(path, tensors={"x": torch.arange(2000.0)}, meta={})
    _, mapped = read_checkpoint(path, mmap=True)
    mapped["x"][0] = -1.0  # copy-on-write: the file keeps its bytes
    assert read_checkpoint(path)[1]["x"][0] == 0.0
    write_checkpoint(path, tensors={"x": torch.zeros(2000)}, meta={})
    assert mapped["x"][1] == 1.0 and mapped["x"][1999] == 1999.0


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
def test_parts_are_read_into_the_tensors_into_gives(tmp_path, mmap):
    path = tmp_path / "ck"
    tensors = _three()
    write_checkpoint(path, tensors=tensors, meta={"rows": 50})
    seen = {}

    def into(meta, layout):
        seen.update(meta=meta, layout=layout)
        return {"obs": dst, "mask": mask[10:]}

    dst, mask = torch.zeros(50, 8), torch.zeros(60, 3, dtype=torch.bool)
    meta, got = read_checkpoint(path, mmap=mmap, into=into)
    assert seen["meta"] == meta == {"rows": 50}
    assert seen["layout"] == {"obs": (torch.float32, (50, 8)), "act": (torch.int64, (50,)),
                              "mask": (torch.bool, (50, 3))}
    assert list(got) == ["obs", "act", "mask"]  # file order
    assert got["obs"] is dst and got["mask"].data_ptr() == mask[10:].data_ptr()
    def bits(t):  # the random floats include NaNs
        return t.contiguous().reshape(-1).view(torch.uint8)

    assert torch.equal(bits(dst), bits(tensors["obs"]))
    assert torch.equal(mask[10:], tensors["mask"]) and not mask[:10].any()
    assert torch.equal(got["act"], tensors["act"])


@pytest.mark.parametrize("bad, match", [
    ({"nope": torch.zeros(3)}, "'nope' is not a part"),
    ({"obs": torch.zeros(50, 9)}, r"'obs'.*float32 \(50, 8\)"),
    ({"obs": torch.zeros(50, 8, dtype=torch.float64)}, "'obs'"),
    ({"obs": torch.zeros(8, 50).T}, "'obs'"),
])
def test_into_refuses_tensors_that_do_not_fit_their_part(tmp_path, bad, match):
    path = tmp_path / "ck"
    write_checkpoint(path, tensors=_three(), meta={})
    with pytest.raises(ConfigError, match=match) as err:
        read_checkpoint(path, into=lambda meta, layout: bad)
    assert err.value.field == "into"


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
def test_a_flipped_byte_in_a_part_read_into_a_tensor_names_that_part(tmp_path, mmap):
    path = tmp_path / "ck"
    write_checkpoint(path, tensors=_three(), meta={})
    header = json.loads(path.read_bytes()[20:_header_end(path)])
    obs = next(p for p in header["parts"] if p["name"] == "obs")
    data = bytearray(path.read_bytes())
    data[obs["offset"] + 7] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"part 'obs'.*checksum"):
        read_checkpoint(path, mmap=mmap, into=lambda meta, layout: {"obs": torch.zeros(50, 8)})


# Corruption -------------------------------------------------------------------------------


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
def test_a_flipped_byte_in_a_part_names_that_part(tmp_path, mmap):
    path = tmp_path / "ck"
    tensors = _three()
    write_checkpoint(path, tensors=tensors, meta={})
    header = json.loads(path.read_bytes()[20:_header_end(path)])
    clean = path.read_bytes()
    for p in header["parts"]:
        for at in (0, p["nbytes"] // 2, p["nbytes"] - 1):
            data = bytearray(clean)
            data[p["offset"] + at] ^= 0x01
            path.write_bytes(bytes(data))
            with pytest.raises(CheckpointError, match=f"part '{p['name']}'.*checksum") as err:
                read_checkpoint(path, mmap=mmap)
            assert err.value.part == p["name"] and err.value.path == path


def test_every_flipped_byte_of_the_file_is_detected(tmp_path):
    path = tmp_path / "ck"
    write_checkpoint(path, tensors={"a": torch.arange(5.0), "b": torch.arange(3)},
                     meta={"k": "v"})
    clean = path.read_bytes()
    end = _header_end(path)
    header_bytes = range(end)
    padding = range(end, len(clean), 61)  # padding and parts, sampled
    for at in [*header_bytes, *padding]:
        data = bytearray(clean)
        data[at] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(CheckpointError) as err:
            read_checkpoint(path)
        if at < end:
            assert err.value.part is None, at


@pytest.mark.parametrize("at, message", [(0, "bad magic"), (8, "version 0 is unknown"),
                                         (14, "truncated"), (16, "header checksum"),
                                         (40, "header checksum")])
def test_header_damage_is_named(tmp_path, at, message):
    path = tmp_path / "ck"
    write_checkpoint(path, tensors=_three(), meta={})
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=message) as err:
        read_checkpoint(path)
    assert err.value.part is None


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
def test_truncated_or_extended_files_raise(tmp_path, mmap):
    path = tmp_path / "ck"
    write_checkpoint(path, tensors=_three(), meta={})
    clean = path.read_bytes()
    for keep in (0, 7, 19, _header_end(path) - 1, _header_end(path) + 10, len(clean) // 2,
                 len(clean) - 1):
        path.write_bytes(clean[:keep])
        with pytest.raises(CheckpointError, match="truncated"):
            read_checkpoint(path, mmap=mmap)
    path.write_bytes(clean + b"\0")
    with pytest.raises(CheckpointError, match="trailing bytes"):
        read_checkpoint(path, mmap=mmap)


def test_unknown_version_raises(tmp_path):
    path = tmp_path / "ck"
    write_checkpoint(path, tensors=_three(), meta={})
    _rewrite_header(path, lambda h: None, version=FORMAT_VERSION + 1)
    with pytest.raises(CheckpointError, match=f"version {FORMAT_VERSION + 1} is unknown"):
        read_checkpoint(path)


def _set_part(key, value):
    def edit(header):
        header["parts"][1][key] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (_set_part("dtype", "float128"), "unknown dtype 'float128'"),
    (_set_part("shape", [51]), "needs 408 bytes, the header says 400"),
    (_set_part("shape", [-50]), "shape"),
    (_set_part("offset", 4097), "unaligned"),
    (_set_part("name", "obs"), "twice"),
], ids=["dtype", "shape", "negative", "offset", "duplicate"])
def test_a_sealed_but_invalid_header_names_the_part(tmp_path, edit, message):
    path = tmp_path / "ck"
    write_checkpoint(path, tensors=_three(), meta={})
    _rewrite_header(path, edit)
    with pytest.raises(CheckpointError, match=message) as err:
        read_checkpoint(path)
    assert err.value.part in ("act", "obs")


@pytest.mark.parametrize("edit", [lambda h: h.pop("parts"), lambda h: h.update(alignment=64),
                                  lambda h: h["parts"][0].update(crc32=7)],
                         ids=["missing key", "alignment", "crc type"])
def test_a_header_of_another_layout_raises(tmp_path, edit):
    path = tmp_path / "ck"
    write_checkpoint(path, tensors=_three(), meta={})
    _rewrite_header(path, edit)
    with pytest.raises(CheckpointError, match="does not describe"):
        read_checkpoint(path)


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_checkpoint(tmp_path / "nothing")


def test_checkpoint_error_is_a_conduit_error():
    assert issubclass(CheckpointError, ConduitError)


# Atomicity --------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise")
def test_a_save_drops_the_file_it_replaces_from_the_cache_first(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    write_checkpoint(path, tensors=_three(0), meta={"n": 0})
    before = path.stat().st_ino
    calls = []
    real = os.posix_fadvise

    def advise(fd, offset, length, advice):
        calls.append((os.fstat(fd).st_ino, advice, [p.name for p in tmp_path.iterdir()]))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    write_checkpoint(path, tensors=_three(1), meta={"n": 1})
    # the old file, before any temporary file was made beside it
    assert calls == [(before, os.POSIX_FADV_DONTNEED, ["ck"])]
    meta, got = read_checkpoint(path)
    assert meta == {"n": 1} and _same(got["obs"], _three(1)["obs"])
    calls.clear()
    write_checkpoint(tmp_path / "new", tensors=_three(), meta={})
    assert calls == []  # nothing to drop


@pytest.mark.parametrize("fail", ["replace", "fsync", "tensor"])
def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, fail):
    path = tmp_path / "ck"
    write_checkpoint(path, tensors=_three(0), meta={"n": 0})
    tensors = _three(1)

    real_chunks = checkpoint._byte_chunks

    def boom(*args, **kwargs):
        raise OSError("injected")

    if fail == "tensor":  # the last tensor cannot be read
        monkeypatch.setattr(checkpoint, "_byte_chunks", lambda t: boom() if t.dtype == torch.bool
                            else real_chunks(t))
    else:
        monkeypatch.setattr(os, fail, boom)
    with pytest.raises(OSError, match="injected"):
        write_checkpoint(path, tensors=tensors, meta={"n": 1})
    monkeypatch.undo()
    meta, got = read_checkpoint(path)
    assert meta == {"n": 0} and all(_same(got[k], v) for k, v in _three(0).items())
    assert os.listdir(tmp_path) == ["ck"]  # the temporary file is gone


_SAVER = textwrap.dedent("""
    import sys, torch
    from conduit.storage.checkpoint import write_checkpoint
    path, n = sys.argv[1], 0
    x = torch.full((4 << 20,), 7.0)  # 16 MB: the saver spends its time writing
    while True:
        n += 1
        write_checkpoint(path, tensors={"x": x, "n": torch.tensor(n)}, meta={"n": n})
        print(n, flush=True)
""")


def test_sigkill_mid_save_leaves_a_complete_checkpoint(tmp_path):
    path = tmp_path / "ck"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    for trial in range(3):
        proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(path)], env=env,
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            proc.stdout.readline()  # one save completed
            time.sleep(0.05 + 0.1 * trial)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        _check_complete(path)
        # A killed save leaves its temporary file under another name: either unfinished,
        # which fails to read, or complete but never renamed.
        for leftover in tmp_path.glob(".ck.*.tmp"):
            with contextlib.suppress(CheckpointError):
                _check_complete(leftover)
            leftover.unlink()
        assert os.listdir(tmp_path) == ["ck"]


def _check_complete(path: Path) -> None:
    meta, got = read_checkpoint(path)
    n = meta["n"]
    assert got["n"].item() == n and bool((got["x"] == 7.0).all())


# No pickle, bounded memory ----------------------------------------------------------------


def test_no_pickle_on_write_or_read(tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("pickle used")

    for name in ("load", "loads", "dump", "dumps", "Unpickler", "Pickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(torch, "save", forbidden)
    path = tmp_path / "ck"
    write_checkpoint(path, tensors=_three(), meta={"n": 1})
    for mmap in (False, True):
        meta, got = read_checkpoint(path, mmap=mmap)
        assert meta == {"n": 1} and _same(got["obs"], _three()["obs"])


_MEMORY = textwrap.dedent("""
    import gc, resource, sys, torch
    from conduit.storage.checkpoint import read_checkpoint, write_checkpoint
    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    x = torch.ones(50 << 20)  # 200 MB, every page touched
    base = peak()
    write_checkpoint(sys.argv[1], tensors={"x": x}, meta={})
    wrote = peak()
    del x
    gc.collect()
    _, got = read_checkpoint(sys.argv[1])
    assert bool(got["x"][-1] == 1.0)
    print(wrote - base, peak() - base)
""")


def test_save_and_load_do_not_double_memory(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    out = subprocess.run([sys.executable, "-c", _MEMORY, str(tmp_path / "ck")], env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    save_extra, load_extra = (int(v) for v in out.split())
    assert save_extra < 64 << 20, f"saving 200 MB raised peak RSS by {save_extra >> 20} MB"
    assert load_extra < 64 << 20, f"loading 200 MB raised peak RSS by {load_extra >> 20} MB"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_stream_to_the_file(tmp_path):
    tensors = {"x": _random((1000, 33), torch.bfloat16).cuda(),
               "y": _random((40, 30), torch.float32).cuda().t()}
    write_checkpoint(tmp_path / "ck", tensors=tensors, meta={})
    _, got = read_checkpoint(tmp_path / "ck")
    assert all(_same(got[k], v.cpu()) for k, v in tensors.items())
