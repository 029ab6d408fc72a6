"""On-policy: the iteration's first mini-batches are assembled while its rows arrive."""

import threading
import time

import pytest
import torch

from conduit import EmptyBufferError, ExperienceDataPlane, Schedule
from conduit.plane.early import EarlyBatch
from conduit.storage import FifoSampler
from tests.conftest import make_rows

N, M, EPOCHS, UNIT = 48, 4, 2, 12


def _plane(spec, schedule):
    return ExperienceDataPlane(spec=spec, capacity=N, mode="on_policy", num_minibatches=M,
                               num_epochs=EPOCHS, schedule=schedule, seed=3, timeout=20)


def _push_unit_by_unit(plane, spec, it):
    """Push iteration ``it``'s rollout; with overlapped ingestion, each unit after the one
    before was ingested, so that every unit is one buffer write whatever the threads'
    timing (a worker that falls behind ingests the units it finds pending in one write, and
    one write that lands the whole iteration leaves nothing to assemble early)."""
    for start in range(0, N, UNIT):
        plane.push(make_rows(spec, UNIT, start=it * 1000 + start), policy_version=it)
        if start + UNIT == N or not plane.schedule.overlap_ing:
            continue  # the last unit, or units ingested as the schedule's granularity says
        deadline = time.monotonic() + 20
        while plane.counters["ingested_rows"] < it * N + start + UNIT:
            assert time.monotonic() < deadline, "a unit was not ingested within 20 s"
            time.sleep(0.001)


def _run(plane, spec, iters=2):
    out = []
    for it in range(iters):
        _push_unit_by_unit(plane, spec, it)
        out.append(list(plane.minibatches()))
    return out


def test_early_minibatches_are_the_same_batches(small_spec):
    with _plane(small_spec, Schedule.inline(num_minibatches=M)) as ref_plane:
        ref = _run(ref_plane, small_spec)
        assert ref_plane.counters["early_batches"] == 0  # the inline baseline gathers
    with _plane(small_spec, Schedule(1, 0.25, 1, 0.25)) as plane:
        # The first iteration's completing buffer write is held until the learner has its
        # first two mini-batches: they can only have been assembled early.
        gate, written, extend = threading.Event(), [0], plane.buffer.extend

        def held_extend(data, validate=True):
            written[0] += int(data["id"].shape[0])
            if written[0] == N:
                assert gate.wait(20)
            return extend(data, validate=validate)

        plane.buffer.extend = held_extend
        got = []
        for it in range(2):
            _push_unit_by_unit(plane, small_spec, it)
            batches = []
            for mb in plane.minibatches():
                batches.append(mb)
                if len(batches) == 2:
                    gate.set()
            got.append(batches)
        # Two per iteration: the overlapped delivery's prefetch depth.
        assert plane.counters["early_batches"] == 2 * 2
    for it_ref, it_got in zip(ref, got):
        for a, b in zip(it_ref, it_got):
            assert a.keys() == b.keys()
            for k in a:
                assert torch.equal(a[k], b[k]), k


def test_first_minibatch_does_not_wait_for_the_buffer_write(small_spec):
    """The last rollout's buffer write is held back: the first mini-batches are delivered
    anyway, the rest of the iteration waits for the write, and nothing is lost."""
    gate = threading.Event()
    with _plane(small_spec, Schedule(1, 0.25, 1, 0.25)) as plane:
        written = []
        extend = plane.buffer.extend

        def held_extend(data, validate=True):
            written.append(int(data["id"].shape[0]))
            if sum(written) == N:  # the write that completes the iteration
                assert gate.wait(20)
            return extend(data, validate=validate)

        plane.buffer.extend = held_extend
        _push_unit_by_unit(plane, small_spec, 0)
        first = [plane.pull(timeout=10) for _ in range(2)]
        with pytest.raises(EmptyBufferError):
            plane.pull(timeout=0.3)  # the third needs every row in the buffer
        gate.set()
        rest = [plane.pull(timeout=10) for _ in range(M * EPOCHS - 2)]
        assert plane.policy_version == 1
        ids = [mb["id"] for mb in first + rest]
        for e in range(EPOCHS):
            assert sorted(torch.cat(ids[e * M:(e + 1) * M]).tolist()) == list(range(N))


def test_minibatches_that_cannot_be_assembled_fall_back_to_a_gather(small_spec, monkeypatch):
    with _plane(small_spec, Schedule.inline(num_minibatches=M)) as ref_plane:
        ref = _run(ref_plane, small_spec, iters=1)
    monkeypatch.setattr(EarlyBatch, "fill", lambda self, spec, data, start, n: 0)
    with _plane(small_spec, Schedule(1, 0.25, 1, 0.25)) as plane:
        got = _run(plane, small_spec, iters=1)
        assert plane.counters["early_batches"] == 0
    for a, b in zip(ref[0], got[0]):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_no_early_minibatch_ends_the_iteration(small_spec):
    """With one mini-batch per iteration, delivering it clears the buffer: it is never
    assembled early, so it waits for every write."""
    with ExperienceDataPlane(spec=small_spec, capacity=N, mode="on_policy", num_minibatches=1,
                             num_epochs=1, schedule=Schedule(1, 1, 1, 1), timeout=20) as plane:
        for it in range(3):
            plane.push(make_rows(small_spec, N, start=it * 1000), policy_version=it)
            assert sorted(plane.pull()["id"].tolist()) == list(range(it * 1000, it * 1000 + N))
        assert plane.counters["early_batches"] == 0


