"""Per-token log-probs of GRPO's delivered mini-batches: the sources a trainer declares, and
the plan that decides per mini-batch which of them to compute and which to reuse across epochs.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from conduit.errors import ConfigError, SpecError
from conduit.spec import Batch
from conduit.storage import data_path_threads


@dataclass(frozen=True)
class LogProbSource:
    """Per-token log-probs a delivered mini-batch needs, computed during delivery.

    Attributes:
        key: Name in the delivered batch (``old_per_token_logps``, ``ref_per_token_logps``).
        fn: ``fn(prompt_ids, prompt_mask, completion_ids, completion_mask)`` -> a
            floating-point tensor shaped as ``completion_ids`` (B, T); anything else fails
            the delivery with a :class:`SpecError` naming ``key``. It must read a policy that
            does not change during the iteration (a snapshot).
        skip_first: Leading mini-batches of a single-epoch iteration that need none (they are
            trained under the policy that generated them, so the learner's own log-probs,
            detached, are the same): an int >= 0, or ``skip_first(iteration)`` -> that int,
            called once per iteration by
            :meth:`~conduit.integrations.grpo.GroupExperiencePath.begin_iteration` (where the
            iteration's start does not fall on an optimizer step, the count differs from one
            iteration to the next).
        reuse_across_epochs: With several epochs, compute a mini-batch's log-probs once per
            iteration and deliver the same tensor in its later epochs (every epoch repeats
            the iteration's mini-batches, and ``fn`` reads a snapshot, so they would not
            change); they are held until the mini-batch's last epoch is delivered. False
            (default): ``fn`` runs on every delivery.
    """

    key: str
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    skip_first: int | Callable[[int], int] = 0
    reuse_across_epochs: bool = False


_OUT_KEYS = frozenset({"prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                       "advantages", "row"})


def check_sources(logprobs: Any) -> tuple[LogProbSource, ...]:
    """``logprobs`` as a tuple, each a :class:`LogProbSource` with a callable ``fn``, a key
    of its own, an int >= 0 (or callable) ``skip_first`` and a bool ``reuse_across_epochs``.

    Raises:
        ConfigError: One is not (field ``logprobs``, or ``logprobs[i]...``).
    """
    if isinstance(logprobs, (str, bytes)) or not isinstance(logprobs, Sequence):
        raise ConfigError("logprobs", f"must be a sequence of LogProbSource, got {logprobs!r}")
    keys: set[str] = set()
    for i, src in enumerate(logprobs):
        if not isinstance(src, LogProbSource):
            raise ConfigError(f"logprobs[{i}]", f"must be a LogProbSource, got {src!r}")
        if not isinstance(src.key, str) or not src.key or src.key in _OUT_KEYS | keys:
            raise ConfigError(f"logprobs[{i}].key", f"must be a new name for the delivered "
                                                    f"batch, got {src.key!r}")
        keys.add(src.key)
        if not callable(src.fn):
            raise ConfigError(f"logprobs[{i}].fn", f"must be callable, got {src.fn!r}")
        skip = src.skip_first
        if not callable(skip) and (isinstance(skip, bool) or not isinstance(skip, int)
                                   or skip < 0):
            raise ConfigError(f"logprobs[{i}].skip_first", f"must be an int >= 0 or a "
                                                           f"callable, got {skip!r}")
        if not isinstance(src.reuse_across_epochs, bool):
            raise ConfigError(f"logprobs[{i}].reuse_across_epochs", f"must be a bool, got "
                                                                    f"{src.reuse_across_epochs!r}")
    return tuple(logprobs)



def skip_of(i: int, src: LogProbSource, iteration: int) -> int:
    """``src``'s leading mini-batches without log-probs in ``iteration``.

    Raises:
        ConfigError: A callable ``skip_first`` returned something else than an int >= 0.
    """
    n = src.skip_first(iteration) if callable(src.skip_first) else src.skip_first
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ConfigError(f"logprobs[{i}].skip_first", f"must give an int >= 0, got {n!r}")
    return int(n)



def logprobs_of(src: LogProbSource, batch: Batch) -> torch.Tensor:
    """``src``'s per-token log-probs of a padded mini-batch, on one torch thread (a prefetch
    must not take the learner's cores).

    Raises:
        SpecError: ``src.fn`` returned something else than a floating-point tensor shaped as
            ``completion_ids`` (field ``src.key``).
    """
    completion_ids = batch["completion_ids"]
    with data_path_threads(1):
        logps = src.fn(batch["prompt_ids"], batch["prompt_mask"], completion_ids,
                       batch["completion_mask"])
    if (not isinstance(logps, torch.Tensor) or not logps.is_floating_point()
            or logps.shape != completion_ids.shape):
        got = (f"{logps.dtype} tensor of shape {tuple(logps.shape)}"
               if isinstance(logps, torch.Tensor) else type(logps).__name__)
        raise SpecError(src.key, f"LogProbSource {src.key!r}: fn returned {got}; return "
                                 f"a floating-point tensor of per-token log-probs "
                                 f"shaped as completion_ids, {tuple(completion_ids.shape)}")
    return logps



class LogProbPlan:
    """Which log-probs each delivered mini-batch of an iteration carries.

    A source's leading ``skip_first`` mini-batches of a single-epoch iteration go without; with
    several epochs, the sources that ``reuse_across_epochs`` are computed on a mini-batch's
    first epoch and held until its last.

    Args:
        sources: The checked log-prob sources (see :func:`check_sources`).
        num_epochs: Passes over each iteration.
    """

    def __init__(self, sources: tuple[LogProbSource, ...], *, num_epochs: int) -> None:
        self.sources, self.num_epochs = sources, num_epochs
        self.iteration = -1
        self.skips = tuple(0 for _ in sources)  # per source, for the current iteration
        # (iteration, mini-batch) -> its rows, the log-probs of the sources that reuse them
        # across epochs, and the epochs delivered so far
        self.reused: dict[tuple[int, int], tuple[torch.Tensor, dict[str, torch.Tensor], int]] = {}

    def skips_for(self, iteration: int) -> tuple[int, ...]:
        """Each source's leading mini-batches without log-probs in ``iteration``.

        Raises:
            ConfigError: A callable ``skip_first`` returned something else than an int >= 0.
        """
        return tuple(skip_of(i, src, iteration) for i, src in enumerate(self.sources))

    def begin(self, iteration: int, skips: tuple[int, ...]) -> None:
        """Start ``iteration`` with the ``skips`` of :meth:`skips_for`, holding nothing."""
        self.iteration, self.skips = iteration, skips
        self.reused = {}

    def attach(self, out: Batch, part: int, slots: torch.Tensor) -> None:
        """Add to ``out``, mini-batch ``part`` of the iteration (rows ``slots``), the log-probs
        it needs: reused from an earlier epoch, or computed now.

        Raises:
            SpecError: A source's ``fn`` returned something else than per-token log-probs.
        """
        reused = self._reused(part, slots)
        for src, skip in zip(self.sources, self.skips):
            if src.key in reused:
                out[src.key] = reused[src.key]
            elif self.num_epochs > 1 or part >= skip:
                out[src.key] = logprobs_of(src, out)
        self._keep(part, slots, out, reused)

    def _reused(self, part: int, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The log-probs an earlier epoch computed for mini-batch ``part`` of the iteration
        (the sources with ``reuse_across_epochs``), if it held the same rows ``slots``."""
        held = self.reused.get((self.iteration, part))
        if held is None or not torch.equal(held[0], slots):
            return {}
        return held[1]

    def _keep(self, part: int, slots: torch.Tensor, out: Batch,
              reused: dict[str, torch.Tensor]) -> None:
        """Hold the log-probs of mini-batch ``part`` (delivered as ``out``) that its later
        epochs reuse; drop them with its last epoch."""
        if self.num_epochs == 1 or not any(s.reuse_across_epochs for s in self.sources):
            return
        key = (self.iteration, part)
        held = self.reused.get(key)
        epochs = held[2] + 1 if reused and held is not None else 1
        if epochs >= self.num_epochs:
            self.reused.pop(key, None)
            return
        keep = {s.key: out[s.key] for s in self.sources if s.reuse_across_epochs}
        self.reused[key] = (slots.clone(), keep, epochs)


__all__ = ["LogProbPlan", "LogProbSource", "check_sources", "logprobs_of", "skip_of"]
