"""Runs the scheduling policy on a live plane during a run's first learning iterations.

The decisions are :mod:`conduit.scheduling.trial`'s and :mod:`conduit.scheduling.copy_bound`'s;
:class:`WarmupScheduleTuner` only reads the plane's timings, switches its schedule, and keeps
the per-iteration scores (docs/design.md §6).
"""

from __future__ import annotations

import dataclasses
import time
from fractions import Fraction
from typing import TYPE_CHECKING, Protocol

from conduit._checks import check_bool, check_real
from conduit.errors import ConduitError, ConfigError
from conduit.plane.autotune import AutoScheduler, plane_copy_times, tuning_space
from conduit.scheduling import (
    Plan,
    Profile,
    Schedule,
    TrialPair,
    TrialPolicy,
    copy_bound,
    judge_trial,
    profile_from_timings,
    warmup_schedule,
)
from conduit.scheduling.trial import MODEL, THREADLESS
from conduit.timing import Timings

if TYPE_CHECKING:
    from conduit.plane.data_plane import ExperienceDataPlane


class IterationTiming(Protocol):
    """What the tuner reads of one finished iteration."""

    @property
    def learning(self) -> bool:
        """Whether the learner trained in it (other iterations are ignored)."""

    @property
    def end_to_end(self) -> float:
        """Its wall time (seconds)."""

    @property
    def rollout(self) -> float:
        """Seconds the learner waited on actor rollouts in it."""


class WarmupScheduleTuner:
    """Chooses a plane's schedule during its first learning iterations.

    1. **Warm-up.** ``policy.warmup`` learning iterations run on the plane's schedule at
       construction (the start schedule); off-policy one of them probes coarse threadless
       delivery (:func:`~conduit.scheduling.warmup_schedule`). Where each priority update
       discards the batches drawn before it, delivery stays one batch per invocation
       throughout (:attr:`space`, :func:`tuning_space`): nothing coarse is probed or chosen.
    2. **Model.** The plane's timings (those made after the first learning iteration, which
       pays one-off costs, where the later ones price every stage) become a
       :class:`~conduit.scheduling.Profile` with the
       copy-time bound, and :class:`~conduit.plane.AutoScheduler` picks the argmin of Eq. 2
       (A), priced without the probe. With ``prioritized`` replay and no allowed priority
       lag, overlapped delivery is left out of that choice; otherwise the trial may measure
       it.
    3. **Trial.** Unless :meth:`~conduit.scheduling.TrialPair.verdict_without_trial` settles
       it, A and the best threadless schedule B (priced with the probe) run ``policy.trial``
       iterations each, interleaved, each scored by its learner time outside the rollout
       wait (end to end minus rollout); B replaces A only on a clear win
       (:func:`~conduit.scheduling.judge_trial`). A trial that leaves it open (B faster by
       median, not clearly) runs ``policy.extend`` more iterations each, once, and decides
       over all of them.

    Call :meth:`step` once per iteration, at its end.

    Args:
        plane: The plane whose schedule is chosen; its current schedule is the start.
        report: A dict that receives the decision as plain data (``schedule``,
            ``schedule_plan``, ``schedule_explain``, ``copy_ms_per_unit``,
            ``schedule_trial_ms`` or ``note``). A new one when None.
        policy: The trial's parameters (default :class:`~conduit.scheduling.TrialPolicy`).
        prioritized: The plane samples with priorities.
        **changes: Fields of ``policy`` to override, for example ``warmup=2``.

    Raises:
        ConfigError: ``report`` is not a dict, ``policy`` not a
            :class:`~conduit.scheduling.TrialPolicy`, ``prioritized`` not a bool, a change
            names no field of the policy, or a changed value is out of range (the error names
            the field).

    Attributes:
        done: The schedule is chosen.
        space: The schedules chosen among (:func:`tuning_space` of the plane).
        explanation: The decision in words (also ``report["schedule_explain"]``).
        model_plan: The model's :class:`~conduit.scheduling.Plan` (None before step 2).
        profile: The probed, copy-bounded profile B was priced on (None before step 2).
    """

    def __init__(self, plane: ExperienceDataPlane, report: dict[str, object] | None = None,
                 *, policy: TrialPolicy | None = None, prioritized: bool = False,
                 **changes: float) -> None:
        if report is not None and not isinstance(report, dict):
            raise ConfigError("report", f"must be a dict (or None), got {report!r}")
        if policy is not None and not isinstance(policy, TrialPolicy):
            raise ConfigError("policy", f"must be a TrialPolicy (or None), got {policy!r}")
        prioritized = check_bool("prioritized", prioritized)
        self.plane = plane
        self.report: dict[str, object] = {} if report is None else report
        self.policy = dataclasses.replace(policy or TrialPolicy(), **_policy_changes(changes))
        self.prioritized = prioritized
        self.start = plane.schedule
        self.space = tuning_space(plane)
        self.seen = 0
        self.done = False
        self.explanation = ""
        self.model_plan: Plan | None = None
        self.profile: Profile | None = None
        self._probed: Fraction | None = None  # the g_del a warm-up iteration probed
        self._since: float | None = None  # the end of the first learning iteration
        self._pair: TrialPair | None = None
        self._candidates: list[Schedule] = []
        self._order: list[int] = []
        self._scores: dict[int, list[float]] = {}

    def step(self, iteration: IterationTiming) -> None:
        """Account for one finished iteration; may switch the plane's schedule."""
        if self.done or not iteration.learning:
            return
        self.seen += 1
        if self.seen == 1:
            # The first learning iteration pays one-off costs (kernels loaded or compiled on
            # the first gather, the learner's first step): the model prices later ones.
            self._since = time.perf_counter()
        if self.seen < self.policy.warmup:
            self._warm_up()
            return
        if self._candidates:
            self._scores[self._order.pop(0)].append(iteration.end_to_end - iteration.rollout)
        else:
            self._plan_with_model()
        if self.done:
            return
        if self._order:
            self.plane.set_schedule(self._candidates[self._order[0]])
        else:
            self._choose()

    def _warm_up(self) -> None:
        want = warmup_schedule(self.seen, warmup=self.policy.warmup, start=self.start,
                               space=self.space)
        if want != self.start:
            self._probed = want.g_del
        if self.plane.schedule != want:
            self.plane.set_schedule(want)

    def _plan_with_model(self) -> None:
        space, timings = self.space, _after_first(self.plane.timings, self._since)
        try:
            probed = profile_from_timings(timings, space)
            unprobed = probed if self._probed is None else profile_from_timings(
                _without_units(timings, "delivery", float(self._probed)), space)
            copies = plane_copy_times(self.plane)
            self.report["copy_ms_per_unit"] = {k: 1000 * v for k, v in copies.to_dict().items()}
            # (not told prioritized, the trial may measure prefetch, discards included)
            on_learner = self.prioritized and self.plane.max_priority_lag == 0
            plan = AutoScheduler(plane=self.plane, space=space, profile=unprobed,
                                 min_copy=self.policy.min_copy,
                                 deliver_on_learner=on_learner).plan()
        except ConduitError as exc:
            self.report["note"] = f"kept the hand-set schedule ({type(exc).__name__}: {exc})"
            self.done = True
            return
        self.model_plan = plan
        self.profile = copy_bound(probed, copies, min_copy=self.policy.min_copy)
        self.explanation = "\n".join(plan.explain().splitlines()[:13])
        self.report["schedule_plan"] = plan.to_dict()
        pair = TrialPair.of(plan, self.profile, space)
        verdict = pair.verdict_without_trial(self.policy)
        if verdict is not None:
            self._finish(verdict.schedule, verdict.reason)
            return
        self.explanation += f"\n{pair.saving()}"
        self._pair = pair
        self._candidates = list(pair.schedules())
        self._order = list(self.policy.order())
        self._scores = {MODEL: [], THREADLESS: []}

    def _choose(self) -> None:
        assert self._pair is not None
        outcome = judge_trial(self._scores[MODEL], self._scores[THREADLESS], policy=self.policy)
        ran = len(self._scores[MODEL])
        if outcome.open and ran == self.policy.trial and self.policy.extend:
            # B looked faster, but not clearly: run both again before keeping A.
            self._order = list(self.policy.order(self.policy.extend))
            self.plane.set_schedule(self._candidates[self._order[0]])
            return
        a, b = self._candidates
        self.report["schedule_trial_ms"] = {a.label(): 1000 * outcome.model_median,
                                            b.label(): 1000 * outcome.threadless_median}
        self._finish(b if outcome.keep_threadless else a, outcome.explain(self._pair, ran))

    def _finish(self, schedule: Schedule, reason: str) -> None:
        self.plane.set_schedule(schedule)
        self.done = True
        self.report["schedule"] = schedule.label()
        if reason:
            self.explanation += "\n" + reason
        self.report["schedule_explain"] = self.explanation


