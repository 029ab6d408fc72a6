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

from typing import Any, ClassVar, Literal

import numpy as np
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import (
    PrioritizedEpisodeReplayBuffer,
)
from ray.rllib.utils.typing import ModuleID

from conduit import ExperienceDataPlane, ExperienceSpec
from conduit._checks import check_int
from conduit.errors import ConfigError
from conduit.integrations.rllib.episode_rows import Appended, EpisodeRows, NStep
from conduit.integrations.rllib.episodes import SampledEpisodes
from conduit.integrations.rllib.metrics import CachedMetricsLogger
from conduit.integrations.rllib.replay_metrics import add_metrics, sample_metrics
from conduit.integrations.rllib.replay_plane import ReplayPlane
from conduit.integrations.rllib.replay_sampling import PriorityRouter, SampleAssembler
from conduit.integrations.rllib.replay_state import checked_spec, restore
from conduit.integrations.rllib.schedule import ReplaySchedule, ScheduleName
from conduit.integrations.rllib.windows import WindowRequest
from conduit.storage import Placement, PrioritizedSampler, Sampler, UniformSampler


def _count(field: str, value: Any) -> int:
    """``value`` as a positive ``int``; a float with an integral value (``1e5``, as configs
    write capacities and RLlib's own buffers take) counts as that integer.

    Raises:
        ConfigError: It is not a positive integer (field ``field``).
    """
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        value = int(value)
    return check_int(field, value, minimum=1)


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
    before the latest ``add`` calls (at most
    :data:`~conduit.integrations.rllib.schedule.G_MAX` of them), so it may miss their
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
        self._replay = ReplayPlane(capacity, seed=self.seed, placement=placement,
                                   schedule=self.schedule, inner=self._inner_sampler())
        self._rows: EpisodeRows = self._replay.rows
        self._build = SampledEpisodes(prioritized=self.prioritized)
        self._assembler = SampleAssembler(self._replay, self.seed)
        self._priorities = PriorityRouter(self._replay)

    @property
    def plane(self) -> ExperienceDataPlane | None:
        """The plane the rows live in (None until the first ``add``)."""
        return self._replay.plane

    @property
    def discarded_batches(self) -> int:
        """Delivered batches thrown away: drawn for other arguments or overwritten rows."""
        return self._assembler.discarded_batches

    @discarded_batches.setter
    def discarded_batches(self, value: int) -> None:
        self._assembler.discarded_batches = value

    def _inner_sampler(self) -> Sampler:
        """A sampler of rows, for a sampler of windows that has drawn nothing yet."""
        return (PrioritizedSampler(alpha=self._alpha, beta=self.beta, eps=self._eps,
                                   seed=self.seed)
                if self.prioritized else UniformSampler(seed=self.seed))

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
        self._replay.add(episodes, self.batch_size_B, self._added)

    def _added(self, added: Appended) -> None:
        """Count and log what an add changed."""
        self._num_timesteps = len(self._rows)
        self._num_timesteps_added += added.steps
        self._num_episodes_evicted += added.evicted_episodes
        self._update_add_metrics(**add_metrics(added))

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
        self._replay.settle(self._added)
        self._replay.sampler.set_request(request)
        resamples = self._replay.sampler.resamples
        batch, rows = self._assembler.assemble(size, self.sampled_timesteps)
        self._priorities.remember(batch.index, rows)
        self.sampled_timesteps += size
        episodes = self._build.episodes(batch, self._rows.table, to_numpy=to_numpy)
        self._update_sample_metrics(**sample_metrics(batch, self._replay.sampler.resamples
                                                            - resamples))
        self.schedule.sampled()
        return episodes

    def get_num_timesteps(self, module_id: ModuleID | None = None) -> int:
        """Timesteps stored."""
        return len(self._rows)

    def get_num_episodes(self, module_id: ModuleID | None = None) -> int:
        """Episodes with at least one timestep stored."""
        return self._rows.num_episodes

    def get_state(self) -> dict[str, Any]:
        """The buffer's state, for RLlib checkpoints: the plane's ``state_dict`` (rows,
        sampler, ring), the episode links and the counters."""
        self._replay.settle(self._added)
        return {**self._replay.state_dict(self.batch_size_B),
                "last_index": self._priorities.index,
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
        spec = checked_spec(state, prioritized=self.prioritized, rows=self._rows)
        restore(state, spec, before=self.get_state(), load=self._load_state)

    def _load_state(self, state: dict[str, Any], spec: ExperienceSpec | None) -> None:
        self._replay.load_state(state, spec, self._inner_sampler)
        self._priorities.remember(state["last_index"], None)
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
        self._priorities.update(priorities)
