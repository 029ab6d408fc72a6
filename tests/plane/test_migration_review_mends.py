"""Migrations against the rest of the plane: one at a time across threads, fields a growth
adds reaching queued units and staged batches, interrupts while the workers stop, and bad
``spec`` arguments.

Every test checks behaviour (contents, errors, what the plane does next), never timings.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conduit import ExperienceDataPlane, Placement, Schedule
from conduit.errors import ConfigError, OperatorError
from conduit.placement import PlacementMap
from conduit.plane import data_plane, migration
from conduit.spec import ExperienceSpec, FieldSpec
from tests.plane.helpers import frozen_elsewhere
from tests.plane.test_migration import C_TRACE, contents, host_topology, trace_rows, trace_spec

NARROW = ExperienceSpec.of(rid=((), torch.int64), x=((3,), torch.float32))
WIDE = ExperienceSpec.of(rid=((), torch.int64), x=((4,), torch.float32))
IDS = ExperienceSpec.of(rid=((), torch.int64))
IDS_W = IDS.with_field("w", FieldSpec((2,), torch.float32))


def overlap_probe(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, int], threading.Event]:
    """Count the buffer moves running at once. The first move waits (briefly) inside, so a
    second migration that is not held back runs beside it; the returned event is set once the
    first move has started."""
    real, lock = migration.move_buffer, threading.Lock()
    state = {"active": 0, "most": 0, "calls": 0}
    entered, release = threading.Event(), threading.Event()

    def probe(*args, **kwargs):  # type: ignore[no-untyped-def]
        with lock:
            state["calls"] += 1
            state["active"] += 1
            state["most"] = max(state["most"], state["active"])
            first = state["calls"] == 1
        try:
            if first:
                entered.set()
                release.wait(0.5)  # a second move, if one starts, lets this one go on
            else:
                release.set()
            return real(*args, **kwargs)
        finally:
            with lock:
                state["active"] -= 1

    monkeypatch.setattr(migration, "move_buffer", probe)
    return state, entered


def wait_for(cond, what: str, limit: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.005)


# -- one migration at a time ----------------------------------------------------------------


def test_two_migrations_on_two_threads_run_one_after_the_other(monkeypatch):
    """A placement move and a growth started on two threads: the second starts from what the
    first left, so the growth is kept, and the unit queued before both is stored widened."""
    state, entered = overlap_probe(monkeypatch)
    with ExperienceDataPlane(spec=NARROW, capacity=64, batch_size=4, timeout=5,
                             schedule=Schedule(0, 4, 0, 1)) as plane:
        plane.push({"rid": torch.arange(20), "x": torch.zeros(20, 3)})
        plane.flush()
        plane.push({"rid": torch.tensor([1000, 1001]), "x": torch.ones(2, 3)})  # queued
        errors: list[BaseException] = []

        def move() -> None:
            try:
                plane.migrate(Placement.sharded(["cpu", "cpu"]), chunk_rows=3)
            except BaseException as exc:  # reported below
                errors.append(exc)

        mover = threading.Thread(target=move)
        mover.start()
        assert entered.wait(5)
        report = plane.migrate(Placement.pageable(), spec=WIDE)
        mover.join(10)
        assert not errors
        assert state["most"] == 1 and state["calls"] == 2
        assert report["rows"] == 20
        assert plane.spec == WIDE and plane.buffer.spec == WIDE
        assert plane.buffer.placement == Placement.pageable()
        plane.push({"rid": torch.tensor([2000]), "x": torch.full((1, 4), 2.0)})
        plane.flush()
        rows = contents(plane)
        by_id = dict(zip(rows["rid"].tolist(), rows["x"].tolist()))
        assert len(by_id) == 23
        assert by_id[1000] == [1.0, 1.0, 1.0, 0.0] and by_id[2000] == [2.0] * 4
        assert all(by_id[i] == [0.0] * 4 for i in range(20))


def test_grow_beside_a_migration_chooses_its_target_from_what_that_left(monkeypatch):
    state, entered = overlap_probe(monkeypatch)
    pmap = PlacementMap.build(capacity=C_TRACE, actor_device="cpu", learner_device="cpu",
                              topology=host_topology(), x_min=16, x_max=2000, points=16)
    with ExperienceDataPlane(spec=trace_spec(100), capacity=C_TRACE, batch_size=8, timeout=5,
                             placement=pmap, schedule=Schedule(0, 1, 0, 1)) as plane:
        plane.push(trace_rows(torch.arange(40), 92))
        errors: list[BaseException] = []

        def move() -> None:
            try:
                plane.migrate(Placement.pageable(), chunk_rows=7)
            except BaseException as exc:  # reported below
                errors.append(exc)

        mover = threading.Thread(target=move)
        mover.start()
        assert entered.wait(5)
        # the map puts the new size in the pinned region: from where the move left it
        report = plane.grow(spec=trace_spec(200))
        mover.join(10)
        assert not errors
        assert state["most"] == 1
        assert plane.spec == trace_spec(200)
        assert plane.buffer.placement == Placement.pinned()
        assert report["migrated"]
        assert report["from"] == Placement.pageable().to_dict()
        rows = contents(plane)
        assert rows["id"].tolist() == list(range(40))
        assert torch.equal(rows["obs"][:, :92], trace_rows(torch.arange(40), 92)["obs"])
        assert not rows["obs"][:, 92:].any()


def test_a_migration_waits_for_another_threads_pause_and_gives_up_unchanged():
    with ExperienceDataPlane(spec=NARROW, capacity=16, batch_size=4, timeout=0.3,
                             schedule=Schedule(1, 1, 1, 1)) as plane:
        plane.push({"rid": torch.arange(8), "x": torch.ones(8, 3)})
        plane.flush()
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with plane.paused():
                held.set()
                release.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(5)
        buffer = plane.buffer
        try:
            with pytest.raises(OperatorError, match="held the plane paused") as err:
                plane.migrate(Placement.sharded(["cpu", "cpu"]), spec=WIDE)
            assert err.value.operator == "runtime"
            with pytest.raises(OperatorError, match="held the plane paused"):
                plane.set_schedule(Schedule(0, 1, 0, 1))
        finally:
            release.set()
            holder.join(10)
        assert plane.buffer is buffer and plane.spec == NARROW
        assert plane.schedule == Schedule(1, 1, 1, 1)
        assert plane.failed is None
        plane.migrate(Placement.sharded(["cpu", "cpu"]), spec=WIDE)
        plane.push({"rid": torch.arange(8, 12), "x": torch.ones(4, 4)})
        plane.flush()
        assert sorted(contents(plane)["rid"].tolist()) == list(range(12))


def test_workers_run_after_a_migration_beside_another_threads_frozen_block():
    with ExperienceDataPlane(spec=IDS, capacity=32, batch_size=4, timeout=5,
                             schedule=Schedule(1, 1, 1, 1)) as plane:
        with frozen_elsewhere(plane):
            plane.migrate(Placement.sharded(["cpu", "cpu"]))
        plane.push({"rid": torch.arange(8)})
        plane.flush(timeout=5)
        assert sorted(contents(plane)["rid"].tolist()) == list(range(8))


# -- fields a growth adds -------------------------------------------------------------------


def test_units_queued_before_a_growth_get_the_fields_it_adds():
    with ExperienceDataPlane(spec=IDS, capacity=64, batch_size=4, timeout=5,
                             schedule=Schedule(0, 4, 0, 1)) as plane:
        for i in range(2):
            plane.push({"rid": torch.arange(i * 4, i * 4 + 4)})  # queued (g_ing=4)
        plane.migrate(Placement.pageable(), spec=IDS_W)
        plane.flush()
        rows = contents(plane)
        assert rows["rid"].tolist() == list(range(8))
        assert rows["w"].shape == (8, 2) and not rows["w"].any()
        assert plane.counters["pushed_rows"] == 8


def test_a_push_checked_before_a_growth_and_queued_after_gets_the_fields_it_adds(monkeypatch):
    with ExperienceDataPlane(spec=IDS, capacity=64, batch_size=4, timeout=5,
                             schedule=Schedule(0, 4, 0, 1)) as plane:
        real = data_plane.admit_rollout
        grown: list[dict] = []

        def admit_then_grow(*args, **kwargs):  # type: ignore[no-untyped-def]
            out = real(*args, **kwargs)
            if not grown:  # the growth lands between the push's check and its queueing
                grown.append(plane.migrate(Placement.pageable(), spec=IDS_W))
            return out

        monkeypatch.setattr(data_plane, "admit_rollout", admit_then_grow)
        plane.push({"rid": torch.arange(4)})
        assert grown
        plane.flush()
        rows = contents(plane)
        assert rows["rid"].tolist() == list(range(4))
        assert rows["w"].shape == (4, 2) and not rows["w"].any()


def _iteration_after_growth(schedule: Schedule) -> tuple[dict, list[dict]]:
    """Pull one mini-batch, grow the spec by a field (with batches staged, when delivery is
    overlapped), then pull the iteration's other three."""
    with ExperienceDataPlane(spec=IDS, capacity=16, mode="on_policy", num_minibatches=4,
                             schedule=schedule, timeout=5) as plane:
        plane.push({"rid": torch.arange(16)}, policy_version=0)
        first = plane.pull()
        held = {k: v.clone() for k, v in first.items()}
        if schedule.overlap_del:
            wait_for(lambda: plane.stats()["staged_batches"] >= 1, "staged a batch")
        plane.migrate(Placement.pageable(), spec=IDS_W)
        rest = [plane.pull() for _ in range(3)]
        # the batch the learner holds is left as it was handed over
        assert first.keys() == held.keys()
        assert all(torch.equal(first[k], held[k]) for k in held)
        return first, rest


