"""The sampler interface: :class:`Sampler` and the :class:`SampleInfo` a draw returns."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from conduit._checks import check_int
from conduit.errors import ConfigError, EmptyBufferError, PriorityError, StateError
from conduit.spec import Batch, ExperienceSpec
from conduit.storage.state import JSON, StateDict, entry


@dataclass(frozen=True)
class SampleInfo:
    """The result of a draw.

    Attributes:
        indices: Buffer slots, CPU int64; shape ``[B]`` or ``[B, L]`` for sequences.
        weights: Importance weights ``[B]`` (prioritized only).
        written: For a sampler that draws slices of the write order
            (:attr:`Sampler.draws_slices`), the rows the buffer had written when the draw was
            made (its ``total_written``), set by
            :meth:`~conduit.storage.ExperienceBuffer.draw`: a gather then draws again the
            slices that rows written since reached. None otherwise.
    """

    indices: torch.Tensor
    weights: torch.Tensor | None = None
    written: int | None = None


class Sampler(abc.ABC):
    """Base class: which rows a batch reads. Subclasses implement :meth:`sample` and may use
    the write hooks.

    The plane never asks which sampler it holds; it reads two class attributes and calls the
    hooks below (docs/design.md §2):

    * :attr:`consume_once`: every row is delivered exactly once per epoch (on-policy). Such a
      sampler implements :meth:`begin_epoch`, :meth:`layout` and :meth:`seek`, and has
      ``num_minibatches``.
    * :attr:`invalidates_prefetch`: a batch drawn before :meth:`update_priorities` is stale, so
      the plane discards prefetched batches older than the latest update (beyond the allowed
      lag).

    :attr:`accepts_priorities` is set for every subclass from whether it overrides
    :meth:`update_priorities`; only then does the buffer remember which row each gather
    delivered from a slot (a scattered write per row that other samplers do not pay for).
    The buffer also reads :attr:`draws_slices`: only then does a draw record the rows written
    before it, for its gather to check; and :attr:`draws_into`: only then does its synchronous
    sample draw with :meth:`sample_into`, straight into the memory the rows are gathered next
    to.

    Args:
        seed: Seed of the sampler's own generator.

    Raises:
        ConfigError: ``seed`` is not an integer >= 0.
    """

    #: Rows are delivered exactly once per epoch (on-policy samplers).
    consume_once: ClassVar[bool] = False
    #: Priority updates make batches drawn before them stale.
    invalidates_prefetch: ClassVar[bool] = False
    #: A draw's rows along its last dimension are consecutive rows of the write order (sequence
    #: slices), which a write between the draw and its gather may break: the buffer's gather
    #: then draws such a slice again (:meth:`~conduit.storage.ExperienceBuffer.gather`).
    draws_slices: ClassVar[bool] = False
    #: The sampler takes priority updates (derived: it overrides :meth:`update_priorities`).
    accepts_priorities: ClassVar[bool] = False

    @property
    def draws_into(self) -> bool:
        """Whether :meth:`sample_into` draws what :meth:`sample` would: slots only (no
        weights, no slices), into a tensor the caller gives."""
        return False

    def sample_into(self, size: int, out: torch.Tensor) -> None:
        """Where :attr:`draws_into`: draw ``out.shape[0]`` slots out of the ``size`` filled
        ones into ``out`` (CPU int64, 1-D), in place, the slots :meth:`sample` would draw
        (the same generator stream).

        Raises:
            ConfigError: The sampler does not draw into a tensor (``draws_into`` is False).
            EmptyBufferError: The sampler has nothing to draw from.
        """
        raise ConfigError("sampler", f"{type(self).__name__} does not draw into a tensor; "
                                     f"call sample()")

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.accepts_priorities = cls.update_priorities is not Sampler.update_priorities

    def __init__(self, *, seed: int = 0) -> None:
        self.seed = check_int("seed", seed, minimum=0)
        self._rng = np.random.default_rng(self.seed)
        self.capacity = 0

    def bind(self, capacity: int) -> None:
        """Called by a buffer with its capacity before any write, then :meth:`reset`.

        Raises:
            ConfigError: The sampler cannot draw from ``capacity`` slots (the field that
                asks for more is named).
        """
        self.capacity = capacity

    def bind_bytes(self, capacity: int) -> int:
        """Host bytes that :meth:`bind` and the draws allocate for ``capacity`` slots (per-row
        state such as a sum tree's leaves): the buffer counts them against the memory
        available before it binds the sampler."""
        return 0

    def check_spec(self, spec: ExperienceSpec) -> None:
        """Called by the buffer with its spec, before it allocates anything: a sampler that
        reads fields of the rows written refuses a spec without them here, not at a write.

        Raises:
            ConfigError: The sampler needs a field the spec lacks.
        """
        return None

    def on_write(self, indices: torch.Tensor, batch: Batch, *, size: int) -> None:
        """Called after rows were written at ``indices``; ``size`` is the new fill level."""
        return None

    def check_rows(self, *, size: int, head: int) -> None:
        """Called by the buffer after :meth:`load_state_dict`, with the rows its loaded writer
        holds (``size``) and the slot it writes next (``head``): a sampler whose state
        describes its rows refuses a state that describes other rows (they would be drawn
        from slots that hold none, or never drawn).

        Raises:
            StateError: The loaded state does not fit those rows (the key is named).
        """
        return None

    @abc.abstractmethod
    def sample(self, size: int, batch_size: int) -> SampleInfo:
        """Draw ``batch_size`` rows out of the ``size`` filled slots."""

    def begin_epoch(self, size: int, *, iteration: int, epoch: int) -> None:
        """Consume-once samplers: lay out the mini-batches of one epoch over ``size`` rows.
        Other samplers ignore it."""
        return None

    def layout(self, size: int, *, iteration: int, epoch: int) -> list[torch.Tensor]:
        """Consume-once samplers: the slots of each mini-batch of one epoch, as a pure function
        of ``(seed, iteration, epoch, size)``.

        Raises:
            ConfigError: The sampler is not consume-once.
        """
        raise ConfigError("sampler", f"{type(self).__name__} has no epoch layout; on-policy "
                                     f"planes need a consume-once sampler such as FifoSampler")

    def seek(self, position: int) -> None:
        """Consume-once samplers: skip to mini-batch ``position`` of the current epoch (after a
        restore). Other samplers ignore it."""
        return None

    def update_priorities(self, indices: torch.Tensor, priorities: torch.Tensor) -> None:
        """Only prioritized samplers accept priorities."""
        raise PriorityError(f"{type(self).__name__} has no priorities; use "
                            f"PrioritizedSampler to update priorities")

    def reset(self) -> None:
        """Forget per-row state (the buffer was cleared)."""
        return None

    def config(self) -> dict[str, JSON]:
        """The constructor's keyword arguments (JSON), so a checkpoint can rebuild it."""
        return {"seed": self.seed}

    def state_dict(self) -> StateDict:
        """Generator state and per-row state."""
        return {"rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: StateDict) -> None:
        """Restore from :meth:`state_dict`.

        Raises:
            StateError: A key is missing or a value is out of range.
        """
        self._rng.bit_generator.state = self._checked_rng(state)

    def _checked_rng(self, state: StateDict) -> dict:
        """The generator state in ``state``, checked on a scratch generator, so that a
        subclass can check it before it changes anything.

        Raises:
            StateError: The entry is missing or not a state of the sampler's generator.
        """
        rng = entry(state, "rng", "sampler")
        try:
            type(self._rng.bit_generator)().state = rng
        except (TypeError, ValueError, KeyError, OverflowError) as exc:  # Overflow: not uint64
            raise StateError("sampler.rng", f"not a {type(self._rng.bit_generator).__name__} "
                                            f"state: {exc}") from exc
        return rng


def need_rows(size: int, n: int, what: str) -> None:
    if size < 1:
        raise EmptyBufferError(f"cannot sample {what}: the buffer is empty")
    if n < 1:
        raise ConfigError("batch_size", f"must be >= 1, got {n}")
