"""The replay buffer driven as verl's v1 trainer drives it: loaded from
``trainer.v1.sampler.custom_sampler.{path,name}``, built with the keyword arguments of
``PPOTrainer._build_replay_buffer``, and asked for each step in ``_step_once``."""

from tests.verl.conftest import skip_without_verl

skip_without_verl()

import threading  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from transfer_queue import KVBatchMeta  # noqa: E402
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage  # noqa: E402
from verl.utils.import_utils import load_extern_type  # noqa: E402

import conduit.integrations.verl.replay as replay_module  # noqa: E402
from conduit import EmptyBufferError  # noqa: E402

N, PROMPTS, LENGTH = 4, 3, 5
# The trainer loads custom samplers with load_extern_type, which verl itself deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:.*load_extern_type.*:FutureWarning")


def _config(**sampler_kwargs):
    """The part of verl's config that _build_replay_buffer reads."""
    return OmegaConf.create({"trainer": {"v1": {"trainer_mode": "sync", "sync": {}, "sampler": {
        "max_off_policy_threshold": 8, "max_off_policy_strategy": "drop",  # verl's defaults
        "sampler_kwargs": {"group_size": N, "poll_interval": 0.01, "timeout": 5,
                           **sampler_kwargs},
        "custom_sampler": {"path": "pkg://conduit.integrations.verl.replay",
                           "name": "ConduitReplayBuffer"}}}}})


def _build(config, refill_fn=None, path=None):
    """PPOTrainer._build_replay_buffer, for a custom sampler."""
    sampler_config = config.trainer.v1.sampler
    custom = sampler_config.custom_sampler
    cls = load_extern_type(path or custom.path, custom.name)
    mode = config.trainer.v1.trainer_mode
    return cls(trainer_mode=mode, trainer_config=config.trainer.v1.get(mode, {}),
               max_off_policy_threshold=sampler_config.max_off_policy_threshold,
               max_off_policy_strategy=sampler_config.max_off_policy_strategy,
               sampler_kwargs=sampler_config.sampler_kwargs, refill_fn=refill_fn)


def _rollout(uid, global_steps, seed, status="finished", trajectories=N, partition="train"):
    """What the v1 agent loop leaves in TransferQueue for one prompt: a prompt key with the
    group's status and ``trajectories`` ragged trajectories, ``{uid}_{trajectory}_0``."""
    g = torch.Generator().manual_seed(seed)
    keys, masks, scores, tags = [], [], [], []
    for s in range(trajectories):
        length = int(torch.randint(1, LENGTH + 1, (1,), generator=g))
        reward = torch.zeros(length)
        reward[-1] = float(torch.randint(0, 3, (1,), generator=g))
        keys.append(f"{uid}_{s}_0")
        masks.append(torch.ones(length, dtype=torch.int64))
        scores.append(reward)
        tags.append({"status": "success", "prompt_len": 2, "response_len": length,
                     "seq_len": 2 + length, "global_steps": global_steps})
    fields = TensorDict({"response_mask": torch.nested.nested_tensor(masks, layout=torch.jagged),
                         "rm_scores": torch.nested.nested_tensor(scores, layout=torch.jagged)},
                        batch_size=[trajectories])
    tq.kv_batch_put(keys=keys, partition_id=partition, fields=fields, tags=tags)
    tq.kv_batch_put(keys=[uid], partition_id=partition,
                    tags=[{"is_prompt": True, "status": status, "global_steps": global_steps}])


def _verl_advantage(batch):
    """verl's own advantage for the sampled keys (PPOTrainer._compute_advantage's inputs)."""
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                           select_fields=["response_mask", "rm_scores"])
    mask = torch.nested.to_padded_tensor(data["response_mask"], 0)
    rewards = torch.nested.to_padded_tensor(data["rm_scores"], 0.0)
    index = np.array([k.split("_")[0] for k in batch.keys], dtype=object)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, index)
    return adv[torch.arange(len(batch.keys)), mask.sum(dim=-1) - 1]


