"""Adapters that make Conduit the experience path of other RL frameworks.

Each framework lives in its own subpackage and imports that framework; importing this package
imports none of them:

* :mod:`conduit.integrations.rllib`: RLlib's replay buffers (DQN, SAC) and PPO's mini-batch
  path (``pip install conduit-rl[rllib]``).
* :mod:`conduit.integrations.trl`: TRL's ``GRPOTrainer`` with a Conduit on-policy plane as
  its experience path (``pip install conduit-rl[trl]``).
* :mod:`conduit.integrations.verl`: verl's v1 pluggable replay buffer and a ``DataProto``
  GRPO buffer (``pip install conduit-rl[verl]``; its own environment, see the Makefile).
* :mod:`conduit.integrations.grpo`: the framework-free GRPO experience path both build on
  (group-normalized advantages, ragged packing, per-mini-batch padding).
"""
