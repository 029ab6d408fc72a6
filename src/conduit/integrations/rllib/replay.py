"""RLlib's episode replay buffers, with Conduit's plane as their storage and sampler.

Added episodes become plane rows (:mod:`~conduit.integrations.rllib.episode_rows`); a sample is
one pull from the plane (several for more transitions than the capacity), whose sampler draws
the rows and whose delivery operator lays the n-step windows over them. What a sample returns is
what RLlib's buffer of the same name returns for the same arguments: a list of one-step
``SingleAgentEpisode`` objects holding the n-step transition, with ``n_step`` and ``weights``
in their ``extra_model_outputs``.

The plane's schedule is chosen by the ``"schedule"`` key of ``replay_buffer_config``:
``"inline"`` draws on the caller's thread inside ``sample``; ``"prefetch"`` draws the next
batch on the plane's delivery worker while RLlib updates the learner and samples its env
runners; ``"auto"`` (default) starts overlapped and keeps or drops prefetch over the first
training iterations, by their measured time (:mod:`~conduit.integrations.rllib.schedule`).
"""

# ruff: noqa: N803 (the keyword names are RLlib's: batch_size_B, batch_length_T)
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from ray.rllib.core import DEFAULT_AGENT_ID, DEFAULT_MODULE_ID
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils import force_list
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import (
    PrioritizedEpisodeReplayBuffer,
)
from ray.rllib.utils.typing import AgentID, ModuleID

from conduit import ExperienceDataPlane, ExperienceSpec, Schedule
from conduit._checks import check_int
from conduit.errors import (
    ConduitError,
    ConfigError,
    EmptyBufferError,
    OperatorError,
    PlaneClosedError,
    PriorityError,
    SpecError,
    StateError,
)
from conduit.integrations.rllib.episode_rows import Appended, EpisodeRows, NStep, Read
from conduit.integrations.rllib.episodes import SampledEpisodes
from conduit.integrations.rllib.metrics import CachedMetricsLogger
from conduit.integrations.rllib.schedule import G_MAX, ReplaySchedule, ScheduleName
from conduit.integrations.rllib.windows import (
    Transitions,
    WindowRequest,
    WindowSampler,
    deliver_windows,
)
from conduit.plane import BufferIn, LearnerOut
from conduit.storage import Placement, PrioritizedSampler, Sampler, Store, UniformSampler
from conduit.storage.state import entry


def _count(field: str, value: Any) -> int:
    """``value`` as a positive ``int``; a float with an integral value (``1e5``, as configs
    write capacities and RLlib's own buffers take) counts as that integer.

    Raises:
        ConfigError: It is not a positive integer (field ``field``).
    """
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        value = int(value)
    return check_int(field, value, minimum=1)


def _holds_priorities(plane_state: Any) -> bool:
    """Whether a plane's state (in a buffer's :meth:`~ConduitEpisodeReplayBuffer.get_state`)
    is a prioritized sampler's: its windows' inner sampler keeps a sum tree."""
    state: Any = plane_state
    for key in ("buffer", "sampler", "inner"):
        if not isinstance(state, dict):
            return False
        state = state.get(key)
    return isinstance(state, dict) and "tree" in state


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


def _per_id(value: float) -> tuple[dict[AgentID, float], dict[ModuleID, float]]:
    return {DEFAULT_AGENT_ID: value}, {DEFAULT_MODULE_ID: value}


