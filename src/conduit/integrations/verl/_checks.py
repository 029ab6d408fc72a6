"""Argument checks of the verl integration's own settings (the common ones live in
:mod:`conduit._checks`)."""

from __future__ import annotations

from typing import Any

from conduit._checks import check_real
from conduit.errors import ConfigError


def check_epsilon(field: str, value: Any, *, norm_by_std: bool) -> float:
    """GRPO's ``epsilon``: a finite number >= 0, and > 0 where it guards the division by a
    group's standard deviation (a group of equal scores has deviation 0).

    Raises:
        ConfigError: ``value`` is not a finite number in range.
    """
    eps = check_real(field, value, positive=False)
    if norm_by_std and eps == 0:
        raise ConfigError(field, "must be > 0 when advantages are divided by the group's "
                                 "standard deviation (a group of equal scores has deviation "
                                 "0); verl's default is 1e-6")
    return eps
