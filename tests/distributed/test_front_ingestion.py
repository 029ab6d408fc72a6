"""The sharded front's ingestion queue on its own (no Ray): units grouped per node and per
``g_ing``, inline and on the thread, closed without taking units it cannot store."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from conduit.distributed.operators import FrontIngestion, QueuedUnit
from conduit.errors import BackpressureTimeout, DataLossError, OperatorError, PlaneClosedError
from conduit.plane.ports import ActorIn, BufferOut
from conduit.scheduling import Schedule


class Recorder:
    """A store that records ``(node, ids)`` of every write."""

    def __init__(self) -> None:
        self.writes: list[tuple[str | None, list[int]]] = []

    def __call__(self, batch: Mapping[str, Any], unit: QueuedUnit, deadline: float) -> int:
        assert deadline > time.monotonic()
        self.writes.append((unit.node, batch["id"].tolist()))
        return len(batch["id"])


def unit(start: int, node: str, n: int = 2) -> QueuedUnit:
    return QueuedUnit({"id": torch.arange(start, start + n)}, n, node, None)


def test_inline_invocations_take_up_to_g_units_of_one_node():
    store = Recorder()
    ing = FrontIngestion(store=store, timeout=5.0)
    sizes: list[int] = []

    def op(actor_in: ActorIn, exp_out: BufferOut) -> None:
        sizes.append(len(actor_in))
        exp_out.write(actor_in.read())
    ing.fn, ing.registered = op, True
    ing.set_schedule(Schedule(0, 3, 0, 1))
    assert not ing.direct
    deadline = time.monotonic() + 5
    for start, node in ((0, "a"), (2, "a"), (4, "b")):
        ing.submit(unit(start, node), deadline)
    # Three queued: the first invocation takes a's two units; b's waits for two more.
    assert store.writes == [("a", [0, 1, 2, 3])]
    ing.submit(unit(6, "b"), deadline)
    ing.submit(unit(8, "b"), deadline)
    ing.submit(unit(10, "a"), deadline)
    assert store.writes[1:] == [("b", [4, 5, 6, 7, 8, 9])]
    ing.flush(deadline)
    assert store.writes[2:] == [("a", [10, 11])]
    assert sizes == [2, 3, 1]
    ing.close()


def test_the_thread_ingests_and_close_refuses_later_units():
    store = Recorder()
    ing = FrontIngestion(store=store, timeout=5.0)
    gate = threading.Event()

    def op(actor_in: ActorIn, exp_out: BufferOut) -> None:
        gate.wait(5)
        exp_out.write(actor_in.read())
    ing.fn, ing.registered = op, True
    ing.set_schedule(Schedule(1, 1, 0, 1))
    thread = ing._worker.thread
    assert ing.overlapped and thread is not None and thread.name == "conduit-ingestion"
    deadline = time.monotonic() + 5
    for k in range(3):
        ing.submit(unit(2 * k, "a"), deadline)
    with pytest.raises(BackpressureTimeout):
        ing.submit(unit(6, "a"), time.monotonic() + 0.1)
    assert not ing.idle()
    gate.set()
    ing.flush(time.monotonic() + 5)
    assert ing.idle()
    assert [ids for _, ids in store.writes] == [[0, 1], [2, 3], [4, 5]]
    ing.close()
    assert ing._worker.thread is None
    with pytest.raises(PlaneClosedError):
        ing.submit(unit(8, "a"), deadline)
    assert len(store.writes) == 3


def test_a_switch_to_inline_stops_the_thread_and_keeps_order():
    store = Recorder()
    ing = FrontIngestion(store=store, timeout=5.0)
    ing.set_schedule(Schedule(1, 2, 0, 1))
    deadline = time.monotonic() + 5
    ing.submit(unit(0, "a"), deadline)
    ing.flush(deadline)
    thread = ing._worker.thread
    ing.set_schedule(Schedule(0, 1, 0, 1))
    assert thread is not None and not thread.is_alive()
    assert ing.direct  # no operator, one unit per inline invocation
    ing.submit(unit(2, "a"), deadline)
    assert [ids for _, ids in store.writes] == [[0, 1], [2, 3]]
    ing.close()


@pytest.mark.parametrize("overlapped", [True, False])
def test_calls_that_wait_for_the_operator_are_refused_from_inside_it(overlapped):
    """flush, set_schedule and close wait for the operator's invocations to end: from inside
    it they joined their own thread or waited the whole timeout; now they refuse at once."""
    from conduit.errors import ConfigError

    store = Recorder()
    ing = FrontIngestion(store=store, timeout=3.0)
    schedule = Schedule(1 if overlapped else 0, 1, 0, 1)
    got: dict[str, Any] = {}

    def op(actor_in: ActorIn, exp_out: BufferOut) -> None:
        exp_out.write(actor_in.read())
        if got:
            return
        for name, call in (("flush", lambda: ing.flush(time.monotonic() + 3)),
                           ("set_schedule", lambda: ing.set_schedule(schedule)),
                           ("close", ing.close)):
            t0 = time.perf_counter()
            try:
                call()
            except ConfigError as exc:
                got[name] = (exc.field, time.perf_counter() - t0)
    ing.fn, ing.registered = op, True
    ing.set_schedule(schedule)
    ing.submit(unit(0, "a"), time.monotonic() + 5)
    ing.flush(time.monotonic() + 5)
    assert {k: v[0] for k, v in got.items()} == {"flush": "flush",
                                                  "set_schedule": "set_schedule",
                                                  "close": "close"}
    assert all(seconds < 1.0 for _, seconds in got.values())
    ing.submit(unit(2, "a"), time.monotonic() + 5)  # still open and running
    ing.close()
    assert [ids for _, ids in store.writes] == [[0, 1], [2, 3]]


def _failing_on_negative_ids(ing: FrontIngestion, hook: Any = None) -> None:
    def operator(actor_in: ActorIn, exp_out: BufferOut) -> None:
        data = actor_in.read()
        if hook is not None:
            hook(data)
        if (data["id"] < 0).any():
            raise ValueError("bad rollout")
        exp_out.write(data)
    ing.fn, ing.registered = operator, True


def _closing(ing: FrontIngestion) -> tuple[threading.Thread, list[BaseException | None]]:
    """``ing.close()`` started on a thread of its own; the list gets its DataLossError, or
    None once it returned."""
    outcome: list[BaseException | None] = []

    def close() -> None:
        try:
            ing.close()
            outcome.append(None)
        except DataLossError as exc:
            outcome.append(exc)

    closer = threading.Thread(target=close)
    closer.start()
    return closer, outcome


def _fail_over_another_threads_unit(ing: FrontIngestion) -> None:
    """With g_ing = 2: another thread's push queues 4 rows and returns; this thread's push of
    2 bad rows runs the invocation over both units, which fails (OperatorError raised)."""
    acked = unit(0, "n1", 4)
    pusher = threading.Thread(target=ing.submit, args=(acked, time.monotonic() + 5))
    acked.pusher = pusher
    pusher.start()
    pusher.join(10)  # its push returned: 1 of g_ing = 2 units queued
    bad = QueuedUnit({"id": torch.tensor([-1, -2])}, 2, "n1", None, threading.current_thread())
    ing.submit(bad, time.monotonic() + 5)


def test_a_push_whose_unit_was_stored_is_not_told_of_a_later_failure():
    """Defect: a push's inline drain went on after its own unit was stored, took a unit that
    another push had queued meanwhile and raised its failure to this push: its caller would
    retry rows that were stored."""
    store = Recorder()
    ing = FrontIngestion(store=store, timeout=5.0)
    ing.set_schedule(Schedule(0, 1, 0, 1))
    other = QueuedUnit({"id": torch.tensor([-7])}, 1, "n1", None)
    calls = []

    def queue_another(data: Mapping[str, Any]) -> None:
        calls.append(data["id"].tolist())
        if len(calls) == 1:  # another actor's push queues its unit, not drained yet
            ing._queue(other, time.monotonic() + 5)

    _failing_on_negative_ids(ing, queue_another)
    ing.submit(unit(10, "n1"), time.monotonic() + 5)  # returns: its rows are stored
    assert store.writes == [("n1", [10, 11])]
    assert list(ing._units.pending) == [other]  # left to its own push


def test_close_reports_an_inline_loss_told_to_another_thread_only():
    """Defect: a push on one thread ran the invocation over a unit another thread's push had
    acknowledged; the error went to the running thread only, and close() reported nothing,
    so the other actor never learned its rows were lost."""
    store = Recorder()
    ing = FrontIngestion(store=store, timeout=5.0)
    ing.set_schedule(Schedule(0, 2, 0, 1))
    _failing_on_negative_ids(ing)
    with pytest.raises(OperatorError) as raised:
        _fail_over_another_threads_unit(ing)
    assert (raised.value.lost_units, raised.value.lost_rows) == (2, 6)
    with pytest.raises(DataLossError) as lost:
        ing.close()
    assert (lost.value.lost_units, lost.value.lost_rows) == (1, 4)  # the other thread's only


def test_recover_clears_an_inline_loss_told_to_another_thread():
    ing = FrontIngestion(store=Recorder(), timeout=5.0)
    ing.set_schedule(Schedule(0, 2, 0, 1))
    _failing_on_negative_ids(ing)
    with pytest.raises(OperatorError):
        _fail_over_another_threads_unit(ing)
    assert ing.recover() is None  # nothing was latched
    ing.close()  # no DataLossError


def test_close_waits_for_an_inline_invocation_on_another_thread():
    """Defect: close() counted the losses kept so far while an inline invocation still ran on
    another thread: a failure that ended after it was never reported (nor the acknowledged
    unit of a third thread it took)."""
    ing = FrontIngestion(store=Recorder(), timeout=5.0)
    ing.set_schedule(Schedule(0, 2, 0, 1))
    inside, go = threading.Event(), threading.Event()

    def held(data: Mapping[str, Any]) -> None:
        if (data["id"] < 0).any():
            inside.set()
            go.wait(10)

    _failing_on_negative_ids(ing, held)
    raised: list[BaseException] = []

    def push_bad() -> None:
        try:
            _fail_over_another_threads_unit(ing)
        except OperatorError as exc:
            raised.append(exc)

    pusher = threading.Thread(target=push_bad)
    pusher.start()
    assert inside.wait(10)  # the invocation over both units runs, held
    closer, outcome = _closing(ing)
    closer.join(0.5)  # it waits for the invocation (before, it returned here)
    go.set()
    closer.join(10)
    pusher.join(10)
    assert len(raised) == 1 and raised[0].lost_units == 2
    assert len(outcome) == 1 and isinstance(outcome[0], DataLossError)
    assert (outcome[0].lost_units, outcome[0].lost_rows) == (1, 4)  # the other thread's


def test_a_learners_drain_after_close_began_leaves_the_queue_to_close():
    """Defect: a learner's hurry after close() began drained concurrently with close's own
    drain; a failure it met was kept after close() had counted, so the acknowledged unit of
    another thread was reported nowhere."""
    ing = FrontIngestion(store=Recorder(), timeout=5.0)
    ing.set_schedule(Schedule(0, 3, 0, 1))  # two units of two nodes wait: none is due
    inside, go = threading.Event(), threading.Event()

    def held(data: Mapping[str, Any]) -> None:
        if int(data["id"][0]) == 0:
            inside.set()
            go.wait(10)

    _failing_on_negative_ids(ing, held)
    actor = threading.Thread(target=lambda: None)  # the thread whose pushes returned
    for start, node in ((0, "a"), (-4, "b")):
        acked = unit(start, node)
        acked.pusher = actor
        ing.submit(acked, time.monotonic() + 5)
    closer, outcome = _closing(ing)
    assert inside.wait(10)  # close's own drain runs node a's unit
    ing.hurry()  # a learner waiting for rows: the queue is close's now
    go.set()
    closer.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], DataLossError)
    assert (outcome[0].lost_units, outcome[0].lost_rows) == (1, 2)


def test_an_interrupted_push_keeps_its_unit_from_other_threads_drains():
    """Defect: inline drains on different threads were not serialised. While a push's
    invocation over an earlier unit ran, a flush on another thread stored the push's own
    unit; the invocation was then interrupted and the push raised ``KeyboardInterrupt``, so
    its caller would retry rows that were stored (stored twice)."""
    store = Recorder()
    ing = FrontIngestion(store=store, timeout=5.0)
    ing.set_schedule(Schedule(0, 1, 0, 1))
    stored_mine = threading.Event()
    calls: list[list[int]] = []

    def operator(actor_in: ActorIn, exp_out: BufferOut) -> None:
        data = actor_in.read()
        calls.append(data["id"].tolist())
        if int(data["id"][0]) == 0:  # the earlier unit, on the push's thread
            flusher.start()
            stored_mine.wait(1.0)  # long enough for the flush to take the push's unit
            raise KeyboardInterrupt
        exp_out.write(data)
        if int(data["id"][0]) == 10:
            stored_mine.set()

    ing.fn, ing.registered = operator, True
    flusher = threading.Thread(target=ing.flush, args=(time.monotonic() + 10,))
    earlier = unit(0, "n1")
    earlier.pusher = threading.Thread(target=lambda: None)  # its push returned
    ing._queue(earlier, time.monotonic() + 5)
    ing._drains.count -= 1  # queued as a returned push's unit: no drain of its own
    mine = QueuedUnit({"id": torch.tensor([10, 11])}, 2, "n1", None,
                      threading.current_thread())
    with pytest.raises(KeyboardInterrupt):
        ing.submit(mine, time.monotonic() + 5)
    flusher.join(10)
    assert not flusher.is_alive()
    # The push raised, so it stored nothing: a retry stores its rows once.
    assert [ids for _, ids in store.writes].count([10, 11]) == 0
    with pytest.raises(DataLossError) as lost:  # the earlier, acknowledged unit was cut short
        ing.close()
    assert (lost.value.lost_units, lost.value.lost_rows) == (1, 2)
    assert calls[0] == [0, 1]


def test_a_push_interrupted_while_waiting_its_turn_withdraws_its_unit():
    """A push whose drain waits for another thread's invocation (over earlier units) and is
    interrupted there (SIGINT in the main thread) takes its unit out of the queue, so that
    the other drain does not store rows of a push that raised."""
    store = Recorder()
    ing = FrontIngestion(store=store, timeout=5.0)
    ing.set_schedule(Schedule(0, 1, 0, 1))
    inside, go = threading.Event(), threading.Event()

    def operator(actor_in: ActorIn, exp_out: BufferOut) -> None:
        data = actor_in.read()
        if int(data["id"][0]) == 0:
            inside.set()
            go.wait(10)
        exp_out.write(data)

    ing.fn, ing.registered = operator, True
    earlier = unit(0, "n1")
    ing._queue(earlier, time.monotonic() + 5)
    ing._drains.count -= 1  # queued as a returned push's unit: no drain of its own
    flusher = threading.Thread(target=ing.flush, args=(time.monotonic() + 10,))
    flusher.start()
    assert inside.wait(10)  # the flush runs the earlier unit, holding the order
    mine = QueuedUnit({"id": torch.tensor([10, 11])}, 2, "n1", None,
                      threading.current_thread())
    armed = threading.Event()
    armed.set()

    def interrupt(signum: int, frame: Any) -> None:
        if armed.is_set():  # a late signal after the test is ignored
            raise KeyboardInterrupt

    def send_when_waiting() -> None:
        deadline = time.monotonic() + 10
        while mine not in ing._units.pending and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.2)  # the push now waits for the flush's invocation
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        threading.Thread(target=send_when_waiting, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            ing.submit(mine, time.monotonic() + 5)
    finally:
        armed.clear()
        signal.signal(signal.SIGINT, previous)
    go.set()
    flusher.join(10)
    assert [ids for _, ids in store.writes] == [[0, 1]]  # not the interrupted push's rows
    ing.close()


def test_the_latched_error_raised_again_and_again_keeps_its_size():
    """Defect: each call raising the latched error raised the kept object itself, adding the
    caller's frames to its traceback for good (a loop catching it grew it without bound)."""
    ing = FrontIngestion(store=Recorder(), timeout=5.0)
    _failing_on_negative_ids(ing)
    ing.set_schedule(Schedule(1, 1, 0, 1))
    ing.submit(unit(-4, "n1"), time.monotonic() + 5)
    with pytest.raises(OperatorError):
        ing.flush(time.monotonic() + 5)
    kept = ing.error
    assert kept is not None
    frames = len(traceback.extract_tb(kept.__traceback__))
    for _ in range(20):
        with pytest.raises(OperatorError) as raised:
            ing.submit(unit(0, "n1"), time.monotonic() + 5)
        assert raised.value.__cause__ is kept.__cause__
    assert len(traceback.extract_tb(kept.__traceback__)) == frames
    assert ing.recover() is kept
    ing.close()  # the failure was raised (to the flush): no loss left to report


