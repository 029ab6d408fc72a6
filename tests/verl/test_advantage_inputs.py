"""The exported advantage functions refuse bad input with typed errors."""

from tests.verl.conftest import skip_without_verl

skip_without_verl()

import pytest  # noqa: E402
import torch  # noqa: E402

from conduit import ConfigError, SpecError  # noqa: E402
from conduit.integrations.verl import grpo_group_advantage, token_level_advantage  # noqa: E402


@pytest.mark.parametrize("scores", [[1.0, 2.0], torch.tensor([1, 2])], ids=["list", "int"])
def test_scores_must_be_a_floating_point_tensor(scores):
    with pytest.raises(SpecError) as err:
        grpo_group_advantage(scores)
    assert err.value.field == "scores"


@pytest.mark.parametrize("epsilon", [float("nan"), 0.0, -1.0, 1e-320], ids=str)
def test_a_bad_epsilon_is_refused(epsilon):
    with pytest.raises(ConfigError) as err:
        grpo_group_advantage(torch.tensor([1.0, 1.0]), epsilon=epsilon)
    assert err.value.field == "epsilon"


def test_zero_epsilon_is_fine_without_the_division():
    out = grpo_group_advantage(torch.tensor([1.0, 3.0]), epsilon=0.0, norm_by_std=False)
    assert out.tolist() == [-1.0, 1.0]


def test_token_level_advantage_refuses_mismatched_rows():
    with pytest.raises(SpecError) as err:
        token_level_advantage(torch.ones(3), torch.ones(2, 5))
    assert err.value.field == "response_mask"
    with pytest.raises(SpecError) as err:
        token_level_advantage([1.0, 2.0], torch.ones(2, 5))
    assert err.value.field == "advantage"
