"""Samplers: which rows a batch reads. Each works with any store.

Samplers draw CPU ``int64`` indices from their own seeded numpy generator, independent of where
the store lives, so the same seed gives the same batches on pageable, pinned, GPU and sharded
stores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from conduit.errors import ConfigError, EmptyBufferError, PriorityError, SpecError
from conduit.spec import Batch
from conduit.storage.sum_tree import SumTree


@dataclass(frozen=True)
class SampleInfo:
    """The result of a draw.

    Attributes:
        indices: Buffer slots, CPU int64; shape ``[B]`` or ``[B, L]`` for sequences.
        weights: Importance weights ``[B]`` (prioritized only).
    """

    indices: torch.Tensor
    weights: torch.Tensor | None = None


class Sampler:
    """Base class. Subclasses override :meth:`sample` and may use the write hooks.

    Args:
        seed: Seed of the sampler's own generator.
    """

    def __init__(self, *, seed: int = 0) -> None:
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self.capacity = 0

    def bind(self, capacity: int) -> None:
        """Called once by the buffer with its capacity, before any write."""
        self.capacity = capacity

    def on_write(self, indices: torch.Tensor, batch: Batch, *, size: int) -> None:
        """Called after rows were written at ``indices``; ``size`` is the new fill level."""

    def sample(self, size: int, batch_size: int) -> SampleInfo:
        """Draw ``batch_size`` rows out of the ``size`` filled slots."""
        raise NotImplementedError

    def update_priorities(self, indices: torch.Tensor, priorities: torch.Tensor) -> None:
        """Only prioritized samplers accept priorities."""
        raise PriorityError(f"{type(self).__name__} has no priorities; use "
                            f"PrioritizedSampler to update priorities")

    def reset(self) -> None:
        """Forget per-row state (the buffer was cleared)."""

    def state_dict(self) -> dict[str, Any]:
        """Generator state and per-row state."""
        return {"rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        self._rng.bit_generator.state = state["rng"]


def _need(size: int, n: int, what: str) -> None:
    if size < 1:
        raise EmptyBufferError(f"cannot sample {what}: the buffer is empty")
    if n < 1:
        raise ConfigError("batch_size", f"must be >= 1, got {n}")


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

    def sample(self, size: int, batch_size: int) -> SampleInfo:
        """Draw ``batch_size`` slots uniformly."""
        _need(size, batch_size, "a uniform batch")
        if self.replacement:
            idx = self._rng.integers(0, size, batch_size, dtype=np.int64)
        else:
            if batch_size > size:
                raise EmptyBufferError(f"cannot draw {batch_size} distinct rows from {size}; "
                                       f"wait for more data or sample with replacement")
            idx = self._rng.choice(size, batch_size, replace=False).astype(np.int64)
        return SampleInfo(torch.from_numpy(idx))


def _host(values: Any) -> np.ndarray:
    """A flat numpy view of a CPU tensor (a copy for other devices or other array types)."""
    if isinstance(values, torch.Tensor):
        values = values.detach()
        if values.device.type != "cpu":
            values = values.cpu()
        return values.reshape(-1).numpy()
    return np.asarray(values).reshape(-1)


class PrioritizedSampler(Sampler):
    """Proportional prioritized replay (Schaul et al., 2016) over a vectorized sum tree.

    New rows get the largest priority seen so far. A batch is drawn by stratified prefix-sum
    search; importance weights ``(N·P(i))^-beta`` are normalized by their maximum over the
    buffer.

    Args:
        alpha: Priority exponent (0 = uniform).
        beta: Importance-weight exponent.
        eps: Added to every priority so no row becomes unreachable.
        seed: Generator seed.
    """

    def __init__(self, *, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6,
                 seed: int = 0) -> None:
        super().__init__(seed=seed)
        if not alpha >= 0:
            raise ConfigError("alpha", f"must be >= 0, got {alpha}")
        if not beta >= 0:
            raise ConfigError("beta", f"must be >= 0, got {beta}")
        if not eps > 0:
            raise ConfigError("eps", f"must be > 0, got {eps}")
        self.alpha, self.beta, self.eps = float(alpha), float(beta), float(eps)
        self.max_priority = 1.0
        self._tree: SumTree | None = None

    def bind(self, capacity: int) -> None:
        """Allocate the tree (kept when already bound to this capacity, e.g. on migration)."""
        if self._tree is not None and self.capacity == capacity:
            return
        super().bind(capacity)
        self._tree = SumTree(capacity=capacity)

    @property
    def tree(self) -> SumTree:
        """The sum tree (after :meth:`bind`)."""
        if self._tree is None:
            raise ConfigError("sampler", "PrioritizedSampler used before bind(capacity)")
        return self._tree

    def on_write(self, indices: torch.Tensor, batch: Batch, *, size: int) -> None:
        """New rows get the maximum priority seen so far."""
        idx = indices.numpy()
        self.tree.set(idx, np.full(idx.shape, (self.max_priority + self.eps) ** self.alpha))

    def sample(self, size: int, batch_size: int) -> SampleInfo:
        """Stratified proportional draw with importance weights."""
        _need(size, batch_size, "a prioritized batch")
        tree = self.tree
        total = tree.total
        if not total > 0:
            raise PriorityError("all priorities are zero; nothing can be sampled")
        idx, w = tree.stratified_draw(self._rng.random(batch_size), size=size, beta=self.beta)
        return SampleInfo(torch.from_numpy(idx), torch.from_numpy(w))

    def update_priorities(self, indices: torch.Tensor, priorities: torch.Tensor) -> None:
        """Set new priorities for ``indices``.

        Raises:
            PriorityError: NaN, infinite or negative priorities, or mismatched lengths.
        """
        idx = np.ascontiguousarray(_host(indices), dtype=np.int64)
        pr = np.ascontiguousarray(_host(priorities), dtype=np.float64)
        if idx.shape != pr.shape:
            raise PriorityError(f"priorities: {pr.size} values for {idx.size} indices")
        problem, pmax = self.tree.check(idx, pr)
        if problem == "not finite":
            raise PriorityError("priorities: contain NaN or infinity; pass finite |TD errors|")
        if problem == "negative":
            raise PriorityError("priorities: contain negative values; pass |TD error|")
        if problem == "index":
            raise PriorityError(f"indices: must lie in [0, {self.capacity}), got "
                                f"[{idx.min()}, {idx.max()}]")
        if pr.size:
            self.max_priority = max(self.max_priority, pmax)
        self.tree.set(idx, (pr + self.eps) ** self.alpha)

    def priorities(self, indices: torch.Tensor) -> torch.Tensor:
        """Current (exponentiated) priorities of ``indices``."""
        return torch.from_numpy(self.tree.get(indices.numpy()))

    def reset(self) -> None:
        """Clear every priority."""
        self.tree.clear()
        self.max_priority = 1.0

    def state_dict(self) -> dict[str, Any]:
        """Generator, tree leaves and max priority."""
        return {**super().state_dict(), "tree": self.tree.state_dict(),
                "max_priority": self.max_priority}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        super().load_state_dict(state)
        self.tree.load_state_dict(state["tree"])
        self.max_priority = float(state["max_priority"])


class FifoSampler(Sampler):
    """Consume-once on-policy sampling: every row exactly once per epoch.

    An epoch over ``n`` rows is a (shuffled) permutation split into ``num_minibatches`` parts
    whose sizes differ by at most one (``n/M`` each when ``M`` divides ``n``). The permutation
    depends only on ``(seed, iteration, epoch)``, never on timing, so any schedule sees the same
    mini-batches.

    Args:
        num_minibatches: M, mini-batches per epoch.
        shuffle: Shuffle within the epoch (otherwise insertion order).
        seed: Seed.
    """

    def __init__(self, *, num_minibatches: int = 1, shuffle: bool = True, seed: int = 0) -> None:
        super().__init__(seed=seed)
        if not isinstance(num_minibatches, int) or num_minibatches < 1:
            raise ConfigError("num_minibatches", f"must be a positive integer, got "
                                                 f"{num_minibatches!r}")
        self.num_minibatches = num_minibatches
        self.shuffle = shuffle
        self.iteration = 0
        self.epoch = 0
        self.cursor = 0
        self._parts: list[torch.Tensor] = []

    def begin_epoch(self, size: int, *, iteration: int, epoch: int) -> None:
        """Lay out the mini-batches of one epoch over ``size`` rows."""
        if size < self.num_minibatches:
            raise EmptyBufferError(f"an epoch of {self.num_minibatches} mini-batches needs at "
                                   f"least {self.num_minibatches} rows, got {size}")
        self.iteration, self.epoch, self.cursor = iteration, epoch, 0
        self._parts = self.layout(size, iteration=iteration, epoch=epoch)

    def layout(self, size: int, *, iteration: int, epoch: int) -> list[torch.Tensor]:
        """The slots of each mini-batch of one epoch, without touching the sampler's state.

        A pure function of ``(seed, iteration, epoch, size)``: the plane uses it to start
        assembling an iteration's first mini-batches while its rows are still arriving.
        """
        if self.shuffle:
            rng = np.random.default_rng([self.seed, iteration, epoch])
            order = torch.from_numpy(rng.permutation(size).astype(np.int64))
        else:
            order = torch.arange(size, dtype=torch.int64)
        return list(torch.tensor_split(order, self.num_minibatches))

    @property
    def remaining(self) -> int:
        """Mini-batches left in the current epoch."""
        return len(self._parts) - self.cursor

    def sample(self, size: int, batch_size: int = 0) -> SampleInfo:
        """Next mini-batch of the epoch (``batch_size`` is implied by the epoch layout)."""
        if self.cursor >= len(self._parts):
            raise EmptyBufferError("the epoch's mini-batches are all consumed; begin a new "
                                   "epoch (on-policy data is delivered exactly once per epoch)")
        part = self._parts[self.cursor]
        self.cursor += 1
        return SampleInfo(part)

    def reset(self) -> None:
        """Drop the current epoch layout."""
        self._parts, self.cursor = [], 0

    def state_dict(self) -> dict[str, Any]:
        """Iteration, epoch, cursor and the layout."""
        return {**super().state_dict(), "iteration": self.iteration, "epoch": self.epoch,
                "cursor": self.cursor, "parts": [p.clone() for p in self._parts]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        super().load_state_dict(state)
        self.iteration, self.epoch = int(state["iteration"]), int(state["epoch"])
        self.cursor = int(state["cursor"])
        self._parts = [p.clone() for p in state["parts"]]


class SequenceSampler(Sampler):
    """Fixed-length slices that never cross an episode boundary or the ring's write head.

    A slice of length ``L`` starting at logical position ``j`` (oldest = 0) is valid when
    ``j + L <= size`` and no episode ends inside ``j .. j+L-2`` (it may end at the last step).

    Args:
        length: L, steps per slice.
        boundary_key: Boolean field marking the last step of an episode (e.g. ``"done"``).
        seed: Generator seed.
    """

    def __init__(self, *, length: int, boundary_key: str = "done", seed: int = 0) -> None:
        super().__init__(seed=seed)
        if not isinstance(length, int) or length < 1:
            raise ConfigError("length", f"must be a positive integer, got {length!r}")
        self.length = length
        self.boundary_key = boundary_key
        self._ends = np.zeros(0, dtype=bool)
        self._cursor = 0
        self._size = 0
        self._valid: np.ndarray | None = None

    def bind(self, capacity: int) -> None:
        """Allocate the boundary flags (kept when already bound to this capacity)."""
        if self.capacity == capacity and self._ends.size == capacity:
            return
        super().bind(capacity)
        self._ends = np.zeros(capacity, dtype=bool)

    def on_write(self, indices: torch.Tensor, batch: Batch, *, size: int) -> None:
        """Record episode ends of the new rows."""
        if self.boundary_key not in batch:
            raise SpecError(self.boundary_key, "SequenceSampler needs this boundary field in "
                                               "every write")
        flags = batch[self.boundary_key].detach().reshape(indices.shape[0], -1).any(1)
        idx = indices.numpy()
        self._ends[idx] = flags.cpu().numpy()
        self._cursor = int((idx[-1] + 1) % self.capacity) if idx.size else self._cursor
        self._size = size
        self._valid = None

    def _valid_starts(self) -> np.ndarray:
        if self._valid is None:
            size, cap, length = self._size, self.capacity, self.length
            if size < length:
                self._valid = np.zeros(0, dtype=np.int64)
                return self._valid
            oldest = 0 if size < cap else self._cursor
            order = (np.arange(size) + oldest) % cap
            ends = self._ends[order].astype(np.int64)
            c = np.concatenate([[0], np.cumsum(ends)])
            j = np.arange(size - length + 1)
            inner = c[j + length - 1] - c[j]
            self._valid = order[j[inner == 0]]
        return self._valid

    def sample(self, size: int, batch_size: int) -> SampleInfo:
        """Draw ``batch_size`` slices; indices have shape ``[B, L]``."""
        _need(size, batch_size, "a sequence batch")
        starts = self._valid_starts()
        if starts.size == 0:
            raise EmptyBufferError(f"no slice of length {self.length} fits inside one episode "
                                   f"yet ({size} rows stored)")
        pick = starts[self._rng.integers(0, starts.size, batch_size)]
        idx = (pick[:, None] + np.arange(self.length)[None, :]) % self.capacity
        return SampleInfo(torch.from_numpy(idx.astype(np.int64)))

    def reset(self) -> None:
        """Forget boundaries."""
        self._ends[:] = False
        self._cursor = self._size = 0
        self._valid = None

    def state_dict(self) -> dict[str, Any]:
        """Generator, boundary flags and cursor."""
        return {**super().state_dict(), "ends": self._ends.copy(), "cursor": self._cursor,
                "size": self._size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        super().load_state_dict(state)
        self._ends = state["ends"].copy()
        self._cursor, self._size = int(state["cursor"]), int(state["size"])
        self._valid = None
