"""Uniform sampling over the filled slots."""

from __future__ import annotations

import numpy as np
import torch

from conduit._checks import check_bool
from conduit.errors import EmptyBufferError, StateError
from conduit.storage.samplers.base import SampleInfo, Sampler, need_rows
from conduit.storage.state import JSON, StateDict


class UniformSampler(Sampler):
    """Uniform sampling over the filled slots.

    Args:
        replacement: With replacement (default) rows may repeat within a batch; without it a
            batch never holds the same row twice (so ``batch_size`` must not exceed the fill).
        seed: Generator seed.
    """

    def __init__(self, *, replacement: bool = True, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.replacement = check_bool("replacement", replacement)
        self._draws = torch.Generator().manual_seed(_torch_seed(self._rng))

    def config(self) -> dict[str, JSON]:
        """Constructor arguments."""
        return {**super().config(), "replacement": self.replacement}

    @property
    def draws_into(self) -> bool:
        """With replacement, and :meth:`sample` not overridden: :meth:`sample_into` draws
        what it would."""
        return self.replacement and type(self).sample is UniformSampler.sample

    def sample_into(self, size: int, out: torch.Tensor) -> None:
        """Draw ``out.shape[0]`` slots with replacement into ``out`` in place: the slots
        :meth:`sample` draws from the same generator state (``random_`` on the draws'
        generator is the draw ``torch.randint`` makes).

        Raises:
            ConfigError: Sampling without replacement (it draws with :meth:`sample` only).
            EmptyBufferError: Nothing to draw from.
        """
        if not self.replacement:
            super().sample_into(size, out)
        if size < 1 or out.shape[0] < 1:
            need_rows(size, out.shape[0], "a uniform batch")
        out.random_(0, size, generator=self._draws)

    def sample(self, size: int, batch_size: int) -> SampleInfo:
        """Draw ``batch_size`` slots uniformly.

        With replacement, one ``torch.randint`` on the sampler's own torch generator: the
        cheapest draw there is (one call, no intermediate array), as TorchRL's sampler
        draws. For ``size`` below 2**32 torch reduces a 32-bit draw modulo ``size``, so a
        slot's probability is within a factor ``1 ± size / 2**32`` of ``1 / size``
        (``docs/design.md §7``). Without replacement, NumPy's ``choice``.
        """
        if size < 1 or batch_size < 1:
            need_rows(size, batch_size, "a uniform batch")
        if self.replacement:
            return SampleInfo(torch.randint(0, size, (batch_size,), generator=self._draws))
        if batch_size > size:
            raise EmptyBufferError(f"cannot draw {batch_size} distinct rows from {size}; "
                                   f"wait for more data or sample with replacement")
        idx = self._rng.choice(size, batch_size, replace=False).astype(np.int64)
        return SampleInfo(torch.from_numpy(idx))

    def state_dict(self) -> StateDict:
        """Both generators' states: NumPy's (``rng``) and the draws' torch one (``draws``)."""
        return {**super().state_dict(), "draws": self._draws.get_state()}

    def load_state_dict(self, state: StateDict) -> None:
        """Restore from :meth:`state_dict`.

        A state without ``draws`` (for example one whose ``rng`` a shard restore replaced, to
        give the draws a stream of their own) seeds the draws from the restored ``rng``.

        Raises:
            StateError: A generator state is missing or malformed.
        """
        rng = self._checked_rng(state)
        draws = self._checked_draws(state)
        self._rng.bit_generator.state = rng
        if draws is None:
            self._draws.manual_seed(_torch_seed(self._rng))
        else:
            self._draws.set_state(draws)

    def _checked_draws(self, state: StateDict) -> torch.Tensor | None:
        """The draws' generator state in ``state`` (None when absent), checked on a scratch
        generator so that a refused state changes nothing."""
        if "draws" not in state:
            return None
        draws = state["draws"]
        want = self._draws.get_state()
        if (not isinstance(draws, torch.Tensor) or draws.dtype != want.dtype
                or draws.shape != want.shape):
            raise StateError("sampler.draws", f"expected a torch generator state ({want.dtype}, "
                                              f"{tuple(want.shape)}), got "
                                              f"{getattr(draws, 'shape', type(draws).__name__)}")
        draws = draws.cpu()
        try:
            torch.Generator().set_state(draws)
        except RuntimeError as exc:
            raise StateError("sampler.draws", f"not a torch generator state: {exc}") from exc
        return draws


def _torch_seed(rng: np.random.Generator) -> int:
    """A seed for a torch generator, drawn from ``rng``."""
    return int(rng.integers(0, 2**63))
