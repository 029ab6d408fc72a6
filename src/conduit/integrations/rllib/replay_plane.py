"""The plane under a Conduit RLlib replay buffer, kept in step with its episode links.

:class:`ReplayPlane` owns the plane, the window sampler that draws its rows and the
:class:`~conduit.integrations.rllib.episode_rows.EpisodeRows` that link each row to its
episode. It builds the plane on the first add (with the delivery operator that lays the n-step
windows), rebuilds it over the same store for another batch size, writes the rows of added
episodes and links them once they are in the ring, and restores all of it from a state.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils import force_list

from conduit import ExperienceDataPlane, ExperienceSpec, Schedule
from conduit.errors import EmptyBufferError, OperatorError, PlaneClosedError, SpecError, StateError
from conduit.integrations.rllib.episode_rows import Appended, EpisodeRows, Read
from conduit.integrations.rllib.schedule import G_MAX, ReplaySchedule
from conduit.integrations.rllib.windows import WindowSampler, deliver_windows
from conduit.plane import BufferIn, LearnerOut
from conduit.storage import Placement, Sampler, Store

#: Called with what an add (or the settling of an earlier one) linked.
OnAdded = Callable[[Appended], None]


def _despite_draws(plane: ExperienceDataPlane, call: Callable[[], None]) -> None:
    """``call()`` (a push or flush), again after a delivery failure latched on ``plane``: a
    draw made ahead only reads rows, so its failure is the concern of the sample that pulls
    it, never of the add writing rows (a push that raises stores nothing, so a retry stores
    its rows once)."""
    for tries in range(3):
        failed = plane.failed
        if failed is not None and failed.operator == "delivery":
            plane.recover()
        try:
            call()
            return
        except OperatorError as exc:
            if exc.operator != "delivery" or tries == 2:
                raise


def _single_agent(episodes: Any) -> list[SingleAgentEpisode]:
    """``episodes`` as a list of ``SingleAgentEpisode`` objects.

    Raises:
        SpecError: An item is not a ``SingleAgentEpisode`` (field None).
    """
    episodes = force_list(episodes)
    for eps in episodes:
        if not isinstance(eps, SingleAgentEpisode):
            multi = "MultiAgent" in type(eps).__name__
            raise SpecError(None, f"add takes SingleAgentEpisode objects (or a list "
                                  f"of them), got {type(eps).__name__}" + (
                "; Conduit's RLlib buffers are single-agent: for multi-agent "
                "episodes use RLlib's MultiAgentEpisodeReplayBuffer or "
                "MultiAgentPrioritizedEpisodeReplayBuffer" if multi else ""))
    return episodes


class ReplayPlane:
    """A replay buffer's plane, window sampler and episode links, changed together.

    Not safe for calls from several threads at once (as the buffer that owns it); the plane's
    own workers, which draw ahead, read the links under ``rows.lock``.

    Args:
        capacity: Timesteps held.
        seed: Seed of the plane.
        placement: Where the rows live (see the buffer's ``placement``).
        schedule: The buffer's schedule, applied to every plane built.
        inner: The sampler of rows the window sampler draws with.

    Attributes:
        rows: The episode links of the rows.
        sampler: The window sampler the plane draws with.
        plane: The plane (None until the first add with timesteps).
    """

    def __init__(self, capacity: int, *, seed: int, placement: Placement | Literal["auto"] | None,
                 schedule: ReplaySchedule, inner: Sampler) -> None:
        self.capacity, self.seed, self.placement, self.schedule = (
            capacity, seed, placement, schedule)
        self.rows = EpisodeRows(capacity)
        self.sampler = WindowSampler(inner, self.rows)
        self.plane: ExperienceDataPlane | None = None
        self._acknowledged = 0
        # An add whose rows were all pushed but not yet stored when its flush raised: its
        # chunks and the ring rows before it, linked by settle.
        self._unsettled: tuple[Read, int] | None = None

    def close(self) -> Schedule | None:
        """Close the plane (if any); returns the schedule a plane replacing it starts on."""
        plane, self.plane = self.plane, None
        if plane is None:
            return None
        decided = self.schedule.keep(plane)
        plane.close()
        return decided

    def build(self, spec: ExperienceSpec, batch_size: int, decided: Schedule | None = None,
              store: Store | None = None) -> ExperienceDataPlane:
        """A plane for ``spec`` on ``decided`` (None: the schedule :attr:`schedule` starts
        with), in ``store`` if given; :attr:`plane` is left as it is."""
        plane = ExperienceDataPlane(spec=spec, capacity=self.capacity,
                                    batch_size=min(batch_size, self.capacity), min_size=1,
                                    sampler=self.sampler, placement=self.placement,
                                    seed=self.seed, g_max=G_MAX, store=store)

        # The operator holds the plane and the buffer weakly: the plane's engine holds the
        # operator until the plane is dropped, so strong references would keep both alive,
        # with the plane's worker threads, after the buffer is gone.
        owner, sampler = weakref.ref(plane), self.sampler

        def gather_obs(slots: np.ndarray) -> torch.Tensor:
            live = owner()
            if live is None:
                raise PlaneClosedError("the buffer's plane was dropped")
            return live.buffer.gather(torch.from_numpy(slots))["obs"]

        @plane.register_delivery()
        def n_step_windows(exp_in: BufferIn, learn_out: LearnerOut) -> None:
            learn_out.write(deliver_windows(sampler, exp_in.read(), gather_obs))

        self.schedule.apply(plane, decided)
        return plane

    def for_batch_size(self, batch_size: int) -> ExperienceDataPlane:
        """The plane, rebuilt with its rows when a sample asks for another batch size.

        Raises:
            EmptyBufferError: There is no plane yet (nothing was added).
        """
        plane = self.plane
        if plane is None:
            raise EmptyBufferError("cannot sample: nothing was added to the buffer")
        if plane.batch_size != batch_size:  # (sample checked batch_size against capacity)
            # The rows stay where they are: the new plane takes over the store.
            state, spec, store = plane.state_dict(rows=False), plane.spec, plane.buffer.store
            plane = self.build(spec, batch_size, self.close(), store=store)
            plane.load_state_dict(state, rows=False)
            self.plane = plane
        return plane

    def add(self, episodes: Any, batch_size: int, on_added: OnAdded) -> None:
        """Write every timestep of ``episodes`` to the plane (built for ``batch_size`` on the
        first add with timesteps) and link them; ``on_added`` gets what each link changed.

        See the buffer's ``add`` for what is linked when a write raises.

        Raises:
            SpecError: See the buffer's ``add``.
        """
        self.schedule.adding()
        with self.rows.lock:  # a delivery running ahead sees links and ring change at once
            self._settle_locked(on_added)
            episodes = _single_agent(episodes)
            read = self.rows.read(
                episodes, spec=None if self.plane is None else self.plane.spec)
            if read.steps:
                if self.plane is None:
                    assert read.spec is not None
                    self.plane = self.build(read.spec, batch_size)
                ring = self.sampler.ring_rows
                try:
                    self._write(self.plane, read.rows, read.steps)
                except BaseException:
                    if self.sampler.ring_rows - ring == read.steps:  # the rows are stored
                        on_added(self.rows.link(read))
                    elif self._acknowledged == read.steps:
                        # Every push returned, so the rows land (overlapped ingestion) after
                        # the flush that raised: they are linked once they have (settle);
                        # batches drawn meanwhile, over rows without links, are stale.
                        self._unsettled = (read, ring)
                        self.sampler.invalidate()
                    raise
            added = self.rows.link(read)
        on_added(added)

    def _write(self, plane: ExperienceDataPlane, rows: dict[str, np.ndarray],
               steps: int) -> None:
        """Push ``rows`` to ``plane`` and flush it; :attr:`_acknowledged` counts the rows of
        the pushes that returned."""
        self._acknowledged = 0
        for a in range(0, steps, self.capacity):
            part = {k: v[a:a + self.capacity] for k, v in rows.items()}
            _despite_draws(plane, lambda part=part: plane.push(part))
            self._acknowledged += len(part["obs"])
        _despite_draws(plane, plane.flush)

    def settle(self, on_added: OnAdded) -> None:
        """Link the rows of an add whose flush raised after every push returned, once they
        are all in the ring (flushing the plane first, within its timeout); ``on_added`` gets
        what the link changed.

        Raises:
            BackpressureTimeout: They are still not stored (as the add raised); so do the
                plane's other flush errors.
        """
        if self._unsettled is not None:
            with self.rows.lock:
                self._settle_locked(on_added)

    def _settle_locked(self, on_added: OnAdded) -> None:
        """:meth:`settle`, holding ``rows.lock``."""
        pending = self._unsettled
        if pending is None:
            return
        read, ring = pending
        if self.sampler.ring_rows - ring < read.steps and self.plane is not None:
            _despite_draws(self.plane, self.plane.flush)
        self._unsettled = None
        on_added(self.rows.link(read))
        self.sampler.invalidate()  # batches drawn before the link are stale

    def state_dict(self, batch_size: int) -> dict[str, Any]:
        """The plane's spec, batch size (``batch_size`` without a plane) and ``state_dict``
        (rows, sampler, ring), and the episode links."""
        plane = self.plane
        return {"spec": plane.spec.to_dict() if plane else None,
                "batch_size": plane.batch_size if plane else batch_size,
                "plane": plane.state_dict() if plane else None,
                "rows": self.rows.state_dict()}

    def load_state(self, state: dict[str, Any], spec: ExperienceSpec | None,
                   inner: Callable[[], Sampler]) -> None:
        """Restore :meth:`state_dict` (its ``spec`` read as ``spec``); a state without a plane
        starts a window sampler over ``inner()``, which has drawn nothing yet.

        Raises:
            StateError: The links do not cover the rows of the plane's ring. The plane's
                ``load_state_dict`` and the links' ``load_state_dict`` raise their own
                errors; either leaves a part loaded (the caller restores the whole).
        """
        decided = self.close()  # first: its delivery worker reads the links
        self._unsettled = None
        self.rows.load_state_dict(state["rows"])
        if spec is not None:
            plane = self.build(spec, state["batch_size"], decided)
            try:
                plane.load_state_dict(state["plane"])
            except BaseException:
                plane.close()
                raise
            self.plane = plane
        else:  # the state of a buffer that never held a row: so is the sampler
            self.sampler = WindowSampler(inner(), self.rows)
        if self.rows.written != self.sampler.ring_rows:
            raise StateError("rows.written", f"the links cover {self.rows.written} rows, the "
                                             f"plane's ring received {self.sampler.ring_rows}; "
                                             f"restore a state this buffer's get_state wrote")
