"""Sampled transitions as RLlib ``SingleAgentEpisode`` objects, built by copying a template.

RLlib's buffers return every sampled transition as a one-step episode. Building each one with
``SingleAgentEpisode(...)`` checks its spaces and data again (over 100 µs per transition on a
small CPU). The transitions of one sample share their spaces, ids aside, so the first is built
with RLlib's constructor and the others are shallow copies of it whose data buffers are
replaced: each copy holds the same attributes, in the same form (lists or NumPy arrays), as
the constructor would give it.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer


@functools.cache
def _attributes(cls: type) -> tuple[str, ...]:
    """Names of the attributes instances of ``cls`` hold (``__slots__`` of its classes)."""
    names: list[str] = []
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    return tuple(n for n in names if n not in ("__dict__", "__weakref__"))


def _shallow(obj: Any) -> Any:
    """A shallow copy of ``obj`` (its ``__slots__`` and ``__dict__``), without ``copy``'s
    reduce protocol."""
    cls = type(obj)
    out = cls.__new__(cls)
    for k in _attributes(cls):
        if hasattr(obj, k):
            object.__setattr__(out, k, getattr(obj, k))
    if hasattr(obj, "__dict__"):
        out.__dict__.update(obj.__dict__)
    return out


def _buffer_like(buf: InfiniteLookbackBuffer, values: Sequence[Any]) -> InfiniteLookbackBuffer:
    """``buf`` holding ``values`` instead of its data, in its data's form."""
    out = _shallow(buf)
    out.data = (list(values) if isinstance(buf.data, list)
                else np.asarray(values, dtype=buf.data.dtype))
    return out


def episode_like(template: SingleAgentEpisode, *, id_: str, observations: Sequence[Any],
                 actions: Sequence[Any], rewards: Sequence[Any], extra: dict[str, Sequence[Any]],
                 t_started: int, terminated: bool, truncated: bool) -> SingleAgentEpisode:
    """A one-step episode like ``template`` (same spaces, agent and module, same data form)
    with the given data. Mutable containers of the template are copied, not shared.

    Raises:
        KeyError: ``extra`` names an output the template does not hold.
    """
    eps = _shallow(template)
    for k in _attributes(type(template)):
        v = getattr(template, k, None)
        if isinstance(v, (dict, list, set)):
            object.__setattr__(eps, k, copy.copy(v))
    eps.id_ = id_
    eps.observations = _buffer_like(template.observations, observations)
    eps.actions = _buffer_like(template.actions, actions)
    eps.rewards = _buffer_like(template.rewards, rewards)
    eps.infos = _buffer_like(template.infos, [{} for _ in range(len(observations))])
    eps.extra_model_outputs = {k: _buffer_like(template.extra_model_outputs[k], v)
                               for k, v in extra.items()}
    eps.is_terminated, eps.is_truncated = terminated, truncated
    eps.t_started, eps.t = t_started, t_started + len(rewards)
    return eps
