"""ConduitReplayBuffer.sample after a malformed group, driven as verl's ``_step_once`` drives
it (which catches nothing): the group is evicted, counted and warned about once, and the call
goes on with the other groups within its deadline, raising only when none arrive in time."""

from tests.verl.conftest import skip_without_verl

skip_without_verl()

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402

from conduit import EmptyBufferError  # noqa: E402
from tests.verl.test_v1_replay import N, _build, _config, _rollout, _verl_advantage  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*load_extern_type.*:FutureWarning")


def _uids(batch):
    return {k.split("_")[0] for k in batch.keys}


def _step_once(buffer, step, batch_size):
    """What verl's ``_step_once`` does with the buffer: sample, keep the metrics, train on the
    keys (with advantages equal to verl's own)."""
    batch, metrics = buffer.sample(global_steps=step, partition_id="train",
                                   batch_size=batch_size)
    got = torch.tensor([t["conduit_advantage"] for t in batch.tags])
    assert torch.equal(got, _verl_advantage(batch))
    tq.kv_clear(keys=batch.keys, partition_id="train")  # trained on: gone from the pool
    return batch, metrics


def test_a_malformed_group_does_not_end_the_run(kv_store):
    buffer = _build(_config())
    _rollout("abad", 1, seed=1, trajectories=N - 1)  # the oldest finished group
    _rollout("b", 1, seed=2)
    _rollout("c", 1, seed=3)
    with pytest.warns(RuntimeWarning, match="'abad' has 3 trajectories"):
        batch, metrics = _step_once(buffer, 1, batch_size=2)
    assert _uids(batch) == {"b", "c"}
    assert metrics["training/conduit/evicted_malformed"] == 1
    assert not any(k.startswith("abad") for k in tq.kv_list("train")["train"])
    # Another one later: counted, not warned about again.
    _rollout("dbad", 2, seed=4)
    data = kv_store.fields[("train", "dbad_1_0")]
    data["response_mask"] = torch.zeros_like(data["response_mask"])
    _rollout("e", 2, seed=5)
    _rollout("f", 2, seed=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        batch, metrics = _step_once(buffer, 2, batch_size=2)
    assert _uids(batch) == {"e", "f"}
    assert metrics["training/conduit/evicted_malformed"] == 1
    buffer.close()


def test_the_replacement_refill_fn_asks_for_is_sampled_by_the_same_call(kv_store):
    asked = []

    def refill(k):  # the trainer submits k prompts; their groups finish
        asked.append(k)
        _rollout(f"new{len(asked)}", 1, seed=10 + len(asked))

    buffer = _build(_config(), refill_fn=refill)
    _rollout("a", 1, seed=1)
    _rollout("bad", 1, seed=2)
    kv_store.fields[("train", "bad_2_0")]["rm_scores"][-1] = float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite score"):
        batch, metrics = _step_once(buffer, 1, batch_size=2)
    assert asked == [1]
    assert _uids(batch) == {"a", "new1"}
    assert metrics["training/conduit/evicted_malformed"] == 1
    buffer.close()


def test_without_a_replacement_the_timeout_error_says_what_was_evicted(kv_store):
    buffer = _build(_config(timeout=0.3))
    _rollout("a", 1, seed=1)
    _rollout("bad", 1, seed=2, trajectories=N + 1)
    with pytest.warns(RuntimeWarning), \
            pytest.raises(EmptyBufferError, match="1 malformed group"):
        buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    _rollout("c", 1, seed=3)
    batch, metrics = _step_once(buffer, 1, batch_size=2)
    assert _uids(batch) == {"a", "c"}
    assert metrics["training/conduit/evicted_malformed"] == 1  # reported by the next metrics
    buffer.close()


def test_a_validation_batch_goes_on_without_its_malformed_group(kv_store):
    buffer = _build(_config())
    _rollout("v0", 1, seed=1, partition="val", trajectories=2)
    _rollout("v1", 1, seed=2, partition="val", trajectories=1)
    tq.kv_clear(keys=["v1_0_0"], partition_id="val")  # finished, without its trajectory
    with pytest.warns(RuntimeWarning, match="'v1' has 0 trajectories"):
        batch, metrics = buffer.sample(global_steps=1, partition_id="val", batch_size=2)
    assert batch.keys == ["v0_0_0", "v0_1_0"]
    assert metrics["validation/conduit/evicted_malformed"] == 1
    assert tq.kv_list("val")["val"] == {k: t for k, t in tq.kv_list("val")["val"].items()
                                        if k.startswith("v0_")}
    buffer.close()
