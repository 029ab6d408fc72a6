"""Reading state dicts back: typed lookups that refuse values which would corrupt a buffer.

Every ``load_state_dict`` of the storage layer reads through these, so a missing key, a
negative cursor or a NaN priority raises :class:`~conduit.errors.StateError` naming the key
instead of breaking a later push or pull.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from conduit._checks import finite_float
from conduit.errors import StateError

#: A value in a state dict: tensors, plain values, and lists and dicts of them (what
#: ``torch.load``'s weights-only mode reads back).
StateValue = torch.Tensor | int | float | str | bool | None | list["StateValue"] \
    | dict[str, "StateValue"]
#: A component's state, as its ``state_dict()`` returns it.
StateDict = dict[str, StateValue]
#: Strict JSON: what a checkpoint header or a sampler's ``config()`` holds.
JSON = int | float | str | bool | None | list["JSON"] | dict[str, "JSON"]


def entry(state: Mapping[str, StateValue], key: str, where: str) -> Any:
    """``state[key]``, or StateError naming ``where.key`` when it is missing."""
    if not isinstance(state, Mapping):
        raise StateError(where, f"expected a mapping, got {type(state).__name__}")
    if key not in state:
        raise StateError(f"{where}.{key}", "missing")
    return state[key]


def integer(state: Mapping[str, StateValue], key: str, where: str, *, low: int = 0,
            high: int | None = None) -> int:
    """An integer entry in ``[low, high]``."""
    v = entry(state, key, where)
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise StateError(f"{where}.{key}", f"expected an integer, got {v!r}")
    if v < low or (high is not None and v > high):
        raise StateError(f"{where}.{key}", f"{int(v)} is outside [{low}, "
                                           f"{'∞' if high is None else high}]")
    return int(v)


def number(state: Mapping[str, StateValue], key: str, where: str, *, low: float = 0.0) -> float:
    """A finite number >= ``low``."""
    v = entry(state, key, where)
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = float(v)
    f = finite_float(v)
    if f is None:
        raise StateError(f"{where}.{key}", f"expected a finite number, got {v!r}")
    if f < low:
        raise StateError(f"{where}.{key}", f"{v} is below {low}")
    return f


def array(state: Mapping[str, StateValue], key: str, where: str, *, length: int,
          dtype: type | np.dtype) -> np.ndarray:
    """A 1-D array entry (a tensor or numpy array) of ``length`` elements, as a numpy copy of
    ``dtype``.

    The entry's values are taken as they are, never converted into others: a boolean
    ``dtype`` takes booleans only, an integer one integers within its range, a floating one
    floats or integers (so a NaN is never cast into an id, nor a number into a flag).

    Raises:
        StateError: The entry is missing, is not a 1-D array of ``length`` elements, or holds
            values of another kind than ``dtype`` or out of its range (``where.key`` is
            named).
    """
    v = entry(state, key, where)
    if isinstance(v, torch.Tensor):
        try:
            v = v.detach().cpu().numpy()
        except (TypeError, RuntimeError) as exc:  # bfloat16, float8: no numpy type
            raise StateError(f"{where}.{key}", f"expected a {np.dtype(dtype)} array, got "
                                               f"{v.dtype}") from exc
    if not isinstance(v, np.ndarray) or v.ndim != 1 or v.size != length:
        shape = getattr(v, "shape", type(v).__name__)
        raise StateError(f"{where}.{key}", f"expected a 1-D array of {length} elements, got "
                                           f"{shape}")
    want = np.dtype(dtype)
    kinds = {"b": "b", "i": "iu", "u": "iu", "f": "fiu"}.get(want.kind)
    if kinds is not None and v.dtype.kind not in kinds:
        raise StateError(f"{where}.{key}", f"expected {want} values, got {v.dtype}; a state's "
                                           f"values are not converted")
    if want.kind in "iu" and v.size:
        info = np.iinfo(want)
        low, high = int(v.min()), int(v.max())
        if low < info.min or high > info.max:
            raise StateError(f"{where}.{key}", f"values in [{low}, {high}] do not fit {want}")
    return v.astype(want, copy=True)


def tensor(value: np.ndarray) -> torch.Tensor:
    """A numpy array as a tensor for a state dict (so ``torch.load``'s default weights-only
    mode can read the state back)."""
    return torch.from_numpy(np.ascontiguousarray(value))