def test_close_timing_out_counts_the_acknowledged_units_of_a_stuck_invocation():
    """Defect: close() timing out on another thread's inline invocation counted every unit
    the invocation held, the running push's own (not acknowledged: the push reports it)
    included, and none of their rows."""
    ing = FrontIngestion(store=Recorder(), timeout=0.5)
    ing.set_schedule(Schedule(0, 2, 0, 1))
    inside, go = threading.Event(), threading.Event()

    def held(data: Mapping[str, Any]) -> None:
        inside.set()
        go.wait(10)

    _failing_on_negative_ids(ing, held)
    outcome: list[BaseException | None] = []

    def push_both() -> None:  # another thread's 4 rows are queued; this push's 2 join them
        try:
            _fail_over_another_threads_unit(ing)
            outcome.append(None)
        except OperatorError as exc:
            outcome.append(exc)

    pusher = threading.Thread(target=push_both)
    pusher.start()
    assert inside.wait(10)
    with pytest.raises(DataLossError) as lost:
        ing.close()  # the invocation is stuck past the timeout
    assert (lost.value.lost_units, lost.value.lost_rows) == (1, 4)  # the other thread's
    go.set()
    pusher.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], OperatorError)  # told to the push


def _held_push(ing: FrontIngestion, first: int = 0) -> tuple[threading.Thread, threading.Event,
                                                              threading.Event]:
    """A push on a thread of its own whose inline invocation (over ids from ``first``) is
    held until the returned ``go`` is set; waits until it runs."""
    inside, go = threading.Event(), threading.Event()

    def operator(actor_in: ActorIn, exp_out: BufferOut) -> None:
        data = actor_in.read()
        if int(data["id"][0]) == first:
            inside.set()
            go.wait(10)
        exp_out.write(data)

    ing.fn, ing.registered = operator, True
    pusher = threading.Thread(target=ing.submit, args=(unit(first, "n1"),
                                                       time.monotonic() + 20))
    pusher.start()
    assert inside.wait(10)
    return pusher, inside, go


