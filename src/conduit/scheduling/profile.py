"""Profiled costs the cost model reads (§6.2, §6.3): ``T_rollout``, ``T_update``, ``T_ing(g)``,
``T_del(g)`` and the synchronization costs of overlap.

A :class:`Profile` is plain data. Build one by hand (tests, what-if planning) or from the plane's
built-in :class:`~conduit.timing.Timings` with :func:`profile_from_timings`.

Operator costs at granularities that were not measured are filled from a fixed + per-unit cost
fit ``T(g) = a + b·g`` (see :class:`CostFit`), which is exactly the amortization that
granularity exploits: ``a`` is the per-invocation overhead, ``b`` the cost per unit of work.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType
from typing import TYPE_CHECKING

from conduit._checks import finite_float
from conduit.errors import ConfigError, ScheduleError

if TYPE_CHECKING:
    from conduit.scheduling.space import ScheduleSpace
    from conduit.timing import Timings

#: Denominator bound used when turning float granularities into fractions (as in ``Schedule``).
_MAX_DEN = 1024


class ProfileError(ConfigError):
    """The timings cannot yield a profile (e.g. an operator or stage was never measured).

    A :class:`~conduit.errors.ConfigError` (hence a ``ConduitError`` and ``ValueError``) whose
    ``field`` is the timing name or profile field at fault.
    """


def as_granularity(g: float | int | Fraction) -> Fraction:
    """Normalize a granularity to the ``Fraction`` form used by ``Schedule`` and the spaces.

    Args:
        g: A positive number of units (e.g. ``4``, ``0.25`` or ``Fraction(1, 4)``).

    Returns:
        ``Fraction(g)`` with its denominator limited to 1024 (always ``> 0``).

    Raises:
        ScheduleError: ``g`` is not a positive finite number, or it rounds to 0 at that
            resolution (below about 1/2048).
    """
    if (not isinstance(g, (int, float, Fraction)) or isinstance(g, bool)
            or finite_float(g) is None or not g > 0):
        raise ScheduleError(f"granularity must be a positive finite number, got {g!r}")
    out = Fraction(g).limit_denominator(_MAX_DEN)
    if out <= 0:
        raise ScheduleError(f"granularity {g!r} rounds to 0 (granularities are kept as "
                            f"fractions with denominators up to {_MAX_DEN}); use at least "
                            f"1/{_MAX_DEN}")
    return out


@dataclass(frozen=True, kw_only=True)
class CostFit:
    """Fixed + per-unit operator cost ``T(g) = fixed + per_unit·g`` (both ``>= 0``).

    Attributes:
        fixed: Seconds of per-invocation overhead (``a``).
        per_unit: Seconds per unit of work (``b``).

    Raises:
        ConfigError: ``fixed`` or ``per_unit`` is not a finite, non-negative real number (a
            bool is not one; ``field`` is ``"fixed"`` / ``"per_unit"``). Numbers are stored as
            ``float``.
    """

    fixed: float
    per_unit: float

    def __post_init__(self) -> None:
        for name in ("fixed", "per_unit"):
            v = getattr(self, name)
            f = finite_float(v)
            if f is None or f < 0:
                raise ConfigError(name, f"must be a finite, non-negative number of seconds, "
                                        f"got {v!r}")
            object.__setattr__(self, name, f)

    def __call__(self, g: float | Fraction) -> float:
        """Predicted seconds for one invocation at granularity ``g``."""
        return self.fixed + self.per_unit * float(g)


def fit_cost(points: Mapping[Fraction, float] | Iterable[tuple[float, float]]) -> CostFit:
    """Least-squares fit of ``T(g) = a + b·g`` with ``a, b >= 0`` to measured ``(g, T)`` points.

    Rules, in order:

    * one distinct ``g``: the cost is assumed proportional to the work (``a = 0``,
      ``b = T/g``), i.e. no amortization is assumed without evidence for it;
    * two or more: ordinary least squares; if it gives ``a < 0`` (super-linear costs) the
      best fit through the origin is used instead, and if it gives ``b < 0`` (costs falling with
      work, i.e. noise) the best constant (the mean) is used. Fitted values are therefore
      never negative, and extrapolation never predicts a cost falling with ``g``.

    Args:
        points: ``{g: seconds}`` or ``(g, seconds)`` pairs; ``g > 0``, ``seconds >= 0``, both
            finite.

    Returns:
        The :class:`CostFit`.

    Raises:
        ProfileError: ``points`` is empty, a point is not a ``(g, seconds)`` pair of finite
            numbers with ``g > 0`` and ``seconds >= 0``, or the points are so extreme that
            the fit overflows (``field="points"``; a :class:`~conduit.errors.ConfigError`).
    """
    items = list(points.items()) if isinstance(points, Mapping) else list(points)
    if not items:
        raise ProfileError("points", "no measured operator times to fit")
    gs: list[float] = []
    ts: list[float] = []
    for item in items:
        try:
            g, t = item
        except (TypeError, ValueError):
            raise ProfileError("points", f"each point must be a (g, seconds) pair, got "
                                         f"{item!r}") from None
        gf, tf = finite_float(g), finite_float(t)
        if gf is None or not gf > 0:
            raise ProfileError("points", f"granularity must be a finite number > 0, got "
                                         f"{g!r} (point {item!r})")
        if tf is None or tf < 0:
            raise ProfileError("points", f"seconds must be a finite number >= 0, got {t!r} "
                                         f"(point {item!r})")
        gs.append(gf)
        ts.append(tf)
    try:
        return _least_squares(gs, ts)
    except (ArithmeticError, ConfigError) as e:  # overflow, or a fit that is not finite
        raise ProfileError("points", f"out of range for a cost fit ({e})") from None


def _least_squares(gs: list[float], ts: list[float]) -> CostFit:
    if len(set(gs)) == 1:
        return CostFit(fixed=0.0, per_unit=statistics.fmean(ts) / gs[0])
    g_mean = statistics.fmean(gs)
    t_mean = statistics.fmean(ts)
    sxx = sum((g - g_mean) ** 2 for g in gs)
    sxy = sum((g - g_mean) * (t - t_mean) for g, t in zip(gs, ts))
    b = sxy / sxx
    a = t_mean - b * g_mean
    if a >= 0 and b >= 0:
        return CostFit(fixed=a, per_unit=b)
    if a < 0 and b > 0:
        b0 = sum(g * t for g, t in zip(gs, ts)) / sum(g * g for g in gs)
        return CostFit(fixed=0.0, per_unit=max(b0, 0.0))
    return CostFit(fixed=max(t_mean, 0.0), per_unit=0.0)


def _freeze_costs(name: str, costs: Mapping) -> Mapping[Fraction, float]:
    if not isinstance(costs, Mapping):
        raise ConfigError(name, f"must be a mapping g -> seconds, got {type(costs).__name__}")
    out: dict[Fraction, float] = {}
    for g, t in costs.items():
        try:
            key = as_granularity(g)
        except ScheduleError as e:
            raise ConfigError(name, str(e)) from None
        out[key] = _seconds(f"{name}[{g}]", t)
    return MappingProxyType(dict(sorted(out.items())))


def _seconds(name: str, v: object) -> float:
    # finite_float refuses an int too large for a float (math.isfinite would overflow)
    f = finite_float(v) if isinstance(v, (int, float)) else None
    if f is None or f < 0:
        raise ConfigError(name, f"must be a finite, non-negative number of seconds, got {v!r}")
    return f


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Profiled costs of one workload under one placement (the inputs of Eq. 2).

    Attributes:
        t_rollout: Seconds of one actor rollout (``T_rollout``).
        t_update: Seconds of one learner update (``T_update``).
        t_ing: ``{g: seconds}``: wall time of one ingestion invocation processing ``g`` rollout
            units (``T_ing(g)``). Keys are normalized to ``Fraction``.
        t_del: ``{g: seconds}``: wall time of one delivery invocation producing ``g`` training
            batches (``T_del(g)``).
        t_sync_ing: Synchronization cost of overlapping ingestion (``T_sync,ing``).
        t_sync_del: Synchronization cost of overlapping delivery (``T_sync,del``).
        ing_fit: Optional fit used for granularities missing from ``t_ing``.
        del_fit: Optional fit used for granularities missing from ``t_del``.
        t_copy_ing: Optional seconds per unit of ingestion that move data (the unit's bytes at
            the placement's measured bandwidth). An operator on a Python thread overlaps its
            caller only where it is outside CPython's interpreter lock (GIL): tensor copies
            are, the per-invocation Python around them is not, and that part competes with
            the caller rather than hiding behind it. When set, overlap hides at most this much
            per unit (see :func:`~conduit.scheduling.cost_model.predict`). None: all of the
            per-unit cost is overlappable, as Eq. 4 assumes.
        t_copy_del: The same for delivery (Eq. 5).

    Raises:
        ConfigError: A cost is not a finite, non-negative number of seconds, a granularity
            key is not a positive finite number, a fit is not a :class:`CostFit` with finite,
            non-negative parameters (``field`` e.g. ``"ing_fit.fixed"``), or an operator has
            neither a measured granularity nor a fit.
    """

    t_rollout: float
    t_update: float
    t_ing: Mapping[Fraction, float]
    t_del: Mapping[Fraction, float]
    t_sync_ing: float = 0.0
    t_sync_del: float = 0.0
    ing_fit: CostFit | None = field(default=None, compare=False)
    del_fit: CostFit | None = field(default=None, compare=False)
    t_copy_ing: float | None = None
    t_copy_del: float | None = None

    def __post_init__(self) -> None:
        for name in ("t_rollout", "t_update", "t_sync_ing", "t_sync_del"):
            object.__setattr__(self, name, _seconds(name, getattr(self, name)))
        for name in ("t_copy_ing", "t_copy_del"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _seconds(name, getattr(self, name)))
        for name in ("t_ing", "t_del"):
            object.__setattr__(self, name, _freeze_costs(name, getattr(self, name)))
        for name in ("ing_fit", "del_fit"):
            fit = getattr(self, name)
            if fit is not None and not isinstance(fit, CostFit):
                raise ConfigError(name, f"must be a CostFit or None, got {type(fit).__name__}")
            if fit is not None:
                # CostFit checks its numbers; this also catches a fit built around that check
                # (e.g. unpickled), since a NaN or negative fit would be ranked as the best.
                for part in ("fixed", "per_unit"):
                    _seconds(f"{name}.{part}", getattr(fit, part))
        for name, costs, fit in (("t_ing", self.t_ing, self.ing_fit),
                                 ("t_del", self.t_del, self.del_fit)):
            if not costs and fit is None:
                raise ConfigError(name, "needs at least one measured granularity (or a fit)")

    def __hash__(self) -> int:
        return hash((self.t_rollout, self.t_update, tuple(self.t_ing.items()),
                     tuple(self.t_del.items()), self.t_sync_ing, self.t_sync_del,
                     self.t_copy_ing, self.t_copy_del))

    def ing_time(self, g: float | Fraction) -> float:
        """``T_ing(g)``: seconds of one ingestion invocation at granularity ``g``.

        Raises:
            ScheduleError: ``g`` is neither profiled nor covered by ``ing_fit``.
        """
        return _lookup("t_ing", self.t_ing, self.ing_fit, g)

    def del_time(self, g: float | Fraction) -> float:
        """``T_del(g)``: seconds of one delivery invocation at granularity ``g``.

        Raises:
            ScheduleError: ``g`` is neither profiled nor covered by ``del_fit``.
        """
        return _lookup("t_del", self.t_del, self.del_fit, g)

    def to_dict(self) -> dict:
        """JSON-friendly description (granularities as strings such as ``"1/4"``)."""
        return {"t_rollout": self.t_rollout, "t_update": self.t_update,
                "t_ing": {str(g): t for g, t in self.t_ing.items()},
                "t_del": {str(g): t for g, t in self.t_del.items()},
                "t_sync_ing": self.t_sync_ing, "t_sync_del": self.t_sync_del,
                "t_copy_ing": self.t_copy_ing, "t_copy_del": self.t_copy_del}


