"""The sharded plane on a real three-node Ray cluster: placement, per-node ingestion, the
frequencies of uniform and prioritized draws across shards, on-policy exactly-once."""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from conduit.distributed.sampling import ROW_BITS
from conduit.errors import (
    BackpressureTimeout,
    CapacityError,
    PlaneClosedError,
    SpecError,
    StaleRolloutError,
)
from conduit.storage import ExperienceBuffer, PrioritizedSampler
from tests.distributed.helpers import SPEC, check_rows, make_plane, rows

pytestmark = pytest.mark.ray


def owner_of(batch: dict[str, torch.Tensor]) -> np.ndarray:
    return (batch["_index"].numpy() >> ROW_BITS).astype(np.int64)


def test_uniform_draws_across_shards_follow_rows_pushed_per_node(cluster):
    import ray
    plane = make_plane(cluster, capacity=3000, batch_size=128, seed=5)
    try:
        nodes = plane.nodes
        assert len(set(nodes)) == 3  # one shard per node
        pinned = ray.get([a.node_id.remote() for a in plane._shards.actors])
        assert pinned == nodes
        per_node = {nodes[0]: 60, nodes[1]: 120, nodes[2]: 180}
        start = 0
        for node, n in per_node.items():  # actors on each node push to that node's shard
            plane.actor_port(node).push(rows(n, start))
            start += n
        assert [s["rows"] for s in plane.stats()["shards"]] == [60, 120, 180]
        assert [s["replicas_on"] for s in plane.stats()["shards"]] == [[1], [2], [0]]
        by_id: Counter[int] = Counter()
        by_shard = np.zeros(3)
        for _ in range(60):
            batch = plane.pull()
            check_rows(batch)
            owners = owner_of(batch)
            assert (owners == np.searchsorted([60, 180, 360], batch["id"].numpy(),
                                              side="right")).all()
            by_shard += np.bincount(owners, minlength=3)
            by_id.update(batch["id"].tolist())
        draws = by_shard.sum()
        assert stats.chisquare(by_shard, draws * np.array([60, 120, 180]) / 360).pvalue > 1e-3
        counts = np.array([by_id[i] for i in range(360)])
        assert stats.chisquare(counts, np.full(360, draws / 360)).pvalue > 1e-3
        assert plane.learner_port._next is not None  # the next batch is in flight
    finally:
        plane.close()


def test_a_payload_put_by_a_remote_actor_lands_on_its_nodes_shard(cluster):
    import ray
    plane = make_plane(cluster, capacity=300, batch_size=8)
    try:
        node = plane.nodes[2]

        @ray.remote(num_cpus=0)
        def rollout(start: int):
            # A remote actor puts its rows in its own node's object store.
            return [ray.put({k: v.numpy() for k, v in rows(10, start).items()}),
                    ray.get_runtime_context().get_node_id()]

        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        ref, where = ray.get(rollout.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            node_id=node, soft=False)).remote(100))
        assert where == node
        plane.push(ref, node=where)
        assert [s["rows"] for s in plane.stats()["shards"]] == [0, 0, 10]
        batch = plane.pull()
        check_rows(batch)
        assert set(batch["id"].tolist()) <= set(range(100, 110))
        for bad, field in ((ray.put({"obs": np.zeros((3, 5), np.float32)}), "obs"),
                           (ray.put([1, 2, 3]), None)):  # not even a mapping
            with pytest.raises(SpecError) as ei:
                plane.push(bad, node=where)
            assert ei.value.field == field
            assert plane.stats()["shards"][2]["rows"] == 10  # refused on every holder
    finally:
        plane.close()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_rows_every_holder_refuses_leave_no_unhandled_ray_error(cluster):
    """Defect: with replication, a push every holder refused raised the first holder's
    SpecError, and Ray logged the other holders' refusals as unhandled errors (nobody fetched
    them). Every holder's outcome is now fetched."""
    import ray

    seen = _Records()
    ray_log = logging.getLogger("ray._private.worker")
    ray_log.addHandler(seen)
    plane = make_plane(cluster, num_shards=2, replication=2, capacity=100, batch_size=4,
                       min_size=1)
    try:
        plane.push(rows(10))
        for bad in (ray.put({"obs": np.zeros((3, 5), np.float32)}), ray.put([1, 2, 3])):
            with pytest.raises(SpecError):
                plane.push(bad)
        assert sum(s["rows"] for s in plane.stats()["shards"]) == 10
        gc.collect()
        time.sleep(1.0)  # Ray reports an unfetched error when its reference goes
        assert not [m for m in seen.messages if "Unhandled error" in m]
        check_rows(plane.pull())
    finally:
        ray_log.removeHandler(seen)
        plane.close()


