"""Faults at the edges of the local plane's contracts: a loss reported only to another caller,
a push that straddles a migration, and a dropped plane that a snapshotter still refers to.
Each test names the defect it guards."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from conduit import (
    BackpressureTimeout,
    DataLossError,
    EmptyBufferError,
    ExperienceDataPlane,
    ExperienceSpec,
    OperatorError,
    Placement,
    PlaneClosedError,
    Schedule,
)
from conduit.plane.checkpoint import Snapshotter
from conduit.plane.flows import Unit
from tests.conftest import make_rows
from tests.plane.helpers import refusing_ingestion, stored_ids


def _push_on_another_thread(plane: ExperienceDataPlane, rollout: dict) -> None:
    """Push ``rollout`` on a thread of its own; the push must return (acknowledged)."""
    done: list[BaseException | None] = []

    def run() -> None:
        try:
            plane.push(rollout)
            done.append(None)
        except BaseException as exc:  # pragma: no cover - reported below
            done.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert done == [None]


# -- a loss reported only to another caller ------------------------------------------------------


def test_close_reports_units_of_other_threads_lost_by_an_inline_ingestion(small_spec):
    """Defect: with inline ingestion and g_ing > 1, a push on one thread ran the invocation
    over a unit another thread's push had acknowledged; the operator raised, the error went to
    the running thread only, and close() raised nothing, so the other actor never learned its
    rows were lost."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(0, 2, 0, 1), timeout=5)
    refusing_ingestion(plane)
    _push_on_another_thread(plane, make_rows(small_spec, 4))  # queued: 1 of g_ing = 2
    with pytest.raises(OperatorError) as failed:
        plane.push(make_rows(small_spec, 3, start=-10))  # runs the invocation over both
    assert (failed.value.lost_units, failed.value.lost_rows) == (2, 7)
    plane.push(make_rows(small_spec, 2, start=100))  # the plane stays usable
    plane.flush()
    with pytest.raises(DataLossError) as lost:
        plane.close()
    # Only the other thread's acknowledged unit: the raising push's own unit was never
    # acknowledged, and its caller was told.
    assert (lost.value.lost_units, lost.value.lost_rows) == (1, 4)
    assert isinstance(lost.value.__cause__, OperatorError)
    assert plane.closed
    assert stored_ids(plane) == [100, 101]


def test_close_reports_units_an_inline_pull_lost_for_an_actor_thread(small_spec):
    """Defect: a pull that ingested queued units inline (nothing else to deliver) reported
    their loss to the learner only; the actor whose push returned was never told."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4, min_size=1,
                                schedule=Schedule(0, 2, 0, 1), timeout=5)
    refusing_ingestion(plane)
    _push_on_another_thread(plane, make_rows(small_spec, 4, start=-4))
    with pytest.raises(OperatorError) as failed:
        plane.pull(timeout=5)
    assert failed.value.lost_units == 1
    with pytest.raises(DataLossError) as lost:
        plane.close()
    assert (lost.value.lost_units, lost.value.lost_rows) == (1, 4)


def test_an_inline_loss_told_to_the_thread_that_pushed_is_not_reported_again(small_spec):
    """The contract's other half: units the raising caller's thread pushed itself were
    reported to it, so close() does not count them a second time."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(0, 2, 0, 1), timeout=5)
    refusing_ingestion(plane)
    plane.push(make_rows(small_spec, 4))
    with pytest.raises(OperatorError) as failed:
        plane.push(make_rows(small_spec, 3, start=-10))
    assert failed.value.lost_units == 2
    plane.close()  # no DataLossError
    assert plane.counters["lost_units"] == 2


