"""What the three trainers share: building the plane for a buffer mode, the per-iteration
breakdown (Fig. 1 / Fig. 11 style), the progress line, and the JSON + PNG outputs.

Breakdown of one iteration (all wall-clock seconds, measured in the same run):

* ``rollout``: the learner waiting on actor rollouts (plus the policy broadcast);
* ``ingestion``: exposed ingestion, the time the learner's thread spent inside
  ``plane.push``, or, when the actor port pushes on its own thread, waiting for its pushes
  after the last rollout unit arrived;
* ``delivery``: exposed delivery, the time the caller spent inside ``plane.pull``;
* ``update``: learner update compute;
* ``other``: the rest (bookkeeping);
* ``end_to_end``: the iteration's wall time; ``exposed = ingestion + delivery``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from conduit.errors import ConduitError

PHASES = ("rollout", "ingestion", "delivery", "update", "other")
PHASE_COLORS = {"rollout": "#4C72B0", "ingestion": "#DD8452", "delivery": "#C44E52",
                "update": "#55A868", "other": "#B0B0B0"}


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> the first CUDA device when present, else CPU."""
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def set_learner_threads(n: int, *, actors: int, use_ray: bool) -> int:
    """Set torch's intra-op threads for the learner and return the count.

    ``0`` picks one thread per core left over by the actors (at least one): on a small machine
    an oversubscribed learner slows down several-fold.
    """
    import os

    if n <= 0:
        spare = (os.cpu_count() or 1) - (actors if use_ray else 0)
        n = max(1, min(torch.get_num_threads(), spare))
    torch.set_num_threads(n)
    return n


def parse_schedule(text: str) -> Any:
    """``"inline"``, ``"auto"`` or ``"ov_ing,g_ing,ov_del,g_del"`` (g may be ``1/4``)."""
    from conduit import Schedule

    if text in ("auto", "inline"):
        return "auto" if text == "auto" else Schedule.inline()
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 4:
        raise ValueError(f"schedule: expected 'auto', 'inline' or four comma-separated values "
                         f"'ov_ing,g_ing,ov_del,g_del', got {text!r}")
    return Schedule(int(parts[0]), Fraction(parts[1]), int(parts[2]), Fraction(parts[3]))


def parse_placement(text: str, learner_device: torch.device) -> Any:
    """``"auto"``, ``"pageable"``, ``"pinned"``, ``"learner"`` (the learner's device) or a
    device name such as ``"cuda:0"``."""
    from conduit.storage.layout import Placement

    if text == "auto":
        return "auto"
    if text == "pageable":
        return Placement.pageable()
    if text == "pinned":
        return Placement.pinned() if torch.cuda.is_available() else Placement.pageable()
    if text == "learner":
        return (Placement.device(learner_device) if learner_device.type != "cpu"
                else Placement.pageable())
    return Placement.device(text)


def default_conduit_schedule(mode: str, num_minibatches: int, *,
                             prioritized: bool = False, g_ing: Fraction | None = None) -> Any:
    """Hand-set overlap schedule: the starting point of auto-planning, and the fallback.

    With prioritized replay, delivery stays on the learner's thread: a batch prefetched before
    a priority update would be discarded (priorities reach the sampler first, DESIGN §4.4).
    On-policy, ingestion runs at ``g_ing`` (default 1/M; pass the finest feasible one, such
    as one rollout unit, to ingest every unit as it arrives).
    """
    from conduit import Schedule

    if prioritized:
        return Schedule(1, 1, 0, 1)
    if mode == "on_policy":
        return Schedule(1, g_ing or Fraction(1, num_minibatches), 1,
                        Fraction(1, num_minibatches))
    return Schedule(1, 1, 1, 2)


