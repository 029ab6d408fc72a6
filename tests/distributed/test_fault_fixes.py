"""Regression tests of the sharded plane's fault handling on the three-node test cluster: a
push after one that timed out, all-or-nothing priority updates, a partly stored ingestion,
typed errors for bad input, copies kept identical (a restored replica, an unacknowledged
change), close() during a pull, a pushed ObjectRef whose object is gone, and row ids after a
shard is lost with no replica."""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch

from conduit.distributed import RayExperienceDataPlane, ShardUnavailableError
from conduit.distributed.sampling import encode
from conduit.errors import ConfigError, OperatorError, PlaneClosedError, PriorityError
from tests.distributed.helpers import SPEC, check_rows, kill, make_plane, rows

pytestmark = pytest.mark.ray


def held_ids(plane, owner: int) -> list[list[int]]:
    """The ``id`` column of ``owner``'s rows on each of its holders (primary first), in slot
    order."""
    import ray
    shards = plane._shards
    out = []
    for h in shards.holders(owner):
        actor = shards.actors[h]
        size = ray.get(actor.rows.remote(owner)).size
        got = ray.get(actor.gather.remote(owner, np.arange(size))) if size else {"id": []}
        out.append([int(i) for i in got["id"]])
    return out


def test_a_push_after_a_timed_out_push_is_stored(cluster):
    plane = make_plane(cluster, capacity=300, batch_size=8, min_size=1)
    try:
        node = plane.nodes[0]
        with pytest.raises(ShardUnavailableError):  # sent, not acknowledged
            plane.push(rows(5, 100), node=node, timeout=0.0)
        plane.push(rows(5, 300), node=node)  # acknowledged: must be stored
        copies = held_ids(plane, 0)
        assert all(c == copies[0] for c in copies)  # every holder the same
        counts = Counter(copies[0])
        assert all(counts[i] == 1 for i in range(300, 305))  # exactly once
        # the timed-out push was applied by the holders; the front now counts it
        assert set(counts) == set(range(100, 105)) | set(range(300, 305))
        assert len(plane) == 10 and plane._shards.held[0].total_written == 10
        plane.push(rows(5, 500), node=node)  # and the next one after it too
        assert Counter(held_ids(plane, 0)[0]) == Counter(
            [*range(100, 105), *range(300, 305), *range(500, 505)])
        drawn = set()
        for _ in range(20):
            batch = plane.pull()
            check_rows(batch)
            drawn |= set(batch["id"].tolist())
        assert drawn <= set(range(100, 105)) | set(range(300, 305)) | set(range(500, 505))
    finally:
        plane.close()


def test_a_refused_priority_update_changes_no_shard(cluster):
    import ray
    plane = make_plane(cluster, capacity=300, batch_size=8, min_size=1, sampler="prioritized")
    try:
        for k, node in enumerate(plane.nodes):
            plane.push(rows(10, 100 * k), node=node)
        shards = plane._shards

        def masses() -> list[float]:
            return [ray.get(shards.actors[h].rows.remote(o)).mass
                    for o in range(3) for h in shards.holders(o)]
        before = masses()
        idx = torch.from_numpy(np.concatenate([encode(0, np.arange(5)), encode(1, np.arange(5)),
                                               encode(2, np.arange(5))]))
        pr = torch.full((15,), 5.0, dtype=torch.float64)
        pr[5:10] = 1e300  # shard 1's rows: too large for a sum tree
        with pytest.raises(PriorityError, match="priorities"):
            plane.update_priorities(idx, pr)
        assert masses() == before  # all or nothing: shards 0 and 2 kept theirs too
        plane.update_priorities(idx, torch.full((15,), 5.0, dtype=torch.float64))
        assert masses() != before  # the same update with valid values goes through
    finally:
        plane.close()


def test_a_failed_ingestion_reports_the_rows_it_stored(cluster):
    plane = make_plane(cluster, capacity=300, batch_size=8, min_size=1)
    try:
        @plane.register_ingestion(input="Actor", output="ExperienceBuffer")
        def ingest(actor_in, exp_out):
            unit = actor_in.read()
            exp_out.write({k: v[:4] for k, v in unit.items()})  # stored
            raise RuntimeError("boom after a write")

        with pytest.raises(OperatorError) as info:
            plane.push(rows(6, 100), node=plane.nodes[0])
        plane.flush()  # nothing left queued
        err = info.value
        assert (err.lost_units, err.lost_rows, err.stored_rows) == (1, 6, 4)
        assert "4 rows the operator wrote before it raised stay" in str(err)
        assert len(plane) == 4
    finally:
        plane.close()


