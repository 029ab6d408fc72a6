"""GRPO's group-normalized outcome advantage, one prompt group at a time.

verl computes it over a whole step (``core_algos.compute_grpo_outcome_advantage``): a
response's score is the sum of its token-level rewards, normalized by the mean and standard
deviation of the scores of its group (the responses sampled from one prompt). Conduit computes
it in ingestion, once per arriving group, with the same operations in the same order, so the
result is bit-for-bit the one verl computes for that group within a full batch.
"""

from __future__ import annotations

import torch

from conduit.errors import SpecError


def group_scores(token_level_rewards: torch.Tensor) -> torch.Tensor:
    """Outcome score of each response: its token-level rewards summed, shape ``[G]``.

    Raises:
        SpecError: The rewards are not a ``[G, response_length]`` tensor.
    """
    if not isinstance(token_level_rewards, torch.Tensor) or token_level_rewards.dim() != 2:
        raise SpecError("token_level_rewards", "expected a [responses, response_length] tensor")
    return token_level_rewards.sum(dim=-1)


def grpo_group_advantage(scores: torch.Tensor, *, epsilon: float = 1e-6,
                         norm_by_std: bool = True) -> torch.Tensor:
    """Advantage of each response of one group, shape ``[G]``.

    A group of one response has mean 0 and standard deviation 1 (its advantage is its score),
    as in verl. ``norm_by_std=False`` only centres the scores (Dr. GRPO).

    Args:
        scores: Outcome scores of the group's responses, ``[G]`` with ``G >= 1``.
        epsilon: Added to the standard deviation.
        norm_by_std: Divide by the group's (unbiased) standard deviation.

    Raises:
        SpecError: ``scores`` is not a non-empty 1-D tensor.
    """
    if scores.dim() != 1 or scores.shape[0] == 0:
        raise SpecError("scores", f"expected a non-empty 1-D tensor, got shape "
                                  f"{tuple(scores.shape)}")
    if scores.shape[0] == 1:
        mean, std = torch.tensor(0.0), torch.tensor(1.0)
    else:
        mean, std = torch.mean(scores), torch.std(scores)
    if norm_by_std:
        return (scores - mean) / (std + epsilon)
    return scores - mean


def token_level_advantage(advantage: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each response's advantage on each of its tokens (zero on padding), ``[G, L]``."""
    return advantage.unsqueeze(-1) * response_mask