class WarmupScheduleTuner:
    """Chooses the schedule during a run's first learning iterations, in two steps.

    1. **Model.** The run starts on :func:`default_conduit_schedule`. After ``warmup``
       learning iterations the plane's own timings become a
       :class:`~conduit.scheduling.Profile`, and :class:`conduit.plane.AutoScheduler` picks
       the argmin of Eq. 2. With prioritized replay and no allowed priority lag, a batch
       prefetched during an update is always discarded (DESIGN §4.4), so overlapped delivery
       is left out of that choice. Eq. 4/5 assume an overlapped operator runs beside its
       neighbour for free; on a Python thread only its tensor copies do, while its Python
       holds the interpreter lock that the learner needs. So an operator whose data movement
       (a unit's bytes at the placement's measured bandwidth) takes under ``min_copy`` per
       unit is taken as interpreter-bound, and overlap hides only its copies
       (``Profile.t_copy_*``). On the 2-core development VM the light workloads' copies took
       0.2–4 µs per unit and the heavy ones' 0.6–4.7 ms, so the default 0.1 ms sits 25× and
       6× from either side. Without this bound the model picked overlap for PPO-CP, whose
       update ran 8–27 % longer than inline's in six ``conduit bench workloads`` runs.
    2. **Trial.** The cost model scores operator costs; it does not see what overlap costs the
       learner itself where threads compete for few cores and for the GIL (measured on a
       2-core VM: a light DQN update 20–70 % slower beside the workers). So the tuner then
       runs the model's pick (A) against the model's best schedule that starts no thread
       (B: neither operator overlapped, granularities by Eq. 2). Off-policy, the middle
       warm-up iterations run B's kind of schedule at the coarsest ``G_del`` (every batch of
       an invocation drawn and gathered at once, on the learner's thread), so B is priced
       from two measured granularities, whose ``T(g) = a + b·g`` fit sees the fixed
       per-invocation cost that coarse delivery amortizes. A is chosen without those
       records: an overlapped invocation of g batches is refilled only once the stage is
       empty (the prefetch bound), so it overlaps one update, not the g that Eq. 5 assumes,
       and an amortized fit would make coarse overlapped delivery look better than it runs.
       Where the model predicts that A saves less than ``min_gain`` of B's iteration (a light
       workload: little experience-path time to hide), no trial runs and B is kept: four
       noisy iterations each cannot resolve such a gain, and the threads' unmodelled cost
       can exceed it (a trial on a light DQN row costs ~6 iterations slowed by 20–70 %). On
       the 2-core development VM the light workloads' predicted savings were 0.2–1.7 %, the
       heavy ones' 2.8 % (SAC-img128, where the update dwarfs the experience path) and more.
       Otherwise A and B run ``trial`` iterations each, interleaved (A B B A A B B A). Each
       iteration scores the learner's time outside the rollout wait (end to end minus
       rollout: exposed path, update, bookkeeping), and the tuner keeps the model's pick
       unless B wins clearly: its median lower by more than ``margin`` and at most
       ``inversions`` of the ``trial``² (B, A) pairs of iterations with B's not faster (a
       one-sided Mann–Whitney count). With four iterations each and three inversions
       allowed, two equally fast schedules pass the count by chance 7 times in 70 (less
       often with the margin); a first version with two iterations each and none allowed
       (1 in 6 per candidate, three candidates) switched heavy workloads away from overlap
       on noise. Where overlap wins it wins by more than the noise: in one
       ``conduit bench workloads`` run on the 2-core development VM, the threadless
       schedule's trial median was 2–109 % above the overlapped pick's on every heavy
       workload and 11–32 % below it on five of six light ones.

    Call :meth:`step` once per iteration, at its end, with that iteration's record.
    """

    def __init__(self, plane: Any, plan: dict[str, Any], *, warmup: int = 3, trial: int = 4,
                 margin: float = 0.05, inversions: int = 3, min_gain: float = 0.02,
                 min_copy: float = 1e-4, prioritized: bool = False) -> None:
        self.plane, self.plan, self.warmup = plane, plan, warmup
        self.trial, self.margin, self.inversions = trial, margin, inversions
        self.min_gain = min_gain
        self.min_copy = min_copy
        self.prioritized = prioritized
        self.default = plane.schedule
        self._probed: Any = None  # the g_del a warm-up iteration probed, if any
        self.seen = 0
        self.done = False
        self.explanation = ""
        self._candidates: list[Any] = []
        self._order: list[int] = []
        self._scores: dict[int, list[float]] = {}

    def step(self, record: IterationRecord) -> None:
        """Account for one finished iteration; may switch the plane's schedule."""
        if self.done or not record.learning:
            return
        self.seen += 1
        if self.seen < self.warmup:
            self._probe_granularity()
            return
        if not self._candidates:
            self._plan_with_model()
        else:
            ran = self._order.pop(0)
            self._scores[ran].append(record.end_to_end - record.rollout)
        if self.done:
            return
        if self._order:
            self.plane.set_schedule(self._candidates[self._order[0]])
        else:
            self._choose()

    def _probe_granularity(self) -> None:
        """Off-policy warm-up: the next iteration runs threadless at the coarsest ``g_del``
        when ``seen`` is odd, and the start schedule otherwise (the last warm-up iteration
        always runs the start schedule)."""
        from conduit import Schedule

        coarsest = max(self.plane.space.g_del)
        if self.plane.mode != "off_policy" or coarsest == self.default.g_del:
            return
        probe = self.seen % 2 == 1 and self.seen + 1 < self.warmup
        if probe:
            self._probed = coarsest
        want = Schedule(0, self.default.g_ing, 0, coarsest) if probe else self.default
        if self.plane.schedule != want:
            self.plane.set_schedule(want)

    def _plan_with_model(self) -> None:
        from conduit.plane import AutoScheduler
        from conduit.scheduling import profile_from_timings, rank_candidates

        space = self.plane.space
        timings = self.plane.timings
        try:
            probed = profile_from_timings(timings, space)
            unprobed = probed if self._probed is None else profile_from_timings(
                _without_units(timings, "delivery", float(self._probed)), space)
            copy = self._interpreter_bound()
            probed = dataclasses.replace(probed, **copy)
            unprobed = dataclasses.replace(unprobed, **copy)
            auto = AutoScheduler(plane=self.plane, space=space, top_k=5, profile=unprobed)
            plan = auto.plan()
        except ConduitError as exc:
            self.plan["note"] = f"kept the hand-set schedule ({type(exc).__name__}: {exc})"
            self.done = True
            return
        if self.prioritized and plan.schedule.overlap_del and self.plane.max_priority_lag == 0:
            keep = [c for c in plan.ranked if not c.schedule.overlap_del]
            if keep:
                plan = dataclasses.replace(plan, schedule=keep[0].schedule,
                                           prediction=keep[0].prediction)
        self.explanation = "\n".join(plan.explain().splitlines()[:13])
        self.plan["schedule_plan"] = plan.to_dict()
        a = plan.schedule
        best_b = next(c for c in rank_candidates(probed, space)
                      if not c.schedule.overlap_ing and not c.schedule.overlap_del)
        threadless = best_b.schedule
        if not (a.overlap_ing or a.overlap_del):
            # Then B, the same kind of schedule priced with the coarse-delivery probe.
            probed_note = (f"; {threadless.label()} with the coarse-delivery probe priced"
                           if threadless != a else "")
            self._finish(threadless, f"no trial: the model's pick starts no thread"
                                     f"{probed_note}")
            return
        gain = best_b.prediction.t_iter - plan.prediction.t_iter
        saving = (f"the model's pick would save {1000 * gain:.2f} ms of a "
                  f"{1000 * best_b.prediction.t_iter:.1f} ms iteration over {threadless.label()}")
        if gain < self.min_gain * best_b.prediction.t_iter:
            # A saving the trial could not resolve is not worth the threads' unmodelled cost.
            self._finish(threadless, f"no trial: {saving}, less than {self.min_gain:.0%}; "
                         f"kept the schedule without threads")
            return
        self.explanation += f"\n{saving}"
        if self.trial < 1:
            self._finish(a, "")
            return
        self._candidates = [a, threadless]
        ids = [0, 1]
        for k in range(self.trial):  # A B B A ...: drift lands on every candidate
            self._order += ids if k % 2 == 0 else ids[::-1]
        self._scores = {i: [] for i in ids}

    def _interpreter_bound(self) -> dict[str, float]:
        """``t_copy_*`` for the operators that are interpreter-bound: whose data movement per
        unit (:meth:`_copy_costs`) is under ``min_copy`` seconds. What such an operator costs
        beyond its copies is Python, which holds the interpreter lock, so overlap hides only
        the copies (see :class:`~conduit.scheduling.Profile`). The others keep Eq. 4/5 as
        they are: the rest of a heavy operator (scattered gathers, page faults) runs in torch,
        outside the lock, and the bandwidth figure undercounts it."""
        copies = self._copy_costs()
        self.plan["copy_ms_per_unit"] = {k: 1000 * v for k, v in copies.items()}
        return {k: v for k, v in copies.items() if v < self.min_copy}

    def _copy_costs(self) -> dict[str, float]:
        """Per-unit data-movement seconds of each operator (``t_copy_ing``, ``t_copy_del``):
        a unit's rows times the per-sample legs of the placement's transfer model (Eq. 1, from
        measured bandwidths). Empty when the placement was set by hand (no transfer model).

        A unit is what the cost model's per-unit costs cover: off-policy one rollout unit
        (ingestion) and one batch (delivery); on-policy the iteration's rows (``T(g)/g``).
        """
        decision = getattr(self.plane, "placement_decision", None)
        if decision is None:
            return {}
        legs = decision.chosen_evaluation
        plane = self.plane
        if plane.mode == "on_policy":
            return {"t_copy_ing": plane.capacity * legs.ingest_s,
                    "t_copy_del": plane.capacity * legs.deliver_s}
        out = {"t_copy_del": plane.batch_size * legs.deliver_s}
        units = plane.counters["pushed_units"]
        if units:  # rows per rollout unit, as pushed so far
            out["t_copy_ing"] = plane.counters["pushed_rows"] / units * legs.ingest_s
        return out

    def _choose(self) -> None:
        med = {i: statistics.median(v) for i, v in self._scores.items() if v}
        # A clear win only: a median lower by more than the margin, and the candidate's
        # iterations faster than the model pick's in all but `inversions` of the pairs.
        # Iteration times of a heavy workload vary by more than what overlap saves there, and
        # a single noisy trial must not switch it away from overlap.
        def inverted(i: int) -> int:
            return sum(b >= a for b in self._scores[i] for a in self._scores[0])

        clear = [i for i in med if i != 0 and med[i] < med[0] * (1 - self.margin)
                 and inverted(i) <= self.inversions]
        pick = min(clear, key=med.__getitem__) if clear else 0
        lines = [f"  {self._candidates[i].label()}: {1000 * med[i]:.1f} ms"
                 + ("  <- model" if i == 0 else "") + ("  <- kept" if i == pick else "")
                 for i in med]
        self.plan["schedule_trial_ms"] = {self._candidates[i].label(): 1000 * med[i]
                                          for i in med}
        self._finish(self._candidates[pick],
                     f"measured (median learner ms per iteration outside the rollout wait, "
                     f"{self.trial} iterations each):\n" + "\n".join(lines))

    def _finish(self, schedule: Any, trial_text: str) -> None:
        self.plane.set_schedule(schedule)
        self.done = True
        self.plan["schedule"] = schedule.label()
        if trial_text:
            self.explanation += "\n" + trial_text
        self.plan["schedule_explain"] = self.explanation


