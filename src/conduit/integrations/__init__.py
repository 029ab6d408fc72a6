"""Adapters that make Conduit the experience path of other RL frameworks.

Each framework lives in its own subpackage and imports that framework; importing this package
imports none of them:

* :mod:`conduit.integrations.rllib`: RLlib's replay buffers (DQN, SAC) and PPO's mini-batch
  path (``pip install conduit-rl[rllib]``).
"""
