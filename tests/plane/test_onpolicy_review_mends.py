"""On-policy accounting, interrupts and close(): kept rows of a failed ingestion stay counted
against the iteration, an interrupt in a pull's bookkeeping leaves the iteration whole, close()
reports a latched loss that a call was told of, an oversized rollout is refused at once, and an
interrupt in close()'s own ingestion reaches its caller."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from fractions import Fraction

import pytest
import torch

import conduit.plane.engine as engine_module
import conduit.plane.flows as flows_module
import conduit.plane.onpolicy as onpolicy_module
import conduit.plane.onpolicy_delivery as onpolicy_delivery_module
import conduit.plane.operator_errors as operator_errors_module
import conduit.plane.runtime as runtime_module
from conduit import (
    BackpressureTimeout,
    CapacityError,
    DataLossError,
    ExperienceDataPlane,
    ExperienceSpec,
    FieldSpec,
    OperatorError,
    Schedule,
)
from conduit.storage import FifoSampler

RID = ExperienceSpec({"rid": FieldSpec((), torch.int64)})


def _rids(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["rid"].tolist()


# -- kept rows of a failed on-policy ingestion ------------------------------------------------


def test_rows_a_failed_ingestion_keeps_stay_counted_against_the_iteration():
    """The failed invocation wrote two of its three units before it raised, and an early
    mini-batch was drawn from them, so those 8 rows stay: they count against the iteration,
    a push past the capacity is refused, and no row of policy 0 lands in iteration 1."""
    plane = ExperienceDataPlane(
        spec=RID, capacity=12, mode="on_policy", num_minibatches=3, timeout=5,
        schedule=Schedule(1, 1, 1, Fraction(1, 3)),
        sampler=FifoSampler.leading(units=3, num_minibatches=3))
    fail = [True]

    @plane.register_ingestion()
    def ingest(actor_in, out):  # type: ignore[no-untyped-def]
        for i, unit in enumerate(actor_in.read_units()):
            out.write(unit)
            if fail[0] and i == 1:
                fail[0] = False
                raise ValueError("after two units")

    with plane:
        for start in (0, 4, 8):
            plane.push({"rid": torch.arange(start, start + 4)}, policy_version=0)
        with pytest.raises(OperatorError) as failed:
            plane.flush()
        err = failed.value
        assert (err.lost_units, err.lost_rows, err.stored_rows) == (3, 12, 8)
        notes = " ".join(getattr(err, "__notes__", []))
        assert "rollouts of the 4 rows not stored" in notes
        assert "push again only the last 1" in notes
        plane.recover()
        plane.push({"rid": torch.arange(8, 12)}, policy_version=0)  # the unit not stored
        plane.flush()
        with pytest.raises(CapacityError):
            plane.push({"rid": torch.arange(100, 104)}, policy_version=0)
        first = sorted(r for b in plane.minibatches() for r in _rids(b))
        assert first == list(range(12))
        for start in (1000, 1004, 1008):
            plane.push({"rid": torch.arange(start, start + 4)}, policy_version=1)
        second = sorted(r for b in plane.minibatches() for r in _rids(b))
        assert second == list(range(1000, 1012))


# -- an interrupt in a pull's bookkeeping -------------------------------------------------------

#: The plane's files whose lines a pull runs its bookkeeping in.
TRACED = frozenset({flows_module.__file__, onpolicy_module.__file__,
                    onpolicy_delivery_module.__file__, runtime_module.__file__,
                    engine_module.__file__, operator_errors_module.__file__})


def _interrupt_at(k: int) -> tuple[object, list[int]]:
    """A tracer (for ``sys.settrace``: this thread only) raising ``KeyboardInterrupt`` at the
    ``k``-th line the calling thread runs in the plane's flow, runtime (with its operator
    errors) and engine, and the count of those lines seen so far."""
    seen = [0]

    def local(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "line":
            seen[0] += 1
            if seen[0] == k:
                raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        return local if frame.f_code.co_filename in TRACED else None

    return tracer, seen


def _pull_iteration(plane: ExperienceDataPlane, got: list[list[int]], version: int) -> None:
    """Pull until the plane leaves iteration ``version`` (a delivery error is skipped: the
    mini-batch is owed and drawn again)."""
    for _ in range(20):
        if plane.policy_version != version:
            return
        try:
            got.append(_rids(plane.pull()))
        except OperatorError:
            continue
    raise AssertionError(f"iteration {version} did not end: {got}")


def _interrupted_iteration(k: int, *, operator: str) -> bool:
    """Pull an iteration (3 mini-batches, 2 epochs) with an interrupt at the ``k``-th traced
    line, then the rest of it and a whole next one; check each row is delivered once per
    epoch, but for at most one mini-batch counted delivered as the interrupt came. False when
    the pulls ran fewer than ``k`` traced lines (nothing was interrupted)."""
    plane = ExperienceDataPlane(spec=RID, capacity=12, mode="on_policy", num_minibatches=3,
                                num_epochs=2, timeout=5, seed=3)
    if operator != "identity":
        calls = [0]

        @plane.register_delivery()
        def deliver(exp_in, learn_out):  # type: ignore[no-untyped-def]
            calls[0] += 1
            if operator == "failing" and calls[0] == 2:
                raise ValueError("one failed delivery")
            learn_out.write(exp_in.read())

    with plane:
        plane.push({"rid": torch.arange(12)}, policy_version=0)
        got: list[list[int]] = []
        tracer, seen = _interrupt_at(k)
        interrupted = False
        sys.settrace(tracer)  # type: ignore[arg-type]
        try:
            _pull_iteration(plane, got, 0)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            sys.settrace(None)
        if not interrupted:
            assert seen[0] < k
            return False
        _pull_iteration(plane, got, 0)
        rows = Counter(r for batch in got for r in batch)
        assert set(rows) <= set(range(12)) and max(rows.values()) <= 2, (k, got)
        missing = sorted(r for r in range(12) if rows[r] < 2)
        delivered = plane.counters["delivered_batches"]
        if missing:  # counted delivered as the interrupt came: one mini-batch, once
            assert len(missing) == 4 and all(rows[r] == 1 for r in missing), (k, got)
            assert delivered == len(got) + 1 == 6, (k, got)
        else:
            assert delivered == len(got) == 6, (k, got)
        assert plane.policy_version == 1
        plane.push({"rid": torch.arange(100, 112)}, policy_version=1)
        after: list[list[int]] = []
        _pull_iteration(plane, after, 1)
        assert Counter(r for b in after for r in b) == Counter(list(range(100, 112)) * 2)
        with plane.paused():  # nothing counted in flight
            assert plane._engine.runtime.busy == 0
    return True


@pytest.mark.parametrize("operator", ["identity", "custom", "failing"])
def test_an_interrupt_anywhere_in_a_pull_leaves_the_iteration_whole(operator):
    """A ``KeyboardInterrupt`` landing on any line the pulls run in the flow, the runtime or
    the engine (the draw before it is counted, the hand-over, staging, taking back a failed
    delivery, the end of the iteration) leaves the mini-batch either not drawn (the next pull
    returns it) or counted delivered: never drawn and lost, nor a draw left in flight that
    blocks every later pull."""
    k = 1
    while _interrupted_iteration(k, operator=operator):
        k += 1
    assert k > 20  # the pulls ran that many traced lines, each interrupted once


def test_an_interrupt_after_the_sampler_moved_does_not_skip_its_mini_batch():
    """The draw's count: an interrupt on the line after the sampler's cursor moved (found in
    the source) leaves the mini-batch to the next pull."""
    import inspect

    src, first = inspect.getsourcelines(onpolicy_delivery_module.IterationDelivery)
    lines = [first + i for i, text in enumerate(src) if "self.drawn_in_iter" in text
             and "+ 1" in text and "=" in text and "==" not in text]
    assert lines
    for line in lines:
        plane = ExperienceDataPlane(spec=RID, capacity=12, mode="on_policy",
                                    num_minibatches=3, timeout=5)
        with plane:
            plane.push({"rid": torch.arange(12)}, policy_version=0)
            got = [_rids(plane.pull())]
            hit = [0]

            def local(frame, event, arg, line=line, hit=hit):  # type: ignore[no-untyped-def]
                if event == "line" and frame.f_lineno == line:
                    hit[0] += 1
                    raise KeyboardInterrupt
                return local

            sys.settrace(lambda f, e, a: local if f.f_code.co_filename  # type: ignore[misc]
                         == onpolicy_delivery_module.__file__ else None)
            try:
                with pytest.raises(KeyboardInterrupt):
                    plane.pull()
            finally:
                sys.settrace(None)
            assert hit[0] == 1
            _pull_iteration(plane, got, 0)
            assert sorted(r for batch in got for r in batch) == list(range(12))
            assert plane.counters["delivered_batches"] == 3


# -- close() and a latched loss ---------------------------------------------------------------


def _latched_loss_told_to_the_learner() -> ExperienceDataPlane:
    plane = ExperienceDataPlane(spec=RID, capacity=12, mode="on_policy", num_minibatches=3,
                                schedule=Schedule(1, 1, 0, Fraction(1, 3)), timeout=5)
    go = threading.Event()

    @plane.register_ingestion()
    def ingest(actor_in, out):  # type: ignore[no-untyped-def]
        go.wait(5)
        raise ValueError("operator bug")

    def actor() -> None:  # its three pushes are acknowledged
        for start in (0, 4, 8):
            plane.push({"rid": torch.arange(start, start + 4)}, policy_version=0)

    t = threading.Thread(target=actor)
    t.start()
    t.join()
    go.set()
    with pytest.raises(OperatorError) as told:  # the learner is told, not the actor
        for _ in range(50):
            plane.pull(timeout=0.2)
    assert told.value.lost_units >= 1
    return plane


def test_close_reports_a_latched_loss_that_another_call_was_told_of():
    """The actor's pushes returned; only the learner's pull was told of the worker's failure:
    close() reports the loss unless recover() was called (the caller's word that it handled
    it)."""
    plane = _latched_loss_told_to_the_learner()
    with pytest.raises(DataLossError) as lost:
        plane.close()
    assert (lost.value.lost_units, lost.value.lost_rows) == (3, 12)
    plane = _latched_loss_told_to_the_learner()
    assert plane.recover() is not None
    plane.close()


# -- oversized and far-ahead on-policy pushes --------------------------------------------------


@pytest.mark.parametrize("shaped_by", ["rollout_spec", "operator"])
def test_an_on_policy_rollout_larger_than_the_capacity_is_refused_at_once(shaped_by):
    obs = ExperienceSpec({"obs": FieldSpec((), torch.int64)})
    plane = ExperienceDataPlane(spec=RID, capacity=12, mode="on_policy", num_minibatches=3,
                                timeout=30,
                                rollout_spec=obs if shaped_by == "rollout_spec" else None)

    @plane.register_ingestion()
    def ingest(actor_in, out):  # type: ignore[no-untyped-def]
        out.write({"rid": actor_in.read()["obs"]})

    with plane:
        for version in (1, 0):  # the next version's included: it could never fit either
            with pytest.raises(CapacityError) as refused:
                plane.push({"obs": torch.arange(13)}, policy_version=version)
            assert (refused.value.needed, refused.value.available) == (13, 12)
        assert plane.counters["pushed_units"] == 0


def test_a_push_for_a_later_version_says_it_waits_for_that_version():
    with ExperienceDataPlane(spec=RID, capacity=12, mode="on_policy", num_minibatches=3,
                             timeout=5) as plane:
        with pytest.raises(BackpressureTimeout, match="reach that version") as late:
            plane.push({"rid": torch.arange(4)}, policy_version=2, timeout=0.2)
        assert "policy version 2" in str(late.value) and "at version 0" in str(late.value)
        assert plane.counters["pushed_units"] == 0


# -- an interrupt in close()'s own ingestion ---------------------------------------------------


def test_close_raises_an_interrupt_its_own_ingestion_raised():
    plane = ExperienceDataPlane(spec=RID, capacity=64, batch_size=4,
                                schedule=Schedule(0, 4, 0, 1), timeout=5)
    stop = [False]

    @plane.register_ingestion()
    def ingest(actor_in, out):  # type: ignore[no-untyped-def]
        if stop[0]:
            raise KeyboardInterrupt
        out.write(actor_in.read())

    for start in (0, 4, 8):  # queued: fewer than g_ing units
        plane.push({"rid": torch.arange(start, start + 4)})
    stop[0] = True
    with pytest.raises(KeyboardInterrupt) as interrupted:
        plane.close()
    assert plane.closed
    notes = " ".join(getattr(interrupted.value, "__notes__", []))
    assert "3 rollout units (12 rows) acknowledged by push were not stored" in notes
    plane.close()  # closed: returns at once
