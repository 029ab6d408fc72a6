"""RowSnapshot: a buffer's rows and slot ids as they were at one instant, read out while writes
go on (copy-on-write)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch

from conduit.errors import ConfigError
from conduit.storage.state import StateDict

Blocks = list[tuple[int, dict[str, torch.Tensor]]]
"""``(first slot, field -> column)`` per part of a store (one per shard)."""


def sleep_share(duty: float) -> float:
    """Seconds to sleep per second of work so that work takes ``duty`` of the time.

    Raises:
        ConfigError: ``duty`` is outside ``(0, 1]``.
    """
    if not 0 < duty <= 1:
        raise ConfigError("duty", f"must be in (0, 1], got {duty!r}")
    return 1 / duty - 1


class SnapshotAbandonedError(RuntimeError):
    """A snapshot's read-out was stopped (:meth:`RowSnapshot.abandon`) before it finished."""


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """``[start, stop)`` of every run of True in ``mask``."""
    edges = np.diff(np.concatenate(([0], mask.view(np.int8), [0])))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


class RowSnapshot:
    """The filled rows, slot ids and small state of a buffer at the instant it was taken, read
    out in order while writes and samples go on.

    Nothing is copied when the snapshot is taken. A reader streams each column
    (:meth:`stream_rows`) and each id array (:meth:`stream_ids`) a chunk at a time; a write
    about to change a row or an id the reader has not reached copies the old value aside first
    (:meth:`preserve`, :meth:`preserve_ids`, called by the buffer under its lock), and the
    reader takes it from there. So the bytes read out are exactly the buffer at the instant,
    extra memory is one chunk plus the rows overwritten meanwhile, and the reader holds the
    buffer's lock only to check for such rows, never for a copy.

    Args:
        views: Views of the live columns at that instant (see
            :meth:`ExperienceBuffer.filled_blocks`), covering slots ``[0, size)`` in order.
        ids: Name -> the buffer's live per-slot id array (length at least ``size``).
        state: The buffer's small state at that instant; its id entries are filled in by
            :meth:`stream_ids` (until then they alias the live arrays).
        lock: The buffer's lock, held by every write.
        spare: :attr:`kept` of an earlier snapshot of the same buffer: its memory is reused
            for the rows set aside, so a write pays for no fresh pages.
        lead_rows: How far :meth:`copy_ahead` gets ahead of the writes before it paces
            itself.

    Attributes:
        size: Rows in the snapshot.
        state: See ``state`` above.
        lead_rows: See ``lead_rows`` above.
        rows_written: Rows of the snapshot that writes have reached since it was taken.
    """

    def __init__(self, *, views: Blocks, ids: Mapping[str, np.ndarray], state: StateDict,
                 lock: threading.RLock,
                 spare: Mapping[tuple[int, str], torch.Tensor] | None = None,
                 lead_rows: int = 0) -> None:
        self._views = views
        self._lock = lock
        self.size = sum(next(iter(cols.values())).shape[0] for _, cols in views)
        self.state = state
        self.lead_rows = max(0, int(lead_rows))
        self.rows_written = 0
        # Per (block, field): rows [0, read) are read out; kept rows were copied aside by a
        # write before the reader reached them (their copies live in ``_kept``).
        self._read: dict[tuple[int, str], int] = {}
        self._kept_mask: dict[tuple[int, str], np.ndarray] = {}
        self._kept: dict[tuple[int, str], torch.Tensor] = {}
        self._spare = dict(spare or {})
        self._ids_live = dict(ids)
        # Per id array: the old values of the slots changed since the instant (set aside by
        # preserve_ids, the mask marks which), and the whole array once read out.
        self._ids_kept: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._ids: dict[str, np.ndarray] = {}
        self._abandoned = False

    def abandon(self) -> None:
        """Stop the read-out from any thread: :meth:`copy_ahead`, :meth:`stream_rows` and
        :meth:`stream_ids` raise :class:`SnapshotAbandonedError` before their next chunk (a writer
        of the snapshot's file then fails, and removes its temporary file)."""
        self._abandoned = True

    def _check_abandoned(self) -> None:
        if self._abandoned:
            raise SnapshotAbandonedError("the snapshot was abandoned before it was read out")

    @property
    def kept(self) -> dict[tuple[int, str], torch.Tensor]:
        """The memory rows were set aside in (and the unused spare), to pass as ``spare`` to
        the next snapshot; read it once this one is read out."""
        return {**self._spare, **self._kept}

    @property
    def blocks(self) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """The live views the snapshot reads from, ``(first slot, field -> column)`` per block
        (their shapes and dtypes are the snapshot's; their contents may have moved on)."""
        return self._views

    # -- writes (under the buffer's lock) ----------------------------------------------------

    def preserve(self, first: int, stop: int) -> None:
        """Copy aside the rows of slots ``[first, stop)`` the reader has not reached; call
        under the buffer's lock before they change."""
        self.rows_written += max(0, min(stop, self.size) - first)
        for b, cols, lo, hi in self._block_ranges(first, min(stop, self.size)):
            for f, col in cols.items():
                key = (b, f)
                a = max(lo, self._read.get(key, 0))
                if a >= hi:
                    continue
                mask = self._mask_of(key, col)
                todo = ~mask[a:hi]
                if not todo.any():  # copied ahead already: the usual case once a copy leads
                    continue
                for r0, r1 in ([(0, hi - a)] if todo.all() else _runs(todo)):
                    self._kept[key][a + r0:a + r1].copy_(col[a + r0:a + r1])
                mask[a:hi] = True

    def _block_ranges(self, first: int, stop: int
                      ) -> Iterator[tuple[int, dict[str, torch.Tensor], int, int]]:
        """``(block, columns, lo, hi)``: the block-local rows ``[lo, hi)`` of each block that
        slots ``[first, stop)`` cover."""
        for b, (start, cols) in enumerate(self._views):
            n = next(iter(cols.values())).shape[0]
            lo, hi = max(first, start) - start, min(stop, start + n) - start
            if lo < hi:
                yield b, cols, lo, hi

    def _mask_of(self, key: tuple[int, str], col: torch.Tensor) -> np.ndarray:
        """The kept-rows mask of ``key``, with its memory for kept rows made on first use."""
        mask = self._kept_mask.get(key)
        if mask is None:
            mask = self._kept_mask[key] = np.zeros(col.shape[0], dtype=bool)
            old = self._spare.pop(key, None)
            # Fresh memory is virtual only: pages of rows never set aside are never touched.
            # Spare memory has its pages already.
            self._kept[key] = (old if old is not None and old.shape == col.shape
                               and old.dtype == col.dtype
                               else torch.empty_like(col, device="cpu"))
        return mask

    def preserve_ids(self, name: str | None = None,
                     where: slice | np.ndarray | None = None) -> None:
        """Copy aside the old values of the id array ``name`` (all arrays when None) at
        ``where`` (a slice or an array of slots; None: every slot) that are not set aside or
        read out yet; call under the buffer's lock before they change. A write's cost is its
        own slots, not the array's length."""
        for key in ([name] if name is not None else list(self._ids_live)):
            live = self._ids_live.get(key)
            if live is None or key in self._ids:
                continue
            kept = self._ids_kept.get(key)
            if kept is None:
                kept = self._ids_kept[key] = (np.zeros(live.shape[0], dtype=bool),
                                              np.empty_like(live))
            mask, old = kept
            if isinstance(where, np.ndarray):
                slots = where[~mask[where]]
                old[slots] = live[slots]
                mask[slots] = True
                continue
            at = slice(None) if where is None else where
            todo = ~mask[at]
            if todo.any():
                np.copyto(old[at], live[at], where=todo)
                mask[at] = True

    # -- reading out -------------------------------------------------------------------------

    def stream_rows(self, block: int, field: str, *, chunk_bytes: int = 2 << 20,
                    duty: float = 1.0) -> Iterator[torch.Tensor]:
        """The column ``field`` of block ``block`` as it was at the instant, as consecutive
        CPU chunks of about ``chunk_bytes`` (each valid until the next is requested).

        Args:
            block: Index into :attr:`blocks`.
            field: A field of the spec.
            chunk_bytes: Bytes per chunk.
            duty: Fraction of the time spent reading, in ``(0, 1]``: below 1 the generator
                sleeps before each chunk, so the read-out spreads its memory traffic thinly
                over training instead of saturating the memory bus.

        Raises:
            ConfigError: ``duty`` is outside ``(0, 1]``, or the column was read out already
                (each is read once: rows behind a reader are no longer kept).
            SnapshotAbandonedError: :meth:`abandon` was called (checked before each chunk).
        """
        rest = sleep_share(duty)
        key = (block, field)
        with self._lock:
            if key in self._read:
                raise ConfigError("field", f"rows/{block}/{field} of this snapshot is read out "
                                           f"already; each column is read once")
            self._read[key] = 0
        col = self._views[block][1][field]
        n = col.shape[0]
        row_bytes = max(1, col[:1].numel() * col.element_size())
        rows = max(1, chunk_bytes // row_bytes)
        bounce: torch.Tensor | None = None  # made at the first chunk not all set aside
        a = 0
        while a < n:
            self._check_abandoned()
            t0 = time.perf_counter()
            b = min(n, a + rows)
            with self._lock:
                mask = self._kept_mask.get(key)
                whole = mask is not None and bool(mask[a:b].all())
                if whole:
                    self._read[key] = b
            if whole:  # all set aside: those copies never change again
                out = self._kept[key][a:b]
            else:
                if bounce is None:
                    bounce = torch.empty((min(rows, n), *col.shape[1:]), dtype=col.dtype)
                out = bounce[:b - a]
                # Copied without the lock, so a write never waits for it: a write that
                # changes one of these rows meanwhile copies its old value aside first (this
                # reader has not passed it), and the old values are laid over the copy under
                # the lock.
                out.copy_(col[a:b])
                with self._lock:
                    mask = self._kept_mask.get(key)
                    if mask is not None and mask[a:b].any():
                        for r0, r1 in _runs(mask[a:b]):
                            out[r0:r1].copy_(self._kept[key][a + r0:a + r1])
                    self._read[key] = b
            time.sleep(rest * (time.perf_counter() - t0))
            yield out
            a = b

    def copy_ahead(self, *, chunk_bytes: int = 1 << 20, duty: float = 1.0) -> None:
        """Set every row aside now, racing ahead of the writes (a second buffer:
        :meth:`stream_rows` then reads only the copies). Rows go in ring order from the write
        cursor, the next ones a write overwrites, all fields of a chunk of rows together, so
        the copy stays ahead of writes slower than memory and they rarely copy anything
        themselves. Each chunk is copied without the lock and merged under it into the rows
        no write set aside meanwhile, so the lock is held for one chunk's memory copy from a
        hot buffer. It copies at full speed until it is :attr:`lead_rows` rows ahead of the
        writes, and again whenever they close in on it, and keeps to ``duty`` only beyond
        that lead: a write that reaches rows not copied yet copies them itself, under the
        buffer's lock, on the writer's thread.

        Args:
            chunk_bytes: Bytes per chunk (all fields).
            duty: Fraction of the time spent copying, in ``(0, 1]``.

        Raises:
            ConfigError: ``duty`` is outside ``(0, 1]``.
            SnapshotAbandonedError: :meth:`abandon` was called (checked before each chunk).
        """
        rest = sleep_share(duty)
        for name in self._ids_live:  # the ids first: then no write sets any aside
            self.ids(name)
        writer = self.state.get("writer")
        cursor = int(writer["cursor"]) if isinstance(writer, dict) else 0
        cursor = cursor if 0 < cursor < self.size else 0
        bounces: dict[tuple[int, str], torch.Tensor] = {}
        row_bytes = sum(max(1, c[:1].numel() * c.element_size())
                        for c in self._views[0][1].values()) if self._views else 1
        rows = max(1, chunk_bytes // row_bytes)
        copied = 0  # rows done, in ring order from the cursor, the order writes take
        for lo, hi in ((cursor, self.size), (0, cursor)):
            for a in range(lo, hi, rows):
                self._check_abandoned()
                t0 = time.perf_counter()
                b = min(hi, a + rows)
                self._copy_ahead_rows(a, b, bounces)
                copied += b - a
                if rest and copied - self.rows_written >= self.lead_rows:
                    time.sleep(rest * (time.perf_counter() - t0))

    def _copy_ahead_rows(self, first: int, stop: int,
                         bounces: dict[tuple[int, str], torch.Tensor]) -> None:
        """Set aside slots ``[first, stop)`` of every field not set aside or read yet."""
        for b, cols, lo, hi in self._block_ranges(first, stop):
            for f, col in cols.items():
                key = (b, f)
                bounce = bounces.get(key)
                if bounce is None or bounce.shape[0] < hi - lo:
                    bounce = bounces[key] = torch.empty((hi - lo, *col.shape[1:]),
                                                        dtype=col.dtype)
                tmp = bounce[:hi - lo]
                tmp.copy_(col[lo:hi])  # without the lock; rows a write changes are kept
                with self._lock:
                    a = max(lo, self._read.get(key, 0))  # a reader needs no rows behind it
                    if a >= hi:
                        continue
                    mask = self._mask_of(key, col)
                    todo = ~mask[a:hi]
                    kept = self._kept[key]
                    for r0, r1 in ([(0, hi - a)] if todo.all() else _runs(todo)):
                        kept[a + r0:a + r1].copy_(tmp[a - lo + r0:a - lo + r1])
                    mask[a:hi] = True

    def stream_ids(self, name: str) -> Iterator[np.ndarray]:
        """The id array ``name`` as it was at the instant, in one chunk (read out now, if not
        yet, without holding the lock for the copy).

        Raises:
            SnapshotAbandonedError: :meth:`abandon` was called.
        """
        self._check_abandoned()
        with self._lock:
            done = self._ids.get(name)
        if done is None:
            # Like stream_rows: a write that changes a slot meanwhile sets its old value
            # aside first, and the old values are laid over the copy under the lock.
            out = self._ids_live[name].copy()
            with self._lock:
                done = self._ids.get(name)
                if done is None:
                    kept = self._ids_kept.pop(name, None)
                    if kept is not None:
                        np.copyto(out, kept[1], where=kept[0])
                    done = self._ids[name] = out
        yield done

    def materialize(self, *, chunk_bytes: int = 2 << 20, duty: float = 1.0) -> Blocks:
        """Read every row out into new CPU tensors, laid out as :attr:`blocks`."""
        out: Blocks = []
        for b, (start, cols) in enumerate(self._views):
            copies = {}
            for f, col in cols.items():
                dst = torch.empty_like(col, device="cpu")
                at = 0
                for chunk in self.stream_rows(b, f, chunk_bytes=chunk_bytes, duty=duty):
                    dst[at:at + chunk.shape[0]].copy_(chunk)
                    at += chunk.shape[0]
                copies[f] = dst
            out.append((start, copies))
        return out

    def ids(self, name: str) -> np.ndarray:
        """The id array ``name`` at the instant (a copy)."""
        return next(self.stream_ids(name))


SnapshotSource = Callable[[], Iterator[torch.Tensor | np.ndarray]]
"""Makes the chunks of one checkpoint part, in order."""