def test_a_learners_hurry_leaves_the_queue_to_a_running_inline_drain():
    """Defect: a learner's hurry waited for another thread's inline invocation to end, past
    the pull's timeout (and for good when that operator waited for a lock the learner held)."""
    ing = FrontIngestion(store=Recorder(), timeout=20.0)
    ing.set_schedule(Schedule(0, 1, 0, 1))
    pusher, _, go = _held_push(ing)
    learner = threading.Thread(target=ing.hurry)
    learner.start()
    learner.join(5)
    returned = not learner.is_alive()
    go.set()
    pusher.join(10)
    learner.join(10)
    assert returned  # while the push's invocation was still held
    ing.close()


def test_a_push_whose_turn_does_not_come_by_its_deadline_times_out_and_stores_nothing():
    store = Recorder()
    ing = FrontIngestion(store=store, timeout=20.0)
    ing.set_schedule(Schedule(0, 1, 0, 1))
    pusher, _, go = _held_push(ing)
    with pytest.raises(BackpressureTimeout, match="turn"):
        ing.submit(unit(10, "n1"), time.monotonic() + 0.3)
    with pytest.raises(BackpressureTimeout, match="turn"):
        ing.flush(time.monotonic() + 0.3)
    go.set()
    pusher.join(10)
    ing.flush(time.monotonic() + 5)
    assert [ids for _, ids in store.writes] == [[0, 1]]  # the timed-out push's unit withdrawn
    ing.close()


