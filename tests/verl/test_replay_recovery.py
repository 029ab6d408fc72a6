"""ConduitReplayBuffer after bad groups and failures: each gets a typed error once, the group
at fault leaves the pool, and the next ``sample`` goes on."""

from tests.verl.conftest import skip_without_verl

skip_without_verl()

import pytest  # noqa: E402
import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402

from conduit import BackpressureTimeout, ConfigError, SpecError  # noqa: E402
from tests.verl.test_v1_replay import N, _build, _config, _rollout, _verl_advantage  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*load_extern_type.*:FutureWarning")


def _uids(batch):
    return {k.split("_")[0] for k in batch.keys}


def _prompts(partition="train"):
    return sorted(k for k, t in tq.kv_list(partition)[partition].items() if t.get("is_prompt"))


def _drop_trajectories(uid, partition="train"):
    """A finished prompt whose trajectories are not in TransferQueue."""
    tq.kv_clear(keys=[k for k in tq.kv_list(partition)[partition] if k.startswith(f"{uid}_")],
                partition_id=partition)


def test_a_group_without_trajectories_is_refused_before_anything_is_pushed(kv_store):
    asked = []
    buffer = _build(_config(), refill_fn=asked.append)
    _rollout("a", 1, seed=1)
    _rollout("b", 1, seed=2)
    _drop_trajectories("b")
    with pytest.raises(SpecError, match="'b' has 0 trajectories") as err:
        buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    assert err.value.field == "uid"
    assert buffer.plane is None or buffer.plane.counters["pushed_rows"] == 0
    assert _prompts() == ["a"] and asked == [1]  # b evicted and replaced, as failed groups
    _rollout("b2", 1, seed=3)  # the refill
    batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    assert _uids(batch) == {"a", "b2"}
    assert metrics["training/conduit/evicted_malformed"] == 1
    tq.kv_clear(keys=batch.keys, partition_id="train")
    _rollout("c", 2, seed=4)
    _rollout("d", 2, seed=5)
    batch, metrics = buffer.sample(global_steps=2, partition_id="train", batch_size=2)
    assert _uids(batch) == {"c", "d"}
    assert "training/conduit/evicted_malformed" not in metrics  # reported once


@pytest.mark.parametrize("keys", [N - 1, N + 1], ids=["short", "long"])
def test_a_malformed_group_is_evicted_not_picked_again(kv_store, keys):
    buffer = _build(_config())
    _rollout("abad", 1, seed=1, trajectories=keys)  # the oldest finished group
    _rollout("good", 1, seed=2)
    with pytest.raises(SpecError, match=f"'abad' has {keys} trajectories") as err:
        buffer.sample(global_steps=1, partition_id="train", batch_size=1)
    assert err.value.field == "uid"
    assert not any(k.startswith("abad") for k in tq.kv_list("train")["train"])
    batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=1)
    assert _uids(batch) == {"good"}
    assert metrics["training/conduit/evicted_malformed"] == 1


def test_a_multi_output_group_is_named_as_such(kv_store):
    buffer = _build(_config())
    _rollout("m", 1, seed=1)
    tq.kv_batch_put(keys=["m_0_1"], partition_id="train",
                    tags=[{"status": "success", "global_steps": 1}])
    with pytest.raises(SpecError, match="multi-output") as err:
        buffer.sample(global_steps=1, partition_id="train", batch_size=1)
    assert err.value.field == "uid"


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_reward_is_refused_and_its_group_evicted(kv_store, value):
    buffer = _build(_config())
    _rollout("a", 1, seed=1)
    _rollout("b", 1, seed=2)
    rewards = kv_store.fields[("train", "a_2_0")]["rm_scores"]
    rewards[-1] = value
    with pytest.raises(SpecError, match="'a_2_0' has a non-finite score") as err:
        buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    assert err.value.field == "rm_scores"
    assert _prompts() == ["b"]
    _rollout("c", 1, seed=3)
    batch, _ = buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    assert _uids(batch) == {"b", "c"}
    got = torch.tensor([t["conduit_advantage"] for t in batch.tags])
    assert bool(torch.isfinite(got).all()) and torch.equal(got, _verl_advantage(batch))


