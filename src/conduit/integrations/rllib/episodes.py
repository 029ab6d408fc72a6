"""Sampled transitions as RLlib ``SingleAgentEpisode`` objects, built by copying a template.

RLlib's buffers return every sampled transition as a one-step episode. Building each one with
``SingleAgentEpisode(...)`` checks its spaces and data again (over 100 µs per transition on a
small CPU). Sampled transitions share their spaces, ids aside, so one per pair of spaces is
built with RLlib's constructor and :class:`OneStepEpisodes` makes the others from it: each
holds the template's attributes, with its own data buffers in the template's form (lists or
NumPy arrays) and its own copies of the template's mutable containers, as the constructor
would give it. The attributes are read from the template once, not once per episode.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer

#: Attributes every episode sets for itself (the rest come from the template).
_OWN = frozenset({"id_", "observations", "actions", "rewards", "infos", "extra_model_outputs",
                  "is_terminated", "is_truncated", "t_started", "t"})


@functools.cache
def _attributes(cls: type) -> tuple[str, ...]:
    """Names of the attributes instances of ``cls`` hold (``__slots__`` of its classes)."""
    names: list[str] = []
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    return tuple(n for n in names if n not in ("__dict__", "__weakref__"))


def episode_ids(count: int) -> list[str]:
    """``count`` random ids in the form of ``uuid.uuid4().hex`` (RLlib's default episode id),
    from one read of the OS's random source."""
    raw = np.frombuffer(os.urandom(16 * count), dtype=np.uint8).reshape(count, 16).copy()
    raw[:, 6] = (raw[:, 6] & 0x0F) | 0x40  # version 4
    raw[:, 8] = (raw[:, 8] & 0x3F) | 0x80  # RFC 4122 variant
    text = raw.tobytes().hex()
    return [text[32 * i:32 * (i + 1)] for i in range(count)]


class _BufferForm:
    """Makes lookback buffers like one of the template's: same attributes, data in its form."""

    def __init__(self, buf: InfiniteLookbackBuffer) -> None:
        self.attrs = dict(vars(buf))
        self.listed = isinstance(buf.data, list)
        self.dtype = None if self.listed else buf.data.dtype

    def data(self, values: Sequence[Sequence[Any]]) -> list[Any]:
        """Each of ``values`` as a buffer's data in the template's form (a new list, or a new
        array of its dtype)."""
        if self.listed:
            return [list(v) for v in values]
        dtype = self.dtype
        return [np.asarray(v, dtype=dtype) for v in values]


@dataclass(frozen=True)
class StepColumns:
    """The data of one-step episodes, one list item per episode.

    Attributes:
        ids: Episode ids.
        observations: Observation at the start of each transition.
        next_observations: Observation after it.
        actions: Action.
        rewards: Reward (the n-step sum).
        n_step: Steps the transition spans.
        weights: Importance weight.
        t_started: Timestep the transition starts at.
        terminated: Whether the transition ends its episode by termination.
        truncated: Whether it ends it by truncation.
    """

    ids: Sequence[str]
    observations: Sequence[Any]
    next_observations: Sequence[Any]
    actions: Sequence[Any]
    rewards: Sequence[Any]
    n_step: Sequence[Any]
    weights: Sequence[Any]
    t_started: Sequence[int]
    terminated: Sequence[bool]
    truncated: Sequence[bool]


class OneStepEpisodes:
    """Makes one-step episodes like ``template`` (same spaces, agent and module, same data
    form) with other data.

    Args:
        template: A one-step episode built by RLlib's constructor (or converted by its
            ``to_numpy``), holding ``n_step`` and ``weights`` extra model outputs.

    Raises:
        KeyError: The template holds no ``n_step`` or no ``weights`` output.
    """

    def __init__(self, template: SingleAgentEpisode) -> None:
        cls = type(template)
        self._cls = cls
        shared, copied = [], []
        for k in _attributes(cls):
            if k in _OWN or not hasattr(template, k):
                continue
            v = getattr(template, k)
            (copied if isinstance(v, (dict, list, set)) else shared).append((k, v))
        self._shared = tuple(shared)
        self._copied = tuple(copied)
        self._obs = _BufferForm(template.observations)
        self._actions = _BufferForm(template.actions)
        self._rewards = _BufferForm(template.rewards)
        self._infos = _BufferForm(template.infos)
        self._n_step = _BufferForm(template.extra_model_outputs["n_step"])
        self._weights = _BufferForm(template.extra_model_outputs["weights"])

    def make(self, rows: Sequence[int], cols: StepColumns) -> list[SingleAgentEpisode]:
        """The episodes of the items ``rows`` of ``cols``, in that order (infos empty).

        Every episode holds its own data buffers and its own copies of the template's mutable
        containers, as RLlib's constructor would give it; the rest is the template's.
        """
        forms = (self._obs, self._actions, self._rewards, self._n_step, self._weights)
        obs, actions, rewards, n_step, weights = (f.data(v) for f, v in zip(forms, (
            [(cols.observations[i], cols.next_observations[i]) for i in rows],
            [(cols.actions[i],) for i in rows], [(cols.rewards[i],) for i in rows],
            [(cols.n_step[i],) for i in rows], [(cols.weights[i],) for i in rows])))
        infos = self._infos.data([({}, {}) for _ in rows])
        # The loop below is the whole cost of a sample's episodes: names are bound once.
        cls, new, setattr_ = self._cls, self._cls.__new__, object.__setattr__
        shared, copied = self._shared, self._copied
        lookback, make_buffer = InfiniteLookbackBuffer, InfiniteLookbackBuffer.__new__
        obs_a, act_a, rew_a, inf_a, n_a, w_a = (f.attrs for f in (
            self._obs, self._actions, self._rewards, self._infos, self._n_step, self._weights))
        ids, t_started = cols.ids, cols.t_started
        terminated, truncated = cols.terminated, cols.truncated
        out = []
        for j, i in enumerate(rows):
            eps = new(cls)
            for k, v in shared:
                setattr_(eps, k, v)
            for k, v in copied:
                setattr_(eps, k, v.copy())
            # (unrolled: six buffers per episode)
            b = make_buffer(lookback)
            d = obs_a.copy()
            d["data"] = obs[j]
            b.__dict__ = d
            eps.observations = b
            b = make_buffer(lookback)
            d = act_a.copy()
            d["data"] = actions[j]
            b.__dict__ = d
            eps.actions = b
            b = make_buffer(lookback)
            d = rew_a.copy()
            d["data"] = rewards[j]
            b.__dict__ = d
            eps.rewards = b
            b = make_buffer(lookback)
            d = inf_a.copy()
            d["data"] = infos[j]
            b.__dict__ = d
            eps.infos = b
            b = make_buffer(lookback)
            d = n_a.copy()
            d["data"] = n_step[j]
            b.__dict__ = d
            b2 = make_buffer(lookback)
            d = w_a.copy()
            d["data"] = weights[j]
            b2.__dict__ = d
            eps.extra_model_outputs = {"n_step": b, "weights": b2}
            eps.id_ = ids[i]
            eps.is_terminated, eps.is_truncated = terminated[i], truncated[i]
            t = t_started[i]
            eps.t_started, eps.t = t, t + 1
            out.append(eps)
        return out


class SampledEpisodes:
    """Sampled transitions as the list of one-step episodes RLlib's replay buffer of the same
    kind returns: RLlib's ``EpisodeReplayBuffer`` (uniform) or its
    ``PrioritizedEpisodeReplayBuffer`` (``prioritized``: fresh episode ids, importance
    weights, numpy-ized on request). The first transition of each pair of spaces is built by
    ``SingleAgentEpisode``'s constructor, the rest by copying it (:class:`OneStepEpisodes`).

    Args:
        prioritized: Build them as the prioritized buffer does.
    """

    #: Makers kept at most (one per pair of spaces and ``to_numpy``); then all are dropped.
    MOST_MAKERS = 64

    def __init__(self, *, prioritized: bool) -> None:
        self.prioritized = prioritized
        # per (observation space, action space, to_numpy), by ids; a maker holds the spaces,
        # so their ids stay theirs while it is kept
        self._makers: dict[tuple[int, int, bool], tuple[Any, Any, OneStepEpisodes]] = {}

    def episodes(self, batch: Any, table: Mapping[int, Any], *,
                 to_numpy: bool) -> list[SingleAgentEpisode]:
        """The rows of ``batch`` (sampled transitions, as columns: ``index``, ``obs``,
        ``next_obs``, ``action``, ``reward``, ``n_step``, ``t``, ``episode``, ``terminated``,
        ``truncated``, ``weight``), each a one-step episode; ``table`` maps a row's
        ``episode`` to its episode's id, agent, module and spaces."""
        size = len(batch.index)
        metas = [table[e] for e in batch.episode.tolist()]  # (each row's episode, looked up once)
        # Columns as lists once: NumPy scalars and views, as indexing row by row gives them.
        cols = StepColumns(
            ids=(episode_ids(size) if self.prioritized else [m.id_ for m in metas]),
            observations=list(batch.obs), next_observations=list(batch.next_obs),
            actions=list(batch.action), rewards=list(batch.reward),
            n_step=batch.n_step.tolist(),
            weights=(batch.weight.tolist() if self.prioritized and batch.weight is not None
                     else [1.0] * size),
            t_started=batch.t.tolist(), terminated=batch.terminated.tolist(),
            truncated=batch.truncated.tolist())
        out: list[Any] = [None] * size
        # The rows of each pair of spaces, made together; the first row of a pair without
        # a maker is built by RLlib's constructor and becomes the maker's template.
        groups: dict[tuple[int, int, bool], tuple[OneStepEpisodes, list[int]]] = {}
        for i, meta in enumerate(metas):
            key = id(meta.observation_space), id(meta.action_space), to_numpy
            group = groups.get(key)
            if group is None:
                cached = self._makers.get(key)
                if cached is None:
                    out[i] = self._first(batch, meta, i, to_numpy)
                    maker = OneStepEpisodes(out[i])
                    if len(self._makers) >= self.MOST_MAKERS:
                        self._makers.clear()
                    self._makers[key] = (meta.observation_space, meta.action_space, maker)
                    groups[key] = (maker, [])
                    continue
                group = groups[key] = (cached[2], [])
            group[1].append(i)
        for maker, rows in groups.values():
            for i, eps in zip(rows, maker.make(rows, cols)):
                if not self.prioritized:
                    eps.agent_id, eps.module_id = metas[i].agent_id, metas[i].module_id
                out[i] = eps
        return out

    def _first(self, batch: Any, meta: Any, i: int, to_numpy: bool) -> SingleAgentEpisode:
        """Row ``i`` (of the episode ``meta``) as RLlib's buffer of this kind builds it."""
        n, t = int(batch.n_step[i]), int(batch.t[i])
        common = {"observations": [batch.obs[i], batch.next_obs[i]],
                  "actions": [batch.action[i]], "rewards": [batch.reward[i]],
                  "terminated": bool(batch.terminated[i]),
                  "truncated": bool(batch.truncated[i]),
                  "observation_space": meta.observation_space,
                  "action_space": meta.action_space, "t_started": t, "len_lookback_buffer": 0}
        if self.prioritized:
            weight = float(batch.weight[i]) if batch.weight is not None else 1.0
            eps = SingleAgentEpisode(**common, extra_model_outputs={"weights": [weight],
                                                                    "n_step": [n]})
            if to_numpy:
                eps.to_numpy()
            return eps
        eps = SingleAgentEpisode(id_=meta.id_, agent_id=meta.agent_id,
                                 module_id=meta.module_id, infos=[{}, {}],
                                 extra_model_outputs={}, **common)
        eps.extra_model_outputs["n_step"] = InfiniteLookbackBuffer(np.full((1,), n),
                                                                   lookback=0)
        eps.extra_model_outputs["weights"] = InfiniteLookbackBuffer(np.ones((1,)), lookback=0)
        return eps
