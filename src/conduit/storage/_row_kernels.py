"""Compiled row copies (Numba) for host tensors with large rows, such as image payloads.

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
