"""The iteration-latency model of §6.2 (Eq. 2) with the hidden terms of App. E (Eq. 4–6).

For a schedule ``(overlap_ing, g_ing, overlap_del, g_del)`` and a :class:`Profile`:

* per-unit costs ``T̄_ing(g) = T_ing(g)/g`` and ``T̄_del(g) = T_del(g)/g``;
* ``hide_ing = γ(g_ing)·min(T_rollout, T̄_ing(g_ing))`` (Eq. 4),
  ``hide_del = γ(g_del)·min(T_update, T̄_del(g_del))`` (Eq. 5),
  with ``γ(g) = 1`` for ``g >= 1`` and ``1 − g`` for ``0 < g < 1`` (Eq. 6);
  where the profile gives the per-unit data-movement time ``T_copy`` (``t_copy_ing`` /
  ``t_copy_del``), ``T̄`` in the ``min`` is capped at it: on CPython threads only the copies
  run beside the caller, the operator's Python competes with it for the interpreter lock;
* ``T_ing-path = T_rollout + T̄_ing(g_ing) + overlap_ing·(T_sync,ing − hide_ing)``;
* ``T_del-path = T_update + T̄_del(g_del) + overlap_del·(T_sync,del − hide_del)``;
* ``T_iter = T_ing-path + T_del-path``.

Everything here is a pure function of its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from conduit.errors import ScheduleError
from conduit.scheduling.profile import Profile, as_granularity
from conduit.scheduling.space import Schedule


def gamma(g: float | Fraction, *, mode: str = "off_policy") -> float:
    """Overlapable fraction of the hiding bound, Eq. 6.

    Args:
        g: Granularity, ``> 0``.
        mode: ``"off_policy"`` or ``"on_policy"``.

    Returns:
        ``1`` for ``g >= 1`` (off-policy batching hides the full per-unit cost) and ``1 − g``
        for ``0 < g < 1`` (on-policy pipelining hides only the unexposed fraction). On-policy,
        ``g = 1`` also gives ``1 − g = 0``: the whole rollout is ingested only after its last
        unit arrives, and freshness forbids overlapping it with the next iteration's rollout,
        so Eq. 6's off-policy branch does not apply there.

    Raises:
        ScheduleError: ``g`` is not positive.
    """
    g = as_granularity(g)
    if mode == "on_policy":
        return float(1 - min(g, Fraction(1)))
    return 1.0 if g >= 1 else float(1 - g)


def per_unit(seconds: float, g: float | Fraction) -> float:
    """``T̄(g) = T(g)/g``: seconds of one invocation amortized over its ``g`` units."""
    return float(seconds) / float(as_granularity(g))


def hide(t_compute: float, unit_cost: float, g: float | Fraction, *,
         mode: str = "off_policy") -> float:
    """Hidden latency of an overlapped operator, Eq. 4/5: ``γ(g)·min(T_compute, T̄_op(g))``.

    Args:
        t_compute: The neighbouring compute stage (``T_rollout`` for ingestion, ``T_update`` for
            delivery).
        unit_cost: The operator's per-unit cost ``T̄_op(g)``.
        g: The operator's granularity.
        mode: ``"off_policy"`` or ``"on_policy"`` (see :func:`gamma`).

    Returns:
        Seconds of operator latency that overlap can hide.
    """
    return gamma(g, mode=mode) * min(float(t_compute), float(unit_cost))


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Predicted latency of one schedule under one profile (seconds).

    Attributes:
        t_iter: ``T_iter = T_ing-path + T_del-path``, the objective of Eq. 2.
        t_ing_path: Exposed ingestion-path latency ``T_ing-path`` (includes ``T_rollout``).
        t_del_path: Exposed delivery-path latency ``T_del-path`` (includes ``T_update``).
        exposed: ``T_iter − T_rollout − T_update``: the experience-path latency left exposed.
        hide_ing: ``hide_ing`` of Eq. 4 (computed whatever ``overlap_ing``; it only counts when
            ``overlap_ing = 1``).
        hide_del: ``hide_del`` of Eq. 5 (likewise).
        unit_ing: Per-unit ingestion cost ``T̄_ing(g_ing)``.
        unit_del: Per-unit delivery cost ``T̄_del(g_del)``.
    """

    t_iter: float
    t_ing_path: float
    t_del_path: float
    exposed: float
    hide_ing: float
    hide_del: float
    unit_ing: float
    unit_del: float

    def to_dict(self) -> dict[str, float]:
        """JSON-friendly description."""
        return {"t_iter": self.t_iter, "t_ing_path": self.t_ing_path,
                "t_del_path": self.t_del_path, "exposed": self.exposed,
                "hide_ing": self.hide_ing, "hide_del": self.hide_del,
                "unit_ing": self.unit_ing, "unit_del": self.unit_del}


def predict(profile: Profile, schedule: Schedule, *, mode: str = "off_policy") -> Prediction:
    """Score one schedule with the iteration-latency model (Eq. 2, Eq. 4–6).

    Args:
        profile: Profiled costs.
        schedule: The schedule to score.

    Returns:
        The :class:`Prediction`.

    Raises:
        ScheduleError: ``schedule`` is not a :class:`Schedule`, or ``profile`` has no cost for
            one of its granularities.
    """
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"expected a Schedule, got {type(schedule).__name__}")
    unit_ing = per_unit(profile.ing_time(schedule.g_ing), schedule.g_ing)
    unit_del = per_unit(profile.del_time(schedule.g_del), schedule.g_del)
    hide_ing = hide(profile.t_rollout, _overlappable(unit_ing, profile.t_copy_ing),
                    schedule.g_ing, mode=mode)
    hide_del = hide(profile.t_update, _overlappable(unit_del, profile.t_copy_del),
                    schedule.g_del, mode=mode)
    t_ing_path = (profile.t_rollout + unit_ing
                  + schedule.overlap_ing * (profile.t_sync_ing - hide_ing))
    t_del_path = (profile.t_update + unit_del
                  + schedule.overlap_del * (profile.t_sync_del - hide_del))
    t_iter = t_ing_path + t_del_path
    return Prediction(t_iter=t_iter, t_ing_path=t_ing_path, t_del_path=t_del_path,
                      exposed=t_iter - profile.t_rollout - profile.t_update,
                      hide_ing=hide_ing, hide_del=hide_del,
                      unit_ing=unit_ing, unit_del=unit_del)


def _overlappable(unit_cost: float, copy_cost: float | None) -> float:
    """The part of a per-unit operator cost that can run beside the caller."""
    return unit_cost if copy_cost is None else min(unit_cost, copy_cost)
