"""A CartPole whose process exits on its first step, for rollout actors that crash every time
they roll out. Make it with ``gymnasium.make(CRASHING_CARTPOLE)``, which imports this module
(also inside a Ray actor) and registers it."""

from __future__ import annotations

import os

import gymnasium as gym
from gymnasium.envs.classic_control import CartPoleEnv

CRASHING_CARTPOLE = "tests.workloads.crashing_env:CrashingCartPole-v0"


class CrashingCartPole(CartPoleEnv):
    """CartPole that ends its process, without cleanup, when it is stepped."""

    def step(self, action):
        os._exit(1)


gym.register("CrashingCartPole-v0", entry_point=CrashingCartPole)
