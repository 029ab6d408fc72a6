"""Conduit as verl's GRPO experience path (``pip install conduit-rl[verl]``; imports verl).

* :class:`GRPOBuffer`: ``DataProto`` prompt groups in, ``DataProto`` mini-batches out, with
  each group's GRPO advantages computed in ingestion and the mini-batches in verl's order
  (:class:`LostGroupsError` names the groups to put again after an ingestion failure);
* :class:`ConduitReplayBuffer`: verl's v1 pluggable replay buffer
  (``trainer.v1.sampler.custom_sampler.{path,name}``), whose ``sample()`` passes each step's
  finished groups through a Conduit plane;
* :func:`grpo_group_advantage`: one group's advantage, equal to verl's
  ``compute_grpo_outcome_advantage`` for that group.
"""

from conduit.integrations.verl.advantages import grpo_group_advantage, token_level_advantage
from conduit.integrations.verl.buffer import GRPOBuffer, LostGroupsError
from conduit.integrations.verl.order import VerlOrderSampler
from conduit.integrations.verl.replay import ConduitReplayBuffer, ConduitSamplerConfig

__all__ = [
    "ConduitReplayBuffer",
    "ConduitSamplerConfig",
    "GRPOBuffer",
    "LostGroupsError",
    "VerlOrderSampler",
    "grpo_group_advantage",
    "token_level_advantage",
]
