"""RowLedger: which row each slot of a buffer holds and delivered, and the priority updates
matched to those rows."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from conduit.errors import PriorityError
from conduit.storage.row_ids import ROW_IDS_ATTR, RowIds
from conduit.storage.samplers import Sampler
from conduit.storage.snapshot_tracker import SnapshotTracker


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


def priority_arguments(indices: Any, priorities: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``indices`` and ``priorities`` of a priority update as flat CPU tensors
    (:func:`priority_input`), integer indices and one priority per index.

    Raises:
        PriorityError: They are not numbers, the indices are not integers, or their lengths
            differ.
    """
    idx, pr = priority_input(indices, "indices"), priority_input(priorities, "priorities")
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise PriorityError(f"indices: must be integer slots (a batch's _index), got dtype "
                            f"{idx.dtype}")
    if pr.shape[0] != idx.shape[0]:
        raise PriorityError(f"priorities: {pr.shape[0]} values for {idx.shape[0]} indices")
    return idx, pr


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


class RowLedger:
    """The ids of the rows a buffer's slots hold and last delivered
    (:class:`~conduit.storage.row_ids.RowIds`), kept in step with the snapshots in progress:
    every change first copies aside, into them, the ids it alters. A priority update is
    matched against these ids, so it reaches only the rows that were sampled.

    Not thread-safe: the buffer calls it under its lock.

    Args:
        capacity: Slots.
        snapshots: The buffer's snapshots in progress.

    Attributes:
        row: Per slot, the id of the row it holds (-1: none); changed in place only.
        delivered: Per slot, the id of the row it last delivered (-1: none); changed in
            place only.
        forgets: How often slots were forgotten (:meth:`forget`, :meth:`clear`,
            :meth:`load`): while 0, every slot a draw named still holds a row.

    Raises:
        MemoryError: The two id arrays cannot be allocated.
    """

    def __init__(self, capacity: int, snapshots: SnapshotTracker) -> None:
        self.capacity = capacity
        self._ids = RowIds(capacity)
        self._snapshots = snapshots
        self.row, self.delivered = self._ids.row, self._ids.delivered
        self.forgets = 0

    def arrays(self) -> dict[str, np.ndarray]:
        """The live id arrays by their state names (``row_id``, ``delivered_id``)."""
        return {"row_id": self.row, "delivered_id": self.delivered}

    def written(self, start: int, length: int, first_id: int) -> None:
        """Slots ``[start, start + length)`` now hold rows ``first_id, first_id + 1, ...``."""
        self._snapshots.before_ids("row_id", slice(start, start + length))
        self._ids.written(start, length, first_id)

    def deliver(self, indices: torch.Tensor) -> torch.Tensor:
        """Record that a gather delivers the rows in slots ``indices`` (CPU int64).

        Returns:
            The ``_index`` tensor of the batch: ``indices``, or a copy of it when an earlier
            batch delivered that very tensor (each batch keeps the ids of its own rows).
        """
        if hasattr(indices, ROW_IDS_ATTR):
            indices = indices.clone()
        self._snapshots.before_ids("delivered_id", indices.numpy().reshape(-1))
        self._ids.deliver(indices)
        return indices

    def update_priorities(self, indices: Any, idx: torch.Tensor, pr: torch.Tensor,
                          sampler: Sampler, size: int) -> int:
        """Pass the priorities ``pr`` of the slots ``idx`` (:func:`priority_arguments` of
        ``indices``) whose delivered rows they still hold on to ``sampler``.

        Args:
            indices: The update's indices, as the caller gave them.
            idx: The same, checked.
            pr: One priority per index, checked.
            sampler: The buffer's sampler.
            size: Rows the buffer holds now.

        Returns:
            How many rows were updated.

        Raises:
            PriorityError: Slots outside ``[0, capacity)``, or that hold no row and never
                delivered one; priorities that are not finite and non-negative.
        """
        slots = idx.numpy().astype(np.int64, copy=False)
        current = np.empty(slots.shape[0], dtype=np.bool_)
        # Every slot of the buffer: one past the rows held now may have delivered a row
        # before a clear, whose update is then skipped (its row id no longer matches).
        kept = self._ids.matching(indices, slots, self.capacity, current)
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
        sampler.update_priorities(idx, pr)
        return kept

    def reached(self, indices: torch.Tensor, written: int) -> np.ndarray:
        """Per slice of a draw of slices ``indices`` (one slice a row), whether a slot of it
        holds a row written since the draw (an id of at least ``written``)."""
        return (self.row[indices.numpy()] >= written).reshape(indices.shape[0], -1).any(axis=1)

    def forget(self, slots: slice) -> None:
        """Slots ``slots`` hold no row and never delivered one."""
        self._snapshots.before_ids("row_id", slots)
        self._snapshots.before_ids("delivered_id", slots)
        self._ids.forget(slots)
        self.forgets += 1

    def clear(self) -> None:
        """No slot holds a row; the ids each slot delivered are kept."""
        self._snapshots.before_ids("row_id")
        self._ids.clear()
        self.forgets += 1

    def load(self, row: np.ndarray, delivered: np.ndarray) -> None:
        """Take the ids ``row`` and ``delivered`` (copied in place)."""
        self._snapshots.before_ids()
        self._ids.load(row, delivered)
        self.forgets += 1
