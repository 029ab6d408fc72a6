"""SnapshotTracker: the copy-on-write snapshots of one buffer that are still being read out."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from conduit.storage.column_store import Store
from conduit.storage.row_ids import ID_ARRAYS
from conduit.storage.snapshot import Blocks, RowSnapshot, sleep_share
from conduit.storage.state import StateDict


def filled_blocks(store: Store, fields: Sequence[str], size: int) -> Blocks:
    """Views (not copies) of ``store``'s slots ``[0, size)``: ``(first slot, columns)`` per
    part of the store (one per shard), each with the columns ``fields``."""
    shards = getattr(store, "shards", None)
    if shards is None:
        return [(0, {n: store.column(n)[:size] for n in fields})]
    blocks = []
    for k, shard in enumerate(shards):
        start = int(store.bounds[k])
        n = min(size, int(store.bounds[k + 1])) - start
        if n > 0:
            blocks.append((start, {f: shard.column(f)[:n] for f in fields}))
    return blocks


class SnapshotTracker:
    """The :class:`~conduit.storage.snapshot.RowSnapshot` objects of one buffer that are still
    being read out: it starts and stops tracking them, and before the buffer changes rows it
    copies aside into each what the change would alter.

    Not thread-safe: the buffer calls it under its lock, except :meth:`read_out`, which takes
    that lock itself for each chunk it checks.

    Args:
        lock: The buffer's lock, held by every write.

    Attributes:
        live: The snapshots tracked now (the list is changed in place only).
        largest_write: Rows of the largest write so far (twice that is a snapshot's lead).
    """

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self.live: list[RowSnapshot] = []
        self.largest_write = 0

    def wrote(self, rows: int) -> None:
        """A write of ``rows`` rows begins."""
        if rows > self.largest_write:
            self.largest_write = rows

    def before_rows(self, first: int | None = None, stop: int | None = None) -> None:
        """Copy aside the rows of slots ``[first, stop)`` (None: every row of each snapshot)
        before they change."""
        for snap in self.live:
            snap.preserve(0 if first is None else first, snap.size if stop is None else stop)

    def before_ids(self, name: str | None = None,
                   where: slice | np.ndarray | None = None) -> None:
        """Copy aside the ids ``name`` (None: every id array) at ``where`` (None: every slot)
        before they change (see :meth:`RowSnapshot.preserve_ids`)."""
        for snap in self.live:
            snap.preserve_ids(name, where)

    def begin(self, *, views: Blocks, state: StateDict, ids: Mapping[str, np.ndarray],
              spare: Mapping[tuple[int, str], torch.Tensor] | None = None) -> RowSnapshot:
        """Start tracking a snapshot of the rows ``views`` and the ids ``ids`` at this instant.

        Args:
            views: The live filled slots (:func:`filled_blocks`).
            state: The buffer's small state at this instant, with the live id arrays.
            ids: Name -> live per-slot id array.
            spare: ``kept`` of an earlier snapshot, whose memory is reused.

        Returns:
            The snapshot, tracked until :meth:`drop`.
        """
        snap = RowSnapshot(views=views, state=state, lock=self._lock, ids=ids, spare=spare,
                           lead_rows=2 * self.largest_write)
        self.live.append(snap)
        return snap

    @staticmethod
    def read_out(snap: RowSnapshot, *, chunk_bytes: int, duty: float) -> Blocks:
        """Read ``snap`` out into new CPU tensors, about ``chunk_bytes`` at a time, and put
        copies of its ids into its ``state``.

        Returns:
            Its rows, laid out as :func:`filled_blocks`.

        Raises:
            ConfigError: ``duty`` is outside ``(0, 1]``.
        """
        sleep_share(duty)  # checked here too: an empty snapshot reads no column
        blocks = snap.materialize(chunk_bytes=chunk_bytes, duty=duty)
        for name in ID_ARRAYS:
            snap.state[name] = torch.from_numpy(snap.ids(name))
        return blocks

    def drop(self, snap: RowSnapshot) -> None:
        """Stop tracking ``snap`` (nothing happens when it is not tracked)."""
        if snap in self.live:
            self.live.remove(snap)