def _without_units(timings: Any, name: str, units: float) -> Any:
    """A copy of ``timings`` without the ``name`` records of granularity ``units``."""
    from conduit.timing import Timings

    out = Timings()
    out.add(r for n in timings.names() for r in timings.records(n)
            if n != name or r.units != units)
    return out


def make_plane(*, buffer: str, schedule: str, placement: str, mode: str,
               num_minibatches: int = 1, **plane_kw: Any
               ) -> tuple[Any, dict[str, Any], WarmupScheduleTuner | None]:
    """Build the :class:`~conduit.ExperienceDataPlane` for a buffer mode.

    ``buffer="inline"`` is the sequential baseline: pageable CPU memory, every operator on the
    caller's thread. ``buffer="conduit"`` takes ``schedule`` / ``placement``: ``"auto"``
    placement runs the planner (Eq. 1, Alg. 1) inside the plane; ``"auto"`` schedule starts
    from :func:`default_conduit_schedule` and lets :class:`WarmupScheduleTuner` apply the
    cost model's pick after a few iterations.

    Returns:
        The plane, a JSON-friendly description of its plan, and the tuner to step once per
        iteration (None when nothing is left to decide).
    """
    from conduit import ExperienceDataPlane, Schedule

    if buffer not in ("inline", "conduit"):
        raise ValueError(f"buffer: must be 'inline' or 'conduit', got {buffer!r}")
    learner_device = torch.device(plane_kw.get("learner_device", "cpu"))
    if buffer == "inline":
        plane = ExperienceDataPlane(
            mode=mode, num_minibatches=num_minibatches, placement=None,
            schedule=Schedule.inline(num_minibatches=num_minibatches if mode == "on_policy"
                                     else 1), **plane_kw)
        return plane, describe_plan(plane, buffer=buffer), None
    sched = parse_schedule(schedule)
    place = parse_placement(placement, learner_device)
    sampler = plane_kw.get("sampler")
    prioritized = sampler == "prioritized" or type(sampler).__name__ == "PrioritizedSampler"
    auto_sched = sched == "auto"
    plane = ExperienceDataPlane(mode=mode, num_minibatches=num_minibatches,
                                schedule=None if auto_sched else sched, placement=place,
                                **plane_kw)
    if auto_sched:  # the finest feasible ingestion step (one rollout unit when they are given)
        plane.set_schedule(default_conduit_schedule(mode, num_minibatches,
                                                    prioritized=prioritized,
                                                    g_ing=min(plane.space.g_ing)))
    plan = describe_plan(plane, buffer=buffer)
    if plane.placement_decision is not None:
        plan["placement_plan"] = plane.placement_decision.explain()
    tuner = WarmupScheduleTuner(plane, plan, prioritized=prioritized) if auto_sched else None
    return plane, plan, tuner


