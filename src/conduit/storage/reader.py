"""BufferReader: the read side of a buffer: draws, and gathers of drawn or given slots on the
data-path threads."""

from __future__ import annotations

import functools
from typing import Any

import torch

from conduit._checks import check_int
from conduit.errors import ConfigError
from conduit.spec import Batch
from conduit.storage.column_store import ColumnStore, Store
from conduit.storage.row_ledger import RowLedger
from conduit.storage.samplers import SampleInfo, Sampler
from conduit.storage.threads import GatherWorkers, data_path_threads
from conduit.storage.writer import RingWriter

#: The most rows one batch may hold: far more than memory holds for any row, and below the
#: sizes torch's draws refuse with errors of their own.
MAX_BATCH_ROWS = 2**31 - 1


def batch_rows(value: Any) -> int:
    """``value`` as the ``int`` rows of a batch, or ConfigError when it is not a positive
    integer (a Python or NumPy integer; not a bool) of at most :data:`MAX_BATCH_ROWS`."""
    if type(value) is int and 0 < value <= MAX_BATCH_ROWS:  # the usual case, in one call
        return value
    rows = check_int("batch_size", value, minimum=1)
    if rows > MAX_BATCH_ROWS:
        raise ConfigError("batch_size", f"must be at most {MAX_BATCH_ROWS} rows, got {rows}")
    return rows


def _checked_slots(indices: torch.Tensor, size: int) -> torch.Tensor:
    """Slots given by a caller, as int64: integers in ``[0, size)`` (checked before a
    gather, which would read an unfilled slot's leftovers, or on a sharded store an output
    row no shard fills).

    Raises:
        ConfigError: They are not such slots (field ``indices``).
    """
    if indices.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8,
                             torch.uint8):
        raise ConfigError("indices", f"must be integer slots (a batch's _index), got "
                                     f"dtype {indices.dtype}")
    if indices.device.type != "cpu":
        raise ConfigError("indices", f"must be on the CPU, got {indices.device}")
    if indices.dim() == 0:
        raise ConfigError("indices", f"must have a batch dimension, got a 0-d tensor "
                                     f"({int(indices)}); pass {int(indices)} as a "
                                     f"1-element tensor")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= size):
        raise ConfigError("indices", f"must be filled slots in [0, {size}), got "
                                     f"[{int(indices.min())}, {int(indices.max())}]")
    # A copy: the batch's ``_index`` is the caller's, and a later change to ``indices`` must
    # not change it (nor the row ids a gather keeps on it).
    return indices.to(torch.int64, copy=True)


def _check_draw(indices: torch.Tensor, size: int) -> None:
    """Refuse a draw whose slots are not all in ``[0, size)`` (slots forgotten since it was
    drawn, by :meth:`ExperienceBuffer.clear`, :meth:`ExperienceBuffer.drop_newest`,
    :meth:`ExperienceBuffer.load_state_dict` or :meth:`ExperienceBuffer.adopt`).

    Raises:
        ConfigError: Such a slot (field ``indices``).
    """
    slots = indices.numpy()
    if slots.size and (slots.min() < 0 or slots.max() >= size):
        raise ConfigError("indices", f"the draw names slots [{int(slots.min())}, "
                                     f"{int(slots.max())}], but only [0, {size}) hold rows "
                                     f"now (rows were cleared or dropped since it was "
                                     f"drawn); draw again")