def test_bad_input_raises_typed_errors_naming_the_field(cluster):
    plane = make_plane(cluster, capacity=300, batch_size=8, min_size=1, sampler="prioritized")
    try:
        plane.push(rows(10), node=plane.nodes[0])
        batch = plane.pull()
        with pytest.raises(PriorityError, match="indices"):
            plane.update_priorities(None, None)
        with pytest.raises(PriorityError, match="priorities"):
            plane.update_priorities(batch["_index"], "abc")
        with pytest.raises(PriorityError, match="priorities"):
            plane.update_priorities(batch["_index"], torch.ones(8, dtype=torch.complex64))
        for call in (lambda: plane.push(rows(2), node=["n"]),
                     lambda: plane.learner(0, node=["n"]),
                     lambda: plane.actor_port(["n"])):
            with pytest.raises(ConfigError) as info:
                call()
            assert info.value.field == "node"
        assert len(plane) == 10  # nothing changed
    finally:
        plane.close()


def test_bad_shard_resources_are_refused_before_connecting():
    # nothing listens on this address: the argument is checked first
    with pytest.raises(ConfigError) as info:
        RayExperienceDataPlane(spec=SPEC, capacity=100, batch_size=8, shard_resources="x",
                               address="127.0.0.1:1")
    assert info.value.field == "shard_resources"


def test_a_restored_replica_applies_the_priority_updates_its_primary_applies(cluster):
    import ray
    plane = make_plane(cluster, capacity=12, batch_size=8, min_size=1, sampler="prioritized")
    try:
        shards = plane._shards
        node = plane.nodes[0]  # the driver's: its learner reads owner 0 from the primary

        def masses() -> list[float]:
            return [ray.get(shards.actors[h].rows.remote(0)).mass for h in shards.holders(0)]
        plane.push(rows(4, 100), node=node)  # fills shard 0's ring of 4
        for _ in range(3):
            plane.pull()  # the primary records the rows it delivered
        [replica] = shards.replicas[0]
        kill(plane, replica)
        assert [r.shard for r in plane.heal()] == [replica]  # a copy of the primary's ring
        plane.push(rows(4, 200), node=node)  # takes every slot
        for _ in range(3):
            plane.pull()
        plane.update_priorities(torch.from_numpy(encode(0, np.arange(4, 8))),
                                torch.full((4,), 50.0, dtype=torch.float64))
        after = masses()
        assert after[0] > 4.0 and after == [after[0]] * len(after)  # every copy the same
        assert sorted(shards.current(0)) == sorted(shards.holders(0))
        kill(plane, 0)  # the primary goes: its rows come back from the replica
        [rec] = plane.heal()
        assert rec.shard == 0 and rec.lost_rows == 0
        assert masses() == after  # the update survived
    finally:
        plane.close()


def test_close_during_a_pull_ends_it_and_recreates_no_shard(cluster):
    import ray
    plane = make_plane(cluster, capacity=300, batch_size=8, min_size=1)
    shards = plane._shards
    plane.push(rows(10), node=plane.nodes[0])
    real_get = shards.get
    entered, release = threading.Event(), threading.Event()

    def get(refs, deadline, *, shard):
        if threading.current_thread().name == "learner" and not release.is_set():
            entered.set()  # the pull waits on Ray, outside the front's lock
            release.wait(60)
            # what it waits for is answered by a shard close() ended
            got = real_get([*refs, shards.actors[0].ping.remote()], deadline, shard=shard)
            return got[:-1]
        return real_get(refs, deadline, shard=shard)
    shards.get = get
    outcome: list[object] = []

    def learn() -> None:
        try:
            plane.pull(timeout=30)
            outcome.append("batch")
        except Exception as exc:
            outcome.append(exc)
    thread = threading.Thread(target=learn, name="learner")
    thread.start()
    try:
        assert entered.wait(60)
        plane.close()
        actors = list(shards.actors)
        for actor in actors:  # the kill is asynchronous
            with pytest.raises(ray.exceptions.RayActorError):
                for _ in range(200):
                    ray.get(actor.ping.remote(), timeout=30)
    finally:
        release.set()
        thread.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], PlaneClosedError)
    assert plane.recoveries == [] and plane.lost_rows == 0  # no false loss
    assert shards.actors == actors  # nothing re-created after close
    with pytest.raises(PlaneClosedError):
        plane._replicator.heal(time.monotonic() + 30)
    assert shards.actors == actors


