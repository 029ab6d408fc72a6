"""Losing a shard mid-run on a real three-node Ray cluster: with replication no row is lost,
without it the exact loss is reported; a pull never hangs on a dead shard."""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest

from conduit.distributed import ShardUnavailableError
from conduit.errors import EmptyBufferError
from tests.distributed.helpers import check_rows, kill, make_plane, rows

pytestmark = pytest.mark.ray


def drawn_ids(plane, pulls: int) -> set[int]:
    out: set[int] = set()
    for _ in range(pulls):
        batch = plane.pull()
        check_rows(batch)
        out.update(batch["id"].tolist())
    return out


def test_killing_a_shard_mid_run_loses_nothing_with_replication(cluster):
    plane = make_plane(cluster, capacity=3000, batch_size=128, sampler="prioritized",
                       min_size=1)
    try:
        pushed = 0
        for step in range(12):  # push on every node and train, killing shard 1 midway
            node = plane.nodes[step % 3]
            plane.push(rows(25, pushed), node=node)
            pushed += 25
            batch = plane.pull()
            plane.update_priorities(batch["_index"], (batch["id"] % 5 + 1).double())
            if step == 6:
                kill(plane, 1)
        assert plane.lost_rows == 0 and len(plane) == pushed
        [rec] = plane.recoveries
        assert rec.shard == 1 and rec.source == 2 and rec.lost_rows == 0
        # Found dead by step 7's push to it; its replica already held that push's rows.
        assert rec.restored_rows == 75 and plane.stats()["shards"][1]["rows"] == 100
        # Priorities came back with the rows: global weights are the same function of the
        # row as before the kill (they depend on priorities only).
        before = {}
        for _ in range(10):
            b = plane.pull()
            before.update(zip(b["id"].tolist(), b["_weight"].tolist(), strict=True))
        for k in (1, 2):  # one after the other: two copies survive one loss at a time
            kill(plane, k)
            assert [r.shard for r in plane.heal()] == [k]
        assert plane.lost_rows == 0 and len(plane) == pushed
        for _ in range(10):
            b = plane.pull()
            for i, w in zip(b["id"].tolist(), b["_weight"].tolist(), strict=True):
                assert w == pytest.approx(before.get(i, w), rel=1e-5)
    finally:
        plane.close()


def test_without_replication_the_exact_loss_is_reported(cluster):
    plane = make_plane(cluster, capacity=3000, batch_size=64, replication=1, min_size=1)
    try:
        for k, node in enumerate(plane.nodes):
            plane.push(rows(40 + 10 * k, 100 * k), node=node)
        kill(plane, 2)
        with pytest.warns(RuntimeWarning, match="60 rows lost"):
            plane.pull()
        assert plane.lost_rows == 60
        assert [r.lost_rows for r in plane.recoveries] == [60]
        assert plane.stats()["lost_rows"] == 60 and len(plane) == 40 + 50
        assert drawn_ids(plane, 30) == set(range(40)) | set(range(100, 150))
        plane.push(rows(5, 900), node=plane.nodes[2])  # the re-created shard takes rows again
        assert plane.stats()["shards"][2]["rows"] == 5
    finally:
        plane.close()


def test_a_pull_that_needs_only_a_dead_shards_rows_never_hangs(cluster):
    import ray
    with make_plane(cluster, capacity=300, batch_size=16, num_shards=2) as plane:
        plane.push(rows(20), node=plane.nodes[0])
        before = ray.get(plane._shards.actors[0].gather.remote(0, np.arange(20)))
        kill(plane, 0)
        batch = plane.pull()  # waits for the restore from the replica on shard 1
        assert set(batch["id"].tolist()) <= set(range(20)) and plane.lost_rows == 0
        after = ray.get(plane._shards.actors[0].gather.remote(0, np.arange(20)))
        for name in ("obs", "id", "done", "_row_id"):  # every row back in its slot, intact
            np.testing.assert_array_equal(before[name], after[name])
        kill(plane, 0)
        try:  # too short for a new actor to start: the restore is left for the next call
            plane.heal(timeout=0.5)
        except ShardUnavailableError:
            assert plane._shards.unrestored
        plane.push(rows(5, 20), node=plane.nodes[0])  # finishes the restore, then writes
        assert plane.lost_rows == 0 and plane.stats()["shards"][0]["rows"] == 25
        assert not plane._shards.unrestored
    with make_plane(cluster, capacity=300, batch_size=16, num_shards=2,
                    replication=1) as plane:
        plane.push(rows(20), node=plane.nodes[0])
        kill(plane, 0)
        t0 = time.monotonic()
        # Its only copy is gone: the pull ends with a typed error within its timeout, an
        # EmptyBufferError after the restore, or ShardUnavailableError if the re-created
        # shard was not up in time.
        with warnings.catch_warnings(), \
                pytest.raises((EmptyBufferError, ShardUnavailableError)):
            warnings.simplefilter("ignore", RuntimeWarning)
            plane.pull(timeout=3.0)
        assert time.monotonic() - t0 < 3.0 + 15.0  # bounded by the timeout, with slack
        if plane.lost_rows == 0:
            with pytest.warns(RuntimeWarning, match="20 rows lost"):
                plane.heal()
        assert plane.lost_rows == 20 and len(plane) == 0


def test_on_policy_iteration_survives_a_kill_between_minibatches(cluster):
    plane = make_plane(cluster, capacity=60, mode="on_policy", num_minibatches=4)
    try:
        for k, node in enumerate(plane.nodes):
            plane.push(rows(20, 20 * k), node=node)
        it = plane.minibatches()
        ids = next(it)["id"].tolist()
        kill(plane, 0)
        for batch in it:
            check_rows(batch)
            ids += batch["id"].tolist()
        assert sorted(ids) == list(range(60)) and plane.lost_rows == 0
    finally:
        plane.close()


def test_removing_a_node_moves_its_shard_and_loses_nothing(cluster):
    extra = cluster.add_node(num_cpus=1, object_store_memory=96 << 20)
    cluster.wait_for_nodes()
    plane = make_plane(cluster, capacity=4000, batch_size=64, num_shards=4, min_size=1)
    try:
        [k] = [i for i, n in enumerate(plane.nodes) if n == extra.node_id]
        for i, node in enumerate(plane.nodes):
            plane.push(rows(30, 100 * i), node=node)
        cluster.remove_node(extra)
        pushed = set(np.concatenate([np.arange(100 * i, 100 * i + 30) for i in range(4)]).tolist())
        assert drawn_ids(plane, 40) == pushed
        assert plane.lost_rows == 0
        [rec] = plane.recoveries
        assert rec.shard == k and rec.new_node != extra.node_id and rec.lost_rows == 0
        assert plane.nodes[k] != extra.node_id
        plane.push(rows(3, 7000), node=plane.nodes[k])
        assert len(plane) == 123
    finally:
        plane.close()
