"""Row ids: which row a slot holds and which row it last delivered (Reverb's keys).

Every row written gets an id, its position in the write order. A gather records the ids it
delivered, so that a priority update reaches the rows that were sampled and never a row
written into their slots since (:class:`~conduit.storage.ExperienceBuffer`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from conduit.storage import compiled

#: The attribute of a delivered ``_index`` tensor holding the ids of the rows it names.
ROW_IDS_ATTR = "_conduit_row_ids"

#: Host bytes :class:`RowIds` takes per slot (two int64 ids).
ID_BYTES_PER_SLOT = 16

#: The names of :class:`RowIds`' two arrays (``row``, ``delivered``) in a buffer's state.
ID_ARRAYS = ("row_id", "delivered_id")


def delivered_ids(indices: Any) -> np.ndarray | None:
    """The row ids a gather gave with ``indices``, when ``indices`` is the ``_index`` tensor of
    a delivered batch (or a slice of one): the gather keeps them on that tensor as
    :data:`ROW_IDS_ATTR`. None for indices in any other form."""
    if not isinstance(indices, torch.Tensor):
        return None
    ids = getattr(indices, ROW_IDS_ATTR, None)
    if ids is not None:
        return ids if ids.shape[0] == indices.numel() else None
    base = indices._base
    ids = None if base is None else getattr(base, ROW_IDS_ATTR, None)
    if ids is None or indices.dim() != 1 or indices.stride(0) != 1 or base.dim() != 1:
        return None
    at = indices.storage_offset() - base.storage_offset()
    n = indices.shape[0]
    return ids[at:at + n] if at >= 0 and at + n <= ids.shape[0] else None


class RowIds:
    """Per slot, the id of the row it holds (``row``) and of the row it last delivered
    (``delivered``); -1 for none. Not thread-safe: the buffer calls it under its lock.

    The two arrays are never replaced, only written in place, so a snapshot may keep
    references to them (:class:`~conduit.storage.snapshot.RowSnapshot`).

    Args:
        capacity: Slots.
    """

    def __init__(self, capacity: int) -> None:
        self.row = np.full(capacity, -1, dtype=np.int64)
        self.delivered = np.full(capacity, -1, dtype=np.int64)

    def written(self, start: int, length: int, first_id: int) -> None:
        """Slots ``[start, start + length)`` now hold rows ``first_id, first_id + 1, ...``."""
        self.row[start:start + length] = np.arange(first_id, first_id + length)

    def deliver(self, indices: torch.Tensor) -> None:
        """A gather delivered the rows in slots ``indices`` (CPU int64, any shape): remember
        them per slot, and on ``indices`` itself, flat, in the order
        :meth:`matching` reads them."""
        slots = indices.numpy().reshape(-1)
        ids = self.row[slots]
        self.delivered[slots] = ids
        setattr(indices, ROW_IDS_ATTR, ids)

    def matching(self, indices: Any, slots: np.ndarray, bound: int,
                 current: np.ndarray) -> int:
        """Which of a priority update's ``slots`` still hold the row it is for: set in
        ``current`` (a bool array as long as ``slots``). For the ``_index`` tensor of a
        delivered batch (or a slice of one), the rows that batch delivered; for other
        ``indices``, the row each slot last delivered (a slot that never delivered one
        counts as current). A slot that holds no row now (:meth:`clear`) does not hold the
        row a delivery gave from it.

        Args:
            indices: The update's indices, as the caller gave them.
            slots: The same, as int64 slots.
            bound: Slots must lie in ``[0, bound)``: the buffer's capacity, so that an update
                for rows delivered before a :meth:`clear` from slots past the rows held now is
                matched (and skipped), not refused.
            current: Where the answer goes.

        Returns:
            How many are current, or -1 when a slot is outside ``[0, bound)`` (then
            ``current`` is undefined).
        """
        kernels = compiled.load("_row_kernels")
        ids = delivered_ids(indices)
        if ids is not None:  # its own rows, exactly
            if kernels is not None:
                return int(kernels.delivered_rows(slots, bound, ids, self.row, current))
            if slots.size and (slots.min() < 0 or slots.max() >= bound):
                return -1
            np.equal(self.row[slots], ids, out=current)
            return int(current.sum())
        if kernels is not None:
            return int(kernels.current_rows(slots, bound, self.delivered, self.row, current))
        if slots.size and (slots.min() < 0 or slots.max() >= bound):
            return -1
        delivered = self.delivered[slots]
        np.logical_or(delivered == -1, delivered == self.row[slots], out=current)
        return int(current.sum())

    def forget(self, slots: slice) -> None:
        """Slots ``slots`` hold no row and never delivered one."""
        self.row[slots] = -1
        self.delivered[slots] = -1

    def clear(self) -> None:
        """No slot holds a row; the ids each slot delivered are kept (an update for them is
        skipped, and never lands on rows written later, which get new ids)."""
        self.row.fill(-1)

    def load(self, row: np.ndarray, delivered: np.ndarray) -> None:
        """Take the ids ``row`` and ``delivered`` (copied in place)."""
        self.row[:], self.delivered[:] = row, delivered
