"""The copy-time bound on what overlap hides (docs/design.md §6).

An operator on a Python thread runs beside its caller only while it is outside the
interpreter lock: its tensor copies are, the Python around them is not. An operator whose data
movement per unit takes under ``min_copy`` seconds is *interpreter-bound*: overlap hides at
most its copies, so its :class:`~conduit.scheduling.Profile` gets ``t_copy_*``. Every other
operator keeps Eq. 4/5 as they are.

Pure functions of plain numbers; the per-sample legs come from the placement's transfer model
(Eq. 1, measured bandwidths).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from conduit.errors import ConfigError
from conduit.scheduling.profile import Profile

#: Per-unit data movement below which an operator counts as interpreter-bound (seconds).
MIN_COPY = 1e-4


@dataclass(frozen=True, kw_only=True)
class CopyTimes:
    """Per-unit data-movement seconds of each operator (None: not known).

    Attributes:
        t_copy_ing: Ingestion's per rollout unit (off-policy) or per iteration (on-policy).
        t_copy_del: Delivery's per batch (off-policy) or per iteration (on-policy).
    """

    t_copy_ing: float | None = None
    t_copy_del: float | None = None

    def __post_init__(self) -> None:
        for name in ("t_copy_ing", "t_copy_del"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ConfigError(name, f"must be a finite, non-negative number of seconds, "
                                        f"got {v!r}")

    def to_dict(self) -> dict[str, float]:
        """The known times, keyed by their :class:`Profile` field names."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def interpreter_bound(self, min_copy: float = MIN_COPY) -> CopyTimes:
        """Only the operators whose data movement per unit is under ``min_copy`` seconds."""
        return CopyTimes(**{k: v for k, v in self.to_dict().items() if v < min_copy})


def copy_times(*, mode: str, ingest_s: float, deliver_s: float, capacity: int,
               batch_size: int, rows_per_unit: float | None,
               learner: str = "cpu") -> CopyTimes:
    """Per-unit data movement of each operator: a unit's rows times a per-sample leg.

    A unit is what the cost model's per-unit costs cover: off-policy one rollout unit
    (ingestion) and one batch (delivery); on-policy the iteration's rows (``T(g)/g``).
    Delivery's time is left unknown (unbounded) for a learner on an accelerator: its update
    waits for its kernels outside the interpreter lock, where a delivery worker's Python runs,
    so Eq. 5 holds as it is.

    Args:
        mode: ``"off_policy"`` or ``"on_policy"``.
        ingest_s: Seconds per sample of the actor -> buffer leg.
        deliver_s: Seconds per sample of the buffer -> learner leg.
        capacity: Rows per iteration (on-policy).
        batch_size: Rows per training batch (off-policy).
        rows_per_unit: Rows per pushed rollout unit so far (off-policy); None when nothing
            was pushed yet, which leaves ingestion's time unknown.
        learner: The learner's device type (``"cpu"``, ``"cuda"``, ...).

    Returns:
        The :class:`CopyTimes`.
    """
    if mode == "on_policy":
        ing, dele = capacity * ingest_s, capacity * deliver_s
    else:
        ing = None if rows_per_unit is None else rows_per_unit * ingest_s
        dele = batch_size * deliver_s
    return CopyTimes(t_copy_ing=ing, t_copy_del=dele if learner == "cpu" else None)


def copy_bound(profile: Profile, copies: CopyTimes, *, min_copy: float = MIN_COPY) -> Profile:
    """``profile`` with the copy-time bound of its interpreter-bound operators.

    Args:
        profile: Measured costs.
        copies: Each operator's data movement per unit.
        min_copy: Below this many seconds per unit an operator is interpreter-bound.

    Returns:
        ``profile`` with ``t_copy_ing`` / ``t_copy_del`` set for the interpreter-bound
        operators (the others as they were).
    """
    return dataclasses.replace(profile, **copies.interpreter_bound(min_copy).to_dict())