def test_close_waits_for_inline_drains_while_they_make_progress():
    """Defect: close() gave the inline drains on other threads one timeout in all; run one
    at a time, pushes of 0.6 s each outlasted a 1 s timeout, and close() reported rows lost
    that were stored."""
    store = Recorder()
    ing = FrontIngestion(store=store, timeout=1.0)
    ing.set_schedule(Schedule(0, 1, 0, 1))

    def slow(actor_in: ActorIn, exp_out: BufferOut) -> None:
        time.sleep(0.6)
        exp_out.write(actor_in.read())

    ing.fn, ing.registered = slow, True
    acknowledged: list[int] = []

    def push(k: int) -> None:
        with contextlib.suppress(PlaneClosedError):  # not queued: close() had begun
            ing.submit(unit(10 * k, "n1"), time.monotonic() + 20)
            acknowledged.append(10 * k)

    pushers = [threading.Thread(target=push, args=(k,)) for k in range(4)]
    for p in pushers:
        p.start()
    deadline = time.monotonic() + 10
    while ing._units.inflight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # the others queue (two of them) or wait for room
    ing.close()  # no DataLossError: every drain finished, one after the other
    for p in pushers:
        p.join(10)
    stored = sorted(ids[0] for _, ids in store.writes)
    assert stored == sorted(acknowledged) and len(stored) >= 3  # 3 x 0.6 s > the timeout


