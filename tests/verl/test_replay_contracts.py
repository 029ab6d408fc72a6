"""ConduitReplayBuffer: groups leaving the pool while ``sample`` runs, malformed fields that
make a group malformed (evicted once, and ``sample`` goes on with the other groups), one
deadline and eviction metrics reported once, and ``close``."""

from tests.verl.conftest import skip_without_verl

skip_without_verl()

import threading  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from conduit import ConfigError, EmptyBufferError, PlaneClosedError  # noqa: E402
from conduit.integrations.verl import ConduitSamplerConfig  # noqa: E402
from tests.verl.test_v1_replay import N, _build, _config, _rollout  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*load_extern_type.*:FutureWarning")


def _uids(batch):
    return {k.split("_")[0] for k in batch.keys}


def _prompts(partition="train"):
    return sorted(k for k, t in tq.kv_list(partition)[partition].items() if t.get("is_prompt"))


def _put(uid, mask=None, reward=None):
    """A finished group of N trajectories with the given fields (default: well formed)."""
    keys = [f"{uid}_{s}_0" for s in range(N)]
    mask = torch.ones(N, 3, dtype=torch.int64) if mask is None else mask
    reward = torch.arange(N).float()[:, None].expand(N, 3).clone() if reward is None else reward
    tq.kv_batch_put(keys=keys, partition_id="train",
                    fields=TensorDict({"response_mask": mask, "rm_scores": reward},
                                      batch_size=[N]),
                    tags=[{"status": "success", "global_steps": 1}] * N)
    tq.kv_batch_put(keys=[uid], partition_id="train",
                    tags=[{"is_prompt": True, "status": "finished", "global_steps": 1}])


def test_a_group_leaving_the_pool_after_the_wait_is_replaced_by_waiting_again(kv_store):
    buffer = _build(_config(timeout=5))
    _rollout("a", 1, seed=1)
    _rollout("b", 1, seed=2)
    wait = buffer.wait_for_sampleable
    calls = []

    def racing_wait(*args, **kwargs):
        if calls:  # a new group finishes while sample waits again
            _rollout("c", 1, seed=3)
        out = wait(*args, **kwargs)
        if not calls:  # another consumer takes b once it was counted
            tq.kv_clear(keys=[k for k in tq.kv_list("train")["train"] if k.startswith("b")],
                        partition_id="train")
        calls.append(1)
        return out

    buffer.wait_for_sampleable = racing_wait
    t = time.monotonic()
    batch, _ = buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    assert time.monotonic() - t < 2.5
    assert _uids(batch) == {"a", "c"} and len(batch.keys) == 2 * N
    buffer.close()


@pytest.mark.parametrize(("fields", "field"), [
    ({"mask": torch.ones(N, 3)}, "response_mask"),
    ({"mask": torch.ones(N, dtype=torch.int64)}, "response_mask"),
    ({"reward": torch.arange(N).float()}, "rm_scores"),
    ({"reward": torch.tensor([3e38, -3e38, 3e38, 3e38])[:, None].expand(N, 3) / 3},
     "rm_scores"),
], ids=["float-mask", "mask-per-trajectory", "reward-per-trajectory", "overflowing-std"])
def test_a_group_with_malformed_fields_is_evicted_once(kv_store, fields, field):
    asked = []
    buffer = _build(_config(), refill_fn=asked.append)
    _put("a", **fields)  # the oldest finished group
    _put("b")
    with pytest.warns(RuntimeWarning, match=f"field '{field}'.*'a'"):
        batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=1)
    assert _uids(batch) == {"b"} and asked == [1]  # evicted, replaced, and the call went on
    assert metrics["training/conduit/evicted_malformed"] == 1
    assert all(torch.isfinite(torch.tensor(t["conduit_advantage"])) for t in batch.tags)
    assert _prompts() == []
    buffer.close()


def test_a_bool_response_mask_is_fine(kv_store):
    buffer = _build(_config())
    _put("a", mask=torch.ones(N, 3, dtype=torch.bool))
    batch, _ = buffer.sample(global_steps=1, partition_id="train", batch_size=1)
    assert _uids(batch) == {"a"}
    buffer.close()


def test_an_epsilon_that_is_zero_in_float32_is_refused():
    with pytest.raises(ConfigError) as err:
        ConduitSamplerConfig(group_size=N, epsilon=1e-320)
    assert err.value.field == "sampler_kwargs.epsilon"


def test_sample_after_close_raises(kv_store):
    buffer = _build(_config())
    _rollout("a", 1, seed=1)
    buffer.close()
    with pytest.raises(PlaneClosedError):
        buffer.sample(global_steps=1, partition_id="train", batch_size=1)
    assert _prompts() == ["a"]


def test_waiting_again_keeps_one_deadline_and_reports_the_first_waits_evictions(kv_store):
    asked = []
    buffer = _build(_config(timeout=2), refill_fn=asked.append)
    _rollout("a", 1, seed=1)
    _rollout("f", 1, seed=9, status="failure")  # evicted (and refilled) by the first wait
    late = threading.Timer(1.8, _rollout, args=("b", 1, 2))  # b finishes late
    late.start()
    wait = buffer.wait_for_sampleable
    calls = []

    def racing_wait(*args, **kwargs):
        calls.append(1)
        out = wait(*args, **kwargs)
        if len(calls) == 1:  # another consumer takes b once it was counted
            tq.kv_clear(keys=[k for k in tq.kv_list("train")["train"] if k.startswith("b")],
                        partition_id="train")
        return out

    buffer.wait_for_sampleable = racing_wait
    t = time.monotonic()
    with pytest.raises(EmptyBufferError) as err:
        buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    took = time.monotonic() - t
    late.join()
    assert len(calls) == 2 and took < 3.0  # one 2 s deadline for both waits, not 2 s each
    assert "sampler_kwargs.timeout=2.0 s in all" in str(err.value)
    assert asked == [1]
    _rollout("c", 1, seed=3)
    _, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    assert metrics["training/rollout_failure/evicted_samples"] == 1  # f, reported once
    _rollout("d", 1, seed=4)
    _rollout("e", 1, seed=5)
    _, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    assert "training/rollout_failure/evicted_samples" not in metrics
    buffer.close()


def test_groups_evicted_by_get_sampleable_count_are_reported_by_the_next_sample(kv_store):
    buffer = _build(_config())
    _rollout("a", 1, seed=1)
    _rollout("f", 1, seed=9, status="failure")
    assert buffer.get_sampleable_count(global_steps=1, partition_id="train") == 1
    assert _prompts() == ["a"]
    _, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=1)
    assert metrics["training/rollout_failure/evicted_samples"] == 1
    buffer.close()


def test_wait_for_sampleable_takes_a_timeout(kv_store):
    buffer = _build(_config(timeout=60))
    t = time.monotonic()
    with pytest.raises(EmptyBufferError):
        buffer.wait_for_sampleable(1, "train", 1, timeout=0.2)
    assert time.monotonic() - t < 5
    with pytest.raises(ConfigError) as err:
        buffer.wait_for_sampleable(1, "train", 1, timeout=-1)
    assert err.value.field == "timeout"
    buffer.close()