def describe_plan(plane: Any, *, buffer: str) -> dict[str, Any]:
    """The schedule and placement a plane actually runs, as plain data."""
    out: dict[str, Any] = {"buffer": buffer}
    sched = getattr(plane, "schedule", None)
    place = getattr(plane, "placement", None)
    out["schedule"] = sched.label() if hasattr(sched, "label") else str(sched)
    if place is None and hasattr(plane, "buffer"):
        place = getattr(plane.buffer, "placement", None)
    out["placement"] = place.label() if hasattr(place, "label") else str(place or "pageable")
    spec = getattr(plane, "spec", None)
    if spec is not None:
        out["bytes_per_sample"] = spec.bytes_per_sample
    for name in ("plan", "schedule_plan", "placement_plan"):  # the plane's own explanation
        extra = getattr(plane, name, None)
        if extra is not None and not callable(extra):
            out[name] = extra.to_dict() if hasattr(extra, "to_dict") else str(extra)
    return out


@dataclass
class IterationRecord:
    """One iteration's breakdown (seconds) and training metrics."""

    iteration: int
    end_to_end: float
    rollout: float
    ingestion: float
    delivery: float
    update: float
    other: float
    env_steps: int
    learning: bool
    wall_time: float
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def exposed(self) -> float:
        """Exposed experience-path time: exposed ingestion + exposed delivery."""
        return self.ingestion + self.delivery


