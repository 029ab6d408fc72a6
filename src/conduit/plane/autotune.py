"""The runtime side of scheduling: profile the running plane, plan, re-plan.

Decisions stay in :mod:`conduit.scheduling` (pure functions of a :class:`Profile`); this module
only measures and applies:

* :func:`profile_plane` runs a short, bounded warm-up: the caller's ``step(plane)`` (one
  training iteration) under each granularity of the space, inline and overlapped, so that the
  plane's built-in timings hold ``T_rollout``, ``T_update``, ``T_ing(g)``, ``T_del(g)`` and the
  synchronization costs; :func:`~conduit.scheduling.profile_from_timings` turns them into a
  :class:`Profile`.
* :func:`plane_copy_times` reads each operator's data movement per unit from the plane's
  placement decision, for the copy-time bound (:mod:`conduit.scheduling.copy_bound`).
* :class:`AutoScheduler` applies :func:`~conduit.scheduling.choose`'s argmin over the
  copy-bounded profile with :meth:`ExperienceDataPlane.set_schedule`, feeds the plane's recent
  timings to a :class:`~conduit.scheduling.ReplanPolicy`, and re-plans on sustained drift or
  after a placement migration.

Example:
    >>> def step(plane):                       # one iteration of the training loop
    ...     with plane.timed("rollout"):
    ...         r = actor.rollout()
    ...     plane.push(r)
    ...     b = plane.pull()
    ...     with plane.timed("update"):
    ...         learner.update(b)
    >>> auto = AutoScheduler(plane=plane, step=step)
    >>> plan = auto.plan()                     # profile, choose, apply
    >>> for _ in range(1000):
    ...     step(plane)
    ...     auto.observe()                     # re-plans only on sustained drift
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from fractions import Fraction
from typing import TYPE_CHECKING

from conduit._checks import check_int, check_real
from conduit.errors import ConfigError, ScheduleError
from conduit.scheduling import (
    MIN_COPY,
    CopyTimes,
    Plan,
    Profile,
    ReplanDecision,
    ReplanPolicy,
    Schedule,
    ScheduleSpace,
    as_granularity,
    choose,
    copy_bound,
    copy_times,
    fresh_draws,
    learner_delivery,
    profile_from_timings,
)
from conduit.timing import TimingRecord, Timings

if TYPE_CHECKING:
    from conduit.plane.data_plane import ExperienceDataPlane

#: One training iteration on the plane: rollout + push + pull + update, with the compute stages
#: wrapped in ``plane.timed("rollout")`` / ``plane.timed("update")``.
Step = Callable[["ExperienceDataPlane"], object]

#: Timing names a profile is built from.
_PROFILE_NAMES = ("rollout", "update", "ingestion", "delivery", "sync_ing", "sync_del")
#: Timing names :meth:`AutoScheduler.observe` watches by default (sync costs depend on the
#: schedule in force, so they are not watched unless asked for).
DEFAULT_WATCH = ("rollout", "update", "ingestion", "delivery")


def profiling_schedules(space: ScheduleSpace,
                        granularities: Iterable[float | Fraction] | None = None
                        ) -> list[Schedule]:
    """The schedules :func:`profile_plane` runs, in order.

    Ingestion and delivery granularities are paired index by index (the shorter list repeats
    its last value), restricted to ``granularities`` when given; each pair runs inline
    (``overlap = 0``, for ``T_op(g)``) and then overlapped (``overlap = 1``, for the sync costs).

    Args:
        space: The feasible space.
        granularities: Measure only these granularities (others are filled by the cost fit of
            :func:`~conduit.scheduling.profile_from_timings`). ``None``: every one.

    Returns:
        ``2·max(|G_ing|, |G_del|)`` schedules (fewer when restricted).

    Raises:
        ConfigError: ``granularities`` is not a collection of positive finite numbers, or
            leaves nothing to measure.
    """
    g_ing, g_del = list(space.g_ing), list(space.g_del)
    keep = _check_granularities(granularities)
    if keep is not None:
        g_ing = [g for g in g_ing if g in keep] or g_ing[:1]
        g_del = [g for g in g_del if g in keep] or g_del[:1]
    n = max(len(g_ing), len(g_del))
    out: list[Schedule] = []
    for i in range(n):
        gi, gd = g_ing[min(i, len(g_ing) - 1)], g_del[min(i, len(g_del) - 1)]
        out += [Schedule(0, gi, 0, gd), Schedule(1, gi, 1, gd)]
    return out


def _check_granularities(granularities: Iterable[float | Fraction] | None
                        ) -> tuple[Fraction, ...] | None:
    """``granularities`` (see :func:`profiling_schedules`) as ``Fraction``s, or None.

    Raises:
        ConfigError: It is not a non-empty collection of positive finite numbers (a single
            number, a string and an empty list are refused).
    """
    if granularities is None:
        return None
    if isinstance(granularities, (str, bytes)) or not isinstance(granularities, Iterable):
        raise ConfigError("granularities", f"must be a list of granularities, e.g. [1, 4], "
                                           f"got {granularities!r}")
    try:
        out = tuple(as_granularity(g) for g in granularities)
    except ScheduleError as exc:
        raise ConfigError("granularities", str(exc)) from exc
    if not out:
        raise ConfigError("granularities", "must name at least one granularity")
    return out


def _steps_for(plane: ExperienceDataPlane, schedule: Schedule, invocations: int) -> int:
    """Steps needed for about ``invocations`` operator invocations at ``schedule``'s g.

    Off-policy a step pushes one rollout unit and pulls one batch, so an operator at
    granularity ``g`` runs once every ``g`` steps; on-policy each step is one whole iteration
    and every operator runs at least once in it.
    """
    if plane.mode == "on_policy":
        return invocations
    return invocations * max(math.ceil(schedule.g_ing), math.ceil(schedule.g_del))


def profile_plane(plane: ExperienceDataPlane, step: Step, *, space: ScheduleSpace | None = None,
                  iterations_per_g: int = 3, warmup: int = 1,
                  granularities: Iterable[float | Fraction] | None = None,
                  default_sync: float = 0.0) -> Profile:
    """Profile the plane's costs with a short, bounded warm-up of the caller's training step.

    For each schedule of :func:`profiling_schedules` the plane is switched with
    :meth:`~ExperienceDataPlane.set_schedule` and ``step(plane)`` runs ``warmup`` unmeasured
    and then ``iterations_per_g`` measured operator invocations' worth of iterations.
    ``T_rollout``, ``T_update``, ``T_ing(g)`` and ``T_del(g)`` are read from the inline runs.
    The sync costs come from the overlapped runs: the plane's ``sync_ing`` / ``sync_del``
    hand-off times plus the slowdown overlap inflicts on the neighbouring compute stage (the
    median rollout / update time under overlap minus the inline one, if positive), since both
    are critical-path time that overlap adds. The plane's own timings are left in place (the
    profile reads only the measured windows) and the plane's schedule is restored at the end.

    Off-policy, ``step`` is assumed to push one rollout unit and pull one training batch; the
    number of steps per granularity ``g`` is then ``(warmup + iterations_per_g)·g``. On-policy,
    a step is one whole iteration (all rollout units, all mini-batches).

    Args:
        plane: The plane to profile (it must already be able to serve a batch, e.g. an
            off-policy buffer past ``min_size``).
        step: One training iteration, see :data:`Step`.
        space: The schedule space to price (default ``plane.space``); every granularity it
            holds must be feasible for ``plane``.
        iterations_per_g: Measured operator invocations per schedule (``>= 1``).
        warmup: Unmeasured invocations per schedule after each switch (``>= 0``).
        granularities: Measure only these granularities; the others of ``space`` get costs from
            the ``T(g) = a + b·g`` fit (see :func:`~conduit.scheduling.profile_from_timings`).
        default_sync: Sync cost assumed if overlap recorded none (seconds).

    Returns:
        A :class:`Profile` pricing every granularity of ``space``.

    Raises:
        ConfigError: Bad ``iterations_per_g``/``warmup``/``granularities``.
        ScheduleError: ``space`` holds a granularity the plane cannot run.
        ProfileError: The step never timed a rollout or update, or no operator ran.
    """
    check_int("iterations_per_g", iterations_per_g, minimum=1)
    check_int("warmup", warmup, minimum=0)
    space = plane.space if space is None else space
    schedules = profiling_schedules(space, granularities)
    for s in schedules:
        plane.space.check(s)
    inline = Timings(window=1 << 16)
    overlapped = Timings(window=1 << 16)
    original = plane.schedule
    try:
        for sched in schedules:
            _switch(plane, sched)
            for _ in range(_steps_for(plane, sched, warmup)):
                step(plane)
            t0 = time.perf_counter()
            for _ in range(_steps_for(plane, sched, iterations_per_g)):
                step(plane)
            _switch(plane, sched)  # quiesce: in-flight invocations finish and are recorded
            if sched.overlap_ing:
                _copy_since(plane.timings, overlapped, ("rollout", "update", "sync_ing",
                                                        "sync_del"), t0)
            else:
                _copy_since(plane.timings, inline, ("rollout", "update", "ingestion",
                                                    "delivery"), t0)
    finally:
        _switch(plane, original)
    inline.add(r for name in ("sync_ing", "sync_del") for r in overlapped.records(name))
    prof = profile_from_timings(inline, space, default_sync=default_sync)
    # Overlap costs the critical path its hand-off time plus the slowdown its background
    # worker inflicts on the compute it runs next to (shared cores, memory bandwidth).
    return replace(prof,
                   t_sync_ing=prof.t_sync_ing + _slowdown(inline, overlapped, "rollout"),
                   t_sync_del=prof.t_sync_del + _slowdown(inline, overlapped, "update"))


def _slowdown(inline: Timings, overlapped: Timings, name: str) -> float:
    """How much longer a compute stage ran under overlap than inline (``>= 0``)."""
    a, b = inline.median(name), overlapped.median(name)
    return 0.0 if a is None or b is None else max(0.0, b - a)


def _switch(plane: ExperienceDataPlane, schedule: Schedule) -> None:
    """Ingest what is pending under the current schedule, then switch.

    Flushing first keeps a switch to a smaller ``g_ing`` from leaving more units queued than
    the new schedule's backpressure bound admits.
    """
    plane.flush()
    plane.set_schedule(schedule)


def _copy_since(src: Timings, dst: Timings, names: Sequence[str], since: float) -> None:
    dst.add(r for name in names for r in src.records(name) if r.start >= since)


def plane_copy_times(plane: ExperienceDataPlane) -> CopyTimes:
    """Each operator's data movement per unit on ``plane``: a unit's rows times the per-sample
    legs of its placement decision's transfer model (Eq. 1, measured bandwidths).

    Off-policy, a rollout unit's rows are those pushed so far per unit; delivery's is unknown
    for a learner on an accelerator (see :func:`~conduit.scheduling.copy_times`). Empty when
    the placement was set by hand (no transfer model).
    """
    decision = plane.placement_decision
    if decision is None:
        return CopyTimes()
    legs = decision.chosen_evaluation
    units = plane.counters["pushed_units"]
    return copy_times(mode=plane.mode, ingest_s=legs.ingest_s, deliver_s=legs.deliver_s,
                      capacity=plane.capacity, batch_size=plane.batch_size,
                      rows_per_unit=plane.counters["pushed_rows"] / units if units else None,
                      learner=plane.learner_device.type)


def stale_on_update(plane: ExperienceDataPlane) -> bool:
    """Whether each priority update of ``plane`` discards the batches drawn before it: its
    sampler invalidates prefetched batches and ``max_priority_lag`` is 0."""
    return bool(plane.buffer.sampler.invalidates_prefetch and plane.max_priority_lag == 0)


def tuning_space(plane: ExperienceDataPlane) -> ScheduleSpace:
    """The schedules chosen among for ``plane``: its space, with delivery one batch per
    invocation where each priority update discards the batches drawn before it
    (:func:`stale_on_update`, :func:`~conduit.scheduling.fresh_draws`)."""
    return fresh_draws(plane.space) if stale_on_update(plane) else plane.space


class AutoScheduler:
    """Chooses the plane's schedule from a profile and re-plans when the workload drifts.

    Every plan is the argmin over the profile with the copy-time bound of the plane's
    interpreter-bound operators (:func:`plane_copy_times`,
    :func:`~conduit.scheduling.copy_bound`). Where each priority update discards the batches
    drawn before it (:func:`stale_on_update`), the pick is the best candidate that delivers on
    the learner's thread (:func:`~conduit.scheduling.learner_delivery`): the profile prices a
    prefetched batch as delivered, not as drawn again after the update.

    Give ``step`` (the profile is then measured by :func:`profile_plane`, and measured again on
    every re-plan) or ``profile`` (a profile measured elsewhere; re-plans then update it with
    the plane's recent timings), or both (the initial plan uses ``profile``, re-plans measure).

    Args:
        plane: The plane whose schedule is controlled.
        step: One training iteration (see :data:`Step`).
        profile: A precomputed profile.
        space: The schedule space to choose from (default :func:`tuning_space` of the plane).
        threshold: Relative drift threshold of the :class:`~conduit.scheduling.ReplanPolicy`.
        patience: Consecutive out-of-band observations needed to re-plan.
        abs_tol: Absolute deviation (seconds) always treated as noise.
        watch: Timing names fed to the policy (default :data:`DEFAULT_WATCH`).
        iterations_per_g: Passed to :func:`profile_plane`.
        granularities: Passed to :func:`profile_plane`.
        top_k: Candidates kept by the plan for :meth:`explain` (every candidate where the
            pick must deliver on the learner's thread: the best ``top_k`` may all prefetch).
        deliver_on_learner: Pick a schedule whose delivery runs on the learner's thread (None:
            where :func:`stale_on_update` holds for ``plane``).
        min_copy: Per-unit data movement (seconds) under which an operator is
            interpreter-bound, so that overlap hides only its copies.

    Raises:
        ConfigError: Neither ``step`` nor ``profile`` given, ``watch`` not a list of known
            timing names, or a bad ``threshold`` (not a finite number ``> 0``), ``patience``
            (not an integer ``>= 1``), ``abs_tol`` or ``min_copy`` (not a finite number
            ``>= 0``), ``iterations_per_g`` or ``top_k`` (not an integer ``>= 1``), or
            ``granularities`` (not a non-empty list of positive finite numbers). Each is
            checked here, so that a bad value is refused before :meth:`plan` profiles the
            plane or changes its schedule.
    """

    def __init__(self, *, plane: ExperienceDataPlane, step: Step | None = None,
                 profile: Profile | None = None, space: ScheduleSpace | None = None,
                 threshold: float = 0.25, patience: int = 3, abs_tol: float = 0.0,
                 watch: Sequence[str] = DEFAULT_WATCH, iterations_per_g: int = 3,
                 granularities: Iterable[float | Fraction] | None = None,
                 top_k: int = 5, min_copy: float = MIN_COPY,
                 deliver_on_learner: bool | None = None) -> None:
        if step is None and profile is None:
            raise ConfigError("step", "give step= (to profile the plane) or profile=")
        if profile is not None and not isinstance(profile, Profile):
            raise ConfigError("profile", f"must be a Profile, got {type(profile).__name__}")
        if isinstance(watch, (str, bytes)) or not isinstance(watch, Iterable):
            raise ConfigError("watch", f"must be a list of timing names from "
                                       f"{_PROFILE_NAMES}, got {watch!r}")
        watch = tuple(watch)
        bad = [w for w in watch if w not in _PROFILE_NAMES]
        if bad:
            raise ConfigError("watch", f"unknown timing names {bad}; choose from "
                                       f"{_PROFILE_NAMES}")
        # The ReplanPolicy's rules, checked now: plan() builds the policy only after it has
        # chosen a schedule, and a refusal must not leave the plane switched.
        threshold = check_real("threshold", threshold, positive=True,
                               what="a relative deviation")
        patience = check_int("patience", patience, minimum=1)
        abs_tol = check_real("abs_tol", abs_tol, positive=False, what="a number of seconds")
        min_copy = check_real("min_copy", min_copy, positive=False, what="a number of seconds")
        iterations_per_g = check_int("iterations_per_g", iterations_per_g, minimum=1)
        top_k = check_int("top_k", top_k, minimum=1)
        if deliver_on_learner is not None and not isinstance(deliver_on_learner, bool):
            raise ConfigError("deliver_on_learner",
                              f"must be True, False or None, got {deliver_on_learner!r}")
        granularities = _check_granularities(granularities)
        self.plane = plane
        self.step = step
        self.space = tuning_space(plane) if space is None else space
        self.deliver_on_learner = (stale_on_update(plane) if deliver_on_learner is None
                                   else deliver_on_learner)
        self.threshold = threshold
        self.patience = patience
        self.abs_tol = abs_tol
        self.watch = watch
        self.iterations_per_g = iterations_per_g
        self.granularities = granularities
        self.top_k = top_k
        self.min_copy = min_copy
        self.profile: Profile | None = profile
        self.current: Plan | None = None
        self.policy: ReplanPolicy | None = None
        #: Every re-plan so far: ``(reasons, plan)``.
        self.history: list[tuple[tuple[str, ...], Plan]] = []
        self._seen: dict[str, int] = {}
        self._recent: list[TimingRecord] = []
        self._migrations_seen = plane.timings.count("migration")

    # ------------------------------------------------------------------ planning

    def plan(self) -> Plan:
        """Profile (if no profile is held yet), choose the argmin and apply it to the plane.

        Returns:
            The :class:`~conduit.scheduling.Plan` now in force.
        """
        if self.profile is None:
            assert self.step is not None
            self.profile = self._measure()
        return self._apply(self.profile, reasons=("initial",))

    def _measure(self) -> Profile:
        assert self.step is not None
        return profile_plane(self.plane, self.step, space=self.space,
                             iterations_per_g=self.iterations_per_g,
                             granularities=self.granularities)

    def _apply(self, profile: Profile, *, reasons: tuple[str, ...]) -> Plan:
        profile = copy_bound(profile, plane_copy_times(self.plane), min_copy=self.min_copy)
        if self.deliver_on_learner:
            plan = learner_delivery(choose(profile, self.space, top_k=len(self.space)))
        else:
            plan = choose(profile, self.space, top_k=self.top_k)
        # Build the policy before switching, so that a refusal leaves the plane as it was.
        policy = self.policy
        if policy is None:
            policy = ReplanPolicy(reference=profile, threshold=self.threshold,
                                  patience=self.patience, abs_tol=self.abs_tol)
        _switch(self.plane, plan.schedule)
        self.profile = profile
        self.current = plan
        if self.policy is None:
            self.policy = policy
        else:
            self.policy.replanned(profile)
        self.history.append((reasons, plan))
        self._skip_recorded()
        return plan

    @property
    def replans(self) -> int:
        """Re-plans after the initial plan."""
        return max(0, len(self.history) - 1)

    # ------------------------------------------------------------------ observing

    def notify_migration(self) -> ReplanDecision:
        """Record that the placement migrated; the next :meth:`observe` re-plans.

        Timings recorded before the migration are no longer representative and are dropped.

        Returns:
            The policy's decision (always ``replan=True``).

        Raises:
            ConfigError: :meth:`plan` was not called yet.
        """
        policy = self._require_policy()
        self._skip_recorded()
        return policy.notify_migration()

    def observe(self) -> ReplanDecision:
        """Feed the timings recorded since the last call to the policy; re-plan if it says so.

        Each new record of a watched name is one observation (operators at the granularity
        they ran at). On a re-plan the profile is measured again with ``step`` when one was
        given, otherwise the held profile is updated with the medians of the latest records
        seen since the last plan.

        Returns:
            The decision that was acted upon (``replan=True`` means the plane's schedule was
            re-chosen; see :attr:`current`).

        Raises:
            ConfigError: :meth:`plan` was not called yet.
        """
        policy = self._require_policy()
        timings = self.plane.timings
        migrations = timings.count("migration")
        new = self._new_records()
        if migrations > self._migrations_seen:
            # The plane moved its buffer (Alg. 2): operator costs changed with the placement.
            # Records made before the last migration ended are dropped, those after it kept:
            # they are the costs of the new placement.
            self._migrations_seen = migrations
            last = timings.records("migration")[-1]
            moved = last.start + last.seconds
            self._recent = []
            policy.notify_migration()
            new = [r for r in new if r.start >= moved]
        decision = policy.decision()
        for r in new:
            kw = _observation(r)
            if kw is None:
                continue
            try:
                decision = policy.observe(**kw)
            except ScheduleError:  # a granularity the reference cannot price: not comparable
                continue
        self._recent += new
        if decision.replan:
            profile = self._measure() if self.step is not None else self._merged_profile()
            self._apply(profile, reasons=decision.reasons)
        return decision

    def _require_policy(self) -> ReplanPolicy:
        if self.policy is None:
            raise ConfigError("plan", "call AutoScheduler.plan() before observing")
        return self.policy

    def _skip_recorded(self) -> None:
        """Treat everything recorded so far as seen (it predates the plan in force)."""
        self._seen = {name: self.plane.timings.count(name) for name in _PROFILE_NAMES}
        self._recent = []

    def _new_records(self) -> list[TimingRecord]:
        """Records of watched names made since the last call, oldest first."""
        t = self.plane.timings
        recs: list[TimingRecord] = []
        for name in self.watch:
            window = t.records(name)
            total = t.count(name)
            fresh = min(total - self._seen.get(name, 0), len(window))
            self._seen[name] = total
            if fresh > 0:
                recs += window[-fresh:]
        recs.sort(key=lambda r: r.start)
        return recs

    def _merged_profile(self) -> Profile:
        """The held profile, with every metric seen since the last plan replaced by the median of
        its latest ``patience`` records (those that showed the drift)."""
        ref = self.profile
        assert ref is not None
        by: dict[str, list[TimingRecord]] = {}
        for r in self._recent:
            by.setdefault(r.name, []).append(r)

        def med(name: str, default: float) -> float:
            recs = by.get(name)
            return (statistics.median(r.seconds for r in recs[-self.patience:]) if recs
                    else default)

        def per_g(name: str, table: dict) -> dict:
            out = dict(table)
            groups: dict[Fraction, list[float]] = {}
            for r in by.get(name, ()):
                g = _granularity_of(r)
                if g is not None:
                    groups.setdefault(g, []).append(r.seconds)
            out.update({g: statistics.median(v[-self.patience:]) for g, v in groups.items()})
            return out

        return Profile(t_rollout=med("rollout", ref.t_rollout),
                       t_update=med("update", ref.t_update),
                       t_ing=per_g("ingestion", ref.t_ing), t_del=per_g("delivery", ref.t_del),
                       t_sync_ing=med("sync_ing", ref.t_sync_ing),
                       t_sync_del=med("sync_del", ref.t_sync_del),
                       ing_fit=ref.ing_fit, del_fit=ref.del_fit)

    # ------------------------------------------------------------------ reporting

    def explain(self) -> str:
        """The current plan's explanation (top candidates with predicted times) and re-plans.

        Returns:
            Multi-line text; ``"no plan yet"`` before :meth:`plan`.
        """
        if self.current is None:
            return "no plan yet: call AutoScheduler.plan()"
        lines = [self.current.explain()]
        if self.replans:
            lines.append("")
            lines.append(f"re-plans: {self.replans}")
            for reasons, plan in self.history[1:]:
                lines.append(f"  {', '.join(reasons)} -> {plan.schedule.label()}")
        return "\n".join(lines)


def _observation(r: TimingRecord) -> dict[str, float] | None:
    if r.name == "rollout":
        return {"t_rollout": r.seconds}
    if r.name == "update":
        return {"t_update": r.seconds}
    if r.name in ("ingestion", "delivery"):
        g = _granularity_of(r)
        if g is None:
            return None
        if r.name == "ingestion":
            return {"t_ing": r.seconds, "g_ing": g}
        return {"t_del": r.seconds, "g_del": g}
    if r.name == "sync_ing":
        return {"t_sync_ing": r.seconds}
    if r.name == "sync_del":
        return {"t_sync_del": r.seconds}
    return None


def _granularity_of(r: TimingRecord) -> Fraction | None:
    """The granularity an operator record ran at; None when its units are not one (zero, not
    finite, or so small that they round to 0 as a granularity)."""
    try:
        return as_granularity(r.units)
    except ScheduleError:
        return None
