"""Sampling n-step windows through the plane: the sampler that draws them and the delivery
operator that turns the gathered rows into transitions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from conduit.errors import EmptyBufferError, SpecError
from conduit.integrations.rllib.episode_rows import EpisodeRows, NStep, Window
from conduit.spec import Batch
from conduit.storage import SampleInfo, Sampler
from conduit.storage.state import JSON, StateDict, entry


@dataclass
class WindowRequest:
    """What the next draw is for.

    Attributes:
        n_step: Steps per window, or a range ``[low, high)`` drawn per row.
        gamma: Discount of the reward sums.
        complete: Redraw rows whose window would be cut short (RLlib's prioritized buffer).
    """

    n_step: NStep = 1
    gamma: float = 0.99
    complete: bool = False

    def draw_n(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """The n-step of ``size`` rows."""
        if isinstance(self.n_step, Sequence):
            low, high = self.n_step
            return rng.integers(low, high, size=size)
        return np.full(size, self.n_step, dtype=np.int64)


class WindowSampler(Sampler):
    """Draws rows with an inner sampler and lays n-step windows over them.

    A draw returns each row's first slot and, when any window is longer than one step, its last
    slot as a second column (``[B, 2]``), so one gather reads the observation and action at
    the start and the next observation at the end. The windows of a draw and the request they
    were drawn for wait in :attr:`drawn`, keyed by ``id`` of its index tensor (the delivered
    ``_index``), for :func:`deliver_windows`. Set :attr:`request` before a pull; a plane whose
    delivery runs inline draws on that pull.

    Args:
        inner: Draws the rows (uniform or prioritized); priorities and state are its own.
        rows: The links the windows follow.
        max_rounds: Redraw rounds before a draw gives up.
    """

    def __init__(self, inner: Sampler, rows: EpisodeRows, *, max_rounds: int = 1000) -> None:
        super().__init__(seed=inner.seed)
        self._rng = np.random.default_rng([inner.seed, 1])  # a stream apart from inner's
        self.inner, self.rows, self.max_rounds = inner, rows, max_rounds
        self.invalidates_prefetch = inner.invalidates_prefetch
        self.request = WindowRequest()
        self.drawn: dict[int, tuple[Window, WindowRequest]] = {}
        #: Rows redrawn because their window was cut short, over the sampler's life.
        self.resamples = 0

    def bind(self, capacity: int) -> None:
        super().bind(capacity)
        self.inner.bind(capacity)

    def on_write(self, indices: torch.Tensor, batch: Batch, *, size: int) -> None:
        self.inner.on_write(indices, batch, size=size)

    def update_priorities(self, indices: torch.Tensor, priorities: torch.Tensor) -> None:
        self.inner.update_priorities(indices, priorities)

    def sample(self, size: int, batch_size: int) -> SampleInfo:
        """Draw ``batch_size`` rows; with ``request.complete``, only rows whose window holds
        all of its ``n`` steps.

        Raises:
            EmptyBufferError: ``max_rounds`` rounds found too few such rows.
        """
        req = self.request
        starts, n, weights = [], [], []
        need = batch_size
        for _ in range(self.max_rounds):
            info = self.inner.sample(size, need)
            idx = info.indices.numpy()
            rows_n = req.draw_n(self._rng, len(idx))
            keep = (self.rows.windows(idx, rows_n).length == rows_n if req.complete
                    else np.ones(len(idx), dtype=bool))
            self.resamples += int(len(idx) - keep.sum())
            starts.append(idx[keep])
            n.append(rows_n[keep])
            if info.weights is not None:
                weights.append(info.weights[torch.from_numpy(keep)])
            need -= int(keep.sum())
            if need == 0:
                break
        else:
            raise EmptyBufferError(f"no {batch_size} rows with a complete {req.n_step}-step "
                                   f"window among {size} rows; add longer episodes or "
                                   f"lower n_step")
        window = self.rows.windows(np.concatenate(starts), np.concatenate(n))
        pairs = window.end != window.starts
        indices = torch.from_numpy(np.stack([window.starts, window.end], axis=1)
                                   if pairs.any() else window.starts.copy())
        self.drawn[id(indices)] = window, req
        return SampleInfo(indices, torch.cat(weights) if weights else None)

    def reset(self) -> None:
        self.inner.reset()
        self.drawn.clear()

    def config(self) -> dict[str, JSON]:
        return self.inner.config()

    def state_dict(self) -> StateDict:
        return {**super().state_dict(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: StateDict) -> None:
        super().load_state_dict(state)
        self.inner.load_state_dict(entry(state, "inner", "sampler"))


@dataclass(frozen=True)
class Transitions:
    """A delivered batch of n-step transitions, as numpy arrays of ``B`` rows."""

    obs: np.ndarray
    action: np.ndarray
    next_obs: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    n_step: np.ndarray
    episode: np.ndarray
    t: np.ndarray
    index: np.ndarray
    weight: np.ndarray | None = field(default=None)

    @classmethod
    def of(cls, batch: Batch) -> Transitions:
        """From a batch pulled from the plane (see :func:`deliver_windows`)."""
        arrays = {k.lstrip("_"): v.numpy() for k, v in batch.items()}
        return cls(**arrays)


def deliver_windows(sampler: WindowSampler, rows: Batch) -> Batch:
    """Training rows for a draw of ``sampler``: observation and action at each window's start,
    next observation at its end, discounted reward sum, end flags, n-step, episode and
    timestep, ``_index`` (the start slots, for priority updates) and ``_weight`` if any.

    Raises:
        SpecError: ``rows`` was not drawn by ``sampler``.
    """
    drawn = sampler.drawn.pop(id(rows["_index"]), None)
    if drawn is None:
        raise SpecError("_index", "the delivered rows were not drawn by this WindowSampler")
    window, request = drawn
    pair = rows["_index"].dim() == 2
    reward, terminated, truncated = sampler.rows.returns(window, request.gamma)
    out = {"obs": rows["obs"][:, 0] if pair else rows["obs"],
           "action": rows["action"][:, 0] if pair else rows["action"],
           "next_obs": rows["next_obs"][:, 1] if pair else rows["next_obs"],
           "reward": torch.from_numpy(reward), "terminated": torch.from_numpy(terminated),
           "truncated": torch.from_numpy(truncated), "n_step": torch.from_numpy(window.n),
           "episode": torch.from_numpy(sampler.rows.episode[window.starts]),
           "t": torch.from_numpy(sampler.rows.t[window.starts]),
           "_index": torch.from_numpy(window.starts)}
    if "_weight" in rows:
        out["_weight"] = rows["_weight"]
    return out