def test_early_minibatch_is_staged_by_the_ingestion_thread(small_spec):
    """A complete early mini-batch that is next in line is delivered by the thread that
    completed it, without a hand-off to the delivery worker."""
    threads = []
    with _plane(small_spec, Schedule(1, 0.25, 1, 0.25)) as plane:
        @plane.register_delivery()
        def delivery(exp_in, learn_out):
            threads.append(threading.current_thread().name)
            learn_out.write(exp_in.read())

        _run(plane, small_spec, iters=1)
    assert threads[0] == "conduit-ingestion"
    assert threads[-1] == "conduit-delivery"  # gathers stay on the delivery worker


@pytest.mark.parametrize("g_ing", [0.125, 0.25])
def test_per_unit_ingestion_delivers_the_same_batches(small_spec, g_ing):
    """Rollout units smaller than a mini-batch make their share a feasible granularity;
    ingesting once per unit changes when rows land, never the batches."""
    half = UNIT // 2  # 6-row units: 1/8 of the iteration, half a mini-batch
    with _plane(small_spec, Schedule.inline(num_minibatches=M)) as ref_plane:
        ref = _run(ref_plane, small_spec)
    with ExperienceDataPlane(spec=small_spec, capacity=N, mode="on_policy", num_minibatches=M,
                             num_epochs=EPOCHS, seed=3, timeout=20, rollout_rows=half,
                             schedule=Schedule(1, g_ing, 1, 0.25)) as plane:
        # One unit alone is ingested at g = 1/8, and waits for a second one at g = 1/4.
        plane.push(make_rows(small_spec, half, start=0), policy_version=0)
        deadline = time.monotonic() + 10
        while g_ing == 0.125 and plane.counters["ingested_rows"] < half:
            assert time.monotonic() < deadline, "a lone unit was not ingested at g = 1/8"
            time.sleep(0.005)
        time.sleep(0.05)
        assert plane.counters["ingested_rows"] == (half if g_ing == 0.125 else 0)
        plane.push(make_rows(small_spec, half, start=half), policy_version=0)
        for start in range(UNIT, N, half):
            plane.push(make_rows(small_spec, half, start=start), policy_version=0)
        first = list(plane.minibatches())
        for it in range(1, 2):
            for start in range(0, N, half):
                plane.push(make_rows(small_spec, half, start=it * 1000 + start),
                           policy_version=it)
        got = [first, list(plane.minibatches())]
    for it_ref, it_got in zip(ref, got):
        for a, b in zip(it_ref, it_got):
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_rollout_rows_shapes_the_space(small_spec):
    def space(**kw):
        with ExperienceDataPlane(spec=small_spec, capacity=N, mode="on_policy",
                                 num_minibatches=M, **kw) as plane:
            return [str(g) for g in plane.space.g_ing]

    assert space() == ["1/4", "1/2", "3/4", "1"]
    assert space(rollout_rows=UNIT // 2) == ["1/8", "1/4", "1/2", "3/4", "1"]
    assert space(rollout_rows=UNIT // 3) == ["1/12", "1/6", "1/4", "1/2", "3/4", "1"]
    assert space(rollout_rows=N) == ["1/4", "1/2", "3/4", "1"]  # units of a whole iteration


def test_first_minibatch_from_the_head_is_delivered_before_the_last_unit(small_spec):
    """With ``first_within = 1 - 1/units`` the first mini-batch only holds rows of the earlier
    units: it is delivered before the last unit is pushed, and every schedule delivers the
    same batches."""
    def plane(schedule):
        return ExperienceDataPlane(spec=small_spec, capacity=N, mode="on_policy",
                                   num_minibatches=M, num_epochs=EPOCHS, schedule=schedule,
                                   timeout=20, sampler=FifoSampler(num_minibatches=M, seed=3,
                                                                   first_within=1 - UNIT / N))

    with plane(Schedule.inline(num_minibatches=M)) as ref_plane:
        ref = _run(ref_plane, small_spec)
    with plane(Schedule(1, 0.25, 1, 0.25)) as p:
        got = []
        for it in range(2):
            for start in range(0, N - UNIT, UNIT):
                p.push(make_rows(small_spec, UNIT, start=it * 1000 + start), policy_version=it)
            first = p.pull(timeout=10)  # the last unit is not pushed yet
            assert int(first["id"].max()) < it * 1000 + N - UNIT
            p.push(make_rows(small_spec, UNIT, start=it * 1000 + N - UNIT), policy_version=it)
            got.append([first, *(p.pull(timeout=10) for _ in range(M * EPOCHS - 1))])
        assert p.counters["early_batches"] >= 2
    for it_ref, it_got in zip(ref, got):
        for a, b in zip(it_ref, it_got):
            for k in a:
                assert torch.equal(a[k], b[k]), k
