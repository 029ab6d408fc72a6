"""RowSnapshot: a buffer's rows as they were at one instant, copied while writes go on."""

from __future__ import annotations

import numpy as np
import torch

Blocks = list[tuple[int, dict[str, torch.Tensor]]]
"""``(first slot, field -> column)`` per part of a store (one per shard)."""


class RowSnapshot:
    """The filled rows of a buffer at the instant it was taken, completed in the background.

    Copy-on-write: a copying thread moves the rows a chunk at a time, and a write that is
    about to overwrite a row not yet copied copies it first (:meth:`preserve`), so the copy
    ends equal to the rows at the instant :meth:`ExperienceBuffer.begin_snapshot` ran, while
    writes and samples never wait for more than one chunk. Every method must be called under
    the owning buffer's lock.

    Args:
        views: Views of the live columns at that instant (see
            :meth:`ExperienceBuffer.filled_blocks`), covering slots ``[0, size)`` in order.
        reuse: Blocks of an earlier snapshot whose memory is reused where the shapes still
            match (no new pages to fault in).

    Attributes:
        blocks: The copies, on the CPU, laid out as ``views``; exact once :attr:`done`.
        size: Rows in the snapshot.
    """

    def __init__(self, *, views: Blocks, reuse: Blocks | None = None) -> None:
        old = dict(reuse or [])
        self._views = views
        self.blocks: Blocks = []
        for start, cols in views:
            prev = old.get(start, {})
            self.blocks.append((start, {
                f: prev[f] if f in prev and prev[f].shape == c.shape and prev[f].dtype == c.dtype
                else torch.empty_like(c, device="cpu") for f, c in cols.items()}))
        self.size = sum(next(iter(cols.values())).shape[0] for _, cols in views)
        self._pending = np.ones(self.size, dtype=bool)
        self._left = self.size
        self._next = 0  # where the copying thread goes on

    @property
    def done(self) -> bool:
        """Every row is copied."""
        return self._left == 0

    def preserve(self, first: int, stop: int) -> None:
        """Copy the rows in slots ``[first, stop)`` not copied yet; call before they change."""
        stop = min(stop, self.size)
        if first >= stop or not self._left:
            return
        pending = self._pending[first:stop]
        if pending.all():
            runs = [(first, stop)]
        else:
            edges = np.diff(np.concatenate(([0], pending.view(np.int8), [0])))
            runs = list(zip((np.flatnonzero(edges == 1) + first).tolist(),
                            (np.flatnonzero(edges == -1) + first).tolist()))
        for a, b in runs:
            self._copy(a, b)
            self._left -= b - a
        pending[:] = False

    def step(self, rows: int) -> bool:
        """Copy the next ``rows`` slots in order (those not copied yet); returns :attr:`done`."""
        first = self._next
        self._next = min(self.size, first + max(1, rows))
        self.preserve(first, self._next)
        return self.done

    def _copy(self, a: int, b: int) -> None:
        for (start, src), (_, dst) in zip(self._views, self.blocks):
            n = next(iter(src.values())).shape[0]
            lo, hi = max(a, start) - start, min(b, start + n) - start
            if lo < hi:
                for f, col in src.items():
                    dst[f][lo:hi].copy_(col[lo:hi])
