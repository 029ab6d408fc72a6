"""The measured warm-up trial that decides threads or no threads (docs/design.md §6).

The cost model scores operator costs; it does not see what overlap costs the learner itself
where threads compete for cores and for the interpreter lock. So after a few warm-up
iterations the model's pick (A) is run against the model's best schedule that starts no thread
(B), interleaved, and B replaces A only on a clear win. The decisions here are pure functions
of plans, profiles and measured iteration times; :class:`conduit.plane.tuner.WarmupScheduleTuner`
runs them on a plane.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from conduit._checks import check_real
from conduit.errors import ConfigError
from conduit.scheduling.copy_bound import MIN_COPY
from conduit.scheduling.optimizer import Candidate, Plan, rank_candidates
from conduit.scheduling.profile import Profile
from conduit.scheduling.space import Schedule, ScheduleSpace

#: Trial candidates by index: the model's pick, then the best threadless schedule.
MODEL, THREADLESS = 0, 1


@dataclass(frozen=True, kw_only=True)
class TrialPolicy:
    """How the warm-up trial runs and what counts as a clear win.

    Attributes:
        warmup: Learning iterations on the start schedule before the model picks (``>= 1``).
        trial: Iterations each candidate runs in the trial (``0``: keep the model's pick
            untried).
        margin: B's median must be lower than A's by more than this fraction.
        inversions: At most this many of the ``trial²`` (B, A) pairs of iterations may have
            B not faster (a one-sided Mann–Whitney count); over more iterations the
            allowance grows with the pairs (:func:`inversion_allowance`).
        extend: Iterations each candidate runs again, once, when the trial leaves it open
            (B faster by median beyond ``margin``, with more inversions than allowed); the
            decision is then made over all of them (``0``: decide on ``trial`` alone).
        min_gain: When the model predicts that A saves less than this fraction of B's
            iteration, no trial runs and B is kept.
        min_copy: Per-unit data movement (seconds) under which an operator is
            interpreter-bound (see :mod:`conduit.scheduling.copy_bound`).

    Raises:
        ConfigError: A field is out of range (the error names it).
    """

    warmup: int = 3
    trial: int = 4
    margin: float = 0.05
    inversions: int = 3
    extend: int = 4
    min_gain: float = 0.02
    min_copy: float = MIN_COPY

    def __post_init__(self) -> None:
        for name, least in (("warmup", 1), ("trial", 0), ("inversions", 0), ("extend", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ConfigError(name, f"must be an integer >= {least}, got {v!r}")
        margin = check_real("margin", self.margin, positive=False)
        if not margin < 1:
            raise ConfigError("margin", f"must lie in [0, 1), got {self.margin!r}")
        for name in ("min_gain", "min_copy"):
            check_real(name, getattr(self, name), positive=False)

    def order(self, iterations: int | None = None) -> tuple[int, ...]:
        """Which candidate each trial iteration runs, for ``iterations`` each (default
        ``trial``): A B B A A B B A ..., so that drift of a shared machine lands on both
        alike."""
        n = self.trial if iterations is None else iterations
        pair = (MODEL, THREADLESS)
        return tuple(i for k in range(n) for i in (pair if k % 2 == 0 else pair[::-1]))


def spare_core(*, cores: int, compute_threads: int, accelerator: bool) -> bool:
    """Whether a data-path worker thread can run beside the learner's update without taking
    a core the update computes on.

    On an accelerator the update runs on the device and leaves the host's cores to the
    workers. On the CPU the update's intra-op threads use ``compute_threads`` of ``cores``;
    where they use all of them, a worker only takes CPU time from the update, and an
    intra-op region waits for its slowest thread, so what the overlap hides the slower
    update gives back (docs/design.md §6).

    Args:
        cores: Cores of the machine.
        compute_threads: Intra-op threads the update computes with.
        accelerator: Whether the update runs on an accelerator.
    """
    return accelerator or cores > compute_threads


def start_schedule(space: ScheduleSpace, *, prioritized: bool = False) -> Schedule:
    """The hand-set overlap schedule a run starts on, before the model has timings.

    Off-policy both operators overlap, delivery prefetching two batches; with prioritized
    replay delivery stays on the learner's thread (a batch prefetched before a priority
    update would be discarded). On-policy ingestion runs at the finest feasible step (one
    rollout unit when units have a fixed size) and delivery one mini-batch at a time.

    The schedule always lies in ``space``: off-policy delivery prefetches ``min(2, g_max_del)``
    batches, and the prioritized schedule takes ``space``'s finest granularities.
    """
    if prioritized:
        return Schedule(1, space.g_ing[0], 0, space.g_del[0])
    if space.mode == "on_policy":
        return Schedule(1, space.g_ing[0], 1, space.g_del[0])
    return Schedule(1, 1, 1, min(2, max(space.g_del)))


def warmup_schedule(seen: int, *, warmup: int, start: Schedule,
                    space: ScheduleSpace) -> Schedule:
    """The schedule of the next warm-up iteration, after ``seen`` learning iterations.

    Off-policy, when a coarser delivery granularity than ``start``'s is feasible, the
    iteration after every odd ``seen`` (but never the last warm-up one) runs threadless at the
    coarsest ``g_del``: every batch of an invocation drawn and gathered at once, so the
    ``T(g) = a + b·g`` fit sees the fixed per-invocation cost that coarse delivery amortizes.
    Otherwise it runs ``start``.
    """
    coarsest = max(space.g_del)
    if space.mode == "off_policy" and coarsest != start.g_del and (
            seen % 2 == 1 and seen + 1 < warmup):
        return Schedule(0, start.g_ing, 0, coarsest)
    return start


def threads(schedule: Schedule) -> bool:
    """Whether ``schedule`` runs an operator on a worker thread."""
    return bool(schedule.overlap_ing or schedule.overlap_del)


def fresh_draws(space: ScheduleSpace) -> ScheduleSpace:
    """``space`` with off-policy delivery one batch per invocation (its finest ``g_del``).

    For prioritized replay without priority lag, whose learner updates priorities between
    two pulls: every batch drawn before an update is discarded at the next pull, the rest of
    a coarse invocation as much as a prefetched batch, so delivering ``g`` batches at once
    draws and gathers ``g`` batches for each one delivered. On-policy spaces, and spaces with
    one delivery granularity, are returned as they are.
    """
    if space.mode != "off_policy" or len(space.g_del) < 2:
        return space
    return dataclasses.replace(space, g_del=space.g_del[:1])


def learner_delivery(plan: Plan) -> Plan:
    """``plan`` with its pick replaced by its best ranked candidate whose delivery runs on the
    learner's thread, when it has one (prioritized replay without priority lag discards every
    batch prefetched during an update)."""
    if not plan.schedule.overlap_del:
        return plan
    keep = next((c for c in plan.ranked if not c.schedule.overlap_del), None)
    if keep is None:
        return plan
    return dataclasses.replace(plan, schedule=keep.schedule, prediction=keep.prediction)


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """A schedule to keep and the reason, for the plan's explanation (may be empty)."""

    schedule: Schedule
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class TrialPair:
    """The two schedules of a trial, with the model's predictions.

    Attributes:
        model: A, the model's pick (priced without the coarse-delivery probe: an overlapped
            invocation of g batches overlaps one update, not the g that Eq. 5 assumes).
        threadless: B, the best schedule that starts no thread, priced with the probe.
    """

    model: Candidate
    threadless: Candidate

    @classmethod
    def of(cls, plan: Plan, probed: Profile, space: ScheduleSpace) -> TrialPair:
        """A from ``plan``; B the best threadless candidate of ``space`` under ``probed``."""
        best_b = next(c for c in rank_candidates(probed, space) if not threads(c.schedule))
        return cls(model=Candidate(rank=1, schedule=plan.schedule, prediction=plan.prediction),
                   threadless=best_b)

    @property
    def gain(self) -> float:
        """Seconds per iteration the model predicts A saves over B."""
        return self.threadless.prediction.t_iter - self.model.prediction.t_iter

    def saving(self) -> str:
        """The predicted saving, in words."""
        return (f"the model's pick would save {1000 * self.gain:.2f} ms of a "
                f"{1000 * self.threadless.prediction.t_iter:.1f} ms iteration over "
                f"{self.threadless.schedule.label()}")

    def verdict_without_trial(self, policy: TrialPolicy) -> Verdict | None:
        """The schedule to keep when no trial is worth running, else None.

        B is kept when A starts no thread, or when A's predicted saving is under
        ``policy.min_gain`` of B's iteration (a few noisy iterations cannot resolve it, and
        the threads' unmodelled cost can exceed it). A is kept untried when
        ``policy.trial`` is 0.
        """
        a, b = self.model.schedule, self.threadless.schedule
        if not threads(a):
            note = f"; {b.label()} with the coarse-delivery probe priced" if b != a else ""
            return Verdict(schedule=b, reason=f"no trial: the model's pick starts no "
                                              f"thread{note}")
        if self.gain < policy.min_gain * self.threadless.prediction.t_iter:
            return Verdict(schedule=b, reason=f"no trial: {self.saving()}, less than "
                                              f"{policy.min_gain:.0%}; kept the schedule "
                                              f"without threads")
        if policy.trial < 1:
            return Verdict(schedule=a, reason=self.saving())
        return None

    def schedules(self) -> tuple[Schedule, Schedule]:
        """``(A, B)``, indexed by :data:`MODEL` and :data:`THREADLESS`."""
        return self.model.schedule, self.threadless.schedule