def test_recover_clears_an_inline_loss_told_to_another_thread(small_spec):
    """recover() is the caller's word that it handled the failures: close() then reports
    nothing for them, as for a latched error recover() cleared."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(0, 2, 0, 1), timeout=5)
    refusing_ingestion(plane)
    _push_on_another_thread(plane, make_rows(small_spec, 4))
    with pytest.raises(OperatorError):
        plane.push(make_rows(small_spec, 3, start=-10))
    assert plane.recover() is None  # nothing was latched
    plane.close()  # no DataLossError
    assert plane.counters["lost_units"] == 2


# -- a push that straddles a migration -----------------------------------------------------------


@pytest.mark.parametrize("schedule", [Schedule(0, 1, 0, 1), Schedule(1, 1, 0, 1)],
                         ids=lambda s: s.label())
def test_a_push_straddling_a_migration_that_widens_the_spec_is_stored(small_spec, schedule):
    """Defect: a push validated its rollout against the old spec, a migration to a wider spec
    completed, then the push queued its unit unwidened; ingestion then refused it against the
    new spec (an OperatorError, the acknowledged unit lost) instead of storing it padded like
    the units queued before the migration."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2, min_size=1,
                                schedule=schedule, timeout=5)
    wide = ExperienceSpec.of(obs=((6,), torch.float32), id=((), torch.int64),
                             done=((), torch.bool))
    engine = plane._engine
    submit = engine.submit

    def migrate_then_submit(unit, **kw):  # type: ignore[no-untyped-def]
        plane.migrate(Placement.pageable(), spec=wide)  # between validation and queuing
        submit(unit, **kw)

    engine.submit = migrate_then_submit  # type: ignore[method-assign]
    rollout = make_rows(small_spec, 3, start=5)
    plane.push(rollout)
    del engine.submit
    plane.flush()
    assert plane.failed is None
    assert plane.counters["lost_units"] == 0
    assert stored_ids(plane) == [5, 6, 7]
    obs = plane.buffer.store.get(torch.arange(3))["obs"]
    assert obs.shape == (3, 6)
    assert torch.equal(obs[:, :4], rollout["obs"])
    assert not obs[:, 4:].any()
    plane.close()


# -- a dropped plane and its snapshotter ---------------------------------------------------------


@pytest.mark.parametrize("every_s", [3600.0, float("inf")])
def test_a_dropped_plane_with_a_snapshotter_is_closed_by_its_finaliser(small_spec, tmp_path,
                                                                       every_s):
    """Defect: a plane dropped without close() while a snapshotter of it was alive was never
    closed by its finaliser: the snapshotter (and its thread) held the plane strongly, so the
    plane, its workers and the snapshot thread lived on for the rest of the process."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(1, 1, 1, 1), timeout=5)
    plane.push(make_rows(small_spec, 4))
    engine = plane._engine
    snap = plane.snapshots(tmp_path / "s.ckpt", every_s=every_s)
    snap.request(wait=True)
    thread = snap._thread
    gone = weakref.ref(plane)
    del plane
    gc.collect()
    assert gone() is None
    assert engine.closed  # the finaliser closed it, and stored the queue
    thread.join(10)
    assert not thread.is_alive()  # the finaliser stopped the snapshotter
    with pytest.raises(PlaneClosedError):
        snap.request()
    with pytest.raises(PlaneClosedError):
        _ = snap.plane
    snap.close()  # still idempotent and quiet
    assert (tmp_path / "s.ckpt").exists()


def test_a_dropped_plane_and_its_dropped_snapshotter_leave_no_thread(small_spec, tmp_path):
    """Defect: dropping the plane and the snapshotter that ``snapshots()`` returned left the
    snapshot thread running forever, holding both."""
    def snapshot_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "conduit-snapshot"}

    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4, timeout=5)
    others = snapshot_threads()  # (of other tests, if any)
    plane.snapshots(tmp_path / "s.ckpt", every_s=3600)
    mine = snapshot_threads() - others
    assert len(mine) == 1
    gone = weakref.ref(plane)
    del plane
    gc.collect()
    assert gone() is None
    for t in mine:
        t.join(10)
        assert not t.is_alive()


def test_a_snapshotter_that_failed_does_not_keep_its_plane_alive(small_spec, tmp_path):
    """A failed snapshot's error is kept (``last_error``, raised by ``request(wait=True)``);
    the frames of its traceback (the plane's own calls) must not keep the plane alive."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(0, 2, 0, 1), timeout=5)
    refusing_ingestion(plane)
    plane.push(make_rows(small_spec, 4, start=-4))  # queued; the snapshot's flush runs it
    snap = Snapshotter(plane, tmp_path / "s.ckpt", every_s=3600)
    with pytest.warns(RuntimeWarning), pytest.raises(OperatorError):
        snap.request(wait=True)
    gone = weakref.ref(plane)
    del plane
    with pytest.warns(ResourceWarning, match="dropped without close"):  # its lost unit
        gc.collect()
    assert gone() is None
    snap.close()


def test_a_failure_raised_by_request_does_not_keep_the_callers_plane_alive(small_spec,
                                                                           tmp_path):
    """Defect: ``request(wait=True)`` raised the kept ``last_error`` object itself, which
    added the caller's frames (one holding the plane) to its traceback for good: the dropped
    plane was then never collected or closed."""
    def work() -> tuple[Snapshotter, weakref.ref, object]:
        plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                    schedule=Schedule(0, 2, 0, 1), timeout=5)
        refusing_ingestion(plane)
        plane.push(make_rows(small_spec, 4, start=-4))  # the snapshot's flush runs it
        snap = Snapshotter(plane, tmp_path / "s.ckpt", every_s=3600)
        with pytest.warns(RuntimeWarning), pytest.raises(OperatorError) as raised:
            snap.request(wait=True)
        assert raised.value is not snap.last_error  # a copy, with the same content
        assert type(raised.value) is type(snap.last_error)
        assert str(raised.value) == str(snap.last_error)
        assert raised.value.__cause__ is snap.last_error.__cause__
        return snap, weakref.ref(plane), plane._engine

    snap, gone, engine = work()
    with pytest.warns(ResourceWarning, match="dropped without close"):  # its lost unit
        gc.collect()
    assert gone() is None
    assert engine.closed
    snap.close()


