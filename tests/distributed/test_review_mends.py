"""Regression tests of reviewed defects of the sharded plane: a write that finds its shard dead
with no copy left, pushed ObjectRefs not made yet or whose task raised, priorities of rows no
longer held, where a shard is re-created, close() while a push waits on a shard, the address
of another cluster, and shard resources."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch

from conduit.distributed import (
    ClusterConnectionError,
    RayExperienceDataPlane,
    ShardResources,
    ShardUnavailableError,
)
from conduit.distributed._ray import connect
from conduit.distributed.cluster import ShardSet
from conduit.errors import ConfigError, PlaneClosedError, PriorityError
from conduit.scheduling import Schedule
from tests.distributed.helpers import SMALL, SPEC, check_rows, kill, make_plane, rows

pytestmark = pytest.mark.ray

PUSH_TIMEOUT = 40.0


def held_ids(plane, owner: int) -> list[int]:
    """The ``id`` column of ``owner``'s rows on its primary."""
    import ray
    actor = plane._shards.actors[owner]
    size = ray.get(actor.rows.remote(owner)).size
    return [int(i) for i in ray.get(actor.gather.remote(owner, np.arange(size)))["id"]] \
        if size else []


def wait_until_locked(plane) -> None:
    """Wait until another thread holds the front's lock (a push waiting on a shard)."""
    for _ in range(600):
        if not plane._lock.acquire(blocking=False):
            return
        plane._lock.release()
        time.sleep(0.05)
    raise AssertionError("no push took the front's lock")


# -- a write to a shard found dead with no copy left is stored in its fresh ring ------------
def test_a_push_to_a_dead_shard_without_replica_is_stored(cluster):
    plane = make_plane(cluster, capacity=300, batch_size=4, min_size=1, replication=1)
    try:
        for k, node in enumerate(plane.nodes):
            plane.push(rows(10, 10 * k), node=node)
        kill(plane, 1)
        with pytest.warns(RuntimeWarning, match="rows lost"):
            plane.push(rows(10, 100), node=plane.nodes[1])  # acknowledged: must be stored
        assert plane.lost_rows == 10
        assert held_ids(plane, 1) == list(range(100, 110))
        assert len(plane) == 30
        drawn = set()
        for _ in range(40):
            batch = plane.pull()
            check_rows(batch)
            drawn |= set(batch["id"].tolist())
        assert set(range(100, 110)) <= drawn
    finally:
        plane.close()


def test_a_queued_unit_for_a_dead_shard_without_replica_is_stored(cluster):
    plane = make_plane(cluster, capacity=300, batch_size=4, min_size=1, replication=1,
                       schedule=Schedule(0, 2, 1, 1))
    try:
        node = plane.nodes[1]
        plane.push(rows(5, 0), node=node)
        plane.push(rows(5, 5), node=node)  # the invocation of both writes to shard 1
        assert held_ids(plane, 1) == list(range(10))
        plane.push(rows(5, 100), node=node)  # acknowledged, queued
        kill(plane, 1)
        with pytest.warns(RuntimeWarning, match="rows lost"):
            plane.flush()
        assert held_ids(plane, 1) == list(range(100, 105))
        assert plane.lost_rows == 10 and len(plane) == 5
    finally:
        plane.close()  # nothing acknowledged was lost unreported: no DataLossError


# -- a pushed ObjectRef not made yet, or whose task raised --------------------------------
def test_a_pending_object_ref_times_out_without_wedging_the_shards(cluster):
    import ray

    @ray.remote(num_cpus=0)
    def slow_rollout():
        time.sleep(120)

    @ray.remote(num_cpus=0)
    def failed_rollout():
        raise ValueError("rollout worker crashed")

    plane = make_plane(cluster, capacity=60, batch_size=4, min_size=1, timeout=10.0)
    slow = slow_rollout.remote()
    try:
        for k, node in enumerate(plane.nodes):
            plane.push(rows(4, 10 * k), node=node)
        with pytest.raises(ConfigError) as err:
            plane.push(failed_rollout.remote())
        assert err.value.field == "rollout"
        with pytest.raises(ShardUnavailableError) as late:
            plane.push(slow, timeout=1.0)
        assert late.value.shard is None and "shard" not in str(late.value).split(":")[0]
        for k, node in enumerate(plane.nodes):  # every shard still answers
            plane.push(rows(2, 100 + 2 * k), node=node)
            check_rows(plane.pull())
        assert len(plane) == 18
    finally:
        ray.cancel(slow, force=True)
        plane.close()


