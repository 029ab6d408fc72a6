"""ExperienceBuffer: a store, a ring writer and a sampler, composed (TorchRL's shape)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from conduit.spec import Batch, ExperienceSpec
from conduit.storage.column_store import make_store
from conduit.storage.layout import Placement
from conduit.storage.samplers import SampleInfo, Sampler, UniformSampler
from conduit.storage.threads import data_path_threads
from conduit.storage.writer import RingWriter


class ExperienceBuffer:
    """A replay or rollout buffer: validated vectorized writes, sampled vectorized reads.

    All methods are thread-safe: one lock orders writes against reads, so a gather never sees
    a half-written row.

    Args:
        spec: Fields of one sample.
        capacity: Rows.
        sampler: Which rows a batch reads (default: uniform with replacement).
        placement: Where the rows live (default: pageable CPU).
        threads: Torch intra-op threads used by the data path (see
            :func:`~conduit.storage.threads.data_path_threads`).
    """

    def __init__(self, *, spec: ExperienceSpec, capacity: int, sampler: Sampler | None = None,
                 placement: Placement | None = None, threads: int = 1) -> None:
        self.spec = spec
        self.store = make_store(spec=spec, capacity=capacity, placement=placement)
        self.capacity = self.store.capacity
        self.writer = RingWriter(capacity=self.capacity)
        self.sampler = sampler or UniformSampler()
        self.sampler.bind(self.capacity)
        self.threads = threads
        self._lock = threading.RLock()

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
            CapacityError: The batch has more rows than the buffer.
        """
        if validate:
            data, n = self.spec.validate(batch, what="write")
        else:
            data = dict(batch)
            n = next(iter(data.values())).shape[0]
        with self._lock, data_path_threads(self.threads):
            pieces = self.writer.reserve(n)
            for store_start, b0, length in pieces:
                part = data if length == n else {k: v[b0:b0 + length] for k, v in data.items()}
                self.store.set_range(store_start, part)
            idx = RingWriter.indices(pieces)
            self.sampler.on_write(idx, data, size=self.writer.size)
        return idx

    def draw(self, batch_size: int) -> SampleInfo:
        """Pick indices (no gather)."""
        with self._lock:
            return self.sampler.sample(self.writer.size, batch_size)

    def gather(self, info: SampleInfo | torch.Tensor, *,
               device: torch.device | None = None) -> Batch:
        """Read rows for a draw; adds ``_index`` and, when weighted, ``_weight``."""
        if isinstance(info, torch.Tensor):
            info = SampleInfo(info)
        with self._lock, data_path_threads(self.threads):
            out = self.store.get(info.indices, device=device)
        out["_index"] = info.indices
        if info.weights is not None:
            out["_weight"] = info.weights
        return out

    def sample(self, batch_size: int, *, device: torch.device | None = None) -> Batch:
        """Draw and gather one batch."""
        with self._lock:
            return self.gather(self.draw(batch_size), device=device)

    def update_priorities(self, indices: torch.Tensor, priorities: torch.Tensor) -> None:
        """Forward to the sampler (prioritized samplers only)."""
        with self._lock:
            self.sampler.update_priorities(indices, priorities)

    def clear(self) -> None:
        """Forget all rows (storage stays allocated)."""
        with self._lock:
            self.writer.reset()
            self.sampler.reset()

    def state_dict(self) -> dict[str, Any]:
        """Store contents, writer cursor and sampler state."""
        with self._lock:
            return {"store": self.store.state_dict(), "writer": self.writer.state_dict(),
                    "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (store placement may differ)."""
        with self._lock:
            self.store.load_state_dict(state["store"])
            self.writer.load_state_dict(state["writer"])
            self.sampler.load_state_dict(state["sampler"])
