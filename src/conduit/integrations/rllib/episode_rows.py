"""RLlib episodes as buffer rows, and the n-step windows sampled over them.

Every timestep of an added episode chunk becomes one buffer row ``(obs, action)``: each
observation is stored once. What links rows into episodes lives beside the plane, one entry per
slot: the slot of the episode's next timestep (chunks of an ongoing episode arrive in later
``add`` calls, so a link is set after its row was written), the reward, and whether the
episode terminated or was truncated at that step. A window of ``n`` steps from a sampled row
follows these links; it is cut short where the stored episode ends, as in RLlib's
``EpisodeReplayBuffer``.

A row's next observation is the observation of its successor row (RLlib's chunks of one
episode share the observation at their boundary). The last stored row of an episode has no
successor; its next observation is the episode's *tail*, kept in :class:`Tails`, one per
episode in the buffer, overwritten when a later chunk continues the episode and freed when the
episode's last row is overwritten.

Rows are written in ring order, so slot ``r % capacity`` holds row ``r``. A row's successors
are newer than it: while a row is in the buffer, so is its whole window and the row or tail
holding its next observation.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import gymnasium as gym
import numpy as np
import torch
from numpy.typing import ArrayLike

from conduit.errors import ConfigError, SpecError, StateError
from conduit.integrations.rllib import _window_kernels as kernels
from conduit.spec import ExperienceSpec
from conduit.storage.state import entry

NStep = int | tuple[int, int]
"""RLlib's ``n_step``: fixed, or a range ``[low, high)`` drawn per sampled row."""


class Episode(Protocol):
    """What is read from an RLlib ``SingleAgentEpisode`` chunk."""

    id_: str
    agent_id: Hashable | None
    module_id: str | None
    observation_space: gym.Space | None
    action_space: gym.Space | None
    t_started: int
    is_terminated: bool
    is_truncated: bool

    def __len__(self) -> int: ...
    def get_observations(self, indices: slice) -> ArrayLike: ...
    def get_actions(self, indices: slice) -> ArrayLike: ...
    def get_rewards(self, indices: slice) -> ArrayLike: ...


@dataclass
class EpisodeMeta:
    """What a sampled transition reports of its episode."""

    id_: str
    agent_id: Hashable | None
    module_id: str | None
    observation_space: gym.Space | None
    action_space: gym.Space | None
    last_row: int
    tail: int = -1
    t0: int = 0
    """The ``t`` of the episode's first stored step: stored steps are numbered from it, as
    RLlib's buffers number them (``t_started`` of a sampled step is its index in the stored
    episode)."""


@dataclass(frozen=True)
class Appended:
    """Rows made from one ``add`` call, and what it changed."""

    rows: dict[str, np.ndarray]
    steps: int
    new_episodes: int
    evicted_episodes: int
    evicted_steps: int
    spec: ExperienceSpec | None = None
    """The spec every row was checked against (None when no row was made)."""


@dataclass(frozen=True)
class Read:
    """Episode chunks read and checked by :meth:`EpisodeRows.read`, not linked yet.

    Attributes:
        chunks: Each chunk with its rows, rewards and last observation, or (a chunk without
            timesteps that ends its episode) the chunk alone.
        rows: The rows of all chunks, in order: what the ring receives.
        steps: Rows in ``rows``.
        spec: The spec every row was checked against (None when there is no row).
    """

    chunks: list[tuple[Episode, dict[str, np.ndarray], np.ndarray, np.ndarray] | Episode]
    rows: dict[str, np.ndarray]
    steps: int
    spec: ExperienceSpec | None