def test_batches_staged_before_a_growth_get_the_fields_it_adds_under_every_schedule():
    runs = [_iteration_after_growth(s) for s in (Schedule(0, 1, 0, 0.25),
                                                 Schedule(0, 1, 1, 0.25))]
    for first, rest in runs:
        assert "w" not in first
        for batch in rest:
            assert set(batch) == {"_index", "rid", "w"}
            assert batch["w"].shape == (4, 2) and not batch["w"].any()
    (_, inline), (_, overlapped) = runs
    for a, b in zip(inline, overlapped):
        assert torch.equal(a["rid"], b["rid"]) and torch.equal(a["w"], b["w"])


# -- an interrupt while the workers stop ------------------------------------------------------


def test_workers_run_again_after_an_interrupt_while_a_migration_stops_them():
    """An interrupt (``KeyboardInterrupt``) while the migration waits for the ingestion
    worker's invocation to end: the migration raises it, the workers run again once that
    invocation returned, and nothing pushed is lost. The interrupt is raised from the wait
    itself, so it lands there on every run (a signal lands wherever the main thread next
    runs Python code)."""
    with ExperienceDataPlane(spec=IDS, capacity=100, batch_size=4, timeout=5,
                             schedule=Schedule(1, 1, 1, 1)) as plane:
        engine = plane._engine
        entered, release = threading.Event(), threading.Event()
        armed = [True]

        @plane.register_ingestion()
        def ingest(actor_in, exp_out):  # type: ignore[no-untyped-def]
            data = actor_in.read()
            if armed and armed.pop():
                entered.set()
                assert release.wait(10)  # in flight until the interrupted wait is over
            exp_out.write(data)

        plane.push({"rid": torch.arange(8)})
        assert entered.wait(5)
        runner = engine.ingestion
        waits: list[bool] = []

        def interrupted_join(timeout: float) -> None:
            waits.append(engine.runtime.stop)
            del runner.join  # the wait after this one is the runner's own
            threading.Timer(0.2, release.set).start()
            raise KeyboardInterrupt

        runner.join = interrupted_join  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            plane.migrate(Placement.sharded(["cpu", "cpu"]))
        assert waits == [True]  # interrupted while the workers were told to stop
        assert engine.ingestion is not runner and engine.ingestion.thread.is_alive()
        plane.push({"rid": torch.arange(8, 16)})
        plane.flush(timeout=5)
        assert sorted(contents(plane)["rid"].tolist()) == list(range(16))
        assert plane.failed is None
        assert plane.buffer.placement == Placement.pageable()  # the migration did not run