def test_counts_node_ids_and_priority_indices_are_checked(cluster):
    """Defects: rows pushed as an actor's ``ObjectRef`` were left out of
    ``stats()["counters"]["rows"]``; a push or an actor port for a node id not in the cluster
    was taken (the rows went to some shard) while ``learner(node=...)`` refused it; and a
    priority update for a row id its shard never wrote was dropped silently."""
    import ray

    from conduit.distributed.sampling import encode
    from conduit.errors import ConfigError, PriorityError

    plane = make_plane(cluster, capacity=300, batch_size=8, sampler="prioritized",
                       min_size=1)
    try:
        plane.push(rows(8))
        plane.push(ray.put({k: v.numpy() for k, v in rows(5, 100).items()}))
        assert plane.stats()["counters"]["rows"] == len(plane) == 13
        for bad in (lambda: plane.push(rows(2, 200), node="no-such-node"),
                    lambda: plane.actor_port("no-such-node")):
            with pytest.raises(ConfigError) as ei:
                bad()
            assert ei.value.field == "node"
        plane.actor_port(plane.nodes[1]).push(rows(2, 300))
        assert len(plane) == 15
        batch = plane.pull()
        owner = int(owner_of(batch)[0])
        never = torch.from_numpy(encode(owner, np.array([10**6])))
        with pytest.raises(PriorityError, match="names row 1000000"):
            plane.update_priorities(torch.cat([batch["_index"], never]),
                                    torch.full((len(batch["_index"]) + 1,), 5.0))
        plane.update_priorities(batch["_index"], torch.full((len(batch["_index"]),), 5.0))
        check_rows(plane.pull())
    finally:
        plane.close()


def test_prioritized_across_shards_matches_a_single_buffer(cluster):
    plane = make_plane(cluster, capacity=300, batch_size=64, sampler="prioritized", seed=2,
                       min_size=1)
    n = 45
    try:
        for k, node in enumerate(plane.nodes):
            plane.push(rows(15, 15 * k), node=node)

        def priority(ids: torch.Tensor) -> torch.Tensor:
            return (ids % 9 + 1).double() ** 1.5

        seen: set[int] = set()
        while len(seen) < n:  # give every row its priority, through delivered indices
            batch = plane.pull()
            plane.update_priorities(batch["_index"], priority(batch["id"]))
            seen.update(batch["id"].tolist())
        # The single-buffer reference: the same rows and priorities in one PER buffer.
        ref = ExperienceBuffer(spec=SPEC, capacity=n, sampler=PrioritizedSampler(seed=0))
        ref.extend(rows(n))
        ref.update_priorities(torch.arange(n), priority(torch.arange(n)))
        p_ref = ref.sampler.priorities(torch.arange(n)).numpy()
        p_ref = p_ref / p_ref.sum()
        ref_batch = ref.sample(4096)
        ref_weight = dict(zip(ref_batch["id"].tolist(), ref_batch["_weight"].tolist(),
                              strict=True))
        counts = np.zeros(n)
        for _ in range(80):
            batch = plane.pull()
            check_rows(batch)
            ids = batch["id"].numpy()
            counts += np.bincount(ids, minlength=n)
            for i, w in zip(ids.tolist(), batch["_weight"].tolist(), strict=True):
                assert w == pytest.approx(ref_weight.get(i, w), rel=1e-5)
        assert stats.chisquare(counts, counts.sum() * p_ref).pvalue > 1e-3
        # The same test rejects a uniform draw: it has the power to tell them apart.
        assert stats.chisquare(counts, np.full(n, counts.sum() / n)).pvalue < 1e-6
        # A new row gets the largest priority seen on any shard, as in one buffer.
        batch = plane.pull()
        first = int(np.nonzero(owner_of(batch) == 0)[0][0])
        plane.update_priorities(batch["_index"][first:first + 1], torch.tensor([100.0]))
        mass = plane._shards.held[2].mass
        plane.push(rows(2, 500), node=plane.nodes[2])
        sampler = ref.sampler
        leaf = (100.0 + sampler.eps) ** sampler.alpha
        assert plane._shards.held[2].mass - mass == pytest.approx(2 * leaf, rel=1e-9)
    finally:
        plane.close()


