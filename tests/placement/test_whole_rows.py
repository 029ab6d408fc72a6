"""Rows are whole: the capacity check, the transfer plans and the sharded store count the
same split of a buffer's rows over its shards."""

import pytest
import torch

from conduit.errors import CapacityError
from conduit.placement import check_capacity, plan_placement
from conduit.placement.migration import rows_per_device
from conduit.placement.topology import DeviceInfo, Link, Topology
from conduit.spec import ExperienceSpec
from conduit.storage.column_store import ShardedStore
from conduit.storage.layout import Placement, split_rows


def _two_small_gpus() -> Topology:
    names = ("cpu", "cuda:0", "cuda:1")
    return Topology.single_node(
        devices=[DeviceInfo(name="cpu", memory_bytes=10),
                 DeviceInfo(name="cuda:0", memory_bytes=150),  # 1.5 rows of 100 B each
                 DeviceInfo(name="cuda:1", memory_bytes=150)],
        links=[Link(src=a, dst=b, bandwidth=1e9) for a in names for b in names])


def test_a_shard_holding_one_row_more_than_its_share_must_fit():
    """3 rows over two GPUs of 1.5 rows each: one GPU gets 2 rows, which do not fit."""
    topo = _two_small_gpus()
    sharded = Placement.sharded(["cuda:0", "cuda:1"])
    check = check_capacity(sharded, capacity=3, x=100, topology=topo)
    assert not check.fits and check.limiting_device.endswith("cuda:0")
    assert check_capacity(sharded, capacity=2, x=100, topology=topo).fits
    with pytest.raises(CapacityError):
        plan_placement(spec_bytes=100, capacity=3, actor_device="cpu", learner_device="cuda:0",
                       topology=topo)


@pytest.mark.parametrize(("capacity", "shards"), [(15, 8), (10, 3), (7, 7), (1001, 4)])
def test_the_sharded_store_allocates_the_split_the_planner_counts(capacity, shards):
    spec = ExperienceSpec.of(obs=((2,), torch.float32))
    store = ShardedStore(spec=spec, capacity=capacity,
                         placement=Placement.sharded(["cpu"] * shards))
    counts = [s.capacity for s in store.shards]
    assert sum(counts) == capacity and max(counts) - min(counts) <= 1
    assert counts == split_rows(capacity, [1 / shards] * shards)
    gpus = Placement.sharded([f"cuda:{i}" for i in range(shards)])
    assert list(rows_per_device(gpus, capacity).values()) == counts