def test_a_kept_snapshot_failure_leaves_the_operators_frames_whole(small_spec, tmp_path):
    """Defect: keeping a failed snapshot's error cleared the locals of every frame in its
    cause chain, the user's operator included, though the same exception is the cause that
    ``close()`` reports."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(0, 2, 0, 1), timeout=5)

    @plane.register_ingestion()
    def ingest(actor_in, exp_out) -> None:  # type: ignore[no-untyped-def]
        data = actor_in.read()
        marker = "operator state"  # noqa: F841 - read back from the traceback below
        if (data["id"] < 0).any():
            raise ValueError("bad rollout")
        exp_out.write(data)

    plane.push(make_rows(small_spec, 4, start=-4))
    snap = Snapshotter(plane, tmp_path / "s.ckpt", every_s=3600)
    with pytest.warns(RuntimeWarning), pytest.raises(OperatorError):
        snap.request(wait=True)
    snap.close()
    root = snap.last_error.__cause__
    assert isinstance(root, ValueError)
    tb = root.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_name == "ingest"
    assert tb.tb_frame.f_locals.get("marker") == "operator state"
    with pytest.raises(DataLossError):
        plane.close()


# -- whose failure an inline invocation reports --------------------------------------------------


def test_a_push_whose_rows_were_stored_is_not_told_of_a_later_unit_failing(small_spec):
    """Defect: a push's inline drain went on after its own unit was stored, took a unit
    another thread queued meanwhile, and raised that unit's failure to this push: its caller
    retried rows that were stored (twice), while the other push, whose unit failed, returned."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(0, 1, 0, 1), timeout=5)
    queued = threading.Event()
    other: dict[str, BaseException | None] = {}

    def push_other() -> None:
        try:
            plane.push(make_rows(small_spec, 2, start=-20))
            other["raised"] = None
        except BaseException as exc:
            other["raised"] = exc

    calls = []

    @plane.register_ingestion()
    def ingest(actor_in, exp_out) -> None:  # type: ignore[no-untyped-def]
        data = actor_in.read()
        calls.append(data["id"].tolist())
        if len(calls) == 1:  # another actor pushes while this push's own invocation runs
            threading.Thread(target=push_other).start()
            while not plane._engine.flow.pending:
                queued.wait(0.001)
        if (data["id"] < 0).any():
            raise ValueError("bad rollout")
        exp_out.write(data)

    plane.push(make_rows(small_spec, 3, start=10))  # its own rows stored: no error
    for _ in range(500):
        if "raised" in other:
            break
        queued.wait(0.01)
    assert isinstance(other["raised"], OperatorError)  # told to the push that brought it
    assert other["raised"].lost_units == 1
    assert stored_ids(plane) == [10, 11, 12]
    plane.close()  # the loss was told: nothing more to report


