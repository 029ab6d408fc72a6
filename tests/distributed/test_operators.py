"""The Fig. 8 operators and schedules on the sharded plane: the same rows and fields as a local
plane delivers for the same operators, overlapped and grouped ingestion that loses nothing,
operator failures that fail the calls depending on them until ``recover()``, typed schedule
errors."""

from __future__ import annotations

import threading
from fractions import Fraction

import pytest
import torch

from conduit.errors import (
    BackpressureTimeout,
    CapacityError,
    ConfigError,
    DataLossError,
    EmptyBufferError,
    OperatorError,
    ScheduleError,
    SpecError,
)
from conduit.plane import ExperienceDataPlane
from conduit.plane.ports import ActorIn, BufferIn, BufferOut, LearnerOut
from conduit.scheduling import Schedule
from conduit.spec import FieldSpec
from tests.distributed.helpers import SMALL, SPEC, rows

pytestmark = pytest.mark.ray

#: Buffer rows: the rollout's fields plus ``ret``, which the ingestion operator computes.
BUF = SPEC.with_field("ret", FieldSpec((), torch.float32))


def ingest(actor_in: ActorIn, exp_out: BufferOut) -> None:
    """Rows of the rollout with ``ret = 3·id + 1`` computed from them."""
    data = actor_in.read()
    exp_out.write({**data, "ret": data["obs"][:, 0] * 3 + 1})


def deliver(exp_in: BufferIn, learn_out: LearnerOut) -> None:
    """The sampled rows with an ``adv`` field added."""
    batch = exp_in.read()
    learn_out.write({**batch, "adv": batch["ret"] - batch["id"].float()})


def check(batch: dict[str, torch.Tensor]) -> None:
    """Both operators ran on every delivered row, which is intact."""
    ids = batch["id"].float()
    assert torch.equal(batch["obs"], ids[:, None].expand(-1, 4))
    assert torch.equal(batch["ret"], ids * 3 + 1)
    assert torch.equal(batch["adv"], ids * 2 + 1)


def sharded(cluster, **kwargs):
    """A plane of ``BUF`` rows on the test cluster (3 shards unless told)."""
    from conduit.distributed import RayExperienceDataPlane
    kwargs.setdefault("num_shards", 3)
    return RayExperienceDataPlane(spec=BUF, address=cluster.address, shard_resources=SMALL,
                                  timeout=30.0, **kwargs)


@pytest.fixture(scope="module")
def replay(cluster):
    """One off-policy 3-shard plane for the tests below (a shard actor takes seconds to start
    here); each test sets its own schedule and operators and pushes rows with its own ids."""
    plane = sharded(cluster, capacity=600, batch_size=16, seed=1)
    yield plane
    plane.close()  # raises DataLossError if a test left an acknowledged unit unstored


def with_operators(plane):
    plane.register_ingestion(input="Actor", output="ExperienceBuffer")(ingest)
    plane.register_delivery(input="ExperienceBuffer", output="Learner")(deliver)
    return plane


