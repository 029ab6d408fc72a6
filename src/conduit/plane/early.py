"""On-policy early assembly: an iteration's first mini-batches, built while their rows arrive.

The consume-once layout is a pure function of ``(seed, iteration, epoch, size)``, so the slots
of the first mini-batches are known before any row lands. Ingestion copies each written row
that belongs to one of them straight into its output; when the last one lands the mini-batch is
complete without a gather, which takes the gather off the learner's path at the start of the
iteration (docs/design.md §2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conduit.spec import Batch, ExperienceSpec
from conduit.storage import Sampler, data_path_threads
from conduit.storage.column_store import copy_rows


@dataclass
class EarlyBatch:
    """One mini-batch being assembled from arriving rows.

    Attributes:
        indices: Its slots, in delivery order.
        out: The rows copied so far (allocated on the first write), with ``_index``.
        filled: How many of its rows have been copied.
    """

    indices: torch.Tensor
    out: Batch | None = None
    filled: int = 0

    @property
    def complete(self) -> bool:
        """Whether every row has been copied."""
        return self.filled == int(self.indices.numel())

    def fill(self, spec: ExperienceSpec, data: Batch, start: int, n: int) -> int:
        """Copy the rows of ``data`` (slots ``start .. start + n``) that belong here.

        Returns:
            How many rows were copied. Rows that are not in host memory are never copied, so
            such a mini-batch never completes and falls back to a gather.
        """
        pos = ((self.indices >= start) & (self.indices < start + n)).nonzero().squeeze(1)
        if pos.numel() and any(v.device.type != "cpu" for v in data.values()):
            return 0
        if self.out is None:
            m = int(self.indices.numel())
            # zeros, not empty: one sequential pass that touches every page is far cheaper than
            # faulting pages in row by row as scattered rows arrive.
            self.out = {name: torch.zeros((m, *fs.shape), dtype=fs.dtype)
                        for name, fs in spec.fields.items()}
            self.out["_index"] = self.indices
        if pos.numel():
            src = self.indices[pos] - start
            with data_path_threads(1):
                for name in spec.fields:
                    copy_rows(self.out[name], pos, data[name], src)
        return int(pos.numel())


def plan_early(sampler: Sampler, *, capacity: int, iteration: int, count: int,
               batches_per_iteration: int) -> dict[int, EarlyBatch]:
    """The first ``count`` mini-batches of ``iteration`` (epoch 0), keyed by delivery position.

    Never the iteration's last mini-batch: delivering it ends the iteration and clears the
    buffer, which must wait until every write has landed.
    """
    parts = sampler.layout(capacity, iteration=iteration, epoch=0)
    return {d: EarlyBatch(parts[d])
            for d in range(min(count, len(parts), batches_per_iteration - 1))}