def test_a_push_is_not_told_of_an_invocation_over_units_queued_before_its_own(small_spec):
    """An invocation a push runs over units other pushes queued before its own fails: the
    error is not the push's (its unit is still queued, and is stored next); the units are
    reported by ``close()``, as their pushes returned."""
    from conduit.plane.flows import Unit

    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(0, 1, 0, 1), timeout=5)
    refusing_ingestion(plane)
    engine = plane._engine
    elsewhere = threading.Thread(target=lambda: None)  # the earlier unit's pusher
    earlier = Unit(make_rows(small_spec, 2, start=-2), 2, None, pusher=elsewhere)
    mine = Unit(make_rows(small_spec, 3, start=10), 3, None,
                pusher=threading.current_thread())
    with engine.signals.lock:
        engine.flow.enqueue_locked(earlier)
        engine.flow.enqueue_locked(mine)
    engine.runtime.drain_inline(force=False, deadline=None, current=mine)
    # (the push's drain: no error)
    assert stored_ids(plane) == [10, 11, 12]
    with pytest.raises(DataLossError) as lost:
        plane.close()
    assert (lost.value.lost_units, lost.value.lost_rows) == (1, 2)


def test_a_push_whose_rows_were_stored_returns_though_a_worker_failed_meanwhile(small_spec):
    """Defect: a push's drain checked the error a worker latched before checking whether its
    own unit was taken: a push whose rows were stored raised the delivery worker's error, and
    its caller's retry stored the rows twice."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2,
                                schedule=Schedule(0, 1, 1, 1), timeout=5)
    failed = threading.Event()

    @plane.register_delivery()
    def deliver(exp_in, learn_out) -> None:  # type: ignore[no-untyped-def]
        if not failed.is_set():
            failed.set()
            raise RuntimeError("delivery failed")
        learn_out.write(exp_in.read())

    @plane.register_ingestion()
    def ingest(actor_in, exp_out) -> None:  # type: ignore[no-untyped-def]
        exp_out.write(actor_in.read())  # the rows land; the delivery worker wakes and fails
        for _ in range(300):
            if plane._engine.runtime.errors.error is not None:
                break
            failed.wait(0.01)

    plane.push(make_rows(small_spec, 3, start=10))  # returns: its rows are stored
    assert stored_ids(plane) == [10, 11, 12]
    with pytest.raises(OperatorError):  # the next call is told
        plane.pull()
    plane.recover()
    plane.close()


def test_an_interrupt_of_an_invocation_over_earlier_units_reaches_the_push(small_spec):
    """Defect: a KeyboardInterrupt in an invocation a push ran over units queued before its
    own was kept for close() only: the push returned as if nothing happened. It is raised,
    and the push's own unit is withdrawn (a retry stores it once)."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2,
                                schedule=Schedule(0, 1, 0, 1), timeout=5)

    @plane.register_ingestion()
    def ingest(actor_in, exp_out) -> None:  # type: ignore[no-untyped-def]
        data = actor_in.read()
        if (data["id"] < 0).any():
            raise KeyboardInterrupt
        exp_out.write(data)

    with plane.frozen(reads=True, flush=False):  # the other thread's unit waits in the queue
        _push_on_another_thread(plane, make_rows(small_spec, 2, start=-5))
    with pytest.raises(KeyboardInterrupt) as raised:  # the interrupt itself, not wrapped
        plane.push(make_rows(small_spec, 3, start=10))
    assert any("ingestion operator raised KeyboardInterrupt" in n
               for n in raised.value.__notes__)
    assert stored_ids(plane) == [] and plane.stats()["pending_units"] == 0
    plane.push(make_rows(small_spec, 3, start=10))  # the caller retries: stored once
    assert stored_ids(plane) == [10, 11, 12]
    with pytest.raises(DataLossError) as lost:
        plane.close()
    assert (lost.value.lost_units, lost.value.lost_rows) == (1, 2)  # the other thread's


