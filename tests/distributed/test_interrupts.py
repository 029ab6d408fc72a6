"""Interrupts (``KeyboardInterrupt``) and timeouts between a remote call being sent and its
acknowledgement, on the three-node test cluster: each is raised by the test at one exact point
(a wrapped method), and the plane must keep its counts, its rows and its iteration."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from conduit.distributed import ShardUnavailableError
from conduit.errors import CapacityError, DataLossError
from conduit.scheduling import Schedule
from tests.distributed.helpers import check_rows, make_plane, rows

pytestmark = pytest.mark.ray


def interrupting_ingestion(plane, at_call: int) -> None:
    """Register an ingestion operator that writes each unit, but raises
    ``KeyboardInterrupt`` after the first unit of its ``at_call``-th invocation."""
    calls = [0]

    @plane.register_ingestion()
    def ing(actor_in, exp_out):
        calls[0] += 1
        for k, unit in enumerate(actor_in.read_units()):
            if calls[0] == at_call and k == 1:
                raise KeyboardInterrupt
            exp_out.write(unit)


def test_an_interrupted_inline_ingestion_is_counted_and_the_plane_goes_on(cluster):
    plane = make_plane(cluster, capacity=300, batch_size=4, min_size=1, num_shards=2,
                       schedule=Schedule(0, 4, 0, 1))
    interrupting_ingestion(plane, at_call=1)
    try:
        for k in range(3):
            plane.push(rows(4, 4 * k))  # acknowledged, queued
        with pytest.raises(KeyboardInterrupt):
            plane.push(rows(4, 12))  # runs the invocation of all four units inline
        assert plane._ingestion.idle()  # nothing left counted as being ingested
        assert plane.stats()["ingestion"]["lost_units"] == 3  # the interrupted push's not
        for k in range(4, 8):
            plane.push(rows(4, 4 * k))
        plane.flush(timeout=30)
        plane.set_schedule(Schedule(1, 4, 0, 1))
        plane.push(rows(4, 100))
        plane.flush(timeout=30)  # the overlapped thread finds no unit stuck in flight
        check_rows(plane.pull())
    finally:
        with pytest.raises(DataLossError) as info:
            plane.close()
    assert info.value.lost_units == 3 and info.value.lost_rows == 12


def test_an_interrupted_on_policy_ingestion_leaves_the_iteration(cluster):
    plane = make_plane(cluster, capacity=32, mode="on_policy", num_minibatches=2,
                       num_shards=2, schedule=Schedule(0, 0.5, 0, 0.5))
    interrupting_ingestion(plane, at_call=1)
    try:
        plane.push(rows(8, 0), policy_version=0)  # queued: an invocation takes 16 rows
        with pytest.raises(KeyboardInterrupt):
            plane.push(rows(8, 8), policy_version=0)
        assert plane._gate.pushed == 0 and plane._gate.rows == 0 and len(plane) == 0
        for start in (0, 8, 16, 24):
            plane.push(rows(8, start), policy_version=0)
        ids = [i for b in plane.minibatches(timeout=30) for i in b["id"].tolist()]
        assert sorted(ids) == list(range(32))
    finally:
        with pytest.raises(DataLossError) as info:
            plane.close()
    assert info.value.lost_units == 1 and info.value.lost_rows == 8


def on_policy_plane(cluster, **kwargs):
    kwargs.setdefault("num_minibatches", 4)
    return make_plane(cluster, capacity=32, mode="on_policy", num_shards=2, replication=2,
                      **kwargs)


def test_an_on_policy_push_that_timed_out_after_it_was_sent_counts_once(cluster):
    plane = on_policy_plane(cluster, num_minibatches=2)
    try:
        with pytest.raises(ShardUnavailableError) as info:
            plane.push(rows(8, 900), policy_version=0, timeout=0.0)  # sent, not acknowledged
        # the holders applied it: it is stored and counts against the iteration
        assert plane._gate.pushed == 8 and plane._gate.rows == 8 and len(plane) == 8
        assert (info.value.stored_rows, info.value.unsettled_rows) == (8, 0)
        assert "call's timeout" in str(info.value)  # the push's, not the plane's 60 s
        for start in (100, 108, 116):
            plane.push(rows(8, start), policy_version=0)
        ids = [i for b in plane.minibatches(timeout=30) for i in b["id"].tolist()]
        assert sorted(ids) == [*range(100, 124), *range(900, 908)]
    finally:
        plane.close()


def test_an_on_policy_push_interrupted_after_it_was_sent_counts_once(cluster):
    import ray
    plane = on_policy_plane(cluster, num_minibatches=2)
    shards = plane._shards
    get, fired = shards.get, []

    def interrupted_get(refs, deadline, *, shard):
        if not fired:  # the write was sent; Ctrl-C lands in the wait for its answer
            fired.append(True)
            ray.wait(refs, num_returns=len(refs), timeout=30)
            raise KeyboardInterrupt
        return get(refs, deadline, shard=shard)
    try:
        shards.get = interrupted_get
        with pytest.raises(KeyboardInterrupt):
            plane.push(rows(8, 900), policy_version=0)
        assert plane._gate.pushed == 8 and plane._gate.rows == 8 and len(plane) == 8
        for start in (100, 108, 116):
            plane.push(rows(8, start), policy_version=0)
        ids = [i for b in plane.minibatches(timeout=30) for i in b["id"].tolist()]
        assert sorted(ids) == [*range(100, 124), *range(900, 908)]
    finally:
        shards.get = get
        plane.close()


def pull_iteration(plane, version: int) -> tuple[list[int], list[str]]:
    """Pull until the plane moves past ``version``, catching interrupts as a learner would;
    the ids delivered and what each pull did."""
    ids, log = [], []
    for _ in range(12):
        try:
            ids += plane.pull(timeout=30)["id"].tolist()
            log.append("batch")
        except KeyboardInterrupt:
            log.append("interrupt")
        if plane.policy_version > version:
            break
    return ids, log


@contextlib.contextmanager
def failing_once_in_clear(plane, error: BaseException, *, landed: str
                          ) -> Iterator[dict[str, bool]]:
    """While inside, the first wait for the shards' answers within an on-policy clear raises
    ``error``, once the clears were sent and ``landed`` (``"one"`` or ``"all"``) of them were
    applied. Yields the state (``"fired"``: it did); the plane's methods are put back on
    exit."""
    import ray
    rep, shards = plane._replicator, plane._shards
    clear_all, get = rep.clear_all, shards.get
    state = {"in_clear": False, "fired": False}

    def clear_once_failing(deadline):
        state["in_clear"] = True
        try:
            return clear_all(deadline)
        finally:
            state["in_clear"] = False

    def get_once_failing(refs, deadline, *, shard):
        if state["in_clear"] and not state["fired"]:
            state["fired"] = True
            ray.wait(refs, num_returns=1 if landed == "one" else len(refs), timeout=30)
            raise error
        return get(refs, deadline, shard=shard)
    rep.clear_all, shards.get = clear_once_failing, get_once_failing
    try:
        yield state
    finally:
        rep.clear_all, shards.get = clear_all, get


def test_an_interrupted_clear_is_finished_by_the_next_pull(cluster):
    plane = on_policy_plane(cluster)
    try:
        with failing_once_in_clear(plane, KeyboardInterrupt(), landed="one") as state:
            for k in range(4):
                plane.push(rows(8, 8 * k), policy_version=0)
            ids, log = pull_iteration(plane, 0)
            assert state["fired"] and log == ["batch"] * 3 + ["interrupt", "batch"]
            assert sorted(ids) == list(range(32)) and plane.policy_version == 1
            for k in range(4):
                plane.push(rows(8, 100 + 8 * k), policy_version=1)
            ids, log = pull_iteration(plane, 1)
            assert sorted(ids) == list(range(100, 132)) and log == ["batch"] * 4
    finally:
        plane.close()


def test_an_interrupt_after_a_mini_batch_is_formed_keeps_it(cluster):
    plane = on_policy_plane(cluster)
    port = plane.learner_port
    plan, fired = port._plan, []

    def interrupted_plan():
        if port._position == (0, 0, 1) and not fired:
            fired.append(True)  # the prefetch after the first mini-batch was formed
            raise KeyboardInterrupt
        return plan()
    try:
        port._plan = interrupted_plan
        for k in range(4):
            plane.push(rows(8, 8 * k), policy_version=0)
        ids, log = pull_iteration(plane, 0)
        assert fired and log == ["interrupt"] + ["batch"] * 4
        assert sorted(ids) == list(range(32)) and plane.policy_version == 1
    finally:
        plane.close()


def test_an_interrupted_push_of_another_node_leaves_its_unit_unqueued(cluster):
    plane = make_plane(cluster, capacity=100, batch_size=4, min_size=1, num_shards=2,
                       schedule=Schedule(0, 2, 0, 1))
    nodes = plane.nodes
    calls = [0]

    @plane.register_ingestion()
    def ing(actor_in, exp_out):
        calls[0] += 1
        for unit in actor_in.read_units():
            if calls[0] == 1:
                raise KeyboardInterrupt
            exp_out.write(unit)
    try:
        plane.push(rows(4, 0), node=nodes[0])  # acknowledged, queued
        with pytest.raises(KeyboardInterrupt):  # runs node 0's unit only, interrupted
            plane.push(rows(4, 100), node=nodes[1])
        assert plane._ingestion.idle()  # the push that raised left nothing queued
        plane.push(rows(4, 100), node=nodes[1])  # the caller retries it
        plane.flush(timeout=30)
        assert len(plane) == 4 and plane._ingress.counters["rows"] == 4  # stored once
        assert set(plane.pull(timeout=10)["id"].tolist()) <= {100, 101, 102, 103}
    finally:
        with pytest.raises(DataLossError) as info:
            plane.close()
    assert info.value.lost_units == 1 and info.value.lost_rows == 4


def test_a_push_waiting_for_the_next_iteration_finishes_a_failed_clear(cluster):
    import threading
    import time

    plane = on_policy_plane(cluster)
    result = {}

    def next_version_push():
        start = time.monotonic()
        try:
            plane.push(rows(8, 100), policy_version=1, timeout=6)
            result["outcome"] = "stored"
        except Exception as exc:
            result["outcome"] = type(exc).__name__
        result["seconds"] = time.monotonic() - start
    try:
        # the clears land; no answer in time
        with failing_once_in_clear(plane, ShardUnavailableError(
                0, "no answer within the call's timeout"), landed="all"):
            for k in range(4):
                plane.push(rows(8, 8 * k), policy_version=0)
            for _ in range(3):
                plane.pull(timeout=30)
            pusher = threading.Thread(target=next_version_push)
            pusher.start()
            time.sleep(0.5)  # the push waits in the gate for iteration 0 to be consumed
            with pytest.raises(ShardUnavailableError):
                plane.pull(timeout=30)  # the last mini-batch; its clear fails
            pusher.join(30)
            assert result["outcome"] == "stored" and result["seconds"] < 4  # not its timeout
            assert plane.policy_version == 1 and plane._gate.pushed == 8
    finally:
        plane.close()


def test_minibatches_of_the_next_iteration_yield_only_its_own_rows(cluster):
    plane = on_policy_plane(cluster)
    try:
        # the last mini-batch's clear is interrupted
        with failing_once_in_clear(plane, KeyboardInterrupt(), landed="one") as state:
            for k in range(4):
                plane.push(rows(8, 8 * k), policy_version=0)
            first = []
            with pytest.raises(KeyboardInterrupt):
                for batch in plane.minibatches(timeout=30):
                    first.append(batch["id"].tolist())
            assert state["fired"] and len(first) == 3
            for k in range(4):
                plane.push(rows(8, 100 + 8 * k), policy_version=1)
            second = [batch["id"].tolist() for batch in plane.minibatches(timeout=30)]
            assert len(second) == 4  # iteration 0's last mini-batch is not among them
            assert sorted(i for ids in second for i in ids) == list(range(100, 132))
            assert plane.policy_version == 2
    finally:
        plane.close()


def test_a_timed_out_push_to_a_busy_shard_keeps_its_rows_until_settled(cluster):
    import time

    import ray
    plane = make_plane(cluster, capacity=32, mode="on_policy", num_minibatches=2,
                       replication=1, num_shards=1, timeout=3.0)

    def busy(actor_self):
        import time
        time.sleep(4.0)
        return 1
    try:
        plane.push(rows(8, 0), policy_version=0)
        busy_ref = plane._shards.actors[0].__ray_call__.remote(busy)
        time.sleep(0.3)
        start = time.monotonic()
        with pytest.raises(ShardUnavailableError) as info:
            plane.push(rows(8, 900), policy_version=0, timeout=0.5)  # sent, lands later
        # the re-read is bounded by the push's own timeout (plus a short grace), and the
        # rows it could not settle stay counted against the iteration
        assert time.monotonic() - start < 2.5
        assert (info.value.stored_rows, info.value.unsettled_rows) == (0, 8)
        assert plane._gate.pushed == 16 and plane._replicator.unsettled
        ray.get(busy_ref)
        for begin in (100, 108):
            plane.push(rows(8, begin), policy_version=0)  # settles it first: it landed
        assert plane._gate.pushed == 32 and plane._gate.rows == 32
        with pytest.raises(CapacityError):
            plane.push(rows(8, 116), policy_version=0)
        ids = [i for b in plane.minibatches(timeout=30) for i in b["id"].tolist()]
        assert sorted(ids) == [*range(8), *range(100, 116), *range(900, 908)]
    finally:
        plane.close()
