"""BufferState: a buffer's parts saved as one state dict and restored all or nothing."""

from __future__ import annotations

import numpy as np
import torch

from conduit.errors import StateError
from conduit.storage.column_store import Store
from conduit.storage.row_ids import ID_ARRAYS
from conduit.storage.row_ledger import RowLedger
from conduit.storage.samplers import Sampler
from conduit.storage.snapshot_tracker import SnapshotTracker
from conduit.storage.state import StateDict, array, entry
from conduit.storage.writer import RingWriter


class BufferState:
    """Saves a buffer's ring writer, sampler, row ids and (optionally) store as one state dict,
    and restores them from it all or nothing.

    Not thread-safe: the buffer calls it under its lock.

    Args:
        capacity: Slots of the buffer.
        rows: The buffer's row ledger.
        snapshots: The buffer's snapshots in progress (a restore of the rows first copies
            aside what it replaces).
    """

    def __init__(self, *, capacity: int, rows: RowLedger, snapshots: SnapshotTracker) -> None:
        self.capacity = capacity
        self._rows = rows
        self._snapshots = snapshots

    def save(self, writer: RingWriter, sampler: Sampler, store: Store | None = None, *,
             live: bool = False) -> StateDict:
        """The state of ``writer``, ``sampler``, the row ids and (unless None) ``store``.

        Args:
            writer: The buffer's ring writer.
            sampler: The buffer's sampler.
            store: The buffer's store, or None to leave the rows out.
            live: Give the live id arrays instead of copies.
        """
        saved = {} if store is None else {"store": store.state_dict()}
        ids = {name: torch.from_numpy(a if live else a.copy())
               for name, a in self._rows.arrays().items()}
        return {**saved, "writer": writer.state_dict(), "sampler": sampler.state_dict(), **ids}

    def load(self, state: StateDict, writer: RingWriter, sampler: Sampler,
             store: Store | None) -> None:
        """Restore ``writer``, ``sampler``, the row ids and (unless None) ``store`` from
        :meth:`save`; when one refuses its entry, nothing changes.

        Raises:
            StateError: A key is missing or a value would corrupt the buffer.
            SpecError, CapacityError: The saved store does not match ``store``.
        """
        # All or nothing: every part checks its entry before it changes anything, and a
        # part that refuses puts back the parts loaded before it (the rows come last).
        ids = {key: array(state, key, "buffer", length=self.capacity, dtype=np.int64)
               for key in ID_ARRAYS}
        scratch = RingWriter(capacity=self.capacity)
        scratch.load_state_dict(entry(state, "writer", "buffer"))
        before = sampler.state_dict()
        try:  # a sampler that refuses part way is put back too
            sampler.load_state_dict(entry(state, "sampler", "buffer"))
            sampler.check_rows(size=scratch.size, head=scratch.cursor)
            if store is not None:
                self._snapshots.before_rows()
                store.load_state_dict(entry(state, "store", "buffer"))
        except BaseException:
            sampler.load_state_dict(before)
            raise
        writer.load_state_dict(scratch.state_dict())
        self._rows.load(ids["row_id"], ids["delivered_id"])

    def rows_in(self, state: StateDict) -> int:
        """The rows a buffer loaded from ``state`` would hold.

        Raises:
            StateError: The state is of a buffer with another capacity (its ``row_id`` has
                another length), or the writer's entry is missing or out of range.
        """
        shape = getattr(entry(state, "row_id", "buffer"), "shape", None)
        if shape is not None and len(shape) == 1 and shape[0] != self.capacity:
            raise StateError("buffer.row_id", f"the state is of a buffer with capacity "
                                              f"{shape[0]}, this one holds {self.capacity} "
                                              f"rows; load it where capacity={shape[0]}")
        array(state, "row_id", "buffer", length=self.capacity, dtype=np.int64)
        scratch = RingWriter(capacity=self.capacity)
        scratch.load_state_dict(entry(state, "writer", "buffer"))
        return scratch.size
