"""ExperienceBuffer: a store, a ring writer and a sampler, composed (TorchRL's shape)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import psutil
import torch

from conduit._checks import check_device, check_int
from conduit.errors import CapacityError, ConfigError, PriorityError, StateError
from conduit.spec import Batch, ExperienceSpec
from conduit.storage.column_store import ColumnStore, Store, make_store
from conduit.storage.layout import Placement
from conduit.storage.row_ids import ID_BYTES_PER_SLOT, ROW_IDS_ATTR, RowIds
from conduit.storage.samplers import SampleInfo, Sampler, UniformSampler
from conduit.storage.snapshot import Blocks, RowSnapshot, sleep_share
from conduit.storage.state import StateDict, array, entry
from conduit.storage.threads import GatherWorkers, data_path_threads
from conduit.storage.writer import RingWriter

#: The most rows one batch may hold: far more than memory holds for any row, and below the
#: sizes torch's draws refuse with errors of their own.
MAX_BATCH_ROWS = 2**31 - 1


def _batch_size(value: Any) -> int:
    """``value`` as the ``int`` rows of a batch, or ConfigError when it is not a positive
    integer (a Python or NumPy integer; not a bool) of at most :data:`MAX_BATCH_ROWS`."""
    rows = check_int("batch_size", value, minimum=1)
    if rows > MAX_BATCH_ROWS:
        raise ConfigError("batch_size", f"must be at most {MAX_BATCH_ROWS} rows, got {rows}")
    return rows


def priority_input(values: Any, field: str) -> torch.Tensor:
    """``values`` of a priority update (its indices or priorities) as a flat CPU tensor
    without autograd history (no copy when it is one).

    Raises:
        PriorityError: They are not numbers (None, text, ragged lists); the message starts
            with ``field``.
    """
    if (isinstance(values, torch.Tensor) and values.dim() == 1 and values.device.type == "cpu"
            and not values.requires_grad):
        return values
    try:
        return torch.as_tensor(values).detach().cpu().reshape(-1)
    except (TypeError, ValueError, RuntimeError) as e:
        raise PriorityError(f"{field}: must be a tensor, array or list of numbers, got "
                            f"{type(values).__name__} ({e})") from None


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


def _check_priority_values(priorities: torch.Tensor) -> None:
    """Refuse priorities that are not real, finite and non-negative (checked before an update
    skips any of them, so a bad value is refused wherever it falls).

    Raises:
        PriorityError: Such a priority.
    """
    if priorities.is_complex():
        raise PriorityError(f"priorities: must be real numbers (|TD errors|), got "
                            f"{priorities.dtype} values")
    if priorities.is_floating_point() and not bool(torch.isfinite(priorities).all()):
        raise PriorityError("priorities: contain NaN or infinity; pass finite |TD errors|")
    if priorities.dtype != torch.bool and bool((priorities < 0).any()):
        raise PriorityError("priorities: contain negative values; pass |TD error|")


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
        if store is None:
            store = make_store(spec=spec, capacity=capacity, placement=placement)
        elif store.spec != spec or store.capacity != capacity:
            raise ConfigError("store", f"holds {store.capacity} rows of {store.spec}, the "
                                       f"buffer needs {capacity} rows of {spec}")
        self.store = store
        self.capacity = self.store.capacity
        self.writer = RingWriter(capacity=self.capacity)
        self.sampler = sampler
        _check_slot_memory(self.capacity, sampler)
        try:
            self.sampler.bind(self.capacity)
            self._ids = RowIds(self.capacity)
        except MemoryError as exc:  # (the check above counted memory that went meanwhile)
            raise CapacityError(f"capacity: cannot allocate the row ids and sampler state of "
                                f"{self.capacity:,} slots: {exc}") from exc
        # No slot holds a row yet: a sampler that served another buffer forgets its rows
        # (priorities, boundaries, an epoch's layout), which would be drawn from here.
        self.sampler.reset()
        self.threads = int(threads)
        self._lock = threading.RLock()
        self._row_id, self._delivered_id = self._ids.row, self._ids.delivered  # (in place only)
        self._snapshots: list[RowSnapshot] = []  # copies in progress (begin_snapshot)
        self._largest_write = 0  # rows of the largest extend so far (a snapshot's lead)
        # clear, drop_newest, load and adopt calls: a draw may name slots gone since
        self._forgets = 0

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
            if n > self._largest_write:
                self._largest_write = n
            w = self.writer
            first_id, cursor, size = w.total_written, w.cursor, w.size
            pieces = w.reserve(n)
            try:
                for store_start, b0, length in pieces:
                    part = (data if length == n else
                            {k: v[b0:b0 + length] for k, v in data.items()})
                    for snap in self._snapshots:
                        snap.preserve(store_start, store_start + length)
                        snap.preserve_ids("row_id", slice(store_start, store_start + length))
                    self.store.set_range(store_start, part)
            except BaseException:  # the rows are not the buffer's: it stays as it was
                w.cursor, w.size, w.total_written = cursor, size, first_id
                raise
            for store_start, b0, length in pieces:
                self._ids.written(store_start, length, first_id + b0)
            idx = RingWriter.indices(pieces)
            self.sampler.on_write(idx, data, size=self.writer.size)
        return idx

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
        batch_size = _batch_size(batch_size)
        with self._lock:
            info = self.sampler.sample(self.writer.size, batch_size)
            if self.sampler.draws_slices:
                info = SampleInfo(info.indices, info.weights, self.writer.total_written)
            return info

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
            if isinstance(info, torch.Tensor):
                info = SampleInfo(_checked_slots(info, self.writer.size))
            elif not isinstance(info, SampleInfo):
                raise ConfigError("indices", f"must be a SampleInfo or a tensor of slots, got "
                                             f"{type(info).__name__}; pass "
                                             f"torch.as_tensor(slots)")
            elif self._forgets:  # (until rows are forgotten, every slot drawn still holds one)
                _check_draw(info.indices, self.writer.size)
            if info.written is not None and info.written != self.writer.total_written:
                info = self._redraw_reached(info)
            return self._gather_locked(info, device)

    def _redraw_reached(self, info: SampleInfo) -> SampleInfo:
        """``info``, a draw of slices, with each slice that holds a row written since the draw
        (an id of at least ``info.written``) drawn again from the rows held now."""
        indices = info.indices
        reached = (self._row_id[indices.numpy()] >= info.written).reshape(
            indices.shape[0], -1).any(axis=1)
        k = int(reached.sum())
        if not k:
            return info
        fresh = self.sampler.sample(self.writer.size, k)
        keep = torch.from_numpy(reached)
        indices = indices.clone()
        indices[keep] = fresh.indices
        weights = info.weights
        if weights is not None and fresh.weights is not None:
            weights = weights.clone()
            weights[keep] = fresh.weights
        return SampleInfo(indices, weights, self.writer.total_written)

    def sample(self, batch_size: int, *, device: torch.device | None = None) -> Batch:
        """Draw and gather one batch.

        Raises:
            ConfigError: ``batch_size`` is not a positive integer, or ``device`` is not a
                device this machine has.
            EmptyBufferError: The sampler has nothing to draw from.
        """
        batch_size = _batch_size(batch_size)
        device = None if device is None else check_device("device", device)
        with self._lock:
            return self._gather_locked(self.sampler.sample(self.writer.size, batch_size),
                                       device)

    _workers: GatherWorkers | None = None

    @property
    def gather_mode(self) -> str | None:
        """How large gathers run with ``threads > 1``: one of
        :data:`~conduit.storage.threads.GATHER_MODES` once measured (see
        :class:`~conduit.storage.threads.GatherWorkers`); None with one thread, before the
        first large gather, or while the trials run."""
        workers = self._workers
        return None if workers is None or self.threads < 2 else workers.mode

    def _gather_locked(self, info: SampleInfo, device: torch.device | None) -> Batch:
        indices = info.indices
        if self.threads > 1 and isinstance(self.store, ColumnStore):
            # Several data-path threads: a large gather may be split over row ranges on the
            # buffer's own pool, each range on one torch thread (see GatherWorkers).
            if self._workers is None:
                self._workers = GatherWorkers(threads=self.threads)
            with data_path_threads(1):
                out = self.store.get(indices, device=device, workers=self._workers)
        elif torch.get_num_threads() == self.threads:  # usually right already: no switch
            out = self.store.get(indices, device=device)
        else:
            with data_path_threads(self.threads):
                out = self.store.get(indices, device=device)
        if self.sampler.accepts_priorities:
            # Only a priority update reads which row a slot delivered (see update_priorities).
            if hasattr(indices, ROW_IDS_ATTR):  # gathered before: this batch gets its own
                indices = indices.clone()
            for snap in self._snapshots:
                snap.preserve_ids("delivered_id", indices.numpy().reshape(-1))
            self._ids.deliver(indices)
        out["_index"] = indices
        if info.weights is not None:
            out["_weight"] = info.weights
        return out

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
        idx, pr = priority_input(indices, "indices"), priority_input(priorities, "priorities")
        if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
            raise PriorityError(f"indices: must be integer slots (a batch's _index), got dtype "
                                f"{idx.dtype}")
        if pr.shape[0] != idx.shape[0]:
            raise PriorityError(f"priorities: {pr.shape[0]} values for {idx.shape[0]} indices")
        with self._lock:
            slots = idx.numpy().astype(np.int64, copy=False)
            current = np.empty(slots.shape[0], dtype=np.bool_)
            # Every slot of the buffer: one past the rows held now may have delivered a row
            # before a clear, whose update is then skipped (its row id no longer matches).
            kept = self._ids.matching(indices, slots, self.capacity, current)
            size = self.writer.size
            if kept < 0 or (kept and size < self.capacity
                            and bool((slots[current] >= size).any())):
                # (outside the buffer, or holding no row and never delivering one)
                since = (f" (or, for rows delivered before a clear, slots in "
                         f"[0, {self.capacity}))" if size < self.capacity else "")
                raise PriorityError(f"indices: must be filled slots in [0, {size}){since}, "
                                    f"got [{slots.min()}, {slots.max()}]")
            if kept < slots.shape[0]:
                _check_priority_values(pr)  # (the sampler checks only those it keeps)
                keep = torch.from_numpy(current)
                idx, pr = idx[keep], pr[keep]
            self.sampler.update_priorities(idx, pr)
            return kept

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
            w = self.writer
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= w.size:
                raise ConfigError("n", f"must be an integer in [0, {w.size}], got {n!r}")
            if w.size == w.capacity and w.cursor != 0:
                raise ConfigError("n", "the ring has wrapped part way: its newest rows took "
                                       "the slots of older ones, which cannot come back")
            if type(self.sampler).on_write is not Sampler.on_write:
                raise ConfigError("sampler", f"{type(self.sampler).__name__} keeps per-row "
                                             f"state; rows cannot be taken back from it")
            if n == 0:
                return
            slots = slice(w.size - n, w.size)
            for snap in self._snapshots:
                snap.preserve_ids("row_id", slots)
                snap.preserve_ids("delivered_id", slots)
            self._ids.forget(slots)
            self._forgets += 1
            w.size -= n
            w.cursor = w.size
            w.total_written -= n

    def clear(self) -> None:
        """Forget all rows (storage stays allocated).

        The ids of the rows last delivered from each slot are kept (rows written after the
        clear get new ids), so a priority update for rows delivered before the clear is
        skipped, as for rows overwritten by a wraparound, and never lands on the rows written
        since.
        """
        with self._lock:
            for snap in self._snapshots:
                snap.preserve_ids("row_id")
            self.writer.reset()
            self.sampler.reset()
            self._ids.clear()
            self._forgets += 1

    def filled_blocks(self) -> Blocks:
        """Views (not copies) of the filled slots ``[0, len(self))``: ``(first slot, columns)``
        per part of the store (one per shard)."""
        with self._lock:
            size, store = self.writer.size, self.store
            shards = getattr(store, "shards", None)
            if shards is None:
                return [(0, {n: store.column(n)[:size] for n in self.spec.fields})]
            blocks = []
            for k, shard in enumerate(shards):
                start = int(store.bounds[k])
                n = min(size, int(store.bounds[k + 1])) - start
                if n > 0:
                    blocks.append((start, {f: shard.column(f)[:n] for f in self.spec.fields}))
            return blocks

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
            state: StateDict = {"writer": self.writer.state_dict(),
                                "sampler": self.sampler.state_dict(),
                                "row_id": torch.from_numpy(self._row_id),
                                "delivered_id": torch.from_numpy(self._delivered_id)}
            snap = RowSnapshot(views=self.filled_blocks(), state=state, lock=self._lock,
                               ids={"row_id": self._row_id, "delivered_id": self._delivered_id},
                               spare=spare, lead_rows=2 * self._largest_write)
            self._snapshots.append(snap)
            return snap

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
            sleep_share(duty)  # checked here too: an empty snapshot reads no column
            blocks = snap.materialize(chunk_bytes=chunk_bytes, duty=duty)
            for name in ("row_id", "delivered_id"):
                snap.state[name] = torch.from_numpy(snap.ids(name))
        finally:
            self.drop_snapshot(snap)
        return blocks

    def drop_snapshot(self, snap: RowSnapshot) -> None:
        """Stop tracking ``snap``: later writes no longer copy rows into it."""
        with self._lock:
            if snap in self._snapshots:
                self._snapshots.remove(snap)

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
            for snap in self._snapshots:
                snap.preserve_ids()
            self.sampler = other.sampler
            self.writer.load_state_dict(other.writer.state_dict())
            self._ids.load(other._ids.row, other._ids.delivered)
            self._forgets += 1

    def state_dict(self, *, rows: bool = True) -> StateDict:
        """Writer cursor, sampler state, row ids and (``rows``) a copy of the store."""
        with self._lock:
            store = {"store": self.store.state_dict()} if rows else {}
            return {**store, "writer": self.writer.state_dict(),
                    "sampler": self.sampler.state_dict(),
                    "row_id": torch.from_numpy(self._row_id.copy()),
                    "delivered_id": torch.from_numpy(self._delivered_id.copy())}

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
            # All or nothing: every part checks its entry before it changes anything, and a
            # part that refuses puts back the parts loaded before it (the rows come last).
            ids = {key: array(state, key, "buffer", length=self.capacity, dtype=np.int64)
                   for key in ("row_id", "delivered_id")}
            writer = RingWriter(capacity=self.capacity)
            writer.load_state_dict(entry(state, "writer", "buffer"))
            before = self.sampler.state_dict()
            try:  # a sampler that refuses part way is put back too
                self.sampler.load_state_dict(entry(state, "sampler", "buffer"))
                self.sampler.check_rows(size=writer.size, head=writer.cursor)
                if rows:
                    for snap in self._snapshots:
                        snap.preserve(0, snap.size)
                    self.store.load_state_dict(entry(state, "store", "buffer"))
            except BaseException:
                self.sampler.load_state_dict(before)
                raise
            for snap in self._snapshots:
                snap.preserve_ids()
            self.writer.load_state_dict(writer.state_dict())
            self._ids.load(ids["row_id"], ids["delivered_id"])
            self._forgets += 1

    def rows_in(self, state: StateDict) -> int:
        """The rows a buffer loaded from ``state`` (:meth:`state_dict`) would hold.

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
        writer = RingWriter(capacity=self.capacity)
        writer.load_state_dict(entry(state, "writer", "buffer"))
        return writer.size
