"""BufferWriter: the write side of a buffer: rows into the slots its ring reserves, and the
newest rows taken back."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from conduit.errors import ConfigError
from conduit.storage.column_store import Store
from conduit.storage.row_ledger import RowLedger
from conduit.storage.samplers import Sampler
from conduit.storage.snapshot_tracker import SnapshotTracker
from conduit.storage.writer import RingWriter


class BufferWriter:
    """The write side of an :class:`~conduit.storage.ExperienceBuffer`: writes a batch into
    the slots its :class:`~conduit.storage.RingWriter` reserves, keeping the row ids, the
    sampler and the snapshots in progress in step, and takes the newest rows back.

    Not thread-safe: the buffer calls it under its lock.

    Args:
        rows: The buffer's row ledger.
        snapshots: The buffer's snapshots in progress.
    """

    def __init__(self, *, rows: RowLedger, snapshots: SnapshotTracker) -> None:
        self._rows = rows
        self._snapshots = snapshots

    def extend(self, data: Mapping[str, torch.Tensor], n: int, writer: RingWriter,
               store: Store, sampler: Sampler) -> torch.Tensor:
        """Write the ``n`` rows of ``data`` (checked against the spec) into ``store``.

        Returns:
            The slots written, CPU int64, in batch order.

        Raises:
            CapacityError: ``writer`` refuses ``n`` rows (nothing is written).
            Exception: Whatever ``store`` raises; the ring, the row ids and the sampler then
                stay as they were.
        """
        self._snapshots.wrote(n)
        first_id, cursor, size = writer.total_written, writer.cursor, writer.size
        pieces = writer.reserve(n)
        try:
            for store_start, b0, length in pieces:
                part = (data if length == n else
                        {k: v[b0:b0 + length] for k, v in data.items()})
                self._snapshots.before_rows(store_start, store_start + length)
                store.set_range(store_start, part)
        except BaseException:  # the rows are not the buffer's: it stays as it was
            writer.cursor, writer.size, writer.total_written = cursor, size, first_id
            raise
        for store_start, b0, length in pieces:
            self._rows.written(store_start, length, first_id + b0)
        idx = RingWriter.indices(pieces)
        sampler.on_write(idx, data, size=writer.size)
        return idx

    def take_back(self, n: int, writer: RingWriter, sampler: Sampler) -> None:
        """Forget the ``n`` newest rows, as if they had never been written.

        Raises:
            ConfigError: ``n`` is not in ``[0, writer.size]``, the ring has wrapped part way,
                or ``sampler`` keeps per-row state.
        """
        w = writer
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= w.size:
            raise ConfigError("n", f"must be an integer in [0, {w.size}], got {n!r}")
        if w.size == w.capacity and w.cursor != 0:
            raise ConfigError("n", "the ring has wrapped part way: its newest rows took "
                                   "the slots of older ones, which cannot come back")
        if type(sampler).on_write is not Sampler.on_write:
            raise ConfigError("sampler", f"{type(sampler).__name__} keeps per-row "
                                         f"state; rows cannot be taken back from it")
        if n == 0:
            return
        self._rows.forget(slice(w.size - n, w.size))
        w.size -= n
        w.cursor = w.size
        w.total_written -= n
