"""Compiled row kernels (Numba): row copies for host tensors with large rows, such as image
payloads; the range check of a host gather's indices; and the checks of which delivered rows a
priority update may still touch.

``dst[dst_rows[k]] = src[src_rows[k]]`` row by row, as bytes, in one call that does not hold
the GIL, where a Python loop would take it once per row (``docs/design.md §7``).

Compiled on first use and cached next to this file (``cache=True``).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def copy_rows(dst: np.ndarray, dst_rows: np.ndarray, src: np.ndarray,
              src_rows: np.ndarray) -> int:  # pragma: no cover - compiled
    """Copy rows of two 2-D ``uint8`` arrays (rows × bytes of a row).

    Returns:
        0 on success, or ``k + 1`` for the first pair ``k`` whose index is out of range (in
        which case nothing was copied).
    """
    n, m = dst_rows.shape[0], src.shape[1]
    for k in range(n):
        if not (0 <= dst_rows[k] < dst.shape[0] and 0 <= src_rows[k] < src.shape[0]):
            return k + 1
    for k in range(n):
        a, b = dst_rows[k], src_rows[k]
        for j in range(m):
            dst[a, j] = src[b, j]
    return 0


@numba.njit(cache=True, nogil=True)
def current_rows(slots: np.ndarray, size: int, delivered: np.ndarray, row_id: np.ndarray,
                 keep: np.ndarray) -> int:  # pragma: no cover - compiled
    """Which slots still hold the row last delivered from them (or never delivered one).

    Sets ``keep[k]`` for slot ``slots[k]``.

    Returns:
        How many slots were kept, or ``-1 - k`` for the first slot ``k`` outside
        ``[0, size)`` (``keep`` is then unset).
    """
    n = slots.shape[0]
    for k in range(n):
        if slots[k] < 0 or slots[k] >= size:
            return -1 - k
    kept = 0
    for k in range(n):
        d = delivered[slots[k]]
        ok = d == -1 or d == row_id[slots[k]]
        keep[k] = ok
        kept += ok
    return kept


@numba.njit(cache=True, nogil=True)
def delivered_rows(slots: np.ndarray, size: int, ids: np.ndarray, row_id: np.ndarray,
                   keep: np.ndarray) -> int:  # pragma: no cover - compiled
    """Which slots still hold the rows one delivery gave from them (``ids``, in order).

    Sets ``keep[k]`` for slot ``slots[k]``.

    Returns:
        How many slots were kept, or -1 if a slot lies outside ``[0, size)`` (``keep`` is
        then unset).
    """
    n = slots.shape[0]
    for k in range(n):
        if slots[k] < 0 or slots[k] >= size:
            return -1
    kept = 0
    for k in range(n):
        ok = row_id[slots[k]] == ids[k]
        keep[k] = ok
        kept += ok
    return kept


@numba.njit(cache=True, nogil=True)
def first_outside(indices: np.ndarray, n: int) -> int:  # pragma: no cover - compiled
    """The position of the first index outside ``[0, n)``, or -1 if every one lies inside."""
    for k in range(indices.shape[0]):
        if indices[k] < 0 or indices[k] >= n:
            return k
    return -1
