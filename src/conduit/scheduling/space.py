"""The schedule and its feasible space, derived only from the RL configuration (§4.1–4.2, §6.3).

Off-policy: ``G_ing = {1..g_max_ing}``, ``G_del = {1..g_max_del}``.
On-policy with M mini-batches per update: ``G_ing = {1/M, 2/M, ..., 1}``, ``G_del = {1/M}``;
when fixed-size rollout units are smaller than a mini-batch, ``G_ing`` also holds the multiples
of one unit's share below 1/M.
Users may cap the space (``g_max_ing`` / ``g_max_del`` off-policy, ``max_fraction_ing``
on-policy); an infeasible cap is rejected with :class:`~conduit.errors.ConfigError`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from conduit._checks import finite_float
from conduit.errors import ConfigError, ScheduleError

Mode = Literal["off_policy", "on_policy"]


@dataclass(frozen=True)
class Schedule:
    """When and how much experience-path work runs: ``(overlap_ing, g_ing, overlap_del, g_del)``.

    Attributes:
        overlap_ing: 1 runs ingestion on a background worker, overlapping actor rollout;
            0 runs it inline on the pushing thread (the sequential baseline).
        g_ing: Rollout units per ingestion invocation. ``g >= 1`` batches units (off-policy);
            ``0 < g < 1`` pipelines mini-batch-sized chunks (on-policy).
        overlap_del: 1 prepares batches on a background worker, overlapping learner update;
            0 prepares each batch inline when the learner pulls.
        g_del: Training batches per delivery invocation. ``g >= 1`` prefetches ``g`` batches;
            ``g = 1/M`` delivers one on-policy mini-batch per invocation.

    Granularities are stored as ``Fraction``s with denominators up to 1024.

    Raises:
        ScheduleError: An overlap flag is not 0 or 1 (``True``/``False`` are refused), or a
            granularity is not a finite positive number, is above 1 but not whole, or rounds
            to 0 when stored (below about 1/2048); the message starts with the field name
            (``g_ing: ...``).
    """

    overlap_ing: int = 0
    g_ing: float = 1
    overlap_del: int = 0
    g_del: float = 1

    def __post_init__(self) -> None:
        for name in ("overlap_ing", "overlap_del"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or v not in (0, 1):
                hint = "; pass int(flag) for a bool" if isinstance(v, bool) else ""
                raise ScheduleError(f"{name}: must be 0 or 1, got {v!r}{hint}")
            object.__setattr__(self, name, int(v))
        for name in ("g_ing", "g_del"):
            v = getattr(self, name)
            if (not isinstance(v, (int, float, Fraction)) or isinstance(v, bool) or not v > 0
                    or finite_float(v) is None):  # an int too large for a float is refused
                raise ScheduleError(f"{name}: must be a finite positive number, got {v!r}")
            if v > 1 and float(v) != int(v):
                raise ScheduleError(f"{name}: granularities above 1 must be whole numbers of "
                                    f"units, got {v!r}")
            g = Fraction(v).limit_denominator(1024)
            if g <= 0:  # a tiny positive value rounds to 0 at the stored resolution
                raise ScheduleError(f"{name}: {v!r} rounds to 0 (granularities are stored as "
                                    f"fractions with denominators up to 1024); use at least "
                                    f"1/1024")
            object.__setattr__(self, name, g)

    @classmethod
    def inline(cls, *, num_minibatches: int = 1) -> Schedule:
        """The sequential baseline of Fig. 5a: everything on the caller's thread, ``g_ing = 1``;
        delivery one batch per invocation (one mini-batch, ``1/M``, on-policy).

        Raises:
            ConfigError: ``num_minibatches`` is not an integer in ``1..MAX_MINIBATCHES``.
        """
        m = num_minibatches
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= MAX_MINIBATCHES:
            raise ConfigError("num_minibatches", f"must be an integer from 1 to "
                                                 f"{MAX_MINIBATCHES}, got {m!r}")
        return cls(0, 1, 0, Fraction(1, m))

    def as_tuple(self) -> tuple[int, float, int, float]:
        """``(overlap_ing, g_ing, overlap_del, g_del)`` with floats."""
        return (self.overlap_ing, float(self.g_ing), self.overlap_del, float(self.g_del))

    def label(self) -> str:
        """Compact label, e.g. ``ing(ov=1,g=4) del(ov=1,g=2)``."""
        return (f"ing(ov={self.overlap_ing},g={self.g_ing!s}) "
                f"del(ov={self.overlap_del},g={self.g_del!s})")

    def to_dict(self) -> dict:
        """JSON-friendly description."""
        return {"overlap_ing": self.overlap_ing, "g_ing": str(self.g_ing),
                "overlap_del": self.overlap_del, "g_del": str(self.g_del)}


@dataclass(frozen=True, kw_only=True)
class ScheduleSpace:
    """Feasible granularities for one RL configuration.

    Build it with :func:`feasible_space`; do not fill it by hand.

    Attributes:
        mode: ``"off_policy"`` or ``"on_policy"``.
        g_ing: Feasible ingestion granularities, ascending.
        g_del: Feasible delivery granularities, ascending.
    """

    mode: Mode
    g_ing: tuple[Fraction, ...]
    g_del: tuple[Fraction, ...]

    def __len__(self) -> int:
        return 4 * len(self.g_ing) * len(self.g_del)

    def candidates(self) -> list[Schedule]:
        """All ``4·|G_ing|·|G_del|`` schedules (two binary overlap flags)."""
        return [Schedule(oi, gi, od, gd) for oi in (0, 1) for gi in self.g_ing
                for od in (0, 1) for gd in self.g_del]

    def check(self, schedule: Schedule) -> None:
        """Raise :class:`ScheduleError` if ``schedule`` is outside the space."""
        if schedule.g_ing not in self.g_ing:
            raise ScheduleError(
                f"g_ing: {schedule.g_ing!s} is not feasible for {self.mode}; "
                f"choose one of {{{', '.join(str(g) for g in self.g_ing)}}}")
        if schedule.g_del not in self.g_del:
            raise ScheduleError(
                f"g_del: {schedule.g_del!s} is not feasible for {self.mode}; "
                f"choose one of {{{', '.join(str(g) for g in self.g_del)}}}")


#: Largest off-policy granularity cap accepted (bounds the enumeration and the staging memory).
MAX_GRANULARITY = 1024
#: Largest on-policy mini-batch count accepted; :class:`Schedule` stores granularities with
#: denominators of at most 1024, so finer fractions could not be represented exactly.
MAX_MINIBATCHES = 1024


def feasible_space(*, mode: Mode, num_minibatches: int = 1, g_max_ing: int = 8,
                   g_max_del: int = 8,
                   max_fraction_ing: float | Fraction | None = None,
                   unit_fraction_ing: Fraction | None = None) -> ScheduleSpace:
    """Derive the feasible granularity sets from the RL configuration, optionally capped.

    Off-policy: ``G_ing = {1..g_max_ing}``, ``G_del = {1..g_max_del}``; the two caps are the
    user's caps (they bound staleness and staging memory). On-policy with ``M`` mini-batches:
    ``G_ing = {1/M, 2/M, ..., f_max}`` where ``f_max`` is ``max_fraction_ing`` (default 1),
    preceded by ``u, 2u, ... < 1/M`` for a unit share ``u = unit_fraction_ing``, and
    ``G_del = {1/M}``.

    Args:
        mode: ``"off_policy"`` or ``"on_policy"``.
        num_minibatches: M, mini-batches per on-policy update (ignored off-policy); at most
            :data:`MAX_MINIBATCHES`.
        g_max_ing: Off-policy cap on rollout units per ingestion, ``1..MAX_GRANULARITY``.
        g_max_del: Off-policy cap on prefetched batches per delivery, ``1..MAX_GRANULARITY``.
        max_fraction_ing: On-policy only: largest fraction of a rollout one ingestion
            invocation may process, in ``[1/M, 1]``. ``None`` means 1 (no cap). ``k/M`` is
            feasible when it does not exceed the cap (a float cap also admits the ``k/M`` it
            is the float of, so ``0.3`` admits ``3/10``).
        unit_fraction_ing: On-policy only: the share of an iteration that one pushed rollout
            unit holds (rows per unit / rows per iteration), when units have a fixed size.
            When it is below 1/M, its multiples below 1/M join ``G_ing``, so ingestion can run
            once per arriving unit instead of waiting for a mini-batch's worth of rows.

    Returns:
        The :class:`ScheduleSpace`.

    Raises:
        ConfigError: The mode is unknown, a cap or M is not a positive integer or exceeds its
            limit, or ``max_fraction_ing`` is given off-policy or lies outside ``[1/M, 1]``
            (which would leave the space empty). The error's ``field`` names the argument.
    """
    if mode not in ("off_policy", "on_policy"):
        raise ConfigError("mode", f"must be 'off_policy' or 'on_policy', got {mode!r}")
    for name, v, limit in (("num_minibatches", num_minibatches, MAX_MINIBATCHES),
                           ("g_max_ing", g_max_ing, MAX_GRANULARITY),
                           ("g_max_del", g_max_del, MAX_GRANULARITY)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(name, f"must be a positive integer, got {v!r}")
        if v > limit:
            raise ConfigError(name, f"must be at most {limit}, got {v}")
    if mode == "off_policy":
        if unit_fraction_ing is not None:
            raise ConfigError("unit_fraction_ing", "only applies on-policy; off-policy "
                                                   "granularity already counts rollout units")
        if max_fraction_ing is not None:
            raise ConfigError("max_fraction_ing",
                              "only applies on-policy; cap off-policy ingestion with g_max_ing")
        return ScheduleSpace(mode=mode,
                             g_ing=tuple(Fraction(g) for g in range(1, g_max_ing + 1)),
                             g_del=tuple(Fraction(g) for g in range(1, g_max_del + 1)))
    m = num_minibatches
    cap: int | float | Fraction = 1
    if max_fraction_ing is not None:
        cap = max_fraction_ing
        if (not isinstance(cap, (int, float, Fraction)) or isinstance(cap, bool)
                or cap != cap or not 0 < cap <= 1):
            raise ConfigError("max_fraction_ing", f"must be a fraction in (0, 1], got {cap!r}")
        if not _within(Fraction(1, m), cap):
            raise ConfigError("max_fraction_ing",
                              f"must be at least 1/M = 1/{m} (one mini-batch), got {cap!r}; "
                              "a smaller cap leaves no feasible ingestion granularity")
    g_ing = [Fraction(k, m) for k in range(1, m + 1) if _within(Fraction(k, m), cap)]
    if unit_fraction_ing is not None:
        u = unit_fraction_ing
        if not isinstance(u, Fraction) or not 0 < u <= 1:
            raise ConfigError("unit_fraction_ing", f"must be a Fraction in (0, 1], got {u!r}")
        if u.denominator > MAX_MINIBATCHES:
            raise ConfigError("unit_fraction_ing", f"{u} is finer than 1/{MAX_MINIBATCHES}; "
                                                   f"push larger rollout units")
        below = -(-Fraction(1, m) // u)  # the multiples u, 2u, ... strictly below 1/M
        g_ing = [u * j for j in range(1, below)] + g_ing
    return ScheduleSpace(mode=mode, g_ing=tuple(g_ing), g_del=(Fraction(1, m),))


def _within(g: Fraction, cap: int | float | Fraction) -> bool:
    """Whether granularity ``g`` is at most the user's cap: compared exactly, never rounded
    up; a float cap also admits the ``g`` it is the float of (``0.3`` admits ``3/10``)."""
    return g <= Fraction(cap) or (isinstance(cap, float) and float(g) == cap)
