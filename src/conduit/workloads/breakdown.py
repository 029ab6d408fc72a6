"""The per-iteration latency breakdown of a training run (Fig. 1 / Fig. 11 style), its
summaries, and the comparison of inline and Conduit runs.

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
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conduit import ExperienceDataPlane
from conduit.report import finite
from conduit.workloads.args import TrainerArgs

if TYPE_CHECKING:
    from conduit.workloads.actors import ActorGroup

PHASES = ("rollout", "ingestion", "delivery", "update", "other")


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

    #: The recorder :meth:`for_run` made last: what an interrupted run had recorded.
    latest: BreakdownRecorder | None = None

    def __init__(self, plane: ExperienceDataPlane, *, total_iters: int, log_every: int = 1,
                 label: str = "") -> None:
        self.plane = plane
        self.total_iters = total_iters
        self.log_every = log_every
        self.label = label
        self.records: list[IterationRecord] = []
        self.returns: list[tuple[int, float, float]] = []  # (iteration, wall, episode return)
        self._t_start = time.perf_counter()

    @classmethod
    def for_run(cls, plane: ExperienceDataPlane, args: TrainerArgs, *,
                algo: str) -> BreakdownRecorder:
        """A recorder for ``args.iters`` iterations of ``algo``, its progress line every
        ``args.log_every``."""
        rec = cls(plane, total_iters=args.iters, log_every=args.log_every,
                  label=f"[{algo} {args.buffer}] ")
        BreakdownRecorder.latest = rec
        return rec

    def to_json(self) -> dict[str, object]:
        """The iterations and episode returns recorded so far, as :meth:`RunResult.to_json`
        writes them."""
        return {"iterations": [finite({**dataclasses.asdict(r), "exposed": r.exposed})
                               for r in self.records],
                "returns": [{"iteration": i, "wall_s": w, "return": r}
                            for i, w, r in self.returns]}

    def _totals(self) -> dict[str, float]:
        t = self.plane.timings
        out = {k: t.total(v) for k, v in self._NAMES.items()}
        # Pushes made on the actor port's thread are not the learner's time; its wait for
        # them after the last unit arrived is (see conduit.workloads.actor_port).
        out["ingestion"] += t.total("push_wait") - t.total("push_offthread")
        return out

    @contextmanager
    def iteration(self, i: int) -> Iterator[dict[str, Any]]:
        """Wrap one iteration; the body fills the yielded dict (``env_steps``, ``learning``,
        ``returns``, and any float metrics)."""
        base = self._totals()
        t0 = time.perf_counter()
        info: dict[str, Any] = {}
        yield info
        wall = time.perf_counter() - t0
        now = self._totals()
        part = {k: max(0.0, now[k] - base[k]) for k in self._NAMES}
        other = max(0.0, wall - sum(part.values()))
        elapsed = time.perf_counter() - self._t_start
        self.returns += [(i, elapsed, float(r)) for r in info.pop("returns", [])]
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
    same configuration, the first ``skip`` learning iterations of each run dropped.

    Raises:
        ValueError: No iteration was recorded.
    """
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
    """What a training run returns and writes to JSON.

    ``rollouts_lost`` counts the rollouts that dead Ray actors did not deliver (each collected
    again from the actor re-created in its place), ``actors_restarted`` the re-created actors.
    ``updates`` counts the learner's gradient steps and ``learning_iterations`` the iterations
    in which it trained; with no update, ``losses_finite`` holds vacuously and the JSON log
    writes it as null. ``diverged`` says why a diverging run stopped early (a loss or the
    policy's output in a rollout was not finite, see
    :data:`~conduit.workloads.learner.LOSS_NOT_FINITE` and
    :func:`~conduit.workloads.learner.policy_not_finite`), and is empty when it did not.
    """

    algo: str
    env: str
    buffer: str
    plan: dict[str, object]
    summary: dict[str, float]
    records: list[IterationRecord]
    returns: list[tuple[int, float, float]]
    config: dict[str, object]
    losses_finite: bool = True
    rollouts_lost: int = 0
    actors_restarted: int = 0
    updates: int = 0
    learning_iterations: int = 0
    diverged: str = ""

    @classmethod
    def of(cls, algo: str, args: TrainerArgs, plan: dict[str, object],
           recorder: BreakdownRecorder, losses: Sequence[float], actors: ActorGroup, *,
           updates: int | None = None, diverged: str = "") -> RunResult:
        """The result of a finished run: the recorder's breakdown, whether every loss was
        finite, the learner's gradient steps (``updates``, one per loss by default), the
        rollouts the actors lost, and why the run stopped early if it diverged
        (``diverged``)."""
        updates = len(losses) if updates is None else updates
        learning = sum(r.learning for r in recorder.records) if updates else 0
        return cls(algo, args.env, args.buffer, plan, recorder.summary(), recorder.records,
                   recorder.returns, dataclasses.asdict(args),
                   all(math.isfinite(v) for v in losses), actors.rollouts_lost,
                   actors.actors_restarted, updates, learning, diverged)

    def to_json(self) -> dict[str, object]:
        """JSON-friendly form (non-finite floats become None)."""
        return {"algo": self.algo, "env": self.env, "buffer": self.buffer, "plan": self.plan,
                "summary": finite(self.summary), "config": finite(self.config),
                "losses_finite": self.losses_finite if self.updates else None,
                "diverged": self.diverged or None,
                "updates": self.updates, "learning_iterations": self.learning_iterations,
                "rollouts_lost": self.rollouts_lost,
                "actors_restarted": self.actors_restarted,
                "iterations": [finite({**dataclasses.asdict(r), "exposed": r.exposed})
                               for r in self.records],
                "returns": [{"iteration": i, "wall_s": w, "return": r}
                            for i, w, r in self.returns]}


def buffer_order(round_index: int) -> tuple[str, str]:
    """The two buffer modes in the order round ``round_index`` runs them: inline first in even
    rounds, Conduit first in odd ones (A B B A ...), so a shared machine's drift lands on both
    modes alike."""
    return ("inline", "conduit") if round_index % 2 == 0 else ("conduit", "inline")


def reduction(before: float, after: float) -> float:
    """Relative reduction ``1 - after/before`` (NaN when ``before`` is not positive)."""
    return 1.0 - after / before if before > 0 else float("nan")
