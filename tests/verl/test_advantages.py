"""Advantages computed per group in ingestion equal verl's over the whole step."""

from tests.verl.conftest import skip_without_verl

skip_without_verl()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage  # noqa: E402

from conduit.integrations.verl import GRPOBuffer, grpo_group_advantage  # noqa: E402
from tests.verl.conftest import make_step  # noqa: E402


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("group_size", [1, 2, 5])
def test_ingestion_advantages_equal_verl(norm, group_size):
    groups = 6
    step = make_step(groups=groups, group_size=group_size, seed=group_size)
    want, want_returns = compute_grpo_outcome_advantage(
        token_level_rewards=step.batch["token_level_rewards"],
        response_mask=step.batch["response_mask"], index=step.non_tensor_batch["uid"],
        norm_adv_by_std_in_grpo=norm)
    with GRPOBuffer(group_size=group_size, groups_per_step=groups,
                    mini_batch_size=groups * group_size, norm_adv_by_std_in_grpo=norm) as buf:
        for g in range(0, groups, 2):  # two groups per put
            buf.put(step.slice(g * group_size, (g + 2) * group_size))
        (mb,) = buf.minibatches()
    assert torch.equal(mb.batch["advantages"], want)
    assert torch.equal(mb.batch["returns"], want_returns)


def test_groups_whose_rows_interleave_in_a_put():
    """A put may hold its groups' rows in any order (here p0, p1, p0, p1, ...)."""
    step = make_step(groups=2, group_size=4, seed=3)
    order = np.array([0, 4, 1, 5, 2, 6, 3, 7])
    mixed = step.select_idxs(order)
    want, _ = compute_grpo_outcome_advantage(
        token_level_rewards=mixed.batch["token_level_rewards"],
        response_mask=mixed.batch["response_mask"], index=mixed.non_tensor_batch["uid"])
    with GRPOBuffer(group_size=4, groups_per_step=2, mini_batch_size=8) as buf:
        buf.put(mixed)
        (mb,) = buf.minibatches()
    assert torch.equal(mb.batch["advantages"], want)


def test_one_group_function_matches_verl_on_that_group():
    scores = torch.tensor([1.0, 0.0, 2.0, 2.0])
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = scores
    want, _ = compute_grpo_outcome_advantage(rewards, torch.ones(4, 3),
                                             np.array(["a"] * 4, dtype=object))
    assert torch.equal(grpo_group_advantage(scores), want[:, 0])
    same = grpo_group_advantage(torch.full((3,), 2.0))
    assert torch.equal(same, torch.zeros(3))  # no signal in a group of equal rewards
