"""A failed push on the three-node test cluster says what became of its rows, and is never
stored later: what a caller reads to decide whether to push again, and the push whose inline
ingestion of other units failed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from conduit.distributed import ShardUnavailableError
from conduit.errors import OperatorError
from conduit.scheduling import Schedule
from tests.distributed.helpers import make_plane, rows

pytestmark = pytest.mark.ray


@contextlib.contextmanager
def answers_lost_once(plane) -> Iterator[dict[str, bool]]:
    """While inside, the first wait for the shards' answers raises
    :class:`ShardUnavailableError` once every holder applied the call (a write sent whose
    acknowledgement did not come in time). Yields the state (``"fired"``: it did)."""
    import ray
    shards = plane._shards
    get, state = shards.get, {"fired": False}

    def get_once_lost(refs, deadline, *, shard):
        if not state["fired"]:
            state["fired"] = True
            ray.wait(refs, num_returns=len(refs), timeout=30)
            raise ShardUnavailableError(-1 if shard is None else shard,
                                        "no answer within the call's timeout")
        return get(refs, deadline, shard=shard)
    shards.get = get_once_lost
    try:
        yield state
    finally:
        shards.get = get


def test_a_failed_on_policy_push_says_its_rows_were_stored(cluster):
    plane = make_plane(cluster, capacity=32, mode="on_policy", num_minibatches=2,
                       num_shards=2)
    try:
        with answers_lost_once(plane) as state, \
                pytest.raises(ShardUnavailableError) as info:
            plane.push(rows(16, 900), policy_version=0)
        assert state["fired"]
        # the holders were re-read: the rows are stored, so the caller does not push again
        assert (info.value.stored_rows, info.value.unsettled_rows) == (16, 0)
        plane.push(rows(16, 100), policy_version=0)
        ids = [i for b in plane.minibatches(timeout=30) for i in b["id"].tolist()]
        assert sorted(ids) == [*range(100, 116), *range(900, 916)]
    finally:
        plane.close()


def test_a_failed_off_policy_push_says_its_rows_may_have_landed(cluster):
    plane = make_plane(cluster, capacity=300, batch_size=8, min_size=1, num_shards=2)
    try:
        node = plane.nodes[0]
        with answers_lost_once(plane), pytest.raises(ShardUnavailableError) as info:
            plane.push(rows(5, 100), node=node)
        # sent and not re-read: the rows may be stored, a retry may store them twice
        assert (info.value.stored_rows, info.value.unsettled_rows) == (0, 5)
        plane.push(rows(5, 300), node=node)
        assert len(plane) == 10  # they had landed
    finally:
        plane.close()


def test_a_failed_ingestion_write_says_its_rows_may_have_landed(cluster):
    plane = make_plane(cluster, capacity=300, batch_size=8, min_size=1, num_shards=2)

    @plane.register_ingestion()
    def ing(actor_in, exp_out):
        exp_out.write(actor_in.read())
    try:
        node = plane.nodes[0]
        with answers_lost_once(plane), pytest.raises(OperatorError) as info:
            plane.push(rows(4, 100), node=node)
        err = info.value
        assert (err.lost_units, err.lost_rows) == (1, 4)
        assert (err.stored_rows, err.unsettled_rows) == (0, 4)
        assert "4 rows it wrote may still land" in str(err)
        assert isinstance(err.__cause__, ShardUnavailableError)
        plane.push(rows(4, 300), node=node)
        assert len(plane) == 8  # they had landed
    finally:
        plane.close()


def test_a_failed_on_policy_ingestion_write_says_its_rows_were_stored(cluster):
    plane = make_plane(cluster, capacity=32, mode="on_policy", num_minibatches=2,
                       num_shards=2, schedule=Schedule(0, 0.5, 0, 0.5))

    @plane.register_ingestion()
    def ing(actor_in, exp_out):
        exp_out.write(actor_in.read())
    try:
        with answers_lost_once(plane), pytest.raises(OperatorError) as info:
            plane.push(rows(16, 900), policy_version=0)
        err = info.value
        assert (err.stored_rows, err.unsettled_rows) == (16, 0)  # not to be pushed again
        plane.push(rows(16, 100), policy_version=0)
        ids = [i for b in plane.minibatches(timeout=30) for i in b["id"].tolist()]
        assert sorted(ids) == [*range(100, 116), *range(900, 916)]
    finally:
        plane.close()


def failing_first_invocation(plane) -> None:
    """Register an ingestion operator whose first invocation raises ``RuntimeError`` before
    it writes; later ones write every unit."""
    calls = [0]

    @plane.register_ingestion()
    def ing(actor_in, exp_out):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("the operator failed")
        for unit in actor_in.read_units():
            exp_out.write(unit)


def test_a_push_whose_inline_ingestion_of_other_units_fails_is_not_stored_later(cluster):
    plane = make_plane(cluster, capacity=100, batch_size=4, min_size=1, num_shards=2,
                       schedule=Schedule(0, 2, 0, 1))
    nodes = plane.nodes
    failing_first_invocation(plane)
    try:
        plane.push(rows(4, 0), node=nodes[0])  # acknowledged, queued
        with pytest.raises(OperatorError) as info:  # runs node 0's unit only, which fails
            plane.push(rows(4, 100), node=nodes[1])
        assert (info.value.lost_units, info.value.lost_rows) == (1, 4)
        assert plane._ingestion.idle()  # the push that raised left nothing queued
        plane.push(rows(4, 100), node=nodes[1])  # the caller retries it
        plane.flush(timeout=30)
        assert len(plane) == 4 and plane._ingress.counters["rows"] == 4  # stored once
        assert set(plane.pull(timeout=10)["id"].tolist()) <= {100, 101, 102, 103}
    finally:
        plane.close()  # node 0's loss was raised to the push: nothing more to report


def test_an_on_policy_push_whose_ingestion_of_other_units_fails_leaves_the_iteration(
        cluster):
    plane = make_plane(cluster, capacity=32, mode="on_policy", num_minibatches=2,
                       num_shards=2, schedule=Schedule(0, 0.5, 0, 0.5))
    nodes = plane.nodes
    failing_first_invocation(plane)
    try:
        plane.push(rows(8, 0), node=nodes[0], policy_version=0)  # queued: 16 rows are due
        with pytest.raises(OperatorError):  # runs node 0's unit only, which fails
            plane.push(rows(8, 8), node=nodes[1], policy_version=0)
        assert plane._gate.pushed == 0 and plane._ingestion.idle()
        for start in (0, 8, 16, 24):
            plane.push(rows(8, start), node=nodes[0], policy_version=0)
        ids = [i for b in plane.minibatches(timeout=30) for i in b["id"].tolist()]
        assert sorted(ids) == list(range(32))
    finally:
        plane.close()
