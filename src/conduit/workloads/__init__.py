"""Reference workloads: DQN, SAC and PPO on Ray rollout actors, with the experience path
inline (the sequential baseline) or through Conduit's Experience Data Plane.

* :mod:`~conduit.workloads.dqn`, :mod:`~conduit.workloads.sac`, :mod:`~conduit.workloads.ppo`:
  one readable trainer each (``Args`` + ``train``);
* :mod:`~conduit.workloads.envs`: environments, the image-payload stand-in, multi-agent CartPole;
* :mod:`~conduit.workloads.nets`: networks; :mod:`~conduit.workloads.actors`: Ray actors;
* :mod:`~conduit.workloads.runner`: plane construction per buffer mode and the breakdown;
* :mod:`~conduit.workloads.cli`: ``conduit train`` and ``conduit demo``.
"""
