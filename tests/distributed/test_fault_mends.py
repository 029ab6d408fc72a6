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


def test_a_push_is_not_told_of_a_failed_invocation_over_other_units(cluster):
    """A push from node 1 ran an invocation over node 0's queued unit alone, which failed:
    the push raised (about rows it did not bring) while its own unit stayed queued and was
    stored later, so a retry stored it twice. The failure is not this push's: it goes on and
    stores its unit; ``close()`` reports node 0's unit, whose push returned."""
    from conduit.errors import DataLossError

    plane = make_plane(cluster, capacity=100, batch_size=4, min_size=1, num_shards=2,
                       schedule=Schedule(0, 2, 0, 1))
    nodes = plane.nodes
    failing_first_invocation(plane)
    closed = False
    try:
        plane.push(rows(4, 0), node=nodes[0])  # acknowledged, queued
        plane.push(rows(4, 100), node=nodes[1])  # runs node 0's unit (fails), then its own
        plane.flush(timeout=30)
        assert plane._ingestion.idle()
        assert len(plane) == 4 and plane._ingress.counters["rows"] == 4  # stored once
        assert set(plane.pull(timeout=10)["id"].tolist()) <= {100, 101, 102, 103}
        closed = True
        with pytest.raises(DataLossError) as lost:
            plane.close()
        assert (lost.value.lost_units, lost.value.lost_rows) == (1, 4)
    finally:
        if not closed:
            plane.close()


def test_an_on_policy_push_is_not_told_of_a_failed_invocation_over_other_units(cluster):
    from conduit.errors import DataLossError

    plane = make_plane(cluster, capacity=32, mode="on_policy", num_minibatches=2,
                       num_shards=2, schedule=Schedule(0, 0.5, 0, 0.5))
    nodes = plane.nodes
    failing_first_invocation(plane)
    closed = False
    try:
        plane.push(rows(8, 0), node=nodes[0], policy_version=0)  # queued: 16 rows are due
        plane.push(rows(8, 8), node=nodes[1], policy_version=0)  # node 0's unit fails
        assert plane._gate.pushed == 8  # node 0's unit left the iteration; its own stays
        for start in (16, 24, 0):
            plane.push(rows(8, start), node=nodes[0], policy_version=0)
        ids = [i for b in plane.minibatches(timeout=30) for i in b["id"].tolist()]
        assert sorted(ids) == list(range(32))
        closed = True
        with pytest.raises(DataLossError) as lost:
            plane.close()
        assert lost.value.lost_units == 1
    finally:
        if not closed:
            plane.close()