class BufferReader:
    """The read side of an :class:`~conduit.storage.ExperienceBuffer`: draws from its sampler
    and gathers the rows drawn from its store, on the data-path threads, recording the rows
    delivered where the sampler takes priority updates.

    Not thread-safe: the buffer calls it under its lock.

    Args:
        threads: Threads of the data path (see
            :func:`~conduit.storage.threads.data_path_threads`).
        rows: The buffer's row ledger.

    Attributes:
        threads: See ``threads`` above.
        workers: The pool a large gather is split over with ``threads > 1`` (made on the
            first such gather), or None.
    """

    def __init__(self, *, threads: int, rows: RowLedger) -> None:
        self.threads = threads
        self.workers: GatherWorkers | None = None
        self._rows = rows
        self._drawn_store: Store | None = None  # (see _gathers_drawn)

    @property
    def mode(self) -> str | None:
        """How large gathers run with ``threads > 1`` (see
        :attr:`ExperienceBuffer.gather_mode`)."""
        workers = self.workers
        return None if workers is None or self.threads < 2 else workers.mode

    def _pool(self) -> GatherWorkers:
        """The pool of a buffer with more than one data-path thread (made on first use)."""
        workers = self.workers
        if workers is None:
            workers = self.workers = GatherWorkers(threads=self.threads)
        return workers

    @staticmethod
    def draw(sampler: Sampler, writer: RingWriter, batch_size: int) -> SampleInfo:
        """``batch_size`` slots drawn by ``sampler`` from ``writer``'s filled slots; a draw of
        slices records the rows written so far.

        Raises:
            EmptyBufferError: The sampler has nothing to draw from.
        """
        info = sampler.sample(writer.size, batch_size)
        if sampler.draws_slices:
            info = SampleInfo(info.indices, info.weights, writer.total_written)
        return info

    def resolve(self, info: Any, sampler: Sampler, writer: RingWriter) -> SampleInfo:
        """The draw to gather for ``info`` (a draw, or a tensor of slots): checked against the
        slots filled now, with each slice a write reached since drawn again.

        Raises:
            ConfigError: ``info`` is neither a draw nor a tensor, or names slots outside
                ``[0, writer.size)`` (field ``indices``).
            EmptyBufferError: A slice must be drawn again and the sampler has nothing to
                draw from.
        """
        if isinstance(info, torch.Tensor):
            info = SampleInfo(_checked_slots(info, writer.size))
        elif not isinstance(info, SampleInfo):
            raise ConfigError("indices", f"must be a SampleInfo or a tensor of slots, got "
                                         f"{type(info).__name__}; pass "
                                         f"torch.as_tensor(slots)")
        elif self._rows.forgets:  # (until rows are forgotten, every slot drawn still holds one)
            _check_draw(info.indices, writer.size)
        if info.written is not None and info.written != writer.total_written:
            info = self._redraw_reached(info, sampler, writer)
        return info

    def _redraw_reached(self, info: SampleInfo, sampler: Sampler,
                        writer: RingWriter) -> SampleInfo:
        """``info``, a draw of slices, with each slice that holds a row written since the draw
        (an id of at least ``info.written``) drawn again from the rows held now."""
        reached = self._rows.reached(info.indices, info.written)
        k = int(reached.sum())
        if not k:
            return info
        fresh = sampler.sample(writer.size, k)
        keep = torch.from_numpy(reached)
        indices = info.indices.clone()
        indices[keep] = fresh.indices
        weights = info.weights
        if weights is not None and fresh.weights is not None:
            weights = weights.clone()
            weights[keep] = fresh.weights
        return SampleInfo(indices, weights, writer.total_written)

    def sample(self, sampler: Sampler, writer: RingWriter, store: Store, batch_size: int,
               device: torch.device | None) -> Batch:
        """Draw ``batch_size`` slots from ``writer``'s filled ones and gather their rows: with
        a gather on one thread (one data-path thread, or a gather too small to split), a
        sampler that :attr:`~Sampler.draws_into` and a host column store gathering for the
        host, the draw goes straight into the batch's reused ``_index``
        (:meth:`ColumnStore.gather_drawn`); otherwise a draw, then :meth:`read`. The slots
        and rows are the same either way.

        Raises:
            EmptyBufferError: The sampler has nothing to draw from.
        """
        if (device is None and (store is self._drawn_store or self._gathers_drawn(store))
                and sampler.draws_into and (self.threads == 1 or self._pool().alone(
                    batch_size * store.spec.bytes_per_sample))):
            draw = functools.partial(sampler.sample_into, writer.size)  # (draw(out))
            if torch.get_num_threads() == 1:
                return store.gather_drawn(batch_size, draw)
            with data_path_threads(1):
                return store.gather_drawn(batch_size, draw)
        return self.read(sampler.sample(writer.size, batch_size), store, sampler, device)

    def _gathers_drawn(self, store: Store) -> bool:
        """Whether ``store`` is a column store that :attr:`~ColumnStore.gathers_drawn`
        (remembered as :attr:`_drawn_store`: a store's answer does not change)."""
        if isinstance(store, ColumnStore) and store.gathers_drawn:
            self._drawn_store = store
            return True
        return False

    def read(self, info: SampleInfo, store: Store, sampler: Sampler,
             device: torch.device | None) -> Batch:
        """The rows of the draw ``info`` from ``store``, with ``_index`` and, when weighted,
        ``_weight``."""
        indices = info.indices
        if self.threads > 1 and isinstance(store, ColumnStore):
            # Several data-path threads: a large gather may be split over row ranges on the
            # buffer's own pool, each range on one torch thread (see GatherWorkers).
            with data_path_threads(1):
                out = store.get(indices, device=device, workers=self._pool())
        elif torch.get_num_threads() == self.threads:  # usually right already: no switch
            out = store.get(indices, device=device)
        else:
            with data_path_threads(self.threads):
                out = store.get(indices, device=device)
        if sampler.accepts_priorities:
            # Only a priority update reads which row a slot delivered (see update_priorities).
            indices = self._rows.deliver(indices)
        out["_index"] = indices
        if info.weights is not None:
            out["_weight"] = info.weights
        return out