class ConduitEpisodeReplayBuffer(EpisodeReplayBuffer):
    """RLlib's ``EpisodeReplayBuffer`` (uniform sampling) over a Conduit plane.

    Usage: ``config.training(replay_buffer_config={"type":
    "conduit.integrations.rllib.ConduitEpisodeReplayBuffer", "capacity": 50_000})``.

    Capacity counts timesteps; once full, the oldest timestep is overwritten (RLlib evicts
    whole episodes instead). Sampling draws ``(o_t, a_t, Σ γ^k r_{t+k}, o_{t+n},
    terminated, truncated)`` transitions: for ``sample_episodes=True`` with
    ``batch_length_T=0``, the path DQN and SAC take. Infos are not stored (sampled episodes hold
    empty infos; ``sample`` refuses ``include_infos=True``), nor are ``extra_model_outputs``.
    Each observation is stored once: a row's next observation is the next row of its episode,
    or for the last stored row the episode's tail
    (:mod:`~conduit.integrations.rllib.episode_rows`). A sampled transition's ``t_started`` is
    its step's index in the stored episode, counted from the episode's first stored chunk, as
    in RLlib's buffers.

    A sample holds ``num_items`` transitions, drawn with replacement, more than ``capacity``
    included (the plane draws at most ``capacity`` rows a batch: such a sample joins several
    batches, and :meth:`ConduitPrioritizedEpisodeReplayBuffer.update_priorities` takes one
    priority per transition of the joined sample). Where RLlib's buffers differ:

    * RLlib's uniform buffer returns more than ``num_items`` transitions when windows miss
      three or more of their ``n`` steps at the end of the stored episode (its count steps
      back for each); this one returns ``num_items``.
    * Actions and observations come as NumPy values; RLlib returns them as the episode holds
      them, Python numbers for an episode built from lists and not numpy-ized (env runners
      add numpy-ized episodes, for which both agree).
    * A negative ``num_items`` is refused (RLlib returns no transition and lowers its count
      of sampled timesteps), as is ``n_step=0`` (RLlib's prioritized buffer takes it as 1,
      its uniform one fails), and a multi-agent episode (RLlib's single-agent buffers store
      it as an empty episode).

    As RLlib's, the buffer is not safe for calls from several threads at once: call ``add``,
    ``sample``, ``update_priorities``, ``get_state`` and ``set_state`` from one thread, as
    DQN and SAC do (the plane's own workers, which draw ahead, are synchronized with them).

    With ``schedule="prefetch"`` (or ``"auto"`` when it keeps prefetch), a batch may be drawn
    before the latest ``add`` calls (at most :data:`G_MAX` of them), so it may miss their
    rows; each of its transitions is what RLlib's buffer returns for its row when the batch
    was delivered, and importance weights are those of the draw. Batches drawn for other
    ``sample`` arguments (``n_step``, ``gamma``, ``beta``) are discarded, as are batches
    drawn before a priority update, and rows overwritten since their draw.

    Args:
        capacity: Timesteps held.
        batch_size_B: Transitions per sample when ``sample`` is not told.
        batch_length_T: Kept for RLlib; sequence sampling is not supported.
        alpha: Priority exponent (prioritized buffer).
        beta: Importance-weight exponent when ``sample`` gets ``beta=None``.
        eps: Added to every priority (prioritized buffer).
        seed: Seed of the sampler (None: a fresh one).
        schedule: ``"auto"``, ``"inline"`` or ``"prefetch"`` (see the module docstring).
        placement: Where the rows live: ``"auto"`` (Alg. 1 over this machine's topology,
            docs/design.md §4), a :class:`~conduit.storage.Placement`, or None (pageable CPU
            memory).
        metrics_num_episodes_for_smoothing: RLlib's metrics window.
        **kwargs: Further keys of ``replay_buffer_config``, ignored as RLlib does.

    Raises:
        ConfigError: ``capacity`` or ``batch_size_B`` is not a positive integer (a float
            with an integral value, such as ``1e5``, is taken as that integer), ``seed`` is
            neither None nor an integer >= 0, or ``alpha``, ``beta``, ``eps`` or
            ``schedule`` is out of range.
    """

    #: Whether rows are drawn by priority.
    prioritized: ClassVar[bool] = False

    def __init__(self, capacity: int = 10_000, *, batch_size_B: int = 16,
                 batch_length_T: int = 1, alpha: float = 1.0, beta: float = 0.0,
                 eps: float = 1e-6, seed: int | None = None, schedule: ScheduleName = "auto",
                 placement: Placement | Literal["auto"] | None = None,
                 metrics_num_episodes_for_smoothing: int = 100, **kwargs: Any) -> None:
        capacity = _count("capacity", capacity)
        batch_size = _count("batch_size_B", batch_size_B)
        if seed is not None:
            seed = check_int("seed", seed, minimum=0)
        EpisodeReplayBuffer.__init__(
            self, capacity=capacity, batch_size_B=batch_size, batch_length_T=batch_length_T,
            metrics_num_episodes_for_smoothing=metrics_num_episodes_for_smoothing)
        self.metrics = CachedMetricsLogger(root=False)  # RLlib's, with fewer steps per value
        #: The plane's schedule, and for ``"auto"`` its decision (``schedule.report``).
        self.schedule = ReplaySchedule(schedule)
        self.seed = int(np.random.SeedSequence(seed).generate_state(1)[0]) >> 1
        self.beta, self.placement = beta, placement
        self._alpha, self._eps = alpha, eps
        self._rows = EpisodeRows(capacity)
        self._sampler = self._new_sampler()
        self._plane: ExperienceDataPlane | None = None
        self._last_index: np.ndarray | None = None
        self._last_rows: np.ndarray | None = None  # their rows' numbers in the ring's order
        self._build = SampledEpisodes(prioritized=self.prioritized)
        self._acknowledged = 0
        # An add whose rows were all pushed but not yet stored when its flush raised: its
        # chunks and the ring rows before it, linked by _settle.
        self._unsettled: tuple[Read, int] | None = None
        #: Delivered batches thrown away: drawn for other arguments or overwritten rows.
        self.discarded_batches = 0

    @property
    def plane(self) -> ExperienceDataPlane | None:
        """The plane the rows live in (None until the first ``add``)."""
        return self._plane

    def _new_sampler(self) -> WindowSampler:
        """A sampler of windows over :attr:`_rows` that has drawn nothing yet."""
        inner: Sampler = (PrioritizedSampler(alpha=self._alpha, beta=self.beta, eps=self._eps,
                                             seed=self.seed)
                          if self.prioritized else UniformSampler(seed=self.seed))
        return WindowSampler(inner, self._rows)

    def _close_plane(self) -> Schedule | None:
        """Close the plane (if any); returns the schedule a plane replacing it starts on."""
        plane, self._plane = self._plane, None
        if plane is None:
            return None
        decided = self.schedule.keep(plane)
        plane.close()
        return decided

    def _build_plane(self, spec: ExperienceSpec, batch_size: int,
                     decided: Schedule | None = None, store: Store | None = None
                     ) -> ExperienceDataPlane:
        """A plane for ``spec`` on ``decided`` (None: the schedule :attr:`schedule` starts
        with), in ``store`` if given."""
        plane = ExperienceDataPlane(spec=spec, capacity=self.capacity,
                                    batch_size=min(batch_size, self.capacity), min_size=1,
                                    sampler=self._sampler, placement=self.placement,
                                    seed=self.seed, g_max=G_MAX, store=store)

        # The operator holds the plane and the buffer weakly: the plane's engine holds the
        # operator until the plane is dropped, so strong references would keep both alive,
        # with the plane's worker threads, after the buffer is gone.
        owner, sampler = weakref.ref(plane), self._sampler

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

    def _plane_for(self, batch_size: int) -> ExperienceDataPlane:
        """The plane, rebuilt with its rows when a sample asks for another batch size."""
        plane = self._plane
        if plane is None:
            raise EmptyBufferError("cannot sample: nothing was added to the buffer")
        if plane.batch_size != batch_size:  # (sample checked batch_size against capacity)
            # The rows stay where they are: the new plane takes over the store.
            state, spec, store = plane.state_dict(rows=False), plane.spec, plane.buffer.store
            plane = self._build_plane(spec, batch_size, self._close_plane(), store=store)
            plane.load_state_dict(state, rows=False)
            self._plane = plane
        return plane

    def add(self, episodes: list[SingleAgentEpisode] | SingleAgentEpisode) -> None:
        """Write every timestep of ``episodes`` to the plane; chunks of an episode already in
        the buffer continue it.

        The episodes are linked to the buffer's rows once their rows are in the plane: an add
        that raises before its rows are stored leaves links and rows as they were (except an
        add of more than ``capacity`` timesteps, written in several pushes, interrupted after
        the first). One whose flush raised (a timeout, an interrupt) after every push returned
        has its rows stored later by the plane: the next ``add``, ``sample`` or
        ``get_state`` links them first, waiting for them within the plane's timeout. A
        delivery failure latched on the plane (a draw made ahead, which only reads rows) does
        not fail the add.

        Raises:
            SpecError: An item is not a ``SingleAgentEpisode`` (field None; for a
                multi-agent episode the message names RLlib's multi-agent buffers), an
                observation or action differs in shape or dtype from earlier ones,
                is not numeric or belongs to a Tuple or Dict space, or a chunk of an ongoing
                episode does not start where its stored steps end (field ``t_started``).
        """
        self.schedule.adding()
        with self._rows.lock:  # a delivery running ahead sees links and ring change at once
            self._settle_locked()
            episodes = force_list(episodes)
            for eps in episodes:
                if not isinstance(eps, SingleAgentEpisode):
                    multi = "MultiAgent" in type(eps).__name__
                    raise SpecError(None, f"add takes SingleAgentEpisode objects (or a list "
                                          f"of them), got {type(eps).__name__}" + (
                        "; Conduit's RLlib buffers are single-agent: for multi-agent "
                        "episodes use RLlib's MultiAgentEpisodeReplayBuffer or "
                        "MultiAgentPrioritizedEpisodeReplayBuffer" if multi else ""))
            read = self._rows.read(
                episodes, spec=None if self._plane is None else self._plane.spec)
            if read.steps:
                if self._plane is None:
                    assert read.spec is not None
                    self._plane = self._build_plane(read.spec, self.batch_size_B)
                ring = self._sampler.ring_rows
                try:
                    self._write(self._plane, read.rows, read.steps)
                except BaseException:
                    if self._sampler.ring_rows - ring == read.steps:  # the rows are stored
                        self._added(self._rows.link(read))
                    elif self._acknowledged == read.steps:
                        # Every push returned, so the rows land (overlapped ingestion) after
                        # the flush that raised: they are linked once they have (_settle);
                        # batches drawn meanwhile, over rows without links, are stale.
                        self._unsettled = (read, ring)
                        self._sampler.invalidate()
                    raise
            added = self._rows.link(read)
        self._added(added)

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

    def _settle(self) -> None:
        """Link the rows of an add whose flush raised after every push returned, once they
        are all in the ring (flushing the plane first, within its timeout).

        Raises:
            BackpressureTimeout: They are still not stored (as the add raised); so do the
                plane's other flush errors.
        """
        if self._unsettled is not None:
            with self._rows.lock:
                self._settle_locked()

    def _settle_locked(self) -> None:
        """:meth:`_settle`, holding ``_rows.lock``."""
        pending = self._unsettled
        if pending is None:
            return
        read, ring = pending
        if self._sampler.ring_rows - ring < read.steps and self._plane is not None:
            _despite_draws(self._plane, self._plane.flush)
        self._unsettled = None
        self._added(self._rows.link(read))
        self._sampler.invalidate()  # batches drawn before the link are stale

    def _added(self, added: Appended) -> None:
        """Count and log what an add changed."""
        self._num_timesteps = len(self._rows)
        self._num_timesteps_added += added.steps
        self._num_episodes_evicted += added.evicted_episodes
        self._log_add(added)

    def _log_add(self, added: Appended) -> None:
        a_added, m_added = _per_id(added.new_episodes)
        a_steps, m_steps = _per_id(added.steps)
        a_evicted, m_evicted = _per_id(added.evicted_episodes)
        a_esteps, m_esteps = _per_id(added.evicted_steps)
        self._update_add_metrics(
            num_episodes_added=added.new_episodes, num_env_steps_added=added.steps,
            num_episodes_evicted=added.evicted_episodes,
            num_env_steps_evicted=added.evicted_steps,
            agent_to_num_episodes_added=a_added, agent_to_num_steps_added=a_steps,
            agent_to_num_episodes_evicted=a_evicted, agent_to_num_steps_evicted=a_esteps,
            module_to_num_episodes_added=m_added, module_to_num_steps_added=m_steps,
            module_to_num_episodes_evicted=m_evicted, module_to_num_steps_evicted=m_esteps)

    def sample(self, num_items: int | None = None, *, batch_size_B: int | None = None,
               batch_length_T: int | None = None, n_step: NStep | None = None,
               beta: float | None = None, gamma: float = 0.99, include_infos: bool = False,
               include_extra_model_outputs: bool = False, sample_episodes: bool = True,
               to_numpy: bool = False, lookback: int = 0, min_batch_length_T: int = 0,
               **kwargs: Any) -> list[SingleAgentEpisode]:
        """Sample ``num_items`` n-step transitions, each as a one-step episode.

        Args:
            num_items: Transitions (0 or None: the constructor's ``batch_size_B``, as in
                RLlib; a float with an integral value counts as that integer); more than
                ``capacity`` are drawn in several plane batches.
            batch_size_B: Same as ``num_items``.
            batch_length_T: Must be 0 or None (no sequence sampling; RLlib's prioritized
                buffer ignores it and samples transitions, this one refuses other values).
            n_step: Steps per transition, or a range ``(low, high)`` drawn per transition
                (None: 1).
            beta: Importance-weight exponent (prioritized; default: the constructor's).
            gamma: Discount of the n-step reward sums.
            include_infos: Must be False: infos are not stored (sampled episodes hold empty
                infos; RLlib's uniform buffer returns them whatever this says).
            include_extra_model_outputs: Must be False.
            sample_episodes: Must be True.
            to_numpy: Numpy-ize the returned episodes (prioritized, as RLlib).
            lookback: Must be 0.
            min_batch_length_T: Must be 0.
            **kwargs: Ignored.

        Raises:
            ConfigError: An argument asks for what the buffer does not support, both
                ``num_items`` and ``batch_size_B`` are given, either is not an integer >= 0
                (a float with an integral value counts as one), or ``n_step`` is neither an
                integer >= 1 nor a range of them (0, False or an empty sequence included).
            EmptyBufferError: Nothing was added yet, or (prioritized) no row in the buffer
                starts a complete n-step window (RLlib's buffer would redraw forever).
        """
        if num_items is not None and batch_size_B is not None:
            raise ConfigError("num_items", "give num_items or batch_size_B, not both")
        if include_infos:
            raise ConfigError("include_infos", "Conduit's RLlib buffers do not store infos; "
                                               "sample with include_infos=False (DQN and SAC "
                                               "do), or use RLlib's own buffer for infos")
        unsupported = {"batch_length_T": batch_length_T,
                       "include_extra_model_outputs": include_extra_model_outputs,
                       "sample_episodes": not sample_episodes, "lookback": lookback,
                       "min_batch_length_T": min_batch_length_T}
        for name, bad in unsupported.items():
            if bad:
                raise ConfigError(name, "Conduit's RLlib buffers sample n-step transitions of "
                                        "stateless modules only (as DQN and SAC do); use "
                                        "RLlib's own buffer for sequences")
        given = "num_items" if num_items is not None else "batch_size_B"
        size = num_items if num_items is not None else batch_size_B
        if isinstance(size, (float, np.floating)) and float(size).is_integer():
            size = int(size)  # a train batch size written 1e3 (RLlib's buffers take it)
        integral = isinstance(size, (int, np.integer)) and not isinstance(size, bool)
        if size is None or (integral and size == 0):  # RLlib: `batch_size_B or default`
            size = self.batch_size_B
        elif not integral or size < 0:
            raise ConfigError(given, f"must be an integer >= 0 (0 or None: batch_size_B), got "
                                     f"{size!r}")
        size = int(size)
        beta = self.beta if beta is None else beta
        if self.prioritized and not (isinstance(beta, (int, float, np.floating))
                                     and not isinstance(beta, bool)):
            raise ConfigError("beta", f"must be a number >= 0, got {beta!r}")
        # Checked before anything changes: a bad argument leaves the buffer as it was.
        request = WindowRequest(n_step=1 if n_step is None else n_step, gamma=gamma,
                                complete=self.prioritized,
                                beta=float(beta) if self.prioritized else None)
        self._settle()
        self._sampler.set_request(request)
        resamples = self._sampler.resamples
        # The plane draws at most `capacity` rows a batch: a larger sample joins `pulls`
        # batches of one size and drops the surplus (fewer than `pulls` rows) at random
        # positions, so each row kept is a draw of the sampler's own distribution.
        pulls = -(-size // self.capacity)
        plane = self._plane_for(-(-size // pulls))
        self.schedule.sampling(plane)
        parts, rows = [], []
        for _ in range(pulls):
            pulled, pulled_rows = self._pull(plane)
            parts.append(Transitions.of(pulled))
            rows.append(pulled_rows)
        if pulls == 1:
            batch, self._last_rows = parts[0], rows[0]
        else:
            total = sum(len(p.index) for p in parts)
            drop = np.random.default_rng([self.seed, 2, self.sampled_timesteps]).choice(
                total, total - size, replace=False)
            keep = np.delete(np.arange(total), drop)
            batch = Transitions.joined(parts, keep)
            self._last_rows = np.concatenate(rows)[keep]
        self._last_index = batch.index
        self.sampled_timesteps += size
        episodes = self._build.episodes(batch, self._rows.table, to_numpy=to_numpy)
        self._log_sample(batch, self._sampler.resamples - resamples)
        self.schedule.sampled()
        return episodes

    def _pull(self, plane: ExperienceDataPlane) -> tuple[dict[str, torch.Tensor], np.ndarray]:
        """The next batch drawn for the request in force with every row still in the buffer,
        and its rows' numbers in the ring's order; others are discarded (a prefetched batch
        may be either).

        Raises:
            EmptyBufferError: The draw for the request in force, over the rows in the buffer
                now, found no row with a complete n-step window.
        """
        for _ in range(4 * G_MAX + 4):
            try:
                batch = plane.pull()
            except OperatorError as exc:
                cause = exc.__cause__
                if isinstance(cause, ConduitError):
                    plane.recover()
                    raise cause from None
                raise
            failed = int(batch.pop("_failed")[0])
            if failed >= 0:  # no row had a complete window when it was drawn
                if (failed == self._sampler.ring_rows
                        and int(batch["_request"][0]) == self._sampler.serial):
                    raise EmptyBufferError(self._sampler.failure)
                self.discarded_batches += 1  # drawn before an add, or for other arguments
                continue
            # Rows overwritten by adds since the batch was delivered are stale as well.
            oldest = self._sampler.ring_rows - self.capacity
            rows = batch.pop("_row").numpy()
            if (batch.pop("_valid").numpy().all() and (rows >= oldest).all()
                    and int(batch.pop("_request")[0]) == self._sampler.serial):
                return batch, rows
            self.discarded_batches += 1
        raise EmptyBufferError(f"{4 * G_MAX + 4} batches in a row were drawn for other sample "
                               f"arguments or lost rows to adds; sample with schedule='inline'")

    def _log_sample(self, batch: Transitions, resamples: int) -> None:
        size = len(batch.index)
        a_sampled, m_sampled = _per_id(size)
        a_eps, m_eps = _per_id(len(set(batch.episode.tolist())))
        a_steps, m_steps = _per_id(len(set(batch.index.tolist())))
        a_n, m_n = _per_id(float(batch.n_step.mean()))
        a_re, m_re = _per_id(resamples)
        self._update_sample_metrics(
            num_env_steps_sampled=size, num_episodes_per_sample=a_eps[DEFAULT_AGENT_ID],
            num_env_steps_per_sample=a_steps[DEFAULT_AGENT_ID],
            sampled_n_step=a_n[DEFAULT_AGENT_ID], num_resamples=resamples,
            agent_to_num_steps_sampled=a_sampled, agent_to_num_episodes_per_sample=a_eps,
            agent_to_num_steps_per_sample=a_steps, agent_to_sampled_n_step=a_n,
            agent_to_num_resamples=a_re, module_to_num_steps_sampled=m_sampled,
            module_to_num_episodes_per_sample=m_eps, module_to_num_steps_per_sample=m_steps,
            module_to_sampled_n_step=m_n, module_to_num_resamples=m_re)

    def get_num_timesteps(self, module_id: ModuleID | None = None) -> int:
        """Timesteps stored."""
        return len(self._rows)

    def get_num_episodes(self, module_id: ModuleID | None = None) -> int:
        """Episodes with at least one timestep stored."""
        return self._rows.num_episodes

    def get_state(self) -> dict[str, Any]:
        """The buffer's state, for RLlib checkpoints: the plane's ``state_dict`` (rows,
        sampler, ring), the episode links and the counters."""
        self._settle()
        plane = self._plane
        return {"spec": plane.spec.to_dict() if plane else None,
                "batch_size": plane.batch_size if plane else self.batch_size_B,
                "plane": plane.state_dict() if plane else None,
                "rows": self._rows.state_dict(),
                "last_index": self._last_index,
                "_num_timesteps_added": self._num_timesteps_added,
                "_num_episodes_evicted": self._num_episodes_evicted,
                "sampled_timesteps": self.sampled_timesteps}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`get_state`.

        Raises:
            StateError: The state is missing a key, does not fit the buffer's capacity, or is
                a buffer of the other kind's (with rows: a prioritized buffer's state holds
                priorities a uniform buffer would drop, a uniform one's has none to give). A
                refused state leaves the buffer as it was.
        """
        for key in ("spec", "batch_size", "plane", "rows", "last_index", "_num_timesteps_added",
                    "_num_episodes_evicted", "sampled_timesteps"):
            entry(state, key, "rllib_buffer")
        if not self.prioritized and _holds_priorities(state["plane"]):
            raise StateError("rllib_buffer.plane.buffer.sampler.inner",
                             "a prioritized buffer's state (its rows have priorities, which "
                             "this uniform buffer would drop): restore it into a "
                             "ConduitPrioritizedEpisodeReplayBuffer")
        spec = ExperienceSpec.from_dict(state["spec"]) if state["spec"] is not None else None
        if spec is not None and set(spec.fields) != {"obs", "action"}:
            raise StateError("spec", f"rows of fields {sorted(spec.fields)}; this buffer's rows "
                                     f"are (obs, action): restore a state of this buffer kind")
        self._rows.check_state(state["rows"])
        # All or nothing: a state refused part way (its rows' table or tails, the plane's
        # entry) puts the buffer back as it was, rows and links together.
        before = self.get_state()
        try:
            self._load_state(state, spec)
        except Exception as exc:
            self._load_state(before, ExperienceSpec.from_dict(before["spec"])
                             if before["spec"] is not None else None)
            if isinstance(exc, ConduitError):
                raise
            raise StateError("rllib_buffer", f"does not fit this buffer "
                                             f"({type(exc).__name__}: {exc})") from exc

    def _load_state(self, state: dict[str, Any], spec: ExperienceSpec | None) -> None:
        decided = self._close_plane()  # first: its delivery worker reads the links
        self._unsettled = None
        self._rows.load_state_dict(state["rows"])
        if spec is not None:
            plane = self._build_plane(spec, state["batch_size"], decided)
            try:
                plane.load_state_dict(state["plane"])
            except BaseException:
                plane.close()
                raise
            self._plane = plane
        else:  # the state of a buffer that never held a row: so is the sampler
            self._sampler = self._new_sampler()
        if self._rows.written != self._sampler.ring_rows:
            raise StateError("rows.written", f"the links cover {self._rows.written} rows, the "
                                             f"plane's ring received {self._sampler.ring_rows}; "
                                             f"restore a state this buffer's get_state wrote")
        self._last_index, self._last_rows = state["last_index"], None
        self._num_timesteps = len(self._rows)
        self._num_timesteps_added = state["_num_timesteps_added"]
        self._num_episodes_evicted = state["_num_episodes_evicted"]
        self.sampled_timesteps = state["sampled_timesteps"]


class ConduitPrioritizedEpisodeReplayBuffer(ConduitEpisodeReplayBuffer,
                                            PrioritizedEpisodeReplayBuffer):
    """RLlib's ``PrioritizedEpisodeReplayBuffer`` over a Conduit plane: proportional
    prioritized replay on Conduit's sum tree.

    Usage: ``config.training(replay_buffer_config={"type":
    "conduit.integrations.rllib.ConduitPrioritizedEpisodeReplayBuffer", "capacity": 50_000,
    "alpha": 0.6, "beta": 0.4})``.

    As in RLlib, a sampled row whose n-step window would be cut short by the end of its
    stored episode is redrawn, new rows get the largest priority seen so far, and importance
    weights are ``(N·P(i))^-β`` divided by their largest possible value. Priorities are
    ``(p + eps)^α`` (RLlib: ``max(p, 1e-12)^α``). See :class:`ConduitEpisodeReplayBuffer`
    for the arguments.

    ``set_state`` restores the priorities as stored, ``(p + eps)^α`` under the α and eps of
    the buffer that wrote the state; this buffer's own α and eps apply to the priorities of
    rows added or updated after. A state holds no α, as RLlib's does not (its ``set_state``
    likewise keeps the restored sum tree under the buffer's own α): restore a state into a
    buffer made with the same ``alpha`` and ``eps`` to keep one exponent throughout.
    """

    prioritized: ClassVar[bool] = True

    def update_priorities(self, priorities: np.ndarray, module_id: ModuleID | None = None) -> None:
        """Give the transitions of the most recent sample new priorities (|TD errors|).

        ``priorities`` may be any array-like of numbers, a torch tensor on any device included
        (detached first: one that requires grad is read, not differentiated).

        Raises:
            PriorityError: No sample to update, a length that differs from it, or
                priorities that are not finite and non-negative.
        """
        if self._last_index is None or self._plane is None:
            raise PriorityError("update_priorities: no sample since the last update")
        try:
            if isinstance(priorities, torch.Tensor):  # e.g. TD errors still in the graph
                pr = priorities.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
            else:
                pr = torch.as_tensor(np.asarray(priorities, dtype=np.float64).reshape(-1))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise PriorityError(f"priorities: must be numbers, got {priorities!r:.80} "
                                f"({exc})") from None
        if pr.numel() != len(self._last_index):
            raise PriorityError(f"priorities: {pr.numel()} values for the "
                                f"{len(self._last_index)} transitions of the last sample")
        index = self._last_index
        rows = self._last_rows
        if rows is not None and len(rows) == len(index):
            # Rows an add overwrote since the sample are gone: their slots hold new rows,
            # which keep their own priorities (a prefetched draw after the add may have
            # marked those slots delivered again, so the buffer's own check cannot tell).
            kept = rows >= self._sampler.ring_rows - self.capacity
            if not kept.all():
                index, pr = index[kept], pr[torch.from_numpy(kept)]
        self._plane.update_priorities(torch.from_numpy(index), pr)
        self._last_index = self._last_rows = None
