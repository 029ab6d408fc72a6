"""Cost-model fidelity, as reported in App. F / Tab. 4: Pearson r, MAPE, top-k rank agreement.

The optimizer picks by argmin over predictions, so rank agreement matters more than pointwise
accuracy; both are reported.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from conduit.errors import ConfigError


def _as_array(name: str, values: Sequence[float]) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError(name, "must be a sequence of numbers") from None
    if arr.ndim != 1:
        raise ConfigError(name, f"must be one-dimensional, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ConfigError(name, "must contain only finite numbers")
    return arr


def top_k_order(values: Sequence[float], k: int) -> list[int]:
    """Indices of the ``k`` smallest values, smallest first (ties keep input order).

    Args:
        values: Latencies, one per configuration.
        k: How many to return (capped at ``len(values)``).

    Returns:
        The indices.
    """
    arr = np.asarray(values, dtype=np.float64)
    return [int(i) for i in np.argsort(arr, kind="stable")[:k]]


def fidelity(predicted: Sequence[float], measured: Sequence[float], k: int = 8) -> dict:
    """Compare predicted and measured ``T_iter`` over a set of configurations (Tab. 4).

    Args:
        predicted: Predicted ``T_iter`` per configuration.
        measured: Measured ``T_iter`` per configuration, same order; all ``> 0``.
        k: Size of the ranking compared (Tab. 4 uses 8); capped at the number of
            configurations.

    Returns:
        A JSON-friendly dict:

        * ``"n"``: number of configurations; ``"k"``: the ``k`` used;
        * ``"pearson_r"``: Pearson correlation of predicted vs measured (``nan`` when fewer than
          two configurations or either side is constant);
        * ``"mape"``: mean absolute percentage error, in percent
          (``100·mean(|pred − meas| / meas)``);
        * ``"top_k_match"``: whether the ``k`` lowest predictions, in order, are exactly the
          ``k`` lowest measurements in the same order;
        * ``"best_match"``: whether the predicted argmin is the measured argmin;
        * ``"predicted_top_k"`` / ``"measured_top_k"``: the two orderings (indices).

    Raises:
        ConfigError: Lengths differ, a list is empty, a value is not finite, a measured value is
            not positive, or ``k < 1``.
    """
    p = _as_array("predicted", predicted)
    m = _as_array("measured", measured)
    if p.shape != m.shape:
        raise ConfigError("measured", f"has {m.size} values but predicted has {p.size}")
    if m.size == 0:
        raise ConfigError("measured", "must not be empty")
    if np.any(m <= 0):
        raise ConfigError("measured", "must be positive latencies (MAPE divides by them)")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError("k", f"must be a positive integer, got {k!r}")
    k = min(k, int(m.size))
    if m.size < 2 or np.ptp(p) == 0 or np.ptp(m) == 0:
        r = math.nan
    else:
        r = float(np.corrcoef(p, m)[0, 1])
    mape = float(np.mean(np.abs(p - m) / m) * 100.0)
    pred_top = top_k_order(p, k)
    meas_top = top_k_order(m, k)
    return {"n": int(m.size), "k": k, "pearson_r": r, "mape": mape,
            "top_k_match": pred_top == meas_top, "best_match": pred_top[0] == meas_top[0],
            "predicted_top_k": pred_top, "measured_top_k": meas_top}