def test_a_push_whose_unit_waits_when_a_worker_fails_raises_and_stores_nothing(small_spec):
    """A push waiting for its turn behind another thread's invocation while the delivery
    worker latches an error raises it, and its unit is withdrawn: stored later (after
    recover()), it would have held whatever the caller wrote into its arrays since."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2,
                                schedule=Schedule(0, 1, 1, 1), timeout=5)
    engine, tick, failing = plane._engine, threading.Event(), [True]

    @plane.register_delivery()
    def deliver(exp_in, learn_out) -> None:  # type: ignore[no-untyped-def]
        if failing[0]:
            raise RuntimeError("delivery failed")
        learn_out.write(exp_in.read())

    @plane.register_ingestion()
    def ingest(actor_in, exp_out) -> None:  # type: ignore[no-untyped-def]
        data = actor_in.read()
        if int(data["id"][0]) == 0:  # the other thread's unit: this push's waits behind it
            for _ in range(500):
                if engine.flow.pending:
                    break
                tick.wait(0.01)
            exp_out.write(data)  # the delivery worker wakes and fails
            for _ in range(500):
                if engine.runtime.errors.error is not None:
                    break
                tick.wait(0.01)
            return
        exp_out.write(data)

    other = threading.Thread(target=plane.push, args=(make_rows(small_spec, 2, start=0),))
    other.start()
    for _ in range(500):  # the other push's invocation runs
        if engine.flow.inflight_units:
            break
        tick.wait(0.01)
    with pytest.raises(OperatorError) as raised:
        plane.push(make_rows(small_spec, 3, start=10))
    other.join(10)
    assert raised.value.operator == "delivery"
    assert plane.stats()["pending_units"] == 0  # withdrawn
    failing[0] = False  # (a worker restarted by recover() must not latch again meanwhile)
    plane.recover()
    plane.flush()
    assert stored_ids(plane) == [0, 1]
    plane.close()


class _InterruptedOnce:
    """A lock whose first acquisition raises KeyboardInterrupt (an interrupt while
    waiting)."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock, self.fired = lock, False

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def acquire(self, *args: object, **kw: object) -> bool:
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt
        return self._lock.acquire(*args, **kw)

    def release(self) -> None:
        self._lock.release()


def test_a_push_interrupted_while_waiting_its_turn_withdraws_its_unit(small_spec):
    """Defect: a KeyboardInterrupt while a push waited to run its invocation left its unit
    queued: the push raised, the unit was stored by the next call, and a retry stored it
    twice."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2,
                                schedule=Schedule(0, 1, 0, 1), timeout=5)
    rt = plane._engine.runtime
    rt._inline_order = _InterruptedOnce(rt._inline_order)
    with pytest.raises(KeyboardInterrupt):
        plane.push(make_rows(small_spec, 3, start=10))
    assert plane.stats()["pending_units"] == 0
    plane.push(make_rows(small_spec, 3, start=10))  # the caller retries: stored once
    plane.flush()
    assert stored_ids(plane) == [10, 11, 12]
    plane.close()


# -- a latched error raised again and again ------------------------------------------------------


def _frames(exc: BaseException) -> int:
    tb, n = exc.__traceback__, 0
    while tb is not None:
        tb, n = tb.tb_next, n + 1
    return n


def test_raising_a_latched_error_again_and_again_keeps_it_the_same_size(small_spec):
    """Defect: every call that raised the latched operator error raised the kept object
    itself, which added the caller's frames (and everything they refer to) to its traceback
    for good: a loop that catches the error and pushes on grew it without bound."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(1, 1, 0, 1), timeout=5)
    refusing_ingestion(plane)
    plane.push(make_rows(small_spec, 2, start=-5))  # fails on the ingestion thread
    with pytest.raises(OperatorError):
        plane.flush()
    kept = plane.failed
    assert kept is not None
    size = _frames(kept)
    for _ in range(50):
        with pytest.raises(OperatorError) as raised:
            plane.push(make_rows(small_spec, 2))
        assert raised.value.lost_units == kept.lost_units  # the same failure
        assert raised.value.__cause__ is kept.__cause__
    assert _frames(kept) == size
    assert plane.recover() is kept
    plane.close()


