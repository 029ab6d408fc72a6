"""Checkpointing, schedule switches, timing records, operators, and ports."""

import threading
import time

import pytest
import torch

from conduit import ExperienceDataPlane, Schedule
from conduit.plane.flows import Signals, Staged
from tests.conftest import make_rows


def test_state_dict_round_trip_off_policy(small_spec):
    a = ExperienceDataPlane(spec=small_spec, capacity=50, batch_size=5, sampler="prioritized",
                            schedule=Schedule(1, 2, 1, 1), seed=3)
    for i in range(9):
        a.push(make_rows(small_spec, 7, start=7 * i))
    a.update_priorities(torch.arange(10), torch.linspace(0, 3, 10))
    state = a.state_dict()
    assert state["counters"]["ingested_units"] == 9  # pending units were flushed first
    b = ExperienceDataPlane(spec=small_spec, capacity=50, batch_size=5, sampler="prioritized",
                            seed=99)
    b.load_state_dict(state)
    a.close()
    assert len(b.buffer) == 50
    assert torch.equal(b.buffer.sampler.priorities(torch.arange(10)),
                       a.buffer.sampler.priorities(torch.arange(10)))
    assert b.buffer.writer.cursor == a.buffer.writer.cursor
    b.close()


def test_state_dict_round_trip_on_policy_mid_epoch(small_spec):
    def run(restore_after):
        p = ExperienceDataPlane(spec=small_spec, capacity=16, mode="on_policy",
                                num_minibatches=4, num_epochs=2, seed=1)
        p.push(make_rows(small_spec, 16), policy_version=0)
        got = [p.pull()["id"] for _ in range(restore_after)]
        if restore_after:
            state = p.state_dict()
            p.close()
            p = ExperienceDataPlane(spec=small_spec, capacity=16, mode="on_policy",
                                    num_minibatches=4, num_epochs=2, seed=1,
                                    schedule=Schedule(1, 1, 1, 0.25))
            p.load_state_dict(state)
        got += [p.pull()["id"] for _ in range(8 - restore_after)]
        assert p.policy_version == 1
        p.close()
        return got

    ref = run(0)
    for k in (1, 4, 5):
        assert all(torch.equal(x, y) for x, y in zip(ref, run(k)))


def _conduit_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("conduit-")}


def test_set_schedule_keeps_data(small_spec):
    before = _conduit_threads()  # other tests' planes may still await collection
    with ExperienceDataPlane(spec=small_spec, capacity=100, batch_size=4) as p:
        for i in range(5):
            p.push(make_rows(small_spec, 4, start=4 * i))
        p.set_schedule(Schedule(1, 3, 1, 2))
        for i in range(5, 10):
            p.push(make_rows(small_spec, 4, start=4 * i))
        p.flush()
        assert len(p.buffer) == 40 and p.schedule == Schedule(1, 3, 1, 2)
        p.pull()
        p.set_schedule(Schedule.inline())
        p.pull()
        assert _conduit_threads() <= before  # inline: this plane's workers are gone


def test_timing_records_every_invocation_and_window(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=100, batch_size=4,
                             schedule=Schedule(1, 2, 1, 2)) as p:
        for i in range(6):
            with p.timed("rollout"):
                rows = make_rows(small_spec, 4, start=4 * i)
            p.push(rows)
        p.flush()
        for _ in range(4):
            b = p.pull()
            with p.timed("update"):
                b["obs"].sum()
        t = p.timings
        assert t.count("rollout") == 6 and t.count("update") == 4
        assert t.count("ingestion") == 3
        assert {r.units for r in t.records("ingestion")} == {2.0}
        assert {r.units for r in t.records("delivery")} == {2.0}
        assert t.count("push") == 6 and t.count("pull") == 4
        assert t.count("sync_ing") == 6 and t.count("sync_del") == 4


def test_operators_transform_and_prefetch_split(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=100, batch_size=5,
                             schedule=Schedule(0, 2, 0, 3)) as p:
        seen = []

        @p.register_ingestion(input="Actor", output="ExperienceBuffer")
        def ingest(actor_in, exp_out):
            seen.append(len(actor_in))
            d = actor_in.read()
            d["obs"] = d["obs"] * 2
            exp_out.write(d)

        @p.register_delivery(input="ExperienceBuffer", output="Learner")
        def deliver(exp_in, learn_out):
            d = exp_in.read()
            assert d["obs"].shape[0] == exp_in.batches * exp_in.batch_size == 15
            d["obs"] = d["obs"] + 1
            learn_out.write(d)

        for i in range(4):
            p.push(make_rows(small_spec, 5, start=5 * i))
        assert seen == [2, 2]
        b = p.pull()
        assert b["obs"].shape == (5, 4)
        assert torch.equal(b["obs"][:, 0], b["id"].float() * 2 + 1)
        p.pull()
        p.pull()
        assert p.stats()["invocations_del"] == 1


