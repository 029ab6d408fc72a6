"""Ports handed to registered operators (the paper's Fig. 8 interface).

Ingestion gets ``(actor_in, exp_out)``; delivery gets ``(exp_in, learn_out)``. Operators read
from the input port, apply framework-defined ops, and write to the output port. The plane
decides when they run and on how much data; the ports only move it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from conduit.errors import SpecError
from conduit.spec import Batch
from conduit.storage.column_store import SET_ALIGN


def concat_units(units: list[Batch]) -> Batch:
    """Concatenate rollout units along the batch dimension (one copy per field)."""
    if len(units) == 1:
        return dict(units[0])
    keys = units[0].keys()
    for u in units[1:]:
        if u.keys() != keys:
            raise SpecError(None, f"rollouts in one ingestion disagree on fields: "
                                  f"{sorted(keys)} vs {sorted(u.keys())}")
    return {k: torch.cat([u[k] for u in units]) for k in keys}


class ActorIn:
    """Ingestion input: the rollout units pushed by actors for this invocation."""

    def __init__(self, units: list[Batch], versions: list[int | None]) -> None:
        self._units = units
        self._versions = versions

    def read(self) -> Batch:
        """All units of this invocation, concatenated."""
        return concat_units(self._units)

    def read_units(self) -> list[Batch]:
        """The units one by one, in push order (e.g. one trajectory segment per actor)."""
        return list(self._units)

    @property
    def policy_versions(self) -> list[int | None]:
        """Policy version each unit was pushed with."""
        return list(self._versions)

    def __len__(self) -> int:
        return len(self._units)


class BufferOut:
    """Ingestion output: rows written here are validated and appended to the buffer."""

    def __init__(self, write: Callable[[Mapping[str, Any]], int]) -> None:
        self._write = write
        self.rows = 0

    def write(self, batch: Mapping[str, Any]) -> None:
        """Validate ``batch`` against the spec and append it.

        Raises:
            SpecError: Wrong field name, shape, dtype.
            CapacityError: More rows than the buffer (or, on-policy, the iteration) holds.
        """
        self.rows += self._write(batch)


class BufferIn:
    """Delivery input: the rows the sampler picked for this invocation."""

    def __init__(self, batch: Batch, *, batches: int, batch_size: int) -> None:
        self._batch = batch
        self.batches = batches
        self.batch_size = batch_size

    def read(self) -> Batch:
        """The sampled rows (``batches × batch_size`` of them), with ``_index`` and, for
        prioritized samplers, ``_weight``."""
        return self._batch


class LearnerOut:
    """Delivery output: what is written here is split into training batches and staged."""

    def __init__(self, *, batches: int, device: torch.device) -> None:
        self._batches = batches
        self._device = device
        self.staged: list[Batch] = []

    def write(self, batch: Mapping[str, torch.Tensor]) -> None:
        """Split ``batch`` into this invocation's training batches and move them to the
        learner's device. The tensors are staged as they are (no copy) when they already
        live there and form a single batch.

        Raises:
            SpecError: The rows cannot be split evenly into the invocation's batches.
        """
        rows = next(iter(batch.values())).shape[0]
        if rows % self._batches:
            raise SpecError(None, f"delivery wrote {rows} rows, which do not split into "
                                  f"{self._batches} equal training batches")
        on_host = self._device.type == "cpu"
        for k, v in batch.items():  # one pass: check rows, see whether anything must move
            if v.shape[0] != rows:
                raise SpecError(k, f"has {v.shape[0]} rows in the delivered batch, "
                                   f"expected {rows}")
            on_host = on_host and v.device.type == "cpu"
        moved = dict(batch) if on_host else move_batch(batch, self._device)
        if self._batches == 1:
            self.staged.append(moved)
            return
        size = rows // self._batches
        for i in range(self._batches):
            self.staged.append({k: v[i * size:(i + 1) * size] for k, v in moved.items()})


def move_batch(batch: Mapping[str, torch.Tensor], device: torch.device) -> Batch:
    """``batch`` on ``device``, in its order. For a CUDA device, host fields that are
    contiguous, page-locked and lie side by side in one block of memory (the set a pinned
    store gathers into) leave in one copy of the block and arrive as views of its device copy:
    one DMA, one allocation and one release of the GIL instead of one of each per field.
    Anything else is copied field by field."""
    if device.type != "cuda":
        return {k: _to(v, device) for k, v in batch.items()}
    moved: dict[str, torch.Tensor] = {}
    blocks: dict[int, list[str]] = {}
    for k, v in batch.items():
        if v.device.type == "cpu" and v.is_contiguous():
            blocks.setdefault(v.untyped_storage().data_ptr(), []).append(k)
        else:
            moved[k] = _to(v, device)
    for keys in blocks.values():
        if len(keys) == 1 or not _copy_block(batch, keys, device, moved):
            for k in keys:
                moved[k] = _to(batch[k], device)
    return {k: moved[k] for k in batch}


def _copy_block(batch: Mapping[str, torch.Tensor], keys: list[str], device: torch.device,
                moved: dict[str, torch.Tensor]) -> bool:
    """Copy the fields ``keys``, views of one host block, as one span of it; False (nothing
    copied) unless the block is page-locked and the span holds little besides the fields."""
    spans = [(batch[k].storage_offset() * batch[k].element_size(), batch[k].nbytes)
             for k in keys]
    lo = min(a for a, _ in spans)
    hi = max(a + n for a, n in spans)
    if (hi - lo > sum(n for _, n in spans) + SET_ALIGN * len(keys)
            or any((a - lo) % batch[k].element_size() for k, (a, _) in zip(keys, spans))
            or not batch[keys[0]].is_pinned()):
        return False
    host = torch.empty(0, dtype=torch.uint8).set_(batch[keys[0]].untyped_storage(), lo,
                                                   (hi - lo,))
    block = host.to(device, non_blocking=True)
    for k, (a, n) in zip(keys, spans):
        v = batch[k]
        moved[k] = block[a - lo:a - lo + n].view(v.dtype).view(v.shape)
    return True


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device or (device.type == "cpu" and t.device.type == "cpu"):
        return t
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        # Pinned staging makes the host-to-device copy asynchronous on the worker's stream.
        # (torch's pinned-memory cache reuses the staging block only once the copy is done,
        # as it does the page-locked sets a pinned store gathers into.)
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=True)
