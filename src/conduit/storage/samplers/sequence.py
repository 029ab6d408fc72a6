"""Fixed-length sequence slices that stay inside one episode."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from conduit._checks import check_int
from conduit.errors import ConfigError, EmptyBufferError, SpecError, StateError
from conduit.spec import Batch, ExperienceSpec
from conduit.storage.samplers.base import SampleInfo, Sampler, need_rows
from conduit.storage.state import JSON, StateDict, array, integer, tensor


class SequenceSampler(Sampler):
    """Fixed-length slices that never cross an episode boundary or the ring's write head.

    A slice of length ``L`` starting at logical position ``j`` (oldest = 0) is valid when
    ``j + L <= size`` and no episode ends inside ``j .. j+L-2`` (it may end at the last step).

    Args:
        length: L, steps per slice.
        boundary_key: Boolean field marking the last step of an episode (e.g. ``"done"``).
        seed: Generator seed.

    Raises:
        ConfigError: ``length`` is not a positive integer, or ``boundary_key`` not a
            non-empty string.
    """

    draws_slices: ClassVar[bool] = True

    def __init__(self, *, length: int, boundary_key: str = "done", seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.length = check_int("length", length, minimum=1)
        if not isinstance(boundary_key, str) or not boundary_key:
            raise ConfigError("boundary_key", f"expected the name of the boolean field that "
                                              f"marks an episode's last step (such as "
                                              f"'done'), got {boundary_key!r}")
        self.boundary_key = boundary_key
        self._ends = np.zeros(0, dtype=bool)
        self._cursor = 0
        self._size = 0
        self._valid: np.ndarray | None = None

    def bind(self, capacity: int) -> None:
        """Allocate the boundary flags (kept when already bound to this capacity: the buffer
        then resets them).

        Raises:
            ConfigError: ``length`` is larger than ``capacity``: no slice would ever fit
                (nothing changes).
        """
        if self.length > capacity:
            raise ConfigError("length", f"{self.length} steps per slice do not fit a buffer of "
                                        f"{capacity} rows; lower length or raise capacity")
        if self.capacity == capacity and self._ends.size == capacity:
            return
        super().bind(capacity)
        self._ends = np.zeros(capacity, dtype=bool)

    def bind_bytes(self, capacity: int) -> int:
        """The boundary flags (one byte a slot) and the valid starts a draw keeps (up to eight
        bytes a slot)."""
        return 9 * capacity

    def check_spec(self, spec: ExperienceSpec) -> None:
        """Refuse a spec without the boundary field (every write would fail after storing).

        Raises:
            ConfigError: ``boundary_key`` is not a field of ``spec``.
        """
        if self.boundary_key not in spec.fields:  # (a non-empty str: the constructor checks)
            raise ConfigError("boundary_key", f"{self.boundary_key!r} is not a field of the "
                                              f"spec {list(spec.fields)}; pass boundary_key= "
                                              f"the field that marks an episode's last step")

    def on_write(self, indices: torch.Tensor, batch: Batch, *, size: int) -> None:
        """Record episode ends of the new rows (an empty write changes nothing).

        Raises:
            SpecError: The write lacks the boundary field.
        """
        if self.boundary_key not in batch:
            raise SpecError(self.boundary_key, "SequenceSampler needs this boundary field in "
                                               "every write")
        if indices.shape[0] == 0:
            return
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
        need_rows(size, batch_size, "a sequence batch")
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

    def state_dict(self) -> StateDict:
        """Generator, boundary flags and cursor."""
        return {**super().state_dict(), "ends": tensor(self._ends.copy()),
                "cursor": self._cursor, "size": self._size}

    def config(self) -> dict[str, JSON]:
        """Constructor arguments."""
        return {**super().config(), "length": self.length, "boundary_key": self.boundary_key}

    def load_state_dict(self, state: StateDict) -> None:
        """Restore from :meth:`state_dict`."""
        ends = array(state, "ends", "sampler", length=self.capacity, dtype=bool)
        cursor = integer(state, "cursor", "sampler", high=max(self.capacity - 1, 0))
        size = integer(state, "size", "sampler", high=self.capacity)
        super().load_state_dict(state)
        self._ends, self._cursor, self._size = ends, cursor, size
        self._valid = None

    def check_rows(self, *, size: int, head: int) -> None:
        """Refuse a state whose fill level or write head is not the writer's.

        Raises:
            StateError: ``sampler.size`` or ``sampler.cursor`` differs from the writer's.
        """
        if self._size != size:
            raise StateError("sampler.size", f"{self._size}, but the writer holds {size} "
                                             f"rows (slices would start in slots that hold "
                                             f"no row, or skip rows)")
        if size and self._cursor != head:
            raise StateError("sampler.cursor", f"{self._cursor}, but the writer's next slot "
                                               f"is {head} (the oldest row would be "
                                               f"misplaced)")
