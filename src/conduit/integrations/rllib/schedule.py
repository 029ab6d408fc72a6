"""The plane schedule of Conduit's RLlib replay buffers, and the tuner behind ``"auto"``.

RLlib's DQN and SAC call the buffer in a fixed loop: ``add`` the env runners' episodes,
``sample`` a batch, update the learner, ``update_priorities``. From the buffer's side, the
time from a ``sample`` returning to the next ``add`` is the learner window a prefetched draw
can hide behind (the priority update and the env runners' sampling included), and the
interval from one ``sample`` call to the next is one training iteration.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from conduit import ExperienceDataPlane, Schedule
from conduit.errors import ConfigError
from conduit.plane import WarmupScheduleTuner, tuning_space
from conduit.scheduling import spare_core, start_schedule

ScheduleName = Literal["auto", "inline", "prefetch"]
"""The ``"schedule"`` key of ``replay_buffer_config``."""

#: Coarsest delivery granularity a plane may use: a prefetched batch is drawn at most this
#: many ``add`` calls before it is sampled.
G_MAX = 2


@dataclass(frozen=True)
class _Iteration:
    """One sample-to-sample interval, as the tuner reads it (no separate rollout wait: the
    env runners' time is part of the learner window)."""

    learning: bool
    end_to_end: float
    rollout: float = 0.0


class ReplaySchedule:
    """Puts a buffer's plane on the schedule ``name`` asks for and, for ``"auto"``, steps a
    :class:`~conduit.plane.tuner.WarmupScheduleTuner` once per ``sample``.

    * ``"inline"``: every draw on the caller's thread, inside ``sample``.
    * ``"prefetch"``: the next batch is drawn on the delivery worker, one batch ahead.
    * ``"auto"``: where a worker thread would have a core of its own
      (:func:`worker_has_core`, with a CUDA device taken as the learner's), starts on
      :func:`~conduit.scheduling.start_schedule` (ingestion and delivery overlapped) and
      keeps or drops overlap over the first iterations, by their measured time.
      Prioritized buffers are tuned alike: the batch that a priority update discards is
      drawn again while RLlib's env runners sample, and the trial measures that; their
      delivery stays one batch per invocation (:func:`~conduit.plane.tuning_space`), since
      the update would discard the rest of a coarser one. Where a worker would have no
      core, ``"inline"``, untried (``report["note"]`` says so): a worker only takes CPU
      time from the update there, and a few noisy training steps do not show what that
      costs.

    Args:
        name: One of :data:`ScheduleName`.

    Raises:
        ConfigError: ``name`` is not one of them.
    """

    def __init__(self, name: str) -> None:
        if name not in get_args(ScheduleName):
            raise ConfigError("schedule", f"must be one of {get_args(ScheduleName)}, got "
                                          f"{name!r}")
        self.name = name
        #: The ``"auto"`` decision as plain data (filled by the tuner).
        self.report: dict[str, object] = {}
        self._tuner: WarmupScheduleTuner | None = None
        self._called: float | None = None  # when the last sample() started
        self._done: float | None = None  # ... and returned
        self._window: float | None = None  # from its return to the next add()

    @property
    def deciding(self) -> bool:
        """Whether ``"auto"`` is still trying schedules."""
        return self._tuner is not None

    def apply(self, plane: ExperienceDataPlane, decided: Schedule | None = None) -> None:
        """Put a new ``plane`` on ``decided`` (a schedule ``"auto"`` chose for the plane it
        replaces) or on the schedule :attr:`name` starts with."""
        self._tuner = None
        if decided is None and self.name == "auto" and worker_has_core(
                accelerator=torch.cuda.is_available()):
            decided = start_schedule(tuning_space(plane))
            self._tuner = WarmupScheduleTuner(plane, self.report)
        elif decided is None:  # "inline", "prefetch", or "auto" where a worker has no core
            decided = Schedule(0, 1, int(self.name == "prefetch"), 1)
            if self.name == "auto":
                self.report.update(schedule=decided.label(), note=(
                    f"inline, untried: the learner computes on all {os.cpu_count() or 1} "
                    f"cores ({torch.get_num_threads()} torch threads, no CUDA device), so a "
                    "worker thread would have no core of its own"))
        plane.set_schedule(decided)

    def keep(self, plane: ExperienceDataPlane) -> Schedule | None:
        """The schedule a plane replacing ``plane`` starts on (None: start over)."""
        return None if self.deciding else plane.schedule

    def adding(self) -> None:
        """An ``add`` starts: the learner window since the last sample ends."""
        if self._done is not None and self._window is None:
            self._window = time.perf_counter() - self._done

    def sampling(self, plane: ExperienceDataPlane) -> None:
        """A ``sample`` starts: record the interval since the last one in the plane's timings
        (``"update"``: the learner window; ``"rollout"``: 0) and step the tuner, which may
        switch the plane's schedule."""
        now = time.perf_counter()
        if self._done is not None and self._called is not None:
            window = self._window if self._window is not None else now - self._done
            plane.timings.record("update", window)
            plane.timings.record("rollout", 0.0)
            if self._tuner is not None:
                self._tuner.step(_Iteration(True, now - self._called))
                if self._tuner.done:
                    self._tuner = None
        self._called, self._window = now, None

    def sampled(self) -> None:
        """A ``sample`` returned."""
        self._done = time.perf_counter()


def worker_has_core(*, accelerator: bool) -> bool:
    """Whether a plane worker thread in this process has a core of its own beside RLlib's
    learner (:func:`~conduit.scheduling.spare_core`): the learner computes on an
    accelerator, or on the CPU with fewer of this process's torch threads than cores.

    Args:
        accelerator: Whether the learner computes on an accelerator. PPO's learner knows its
            device; the replay buffers, which live in the Algorithm's process but cannot see
            the learner's device, take a machine with a CUDA device as one whose learner
            computes there.
    """
    return spare_core(cores=os.cpu_count() or 1, compute_threads=torch.get_num_threads(),
                      accelerator=accelerator)