@dataclass(frozen=True)
class Window:
    """Sampled n-step windows.

    Attributes:
        starts: Slot of each window's first step ``[B]``.
        n: The n-step drawn for each row ``[B]``.
        slots: Slots of the window's steps ``[B, max n]`` (repeating the last one past its end).
        valid: Which of ``slots`` belong to the window ``[B, max n]``.
        length: Steps in each window (``n``, or fewer where the stored episode ends).
        end: Slot of each window's last step ``[B]``.
    """

    starts: np.ndarray
    n: np.ndarray
    slots: np.ndarray
    valid: np.ndarray
    length: np.ndarray
    end: np.ndarray


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _numeric(name: str, values: Any, n: int) -> np.ndarray:
    """``values`` as an array of ``n`` rows of numbers.

    Raises:
        SpecError: Not a numeric array of ``n`` rows (for example a Dict or Tuple space's
            nested values).
    """
    kind = None
    try:
        arr = np.asarray(values) if not isinstance(values, Mapping) else None
    except (TypeError, ValueError) as exc:  # ragged nested values (a Tuple of Box and Discrete)
        arr, kind = None, f"values numpy cannot stack ({exc})"
    if arr is None or arr.ndim == 0 or len(arr) != n or arr.dtype.kind not in "biuf":
        kind = kind or (type(values).__name__ if arr is None or arr.ndim == 0
                        else f"{arr.dtype} array of shape {arr.shape}")
        raise SpecError(name, f"Conduit's RLlib buffers store episodes whose observations and "
                              f"actions are numeric arrays (Box, Discrete, MultiDiscrete "
                              f"spaces), got {kind}; use RLlib's own buffer for other spaces")
    return arr


def _check_spaces(eps: Episode) -> None:
    """Refuse an episode whose observation or action space is a Tuple or Dict space: its
    values may stack into a numeric array, but RLlib returns them as tuples or dicts.

    Raises:
        SpecError: Naming ``obs`` or ``action``.
    """
    for name, attr in (("obs", "observation_space"), ("action", "action_space")):
        space = getattr(eps, attr, None)
        if isinstance(space, (gym.spaces.Tuple, gym.spaces.Dict)):
            raise SpecError(name, f"the episode's {attr} is a {type(space).__name__} space; "
                                  f"Conduit's RLlib buffers store numeric arrays (Box, "
                                  f"Discrete, MultiDiscrete spaces) and would return its "
                                  f"values as one array: use RLlib's own buffer, which keeps "
                                  f"them as {type(space).__name__.lower()}s")


def _steps(eps: Episode) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """A chunk's rows ``(obs, action)``, its rewards, and its last observation (the tail).

    Raises:
        SpecError: Observations or actions that are not numeric arrays, or a Tuple or Dict
            observation or action space.
    """
    _check_spaces(eps)
    n = len(eps)
    obs = _numeric("obs", eps.get_observations(slice(0, n + 1)), n + 1)
    return ({"obs": obs[:-1], "action": _numeric("action", eps.get_actions(slice(0, n)), n)},
            _rewards(eps.get_rewards(slice(0, n)), n), obs[-1])


def _rewards(values: Any, n: int) -> np.ndarray:
    """A chunk's ``n`` rewards as float64, one number per step (a reward of shape ``(1,)``,
    as some wrappers return, is that number).

    Raises:
        SpecError: Rewards that are not numbers (text, None), or several numbers per step.
    """
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as exc:  # ragged: steps of different shapes
        raise SpecError("reward", f"must be one number per step ({exc})") from None
    if arr.dtype.kind not in "biuf":
        raise SpecError("reward", f"must be real numbers, got {arr.dtype} values such as "
                                  f"{arr.reshape(-1)[:1].tolist()}")
    if arr.shape != (n,):
        if arr.size != n or (arr.ndim and arr.shape[0] != n):
            raise SpecError("reward", f"must be one number per step: {n} steps gave rewards "
                                      f"of shape {arr.shape}")
        arr = arr.reshape(n)
    return arr.astype(np.float64)


