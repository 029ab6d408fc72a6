"""Environments of the reference workloads: image payload, multi-agent CartPole, env pool."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from conduit.workloads.envs import EnvPool, ImagePayload, MultiAgentCartPole, env_info, make_env


@pytest.mark.parametrize(("size", "nbytes"), [(128, 49_152), (256, 196_608)])
def test_image_payload_has_the_stated_size(size: int, nbytes: int) -> None:
    env = ImagePayload(gym.make("CartPole-v1"), size)
    obs, _ = env.reset(seed=0)
    assert obs["pixels"].shape == (size, size, 3)
    assert obs["pixels"].dtype == np.uint8
    assert obs["pixels"].nbytes == nbytes
    assert obs["obs"].shape == (4,)
    assert env.observation_space.contains(obs)


def test_image_is_a_function_of_the_state() -> None:
    env = ImagePayload(gym.make("CartPole-v1"), 64)
    a, _ = env.reset(seed=3)
    b, _ = env.reset(seed=3)
    c, _ = env.reset(seed=4)
    assert np.array_equal(a["pixels"], b["pixels"])
    assert not np.array_equal(a["pixels"], c["pixels"])
    a2, *_ = env.step(0)
    assert not np.array_equal(a["pixels"], a2["pixels"])


def test_multi_agent_cartpole_agents_stay_done_until_all_are() -> None:
    env = MultiAgentCartPole(num_agents=3)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (3, 4)
    done_at: dict[int, int] = {}
    for t in range(600):
        # Agent 0 always pushes left and fails early; the others alternate.
        acts = np.array([0, t % 2, (t + 1) % 2])
        _, rew, term, trunc, info = env.step(acts)
        for i in range(3):
            if i in done_at:
                assert not info["active"][i] and rew[i] == 0.0
            elif term[i] or trunc[i]:
                done_at[i] = t
        if info["all_done"]:
            break
    assert info["all_done"] and len(done_at) == 3
    assert done_at[0] < max(done_at.values())


def test_env_pool_flattens_agents_and_resets_in_the_same_step() -> None:
    pool = EnvPool("MultiAgentCartPole", num_envs=2, seed=0, num_agents=3)
    assert pool.num_rows == 6 and pool.obs["obs"].shape == (6, 4)
    returns = []
    for _ in range(400):
        res = pool.step(np.zeros(6, dtype=np.int64))
        assert res.next_obs["obs"].shape == (6, 4)
        returns += res.episode_returns
    assert returns, "always pushing left ends episodes quickly"
    # After an episode ends the pool continues from a fresh reset observation.
    assert np.all(np.abs(pool.obs["obs"]) < 5)


def test_env_pool_same_step_reset_keeps_the_final_observation() -> None:
    pool = EnvPool("CartPole-v1", num_envs=1, seed=0)
    for _ in range(200):
        before = pool.obs["obs"].copy()
        res = pool.step(np.zeros(1, dtype=np.int64))
        if res.terminated[0]:
            assert abs(res.next_obs["obs"][0, 2]) > 0.2 or abs(res.next_obs["obs"][0, 0]) > 2.4
            assert not np.array_equal(res.next_obs["obs"], pool.obs["obs"])
            return
        assert np.array_equal(res.next_obs["obs"], pool.obs["obs"])
        assert not np.array_equal(before, pool.obs["obs"])
    pytest.fail("CartPole pushed left should terminate within 200 steps")


def test_env_info() -> None:
    cp = env_info("CartPole-v1", image_size=128)
    assert cp.discrete and cp.num_actions == 2 and cp.obs_dim == 4 and cp.image_size == 128
    pd = env_info("Pendulum-v1")
    assert not pd.discrete and pd.action_dim == 1 and pd.action_high == 2.0
    ma = env_info("MultiAgentCartPole", num_agents=5)
    assert ma.agents == 5
    with pytest.raises(ValueError, match="MultiAgentCartPole"):
        make_env("MultiAgentCartPole", image_size=64)


def test_metaworld_is_optional() -> None:
    try:
        import metaworld  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="metaworld"):
            make_env("metaworld/reach-v3")
    else:
        env = make_env("metaworld/reach-v3")
        obs, _ = env.reset(seed=0)
        assert np.asarray(obs).ndim == 1
        env.close()