def test_pushing_an_object_ref_whose_object_is_gone_names_the_rollout(cluster):
    import ray

    @ray.remote(num_cpus=0)
    class Producer:
        def make(self, start: int) -> list:
            return [ray.put({k: v.numpy() for k, v in rows(5, start).items()})]

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    plane = make_plane(cluster, capacity=300, batch_size=8, min_size=1, timeout=20.0)
    try:
        shards = plane._shards
        # The producer's node holds no copy of shard 0: Ray frees a dead owner's objects
        # asynchronously, so a holder on the producer's node could still read the object
        # from its own node's store. Elsewhere, a read asks the dead owner and fails.
        [elsewhere] = set(shards.nodes) - {shards.nodes[h] for h in shards.holders(0)}
        producer = Producer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            node_id=elsewhere, soft=False)).remote()
        [gone] = ray.get(producer.make.remote(100))  # owned by the producer
        [kept] = ray.get(producer.make.remote(200))
        ray.kill(producer, no_restart=True)
        with pytest.raises(ray.exceptions.RayActorError):  # the kill is asynchronous
            for _ in range(200):
                ray.get(producer.make.remote(0), timeout=30)

        @ray.remote(num_cpus=0)
        def readable(refs: list) -> bool:
            """Whether any of ``refs`` can still be read."""
            for ref in refs:
                try:
                    ray.get(ref, timeout=10)
                except Exception:  # gone (or not served in time)
                    continue
                return True
            return False

        # The objects' only copies lie on the producer's node, freed there asynchronously
        # after the owner's death: until then a read from elsewhere may still be served.
        # A reader on that node (which copies nothing elsewhere) tells when they are gone.
        there = NodeAffinitySchedulingStrategy(node_id=elsewhere, soft=False)
        deadline = time.monotonic() + 60
        while ray.get(readable.options(scheduling_strategy=there).remote([gone, kept])):
            assert time.monotonic() < deadline, "Ray kept a dead owner's objects for 60 s"
            time.sleep(0.2)
        with pytest.raises(ConfigError) as info:  # the shard is fine; the rollout is not
            plane.push(gone, node=plane.nodes[0])
        assert info.value.field == "rollout"
        assert plane.recoveries == [] and len(plane) == 0
        with pytest.raises(ConfigError) as info:
            plane.push(kept, node=plane.nodes[0])
        assert info.value.field == "rollout"
        plane.push(rows(5, 300), node=plane.nodes[0])  # the shard takes rows as before
        assert held_ids(plane, 0) == [list(range(300, 305))] * 2
        # fetched to the front (an ingestion operator reads it): the same error
        plane.register_ingestion(input="Actor", output="ExperienceBuffer")(
            lambda actor_in, exp_out: exp_out.write(actor_in.read()))
        with pytest.raises(ConfigError) as info:
            plane.push(gone, node=plane.nodes[0])
        assert info.value.field == "rollout"
        assert plane.recoveries == [] and len(plane) == 5
    finally:
        plane.close()


def test_copies_that_differ_after_an_unacknowledged_change_are_made_the_same(cluster):
    import ray
    plane = make_plane(cluster, capacity=300, batch_size=8, min_size=1)
    try:
        node = plane.nodes[0]
        plane.push(rows(5, 100), node=node)
        shards = plane._shards
        [replica] = shards.replicas[0]
        # a change only the replica applied (as when the primary refused a write it could
        # not read), then not acknowledged
        ray.get(shards.actors[replica].write.remote(0, shards.ray.put(
            {k: v.numpy() for k, v in rows(5, 900).items()}), False, 5))
        plane._replicator._unsure.add(0)
        plane.push(rows(5, 300), node=node)
        assert held_ids(plane, 0) == [[*range(100, 105), *range(300, 305)]] * 2
        assert sorted(shards.current(0)) == sorted(shards.holders(0))
    finally:
        plane.close()


def test_a_priority_update_for_rows_lost_with_a_shard_skips_its_new_rows(cluster):
    import ray
    plane = make_plane(cluster, capacity=60, batch_size=8, min_size=1, replication=1,
                       sampler="prioritized")
    try:
        shards = plane._shards
        plane.push(rows(10, 100), node=plane.nodes[1])  # shard 1's ring holds 20
        old = torch.from_numpy(encode(1, np.arange(10)))  # its rows, delivered before...
        kill(plane, 1)
        with pytest.warns(RuntimeWarning, match="10 rows lost"):
            [rec] = plane.heal()  # ...it died with them
        assert rec.lost_rows == 10 and plane.lost_rows == 10
        plane.push(rows(10, 500), node=plane.nodes[1])  # new rows on the re-created shard
        before = ray.get(shards.actors[1].rows.remote(1))
        assert before.size == 10
        plane.update_priorities(old, torch.full((10,), 1000.0, dtype=torch.float64))
        assert ray.get(shards.actors[1].rows.remote(1)) == before  # no new row changed
        ids = set()
        for _ in range(10):
            batch = plane.pull()
            check_rows(batch)
            ids |= set(batch["_index"][batch["id"] >= 500].tolist())
        assert not ids & set(old.tolist())  # the new rows have ids of their own
    finally:
        plane.close()
