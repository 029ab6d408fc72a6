"""``copy_rows``: the compiled large-row path, the numpy paths and index_copy_ agree."""

from __future__ import annotations

import pytest
import torch

from conduit.storage import compiled
from conduit.storage.column_store import copy_rows


def _reference(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor,
               src_rows: torch.Tensor | None) -> torch.Tensor:
    out = dst.clone()
    rows = src if src_rows is None else src[src_rows]
    for k, d in enumerate(dst_rows.tolist()):
        out[d] = rows[k]
    return out


@pytest.mark.parametrize("shape,dtype", [((64, 64, 3), torch.uint8),  # 12 KB rows: numpy
                                         ((32, 32, 16), torch.float32),  # 64 KB rows
                                         ((128, 128, 3), torch.uint8),  # 48 KB image rows
                                         ((5,), torch.int64)])
def test_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 100, (20, *shape), generator=g).to(dtype)
    dst = torch.zeros((30, *shape), dtype=dtype)
    dst_rows = torch.randperm(30, generator=g)[:12]
    src_rows = torch.randint(0, 20, (12,), generator=g)  # repeats allowed on the source
    want = _reference(dst, dst_rows, src, src_rows)
    copy_rows(dst, dst_rows, src, src_rows)
    assert torch.equal(dst, want)


def test_all_source_rows() -> None:
    src = torch.arange(4 * 48 * 1024, dtype=torch.int32).reshape(4, 48, 1024)
    dst = torch.zeros((10, 48, 1024), dtype=torch.int32)
    rows = torch.tensor([9, 0, 5, 2])
    copy_rows(dst, rows, src)
    assert torch.equal(dst, _reference(torch.zeros_like(dst), rows, src, None))


def test_out_of_range_raises_and_copies_nothing() -> None:
    src = torch.ones((4, 128, 128, 3), dtype=torch.uint8)
    dst = torch.zeros((8, 128, 128, 3), dtype=torch.uint8)
    with pytest.raises(IndexError, match="out of range"):
        copy_rows(dst, torch.tensor([1, 8]), src, torch.tensor([0, 1]))
    with pytest.raises(IndexError):
        copy_rows(dst, torch.tensor([1, 2]), src, torch.tensor([0, -1]))
    assert compiled.load("_row_kernels") is None or int(dst.sum()) == 0


def test_non_contiguous_destination_falls_back() -> None:
    src = torch.randint(0, 255, (6, 128, 128, 3), dtype=torch.uint8)
    base = torch.zeros((8, 128, 128, 6), dtype=torch.uint8)
    dst = base[..., :3]  # every row strided: not C-contiguous
    rows, srows = torch.tensor([7, 1, 3]), torch.tensor([0, 5, 2])
    copy_rows(dst, rows, src, srows)
    assert torch.equal(dst[rows], src[srows])
    assert int(base[..., 3:].sum()) == 0


def test_kernel_is_compiled_here() -> None:
    # Numba is a core dependency: the compiled path must be the one that runs.
    assert compiled.load("_row_kernels") is not None
