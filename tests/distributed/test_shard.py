"""A buffer shard as plain Python (no Ray): replicas stay the same ring as their primary."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conduit.distributed.shard import BufferShard, RemoteError, ShardSpec, to_wire
from conduit.errors import StateError
from tests.conftest import make_rows


@pytest.fixture
def shard_spec(small_spec) -> ShardSpec:
    return ShardSpec(spec=small_spec, capacity=16, sampler="prioritized", seed=1)


def test_shard_spec_pickles(shard_spec):
    import pickle
    back = pickle.loads(pickle.dumps(shard_spec))
    assert back == shard_spec


def test_a_repeated_write_is_applied_once_and_a_gap_is_refused(small_spec, shard_spec):
    shard = BufferShard(shard_id=0, config=shard_spec)
    rows = to_wire(make_rows(small_spec, 5))
    assert shard.write(0, rows, False, 0).total_written == 5
    assert shard.write(0, rows, False, 0).total_written == 5  # a retry
    with pytest.raises(RemoteError) as info:  # what Ray sends back; the front rebuilds it
        shard.write(0, rows, False, 9)
    assert isinstance(info.value.rebuild(), StateError) and "expects 9" in info.value.message


def test_replica_mirrors_priorities_and_restores_the_primary(small_spec, shard_spec):
    primary = BufferShard(shard_id=0, config=shard_spec)
    replica = BufferShard(shard_id=1, config=shard_spec)
    for start in range(0, 24, 6):  # wraps the 16-row ring
        rows = to_wire(make_rows(small_spec, 6, start=start))
        first = primary.rows(0).total_written
        primary.write(0, rows, False, first)
        replica.write(0, rows, False, first)
    batch = primary.sample(0, 8)
    ids = batch["_row_id"]
    pr = np.arange(1, 9, dtype=np.float64)
    stale = np.array([0, 1])  # rows 0 and 1 were overwritten by the wrap
    a = primary.update_priorities(0, np.concatenate([ids, stale]), np.concatenate([pr, pr[:2]]))
    b = replica.update_priorities(0, np.concatenate([ids, stale]), np.concatenate([pr, pr[:2]]))
    assert a == b
    fresh = BufferShard(shard_id=0, config=shard_spec)
    fresh.restore(0, replica.export(0))
    slots = torch.arange(16)
    assert torch.equal(fresh.held(0).sampler.priorities(slots),
                       primary.held(0).sampler.priorities(slots))
    assert torch.equal(fresh.held(0).store.get(slots)["id"], primary.held(0).store.get(slots)["id"])
    got = fresh.gather(0, np.array([0, 15]))
    assert (got["id"] == got["_row_id"]).all()  # the row id is the row's place in the order


def test_a_shards_conduit_error_survives_pickling_with_its_type_and_field(small_spec, shard_spec):
    import pickle

    from conduit.errors import SpecError
    shard = BufferShard(shard_id=0, config=shard_spec)
    with pytest.raises(RemoteError) as info:
        shard.write(0, {"obs": np.zeros((2, 5), np.float32)}, True, 0)
    back = pickle.loads(pickle.dumps(info.value)).rebuild()
    assert isinstance(back, SpecError) and back.field == "obs" and "expected" in str(back)


def test_every_copy_draws_from_its_own_stream_and_counts_what_it_serves(small_spec):
    shard_spec = ShardSpec(spec=small_spec, capacity=16, seed=1)  # uniform
    primary = BufferShard(shard_id=0, config=shard_spec)
    replica = BufferShard(shard_id=1, config=shard_spec)
    rows = to_wire(make_rows(small_spec, 16))
    assert primary.write(0, rows, False, 0) == replica.write(0, rows, False, 0)  # same rows
    a, b = primary.sample(0, 64), replica.sample(0, 64)
    # Two learners reading the two copies draw independently (same distribution, other draws).
    assert not np.array_equal(a["_row_id"], b["_row_id"])
    assert set(a["_row_id"].tolist()) <= set(range(16)) >= set(b["_row_id"].tolist())
    restored = BufferShard(shard_id=2, config=shard_spec)
    restored.restore(0, primary.export(0))
    after = restored.sample(0, 64)
    assert not np.array_equal(after["_row_id"], primary.sample(0, 64)["_row_id"])
    restored.gather(0, np.array([3, 4, 5]))
    assert primary.read_counts() == {0: 128} and replica.read_counts() == {0: 64}
    assert restored.read_counts() == {0: 67}
