"""When to re-plan (§6.3: the search "only re-runs if workload or resources change").

:class:`DriftDetector` is the pure core: an immutable value whose :meth:`DriftDetector.observe`
returns the next detector. A metric (``T_rollout``, ``T_update``, ``T_ing(g)``, ``T_del(g)``,
and optionally the sync costs) *drifts* when its measured value departs from the reference
profile by more than ``threshold`` (relative, default 25 %) on ``patience`` consecutive
observations, all on the same side of the reference. Hysteresis:

* an observation inside the band resets that metric's streak, so noise within the band never
  triggers, and isolated excursions outside it do not either;
* a side change (above -> below) restarts the streak, so large symmetric noise does not trigger;
* once triggered, the detector stays triggered until :meth:`DriftDetector.rebase` installs the
  new reference (the re-planned profile).

:class:`ReplanPolicy` wraps a detector for a caller that wants a mutable object, and adds the
other trigger: a placement migration (:meth:`ReplanPolicy.notify_migration`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction

from conduit.errors import ConfigError
from conduit.scheduling.profile import Profile

#: Metric names, in reporting order.
METRICS = ("rollout", "update", "ingestion", "delivery", "sync_ing", "sync_del")
#: Reason reported when placement migrated.
MIGRATION = "migration"
#: Relative slack on the threshold so that a value exactly at the band's edge (up to float
#: rounding) counts as inside it.
_SLACK = 1e-9


def _check_seconds(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ConfigError(name, f"must be a finite, non-negative number of seconds, got {v!r}")
    return float(v)


@dataclass(frozen=True, kw_only=True)
class DriftDetector:
    """Immutable drift detector against a reference :class:`Profile`.

    Args:
        reference: The profile the current plan was computed from.
        threshold: Relative deviation ``|measured − reference| / reference`` beyond which an
            observation counts as out of band (``> 0``; default 0.25). A value exactly at the
            threshold is inside the band.
        patience: Consecutive out-of-band observations on the same side needed to trigger
            (``k >= 1``; default 3).
        abs_tol: Absolute deviation (seconds) below which an observation is always in band;
            guards against tiny references (e.g. a zero sync cost). Default 0.

    Attributes:
        streaks: Per metric, the signed count of consecutive out-of-band observations
            (positive: above the reference; negative: below). Internal state.
        drifted: Metrics that triggered since the last rebase, in trigger order.
    """

    reference: Profile
    threshold: float = 0.25
    patience: int = 3
    abs_tol: float = 0.0
    streaks: tuple[tuple[str, int], ...] = field(default=(), repr=False)
    drifted: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.reference, Profile):
            raise ConfigError("reference", "must be a Profile, got "
                              f"{type(self.reference).__name__}")
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                or t <= 0:
            raise ConfigError("threshold", f"must be a positive relative deviation, got {t!r}")
        p = self.patience
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ConfigError("patience", f"must be a positive integer, got {p!r}")
        object.__setattr__(self, "abs_tol", _check_seconds("abs_tol", self.abs_tol))

    @property
    def triggered(self) -> bool:
        """Whether some metric drifted since the last :meth:`rebase`."""
        return bool(self.drifted)

    def streak(self, metric: str) -> int:
        """Signed count of consecutive out-of-band observations of ``metric`` (0 if none)."""
        return dict(self.streaks).get(metric, 0)

    def deviation(self, metric: str, value: float, *, g: float | Fraction = 1) -> float:
        """Signed relative deviation of ``value`` from the reference for ``metric``.

        Args:
            metric: One of :data:`METRICS`.
            value: Measured seconds (for operators: one invocation at granularity ``g``).
            g: Granularity of the measured operator invocation (ignored for other metrics).

        Returns:
            ``(value − reference) / reference``; ``±inf`` when the reference is 0 and the value
            differs, 0 when both are 0.

        Raises:
            ConfigError: Unknown ``metric``.
            ScheduleError: The reference profile has no cost at granularity ``g``.
        """
        ref = self._reference_value(metric, g)
        diff = float(value) - ref
        if ref > 0:
            return diff / ref
        return 0.0 if diff == 0 else math.copysign(math.inf, diff)

    def _reference_value(self, metric: str, g: float | Fraction) -> float:
        r = self.reference
        if metric == "rollout":
            return r.t_rollout
        if metric == "update":
            return r.t_update
        if metric == "ingestion":
            return r.ing_time(g)
        if metric == "delivery":
            return r.del_time(g)
        if metric == "sync_ing":
            return r.t_sync_ing
        if metric == "sync_del":
            return r.t_sync_del
        raise ConfigError("metric", f"must be one of {METRICS}, got {metric!r}")

    def _side(self, metric: str, value: float, g: float | Fraction) -> int:
        """+1 / −1 when ``value`` is out of band above / below the reference, else 0."""
        ref = self._reference_value(metric, g)
        diff = value - ref
        if abs(diff) <= self.abs_tol or abs(diff) <= self.threshold * ref * (1 + _SLACK):
            return 0
        return 1 if diff > 0 else -1

    def observe(self, *, t_rollout: float | None = None, t_update: float | None = None,
                t_ing: float | None = None, g_ing: float | Fraction = 1,
                t_del: float | None = None, g_del: float | Fraction = 1,
                t_sync_ing: float | None = None,
                t_sync_del: float | None = None) -> DriftDetector:
        """Feed one observation (any subset of metrics) and return the next detector.

        Metrics left as ``None`` are not observed this time: their streaks are unchanged.

        Args:
            t_rollout: Measured rollout seconds.
            t_update: Measured update seconds.
            t_ing: Measured seconds of one ingestion invocation at ``g_ing``.
            g_ing: Granularity of that ingestion invocation.
            t_del: Measured seconds of one delivery invocation at ``g_del``.
            g_del: Granularity of that delivery invocation.
            t_sync_ing: Measured ingestion sync cost.
            t_sync_del: Measured delivery sync cost.

        Returns:
            A new :class:`DriftDetector`; ``self`` is unchanged.

        Raises:
            ConfigError: A value is negative or not finite.
            ScheduleError: The reference has no cost at ``g_ing`` / ``g_del``.
        """
        obs = (("rollout", "t_rollout", t_rollout, 1), ("update", "t_update", t_update, 1),
               ("ingestion", "t_ing", t_ing, g_ing), ("delivery", "t_del", t_del, g_del),
               ("sync_ing", "t_sync_ing", t_sync_ing, 1),
               ("sync_del", "t_sync_del", t_sync_del, 1))
        streaks = dict(self.streaks)
        drifted = list(self.drifted)
        for metric, arg, value, g in obs:
            if value is None:
                continue
            value = _check_seconds(arg, value)
            side = self._side(metric, value, g)
            prev = streaks.get(metric, 0)
            if side == 0:
                count = 0
            elif prev * side > 0:
                count = prev + side
            else:
                count = side
            streaks[metric] = count
            if abs(count) >= self.patience and metric not in drifted:
                drifted.append(metric)
        ordered = tuple((m, streaks[m]) for m in METRICS if streaks.get(m, 0) != 0)
        return replace(self, streaks=ordered, drifted=tuple(drifted))

    def rebase(self, reference: Profile) -> DriftDetector:
        """A fresh detector (no streaks, not triggered) against a new reference profile."""
        return replace(self, reference=reference, streaks=(), drifted=())


@dataclass(frozen=True, kw_only=True)
class ReplanDecision:
    """Whether to re-plan now, and why.

    Attributes:
        replan: True when a metric drifted or placement migrated since the last re-plan.
        reasons: Drifted metric names (see :data:`METRICS`) and/or ``"migration"``.
    """

    replan: bool
    reasons: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.replan


class ReplanPolicy:
    """Decides when the optimizer must run again: sustained drift or a placement migration.

    A thin mutable holder around a :class:`DriftDetector`; deterministic given the sequence of
    calls (no clocks, no I/O).

    Args:
        reference: The profile the current plan was computed from.
        threshold: Relative drift threshold (default 0.25).
        patience: Consecutive out-of-band observations needed (default 3).
        abs_tol: Absolute deviation always treated as in band (seconds, default 0).
    """

    def __init__(self, *, reference: Profile, threshold: float = 0.25, patience: int = 3,
                 abs_tol: float = 0.0) -> None:
        self._detector = DriftDetector(reference=reference, threshold=threshold,
                                       patience=patience, abs_tol=abs_tol)
        self._migrated = False

    @property
    def detector(self) -> DriftDetector:
        """The current (immutable) detector state."""
        return self._detector

    def decision(self) -> ReplanDecision:
        """The current decision, without observing anything."""
        reasons = self._detector.drifted + ((MIGRATION,) if self._migrated else ())
        return ReplanDecision(replan=bool(reasons), reasons=reasons)

    def observe(self, **measurements: float | Fraction | None) -> ReplanDecision:
        """Feed one observation (keywords of :meth:`DriftDetector.observe`).

        Returns:
            The :class:`ReplanDecision` after this observation.
        """
        self._detector = self._detector.observe(**measurements)
        return self.decision()

    def notify_migration(self) -> ReplanDecision:
        """Record that placement migrated: operator costs changed, so re-plan.

        Returns:
            The :class:`ReplanDecision` (always ``replan=True``).
        """
        self._migrated = True
        return self.decision()

    def replanned(self, reference: Profile) -> None:
        """Install the profile of the new plan: clears drift streaks and the migration flag."""
        self._detector = self._detector.rebase(reference)
        self._migrated = False