def _lookup(name: str, costs: Mapping[Fraction, float], fit: CostFit | None,
            g: float | Fraction) -> float:
    key = as_granularity(g)
    t = costs.get(key)
    if t is not None:
        return t
    if fit is not None:
        return fit(key)
    raise ScheduleError(f"{name}: no profiled cost at g={key!s}; profiled: "
                        f"{{{', '.join(str(k) for k in costs)}}}")


def _medians_by_units(timings: Timings, name: str) -> dict[Fraction, float]:
    groups: dict[Fraction, list[float]] = {}
    for r in timings.records(name):
        try:
            g = as_granularity(r.units)
        except ScheduleError:  # not a granularity (e.g. 0, NaN, or rounding to 0): skip
            continue
        groups.setdefault(g, []).append(r.seconds)
    return {g: statistics.median(v) for g, v in sorted(groups.items())}


def profile_from_timings(timings: Timings, space: ScheduleSpace, *,
                         default_sync: float = 0.0) -> Profile:
    """Build a :class:`Profile` from the plane's recorded timings.

    Uses the median of the retained records per name: ``"rollout"`` -> ``t_rollout``,
    ``"update"`` -> ``t_update``, ``"sync_ing"`` / ``"sync_del"`` -> sync costs, and
    ``"ingestion"`` / ``"delivery"`` records grouped by their ``units`` (the granularity ``g``
    they processed) -> ``t_ing[g]`` / ``t_del[g]``.

    Every granularity of ``space`` gets a cost: measured medians are kept as they are; missing
    ones come from :func:`fit_cost` (``T(g) = a + b·g``, least squares over the measured
    medians, with ``a, b >= 0``), which interpolates between and extrapolates beyond the
    measured granularities. With a single measured granularity the cost is taken as
    proportional to ``g`` (no amortization assumed). The fits are kept on the profile.

    Args:
        timings: A :class:`~conduit.timing.Timings` recorder.
        space: The feasible space whose granularities must be priced.
        default_sync: Sync cost assumed when no ``"sync_ing"`` / ``"sync_del"`` record exists
            (overlap was never exercised). Seconds, ``>= 0``.

    Returns:
        The :class:`Profile`.

    Raises:
        ProfileError: ``"rollout"``, ``"update"``, ``"ingestion"`` or ``"delivery"`` has no
            record at all (``field`` is that name), or an operator's median time is negative
            or not finite (``field="points"``, from :func:`fit_cost`).
        ConfigError: ``default_sync`` is negative or not finite, or another median is
            (``field`` is the profile field).
    """
    default_sync = _seconds("default_sync", default_sync)
    stages: dict[str, float] = {}
    for name in ("rollout", "update"):
        v = timings.median(name)
        if v is None:
            raise ProfileError(name, f"no {name!r} timing was recorded; profile at least one "
                               "iteration before planning")
        stages[name] = v
    costs: dict[str, dict[Fraction, float]] = {}
    fits: dict[str, CostFit] = {}
    for name, wanted in (("ingestion", space.g_ing), ("delivery", space.g_del)):
        measured = _medians_by_units(timings, name)
        if not measured:
            raise ProfileError(name, f"no {name!r} operator invocation was recorded; profile "
                               "at least one granularity before planning")
        fit = fit_cost(measured)
        fits[name] = fit
        filled = dict(measured)
        for g in wanted:
            if g not in filled:
                filled[g] = fit(g)
        costs[name] = filled
    sync = {}
    for name in ("sync_ing", "sync_del"):
        v = timings.median(name)
        sync[name] = default_sync if v is None else v
    return Profile(t_rollout=stages["rollout"], t_update=stages["update"],
                   t_ing=costs["ingestion"], t_del=costs["delivery"],
                   t_sync_ing=sync["sync_ing"], t_sync_del=sync["sync_del"],
                   ing_fit=fits["ingestion"], del_fit=fits["delivery"])