@pytest.mark.parametrize(("before", "after"), [(Schedule(0, 1, 0, 1), Schedule(1, 1, 0, 1)),
                                               (Schedule(1, 1, 0, 1), Schedule(0, 1, 0, 1))])
def test_a_schedule_switch_while_a_push_queues_leaves_close_nothing_to_wait_for(before, after):
    """Defect (review): a push counted its inline drain when it queued its unit, then read
    the schedule again to decide whether to drain; a set_schedule in between left the count
    at 1 (close() waited out its timeout) or -1 (close() dropped a queued, acknowledged unit
    as lost)."""
    store = Recorder()
    ing = FrontIngestion(store=store, timeout=5.0)
    ing.set_schedule(before)
    queue = ing._queue

    def queue_then_switch(unit_: QueuedUnit, deadline: float) -> bool:
        inline = queue(unit_, deadline)
        ing.set_schedule(after)  # another thread's switch, between queueing and draining
        return inline

    ing._queue = queue_then_switch  # type: ignore[method-assign]
    ing.submit(unit(0, "n1"), time.monotonic() + 5)
    ing._queue = queue  # type: ignore[method-assign]
    assert ing._drains.count == 0
    ing.close()  # no DataLossError, no wait
    assert [ids for _, ids in store.writes] == [[0, 1]]