def test_a_note_added_to_a_raised_latched_error_stays_on_that_copy(small_spec):
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(1, 1, 0, 1), timeout=5)
    refusing_ingestion(plane)
    plane.push(make_rows(small_spec, 2, start=-5))
    with pytest.raises(OperatorError):
        plane.flush()
    kept = plane.failed
    assert kept is not None
    kept.add_note("kept")  # a note on the kept error is on every copy, once
    for _ in range(3):
        with pytest.raises(OperatorError) as again:
            plane.push(make_rows(small_spec, 2))
        again.value.add_note("seen by this caller")
        assert again.value.__notes__ == ["kept", "seen by this caller"]
    assert kept.__notes__ == ["kept"]
    plane.recover()
    plane.close()


# -- waiting for another thread's inline ingestion ---------------------------------------------


def _push_held_by(plane: ExperienceDataPlane, small_spec, lock: threading.Lock,
                  entered: threading.Event) -> threading.Thread:
    """A push on a thread of its own whose inline ingestion waits for ``lock``."""

    @plane.register_ingestion()
    def ingest(actor_in, exp_out) -> None:  # type: ignore[no-untyped-def]
        data = actor_in.read()
        entered.set()
        with lock:
            exp_out.write(data)

    pusher = threading.Thread(target=plane.push, args=(make_rows(small_spec, 4),),
                              daemon=True)
    pusher.start()
    assert entered.wait(10)
    return pusher


def test_a_pull_does_not_wait_for_another_threads_inline_ingestion(small_spec):
    """Defect: a learner's pull ran the queued ingestion itself and waited, past its timeout,
    for another thread's inline invocation to end; when that operator waited for a lock the
    learner held (a model lock), both waited for good."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2,
                                schedule=Schedule(0, 1, 0, 1), timeout=5)
    model, entered, outcome = threading.Lock(), threading.Event(), []
    model.acquire()  # the learner's, below
    pusher = _push_held_by(plane, small_spec, model, entered)
    waiting = threading.Thread(target=plane.push, args=(make_rows(small_spec, 2, start=100),),
                               daemon=True)  # queued, waiting its turn
    waiting.start()
    while plane.stats()["pending_units"] == 0:
        time.sleep(0.01)

    def learner() -> None:
        try:
            plane.pull(timeout=0.5)
        except EmptyBufferError as exc:
            outcome.append(exc)
        finally:
            model.release()

    t = threading.Thread(target=learner, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive() and len(outcome) == 1  # its own timeout, not a hang
    pusher.join(10)
    waiting.join(10)
    assert stored_ids(plane) == [0, 1, 2, 3, 100, 101]
    plane.close()


def test_a_push_or_flush_whose_turn_does_not_come_times_out_and_stores_nothing(small_spec):
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2,
                                schedule=Schedule(0, 1, 0, 1), timeout=5)
    held, entered = threading.Lock(), threading.Event()
    held.acquire()
    pusher = _push_held_by(plane, small_spec, held, entered)
    with pytest.raises(BackpressureTimeout, match="turn"):
        plane.push(make_rows(small_spec, 2, start=100), timeout=0.3)
    with pytest.raises(BackpressureTimeout, match="turn"):
        plane.flush(timeout=0.3)
    held.release()
    pusher.join(10)
    plane.flush()
    assert stored_ids(plane) == [0, 1, 2, 3]  # not the timed-out push's rows
    plane.close()


class _SlowRelease:
    """The order lock, whose releasing thread is preempted right after it lets go."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock

    def acquire(self, *args: object, **kw: object) -> bool:
        return self._lock.acquire(*args, **kw)

    def release(self) -> None:
        self._lock.release()
        time.sleep(0.2)  # another thread waiting its turn runs now


