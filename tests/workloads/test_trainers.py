"""Smoke tests: each trainer, in both buffer modes, on a tiny budget with real Ray actors.

They check behaviour only (batches flow, losses finite, same on-policy batches inline and
through Conduit), never timings.
"""

from __future__ import annotations

import math

import pytest
import torch

ray = pytest.importorskip("ray")

from conduit.workloads import dqn, ppo, sac  # noqa: E402

pytestmark = pytest.mark.ray


def _tiny(mod, **kw):
    base = dict(actors=2, log_every=0, device="cpu", seed=3)
    if mod is ppo:
        base.update(envs_per_actor=2, steps_per_rollout=8, rollout_fragments=2,
                    num_minibatches=4, update_epochs=2, iters=3)
    else:
        base.update(envs_per_actor=2, steps_per_rollout=8, batch_size=32, buffer_size=2_000,
                    learning_starts=64, updates_per_iter=2, iters=5)
    base.update(kw)
    return mod.Args(**base)


def _check_run(result, batches, *, expect_keys: set[str]) -> None:
    assert result.losses_finite
    learning = [r for r in result.records if r.learning]
    assert learning, "the learner never trained"
    assert batches, "no training batch reached the learner"
    for b in batches:
        assert expect_keys <= set(b)
        for k, v in b.items():
            if v.is_floating_point():
                assert torch.isfinite(v).all(), k
    for r in result.records:
        assert r.end_to_end >= 0 and r.exposed >= 0
    assert math.isfinite(result.summary["end_to_end"])


@pytest.mark.parametrize("buffer", ["inline", "conduit"])
def test_dqn_trains_in_both_modes(ray_session, buffer: str) -> None:
    batches: list[dict[str, torch.Tensor]] = []
    res = dqn.train(_tiny(dqn, buffer=buffer), on_batch=batches.append)
    _check_run(res, batches, expect_keys={"obs", "action", "reward", "next_obs", "done",
                                          "_index"})
    assert all(b["obs"].shape == (32, 4) for b in batches)
    assert res.plan["buffer"] == buffer


def test_dqn_multi_agent_prioritized_with_image_payload(ray_session) -> None:
    batches: list[dict[str, torch.Tensor]] = []
    res = dqn.train(_tiny(dqn, buffer="conduit", env="MultiAgentCartPole", num_agents=2,
                          prioritized=True), on_batch=batches.append)
    _check_run(res, batches, expect_keys={"_weight", "_index"})
    batches.clear()
    res = dqn.train(_tiny(dqn, buffer="conduit", image_size=32, iters=4),
                    on_batch=batches.append)
    _check_run(res, batches, expect_keys={"pixels", "next_pixels"})
    assert batches[0]["pixels"].shape == (32, 32, 32, 3)
    assert batches[0]["pixels"].dtype == torch.uint8


@pytest.mark.parametrize("buffer", ["inline", "conduit"])
def test_sac_trains_in_both_modes(ray_session, buffer: str) -> None:
    batches: list[dict[str, torch.Tensor]] = []
    res = sac.train(_tiny(sac, buffer=buffer, image_size=32 if buffer == "conduit" else 0),
                    on_batch=batches.append)
    _check_run(res, batches, expect_keys={"obs", "action", "reward", "next_obs", "done"})
    assert batches[0]["action"].shape == (32, 1)
    assert batches[0]["action"].abs().max() <= 2.0


@pytest.mark.parametrize("buffer", ["inline", "conduit"])
def test_ppo_trains_in_both_modes(ray_session, buffer: str) -> None:
    batches: list[dict[str, torch.Tensor]] = []
    res = ppo.train(_tiny(ppo, buffer=buffer), on_batch=batches.append)
    _check_run(res, batches, expect_keys={"obs", "action", "advantage", "ret", "logprob"})
    # 3 iterations x 2 epochs x 4 mini-batches of (2 actors * 2 envs * 8 steps * 2 fragments)/4.
    assert len(batches) == 3 * 2 * 4
    assert all(b["obs"].shape[0] == 16 for b in batches)
    # Advantages are normalized per mini-batch in delivery.
    for b in batches:
        assert abs(b["advantage"].mean().item()) < 1e-4
    # Every slot once per epoch; each iteration's first mini-batch holds no row of its last
    # rollout unit (slots 48..63: 4 units of 16 rows land in push order), so it can be
    # assembled while that unit is ingested.
    for it in range(3):
        epochs = [batches[it * 8 + 4 * e: it * 8 + 4 * e + 4] for e in range(2)]
        for epoch in epochs:
            assert sorted(torch.cat([b["_index"] for b in epoch]).tolist()) == list(range(64))
        assert int(epochs[0][0]["_index"].max()) < 48


def test_ppo_sampler_leads_with_every_unit_but_the_last() -> None:
    args = _tiny(ppo, actors=3, rollout_fragments=4)
    sampler = ppo.minibatch_sampler(args)
    assert (sampler.num_minibatches, sampler.seed) == (4, 3)
    assert sampler.first_within == pytest.approx(1 - 1 / 12)
    assert ppo.minibatch_sampler(_tiny(ppo, lead_first=False)).first_within == 1.0
    # One unit per iteration: nothing to lead with.
    assert ppo.minibatch_sampler(_tiny(ppo, actors=1, rollout_fragments=1)).first_within == 1.0


def test_ppo_first_batches_identical_inline_and_conduit(ray_session) -> None:
    seen: dict[str, list[dict[str, torch.Tensor]]] = {"inline": [], "conduit": []}
    for buffer in seen:
        ppo.train(_tiny(ppo, buffer=buffer, iters=2), on_batch=seen[buffer].append)
    a, b = seen["inline"], seen["conduit"]
    assert len(a) == len(b) == 16
    for x, y in zip(a[:8], b[:8]):  # the whole first iteration
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k