class BreakdownRecorder:
    """Turns the plane's timings into one :class:`IterationRecord` per iteration.

    Args:
        plane: The plane whose ``timings`` hold ``rollout``/``update``/``push``/``pull``.
        total_iters: For the progress line.
        log_every: Print a progress line every this many iterations (0: never).
        label: Prefix of the progress line.
    """

    _NAMES = {"rollout": "rollout", "ingestion": "push", "delivery": "pull", "update": "update"}

    def __init__(self, plane: Any, *, total_iters: int, log_every: int = 1,
                 label: str = "") -> None:
        self.plane = plane
        self.total_iters = total_iters
        self.log_every = log_every
        self.label = label
        self.records: list[IterationRecord] = []
        self.returns: list[tuple[int, float, float]] = []  # (iteration, wall, episode return)
        self._t_start = time.perf_counter()
        self._t0 = 0.0
        self._base: dict[str, float] = {}

    def _totals(self) -> dict[str, float]:
        t = self.plane.timings
        out = {k: t.total(v) for k, v in self._NAMES.items()}
        # Pushes made on the actor port's thread are not the learner's time; its wait for
        # them after the last unit arrived is (see rollout_and_push).
        out["ingestion"] += t.total("push_wait") - t.total("push_offthread")
        return out

    @contextmanager
    def iteration(self, i: int) -> Iterator[dict[str, Any]]:
        """Wrap one iteration; the body fills the yielded dict (``env_steps``, ``learning``,
        ``returns``, and any float metrics)."""
        self._base = self._totals()
        self._t0 = time.perf_counter()
        info: dict[str, Any] = {}
        yield info
        wall = time.perf_counter() - self._t0
        now = self._totals()
        part = {k: max(0.0, now[k] - self._base[k]) for k in self._NAMES}
        other = max(0.0, wall - sum(part.values()))
        elapsed = time.perf_counter() - self._t_start
        for r in info.pop("returns", []):
            self.returns.append((i, elapsed, float(r)))
        metrics = {k: float(v) for k, v in info.items()
                   if k not in ("env_steps", "learning") and isinstance(v, (int, float))}
        rec = IterationRecord(i, wall, part["rollout"], part["ingestion"], part["delivery"],
                              part["update"], other, int(info.get("env_steps", 0)),
                              bool(info.get("learning", True)), elapsed, metrics)
        self.records.append(rec)
        if self.log_every and ((i + 1) % self.log_every == 0 or i + 1 == self.total_iters):
            self._progress(rec)

    def recent_return(self, window: int = 20) -> float:
        """Mean of the last ``window`` finished episodes' returns (NaN before any)."""
        recent = [r for _, _, r in self.returns[-window:]]
        return sum(recent) / len(recent) if recent else float("nan")

    def _progress(self, rec: IterationRecord) -> None:
        ms = lambda s: f"{1000 * s:6.1f}"  # noqa: E731
        extra = " ".join(f"{k} {v:.3g}" for k, v in rec.metrics.items())
        print(f"{self.label}iter {rec.iteration + 1:>4}/{self.total_iters} "
              f"| return {self.recent_return():7.1f} | ms: rollout {ms(rec.rollout)} "
              f"ing {ms(rec.ingestion)} del {ms(rec.delivery)} update {ms(rec.update)} "
              f"e2e {ms(rec.end_to_end)} | {extra}", flush=True)

    def summary(self, *, skip: int = 1) -> dict[str, float]:
        """Median per-iteration breakdown over learning iterations (the first ``skip`` of them
        dropped as warm-up)."""
        out = summarize_records([self.records], skip=skip)
        out["final_return"] = self.recent_return()
        return out