def _policy_changes(changes: dict[str, object]) -> dict[str, object]:
    """``changes`` to a :class:`TrialPolicy`, with the real-valued fields checked to be
    numbers (the policy checks their ranges and its integer fields).

    Raises:
        ConfigError: A change names no field of the policy, or gives a real-valued field a
            value that is not a finite number.
    """
    known = [f.name for f in dataclasses.fields(TrialPolicy)]
    for name, value in changes.items():
        if name not in known:
            raise ConfigError(name, f"is not a TrialPolicy field; the tuner takes "
                                    f"{', '.join(known)}")
        if name in ("margin", "min_gain", "min_copy"):
            check_real(name, value, positive=False)
    return changes


#: The records a profile needs (see :func:`~conduit.scheduling.profile_from_timings`).
_PROFILED = ("rollout", "update", "ingestion", "delivery")


def _after_first(timings: Timings, since: float | None) -> Timings:
    """``timings`` without the records that began before ``since`` (the end of the first
    learning iteration), when every name a profile needs has a record after it; else
    ``timings`` as they are (a one-iteration warm-up, or records made before the tuner ran)."""
    if since is None:
        return timings
    later = Timings()
    later.add(r for n in timings.names() for r in timings.records(n) if r.start >= since)
    return later if all(later.count(n) for n in _PROFILED) else timings


def _without_units(timings: Timings, name: str, units: float) -> Timings:
    """A copy of ``timings`` without the ``name`` records of granularity ``units``."""
    out = Timings()
    out.add(r for n in timings.names() for r in timings.records(n)
            if n != name or r.units != units)
    return out
