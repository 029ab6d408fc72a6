"""Checkpointing, schedule switches, timing records, operators, and ports."""

import threading

import torch

from conduit import ExperienceDataPlane, Schedule
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