def by_id(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The batches' rows concatenated and sorted by id, without ``_index`` (plane-specific)."""
    cat = {k: torch.cat([b[k] for b in batches]) for k in batches[0] if k != "_index"}
    order = torch.argsort(cat["id"])
    return {k: v[order] for k, v in cat.items()}


def test_on_policy_operators_deliver_what_a_local_plane_delivers(cluster):
    kw = dict(capacity=60, mode="on_policy", num_minibatches=3, num_epochs=2, seed=3)
    local = with_operators(ExperienceDataPlane(spec=BUF, **kw))
    # a third of the iteration per invocation: each 20-row unit at its push
    plane = with_operators(sharded(cluster, **kw,
                                   schedule=Schedule(0, Fraction(1, 3), 1, Fraction(1, 3))))
    try:
        nodes = plane.nodes
        for i in range(3):  # one rollout of 20 rows from each node
            local.push(rows(20, 20 * i), policy_version=0)
            plane.actor_port(nodes[i]).push(rows(20, 20 * i), policy_version=0)
        assert [s["rows"] for s in plane.stats()["shards"]] == [20, 20, 20]
        got, want = list(plane.minibatches()), list(local.minibatches())
        assert len(got) == len(want) == 6
        assert [b.keys() for b in got] == [b.keys() for b in want]
        for epoch in (slice(0, 3), slice(3, 6)):  # every row once per epoch, as locally
            g, w = by_id(got[epoch]), by_id(want[epoch])
            assert g.keys() == w.keys() == {*BUF.fields, "adv"}
            for k in w:
                assert torch.equal(g[k], w[k]), k
            assert torch.equal(g["id"], torch.arange(60))
            check(g)
        assert plane.policy_version == local.policy_version == 1

        # Iteration 1: an inline ingestion failure is raised to the pusher (not kept), and a
        # delivery failure to the puller, whose share is drawn again by the next pull.
        calls = {"n": 0}

        def flaky(exp_in: BufferIn, learn_out: LearnerOut) -> None:
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("delivery hiccup")
            deliver(exp_in, learn_out)

        plane.register_ingestion()(failing(999))
        plane.register_delivery()(flaky)
        with pytest.raises(OperatorError, match="bad row 999") as err:
            plane.push(rows(20, 980), policy_version=1)
        assert (err.value.lost_units, err.value.lost_rows) == (1, 20)
        assert plane.failed is None
        for i in range(3):
            plane.actor_port(nodes[i]).push(rows(20, 100 + 20 * i), policy_version=1)
        got = [plane.pull()]
        with pytest.raises(OperatorError, match="delivery hiccup") as err:
            plane.pull()
        assert err.value.operator == "delivery"
        got += [plane.pull() for _ in range(5)]
        for epoch in (slice(0, 3), slice(3, 6)):
            g = by_id(got[epoch])
            assert torch.equal(g["id"], torch.arange(100, 160))  # still exactly once
            check(g)
        assert plane.policy_version == 2
    finally:
        plane.close()
        local.close()


@pytest.mark.parametrize("g_ing", [Fraction(1, 3), 1], ids=["g=1/3", "g=1"])
def test_on_policy_inline_ingestion_runs_per_share_of_the_iteration(cluster, g_ing):
    taken: list[int] = []

    def counted(actor_in: ActorIn, exp_out: BufferOut) -> None:
        taken.append(len(actor_in))
        ingest(actor_in, exp_out)

    plane = sharded(cluster, capacity=60, mode="on_policy", num_minibatches=3,
                    schedule=Schedule(0, g_ing, 0, Fraction(1, 3)))
    try:
        plane.register_ingestion()(counted)
        plane.push(rows(20, 0), policy_version=0)
        plane.push(rows(20, 20), policy_version=0)
        # a share of a third: each unit at its push; the whole iteration: once all is pushed
        assert plane.counters["rows"] == (40 if g_ing < 1 else 0)
        plane.push(rows(20, 40), policy_version=0)
        assert plane.counters["rows"] == 60
        assert taken == ([1, 1, 1] if g_ing < 1 else [3])  # units of one node together
        got = torch.cat([b["id"] for b in plane.minibatches()])
        assert sorted(got.tolist()) == list(range(60))
    finally:
        plane.close()


@pytest.mark.parametrize("overlap", [0, 1], ids=["inline", "overlapped"])
def test_a_failed_on_policy_invocation_leaves_no_row_in_the_iteration(cluster, overlap):
    """Defect: the front stored each write of an on-policy ingestion invocation at once, so an
    invocation that failed part way, or wrote fewer rows than its units hold, left rows in the
    iteration: pushed again, its rows landed twice, or the iteration never filled. Outputs are
    now stored once the operator returned having written exactly its units' rows."""
    faults = ["raise", "short"]

    def flaky(actor_in: ActorIn, exp_out: BufferOut) -> None:
        data = actor_in.read()
        full = {**data, "ret": data["obs"][:, 0] * 3 + 1}
        if int(data["id"][0]) == 20 and faults:
            fault = faults.pop(0)
            exp_out.write({k: v[:5] for k, v in full.items()})
            if fault == "raise":
                raise RuntimeError("scorer down")
            return  # wrote 5 of its 20 rows
        exp_out.write(full)

    plane = sharded(cluster, capacity=40, mode="on_policy", num_minibatches=2,
                    schedule=Schedule(overlap, Fraction(1, 2), 0, Fraction(1, 2)))
    try:
        plane.register_ingestion()(flaky)
        plane.push(rows(20, 0), policy_version=0)
        plane.flush()
        for cause in (RuntimeError, SpecError):
            with pytest.raises(OperatorError) as ei:
                plane.push(rows(20, 20), policy_version=0)
                plane.flush()
            assert isinstance(ei.value.__cause__, cause)
            plane.recover()
            assert len(plane) == 20 and plane.counters["rows"] == 20
        plane.push(rows(20, 20), policy_version=0)  # the same rollout again
        got = torch.cat([b["id"] for b in plane.minibatches()])
        assert sorted(got.tolist()) == list(range(40))
    finally:
        plane.close()


@pytest.mark.parametrize("g_ing", [Fraction(1, 3), 1], ids=["g=1/3", "g=1"])
def test_on_policy_overlapped_ingestion_is_exactly_once_across_two_ranks(cluster, g_ing):
    gate = threading.Event()
    taken: list[int] = []

    def held(actor_in: ActorIn, exp_out: BufferOut) -> None:
        taken.append(len(actor_in))
        gate.wait(20)  # the rollout that follows is pushed meanwhile
        ingest(actor_in, exp_out)

    plane = sharded(cluster, capacity=60, mode="on_policy", num_minibatches=3, num_epochs=2,
                    num_learners=2, seed=9, schedule=Schedule(1, g_ing, 1, Fraction(1, 3)))
    try:
        plane.register_ingestion()(held)
        plane.register_delivery()(deliver)
        nodes = plane.nodes
        for version in range(2):
            base = 1000 * version
            for k, node in enumerate(nodes):  # each returns once queued
                plane.actor_port(node).push(rows(20, base + 20 * k), policy_version=version)
            if version == 0:
                assert plane.counters["rows"] == 0  # ingestion overlaps the next rollouts
                # The iteration is full once pushed, before any row is stored ...
                with pytest.raises(CapacityError):
                    plane.push(rows(1, 999), policy_version=0)
                # ... and a newer policy waits for it to be consumed, at the push.
                with pytest.raises(BackpressureTimeout):
                    plane.push(rows(1, 998), policy_version=1, timeout=0.2)
                # Freshness: no mini-batch before all of the iteration's rows are stored.
                with pytest.raises(EmptyBufferError):
                    plane.learner(1).pull(timeout=0.3)
                gate.set()
            ranks = [plane.learner(0), plane.learner(1)]
            shares = [list(r.minibatches(timeout=30)) for r in ranks]
            assert plane.counters["rows"] == 60 * (version + 1)
            assert [s["rows"] for s in plane.stats()["shards"]] == [0, 0, 0]  # consumed
            epochs: list[list[int]] = [[], []]
            for m in range(6):
                a, b = shares[0][m], shares[1][m]
                check(a)
                check(b)
                assert not set(a["id"].tolist()) & set(b["id"].tolist())
                assert len(a["id"]) + len(b["id"]) == 20
                epochs[m // 3] += a["id"].tolist() + b["id"].tolist()
            for ids in epochs:  # every row exactly once per epoch over both ranks
                assert sorted(ids) == list(range(base, base + 60))
            assert plane.policy_version == version + 1
        assert taken == [1] * 6  # each unit ingested whole, on its own node's shard
        assert plane.stats()["schedule"] == Schedule(1, g_ing, 1, Fraction(1, 3)).to_dict()
        # A unit whose ingestion fails on the thread leaves the iteration: after recover()
        # the iteration takes as many rows again.
        plane.register_ingestion()(failing(2000))
        plane.push(rows(20, 2000), policy_version=2)
        with pytest.raises(OperatorError, match="bad row 2000"):
            plane.flush()
        assert plane.recover() is not None
        plane.register_ingestion()(ingest)
        for k, node in enumerate(nodes):
            plane.actor_port(node).push(rows(20, 3000 + 20 * k), policy_version=2)
        got = [b for r in (plane.learner(0), plane.learner(1)) for b in r.minibatches()]
        assert sorted(torch.cat([b["id"] for b in got]).tolist()) == \
            sorted(list(range(3000, 3060)) * 2)
        assert plane.policy_version == 3
    finally:
        gate.set()
        plane.close()


def test_overlapped_grouped_ingestion_and_delivery_match_a_local_plane(replay):
    plane = replay
    seen: list[int] = []

    def counting(actor_in: ActorIn, exp_out: BufferOut) -> None:
        seen.append(len(actor_in))
        ingest(actor_in, exp_out)

    schedule = Schedule(1, 3, 1, 2)
    local = ExperienceDataPlane(spec=BUF, capacity=400, batch_size=16, schedule=schedule)
    try:
        plane.set_schedule(schedule)
        for p in (local, plane):
            p.register_ingestion()(counting)
            p.register_delivery()(deliver)
        seen.clear()
        before = [s["rows"] for s in plane.stats()["shards"]]
        counters = dict(plane.counters)
        node = plane.nodes[1]
        for i in range(9):  # returns once queued; the thread ingests 3 units at a time
            plane.push(rows(7, 7 * i), node=node)
        plane.flush()
        assert seen == [3, 3, 3]  # g_ing units per invocation, all pushed on one node
        after = [s["rows"] for s in plane.stats()["shards"]]
        assert [b - a for a, b in zip(before, after, strict=True)] == [0, 63, 0]
        assert plane.counters == {"units": counters["units"] + 9,
                                  "rows": counters["rows"] + 63}
        for i in range(9):
            local.push(rows(7, 7 * i))
        local.flush()
        want = local.pull()
        for _ in range(6):
            b = plane.pull()
            assert {k: (v.dtype, v.shape) for k, v in b.items()} == \
                {k: (v.dtype, v.shape) for k, v in want.items()}
            check(b)
        assert plane.stats()["schedule"] == schedule.to_dict()
        assert plane.learner_port._next is not None  # the next invocation is in flight
    finally:
        local.close()


def failing(bad_id: int):
    """The ingestion operator, raising on a rollout that holds row ``bad_id``."""
    def op(actor_in: ActorIn, exp_out: BufferOut) -> None:
        data = actor_in.read()
        if bool((data["id"] == bad_id).any()):
            raise ValueError(f"bad row {bad_id}")
        ingest(actor_in, exp_out)
    return op


def test_a_failed_ingestion_fails_dependent_calls_until_recover(replay):
    plane = replay
    plane.set_schedule(Schedule(1, 1, 0, 1))
    plane.register_ingestion()(failing(1010))
    plane.register_delivery()(deliver)
    rows_before, lost_before = plane.counters["rows"], plane.stats()["ingestion"]["lost_rows"]
    plane.push(rows(5, 1000))
    plane.push(rows(5, 1010))  # acknowledged; its ingestion fails on the thread
    with pytest.raises(OperatorError, match="bad row 1010") as err:
        plane.flush()
    assert err.value.operator == "ingestion"
    assert (err.value.lost_units, err.value.lost_rows) == (1, 5)
    assert isinstance(err.value.__cause__, ValueError)
    kept = plane.failed  # the kept error; each call raises a copy of it
    assert kept is not None and kept.__cause__ is err.value.__cause__
    with pytest.raises(OperatorError) as again:
        plane.push(rows(5, 1020))
    assert again.value.__cause__ is kept.__cause__ and str(again.value) == str(kept)
    with pytest.raises(OperatorError):
        plane.pull()
    assert plane.recover() is kept
    assert plane.failed is None
    plane.push(rows(5, 1020))
    plane.flush()
    assert plane.counters["rows"] == rows_before + 10
    assert plane.stats()["ingestion"]["lost_rows"] == lost_before + 5
    check(plane.pull())


def test_schedule_and_port_errors_are_typed(cluster, replay):
    with pytest.raises(ScheduleError, match="g_del"):
        sharded(cluster, capacity=64, batch_size=8, g_max=4, schedule=Schedule(0, 1, 1, 5))
    with pytest.raises(ScheduleError, match="g_ing"):
        sharded(cluster, capacity=30, mode="on_policy", num_minibatches=3,
                schedule=Schedule(0, Fraction(1, 2), 0, Fraction(1, 3)))  # not a 1/M multiple
    with pytest.raises(ConfigError, match="schedule"):
        sharded(cluster, capacity=64, batch_size=8, schedule=(0, 1, 0, 1))
    with pytest.raises(ConfigError, match="prefetch"):
        sharded(cluster, capacity=64, batch_size=8, prefetch=False,
                schedule=Schedule(0, 1, 1, 1))
    plane = replay
    with pytest.raises(ConfigError, match="register_ingestion"):
        plane.register_ingestion(input="Learner")
    with pytest.raises(ConfigError, match="register_delivery"):
        plane.register_delivery(output="ExperienceBuffer")
    with pytest.raises(ScheduleError, match="g_ing"):
        plane.set_schedule(Schedule(0, 9, 0, 1))
    plane.register_ingestion()(ingest)
    plane.register_delivery()(deliver)
    plane.set_schedule(Schedule(0, 2, 0, 3))
    assert (plane.schedule, plane.prefetch) == (Schedule(0, 2, 0, 3), False)
    rows_before = plane.counters["rows"]
    plane.push(rows(8, 2000))  # inline, g_ing = 2: queued until the next push
    assert plane.counters["rows"] == rows_before
    import ray
    plane.push(ray.put(rows(8, 2008)))  # an actor's ObjectRef: fetched for the operator
    assert plane.counters["rows"] == rows_before + 16
    batch = plane.pull()  # one delivery invocation of 3 batches; this is the first
    assert batch["obs"].shape == (16, 4)
    assert len(plane.learner_port._staged) == 2
    check(batch)
    assert plane.learner_port._next is None  # no prefetch with overlap_del = 0
    plane.prefetch = True
    assert plane.schedule == Schedule(0, 2, 1, 3)


def test_close_stores_every_queued_unit(cluster):
    gate = threading.Event()

    def slow(actor_in: ActorIn, exp_out: BufferOut) -> None:
        gate.wait(10)
        ingest(actor_in, exp_out)

    plane = sharded(cluster, num_shards=1, replication=1, capacity=300, batch_size=8,
                    schedule=Schedule(1, 1, 0, 1))
    plane.register_ingestion()(slow)
    for i in range(3):  # one unit held in the operator, two queued: the queue is full
        plane.push(rows(5, 5 * i))
    with pytest.raises(BackpressureTimeout, match="2·g_ing"):
        plane.push(rows(5, 15), timeout=0.2)
    assert plane.counters["rows"] == 0
    gate.set()
    plane.close()  # drains the queue before the shards end
    assert plane.counters == {"units": 3, "rows": 15}
    assert plane.stats()["ingestion"]["lost_rows"] == 0


def test_an_unreported_failure_makes_close_report_the_lost_rows(cluster):
    gate = threading.Event()
    fail_on_0 = failing(0)

    def late(actor_in: ActorIn, exp_out: BufferOut) -> None:
        gate.wait(10)
        fail_on_0(actor_in, exp_out)

    plane = sharded(cluster, num_shards=1, replication=1, capacity=300, batch_size=4,
                    schedule=Schedule(1, 2, 0, 1))
    plane.register_ingestion()(late)
    plane.push(rows(3, 0))
    plane.push(rows(3, 3))  # one invocation over both units, which will fail
    plane.push(rows(3, 6))  # queued behind it; stored by close()
    gate.set()
    with pytest.raises(DataLossError) as err:
        plane.close()
    assert (err.value.lost_units, err.value.lost_rows) == (2, 6)
    assert isinstance(err.value.__cause__, OperatorError)
    assert plane.closed
    assert plane.counters == {"units": 3, "rows": 3}
