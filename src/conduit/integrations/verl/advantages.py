"""GRPO's group-normalized outcome advantage, one prompt group at a time.

verl computes it over a whole step (``core_algos.compute_grpo_outcome_advantage``): a
response's score is the sum of its token-level rewards, normalized by the mean and standard
deviation of the scores of its group (the responses sampled from one prompt). Conduit computes
it in ingestion, once per arriving group, with the same operations in the same order, so the
result is bit-for-bit the one verl computes for that group within a full batch.
"""

from __future__ import annotations

from typing import Any

import torch

from conduit._checks import check_bool
from conduit.errors import SpecError
from conduit.integrations.verl._checks import check_epsilon


def group_scores(token_level_rewards: torch.Tensor) -> torch.Tensor:
    """Outcome score of each response: its token-level rewards summed, shape ``[G]``.

    Raises:
        SpecError: The rewards are not a ``[G, response_length]`` tensor.
    """
    if not isinstance(token_level_rewards, torch.Tensor) or token_level_rewards.dim() != 2:
        raise SpecError("token_level_rewards", "expected a [responses, response_length] tensor")
    return token_level_rewards.sum(dim=-1)


def group_statistics(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (unbiased) standard deviation of one group's scores, in the scores' dtype; a
    group of one response has mean 0 and standard deviation 1, as in verl.

    Either can overflow the dtype (scores near its largest finite value): callers that need
    finite advantages check them (``torch.isfinite``).

    Raises:
        SpecError: ``scores`` is not a non-empty 1-D floating-point tensor.
    """
    _check_scores(scores)
    if scores.shape[0] == 1:
        return torch.tensor(0.0), torch.tensor(1.0)
    return torch.mean(scores), torch.std(scores)


def grpo_group_advantage(scores: torch.Tensor, *, epsilon: float = 1e-6,
                         norm_by_std: bool = True) -> torch.Tensor:
    """Advantage of each response of one group, shape ``[G]``.

    A group of one response has mean 0 and standard deviation 1 (its advantage is its score),
    as in verl. ``norm_by_std=False`` only centres the scores (Dr. GRPO). Computed in the
    scores' dtype, as verl does: scores near the dtype's largest value can overflow the mean
    or standard deviation (see :func:`group_statistics`).

    Args:
        scores: Outcome scores of the group's responses, ``[G]`` with ``G >= 1``, floating
            point.
        epsilon: Added to the standard deviation: a finite number >= 0, and one that is > 0
            in the scores' dtype when ``norm_by_std``.
        norm_by_std: Divide by the group's (unbiased) standard deviation.

    Raises:
        SpecError: ``scores`` is not a non-empty 1-D floating-point tensor.
        ConfigError: ``epsilon`` or ``norm_by_std`` is invalid.
    """
    norm_by_std = check_bool("norm_by_std", norm_by_std)
    mean, std = group_statistics(scores)
    if norm_by_std:
        epsilon = check_epsilon("epsilon", epsilon, norm_by_std=True, dtype=scores.dtype)
        return (scores - mean) / (std + epsilon)
    check_epsilon("epsilon", epsilon, norm_by_std=False)
    return scores - mean


def token_level_advantage(advantage: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each response's advantage on each of its tokens (zero on padding), ``[G, L]``.

    Raises:
        SpecError: ``advantage`` is not a 1-D tensor, or ``response_mask`` not a
            ``[G, L]`` tensor with as many rows.
    """
    if not isinstance(advantage, torch.Tensor) or advantage.dim() != 1:
        raise SpecError("advantage", f"expected a [responses] tensor, got {_shape(advantage)}")
    if (not isinstance(response_mask, torch.Tensor) or response_mask.dim() != 2
            or response_mask.shape[0] != advantage.shape[0]):
        raise SpecError("response_mask", f"expected a [{advantage.shape[0]}, response_length] "
                                         f"tensor (one row per advantage), got "
                                         f"{_shape(response_mask)}")
    return advantage.unsqueeze(-1) * response_mask


def _check_scores(scores: Any) -> None:
    if not isinstance(scores, torch.Tensor):
        raise SpecError("scores", f"expected a 1-D floating-point tensor, got "
                                  f"{type(scores).__name__}; wrap it with torch.tensor(...)")
    if scores.dim() != 1 or scores.shape[0] == 0:
        raise SpecError("scores", f"expected a non-empty 1-D tensor, got shape "
                                  f"{tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise SpecError("scores", f"must have a floating-point dtype (GRPO takes their mean "
                                  f"and standard deviation), got {scores.dtype}; convert with "
                                  f".float()")


def _shape(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}"
    return type(value).__name__
