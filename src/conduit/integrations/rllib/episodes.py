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

    def make(self, values: Sequence[Any]) -> InfiniteLookbackBuffer:
        out = InfiniteLookbackBuffer.__new__(InfiniteLookbackBuffer)
        attrs = self.attrs.copy()
        attrs["data"] = list(values) if self.listed else np.asarray(values, dtype=self.dtype)
        out.__dict__ = attrs
        return out


class OneStepEpisodes:
    """Makes one-step episodes like ``template`` (same spaces, agent and module, same data
    form) with other data.

    Args:
        template: A one-step episode built by RLlib's constructor (or converted by its
            ``to_numpy``), holding the extra model outputs the made episodes hold.
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
        self._extra = {k: _BufferForm(b) for k, b in template.extra_model_outputs.items()}

    def make(self, *, id_: str, observations: Sequence[Any], actions: Sequence[Any],
             rewards: Sequence[Any], extra: Mapping[str, Sequence[Any]], t_started: int,
             terminated: bool, truncated: bool) -> SingleAgentEpisode:
        """One episode holding the given data (infos empty).

        Raises:
            KeyError: ``extra`` names an output the template does not hold.
        """
        eps = self._cls.__new__(self._cls)
        setattr_ = object.__setattr__
        for k, v in self._shared:
            setattr_(eps, k, v)
        for k, v in self._copied:
            setattr_(eps, k, v.copy())
        eps.id_ = id_
        eps.observations = self._obs.make(observations)
        eps.actions = self._actions.make(actions)
        eps.rewards = self._rewards.make(rewards)
        eps.infos = self._infos.make([{} for _ in observations])
        eps.extra_model_outputs = {k: self._extra[k].make(v) for k, v in extra.items()}
        eps.is_terminated, eps.is_truncated = terminated, truncated
        eps.t_started, eps.t = t_started, t_started + len(rewards)
        return eps


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
        out: list[SingleAgentEpisode] = []
        size = len(batch.index)
        # Columns as lists once: NumPy scalars and views, as indexing row by row gives them.
        obs, next_obs = list(batch.obs), list(batch.next_obs)
        action, reward = list(batch.action), list(batch.reward)
        n_step, t, episode = batch.n_step.tolist(), batch.t.tolist(), batch.episode.tolist()
        terminated, truncated = batch.terminated.tolist(), batch.truncated.tolist()
        weights = (batch.weight.tolist() if self.prioritized and batch.weight is not None
                   else [1.0] * size)
        ids = episode_ids(size) if self.prioritized else None
        for i in range(size):
            meta = table[episode[i]]
            key = id(meta.observation_space), id(meta.action_space), to_numpy
            maker = self._makers.get(key)
            if maker is None:
                out.append(self._first(batch, meta, i, to_numpy))
                if len(self._makers) >= self.MOST_MAKERS:
                    self._makers.clear()
                self._makers[key] = (meta.observation_space, meta.action_space,
                                     OneStepEpisodes(out[-1]))
                continue
            eps = maker[2].make(
                id_=meta.id_ if ids is None else ids[i], observations=(obs[i], next_obs[i]),
                actions=(action[i],), rewards=(reward[i],),
                extra={"n_step": (n_step[i],), "weights": (weights[i],)}, t_started=t[i],
                terminated=terminated[i], truncated=truncated[i])
            if ids is None:
                eps.agent_id, eps.module_id = meta.agent_id, meta.module_id
            out.append(eps)
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
