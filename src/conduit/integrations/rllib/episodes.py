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