def summarize_records(runs: Sequence[Sequence[IterationRecord]], *, skip: int = 1
                      ) -> dict[str, float]:
    """Median per-iteration breakdown over the learning iterations of one or more runs of the
    same configuration, the first ``skip`` learning iterations of each run dropped."""
    recs: list[IterationRecord] = []
    for records in runs:
        learning = [r for r in records if r.learning]
        recs += learning[skip:] or learning or list(records)
    if not recs:
        raise ValueError("summarize_records: no iterations recorded")
    out = {k: statistics.median(getattr(r, k) for r in recs)
           for k in (*PHASES, "end_to_end", "exposed")}
    out["iterations_measured"] = len(recs)
    return out


@dataclass
class RunResult:
    """What a training run returns and writes to JSON."""

    algo: str
    env: str
    buffer: str
    plan: dict[str, Any]
    summary: dict[str, float]
    records: list[IterationRecord]
    returns: list[tuple[int, float, float]]
    config: dict[str, Any]
    losses_finite: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"algo": self.algo, "env": self.env, "buffer": self.buffer, "plan": self.plan,
                "summary": _finite(self.summary), "config": _finite(self.config),
                "losses_finite": self.losses_finite,
                "iterations": [_finite({**dataclasses.asdict(r), "exposed": r.exposed})
                               for r in self.records],
                "returns": [{"iteration": i, "wall_s": w, "return": r}
                            for i, w, r in self.returns]}


