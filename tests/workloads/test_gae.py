"""PPO's GAE (computed in ingestion) against a step-by-step reference."""

from __future__ import annotations

import numpy as np
import torch

from conduit.workloads.ppo import compute_gae


def _reference(reward, value, next_value, term, trunc, gamma, lam):
    steps, envs = reward.shape
    adv = np.zeros_like(reward)
    for e in range(envs):
        last = 0.0
        for t in reversed(range(steps)):
            boot = 0.0 if term[t, e] else next_value[t, e]
            delta = reward[t, e] + gamma * boot - value[t, e]
            if term[t, e] or trunc[t, e]:
                last = delta
            else:
                last = delta + gamma * lam * last
            adv[t, e] = last
    return adv


def test_gae_matches_reference_with_terminations_and_truncations() -> None:
    rng = np.random.default_rng(0)
    steps, envs = 9, 3
    reward = rng.normal(size=(steps, envs)).astype(np.float32)
    value = rng.normal(size=(steps, envs)).astype(np.float32)
    next_value = rng.normal(size=(steps, envs)).astype(np.float32)
    term = rng.random((steps, envs)) < 0.15
    trunc = (rng.random((steps, envs)) < 0.1) & ~term
    unit = {"obs": torch.zeros(steps * envs, 4), "action": torch.zeros(steps * envs,
                                                                         dtype=torch.int64),
            "logprob": torch.zeros(steps * envs), "value": torch.from_numpy(value.reshape(-1)),
            "next_value": torch.from_numpy(next_value.reshape(-1)),
            "reward": torch.from_numpy(reward.reshape(-1)),
            "terminated": torch.from_numpy(term.reshape(-1)),
            "truncated": torch.from_numpy(trunc.reshape(-1))}
    out = compute_gae(unit, num_envs=envs, gamma=0.97, lam=0.9)
    ref = _reference(reward, value, next_value, term, trunc, 0.97, 0.9)
    np.testing.assert_allclose(out["advantage"].numpy(), ref.reshape(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["ret"].numpy(), (ref + value).reshape(-1), rtol=1e-5,
                               atol=1e-5)
    assert set(out) == {"obs", "action", "logprob", "value", "advantage", "ret"}
