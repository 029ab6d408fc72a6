"""Argument checks shared across the layers: each bad value gets a
:class:`~conduit.errors.ConfigError` naming the field and saying what to pass instead."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from conduit.errors import ConfigError


def check_int(field: str, value: Any, *, minimum: int) -> int:
    """``value`` as an ``int`` (a bool is not one).

    Raises:
        ConfigError: ``value`` is not an integer ``>= minimum``.
    """
    if type(value) is int and value >= minimum:  # the usual case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(field, f"must be {what}, got {value!r}")
    return int(value)


def finite_float(value: Any) -> float | None:
    """``value`` as a finite ``float``, or None when it is not a finite real number (a bool is
    not one, and neither is an int too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        f = float(value)
    except (OverflowError, TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def check_real(field: str, value: Any, *, positive: bool, what: str = "a number") -> float:
    """``value`` as a finite ``float`` (a bool or a string is not one).

    Args:
        field: Name the error gives.
        value: The value to check.
        positive: Require ``> 0``; otherwise ``>= 0``.
        what: What the number is, for the message (e.g. ``"a number of seconds"``).

    Raises:
        ConfigError: ``value`` is not a finite real number in range.
    """
    bound = "> 0" if positive else ">= 0"
    f = finite_float(value)
    if f is None or f < 0 or (positive and f == 0):
        raise ConfigError(field, f"must be a finite {what.removeprefix('a ')} {bound}, got "
                                 f"{value!r}")
    return f


def check_bool(field: str, value: Any) -> bool:
    """``value`` as a ``bool``.

    Raises:
        ConfigError: ``value`` is not a bool (a string such as ``"no"`` is refused, not read
            as true).
    """
    if not isinstance(value, bool):
        raise ConfigError(field, f"must be True or False, got {value!r}")
    return value


def check_key(field: str, value: Any) -> str:
    """A field name: a non-empty string.

    Raises:
        ConfigError: ``value`` is not a non-empty string.
    """
    if not isinstance(value, str) or not value:
        raise ConfigError(field, f"must be the name of a field (a non-empty string), got "
                                 f"{value!r}")
    return value


def check_device(field: str, value: Any) -> torch.device:
    """``value`` as a ``torch.device`` this machine has: the CPU or a present CUDA device.

    Args:
        field: Name the error gives.
        value: A ``torch.device``, a device string such as ``"cpu"``, ``"cuda"`` or
            ``"cuda:1"``, or a CUDA device index (an ``int``, as torch takes it).

    Raises:
        ConfigError: ``value`` is neither a device, a device string nor an index, names no
            device torch knows, is neither CPU nor CUDA, or names a CUDA device this machine
            lacks.
    """
    if isinstance(value, bool) or not isinstance(value, (str, torch.device, int)):
        raise ConfigError(field, f"must be a torch.device, a device string such as 'cpu' or "
                                 f"'cuda:0', or a CUDA device index, got {value!r}")
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(field, f"not a device: {value!r} ({exc}); pass 'cpu' or "
                                 f"'cuda[:index]'") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(field, f"must be a CPU or CUDA device, got {value!r}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0 or (device.index is not None and device.index >= count):
        have = f"{count} CUDA devices" if count else "no CUDA device"
        raise ConfigError(field, f"'{device}' is not on this machine ({have}); pass 'cpu' or "
                                 f"a CUDA device this machine has")
    return device
