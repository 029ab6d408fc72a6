"""Cost-based scheduling (§6.3): enumerate the ``4·|G_ing|·|G_del|`` candidates, score each
with the iteration-latency model, pick the argmin.

Ties (predictions equal within a relative ``1e-9``) are broken deterministically in favour of
the simpler schedule: fewer overlapped operators first, then smaller granularities (their sum,
then ingestion before delivery). The result is a :class:`Plan` that explains itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from conduit.errors import ConfigError, ScheduleError
from conduit.scheduling.cost_model import Prediction, predict
from conduit.scheduling.profile import Profile
from conduit.scheduling.space import Schedule, ScheduleSpace

#: Predictions closer than this (relative) are ties, broken by :func:`tie_key`.
REL_TIE = 1e-9
#: Absolute floor of the tie tolerance, in seconds.
ABS_TIE = 1e-15


def tie_key(schedule: Schedule) -> tuple[int, Fraction, int, Fraction, int, Fraction]:
    """Preference among equally fast schedules (smaller is preferred).

    Fewer overlapped operators first (no background worker, no sync), then the smaller total
    granularity (fresher data, less staging memory), then ingestion before delivery.

    Args:
        schedule: A schedule.

    Returns:
        A sort key that orders all schedules totally.
    """
    return (schedule.overlap_ing + schedule.overlap_del, schedule.g_ing + schedule.g_del,
            schedule.overlap_ing, schedule.g_ing, schedule.overlap_del, schedule.g_del)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One scored schedule.

    Attributes:
        rank: 1 for the chosen schedule, 2 for the runner-up, ...
        schedule: The schedule.
        prediction: Its predicted latencies.
    """

    rank: int
    schedule: Schedule
    prediction: Prediction

    def to_dict(self) -> dict:
        """JSON-friendly description."""
        return {"rank": self.rank, "schedule": self.schedule.to_dict(),
                "prediction": self.prediction.to_dict()}


def rank_candidates(profile: Profile, space: ScheduleSpace) -> list[Candidate]:
    """Score every candidate of ``space`` and order them best first.

    Args:
        profile: Profiled costs; must price every granularity of ``space``.
        space: The feasible space.

    Returns:
        All ``len(space)`` candidates, ranked; rank 1 is the argmin of Eq. 2.

    Raises:
        ScheduleError: ``profile`` lacks a cost for a granularity of ``space``.
        ConfigError: Every candidate's predicted iteration overflows (field ``profile``).
    """
    scored = [(predict(profile, s, mode=space.mode), s) for s in space.candidates()]
    if not scored:
        raise ScheduleError("the schedule space is empty")
    if not any(math.isfinite(p.t_iter) for p, _ in scored):
        raise ConfigError("profile", "its costs are so large that every schedule's predicted "
                                     "iteration overflows a float; give them in seconds")
    scored.sort(key=lambda ps: (ps[0].t_iter, tie_key(ps[1])))
    # Group near-equal predictions (within the tolerance of the group's first, fastest member)
    # and order each group by preference, so float noise never decides between equals.
    ordered: list[tuple[Prediction, Schedule]] = []
    i = 0
    while i < len(scored):
        t0 = scored[i][0].t_iter
        tol = max(abs(t0) * REL_TIE, ABS_TIE)
        j = i + 1
        while j < len(scored) and scored[j][0].t_iter - t0 <= tol:
            j += 1
        ordered.extend(sorted(scored[i:j], key=lambda ps: tie_key(ps[1])))
        i = j
    return [Candidate(rank=r, schedule=s, prediction=p)
            for r, (p, s) in enumerate(ordered, start=1)]