def test_sample_returns_the_oldest_groups_in_minibatch_order(kv_store):
    buffer = _build(_config(mini_batch_size=N * PROMPTS // 3))
    for i in range(PROMPTS + 1):  # one group more than a step takes: the newest stays
        _rollout(f"u{i}", global_steps=1 if i < PROMPTS else 2, seed=i)
    batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=PROMPTS)
    assert isinstance(batch, KVBatchMeta) and batch.partition_id == "train"
    assert sorted(batch.keys) == sorted(f"u{i}_{s}_0" for i in range(PROMPTS) for s in range(N))
    assert batch.extra_info == {}
    batch.extra_info["temperature"] = 1.0  # what _step_once does next
    assert "training/conduit/score_mean" in metrics
    # The order is the plane's mini-batches, and each tag carries verl's advantage.
    plane = buffer.plane
    assert plane.num_minibatches == 3 and plane.policy_version == 1
    assert plane.placement_decision is not None  # placement="auto" by default
    got = torch.tensor([t["conduit_advantage"] for t in batch.tags])
    assert torch.equal(got, _verl_advantage(batch))
    assert all(t["seq_len"] == 2 + t["response_len"] for t in batch.tags)
    # The step's prompts left the pool; their trajectories stay for the rest of the step.
    listing = tq.kv_list("train")["train"]
    assert "u0" not in listing and "u3" in listing and "u0_0_0" in listing
    tq.kv_clear(keys=batch.keys, partition_id="train")  # fit() step 7


def test_steps_in_a_row_and_a_group_that_finishes_late(kv_store):
    buffer = _build(_config())
    seen = []
    for step in range(1, 4):
        for i in range(PROMPTS - 1):
            _rollout(f"s{step}x{i}", global_steps=step, seed=10 * step + i)
        late = threading.Timer(0.1, _rollout, args=(f"s{step}late", step, 99 + step))
        late.start()
        batch, _ = buffer.sample(global_steps=step, partition_id="train", batch_size=PROMPTS)
        late.join()
        assert len(batch) == PROMPTS * N
        assert torch.equal(torch.tensor([t["conduit_advantage"] for t in batch.tags]),
                           _verl_advantage(batch))
        seen.append({k.split("_")[0] for k in batch.keys})
        tq.kv_clear(keys=batch.keys, partition_id="train")
    assert seen[2] == {"s3x0", "s3x1", "s3late"}
    assert buffer.plane.policy_version == 3


def test_failed_groups_are_replaced_through_refill_fn(kv_store):
    asked = []

    def refill(count):
        asked.append(count)
        _rollout("fresh", global_steps=1, seed=7)  # the trainer submits a new prompt
        return count

    buffer = _build(_config(), refill_fn=refill)
    _rollout("a", 1, seed=1)
    _rollout("b", 1, seed=2)
    _rollout("bad", 1, seed=3, status="failure", trajectories=2)
    batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=3)
    assert asked == [1]
    assert metrics["training/rollout_failure/evicted_samples"] == 1
    assert {k.split("_")[0] for k in batch.keys} == {"a", "b", "fresh"}
    assert not any(k.startswith("bad") for k in tq.kv_list("train")["train"])


def test_a_file_path_loads_it_too(kv_store):
    buffer = _build(_config(), path=str(Path(replay_module.__file__)))
    _rollout("f", 1, seed=1)
    batch, _ = buffer.sample(global_steps=1, partition_id="train", batch_size=1)
    assert sorted(batch.keys) == [f"f_{s}_0" for s in range(N)]
    assert type(buffer).__name__ == "ConduitReplayBuffer"


def test_validation_partition_is_passed_through(kv_store):
    buffer = _build(_config())
    _rollout("v0", 1, seed=1, partition="val", trajectories=1)
    batch, _ = buffer.sample(global_steps=1, partition_id="val", batch_size=1)
    assert batch.keys == ["v0_0_0"] and batch.partition_id == "val"
    assert buffer.plane is None  # validation data never trains


def test_bad_groups_are_evicted_and_named(kv_store, caplog):
    buffer = _build(_config())
    _rollout("short", 1, seed=1, trajectories=N - 1)
    _rollout("empty", 1, seed=2)
    data = kv_store.fields[("train", "empty_2_0")]
    data["response_mask"] = torch.zeros_like(data["response_mask"])
    _rollout("fine", 2, seed=3)  # finished later: chosen once the bad groups are evicted
    with caplog.at_level("INFO", logger=replay_module.__name__), \
            pytest.warns(RuntimeWarning, match="field 'response_mask'.*empty_2_0"):
        batch, metrics = buffer.sample(global_steps=2, partition_id="train", batch_size=1)
    assert {k.split("_")[0] for k in batch.keys} == {"fine"}
    assert metrics["training/conduit/evicted_malformed"] == 2
    logged = [r.getMessage() for r in caplog.records]
    assert any("'uid'" in m and "group 'short' has 3 trajectories" in m for m in logged)
    assert any("'response_mask'" in m and "empty_2_0" in m for m in logged)


def test_sample_raises_when_groups_never_finish(kv_store):
    buffer = _build(_config(timeout=0.2))
    _rollout("slow", 1, seed=1, status="running")
    with pytest.raises(EmptyBufferError, match="0 of 1 groups"):
        buffer.sample(global_steps=1, partition_id="train", batch_size=1)