@dataclass(frozen=True, kw_only=True)
class TrialOutcome:
    """The statistic of a finished trial.

    Attributes:
        model_median: A's median score (seconds).
        threadless_median: B's median score.
        inverted: (B, A) pairs of iterations with B not faster.
        allowed: The inversions a clear win may have over these pairs.
        keep_threadless: B won clearly: median lower by more than the margin, and at most
            the allowed inversions.
        open: B's median is lower by more than the margin, with more inversions than
            allowed: more iterations may settle it (A is kept if none run).
    """

    model_median: float
    threadless_median: float
    inverted: int
    allowed: int
    keep_threadless: bool
    open: bool

    def explain(self, pair: TrialPair, trial: int) -> str:
        """The measured medians, marking the model's pick and the kept schedule."""
        kept = THREADLESS if self.keep_threadless else MODEL
        lines = [f"  {s.label()}: {1000 * m:.1f} ms" + ("  <- model" if i == MODEL else "")
                 + ("  <- kept" if i == kept else "")
                 for i, (s, m) in enumerate(zip(pair.schedules(),
                                                (self.model_median, self.threadless_median)))]
        verdict = (f"  the schedule without threads was not faster in {self.inverted} of "
                   f"{trial * trial} pairs of iterations (a clear win allows {self.allowed})")
        return (f"measured (median learner ms per iteration outside the rollout wait, "
                f"{trial} iterations each):\n" + "\n".join([*lines, verdict]))