def test_a_push_interrupted_over_earlier_units_withdraws_its_unit_before_its_turn_ends(
        small_spec):
    """Defect (review): an interrupt in a push's invocation over units queued before its own
    came back as the invocation's error, raised after the order lock was let go: a flush
    waiting its turn took the push's unit and stored it although the push raised (a retry
    stored it twice)."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2,
                                schedule=Schedule(0, 1, 0, 1), timeout=5)
    entered, go = threading.Event(), threading.Event()

    @plane.register_ingestion()
    def ingest(actor_in, exp_out) -> None:  # type: ignore[no-untyped-def]
        data = actor_in.read()
        if (data["id"] < 0).any():
            entered.set()
            go.wait(10)
            raise KeyboardInterrupt
        exp_out.write(data)

    engine = plane._engine
    engine.runtime._inline_order = _SlowRelease(engine.runtime._inline_order)
    earlier = Unit(make_rows(small_spec, 2, start=-2), 2, None,
                   pusher=threading.Thread(target=lambda: None))  # its push returned
    mine = Unit(make_rows(small_spec, 3, start=10), 3, None,
                pusher=threading.current_thread())
    with engine.signals.lock:
        engine.flow.enqueue_locked(earlier)
        engine.flow.enqueue_locked(mine)
    raised: list[BaseException] = []

    def push_drain() -> None:  # what the push runs after queueing ``mine``
        try:
            engine.ingestion.after_push(mine, time.perf_counter() + 5)
        except BaseException as exc:
            raised.append(exc)

    pusher = threading.Thread(target=push_drain)
    pusher.start()
    assert entered.wait(10)
    flusher = threading.Thread(target=lambda: plane.flush(timeout=5))
    flusher.start()
    time.sleep(0.05)  # the flush waits its turn
    go.set()
    pusher.join(10)
    flusher.join(10)
    assert len(raised) == 1  # the push raised ...
    assert 10 not in stored_ids(plane)  # ... so nothing of it was stored
    with pytest.raises(DataLossError):  # the earlier, acknowledged unit was cut short
        plane.close()


def test_close_timing_out_on_a_stuck_inline_invocation_counts_its_acknowledged_units(
        small_spec):
    """Defect: close() timing out on another thread's inline invocation counted every unit
    the invocation held, the running push's own (not acknowledged: the push reports it)
    included, and none of their rows."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(0, 2, 0, 1), timeout=0.5)
    entered, go = threading.Event(), threading.Event()

    @plane.register_ingestion()
    def ingest(actor_in, exp_out) -> None:  # type: ignore[no-untyped-def]
        data = actor_in.read()
        entered.set()
        go.wait(10)
        exp_out.write(data)

    _push_on_another_thread(plane, make_rows(small_spec, 4))  # acknowledged: 1 of g_ing = 2
    told: list[BaseException | None] = []

    def push_own() -> None:  # runs the invocation over both units, held
        try:
            plane.push(make_rows(small_spec, 2, start=100), timeout=10)
            told.append(None)
        except Exception as exc:
            told.append(exc)

    pusher = threading.Thread(target=push_own)
    pusher.start()
    assert entered.wait(10)
    with pytest.raises(DataLossError) as lost:
        plane.close()  # the invocation is stuck past the timeout
    assert (lost.value.lost_units, lost.value.lost_rows) == (1, 4)  # the other thread's
    go.set()
    pusher.join(10)
    assert len(told) == 1  # the push itself reported what became of its unit


# -- an operator interrupted on the caller's thread ------------------------------------------------


