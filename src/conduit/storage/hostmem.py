"""Host (CPU) column allocation, backed by transparent huge pages when the kernel offers them.

Columns of at least :data:`HUGE_PAGE_MIN_BYTES` get an anonymous mapping advised
``madvise(MADV_HUGEPAGE)`` (honoured when ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``always`` or ``madvise``), which takes most TLB misses out of random-row gathers
(``docs/design.md §7``). Smaller columns keep torch's allocator.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import warnings
from collections.abc import Sequence

import torch

HUGE_PAGE_MIN_BYTES = 32 << 20
"""Columns at least this large get their own huge-page-advised mapping."""


def huge_pages_supported() -> bool:
    """Whether this platform can advise huge pages for an anonymous mapping."""
    return hasattr(mmap.mmap, "madvise") and hasattr(mmap, "MADV_HUGEPAGE")


def host_zeros(shape: Sequence[int], dtype: torch.dtype, *,
               huge_pages: bool = True) -> torch.Tensor:
    """A zero-filled CPU tensor; large ones on an anonymous mapping advised for huge pages.

    Args:
        shape: Tensor shape.
        dtype: Element type.
        huge_pages: Allow the huge-page mapping (falls back to ``torch.zeros`` when the
            platform has no ``MADV_HUGEPAGE`` or the tensor is below
            :data:`HUGE_PAGE_MIN_BYTES`).

    Returns:
        A contiguous tensor that owns its memory (the mapping lives as long as the tensor).
    """
    numel = math.prod(int(s) for s in shape)
    nbytes = numel * dtype.itemsize
    if not (huge_pages and nbytes >= HUGE_PAGE_MIN_BYTES and huge_pages_supported()):
        return torch.zeros(tuple(shape), dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # THP compiled out: small pages still work
        region.madvise(mmap.MADV_HUGEPAGE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(region, dtype=dtype, count=numel)
    # Fault every page in now, as torch.zeros would: huge-page faults can stall in kernel
    # compaction, which belongs to construction, not to the first writes.
    flat.zero_()
    return flat.view(tuple(shape))
