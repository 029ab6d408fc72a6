"""DQN and SAC for Conduit's replay buffers: checkpoints that keep the buffer, and a
``SACConfig`` whose validation accepts the buffers."""

from __future__ import annotations

import importlib
from collections.abc import Collection
from typing import Any

from ray.rllib.algorithms.dqn import DQN, DQNConfig
from ray.rllib.algorithms.sac import SAC, SACConfig

from conduit.integrations.rllib.replay import (
    ConduitEpisodeReplayBuffer,
    ConduitPrioritizedEpisodeReplayBuffer,
)

#: The key of the replay buffer's state in an algorithm's state.
BUFFER = "local_replay_buffer"

#: Conduit's buffers by their ``replay_buffer_config["type"]``, and the RLlib buffer each one
#: stands in for.
RLLIB_BUFFERS = {
    "conduit.integrations.rllib.ConduitEpisodeReplayBuffer": "EpisodeReplayBuffer",
    "conduit.integrations.rllib.ConduitPrioritizedEpisodeReplayBuffer":
        "PrioritizedEpisodeReplayBuffer",
}

Components = str | Collection[str] | None


def _stand_in(kind: Any) -> str | None:
    """The RLlib buffer a Conduit buffer ``kind`` (a class, or a dotted path to one) stands in
    for; None for anything else (left to RLlib's validation)."""
    if isinstance(kind, str):
        if kind in RLLIB_BUFFERS:
            return RLLIB_BUFFERS[kind]
        module, _, name = kind.rpartition(".")
        try:
            kind = getattr(importlib.import_module(module), name) if module else None
        except (ImportError, AttributeError, ValueError):
            return None
    if not isinstance(kind, type):
        return None
    if issubclass(kind, ConduitPrioritizedEpisodeReplayBuffer):
        return "PrioritizedEpisodeReplayBuffer"
    if issubclass(kind, ConduitEpisodeReplayBuffer):
        return "EpisodeReplayBuffer"
    return None


class BufferCheckpoints:
    """Algorithm mixin: the replay buffer's ``get_state`` is part of the algorithm's state, so
    a checkpoint (``save_to_path``) holds the buffer's rows and ``restore_from_path`` puts
    them back. RLlib's new API stack leaves the buffer out of checkpoints."""

    def get_state(self, components: Components = None, *, not_components: Components = None,
                  **kwargs: Any) -> dict[str, Any]:
        state = super().get_state(components, not_components=not_components, **kwargs)
        buffer = getattr(self, BUFFER, None)
        if buffer is not None and self._check_component(BUFFER, components, not_components):
            state[BUFFER] = buffer.get_state()
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        buffer = getattr(self, BUFFER, None)
        if buffer is not None and BUFFER in state:
            buffer.set_state(state[BUFFER])


class ConduitDQN(BufferCheckpoints, DQN):
    """DQN whose checkpoints keep the replay buffer."""


class ConduitSAC(BufferCheckpoints, SAC):
    """SAC whose checkpoints keep the replay buffer."""


class ConduitDQNConfig(DQNConfig):
    """``DQNConfig`` that builds :class:`ConduitDQN` (checkpoints keep the buffer)."""

    def __init__(self, algo_class: type | None = None) -> None:
        super().__init__(algo_class=algo_class or ConduitDQN)


class ConduitSACConfig(SACConfig):
    """``SACConfig`` for Conduit's replay buffers; builds :class:`ConduitSAC`.

    SAC's own validation accepts only RLlib's buffer names. This config validates a Conduit
    buffer as the RLlib buffer it stands in for and changes nothing else; SAC's training step
    then builds the Conduit buffer from ``replay_buffer_config["type"]``.

    Example:
        >>> kind = "conduit.integrations.rllib.ConduitPrioritizedEpisodeReplayBuffer"
        >>> config = (ConduitSACConfig().environment("Pendulum-v1")
        ...           .training(replay_buffer_config={"type": kind, "capacity": 100_000,
        ...                                           "alpha": 0.6, "beta": 0.4}))
    """

    def __init__(self, algo_class: type | None = None) -> None:
        super().__init__(algo_class=algo_class or ConduitSAC)

    def validate(self) -> None:
        """SAC's validation, with a Conduit buffer checked as its RLlib counterpart: a
        ``replay_buffer_config["type"]`` that is a Conduit buffer class (or a subclass), or a
        dotted path to one (as RLlib's ``from_config`` resolves it)."""
        buffer = self.replay_buffer_config
        kind = buffer.get("type") if isinstance(buffer, dict) else None
        stand_in = _stand_in(kind)
        if stand_in is None:
            super().validate()
            return
        buffer["type"] = stand_in
        try:
            super().validate()
        finally:
            buffer["type"] = kind