def test_a_failed_object_ref_through_the_queue_is_a_config_error(cluster):
    import ray

    @ray.remote(num_cpus=0)
    def failed_rollout():
        raise ValueError("rollout worker crashed")

    plane = make_plane(cluster, capacity=60, batch_size=4, min_size=1,
                       schedule=Schedule(0, 2, 1, 1))
    try:
        with pytest.raises(ConfigError) as err:
            plane.push(failed_rollout.remote())
        assert err.value.field == "rollout"
    finally:
        plane.close()


# -- priorities of rows no longer held ----------------------------------------------------
def test_priorities_of_overwritten_rows_are_checked_and_do_not_raise_max_priority(cluster):
    plane = make_plane(cluster, capacity=16, batch_size=8, min_size=1, replication=2,
                       num_shards=2, sampler="prioritized", prefetch=False)
    try:
        plane.push(rows(8, 0), node=plane.nodes[0])
        plane.push(rows(8, 100), node=plane.nodes[1])
        drawn = plane.pull()
        plane.push(rows(8, 200), node=plane.nodes[0])  # every drawn row is overwritten
        plane.push(rows(8, 300), node=plane.nodes[1])
        with pytest.raises(PriorityError):  # refused wherever it falls
            plane.update_priorities(drawn["_index"][:1], torch.tensor([1e300]))
        plane.update_priorities(drawn["_index"], torch.full((8,), 1000.0))  # all skipped
        plane.push(rows(8, 400), node=plane.nodes[0])
        for _ in range(5):  # every row held has priority 1, the new ones too
            batch = plane.pull()
            assert torch.allclose(batch["_weight"], torch.ones(8))
    finally:
        plane.close()


# -- where a shard is re-created ----------------------------------------------------------
def test_a_rehomed_shard_avoids_the_nodes_of_the_owners_it_replicates():
    shards = ShardSet.__new__(ShardSet)
    shards.nodes = ["A", "B", "C", "D", "A"]
    shards.replicas = [[1], [2], [3], [4], [1]]
    # shard 2 (on C, dead) keeps shard 1's replica (on B); its own replica is on D
    assert shards._home(2, ["A", "B", "D"]) == "A"


# -- close() while a push waits on a shard ------------------------------------------------
def test_close_ends_a_push_waiting_on_a_shard(cluster):
    import ray

    @ray.remote(num_cpus=0)
    def slow_owner():
        time.sleep(120)
        return 99

    plane = make_plane(cluster, capacity=60, batch_size=4, min_size=1)
    slow = slow_owner.remote()
    try:
        # shard 1 is busy until ``slow`` is made: a push to it waits, holding the front's lock
        plane._shards.actors[1].rows.remote(slow)
        errors: list[BaseException] = []

        def push() -> None:
            try:
                plane.push(rows(3, 0), node=plane.nodes[1], timeout=PUSH_TIMEOUT)
            except BaseException as exc:
                errors.append(exc)
        t0 = time.monotonic()
        thread = threading.Thread(target=push)
        thread.start()
        wait_until_locked(plane)
        plane.close()
        thread.join(PUSH_TIMEOUT)
        assert time.monotonic() - t0 < PUSH_TIMEOUT  # neither waited out the push's timeout
        assert not thread.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], PlaneClosedError)
    finally:
        ray.cancel(slow, force=True)
        plane.close()


def test_close_ends_a_push_waiting_for_its_object_ref(cluster):
    import ray

    @ray.remote(num_cpus=0)
    def slow_rollout():
        time.sleep(120)

    plane = make_plane(cluster, capacity=60, batch_size=4, min_size=1)
    slow = slow_rollout.remote()
    try:
        errors: list[BaseException] = []

        def push() -> None:
            try:
                plane.push(slow, timeout=PUSH_TIMEOUT)
            except BaseException as exc:
                errors.append(exc)
        t0 = time.monotonic()
        thread = threading.Thread(target=push)
        thread.start()
        time.sleep(1.0)  # (the push waits for its object by now)
        plane.close()
        thread.join(PUSH_TIMEOUT)
        assert time.monotonic() - t0 < PUSH_TIMEOUT
        assert not thread.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], PlaneClosedError)
    finally:
        ray.cancel(slow, force=True)


# -- the address of another cluster -------------------------------------------------------
def test_another_address_while_connected_is_refused(cluster):
    with socket.socket() as other:  # something listens there, not this cluster's GCS
        other.bind(("127.0.0.1", 0))
        other.listen()
        address = f"127.0.0.1:{other.getsockname()[1]}"
        with pytest.raises(ClusterConnectionError) as err:
            RayExperienceDataPlane(spec=SPEC, capacity=30, batch_size=4, address=address,
                                   shard_resources=SMALL, timeout=10.0)
    assert err.value.address == address
    port = cluster.address.rpartition(":")[2]
    for same in ("auto", cluster.address, f"127.0.0.1:{port}", f"localhost:{port}"):
        assert connect(same, timeout_s=5.0)[1] is False  # this cluster: attached as it is
    plane = RayExperienceDataPlane(spec=SPEC, capacity=30, batch_size=4, address="auto",
                                   shard_resources=SMALL, timeout=10.0)
    plane.close()


