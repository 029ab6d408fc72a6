"""Ring writer: picks the slots new rows go to, oldest first once the store is full."""

from __future__ import annotations

import numpy as np
import torch

from conduit.errors import CapacityError, StateError
from conduit.storage.state import StateDict, integer

_MAX_ROWS = 2**63 - 1
"""The most rows a ring can count: row ids are int64."""


class RingWriter:
    """Round-robin slot allocation over ``capacity`` rows.

    Args:
        capacity: Rows in the store.
    """

    def __init__(self, *, capacity: int) -> None:
        self.capacity = capacity
        self.cursor = 0
        self.size = 0
        self.total_written = 0

    def reserve(self, n: int) -> list[tuple[int, int, int]]:
        """Claim ``n`` slots.

        Returns:
            At most two ``(store_start, batch_start, length)`` contiguous pieces.

        Raises:
            CapacityError: ``n`` exceeds the capacity (the batch would overwrite itself), or
                the rows would take row ids past 2**63 - 1 (nothing changes).
        """
        if n > self.capacity:
            raise CapacityError(f"a write of {n} rows is larger than the buffer capacity "
                                f"{self.capacity}; split it or raise capacity",
                                needed=n, available=self.capacity)
        if self.total_written + n > _MAX_ROWS + 1:
            raise CapacityError(f"a write of {n} rows after {self.total_written} would take "
                                f"row ids past 2**63 - 1", needed=n,
                                available=_MAX_ROWS + 1 - self.total_written)
        pieces = []
        first = min(n, self.capacity - self.cursor)
        if first:
            pieces.append((self.cursor, 0, first))
        if n - first:
            pieces.append((0, first, n - first))
        self.cursor = (self.cursor + n) % self.capacity
        self.size = min(self.capacity, self.size + n)
        self.total_written += n
        return pieces

    @staticmethod
    def indices(pieces: list[tuple[int, int, int]]) -> torch.Tensor:
        """The slot indices covered by ``pieces``, in batch order."""
        if not pieces:
            return torch.empty(0, dtype=torch.int64)
        if len(pieces) == 1:  # (numpy's arange: torch's costs more than a small write)
            s, _, n = pieces[0]
            return torch.from_numpy(np.arange(s, s + n, dtype=np.int64))
        return torch.from_numpy(np.concatenate([np.arange(s, s + n, dtype=np.int64)
                                                for s, _, n in pieces]))

    def logical_order(self) -> torch.Tensor:
        """Slot indices from oldest to newest."""
        if self.size < self.capacity:
            return torch.arange(self.size, dtype=torch.int64)
        return (torch.arange(self.capacity, dtype=torch.int64) + self.cursor) % self.capacity

    def reset(self) -> None:
        """Forget all rows (the next write starts at slot 0)."""
        self.cursor = 0
        self.size = 0

    def state_dict(self) -> StateDict:
        """Cursor and fill level."""
        return {"cursor": self.cursor, "size": self.size, "total_written": self.total_written}

    def load_state_dict(self, state: StateDict) -> None:
        """Restore from :meth:`state_dict`.

        Raises:
            StateError: A missing key, or a cursor, size or count that no ring of this
                capacity can have (a count must be below 2**63, the row ids being int64).
        """
        where = "writer"
        size = integer(state, "size", where, high=self.capacity)
        cursor = integer(state, "cursor", where, high=self.capacity - 1)
        total = integer(state, "total_written", where, low=size, high=_MAX_ROWS) \
            if "total_written" in state else size
        if size < self.capacity and cursor != size:
            raise StateError(f"{where}.cursor", f"{cursor}, but a ring that is not full writes "
                                                f"next at its size {size}")
        self.cursor, self.size, self.total_written = cursor, size, total
