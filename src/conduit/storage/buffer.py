"""ExperienceBuffer: a store, a ring writer and a sampler, composed (TorchRL's shape).

The buffer's own work is done by parts too: :class:`~conduit.storage.buffer_writer.BufferWriter`
(writes), :class:`~conduit.storage.reader.BufferReader` (draws and gathers),
:class:`~conduit.storage.row_ledger.RowLedger` (row ids and priority updates),
:class:`~conduit.storage.snapshot_tracker.SnapshotTracker` (snapshots in progress) and
:class:`~conduit.storage.buffer_state.BufferState` (state dicts); the buffer holds the lock
they all run under.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import psutil
import torch

from conduit._checks import check_device, check_int
from conduit.errors import CapacityError, ConfigError
from conduit.spec import Batch, ExperienceSpec
from conduit.storage.buffer_state import BufferState
from conduit.storage.buffer_writer import BufferWriter
from conduit.storage.column_store import Store, make_store
from conduit.storage.layout import Placement
from conduit.storage.reader import MAX_BATCH_ROWS, BufferReader, batch_rows
from conduit.storage.row_ids import ID_BYTES_PER_SLOT
from conduit.storage.row_ledger import RowLedger, priority_arguments, priority_input
from conduit.storage.samplers import SampleInfo, Sampler, UniformSampler
from conduit.storage.snapshot import Blocks, RowSnapshot
from conduit.storage.snapshot_tracker import SnapshotTracker, filled_blocks
from conduit.storage.state import StateDict
from conduit.storage.threads import data_path_threads
from conduit.storage.writer import RingWriter

__all__ = ["MAX_BATCH_ROWS", "ExperienceBuffer", "priority_input"]


def _check_slot_memory(capacity: int, sampler: Sampler) -> None:
    """Refuse a ``capacity`` whose per-slot host state, the row ids
    (:data:`~conduit.storage.row_ids.ID_BYTES_PER_SLOT`) and the sampler's
    (:meth:`Sampler.bind_bytes`, such as a sum tree), does not fit the host memory available.
    The store checks its own columns, but columns of no bytes, or of files (a
    :class:`~conduit.storage.MemmapColumnStore`), leave that state unchecked, and allocating it
    would fail untyped or be killed by the OS part way.

    Raises:
        CapacityError: It does not fit (the message names ``capacity``).
    """
    need = ID_BYTES_PER_SLOT * capacity + sampler.bind_bytes(capacity)
    free = int(psutil.virtual_memory().available)
    if need > free:
        raise CapacityError(f"capacity: {capacity:,} slots need {need / 1e9:.2f} GB of host "
                            f"memory for their row ids and the {type(sampler).__name__}'s "
                            f"per-row state, more than the {free / 1e9:.2f} GB available; "
                            f"reduce capacity", needed=need, available=free)


def _check_parts(spec: Any, sampler: Any, placement: Any, store: Any) -> None:
    """Refuse constructor arguments of the wrong type, naming them.

    Raises:
        ConfigError: One is not of its type.
    """
    if not isinstance(spec, ExperienceSpec):
        raise ConfigError("spec", f"expected an ExperienceSpec (ExperienceSpec.of(obs=((4,), "
                                  f"torch.float32), ...)), got {type(spec).__name__}")
    if sampler is not None and not isinstance(sampler, Sampler):
        raise ConfigError("sampler", f"expected a Sampler (UniformSampler(), "
                                     f"PrioritizedSampler(), ...), got {sampler!r}; names such "
                                     f"as 'uniform' are for ExperienceDataPlane")
    if placement is not None and not isinstance(placement, Placement):
        raise ConfigError("placement", f"expected a Placement (Placement.pageable(), "
                                       f"Placement.pinned(), ...), got {placement!r}")
    if store is not None and not all(hasattr(store, a) for a in ("spec", "capacity", "get")):
        raise ConfigError("store", f"expected a store (ColumnStore, MemmapColumnStore, "
                                   f"...), got {type(store).__name__}")


def _store_for(spec: ExperienceSpec, capacity: int, placement: Placement | None,
               store: Store | None) -> Store:
    """``store``, or when None a new one for ``placement``.

    Raises:
        ConfigError: ``store`` does not hold ``capacity`` rows of ``spec``.
    """
    if store is None:
        return make_store(spec=spec, capacity=capacity, placement=placement)
    if store.spec != spec or store.capacity != capacity:
        raise ConfigError("store", f"holds {store.capacity} rows of {store.spec}, the "
                                   f"buffer needs {capacity} rows of {spec}")
    return store


class ExperienceBuffer:
    """A replay or rollout buffer: validated vectorized writes, sampled vectorized reads.

    All methods are thread-safe: one lock orders writes against reads, so a gather never sees
    a half-written row.

    Every row has an id, its position in the write order (Reverb's key): a gather remembers
    the ids it delivered, so a priority update applies only to the rows that were sampled and
    not to rows written into their slots since.

    Args:
        spec: Fields of one sample.
        capacity: Rows.
        sampler: Which rows a batch reads (default: uniform with replacement).
        placement: Where the rows live (default: pageable CPU).
        store: A store to use instead of allocating one for ``placement`` (for example a
            :class:`~conduit.storage.MemmapColumnStore`); its spec and capacity must match.
        threads: Threads of the data path (see
            :func:`~conduit.storage.threads.data_path_threads`). Above one, a large gather
            from a single-device store may run on that many threads (split over row ranges on
            a pool the buffer owns, or on torch's intra-op threads) where and while that
            measures faster (:class:`~conduit.storage.threads.GatherWorkers`,
            :attr:`gather_mode`); the rows gathered are the same.

    Raises:
        ConfigError: ``threads`` is not a positive integer; ``spec``, ``sampler``,
            ``placement`` or ``store`` is not of its type; ``store`` does not match ``spec``
            and ``capacity``; or ``sampler`` needs a field ``spec`` lacks (such as a
            :class:`~conduit.storage.SequenceSampler`'s ``boundary_key``) or more rows than
            ``capacity`` (its ``length``).
        CapacityError: The columns (see the store), or the per-slot state besides them (row
            ids, 16 bytes a slot, and the sampler's, such as a sum tree), do not fit the host
            memory available (the message names ``capacity``).
    """

    def __init__(self, *, spec: ExperienceSpec, capacity: int, sampler: Sampler | None = None,
                 placement: Placement | None = None, threads: int = 1,
                 store: Store | None = None) -> None:
        threads = check_int("threads", threads, minimum=1)
        _check_parts(spec, sampler, placement, store)
        sampler = sampler or UniformSampler()
        sampler.check_spec(spec)
        self.spec = spec
        self.store = _store_for(spec, capacity, placement, store)
        self.capacity = self.store.capacity
        self.writer = RingWriter(capacity=self.capacity)
        self.sampler = sampler
        _check_slot_memory(self.capacity, sampler)
        self._lock = threading.RLock()
        self._tracker = SnapshotTracker(self._lock)
        try:
            self.sampler.bind(self.capacity)
            self._rows = RowLedger(self.capacity, self._tracker)
        except MemoryError as exc:  # (the check above counted memory that went meanwhile)
            raise CapacityError(f"capacity: cannot allocate the row ids and sampler state of "
                                f"{self.capacity:,} slots: {exc}") from exc
        # No slot holds a row yet: a sampler that served another buffer forgets its rows
        # (priorities, boundaries, an epoch's layout), which would be drawn from here.
        self.sampler.reset()
        self._reader = BufferReader(threads=int(threads), rows=self._rows)
        self._writer = BufferWriter(rows=self._rows, snapshots=self._tracker)
        self._state = BufferState(capacity=self.capacity, rows=self._rows,
                                  snapshots=self._tracker)
        self._row_id, self._delivered_id = self._rows.row, self._rows.delivered  # (in place)
        self._snapshots = self._tracker.live  # copies in progress (begin_snapshot; in place)

    @property
    def placement(self) -> Placement:
        """Where the rows live."""
        return self.store.placement

    def __len__(self) -> int:
        return self.writer.size

    @property
    def total_written(self) -> int:
        """Rows ever written (including overwritten ones)."""
        return self.writer.total_written

    @property
    def threads(self) -> int:
        """Threads of the data path (see the constructor's ``threads``)."""
        return self._reader.threads

    @threads.setter
    def threads(self, threads: int) -> None:
        self._reader.threads = threads

    def extend(self, batch: Mapping[str, Any], *, validate: bool = True) -> torch.Tensor:
        """Append rows, overwriting the oldest once full.

        Args:
            batch: Field -> tensor (or numpy array) with a leading batch dimension.
            validate: Check against the spec (skip only for batches already checked).

        Returns:
            The slots written, CPU int64, in batch order.

        Raises:
            SpecError: The batch does not match the spec.
            CapacityError: The batch has more rows than the buffer, or would take row ids
                past 2**63 - 1 (nothing is written).
            PlacementError: The store refuses the write (a
                :class:`~conduit.storage.MemmapColumnStore` whose column was moved off its
                file). Whatever the store raises, the ring (fill level, cursor, rows
                written), the row ids and the sampler stay as they were; only a store that
                fails part way leaves the slots it had begun to write changed.
        """
        if validate:
            data, n = self.spec.validate(batch, what="write")
        else:
            data = dict(batch)
            n = next(iter(data.values())).shape[0]
        with self._lock, data_path_threads(1):
            return self._writer.extend(data, n, self.writer, self.store, self.sampler)

    def draw(self, batch_size: int) -> SampleInfo:
        """Pick indices (no gather).

        A draw of slices of the write order (a sampler with
        :attr:`~conduit.storage.samplers.Sampler.draws_slices`, such as a
        :class:`~conduit.storage.SequenceSampler`) records the rows written so far, so that
        :meth:`gather` can tell the slices that later writes reached.

        Raises:
            ConfigError: ``batch_size`` is not a positive integer.
            EmptyBufferError: The sampler has nothing to draw from.
        """
        batch_size = batch_rows(batch_size)
        with self._lock:
            return self._reader.draw(self.sampler, self.writer, batch_size)

    def gather(self, info: SampleInfo | torch.Tensor, *,
               device: torch.device | None = None) -> Batch:
        """Read rows for a draw; adds ``_index`` and, when weighted, ``_weight``.

        The returned tensors are the caller's: later gathers never write into them while
        anything refers to them (see :class:`~conduit.storage.column_store.GatherOutputs`).

        A row of a draw may have been overwritten by a write since the draw (a draw and its
        gather hold the buffer's lock one after the other, not together): the gather reads
        the row the slot holds now. A slice of a draw of slices (:meth:`draw` of a
        :class:`~conduit.storage.SequenceSampler`) that such a write reached would mix two
        stretches of the write order, so it is drawn again, from the rows held now, for this
        gather (the draw itself is left as it was).

        Args:
            info: A draw (:meth:`draw`), or a CPU integer tensor of filled slots with at
                least one dimension.
            device: Where the rows go (default: where the store lives).

        Raises:
            ConfigError: ``info`` is neither a draw nor a tensor (a list or numpy array:
                pass ``torch.as_tensor`` of it), or a tensor of slots that are not integers
                on the CPU, has no dimension, or names slots outside ``[0, len(self))``
                (field ``indices``); ``device`` is not a device this machine has (field
                ``device``).
            EmptyBufferError: A slice of a draw of slices must be drawn again and the
                sampler has nothing to draw from now.
        """
        device = None if device is None else check_device("device", device)
        with self._lock:
            info = self._reader.resolve(info, self.sampler, self.writer)
            return self._reader.read(info, self.store, self.sampler, device)

    def sample(self, batch_size: int, *, device: torch.device | None = None) -> Batch:
        """Draw and gather one batch, with ``_index`` and, when weighted, ``_weight``.

        The returned tensors, ``_index`` included, are the caller's, as :meth:`gather`'s: later
        samples never write into them while anything refers to them.

        Raises:
            ConfigError: ``batch_size`` is not a positive integer, or ``device`` is not a
                device this machine has.
            EmptyBufferError: The sampler has nothing to draw from.
        """
        batch_size = batch_rows(batch_size)
        device = None if device is None else check_device("device", device)
        with self._lock:
            return self._reader.sample(self.sampler, self.writer, self.store, batch_size,
                                       device)

    @property
    def gather_mode(self) -> str | None:
        """How large gathers run with ``threads > 1``: one of
        :data:`~conduit.storage.threads.GATHER_MODES` once measured (see
        :class:`~conduit.storage.threads.GatherWorkers`); None with one thread, before the
        first large gather, or while the trials run."""
        return self._reader.mode

    def update_priorities(self, indices: torch.Tensor, priorities: torch.Tensor) -> int:
        """Set the priorities of delivered rows (prioritized samplers only).

        An update for a slot whose delivered row has been overwritten or forgotten since
        (:meth:`clear`) is skipped: it belongs to a row that is gone, not to the row that took
        its slot, nor to a slot that holds no row now. Given a recent
        batch's ``_index`` tensor (or a slice of it) as delivered, the update is matched to
        that batch's rows exactly, even when the row that took a slot was delivered too;
        given other indices (a copy, a list, a tensor moved between devices), to the row
        last delivered from each slot.

        Args:
            indices: Slots, as delivered in a batch's ``_index`` (integers).
            priorities: One per index.

        Returns:
            How many rows were updated.

        Raises:
            PriorityError: Indices that are not integers, not slots of the buffer (outside
                ``[0, capacity)``), or slots that hold no row and never delivered one;
                priorities that are not finite and non-negative; mismatched lengths.
        """
        idx, pr = priority_arguments(indices, priorities)
        with self._lock:
            return self._rows.update_priorities(indices, idx, pr, self.sampler, len(self))

    def drop_newest(self, n: int) -> None:
        """Forget the ``n`` newest rows, as if they had never been written: the next write
        goes to their slots and gets their ids (an ingestion that failed part way takes its
        rows back).

        Raises:
            ConfigError: ``n`` is not in ``[0, len(self)]``, the ring has wrapped part way
                (its rows do not fill slots ``[0, len(self))`` oldest first), or the sampler
                keeps per-row state (priorities, sequence starts) that would outlive them.
        """
        with self._lock:
            self._writer.take_back(n, self.writer, self.sampler)

    def clear(self) -> None:
        """Forget all rows (storage stays allocated).

        The ids of the rows last delivered from each slot are kept (rows written after the
        clear get new ids), so a priority update for rows delivered before the clear is
        skipped, as for rows overwritten by a wraparound, and never lands on the rows written
        since.
        """
        with self._lock:
            self.writer.reset()
            self.sampler.reset()
            self._rows.clear()

    def filled_blocks(self) -> Blocks:
        """Views (not copies) of the filled slots ``[0, len(self))``: ``(first slot, columns)``
        per part of the store (one per shard)."""
        with self._lock:
            return filled_blocks(self.store, self.spec.fields, self.writer.size)

    def begin_snapshot(self, *, spare: Mapping[tuple[int, str], torch.Tensor] | None = None
                       ) -> RowSnapshot:
        """Take a snapshot of the buffer as it is now, copying nothing: its rows and ids are
        read out later (:meth:`RowSnapshot.stream_rows`, :meth:`complete_snapshot`) while
        writes and samples go on, a write first copying aside what it would change
        (copy-on-write). Call :meth:`drop_snapshot` once it is read out.

        Args:
            spare: ``kept`` of an earlier snapshot, whose memory is reused for the rows that
                writes set aside (see :class:`~conduit.storage.snapshot.RowSnapshot`).

        Returns:
            The snapshot; its ``state`` is :meth:`state_dict` ``(rows=False)`` at this
            instant, with the ids filled in as they are read out.
        """
        with self._lock:
            state = self._state.save(self.writer, self.sampler, live=True)
            return self._tracker.begin(views=self.filled_blocks(), state=state,
                                       ids=self._rows.arrays(), spare=spare)

    def complete_snapshot(self, snap: RowSnapshot, *, chunk_bytes: int = 2 << 20,
                          duty: float = 1.0) -> Blocks:
        """Read ``snap`` out into new CPU tensors, about ``chunk_bytes`` at a time while writes
        and samples go on, then stop tracking it (also on error); its ``state`` then holds
        copies of the ids.

        Args:
            snap: What :meth:`begin_snapshot` returned.
            chunk_bytes: Bytes per chunk.
            duty: Fraction of the time spent reading, in ``(0, 1]`` (see
                :meth:`RowSnapshot.stream_rows`).

        Returns:
            The rows at :meth:`begin_snapshot`, laid out as :meth:`filled_blocks`.

        Raises:
            ConfigError: ``duty`` is outside ``(0, 1]``.
        """
        try:
            return self._tracker.read_out(snap, chunk_bytes=chunk_bytes, duty=duty)
        finally:
            self.drop_snapshot(snap)

    def drop_snapshot(self, snap: RowSnapshot) -> None:
        """Stop tracking ``snap``: later writes no longer copy rows into it."""
        with self._lock:
            self._tracker.drop(snap)

    def adopt(self, other: ExperienceBuffer) -> None:
        """Take ``other``'s sampler (with its per-row state), ring cursor and row ids, after its
        rows were copied here slot for slot (a migration). A draw made here before is then
        refused by :meth:`gather` where it names slots outside ``[0, len(self))``, as after
        :meth:`clear`.

        Raises:
            ConfigError: ``other`` has another capacity, or its sampler needs a field this
                buffer's spec lacks (nothing changes).
        """
        if other.capacity != self.capacity:
            raise ConfigError("other", f"holds {other.capacity} slots, this buffer "
                                       f"{self.capacity}; a migration keeps the capacity")
        other.sampler.check_spec(self.spec)
        with self._lock:
            self.sampler = other.sampler
            self.writer.load_state_dict(other.writer.state_dict())
            self._rows.load(other._rows.row, other._rows.delivered)

    def state_dict(self, *, rows: bool = True) -> StateDict:
        """Writer cursor, sampler state, row ids and (``rows``) a copy of the store."""
        with self._lock:
            return self._state.save(self.writer, self.sampler, self.store if rows else None)

    def load_state_dict(self, state: StateDict, *, rows: bool = True) -> None:
        """Restore from :meth:`state_dict` (store placement may differ).

        Args:
            state: What :meth:`state_dict` returned.
            rows: Restore the store too (False: its rows were restored separately).

        Raises:
            StateError: A key is missing or a value would corrupt the buffer.
            SpecError, CapacityError: The saved store does not match this buffer.
        """
        with self._lock:
            self._state.load(state, self.writer, self.sampler, self.store if rows else None)

    def rows_in(self, state: StateDict) -> int:
        """The rows a buffer loaded from ``state`` (:meth:`state_dict`) would hold.

        Raises:
            StateError: The state is of a buffer with another capacity (its ``row_id`` has
                another length), or the writer's entry is missing or out of range.
        """
        return self._state.rows_in(state)