def _interrupted_once(data: dict) -> None:
    if (data["id"] < 0).any():
        raise KeyboardInterrupt


def test_an_inline_ingestion_interrupted_raises_the_interrupt_not_an_exception(small_spec):
    """Defect: a Ctrl-C inside an inline ingestion operator reached the push as an
    OperatorError (an ``Exception``), so an ``except Exception`` around the push swallowed it.
    The interrupt itself is raised, its unit not stored; a retry stores it once."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2,
                                schedule=Schedule(0, 1, 0, 1), timeout=5)

    @plane.register_ingestion()
    def ingest(actor_in, exp_out) -> None:  # type: ignore[no-untyped-def]
        data = actor_in.read()
        _interrupted_once(data)
        exp_out.write(data)

    swallowed = False
    with pytest.raises(KeyboardInterrupt) as raised:
        try:
            plane.push(make_rows(small_spec, 3, start=-3))
        except Exception:  # what a retry loop writes: must not catch a Ctrl-C
            swallowed = True
    assert not swallowed
    assert any("1 rollout units, 3 rows, were not stored" in n for n in raised.value.__notes__)
    assert stored_ids(plane) == [] and plane.stats()["pending_units"] == 0
    plane.push(make_rows(small_spec, 3, start=10))
    assert stored_ids(plane) == [10, 11, 12]
    plane.close()


def test_an_inline_delivery_interrupted_raises_the_interrupt_and_the_plane_goes_on(small_spec):
    """Defect: a Ctrl-C inside the delivery operator an inline pull ran came back as an
    OperatorError. The interrupt itself is raised, nothing is latched, and the next pull
    delivers."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2,
                                schedule=Schedule(0, 1, 0, 1), timeout=5)
    calls = [0]

    @plane.register_delivery()
    def deliver(exp_in, learn_out) -> None:  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        learn_out.write(exp_in.read())

    plane.push(make_rows(small_spec, 4))
    with pytest.raises(KeyboardInterrupt) as raised:
        try:
            plane.pull()
        except Exception:  # pragma: no cover - the defect
            pytest.fail("the interrupt was raised as an Exception")
    assert any("delivery operator raised KeyboardInterrupt" in n
               for n in raised.value.__notes__)
    assert plane.pull()["id"].shape == (2,)
    plane.close()


def test_a_plane_collected_on_a_conduit_thread_is_closed_from_a_new_thread(small_spec):
    """Defect: a dropped plane collected on a thread Conduit made (a worker of another plane,
    one loading a kernel under the import lock) was closed there: the close joined workers
    waiting for a lock that thread held, and every plane behind that lock stalled until the
    close gave up. It is closed from a new thread; the collecting thread goes on at once."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2,
                                schedule=Schedule(1, 1, 0, 1), timeout=5)
    held = threading.Lock()  # stands for the import lock the collecting thread holds

    @plane.register_ingestion()
    def ingest(actor_in, exp_out) -> None:  # type: ignore[no-untyped-def]
        with held:
            exp_out.write(actor_in.read())

    engine = plane._engine
    took: list[float] = []
    gc.disable()
    try:
        cycle: list = [plane]
        cycle.append(cycle)  # the plane is freed only by a collection
        del plane

        def collect() -> None:
            with held:
                cycle_ref = weakref.ref(engine)
                time.sleep(0.2)  # the worker takes the unit and waits for the lock
                t0 = time.monotonic()
                gc.collect()
                took.append(time.monotonic() - t0)
                assert cycle_ref() is not None

        t = threading.Thread(target=collect, name="conduit-test-collector")
        with_unit = make_rows(small_spec, 3)
        cycle[0].push(with_unit)
        del cycle
        t.start()
        t.join(30)
    finally:
        gc.enable()
    assert took and took[0] < 2.0, took  # (the plane's close would wait 5 s there)
    deadline = time.monotonic() + 10
    while engine.flow.counters["ingested_rows"] < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.closed
    assert engine.flow.counters["ingested_rows"] == 3  # the queued unit was stored
    assert engine.flow.counters["lost_units"] == 0