class Tails:
    """The observation after the last stored row of each episode, in a growing array.

    Slots are handed out by :meth:`take` and returned by :meth:`free`; the array doubles when
    all are taken, so it holds about as many observations as there are episodes in the buffer.
    """

    def __init__(self) -> None:
        self.data: np.ndarray | None = None
        self._free: list[int] = []

    def take(self, like: np.ndarray) -> int:
        """A free slot for observations like ``like`` (the first call fixes shape and dtype).

        Raises:
            SpecError: ``like`` differs in shape or dtype from earlier observations.
        """
        self.check(like)
        if not self._free:
            size = 0 if self.data is None else len(self.data)
            grown = np.zeros((max(2 * size, 16), *like.shape), dtype=like.dtype)
            if self.data is not None:
                grown[:size] = self.data
            self.data = grown
            self._free = list(range(len(grown) - 1, size - 1, -1))
        return self._free.pop()

    def free(self, slot: int) -> None:
        """Return ``slot``."""
        self._free.append(slot)

    def write(self, slot: int, obs: np.ndarray) -> None:
        """Store ``obs`` in ``slot``.

        Raises:
            SpecError: ``obs`` differs in shape or dtype from earlier observations.
        """
        self.check(obs)
        assert self.data is not None, "write to a slot that was not taken"
        self.data[slot] = obs

    def check(self, obs: np.ndarray) -> None:
        """Raises SpecError when ``obs`` differs in shape or dtype from stored observations."""
        if self.data is not None and (obs.shape != self.data.shape[1:]
                                      or obs.dtype != self.data.dtype):
            raise SpecError("obs", f"an observation of shape {obs.shape} and dtype {obs.dtype} "
                                   f"after ones of {self.data.shape[1:]} and "
                                   f"{self.data.dtype}; add episodes of one observation space")

    def read(self, slots: np.ndarray) -> np.ndarray:
        """The observations in ``slots``."""
        assert self.data is not None, "no tail was written"
        return self.data[slots]

    def state_dict(self) -> dict[str, Any]:
        """The array and free slots."""
        return {"data": None if self.data is None else self.data.copy(),
                "free": list(self._free)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        data = entry(state, "data", "episode_rows.tails")
        self.data = None if data is None else np.array(data)
        self._free = [int(k) for k in entry(state, "free", "episode_rows.tails")]


def spec_of(rows: dict[str, np.ndarray]) -> ExperienceSpec:
    """The spec of rows made by :meth:`EpisodeRows.read`: one timestep's observation and
    action.

    Raises:
        ConfigError: The observations or actions are not numeric arrays (for example dict
            spaces).
    """
    try:
        return ExperienceSpec.of(**{k: (v.shape[1:], _torch_dtype(v.dtype))
                                    for k, v in rows.items()})
    except TypeError as exc:
        raise ConfigError("observation_space", f"Conduit's RLlib buffers store observations "
                                               f"and actions that are numeric arrays: "
                                               f"{exc}") from exc


class EpisodeRows:
    """Links between rows, rewards and episode ends, by slot, beside a ring of ``capacity``.

    Args:
        capacity: Slots of the ring the rows are written to.
    """

    _ARRAYS: ClassVar[tuple[str, ...]] = ("succ", "reward", "terminated", "truncated",
                                          "episode", "t", "tail")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.succ = np.full(capacity, -1, dtype=np.int64)
        self.reward = np.zeros(capacity, dtype=np.float64)
        self.terminated = np.zeros(capacity, dtype=bool)
        self.truncated = np.zeros(capacity, dtype=bool)
        self.episode = np.full(capacity, -1, dtype=np.int64)
        self.t = np.zeros(capacity, dtype=np.int64)
        #: The tail slot of the episode's last stored row (read only where ``succ`` is -1).
        self.tail = np.full(capacity, -1, dtype=np.int64)
        #: Next observations of the episodes' last stored rows.
        self.tails = Tails()
        #: Rows written so far; the next row goes to slot ``written % capacity``.
        self.written = 0
        #: Episodes with a row in the ring, oldest last write first.
        self.table: OrderedDict[int, EpisodeMeta] = OrderedDict()
        self._ongoing: dict[str, int] = {}  # episode id -> key, until the episode is done
        self._stored: dict[str, int] = {}  # episode id -> key, while it is in the table
        self._spaces: list[tuple[gym.Space | None, gym.Space | None]] = []
        self._next_key = 0
        #: Held while the links and the ring they describe change together (an add), and
        #: while a delivery reads them.
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return min(self.written, self.capacity)

    @property
    def num_episodes(self) -> int:
        """Episodes with at least one row in the ring."""
        return len(self.table)

    def read(self, episodes: Iterable[Episode], *,
             spec: ExperienceSpec | None = None) -> Read:
        """Read and check ``episodes`` (in order) without changing anything; :meth:`link`
        links them once their rows are in the ring.

        A chunk without timesteps that is terminated or truncated ends its ongoing episode:
        the episode's last stored row takes its end flags (as RLlib's buffer concatenates it
        to the stored episode); other empty chunks change nothing.

        Args:
            episodes: Episode chunks.
            spec: The rows' spec (the ring's); None: the first chunk's.

        Raises:
            SpecError: A chunk's observations or actions are not numeric arrays, its
                observation or action space is a Tuple or Dict space, its observations or
                actions differ in shape or dtype from ``spec`` (or the first chunk's) or from
                the stored observations, or (field ``t_started``) a chunk of an ongoing
                episode does not start where the episode's stored steps end (a chunk added
                twice, or one after a lost chunk; RLlib's buffer refuses it too).
        """
        chunks: list[tuple[Episode, dict[str, np.ndarray], np.ndarray, np.ndarray] | Episode] = []
        next_t: dict[str, int | None] = {}  # episode id -> where its next chunk starts
        ended: set[str] = set()  # episodes that ended in the buffer or earlier in this add
        for eps in episodes:
            if eps.id_ not in next_t:
                key = self._ongoing.get(eps.id_)
                meta = None if key is None else self.table.get(key)
                next_t[eps.id_] = (None if meta is None else
                                   int(self.t[meta.last_row % self.capacity]) + meta.t0 + 1)
                if key is None and eps.id_ in self._stored:
                    ended.add(eps.id_)
            if eps.id_ in ended:
                raise SpecError("id_", f"the episode {eps.id_!r} ended in the buffer (or "
                                       f"earlier in this add); a chunk of it cannot be added "
                                       f"again (RLlib's buffer refuses it too): add each "
                                       f"chunk once")
            want = next_t[eps.id_]
            if want is not None and eps.t_started != want:
                raise SpecError("t_started", f"a chunk of the ongoing episode {eps.id_!r} "
                                             f"starts at t={eps.t_started}, but its stored "
                                             f"steps end at t={want}: add each chunk once, "
                                             f"in order (a cut() successor starts where its "
                                             f"predecessor ends)")
            if len(eps) == 0:
                if eps.is_terminated or eps.is_truncated:
                    chunks.append(eps)  # ends the ongoing episode: see _end
                    next_t[eps.id_] = None
                    ended.add(eps.id_)
                continue
            steps, reward, last_obs = _steps(eps)
            if spec is None:
                spec = spec_of(steps)
            spec.validate(steps, what="episode")
            self.tails.check(last_obs)
            chunks.append((eps, steps, reward, last_obs))
            next_t[eps.id_] = (None if eps.is_terminated or eps.is_truncated
                               else eps.t_started + len(eps))
            if eps.is_terminated or eps.is_truncated:
                ended.add(eps.id_)
        parts = [c[1] for c in chunks if isinstance(c, tuple)]
        rows = (parts[0] if len(parts) == 1 else  # one chunk: its arrays, not copies
                {k: np.concatenate([p[k] for p in parts]) for k in parts[0]} if parts else {})
        return Read(chunks, rows, sum(len(c[0]) for c in chunks if isinstance(c, tuple)),
                    spec if parts else None)

    def link(self, read: Read) -> Appended:
        """Link the chunks of ``read`` (made by :meth:`read` since the last change) to earlier
        chunks of the same episodes, once the ring received ``read.rows``, in order.

        Returns:
            What the add changed.
        """
        new = 0
        links: list[tuple[int, int]] = []
        row = self.written
        for chunk in read.chunks:
            if not isinstance(chunk, tuple):
                self._end(chunk, oldest=row - self.capacity)
                continue
            eps, _, reward, last_obs = chunk
            n = len(eps)
            key = self._ongoing.get(eps.id_)
            if key is None or key not in self.table:
                key, new = self._next_key, new + 1
                self._next_key += 1
                obs_space, act_space = self._interned(eps.observation_space,
                                                      eps.action_space)
                self.table[key] = EpisodeMeta(eps.id_, eps.agent_id, eps.module_id,
                                              obs_space, act_space, -1,
                                              self.tails.take(last_obs), eps.t_started)
                self._stored[eps.id_] = key
            else:
                links.append((self.table[key].last_row, row))
            meta = self.table[key]
            self.tails.write(meta.tail, last_obs)
            slots = (row + np.arange(n)) % self.capacity
            self.succ[slots] = np.append(slots[1:], -1)
            self.tail[slots[-1]] = meta.tail
            self.reward[slots] = reward
            self.terminated[slots] = False
            self.truncated[slots] = False
            self.terminated[slots[-1]] = eps.is_terminated
            self.truncated[slots[-1]] = eps.is_truncated
            self.episode[slots] = key
            self.t[slots] = eps.t_started - meta.t0 + np.arange(n)
            self.table[key].last_row = row + n - 1
            self.table.move_to_end(key)
            if eps.is_terminated or eps.is_truncated:
                self._ongoing.pop(eps.id_, None)
            else:
                self._ongoing[eps.id_] = key
            row += n
        before, self.written = self.written, row
        oldest = row - self.capacity  # rows below it were overwritten
        for prev, first in links:
            if prev >= oldest:
                self.succ[prev % self.capacity] = first % self.capacity
        evicted = 0
        while self.table and next(iter(self.table.values())).last_row < oldest:
            key, meta = self.table.popitem(last=False)
            self._ongoing.pop(meta.id_, None)
            if self._stored.get(meta.id_) == key:
                del self._stored[meta.id_]
            self.tails.free(meta.tail)
            evicted += 1
        return Appended(read.rows, row - before, new, evicted,
                        max(0, oldest) - max(0, before - self.capacity), read.spec)

    #: Distinct pairs of spaces kept for :meth:`_interned`.
    MOST_SPACES = 16

    def _interned(self, obs_space: gym.Space | None, act_space: gym.Space | None
                  ) -> tuple[gym.Space | None, gym.Space | None]:
        """One object per distinct pair of spaces: episodes from remote env runners arrive
        with spaces of their own, equal to earlier ones, and sampled transitions are built
        per pair of space objects (a new pair costs RLlib's episode constructor)."""
        for pair in self._spaces:
            if (pair[0] is obs_space or pair[0] == obs_space) and (
                    pair[1] is act_space or pair[1] == act_space):
                return pair
        if len(self._spaces) < self.MOST_SPACES:
            self._spaces.append((obs_space, act_space))
        return obs_space, act_space

    def _end(self, eps: Episode, *, oldest: int) -> None:
        """Apply a zero-length chunk's end flags to its ongoing episode: the episode ends at
        its last stored row (if that row is not below ``oldest``, the oldest row in the ring),
        as RLlib's buffer concatenates the chunk to the stored episode."""
        key = self._ongoing.pop(eps.id_, None)
        meta = None if key is None else self.table.get(key)
        if meta is not None and meta.last_row >= oldest:
            slot = meta.last_row % self.capacity
            self.terminated[slot] = eps.is_terminated
            self.truncated[slot] = eps.is_truncated

    def windows(self, starts: np.ndarray, n: np.ndarray) -> Window:
        """The windows of ``n[i]`` steps from slots ``starts[i]``, cut where episodes end."""
        width = int(n.max()) if len(starts) else 1
        slots, valid, length = kernels.lay_windows(self.succ, starts, n, width)
        return Window(starts, n, slots, valid, length, slots[:, -1])

    def complete(self, starts: np.ndarray, n: np.ndarray) -> np.ndarray:
        """Whether the window of ``n[i]`` steps from slot ``starts[i]`` holds all of them
        (what ``windows(starts, n).length == n`` says, without laying the windows)."""
        return kernels.complete(self.succ, starts, n)

    def returns(self, window: Window, gamma: float
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Discounted reward sums over each window (summed last step first, as RLlib's
        ``lfilter`` does) and its end flags: set where the window's ``n`` steps end exactly at
        the episode's last step (a window cut short reports neither, as in RLlib)."""
        acc = kernels.discounted_sums(self.reward, window.slots, window.valid, float(gamma))
        full = window.length == window.n
        return (acc, self.terminated[window.end] & full, self.truncated[window.end] & full)

    def next_of(self, slots: np.ndarray) -> np.ndarray:
        """The slot holding the next observation of the rows in ``slots``: their successor's
        slot, or -1 where the row is its episode's last stored one (see :meth:`tails_of`)."""
        return self.succ[slots]

    def tails_of(self, slots: np.ndarray) -> np.ndarray:
        """The next observations of the rows in ``slots``, each the last stored row of its
        episode."""
        return self.tails.read(self.tail[slots])

    def state_dict(self) -> dict[str, Any]:
        """Arrays, tails, write count and episode table (picklable; spaces are kept as
        objects)."""
        return {**{k: getattr(self, k).copy() for k in self._ARRAYS}, "written": self.written,
                "tails": self.tails.state_dict(),
                "table": [(k, vars(m).copy()) for k, m in self.table.items()],
                "ongoing": dict(self._ongoing), "next_key": self._next_key}

    def check_state(self, state: dict[str, Any]) -> None:
        """Check a :meth:`state_dict` against this object without changing anything.

        Raises:
            StateError: A key is missing, an array has the wrong length, or a link is not a
                slot of the ring (the compiled windows follow links without bounds checks).
        """
        for k in (*self._ARRAYS, "written", "tails", "table", "ongoing", "next_key"):
            entry(state, k, "episode_rows")
        for k in self._ARRAYS:
            shape = np.shape(state[k])
            if shape != (self.capacity,):
                raise StateError(f"episode_rows.{k}", f"has shape {shape}, expected "
                                                      f"({self.capacity},)")
        succ = np.asarray(state["succ"])
        if not np.issubdtype(succ.dtype, np.integer) or (
                len(succ) and (succ.min() < -1 or succ.max() >= self.capacity)):
            raise StateError("episode_rows.succ", f"links must be slots in [0, "
                                                  f"{self.capacity}) or -1; restore a state "
                                                  f"this buffer's get_state wrote")
        written = state["written"]
        if isinstance(written, bool) or not isinstance(written, (int, np.integer)) \
                or written < 0:
            raise StateError("episode_rows.written", f"must be an integer >= 0, got "
                                                     f"{written!r}")
        try:
            keys = {k for k, _ in state["table"]}
        except (TypeError, ValueError) as exc:
            raise StateError("episode_rows.table", f"must be (key, episode) pairs ({exc})"
                             ) from None
        held = np.asarray(state["episode"])[:min(int(written), self.capacity)]
        missing = set(np.unique(held).tolist()) - keys
        if missing:
            raise StateError("episode_rows.episode", f"rows of episodes {sorted(missing)[:5]} "
                                                     f"that the table lacks; restore a state "
                                                     f"this buffer's get_state wrote")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            StateError: As :meth:`check_state`, before anything changes.
        """
        self.check_state(state)
        for k in self._ARRAYS:
            getattr(self, k)[:] = np.asarray(state[k])
        self.written = int(entry(state, "written", "episode_rows"))
        self.tails.load_state_dict(entry(state, "tails", "episode_rows"))
        self.table = OrderedDict((k, EpisodeMeta(**m))
                                 for k, m in entry(state, "table", "episode_rows"))
        self._ongoing = dict(entry(state, "ongoing", "episode_rows"))
        self._stored = {m.id_: k for k, m in self.table.items()}
        self._spaces = []
        for m in self.table.values():
            m.observation_space, m.action_space = self._interned(m.observation_space,
                                                                 m.action_space)
        self._next_key = int(entry(state, "next_key", "episode_rows"))
