"""The sharded front's ``close()`` reports the acknowledged units a failure on its ingestion
thread lost, also once another call (a learner's, say) was told of the failure: the actors
that pushed them never were. Only ``recover()`` clears them. Fails on the code before."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conduit.distributed.operators import FrontIngestion, QueuedUnit
from conduit.errors import DataLossError, OperatorError
from conduit.plane.ports import ActorIn, BufferOut
from conduit.scheduling import Schedule


def _failing_front(*, pushed_here: bool = False) -> FrontIngestion:
    """A front whose ingestion thread failed its first invocation (one unit of three
    acknowledged ones, pushed by an actor thread, or by this one with ``pushed_here``), and
    this thread's call told of it."""
    go, calls = threading.Event(), []

    def op(actor_in: ActorIn, exp_out: BufferOut) -> None:
        go.wait(5)
        calls.append(1)
        if len(calls) == 1:  # the first invocation only
            raise ValueError("operator bug")
        exp_out.write(actor_in.read())

    ing = FrontIngestion(store=lambda batch, unit, deadline: len(batch["id"]), timeout=5.0)
    ing.fn, ing.registered = op, True
    ing.set_schedule(Schedule(1, 1, 0, 1))  # on the front's ingestion thread
    deadline = time.monotonic() + 5

    def actor() -> None:  # acknowledged: the pushes return
        for start in (0, 4, 8):
            ing.submit(QueuedUnit({"id": torch.arange(start, start + 4)}, 4, "a", None,
                                  threading.current_thread()), deadline)
    if pushed_here:
        actor()
    else:
        pusher = threading.Thread(target=actor)
        pusher.start()
        pusher.join()
    go.set()
    for _ in range(200):
        if ing.error is not None:
            break
        time.sleep(0.02)
    with pytest.raises(OperatorError):
        ing.raise_if_failed()  # this thread's call is told
    return ing


def test_close_reports_units_a_worker_failure_lost_after_a_call_was_told():
    ing = _failing_front()
    with pytest.raises(DataLossError) as lost:
        ing.close()  # the two units still queued are stored
    assert (lost.value.lost_units, lost.value.lost_rows) == (1, 4)


def test_recover_clears_them():
    ing = _failing_front()
    assert ing.recover() is not None
    ing.close()  # no DataLossError


def test_a_pushing_thread_told_is_not_told_again():
    ing = _failing_front(pushed_here=True)
    ing.close()  # no DataLossError
