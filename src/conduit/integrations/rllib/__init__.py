"""Conduit as RLlib's experience path (``pip install conduit-rl[rllib]``; imports Ray).

One line of config per algorithm:

* DQN: ``replay_buffer_config={"type":
  "conduit.integrations.rllib.ConduitPrioritizedEpisodeReplayBuffer", "capacity": ...,
  "alpha": ..., "beta": ...}`` (or ``ConduitEpisodeReplayBuffer`` for uniform replay);
* SAC: the same, on a :class:`ConduitSACConfig` instead of ``SACConfig``;
* PPO: ``config.learners(learner_class=ConduitPPOTorchLearner)``.

RLlib's checkpoints leave replay buffers out; the algorithms that :class:`ConduitDQNConfig`
and :class:`ConduitSACConfig` build keep them.
"""

from conduit.integrations.rllib.algorithms import (
    ConduitDQN,
    ConduitDQNConfig,
    ConduitSAC,
    ConduitSACConfig,
)
from conduit.integrations.rllib.ppo import ConduitPPOTorchLearner
from conduit.integrations.rllib.replay import (
    ConduitEpisodeReplayBuffer,
    ConduitPrioritizedEpisodeReplayBuffer,
)

__all__ = [
    "ConduitDQN",
    "ConduitDQNConfig",
    "ConduitEpisodeReplayBuffer",
    "ConduitPPOTorchLearner",
    "ConduitPrioritizedEpisodeReplayBuffer",
    "ConduitSAC",
    "ConduitSACConfig",
]
