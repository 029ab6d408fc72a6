"""Bad input gets a typed error that names the field, from the call that brought it."""

from tests.verl.conftest import skip_without_verl

skip_without_verl()

import pytest  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from conduit import CapacityError, ConfigError, SpecError  # noqa: E402
from conduit.integrations.verl import (  # noqa: E402
    ConduitReplayBuffer,
    ConduitSamplerConfig,
    GRPOBuffer,
)
from tests.verl.conftest import make_step  # noqa: E402


@pytest.fixture
def buf():
    with GRPOBuffer(group_size=3, groups_per_step=2, mini_batch_size=3) as b:
        yield b


def test_wrong_type(buf):
    step = make_step(groups=2, group_size=3)
    with pytest.raises(SpecError, match="DataProto"):
        buf.put({k: v for k, v in step.batch.items()})


def test_mismatched_group_size(buf):
    step = make_step(groups=2, group_size=3)
    with pytest.raises(SpecError, match="group 'p0' has 2 responses") as err:
        buf.put(step.slice(0, 2))
    assert err.value.field == "uid"


def test_empty_response(buf):
    step = make_step(groups=2, group_size=3)
    step.batch["response_mask"][4] = 0
    with pytest.raises(SpecError, match="response 4") as err:
        buf.put(step)
    assert err.value.field == "response_mask"


def test_missing_fields_and_reserved_names(buf):
    step = make_step(groups=2, group_size=3)
    with pytest.raises(SpecError) as err:
        buf.put(step.select(batch_keys=["responses", "response_mask"]))
    assert err.value.field == "token_level_rewards"
    no_uid = make_step(groups=2, group_size=3)
    no_uid.non_tensor_batch.pop("uid")
    with pytest.raises(SpecError, match="uid"):
        buf.put(no_uid)
    step.batch["advantages"] = torch.zeros_like(step.batch["token_level_rewards"])
    with pytest.raises(SpecError, match="computed by the buffer"):
        buf.put(step)


def test_group_put_twice_and_overflow(buf):
    step = make_step(groups=2, group_size=3)
    buf.put(step.slice(0, 3))
    with pytest.raises(SpecError, match="already put"):
        buf.put(step.slice(0, 3))
    with pytest.raises(CapacityError):
        buf.put(make_step(groups=2, group_size=3, first_uid=5))


def test_non_tensor_keys_that_change_within_a_step(buf):
    buf.put(make_step(groups=1, group_size=3))
    other = make_step(groups=1, group_size=3, first_uid=1)
    other.non_tensor_batch.pop("extra_info")
    with pytest.raises(SpecError, match="extra_info") as err:
        buf.put(other)
    assert err.value.field == "non_tensor_batch"


def test_field_that_changes_shape_between_puts(buf):
    buf.put(make_step(groups=1, group_size=3))
    with pytest.raises(SpecError) as err:
        buf.put(make_step(groups=1, group_size=3, response_length=7, first_uid=1))
    assert err.value.field in {"responses", "input_ids", "attention_mask", "response_mask",
                               "token_level_rewards", "old_log_probs"}


def test_bad_configuration():
    with pytest.raises(ConfigError, match="mini_batch_size"):
        GRPOBuffer(group_size=3, groups_per_step=2, mini_batch_size=4)
    with pytest.raises(ConfigError, match="group_size"):
        GRPOBuffer(group_size=0, groups_per_step=2, mini_batch_size=1)
    args = dict(trainer_mode="sync", trainer_config=OmegaConf.create({}),
                max_off_policy_threshold=None, max_off_policy_strategy="drop")
    with pytest.raises(ConfigError, match=r"sampler_kwargs\.group_sise"):
        ConduitReplayBuffer(**args, sampler_kwargs=OmegaConf.create({"group_sise": 4}))
    with pytest.raises(ConfigError, match="trainer_mode"):
        ConduitReplayBuffer(**{**args, "trainer_mode": "separate_async"}, sampler_kwargs=None)
    # verl does not pass rollout.n: a default would evict every group of another size
    for kwargs in (None, OmegaConf.create({"mini_batch_size": 4})):
        with pytest.raises(ConfigError, match=r"rollout\.n") as err:
            ConduitReplayBuffer(**args, sampler_kwargs=kwargs)
        assert err.value.field == "sampler_kwargs.group_size"


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"group_size": True}, "group_size"),
    ({"mini_batch_size": False}, "mini_batch_size"),
    ({"poll_interval": "0.5"}, "poll_interval"),
    ({"poll_interval": 0}, "poll_interval"),
    ({"timeout": float("nan")}, "timeout"),
    ({"timeout": float("inf")}, "timeout"),
    ({"epsilon": float("nan")}, "epsilon"),
    ({"epsilon": -1.0}, "epsilon"),
    ({"epsilon": "1e-6"}, "epsilon"),
    ({"epsilon": 0.0}, "epsilon"),  # a group of equal scores would divide 0 by 0
    ({"norm_adv_by_std_in_grpo": "no"}, "norm_adv_by_std_in_grpo"),
    ({"reward_key": 3}, "reward_key"),
])
def test_bad_sampler_kwargs_name_their_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        ConduitSamplerConfig(**kwargs)
    assert err.value.field == f"sampler_kwargs.{field}"


def test_good_sampler_kwargs():
    config = ConduitSamplerConfig(group_size=8, epsilon=0, norm_adv_by_std_in_grpo=False,
                                  poll_interval=1, timeout=10)
    assert config.epsilon == 0.0 and isinstance(config.poll_interval, float)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"epsilon": "1e-6"}, "epsilon"),
    ({"epsilon": float("inf")}, "epsilon"),
    ({"epsilon": float("nan")}, "epsilon"),
    ({"epsilon": -1e-6}, "epsilon"),
    ({"epsilon": 0}, "epsilon"),
    ({"epsilon": True}, "epsilon"),
    ({"timeout": -1}, "timeout"),
    ({"timeout": "60"}, "timeout"),
    ({"seed": "x"}, "seed"),
    ({"shuffle": "yes"}, "shuffle"),
    ({"norm_adv_by_std_in_grpo": "no"}, "norm_adv_by_std_in_grpo"),
    ({"reward_key": ""}, "reward_key"),
    ({"epochs": True}, "epochs"),
])
def test_bad_buffer_arguments_name_their_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        GRPOBuffer(group_size=2, groups_per_step=2, mini_batch_size=2, **kwargs)
    assert err.value.field == field


def test_dr_grpo_takes_epsilon_zero():
    step = make_step(groups=1, group_size=3)
    with GRPOBuffer(group_size=3, groups_per_step=1, mini_batch_size=3, epsilon=0,
                    norm_adv_by_std_in_grpo=False, timeout=5) as buf:
        buf.put(step)
        (mb,) = buf.minibatches()
    assert bool(torch.isfinite(mb.batch["advantages"]).all())