def test_a_plane_failure_after_a_push_leaves_no_rows_behind(kv_store, monkeypatch):
    buffer = _build(_config())
    _rollout("a", 1, seed=1)
    _rollout("b", 1, seed=2)
    batch, _ = buffer.sample(global_steps=1, partition_id="train", batch_size=2)  # builds it
    tq.kv_clear(keys=batch.keys, partition_id="train")
    plane = buffer.plane
    push, calls = plane.push, []

    def second_push_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise BackpressureTimeout("injected")
        return push(*args, **kwargs)

    monkeypatch.setattr(plane, "push", second_push_fails)
    _rollout("c", 2, seed=3)
    _rollout("d", 2, seed=4)
    with pytest.raises(BackpressureTimeout, match="injected"):
        buffer.sample(global_steps=2, partition_id="train", batch_size=2)
    assert plane.closed and buffer.plane is None  # the first group's rows went with it
    assert _prompts() == ["c", "d"]  # not the groups' fault: they wait for the next call
    batch, _ = buffer.sample(global_steps=2, partition_id="train", batch_size=2)
    assert _uids(batch) == {"c", "d"}
    got = torch.tensor([t["conduit_advantage"] for t in batch.tags])
    assert torch.equal(got, _verl_advantage(batch))


@pytest.mark.parametrize("batch_size", [0, -1, True, 1.5])
def test_a_batch_size_that_is_not_a_positive_integer(kv_store, batch_size):
    buffer = _build(_config())
    _rollout("a", 1, seed=1)
    with pytest.raises(ConfigError) as err:
        buffer.sample(global_steps=1, partition_id="train", batch_size=batch_size)
    assert err.value.field == "batch_size"


def test_validation_group_without_trajectories(kv_store):
    buffer = _build(_config())
    _rollout("v0", 1, seed=1, partition="val", trajectories=1)
    _drop_trajectories("v0", partition="val")
    with pytest.raises(SpecError, match="'v0' has 0 trajectories") as err:
        buffer.sample(global_steps=1, partition_id="val", batch_size=1)
    assert err.value.field == "uid"
    _rollout("v1", 1, seed=2, partition="val", trajectories=2)  # any count is fine there
    batch, metrics = buffer.sample(global_steps=1, partition_id="val", batch_size=1)
    assert batch.keys == ["v1_0_0", "v1_1_0"]
    assert metrics["validation/conduit/evicted_malformed"] == 1


def test_a_multi_output_group_of_group_size_keys_is_refused(kv_store):
    # N keys, one of them a second output of trajectory 0: the count fits group_size, but verl
    # gives the trajectory its final output's advantage, which the buffer does not compute
    from tensordict import TensorDict

    buffer = _build(_config())
    _rollout("m", 1, seed=1, trajectories=N - 1)
    _rollout("ok", 1, seed=2)
    one = [torch.ones(2, dtype=torch.int64)]
    fields = TensorDict({"response_mask": torch.nested.nested_tensor(one, layout=torch.jagged),
                         "rm_scores": torch.nested.nested_tensor([torch.tensor([0.0, 1.0])],
                                                                 layout=torch.jagged)},
                        batch_size=[1])
    tq.kv_batch_put(keys=["m_0_1"], partition_id="train", fields=fields,
                    tags=[{"status": "success", "prompt_len": 2, "response_len": 2,
                           "seq_len": 4, "global_steps": 1}])
    with pytest.raises(SpecError, match="multi-output") as err:
        buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    assert err.value.field == "uid" and "'m'" in str(err.value)
    assert _prompts() == ["ok"]