def test_an_inline_pull_hands_its_rows_straight_back(small_spec, monkeypatch):
    """Inline delivery with the identity operator: the rows a pull gathered are its batch,
    counted as delivered without passing through the stage; a batch the caller holds is not
    written by the next pull."""
    with ExperienceDataPlane(spec=small_spec, capacity=50, batch_size=6,
                             schedule=Schedule(0, 1, 0, 1), seed=2) as p:
        p.push(make_rows(small_spec, 50))
        flow = p._engine.flow
        monkeypatch.setattr(flow, "stage_locked", lambda *a: pytest.fail("staged"))
        held = p.pull()
        kept = {k: v.clone() for k, v in held.items()}
        for n in range(2, 5):
            b = p.pull()
            assert not flow.staged
            assert torch.equal(b["obs"][:, 0], b["id"].float())
            assert p.stats()["delivered_batches"] == p.stats()["invocations_del"] == n
        assert all(torch.equal(held[k], kept[k]) for k in kept)
        assert held["obs"].data_ptr() != b["obs"].data_ptr()
        # The pull records its own delivery with itself: one record each, the delivery
        # within the pull.
        t = p.timings
        assert t.count("delivery") == t.count("pull") == 4 and t.count("sync_del") == 0
        for d, pl in zip(t.records("delivery"), t.records("pull")):
            assert pl.start <= d.start and d.seconds <= pl.seconds and d.units == 1.0


def test_a_wake_reaches_a_waiting_thread_and_skips_a_condition_without_one():
    """Conditions count their waiters: a wake-up with none to wake does nothing, and one with a
    waiter reaches it (a lost wake-up would leave it waiting out its 30 s)."""
    sig = Signals()
    woke = threading.Event()

    def waiter():
        with sig.lock:
            sig.callers.wait(30)
        woke.set()

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while True:
        with sig.lock:
            if sig.callers.waiting == 1:
                assert sig.delivery.waiting == sig.ingestion.waiting == 0
                sig.wake(callers=True, ingestion=True, delivery=True)
                break
        assert time.monotonic() < deadline, "the waiter never waited"
        time.sleep(0.001)
    assert woke.wait(5)
    thread.join(5)
    assert sig.callers.waiting == 0


def test_an_inline_pull_stages_rows_a_priority_update_made_stale(small_spec, monkeypatch):
    """A priority update while a pull gathers makes its rows stale (max_priority_lag 0): they
    go to the stage, where they are discarded, and the pull draws again."""
    with ExperienceDataPlane(spec=small_spec, capacity=50, batch_size=4,
                             sampler="prioritized", schedule=Schedule(0, 1, 0, 1), seed=2) as p:
        p.push(make_rows(small_spec, 50))
        gather, drawn = p.buffer.gather, []

        def gather_then_update(info, **kw):
            drawn.append(info.indices.clone())
            if len(drawn) == 1:
                p.update_priorities(torch.arange(4), torch.full((4,), 5.0))
            return gather(info, **kw)

        monkeypatch.setattr(p.buffer, "gather", gather_then_update)
        b = p.pull()
        stats = p.stats()
        assert (stats["discarded_batches"], stats["delivered_batches"],
                stats["invocations_del"]) == (1, 1, 2)
        assert len(drawn) == 2 and torch.equal(b["_index"], drawn[1])
        assert not p._engine.flow.staged
        flow = p._engine.flow
        with p._engine.signals.lock:  # refused (nothing counted) behind a staged batch
            flow.staged.append(Staged({}, flow.priority_generation))
            assert not flow.hand_over_locked(flow.priority_generation)
            flow.staged.clear()
            assert not flow.hand_over_locked(flow.priority_generation - 1)  # stale
            assert p.stats()["delivered_batches"] == 1
            assert flow.hand_over_locked(flow.priority_generation)
            assert p.stats()["delivered_batches"] == 2


def test_ports_are_the_same_plane(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=20, batch_size=2) as p:
        p.actor_port.push(make_rows(small_spec, 4))
        assert p.learner_port.pull()["obs"].shape == (2, 4)


def test_auto_placement_uses_the_planner(small_spec):
    import pytest

    from conduit import ConfigError
    with ExperienceDataPlane(spec=small_spec, capacity=100, batch_size=4,
                             placement="auto") as p:
        d = p.placement_decision
        assert d is not None and p.buffer.placement == d.placement
        if not torch.cuda.is_available():
            assert d.placement.kind == "pageable"  # the only executable CPU tier here
        p.push(make_rows(small_spec, 8))
        assert p.pull()["obs"].shape == (4, 4)
    with pytest.raises(ConfigError, match="placement"):
        ExperienceDataPlane(spec=small_spec, capacity=100, batch_size=4, placement="gpu")
