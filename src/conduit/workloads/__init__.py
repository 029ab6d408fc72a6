"""Reference workloads: DQN, SAC and PPO on Ray rollout actors, with the experience path
inline (the sequential baseline) or through Conduit's Experience Data Plane.

* :mod:`~conduit.workloads.dqn`, :mod:`~conduit.workloads.sac`, :mod:`~conduit.workloads.ppo`:
  one readable trainer each (``Args`` + ``train``);
* :mod:`~conduit.workloads.args`: the arguments the trainers share, and how they are read;
* :mod:`~conduit.workloads.learner`: the learner's seeds, device and threads;
* :mod:`~conduit.workloads.planes`: the plane for a buffer mode, and the transition spec;
* :mod:`~conduit.workloads.actors`: rollout actors and Ray;
  :mod:`~conduit.workloads.actor_port`: pushing their rollouts through the plane;
* :mod:`~conduit.workloads.breakdown`: the per-iteration breakdown and its summaries;
  :mod:`~conduit.workloads.figures`: its PNG figures;
* :mod:`~conduit.workloads.envs`: environments, the image-payload stand-in, multi-agent
  CartPole; :mod:`~conduit.workloads.nets`: networks;
* :mod:`~conduit.workloads.cli`: ``conduit train`` and ``conduit demo``.
"""