# -- shard resources ----------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "field"), [
    ({"memory": True}, "shard_resources.memory"),
    ({"num_cpus": float("inf")}, "shard_resources.num_cpus"),
    ({"num_gpus": float("nan")}, "shard_resources.num_gpus"),
    ({"num_cpus": True}, "shard_resources.num_cpus"),
    ({"resources": {"CPU": 1}}, "shard_resources.resources"),
    ({"resources": ["buffer_host"]}, "shard_resources.resources"),
    ({"resources": {"x": -1}}, "shard_resources.resources['x']"),
    ({"resources": {"x": "a lot"}}, "shard_resources.resources['x']"),
    ({"resources": {"x": float("inf")}}, "shard_resources.resources['x']"),
])
def test_bad_shard_resources_are_config_errors(kwargs, field):
    with pytest.raises(ConfigError) as err:
        ShardResources(**kwargs)
    assert err.value.field == field


def test_shards_are_placed_on_nodes_with_their_resources(cluster):
    res = ShardResources(num_cpus=0.25, resources={"buffer_host": 1})
    with pytest.raises(ShardUnavailableError) as none:  # no node has it
        RayExperienceDataPlane(spec=SPEC, capacity=30, batch_size=4, address=cluster.address,
                               shard_resources=res, timeout=10.0)
    assert none.value.shard is None and str(none.value).startswith("no live node")
    extra = cluster.add_node(num_cpus=1, resources={"buffer_host": 2},
                             object_store_memory=96 << 20)
    cluster.wait_for_nodes()
    try:
        plane = RayExperienceDataPlane(spec=SPEC, capacity=30, batch_size=4, num_shards=2,
                                       address=cluster.address, shard_resources=res,
                                       timeout=30.0)
        try:
            assert plane.nodes == [extra.node_id, extra.node_id]
            plane.push(rows(4))
            check_rows(plane.pull())
        finally:
            plane.close()
    finally:
        cluster.remove_node(extra)


# -- on-policy: rows lost mid-epoch -------------------------------------------------------
def test_an_epoch_with_rows_lost_mid_way_starts_again(cluster):
    plane = make_plane(cluster, mode="on_policy", capacity=24, batch_size=24,
                       num_minibatches=4, num_epochs=1, replication=1)
    try:
        for k, node in enumerate(plane.nodes):
            plane.push(rows(8, 8 * k), policy_version=0, node=node)
        it = plane.minibatches()
        first = next(it)["id"].tolist()
        kill(plane, 0)
        with pytest.warns(RuntimeWarning, match="rows lost"):
            plane.heal()
        plane.push(rows(8, 500), policy_version=0, node=plane.nodes[0])  # taken again
        with pytest.warns(RuntimeWarning, match="starts the epoch again"):
            rest = [batch["id"].tolist() for batch in it]
        assert len(first) == 6 and len(rest) == 4  # the whole epoch, over the rows held now
        assert sorted(i for batch in rest for i in batch) == [*range(8, 24), *range(500, 508)]
        assert plane.learner_port.epoch_restarts == 1
    finally:
        plane.close()


_OWN_RAY_CLOSE = """
import threading, time, warnings
warnings.simplefilter("ignore")
import ray
from conduit.distributed import RayExperienceDataPlane, ShardResources
from conduit.errors import PlaneClosedError
from tests.distributed.helpers import SPEC

plane = RayExperienceDataPlane(spec=SPEC, capacity=200, batch_size=4, min_size=1, num_shards=2,
                               timeout=60.0, shard_resources=ShardResources(num_cpus=0.25))

@ray.remote(num_cpus=0)
def slow():
    time.sleep(60)

ref, out = slow.remote(), {}

def push():
    try:
        plane.push(ref, timeout=30)
        out["r"] = "returned"
    except BaseException as exc:  # SystemExit from a Ray shut down under it included
        out["r"] = exc

thread = threading.Thread(target=push, daemon=True)
thread.start()
time.sleep(1.5)
plane.close()
thread.join(25)
print("ALIVE" if thread.is_alive() else type(out["r"]).__name__, ray.is_initialized())
"""


