"""ConduitReplayBuffer after bad groups and failures: a bad group is evicted (named in a
warning, counted once) and ``sample`` goes on with the others; after a plane failure the
groups stay in the pool for the next ``sample``."""

from tests.verl.conftest import skip_without_verl

skip_without_verl()

import pytest  # noqa: E402
import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402

from conduit import BackpressureTimeout, ConfigError, EmptyBufferError  # noqa: E402
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


def test_a_group_without_trajectories_is_evicted_before_anything_is_pushed(kv_store):
    asked = []

    def refill(k):  # the trainer submits k prompts; here the replacement finishes at once
        asked.append(k)
        _rollout("b2", 1, seed=3)

    buffer = _build(_config(), refill_fn=refill)
    _rollout("a", 1, seed=1)
    _rollout("b", 1, seed=2)
    _drop_trajectories("b")
    with pytest.warns(RuntimeWarning, match="field 'uid'.*'b' has 0 trajectories"):
        batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    assert asked == [1]  # b evicted and replaced, as failed groups are
    assert _uids(batch) == {"a", "b2"}
    assert buffer.plane.counters["pushed_rows"] == 2 * N  # nothing of b was pushed
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
    with pytest.warns(RuntimeWarning, match=f"field 'uid'.*'abad' has {keys} trajectories"):
        batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=1)
    assert _uids(batch) == {"good"}
    assert metrics["training/conduit/evicted_malformed"] == 1
    assert not any(k.startswith("abad") for k in tq.kv_list("train")["train"])


def test_a_multi_output_group_is_named_as_such(kv_store):
    buffer = _build(_config())
    _rollout("m", 1, seed=1)
    _rollout("ok", 1, seed=2)
    tq.kv_batch_put(keys=["m_0_1"], partition_id="train",
                    tags=[{"status": "success", "global_steps": 1}])
    with pytest.warns(RuntimeWarning, match="field 'uid'.*multi-output"):
        batch, _ = buffer.sample(global_steps=1, partition_id="train", batch_size=1)
    assert _uids(batch) == {"ok"}


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_reward_is_refused_and_its_group_evicted(kv_store, value):
    buffer = _build(_config(), refill_fn=lambda k: _rollout("c", 1, seed=3))
    _rollout("a", 1, seed=1)
    _rollout("b", 1, seed=2)
    rewards = kv_store.fields[("train", "a_2_0")]["rm_scores"]
    rewards[-1] = value
    with pytest.warns(RuntimeWarning, match="field 'rm_scores'.*'a_2_0' has a non-finite"):
        batch, _ = buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    assert _uids(batch) == {"b", "c"}  # a evicted, c its replacement
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
    with pytest.warns(RuntimeWarning, match="field 'uid'.*'v0' has 0 trajectories"), \
            pytest.raises(EmptyBufferError, match="malformed"):  # no other group was chosen
        buffer.sample(global_steps=1, partition_id="val", batch_size=1)
    _rollout("v1", 1, seed=2, partition="val", trajectories=2)  # any count is fine there
    batch, metrics = buffer.sample(global_steps=1, partition_id="val", batch_size=1)
    assert batch.keys == ["v1_0_0", "v1_1_0"]
    assert metrics["validation/conduit/evicted_malformed"] == 1


def test_a_multi_output_group_of_group_size_keys_is_refused(kv_store):
    # N keys, one of them a second output of trajectory 0: the count fits group_size, but verl
    # gives the trajectory its final output's advantage, which the buffer does not compute
    from tensordict import TensorDict

    buffer = _build(_config(), refill_fn=lambda k: _rollout("ok2", 1, seed=3))
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
    with pytest.warns(RuntimeWarning, match="field 'uid'.*'m'.*multi-output"):
        batch, _ = buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    assert _uids(batch) == {"ok", "ok2"}  # m evicted, ok2 its replacement
    assert _prompts() == []
