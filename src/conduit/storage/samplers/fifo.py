"""Consume-once on-policy sampling: every row exactly once per epoch."""

from __future__ import annotations

import numbers
from typing import ClassVar

import numpy as np
import torch

from conduit._checks import check_bool, check_int
from conduit.errors import ConfigError, EmptyBufferError, StateError
from conduit.storage.samplers.base import SampleInfo, Sampler
from conduit.storage.state import JSON, StateDict, entry, integer


class FifoSampler(Sampler):
    """Consume-once on-policy sampling: every row exactly once per epoch.

    An epoch over ``n`` rows is a (shuffled) permutation split into ``num_minibatches`` parts
    whose sizes differ by at most one (``n/M`` each when ``M`` divides ``n``). The permutation
    depends only on ``(seed, iteration, epoch)``, never on timing, so any schedule sees the same
    mini-batches.

    ``first_within < 1`` draws the first mini-batch of an iteration's first epoch from the first
    ``first_within · n`` rows only (at least as many as it holds); the other mini-batches shuffle
    the rest. Rows land in push order, so with ``U`` rollout units per iteration
    ``first_within = 1 - 1/U`` lets that mini-batch be assembled before the last unit lands: the
    learner's first update then overlaps the last unit's ingestion (``docs/design.md §2``).
    Every row is still delivered exactly once per epoch.

    Args:
        num_minibatches: M, mini-batches per epoch.
        shuffle: Shuffle within the epoch (otherwise insertion order).
        seed: Seed.
        first_within: Share of the iteration's rows, in push order, that the first mini-batch of
            its first epoch is drawn from, in ``(0, 1]`` (1: all of them, a plain shuffle).

    Raises:
        ConfigError: ``num_minibatches`` is not a positive integer, or ``first_within`` is
            outside ``(0, 1]``.
    """

    consume_once: ClassVar[bool] = True

    def __init__(self, *, num_minibatches: int = 1, shuffle: bool = True, seed: int = 0,
                 first_within: float = 1.0) -> None:
        super().__init__(seed=seed)
        num_minibatches = check_int("num_minibatches", num_minibatches, minimum=1)
        check_bool("shuffle", shuffle)
        if (isinstance(first_within, bool) or not isinstance(first_within, numbers.Real)
                or not 0 < first_within <= 1):
            raise ConfigError("first_within", f"must lie in (0, 1], got {first_within!r}; "
                                              f"FifoSampler.leading(units=U) sets it for "
                                              f"an iteration of U rollout units")
        self.num_minibatches = num_minibatches
        self.shuffle = shuffle
        self.first_within = float(first_within)
        self.iteration = 0
        self.epoch = 0
        self.cursor = 0
        self._parts: list[torch.Tensor] = []
        self._rows = 0  # rows the layout covers (slots [0, _rows))

    @classmethod
    def leading(cls, *, units: int, num_minibatches: int = 1, seed: int = 0) -> FifoSampler:
        """The sampler of an iteration of ``units`` equal rollout units pushed in order, whose
        first mini-batch is drawn from every unit but the last (``first_within = 1 - 1/units``;
        the plain shuffle when ``units`` is 1), so it can be assembled while the last unit is
        still being ingested.

        Raises:
            ConfigError: ``units`` is not a positive integer (or as the constructor).
        """
        units = check_int("units", units, minimum=1)
        return cls(num_minibatches=num_minibatches, seed=seed,
                   first_within=1 - 1 / units if units > 1 else 1.0)

    def bind_bytes(self, capacity: int) -> int:
        """An epoch's layout: one int64 slot per row."""
        return 8 * capacity

    def begin_epoch(self, size: int, *, iteration: int, epoch: int) -> None:
        """Lay out the mini-batches of one epoch over ``size`` rows."""
        if size < self.num_minibatches:
            raise EmptyBufferError(f"an epoch of {self.num_minibatches} mini-batches needs at "
                                   f"least {self.num_minibatches} rows, got {size}")
        self.iteration, self.epoch, self.cursor = iteration, epoch, 0
        self._parts = self.layout(size, iteration=iteration, epoch=epoch)
        self._rows = size

    def layout(self, size: int, *, iteration: int, epoch: int) -> list[torch.Tensor]:
        """The slots of each mini-batch of one epoch, without touching the sampler's state.

        A pure function of ``(seed, iteration, epoch, size)``: the plane uses it to start
        assembling an iteration's first mini-batches while its rows are still arriving.
        """
        if not self.shuffle:
            return list(torch.tensor_split(torch.arange(size, dtype=torch.int64),
                                           self.num_minibatches))
        rng = np.random.default_rng([self.seed, iteration, epoch])
        if epoch > 0 or self.first_within >= 1 or self.num_minibatches == 1:
            order = rng.permutation(size).astype(np.int64)
            return list(torch.tensor_split(torch.from_numpy(order), self.num_minibatches))
        first = size // self.num_minibatches + (size % self.num_minibatches > 0)
        head = rng.permutation(max(first, int(self.first_within * size))).astype(np.int64)
        rest = np.concatenate([head[first:], np.arange(head.size, size, dtype=np.int64)])
        rest = rest[rng.permutation(rest.size)]
        return [torch.from_numpy(head[:first]),
                *torch.tensor_split(torch.from_numpy(rest), self.num_minibatches - 1)]

    def seek(self, position: int) -> None:
        """Skip to mini-batch ``position`` of the current epoch (0 = its first).

        Raises:
            ConfigError: ``position`` is outside ``[0, num_minibatches]``.
        """
        if not 0 <= position <= len(self._parts):
            raise ConfigError("position", f"must lie in [0, {len(self._parts)}], got "
                                          f"{position!r}")
        self.cursor = position

    @property
    def remaining(self) -> int:
        """Mini-batches left in the current epoch."""
        return len(self._parts) - self.cursor

    def sample(self, size: int, batch_size: int = 0) -> SampleInfo:
        """Next mini-batch of the epoch (``batch_size`` is implied by the epoch layout), as a
        tensor of its own (changing it changes nothing here).

        Raises:
            EmptyBufferError: The epoch's mini-batches are all drawn, or ``size`` (the filled
                slots) is below the rows the epoch was laid out over (rows were taken back
                since): its slots would hold none.
        """
        if self.cursor >= len(self._parts):
            raise EmptyBufferError("the epoch's mini-batches are all consumed; begin a new "
                                   "epoch (on-policy data is delivered exactly once per epoch)")
        if size < self._rows:
            raise EmptyBufferError(f"the epoch was laid out over {self._rows} rows, but only "
                                   f"{size} are filled now; begin a new epoch")
        part = self._parts[self.cursor]
        self.cursor += 1
        return SampleInfo(part.clone())

    def reset(self) -> None:
        """Drop the current epoch layout."""
        self._parts, self.cursor, self._rows = [], 0, 0

    def state_dict(self) -> StateDict:
        """Iteration, epoch, cursor and the layout."""
        return {**super().state_dict(), "iteration": self.iteration, "epoch": self.epoch,
                "cursor": self.cursor, "parts": [p.clone() for p in self._parts]}

    def config(self) -> dict[str, JSON]:
        """Constructor arguments."""
        return {**super().config(), "num_minibatches": self.num_minibatches,
                "shuffle": self.shuffle, "first_within": self.first_within}

    def load_state_dict(self, state: StateDict) -> None:
        """Restore from :meth:`state_dict`.

        Raises:
            StateError: A key is missing, or the layout or cursor does not fit the sampler:
                ``parts`` must be none or ``num_minibatches`` 1-D integer tensors whose
                concatenation is a permutation of ``range(n)`` (each of ``n`` rows once).
        """
        parts = entry(state, "parts", "sampler")
        if not isinstance(parts, (list, tuple)) or (parts and len(parts) != self.num_minibatches) \
                or not all(isinstance(p, torch.Tensor) and p.dim() == 1 for p in parts):
            raise StateError("sampler.parts", f"expected {self.num_minibatches} 1-D index "
                                              f"tensors (or none)")
        if any(p.is_floating_point() or p.is_complex() or p.dtype == torch.bool
               for p in parts):
            raise StateError("sampler.parts", f"expected integer slots, got dtypes "
                                              f"{sorted({str(p.dtype) for p in parts})}")
        parts = [p.detach().cpu().to(torch.int64) for p in parts]
        if parts:
            order = torch.cat(parts)
            n = order.numel()
            if not torch.equal(torch.sort(order).values, torch.arange(n, dtype=torch.int64)):
                raise StateError("sampler.parts", f"the slots of the mini-batches must be "
                                                  f"each of the epoch's {n} rows 0..{n - 1} "
                                                  f"once (a permutation of range({n}))")
        iteration = integer(state, "iteration", "sampler")
        epoch = integer(state, "epoch", "sampler")
        cursor = integer(state, "cursor", "sampler", high=len(parts))
        super().load_state_dict(state)
        self.iteration, self.epoch, self.cursor = iteration, epoch, cursor
        self._parts = [p.clone() for p in parts]
        self._rows = sum(p.numel() for p in parts)