def inversion_allowance(policy: TrialPolicy, pairs: int) -> int:
    """The inversions a clear win may have over ``pairs`` (B, A) pairs: ``inversions`` per
    ``trial²`` pairs, rounded down (for ``trial`` 0, per pair)."""
    return policy.inversions * pairs // max(policy.trial, 1) ** 2


def judge_trial(model: Sequence[float], threadless: Sequence[float], *,
                policy: TrialPolicy) -> TrialOutcome:
    """Compare the two candidates' per-iteration scores (lower is better).

    Args:
        model: A's scores.
        threadless: B's scores.
        policy: Supplies ``margin``, ``inversions`` and ``trial`` (the iterations the
            allowance is given for).

    Raises:
        ValueError: Either candidate has no score.
    """
    if not model or not threadless:
        raise ValueError("judge_trial: both candidates need at least one score")
    med_a, med_b = statistics.median(model), statistics.median(threadless)
    inverted = sum(b >= a for b in threadless for a in model)
    allowed = inversion_allowance(policy, len(model) * len(threadless))
    faster = med_b < med_a * (1 - policy.margin)
    return TrialOutcome(model_median=med_a, threadless_median=med_b, inverted=inverted,
                        keep_threadless=faster and inverted <= allowed, allowed=allowed,
                        open=faster and inverted > allowed)
