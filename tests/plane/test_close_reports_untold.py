"""``close()`` reports the acknowledged units a latched ingestion failure lost whose pushing
thread no call told of it; a thread told knows already. Leaving ``with plane:`` on an
interrupt keeps the interrupt, with the loss as a note. Both failed before: close reported
nothing once any thread was told, or (after that was widened to every lost unit) a Ctrl-C run
ended in DataLossError instead of its interrupt."""

from __future__ import annotations

import threading
import time
from fractions import Fraction

import pytest
import torch

from conduit import DataLossError, ExperienceDataPlane, ExperienceSpec, FieldSpec, Schedule
from conduit.errors import OperatorError

SPEC = ExperienceSpec({"rid": FieldSpec((), torch.int64)})


def _plane(fail_with: BaseException) -> tuple[ExperienceDataPlane, threading.Event]:
    plane = ExperienceDataPlane(spec=SPEC, capacity=12, mode="on_policy", num_minibatches=3,
                                schedule=Schedule(1, 1, 0, Fraction(1, 3)), timeout=2)
    go = threading.Event()

    @plane.register_ingestion()
    def ingest(actor_in, exp_out) -> None:  # type: ignore[no-untyped-def]
        go.wait(5)
        raise fail_with
    return plane, go


def _wait_latched(plane: ExperienceDataPlane) -> None:
    for _ in range(250):
        if plane.failed is not None:
            return
        time.sleep(0.02)
    raise AssertionError("no failure latched")


def test_a_pushing_thread_told_of_the_failure_is_not_told_again_by_close():
    plane, go = _plane(ValueError("operator bug"))
    for start in (0, 4, 8):  # pushed on this thread
        plane.push({"rid": torch.arange(start, start + 4)}, policy_version=0)
    go.set()
    _wait_latched(plane)
    with pytest.raises(OperatorError):
        plane.pull(timeout=1)  # this thread is told
    plane.close()  # no DataLossError: the thread that pushed them knows


def _failed_after_another_threads_pushes(fail_with: BaseException) -> ExperienceDataPlane:
    """A plane whose ingestion worker failed (latched) over three units an actor thread
    pushed (acknowledged)."""
    plane, go = _plane(fail_with)
    actor = threading.Thread(target=lambda: [plane.push(
        {"rid": torch.arange(s, s + 4)}, policy_version=0) for s in (0, 4, 8)])
    actor.start()
    actor.join()
    go.set()
    _wait_latched(plane)
    return plane


def test_leaving_the_block_on_an_interrupted_operator_keeps_the_interrupt():
    plane = _failed_after_another_threads_pushes(KeyboardInterrupt())
    with pytest.raises(OperatorError) as raised, plane:
        plane.pull(timeout=1)
    assert isinstance(raised.value.__cause__, KeyboardInterrupt)
    assert any("DataLossError" in n or "were not stored" in n
               for n in getattr(raised.value, "__notes__", []))
    assert plane.closed


def test_an_error_leaving_the_block_still_gets_closes_data_loss_error():
    plane = _failed_after_another_threads_pushes(ValueError("operator bug"))
    with pytest.raises(DataLossError) as lost, plane:
        plane.pull(timeout=1)  # the learner is told; the actor thread never was
    assert (lost.value.lost_units, lost.value.lost_rows) == (3, 12)