def test_on_policy_minibatches_are_exactly_once_across_shards_and_two_ranks(cluster):
    plane = make_plane(cluster, capacity=90, mode="on_policy", num_minibatches=3,
                       num_epochs=2, num_learners=2, timeout=20.0)
    try:
        with pytest.raises(CapacityError, match="an iteration's 90 rows"):
            plane.push(rows(91))
        for version in range(2):
            base = 1000 * version
            for k, node in enumerate(plane.nodes):
                plane.push(rows(30, base + 30 * k), node=node, policy_version=version)
            with pytest.raises(CapacityError):
                plane.push(rows(1, base + 999), policy_version=version)
            if version == 0:
                with pytest.raises(BackpressureTimeout):  # waits for iteration 0 to be consumed
                    plane.push(rows(1), policy_version=1, timeout=0.2)
            ranks = [plane.learner(0), plane.learner(1)]
            epochs: list[list[int]] = [[], []]
            first = []
            for b in ranks[0].minibatches():
                first.append(b)
                if len(first) == 2:
                    break  # a loop left early: the next call resumes, in this iteration
            shares = [first + list(ranks[0].minibatches()), list(ranks[1].minibatches())]
            assert [len(s) for s in shares] == [6, 6]
            for m in range(6):
                a, b = shares[0][m]["id"].tolist(), shares[1][m]["id"].tolist()
                check_rows(shares[0][m])
                assert not set(a) & set(b) and abs(len(a) - len(b)) <= 1
                assert len(a) + len(b) == 30
                epochs[m // 3] += a + b
            for ids in epochs:
                assert sorted(ids) == list(range(base, base + 90))
            assert epochs[0] != epochs[1]  # each epoch is reshuffled
            assert plane.policy_version == version + 1
        with pytest.raises(StaleRolloutError):
            plane.push(rows(3), policy_version=0)
    finally:
        plane.close()
    plane.close()  # idempotent
    with pytest.raises(PlaneClosedError):
        plane.pull()
    with pytest.raises(PlaneClosedError):
        plane.push(rows(3))


def test_two_off_policy_ranks_pull_independently_while_actors_push(cluster):
    import threading
    plane = make_plane(cluster, capacity=2000, batch_size=32, num_shards=2, num_learners=2,
                       min_size=32)
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def learner(rank: int) -> None:
        try:
            port = plane.learner(rank)
            for _ in range(15):
                batch = port.pull(timeout=30)
                check_rows(batch)
                got[rank].append(batch["id"])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=learner, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for i in range(20):  # actors on both nodes keep pushing while the learners pull
            plane.push(rows(16, 16 * i), node=plane.nodes[i % 2])
        for t in threads:
            t.join(60)
        assert not errors and all(len(v) == 15 for v in got.values())
        assert len(plane) == 320 and plane.counters == {"units": 20, "rows": 320}
        a, b = torch.cat(got[0]), torch.cat(got[1])
        assert not torch.equal(a, b)  # each rank draws its own samples
        assert set(a.tolist()) | set(b.tolist()) <= set(range(320))
        with pytest.raises(ValueError, match="rank"):
            plane.learner(2)
    finally:
        plane.close()


def test_a_timeout_shorter_than_a_shards_start_still_starts_the_plane(cluster, monkeypatch):
    """The shards' start (a Ray worker process each, torch imported) is given
    SHARD_START_S whatever the plane's timeout; the calls after it keep the timeout."""
    from conduit.distributed.cluster import SHARD_START_S, ShardSet

    given: list[float] = []
    real_get = ShardSet.get

    def get(self, refs, deadline, *, shard):
        given.append(deadline - time.monotonic())
        return real_get(self, refs, deadline, shard=shard)

    monkeypatch.setattr(ShardSet, "get", get)
    plane = make_plane(cluster, capacity=30, batch_size=4, timeout=0.5)
    try:
        assert SHARD_START_S - 5 < given[0] <= SHARD_START_S  # the start's ping
        assert plane.timeout == 0.5
        started = len(given)
        plane.push(rows(8))
        assert given[started:] and all(left <= 0.5 for left in given[started:])
    finally:
        plane.close()
