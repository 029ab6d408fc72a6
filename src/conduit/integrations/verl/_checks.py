"""Argument checks of the verl integration's own settings (the common ones live in
:mod:`conduit._checks`)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from conduit._checks import check_int, check_real
from conduit.errors import ConfigError

#: Largest seed ``torch.Generator.manual_seed`` takes (verl's shuffle seeds one).
MAX_SEED = 2**64 - 1


def check_epsilon(field: str, value: Any, *, norm_by_std: bool,
                  dtype: torch.dtype = torch.float32) -> float:
    """GRPO's ``epsilon``: a finite number >= 0, and > 0 where it guards the division by a
    group's standard deviation (a group of equal scores has deviation 0) -- also once rounded
    to ``dtype``, the dtype of the scores it is added to.

    Raises:
        ConfigError: ``value`` is not a finite number in range, or rounds to 0 in ``dtype``.
    """
    eps = check_real(field, value, positive=False)
    if norm_by_std and eps == 0:
        raise ConfigError(field, "must be > 0 when advantages are divided by the group's "
                                 "standard deviation (a group of equal scores has deviation "
                                 "0); verl's default is 1e-6")
    if norm_by_std and rounds_to_zero(eps, dtype):
        raise ConfigError(field, f"{eps!r} rounds to 0 in {dtype}, the dtype of the scores "
                                 f"it is added to, so a group of equal scores would divide 0 "
                                 f"by 0; use a larger one (verl's default 1e-6 is > 0 down "
                                 f"to float16)")
    return eps


@lru_cache(maxsize=64)
def rounds_to_zero(eps: float, dtype: torch.dtype) -> bool:
    """Whether ``eps`` (a positive float) becomes 0 in floating-point ``dtype``."""
    return bool(torch.tensor(eps, dtype=dtype) == 0)


def check_seed(field: str, value: Any) -> int:
    """A shuffle seed: an integer in ``[0, 2**64 - 1]`` (what ``torch.Generator`` takes).

    Raises:
        ConfigError: ``value`` is not such an integer.
    """
    seed = check_int(field, value, minimum=0)
    if seed > MAX_SEED:
        raise ConfigError(field, f"must be at most 2**64 - 1 (torch.Generator's range), got "
                                 f"{seed}")
    return seed
