"""Uniform sampling over the filled slots."""

from __future__ import annotations

import numpy as np
import torch

from conduit.errors import EmptyBufferError
from conduit.storage.samplers.base import SampleInfo, Sampler, need_rows
from conduit.storage.state import JSON


class UniformSampler(Sampler):
    """Uniform sampling over the filled slots.

    Args:
        replacement: With replacement (default) rows may repeat within a batch; without it a
            batch never holds the same row twice (so ``batch_size`` must not exceed the fill).
        seed: Generator seed.
    """

    def __init__(self, *, replacement: bool = True, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.replacement = replacement

    def config(self) -> dict[str, JSON]:
        """Constructor arguments."""
        return {**super().config(), "replacement": self.replacement}

    def sample(self, size: int, batch_size: int) -> SampleInfo:
        """Draw ``batch_size`` slots uniformly.

        With replacement, slot ``k`` is ``floor(u_k · size)`` for a uniform double ``u_k`` in
        ``[0, 1)``: three array operations, where ``Generator.integers`` costs several times
        more per call at training batch sizes. Its bias, below ``size / 2**53`` per slot, is far
        under what any test of a sample could see, and ``u_k · size`` rounds below ``size``
        for every ``u_k < 1``.
        """
        if size < 1 or batch_size < 1:
            need_rows(size, batch_size, "a uniform batch")
        if self.replacement:
            u = self._rng.random(batch_size)
            u *= size
            return SampleInfo(torch.from_numpy(u.astype(np.int64)))
        if batch_size > size:
            raise EmptyBufferError(f"cannot draw {batch_size} distinct rows from {size}; "
                                   f"wait for more data or sample with replacement")
        idx = self._rng.choice(size, batch_size, replace=False).astype(np.int64)
        return SampleInfo(torch.from_numpy(idx))