def test_close_of_a_plane_with_its_own_ray_ends_a_waiting_push_before_ray_goes():
    """Defect: close() shut down the Ray the plane started while a push still waited for its
    ObjectRef outside the front's lock: the push got SystemExit(0) from ray.wait, or hung."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.abspath("src"), os.path.abspath("."), os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-c", _OWN_RAY_CLOSE], env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["PlaneClosedError", "False"], done.stdout


def test_an_object_ref_whose_owner_dies_before_its_task_ends_is_the_rollouts_error(cluster):
    """Defect: the holders' error for an argument whose owner died carries a nil object id,
    so it was taken for a dead shard: heal and re-send in a loop under the front's lock until
    the push's timeout, then ShardUnavailableError."""
    import ray

    @ray.remote(num_cpus=0)
    def slow_rollout():
        time.sleep(30)
        return {k: v.numpy() for k, v in rows(3, 0).items()}

    @ray.remote(num_cpus=0)
    class Producer:
        def make(self) -> list:
            return [slow_rollout.remote()]  # the actor owns the reference

    plane = make_plane(cluster, capacity=60, batch_size=4, min_size=1, timeout=20.0)
    try:
        producer = Producer.remote()
        [ref] = ray.get(producer.make.remote())
        ray.kill(producer, no_restart=True)
        with pytest.raises(ConfigError) as err:  # (was ShardUnavailableError at the timeout)
            plane.push(ref, timeout=15.0)
        assert err.value.field == "rollout"
        assert plane.recoveries == [] and len(plane) == 0
        plane.push(rows(2, 50))  # the shards take rows as before
        assert len(plane) == 2
    finally:
        plane.close()


def test_close_during_a_schedule_change_stores_the_running_invocations_units(cluster):
    """Defect: set_schedule took the ingestion thread out while its invocation over two
    acknowledged units still ran; close() found no thread, ended the shards under the
    invocation and reported nothing, and the change could start a thread after close."""
    plane = make_plane(cluster, capacity=2000, batch_size=4, min_size=1, num_shards=2,
                       schedule=Schedule(1, 2, 1, 1), timeout=20.0)

    @plane.register_ingestion()
    def slow(actor_in, exp_out):
        time.sleep(1.5)  # the invocation is in flight while the schedule changes
        for unit in actor_in.read_units():
            exp_out.write(unit)

    ingestion, join = plane._ingestion, plane._ingestion._join
    closing = threading.Event()

    def join_once_units_are_taken():  # timing only: the original join runs
        if threading.current_thread().name == "switcher" and not closing.is_set():
            plane.push(rows(3, 0))
            plane.push(rows(3, 3))  # two acknowledged units, taken by the worker
            while ingestion._units.inflight < 2:
                time.sleep(0.01)
            threading.Timer(0.2, closing.set).start()
        return join()

    ingestion._join = join_once_units_are_taken
    outcome: dict[str, BaseException | None] = {}

    def switch() -> None:
        try:
            plane.set_schedule(Schedule(0, 2, 1, 1))
            outcome["switch"] = None
        except BaseException as exc:
            outcome["switch"] = exc

    switcher = threading.Thread(target=switch, name="switcher")
    switcher.start()
    assert closing.wait(30)
    held: list[int] = []
    kill_all = plane._shards.kill_all

    def count_then_kill() -> None:
        import ray
        held.extend(ray.get(a.rows.remote(k)).size for k, a in enumerate(plane._shards.actors))
        kill_all()

    plane._shards.kill_all = count_then_kill
    plane.close()  # no DataLossError: the two units were stored
    switcher.join(30)
    assert sum(held) == 6 and plane.counters == {"units": 2, "rows": 6}
    assert outcome["switch"] is None or isinstance(outcome["switch"], PlaneClosedError)
    assert not [t for t in threading.enumerate() if t.name == ingestion.thread_name]


def test_a_shard_that_dies_again_while_it_is_re_created_is_healed_again(cluster):
    """Defect: a re-created shard that died before answering its first ping escaped heal()
    (and the push or pull that healed) as a raw ActorDiedError."""
    import ray

    plane = make_plane(cluster, capacity=60, batch_size=4, min_size=1, num_shards=2,
                       replication=2, timeout=30.0)
    try:
        for k, node in enumerate(plane.nodes):
            plane.push(rows(4, 10 * k), node=node)
        shards, heal = plane._shards, plane._shards.heal
        calls = []

        def dies_once_while_re_created(deadline: float):
            calls.append(1)
            if len(calls) == 1:  # the re-created actor dies before its ping answers
                kill(plane, 0)
                raise ray.exceptions.RayActorError()
            return heal(deadline)

        kill(plane, 0)
        shards.heal = dies_once_while_re_created
        recoveries = plane.heal()
        assert len(calls) == 2 and [r.shard for r in recoveries] == [0]
        assert len(plane) == 8 and plane.lost_rows == 0
    finally:
        plane.close()