def baseline_schedule(space: ScheduleSpace) -> Schedule | None:
    """The inline (sequential) schedule of ``space``, for comparison: no overlap, ``g_ing = 1``
    and the finest delivery granularity (1 off-policy, ``1/M`` on-policy).

    Returns:
        The schedule, or ``None`` when ``g_ing = 1`` was capped out of ``space``.
    """
    if Fraction(1) not in space.g_ing or not space.g_del:
        return None
    return Schedule(0, 1, 0, space.g_del[0])


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The optimizer's decision and its justification.

    Attributes:
        schedule: The chosen schedule (argmin of Eq. 2).
        prediction: Its predicted latencies.
        ranked: The ``top_k`` best candidates, best first (``ranked[0]`` is the choice).
        num_candidates: How many candidates were scored (``4·|G_ing|·|G_del|``).
        mode: ``"off_policy"`` or ``"on_policy"``.
        profile: The profile the plan was computed from.
        baseline: The inline schedule's candidate (see :func:`baseline_schedule`), if feasible.
    """

    schedule: Schedule
    prediction: Prediction
    ranked: tuple[Candidate, ...]
    num_candidates: int
    mode: str
    profile: Profile
    baseline: Candidate | None = None

    @property
    def speedup_vs_baseline(self) -> float | None:
        """Predicted ``T_iter(baseline) / T_iter(chosen)``, or ``None`` without a baseline."""
        if self.baseline is None or self.prediction.t_iter <= 0:
            return None
        return self.baseline.prediction.t_iter / self.prediction.t_iter

    def explain(self) -> str:
        """A readable account of the decision: the profile, the ranked table, the baseline.

        Returns:
            Multi-line text (times in milliseconds).
        """
        p = self.profile
        lines = [
            f"Conduit schedule plan ({self.mode}, {self.num_candidates} candidates scored "
            "with Eq. 2)",
            "times per Eq. 2 iteration: one timed rollout and one timed update (not a "
            "trainer's whole iteration, which may hold several of each)",
            f"profile: T_rollout={_ms(p.t_rollout)} ms  T_update={_ms(p.t_update)} ms  "
            f"T_sync,ing={_ms(p.t_sync_ing)} ms  T_sync,del={_ms(p.t_sync_del)} ms"
            + "".join(f"  {label}={_ms(v)} ms" for label, v in (("T_copy,ing", p.t_copy_ing),
                                                             ("T_copy,del", p.t_copy_del))
                      if v is not None),
            f"chosen:  {self.schedule.label()}  T_iter={_ms(self.prediction.t_iter)} ms  "
            f"exposed={_ms(self.prediction.exposed)} ms",
        ]
        if self.baseline is not None:
            speedup = self.speedup_vs_baseline
            ratio = ("(both predict no time)" if speedup is None
                     else f"(chosen is {speedup:.2f}x faster)")
            lines.append(f"inline:  {self.baseline.schedule.label()}  "
                         f"T_iter={_ms(self.baseline.prediction.t_iter)} ms  "
                         f"exposed={_ms(self.baseline.prediction.exposed)} ms  {ratio}")
        header = (f"{'rank':>4}  {'ov_ing':>6} {'g_ing':>6} {'ov_del':>6} {'g_del':>6}  "
                  f"{'T_iter':>9} {'ing-path':>9} {'del-path':>9} {'exposed':>9} "
                  f"{'hide_ing':>9} {'hide_del':>9}")
        lines += ["", "top candidates (ms):", header, "-" * len(header)]
        for c in self.ranked:
            s, q = c.schedule, c.prediction
            lines.append(
                f"{c.rank:>4}  {s.overlap_ing:>6} {_g(s.g_ing):>6} {s.overlap_del:>6} "
                f"{_g(s.g_del):>6}  {_ms(q.t_iter):>9} {_ms(q.t_ing_path):>9} "
                f"{_ms(q.t_del_path):>9} {_ms(q.exposed):>9} {_ms(q.hide_ing):>9} "
                f"{_ms(q.hide_del):>9}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()

    def to_dict(self) -> dict:
        """JSON-friendly description."""
        return {"mode": self.mode, "num_candidates": self.num_candidates,
                "schedule": self.schedule.to_dict(), "prediction": self.prediction.to_dict(),
                "ranked": [c.to_dict() for c in self.ranked],
                "baseline": None if self.baseline is None else self.baseline.to_dict(),
                "profile": self.profile.to_dict()}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _g(g: Fraction) -> str:
    return str(g.numerator) if g.denominator == 1 else f"{g.numerator}/{g.denominator}"


def choose(profile: Profile, space: ScheduleSpace, *, top_k: int = 5) -> Plan:
    """Pick the latency-minimizing schedule of ``space`` under ``profile`` (Eq. 2).

    Enumerates all ``4·|G_ing|·|G_del|`` candidates, scores each with
    :func:`~conduit.scheduling.cost_model.predict`, and returns the argmin with deterministic
    tie-breaking (:func:`tie_key`).

    Args:
        profile: Profiled costs; must price every granularity of ``space``.
        space: The feasible space (see :func:`~conduit.scheduling.space.feasible_space`).
        top_k: How many ranked candidates the plan keeps for explanation (>= 1; capped at the
            number of candidates).

    Returns:
        The :class:`Plan`.

    Raises:
        ConfigError: ``top_k`` is not a positive integer, or every candidate's predicted
            iteration overflows (field ``profile``).
        ScheduleError: ``profile`` lacks a cost for a granularity of ``space``.
    """
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ConfigError("top_k", f"must be a positive integer, got {top_k!r}")
    ranked = rank_candidates(profile, space)
    best = ranked[0]
    base_s = baseline_schedule(space)
    baseline = next((c for c in ranked if c.schedule == base_s), None)
    return Plan(schedule=best.schedule, prediction=best.prediction,
                ranked=tuple(ranked[:top_k]), num_candidates=len(ranked), mode=space.mode,
                profile=profile, baseline=baseline)
