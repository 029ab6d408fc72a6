"""Latency-aware scheduling of experience ingestion and delivery (§6 of the paper).

Pure functions and immutable values, no I/O:

* :func:`feasible_space` derives the feasible granularities from the RL configuration
  (:class:`ScheduleSpace`, :class:`Schedule`);
* :class:`Profile` holds profiled costs; :func:`profile_from_timings` builds one from the
  plane's :class:`~conduit.timing.Timings`;
* :func:`predict` is the iteration-latency model (Eq. 2, App. E Eq. 4–6);
* :func:`choose` enumerates the ``4·|G_ing|·|G_del|`` candidates and returns a :class:`Plan`;
* :func:`copy_bound` caps what overlap hides for interpreter-bound operators (:class:`CopyTimes`);
* :class:`TrialPolicy`, :class:`TrialPair` and :func:`judge_trial` decide threads or no threads
  from the model's pick and a measured warm-up trial; :func:`spare_core` says whether a
  worker has a core the update does not compute on;
* :class:`DriftDetector` / :class:`ReplanPolicy` decide when to re-plan;
* :func:`fidelity` reports the model's accuracy like Tab. 4.

Example:
    >>> from conduit.scheduling import Profile, choose, feasible_space
    >>> space = feasible_space(mode="off_policy", g_max_ing=2, g_max_del=2)
    >>> prof = Profile(t_rollout=0.010, t_update=0.020,
    ...                t_ing={1: 0.004, 2: 0.005}, t_del={1: 0.003, 2: 0.004},
    ...                t_sync_ing=0.0005, t_sync_del=0.0005)
    >>> choose(prof, space).schedule.label()
    'ing(ov=1,g=1) del(ov=1,g=1)'
"""

from conduit.scheduling.copy_bound import MIN_COPY, CopyTimes, copy_bound, copy_times
from conduit.scheduling.cost_model import Prediction, gamma, hide, per_unit, predict
from conduit.scheduling.fidelity import fidelity, top_k_order
from conduit.scheduling.optimizer import (
    Candidate,
    Plan,
    baseline_schedule,
    choose,
    rank_candidates,
    tie_key,
)
from conduit.scheduling.profile import (
    CostFit,
    Profile,
    ProfileError,
    as_granularity,
    fit_cost,
    profile_from_timings,
)
from conduit.scheduling.replan import (
    METRICS,
    MIGRATION,
    DriftDetector,
    ReplanDecision,
    ReplanPolicy,
)
from conduit.scheduling.space import (
    MAX_GRANULARITY,
    MAX_MINIBATCHES,
    Schedule,
    ScheduleSpace,
    feasible_space,
)
from conduit.scheduling.trial import (
    TrialOutcome,
    TrialPair,
    TrialPolicy,
    Verdict,
    fresh_draws,
    judge_trial,
    learner_delivery,
    spare_core,
    start_schedule,
    warmup_schedule,
)

__all__ = [
    "MAX_GRANULARITY",
    "MAX_MINIBATCHES",
    "METRICS",
    "MIGRATION",
    "MIN_COPY",
    "Candidate",
    "CopyTimes",
    "CostFit",
    "DriftDetector",
    "Plan",
    "Prediction",
    "Profile",
    "ProfileError",
    "ReplanDecision",
    "ReplanPolicy",
    "Schedule",
    "ScheduleSpace",
    "TrialOutcome",
    "TrialPair",
    "TrialPolicy",
    "Verdict",
    "as_granularity",
    "baseline_schedule",
    "choose",
    "copy_bound",
    "copy_times",
    "feasible_space",
    "fidelity",
    "fit_cost",
    "fresh_draws",
    "gamma",
    "hide",
    "judge_trial",
    "learner_delivery",
    "per_unit",
    "predict",
    "profile_from_timings",
    "rank_candidates",
    "spare_core",
    "start_schedule",
    "tie_key",
    "top_k_order",
    "warmup_schedule",
]