# -- bad spec arguments ---------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["abc", {"rid": 1}, {}, 0, [], IDS.to_dict()])
def test_migrate_refuses_a_spec_that_is_not_an_experience_spec(spec):
    with ExperienceDataPlane(spec=IDS, capacity=16, batch_size=4, timeout=5) as plane:
        plane.push({"rid": torch.arange(4)})
        buffer = plane.buffer
        with pytest.raises(ConfigError) as err:
            plane.migrate(Placement.sharded(["cpu", "cpu"]), spec=spec)
        assert err.value.field == "spec"
        assert plane.buffer is buffer and plane.spec == IDS
        assert plane.buffer.placement == Placement.pageable()


@pytest.mark.parametrize("spec", [None, "abc", {}, 0])
def test_grow_refuses_a_spec_that_is_not_an_experience_spec(spec):
    pmap = PlacementMap.build(capacity=C_TRACE, actor_device="cpu", learner_device="cpu",
                              topology=host_topology(), x_min=16, x_max=2000, points=16)
    with ExperienceDataPlane(spec=trace_spec(100), capacity=C_TRACE, batch_size=8, timeout=5,
                             placement=pmap) as plane:
        buffer = plane.buffer
        with pytest.raises(ConfigError) as err:
            plane.grow(spec=spec)
        assert err.value.field == "spec"
        assert plane.buffer is buffer and plane.spec == trace_spec(100)