def _finite(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _finite(v) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return [_finite(v) for v in d]
    if isinstance(d, float) and not math.isfinite(d):
        return None
    return d


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON (NaN/inf become null), creating parent folders."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_finite(data), indent=2, default=str))
    return p


def plot_breakdown(results: dict[str, dict[str, float]], path: str | Path, *,
                   title: str = "") -> Path:
    """Stacked per-iteration breakdown bars, one per run (Fig. 1 style).

    Args:
        results: Label -> summary (``rollout``, ``ingestion``, ``delivery``, ``update``,
            ``other`` in seconds).
        path: PNG to write.
        title: Figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.6 * len(labels)))
    for row, label in enumerate(labels):
        s = results[label]
        left = 0.0
        total = sum(s.get(p, 0.0) for p in PHASES) or 1.0
        for p in PHASES:
            w = 1000 * s.get(p, 0.0)
            ax.barh(row, w, left=left, color=PHASE_COLORS[p], label=p if row == 0 else None)
            if w / (1000 * total) > 0.08:
                ax.text(left + w / 2, row, f"{100 * w / (1000 * total):.0f}%",
                        ha="center", va="center", fontsize=8, color="white")
            left += w
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("latency per iteration (ms, median)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return p


def plot_comparison(rows: dict[str, dict[str, dict[str, float]]], path: str | Path) -> Path:
    """Fig. 11 style: per workload, inline vs Conduit bars for exposed path and end to end.

    Args:
        rows: Workload label -> {"inline": summary, "conduit": summary}.
        path: PNG to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, axes = plt.subplots(1, 2, figsize=(max(6, 1.6 * len(names) + 2) * 2 / 1.5, 3.6))
    for ax, key, title in ((axes[0], "exposed", "Exposed experience path"),
                           (axes[1], "end_to_end", "End to end")):
        for j, (mode, color) in enumerate((("inline", "#8c8c8c"), ("conduit", "#C44E52"))):
            xs = [i + (j - 0.5) * 0.38 for i in range(len(names))]
            ys = [1000 * rows[n].get(mode, {}).get(key, 0.0) for n in names]
            ax.bar(xs, ys, width=0.38, color=color,
                   label="inline (sequential)" if mode == "inline" else "Conduit")
        for i, n in enumerate(names):
            a = rows[n].get("inline", {}).get(key)
            b = rows[n].get("conduit", {}).get(key)
            if a and b is not None and a > 0:
                ax.text(i, 1000 * max(a, b) * 1.02, f"-{100 * (1 - b / a):.0f}%",
                        ha="center", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.set_ylabel("latency per iteration (ms)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p


def buffer_order(round_index: int) -> tuple[str, str]:
    """The two buffer modes in the order round ``round_index`` runs them: inline first in even
    rounds, Conduit first in odd ones (A B B A ...), so a shared machine's drift lands on both
    modes alike."""
    return ("inline", "conduit") if round_index % 2 == 0 else ("conduit", "inline")


def reduction(before: float, after: float) -> float:
    """Relative reduction ``1 - after/before`` (NaN when ``before`` is not positive)."""
    return 1.0 - after / before if before > 0 else float("nan")


def quiet_readonly_warning() -> None:
    """Ray hands back read-only numpy views; the plane copies them once, so the warning that
    torch raises on wrapping them is noise here."""
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def all_finite(values: list[float]) -> bool:
    """True when every value is a finite float."""
    return all(math.isfinite(v) for v in values)


def eprint(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def transition_spec(info: Any) -> Any:
    """Spec of an off-policy transition ``(s, a, r, s', done)`` for an environment, with the
    image payload (``pixels`` / ``next_pixels``) when the environment has one."""
    from conduit import ExperienceSpec

    if info.discrete:
        action = ((), torch.int64)
    else:
        action = ((info.action_dim,), torch.float32)
    fields: dict[str, Any] = {"obs": ((info.obs_dim,), torch.float32), "action": action,
                              "reward": ((), torch.float32),
                              "next_obs": ((info.obs_dim,), torch.float32),
                              "done": ((), torch.bool)}
    if info.image_size:
        img = ((info.image_size, info.image_size, 3), torch.uint8)
        fields["pixels"] = img
        fields["next_pixels"] = img
    return ExperienceSpec.of(**fields)


def cpu_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of ``module``'s ``state_dict`` for broadcasting to actors."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def pixels_of(batch: dict[str, torch.Tensor], key: str = "pixels") -> torch.Tensor | None:
    """The image field of a batch, or None for state-only workloads."""
    return batch.get(key)


def rollout_and_push(plane: Any, actors: Any, num_steps: int,
                     weights: dict[str, torch.Tensor] | None, params: dict[str, Any] | None = None,
                     *, on_policy: bool = False, fragments: int = 1) -> dict[str, Any]:
    """One actor-rollout phase: every actor produces ``fragments`` rollout units of
    ``num_steps`` steps each, back to back; each unit is pushed through the plane's actor port
    as soon as it is collected, in (fragment, actor) order, so batches never depend on which
    actor finished first. While fragment k is pushed, the actors already step fragment k+1
    (like RLlib's rollout fragments), in both buffer modes.

    Who pushes depends on the schedule. With inline ingestion (the sequential baseline) the
    learner's thread collects and pushes every unit itself. With overlapped ingestion the
    actor port receives the units on a thread of its own, so the learner's thread only waits
    for the actors and then for the last push to return.

    Timing records: the learner's wait for the actors is ``"rollout"``, one record per unit
    (the per-unit ``T_rollout`` the cost model reads). Time inside ``push`` is the plane's own
    ``"push"`` record; pushes made by the port's thread are also recorded as
    ``"push_offthread"``, and the learner's wait for them after the last unit arrived as
    ``"push_wait"`` (see :class:`BreakdownRecorder`).

    Returns:
        ``rows`` pushed and the finished ``episode_returns``.
    """
    t0 = time.perf_counter()
    # Ray runs an actor's calls in order, so all fragments can be queued at once; the weights
    # travel with the first.
    handles = [h for k in range(fragments)
               for h in actors.submit(num_steps, weights if k == 0 else None, params)]
    got: dict[str, Any] = {"rows": 0, "episode_returns": [], "waited": time.perf_counter() - t0}

    def receive(offthread: bool) -> None:
        for h in handles:
            t1 = time.perf_counter()
            out = actors.result(h)
            got["arrived"] = time.perf_counter()
            got["waited"] += got["arrived"] - t1
            version = {"policy_version": plane.policy_version} if on_policy else {}
            t2 = time.perf_counter()
            plane.push(out["rollout"], **version)
            if offthread:
                plane.timings.record("push_offthread", time.perf_counter() - t2, start=t2)
            got["rows"] += out["stats"]["rows"]
            got["episode_returns"] += out["stats"]["episode_returns"]

    if plane.schedule.overlap_ing:
        _run_port_thread(receive)
        waited = got["arrived"] - t0  # the learner's thread waited for the actors until here
        plane.timings.record("push_wait", time.perf_counter() - got["arrived"],
                             start=got["arrived"])
    else:
        receive(offthread=False)
        waited = got["waited"]
    for _ in handles:
        plane.timings.record("rollout", waited / len(handles), start=t0)
    return {"rows": got["rows"], "episode_returns": got["episode_returns"]}


def _run_port_thread(receive: Callable[[bool], None]) -> None:
    """Run ``receive(True)`` on the actor port's thread; re-raise what it raised."""
    failure: list[BaseException] = []

    def body() -> None:
        try:
            receive(True)
        except BaseException as exc:  # handed to the learner's thread below
            failure.append(exc)

    port = threading.Thread(target=body, name="conduit-actor-port", daemon=True)
    port.start()
    port.join()
    if failure:
        raise failure[0]
