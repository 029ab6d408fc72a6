"""Host (CPU) memory of the data path: huge-page columns, and the allocator's release policy.

Columns of at least :data:`HUGE_PAGE_MIN_BYTES` get an anonymous mapping advised
``madvise(MADV_HUGEPAGE)`` (honoured when ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``always`` or ``madvise``), which takes most TLB misses out of random-row gathers
(``docs/design.md §7``). Smaller columns keep torch's allocator.

:func:`retain_freed_memory` keeps glibc from handing the batches' memory back to the kernel
between iterations, so the learner does not pay for unmapping and page faults
(``docs/design.md §7``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import mmap
import os
import sys
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


MALLOC_MMAP_THRESHOLD = 32 << 20
"""Blocks below this size come from glibc's heap, not a mapping of their own (glibc's maximum
for the threshold on 64-bit systems)."""

MALLOC_TRIM_THRESHOLD = 64 << 20
"""Free memory at the top of a glibc heap kept for reuse before any is returned."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_USER_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


@functools.cache
def retain_freed_memory() -> bool:
    """Make glibc keep freed batch-sized blocks for reuse instead of returning them.

    Sets ``mallopt(M_MMAP_THRESHOLD, 32 MiB)`` and ``mallopt(M_TRIM_THRESHOLD, 64 MiB)`` once
    per process. By default glibc maps a block over its (adaptive) threshold on its own and
    unmaps it when freed, and returns the free top of a heap to the kernel once it passes
    twice that threshold, so a batch that the learner drops at the end of an iteration can be
    unmapped on the learner's thread, and the next iteration's batches page-fault their memory
    in again. With the policy, freed blocks under 32 MiB are reused, and up to 64 MiB of free
    memory per heap stays with the process. Columns and pooled gather outputs are unaffected
    (they hold their memory).

    Nothing is changed when ``CONDUIT_HOST_MALLOC=system``, when the process already sets
    glibc's malloc through ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
    ``MALLOC_TOP_PAD_`` or a ``glibc.malloc`` entry in ``GLIBC_TUNABLES``, or off Linux.

    Returns:
        Whether the policy is in force (set by this call or by an earlier one).
    """
    if os.environ.get("CONDUIT_HOST_MALLOC", "").strip().lower() == "system":
        return False
    if any(name in os.environ for name in _USER_MALLOC_ENV) or (
            "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt returns 1 on success; the mmap threshold first, as setting either one stops
    # glibc from adapting both.
    return bool(mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD))
