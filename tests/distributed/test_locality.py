"""Where a learner's bytes come from (§5.1 local/remote mixture) on a real three-node Ray
cluster: a rank reads the current copies on its own node, the primary otherwise, and the
sampled frequencies stay those of one buffer. Fetches are counted by the shard actors."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from conduit.distributed.sampling import ROW_BITS
from conduit.distributed.shard import HeldRows
from conduit.errors import ConfigError
from tests.distributed.helpers import check_rows, kill, make_plane, rows

pytestmark = pytest.mark.ray

SIZES = (60, 120, 180)  # rows pushed on the node of shard 0, 1, 2


def served(plane) -> np.ndarray:
    """``[shard, owner]``: rows each shard's actor served of each owner's rows so far (0 for
    an actor that is dead: its re-created successor counts from 0)."""
    import ray
    out = np.zeros((3, 3), dtype=np.int64)
    for k, actor in enumerate(plane._shards.actors):
        try:
            counts = ray.get(actor.read_counts.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            continue
        for owner, n in counts.items():
            out[k, owner] = n
    return out


def pull_counting(plane, port, pulls: int) -> tuple[np.ndarray, Counter[int], np.ndarray]:
    """Pull ``pulls`` batches on ``port``; the rows drawn per owner and delivered per id, and
    the rows each shard served meanwhile. With prefetch a draw is in flight before and after:
    the one before was served already (it is not counted), the one after is."""
    import ray
    by_owner = np.zeros(3, dtype=np.int64)
    if port._next is not None:
        ray.get(list(port._next.refs.values()))
        for owner, where in port._next.where.items():
            by_owner[owner] -= len(where)
    before = served(plane)
    by_id: Counter[int] = Counter()
    for _ in range(pulls):
        batch = port.pull()
        check_rows(batch)
        by_owner += np.bincount(batch["_index"].numpy() >> ROW_BITS, minlength=3)
        by_id.update(batch["id"].tolist())
    pending = port._next  # prefetch: the next draw was submitted to the shards already
    assert pending is not None
    ray.get(list(pending.refs.values()))
    for owner, where in pending.where.items():
        by_owner[owner] += len(where)
    return by_owner, by_id, served(plane) - before


def test_a_learner_reads_the_current_copies_on_its_own_node(cluster):
    plane = make_plane(cluster, capacity=3000, batch_size=128, seed=11)
    try:
        nodes = plane.nodes
        assert len(set(nodes)) == 3
        assert [s["replicas_on"] for s in plane.stats()["shards"]] == [[1], [2], [0]]
        start = 0
        for node, n in zip(nodes, SIZES, strict=True):
            plane.actor_port(node).push(rows(n, start))
            start += n
        with pytest.raises(ConfigError, match="node"):
            plane.learner(0, node="not-a-node")
        # On shard 1's node: shard 1 holds its own rows and the replica of shard 0's.
        port = plane.learner(0, node=nodes[1])
        assert port.node == nodes[1] and plane.stats()["learners"][0]["node"] == nodes[1]
        by_owner, by_id, fetched = pull_counting(plane, port, 60)
        want = np.zeros((3, 3), dtype=np.int64)
        want[1, 0], want[1, 1] = by_owner[0], by_owner[1]  # both local: read on shard 1
        want[2, 2] = by_owner[2]  # no copy of shard 2's rows on that node: its primary
        np.testing.assert_array_equal(fetched, want)
        # Only where the bytes come from changed: the frequencies are one buffer's.
        draws = by_owner.sum()
        assert stats.chisquare(by_owner, draws * np.array(SIZES) / sum(SIZES)).pvalue > 1e-3
        counts = np.array([by_id[i] for i in range(sum(SIZES))])
        assert counts.sum() == 60 * 128
        assert stats.chisquare(counts, np.full(len(counts), counts.mean())).pvalue > 1e-3

        # A copy that missed a change is stale: its rows are read from the primary.
        shards = plane._shards
        held = shards.held[0]
        shards.copies[0][1] = HeldRows(held.size - 1, held.total_written - 1, held.mass - 1,
                                       held.min_leaf)
        port.bind(nodes[1])  # drop the draw planned while the copy was current
        by_owner, _, fetched = pull_counting(plane, port, 20)
        want = np.zeros((3, 3), dtype=np.int64)
        want[0, 0], want[1, 1], want[2, 2] = by_owner
        np.testing.assert_array_equal(fetched, want)
        shards.copies[0][1] = held

        # The local shard dies: it is restored from its replica, the pulls go on, nothing
        # is lost, and the restored copies are read locally again.
        port.bind(nodes[1])
        kill(plane, 1)
        by_owner, _, fetched = pull_counting(plane, port, 20)
        [rec] = plane.recoveries
        assert rec.shard == 1 and rec.lost_rows == 0 and plane.lost_rows == 0
        assert len(plane) == sum(SIZES)
        assert fetched[0].sum() == 0 and fetched[1, 2] == 0 and fetched[2, :2].sum() == 0
        assert fetched[1, 0] > 0 and fetched[1, 1] > 0  # the new shard 1 actor serves them
        # The draw that found shard 1 dead was planned again: shard 2 served its part twice.
        assert fetched[2, 2] >= by_owner[2] and fetched[1, :2].sum() == by_owner[:2].sum()

        # A shard this rank reads nothing from (shard 0: a copy of its rows is on the rank's
        # node) is still found dead, by the pings each draw sends, and restored.
        kill(plane, 0)
        for _ in range(20):
            check_rows(port.pull())
            if len(plane.recoveries) == 2:
                break
        assert [r.shard for r in plane.recoveries] == [1, 0] and plane.lost_rows == 0
        assert len(plane) == sum(SIZES)
    finally:
        plane.close()


def test_each_rank_reads_on_its_own_node_and_delivers_on_its_device(cluster):
    plane = make_plane(cluster, capacity=3000, batch_size=64, num_learners=2, seed=4,
                       learner_device=("cpu", "cpu"))
    try:
        nodes = plane.nodes
        start = 0
        for node, n in zip(nodes, SIZES, strict=True):
            plane.actor_port(node).push(rows(n, start))
            start += n
        ports = [plane.learner(0, node=nodes[0]), plane.learner(1, node=nodes[2])]
        assert [p.device for p in ports] == list(plane.learner_devices)
        assert [r["device"] for r in plane.stats()["learners"]] == ["cpu", "cpu"]
        for rank, port in enumerate(ports):
            batch = port.pull()
            assert {v.device for v in batch.values()} == {port.device}, rank
        # Rank 0 on shard 0's node: shard 0 holds its rows and the replica of shard 2's;
        # shard 1's rows have no copy there and come from shard 1.
        by_owner, _, fetched = pull_counting(plane, ports[0], 10)
        want = np.zeros((3, 3), dtype=np.int64)
        want[0, 0], want[1, 1], want[0, 2] = by_owner
        np.testing.assert_array_equal(fetched, want)
        # Rank 1 on shard 2's node: shard 2 holds its rows and the replica of shard 1's.
        by_owner, _, fetched = pull_counting(plane, ports[1], 10)
        want = np.zeros((3, 3), dtype=np.int64)
        want[0, 0], want[2, 1], want[2, 2] = by_owner
        np.testing.assert_array_equal(fetched, want)
    finally:
        plane.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_rank_on_a_gpu_gets_its_batches_there_and_another_on_the_cpu(cluster):
    plane = make_plane(cluster, capacity=600, batch_size=32, num_learners=2,
                       learner_device=("cuda:0", "cpu"))
    try:
        plane.push(rows(100))
        for rank, want in enumerate((torch.device("cuda", 0), torch.device("cpu"))):
            for _ in range(3):  # the first batch and prefetched ones
                batch = plane.learner(rank).pull()
                assert {v.device for v in batch.values()} == {want}
                check_rows({k: v.cpu() for k, v in batch.items()})
    finally:
        plane.close()
