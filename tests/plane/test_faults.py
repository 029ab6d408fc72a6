"""Fault injection: every acknowledged push is stored or reported, no fault poisons the plane
for good, and wrong input never becomes a wrong result. Each test names the defect it guards.
"""

from __future__ import annotations

import gc
import math
import threading
import time

import pytest
import torch

from conduit import (
    BackpressureTimeout,
    CapacityError,
    ConfigError,
    DataLossError,
    ExperienceDataPlane,
    OperatorError,
    PlaneClosedError,
    PriorityError,
    Schedule,
    ScheduleError,
    SpecError,
)
from conduit.storage import FifoSampler, UniformSampler
from tests.conftest import make_rows
from tests.plane.helpers import stored_ids

# -- shutdown ------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", [Schedule(0, 1, 0, 1), Schedule(1, 2, 0, 1)],
                         ids=lambda s: s.label())
def test_pushes_racing_close_are_stored_or_refused(small_spec, schedule):
    for trial in range(8):
        plane = ExperienceDataPlane(spec=small_spec, capacity=100_000, batch_size=2,
                                    schedule=schedule, timeout=10)
        acked: list[int] = []
        lock = threading.Lock()

        def actor(k: int, plane: ExperienceDataPlane = plane, acked: list[int] = acked,
                  lock: threading.Lock = lock) -> None:
            for i in range(10_000):
                start = (k * 10_000 + i) * 2
                try:
                    plane.push(make_rows(small_spec, 2, start=start))
                except PlaneClosedError:
                    return
                with lock:
                    acked.extend([start, start + 1])

        threads = [threading.Thread(target=actor, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.02 + 0.005 * trial)
        plane.close()
        for t in threads:
            t.join()
        assert stored_ids(plane) == sorted(acked), f"trial {trial}"


def test_close_reports_rows_it_could_not_store(small_spec):
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2,
                                schedule=Schedule(1, 2, 0, 1))

    @plane.register_ingestion()
    def failing(actor_in, exp_out):
        raise ValueError("operator bug")

    plane.push(make_rows(small_spec, 10))  # one unit, below g_ing=2: still queued
    with pytest.raises(DataLossError) as ei:
        plane.close()
    assert (ei.value.lost_units, ei.value.lost_rows) == (1, 10)
    assert isinstance(ei.value.__cause__, OperatorError)
    assert plane.closed


def test_a_hung_operator_still_leaves_the_plane_closed(small_spec):
    entered, release = threading.Event(), threading.Event()
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2,
                                schedule=Schedule(1, 1, 0, 1), timeout=0.5)

    @plane.register_ingestion()
    def hangs(actor_in, exp_out):
        entered.set()
        release.wait(30)
        exp_out.write(actor_in.read())

    try:
        plane.push(make_rows(small_spec, 3))
        assert entered.wait(10)
        with pytest.raises(DataLossError) as ei:
            plane.close()
        assert ei.value.lost_units == 1
        assert plane.closed
        with pytest.raises(PlaneClosedError):
            plane.push(make_rows(small_spec, 1))
    finally:
        release.set()


def test_dropped_planes_stop_their_threads_and_store_queued_units(small_spec):
    gc.collect()
    before = threading.active_count()
    buffers = []
    for _ in range(20):
        plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2,
                                    schedule=Schedule(1, 2, 1, 1))
        plane.push(make_rows(small_spec, 3))  # below g_ing=2: still queued
        buffers.append(plane.buffer)
        del plane
    gc.collect()
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= before
    assert all(len(b) == 3 for b in buffers)


# -- faults that used to poison the plane ---------------------------------------------------


def test_tensor_without_data_is_refused_by_push(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2) as plane:
        rows = make_rows(small_spec, 4)
        rows["obs"] = torch.empty(4, 4, device="meta")
        with pytest.raises(SpecError, match=r"'obs'.*meta"):
            plane.push(rows)
        plane.push(make_rows(small_spec, 4))
        assert len(plane.buffer) == 4


def _rejects_float64(actor_in, exp_out):
    data = actor_in.read()
    if data["obs"].dtype != torch.float32:
        raise TypeError(f"obs must be float32, got {data['obs'].dtype}")
    exp_out.write(data)


def test_inline_operator_failure_is_raised_to_its_push_and_the_plane_stays_usable(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2) as plane:
        plane.register_ingestion()(_rejects_float64)
        bad = make_rows(small_spec, 4)
        bad["obs"] = bad["obs"].double()
        with pytest.raises(OperatorError, match="float32") as ei:
            plane.push(bad)
        assert ei.value.lost_units == 1
        plane.push(make_rows(small_spec, 4, start=10))
        assert stored_ids(plane) == [10, 11, 12, 13]
        assert plane.pull()["obs"].shape == (2, 4)


def test_worker_failure_fails_dependent_calls_until_recover(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2,
                             schedule=Schedule(1, 1, 1, 1)) as plane:
        plane.register_ingestion()(_rejects_float64)
        plane.push(make_rows(small_spec, 4))
        plane.flush()
        bad = make_rows(small_spec, 4, start=100)
        bad["obs"] = bad["obs"].double()
        plane.push(bad)
        with pytest.raises(OperatorError, match="float32"):
            plane.flush()
        with pytest.raises(OperatorError):
            plane.pull(timeout=1)
        state = plane.state_dict()  # the rows already stored can still be saved
        assert state["buffer"]["writer"]["size"] == 4
        err = plane.recover()
        assert isinstance(err, OperatorError) and err.lost_units == 1
        assert plane.counters["lost_units"] == 1
        plane.push(make_rows(small_spec, 4, start=10))
        plane.flush()
        assert stored_ids(plane) == [0, 1, 2, 3, 10, 11, 12, 13]
        assert plane.pull()["obs"].shape == (2, 4)


class _RaisingSampler(UniformSampler):
    def sample(self, size, batch_size):
        raise RuntimeError("sampler bug")


def test_sampler_raising_on_the_delivery_worker_reaches_pull(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2,
                             sampler=_RaisingSampler(), schedule=Schedule(0, 1, 1, 1)) as plane:
        plane.push(make_rows(small_spec, 8))
        with pytest.raises(OperatorError, match="sampler bug") as ei:
            plane.pull(timeout=5)
        assert isinstance(ei.value.__cause__, RuntimeError)


# -- wrong input never becomes a wrong result ----------------------------------------------------


def test_priority_for_an_unfilled_slot_is_refused(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=100, batch_size=10,
                             sampler="prioritized") as plane:
        plane.push(make_rows(small_spec, 50))
        with pytest.raises(PriorityError, match=r"filled slots in \[0, 50\)"):
            plane.update_priorities(torch.tensor([99]), torch.tensor([1e6]))
        with pytest.raises(PriorityError, match="integer"):
            plane.update_priorities(torch.tensor([3.7]), torch.tensor([1.0]))


def test_priority_for_an_overwritten_row_does_not_land_on_its_successor(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=8, batch_size=8,
                             sampler="prioritized") as plane:
        plane.buffer.sampler.eps = 1e-12
        plane.push(make_rows(small_spec, 8))
        batch = plane.pull()
        plane.push(make_rows(small_spec, 8, start=100))  # overwrites every sampled row
        plane.update_priorities(batch["_index"], torch.full((8,), 1e6))
        ids = [plane.pull()["id"] for _ in range(20)]
        assert len(set(torch.cat(ids).tolist())) > 4  # still spread, not one row


def test_priorities_that_overflow_the_sum_are_refused(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=8,
                             sampler="prioritized") as plane:
        plane.push(make_rows(small_spec, 64))
        batch = plane.pull()
        with pytest.raises(PriorityError, match="too large"):
            plane.update_priorities(batch["_index"], torch.full((8,), 1.7e308,
                                                                dtype=torch.float64))
        assert math.isfinite(plane.buffer.sampler.tree.total)
        assert plane.pull()["_weight"].gt(0).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_bad_timeouts_are_refused(small_spec, bad):
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2) as plane:
        with pytest.raises(ConfigError, match="timeout"):
            plane.push(make_rows(small_spec, 2), timeout=bad)
        with pytest.raises(ConfigError, match="timeout"):
            plane.pull(timeout=bad)


def test_rollout_larger_than_capacity_leaves_the_plane_usable(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=8, batch_size=2) as plane:
        with pytest.raises(CapacityError):
            plane.push(make_rows(small_spec, 9))
        plane.push(make_rows(small_spec, 8))
        assert plane.pull()["obs"].shape == (2, 4)


# -- starvation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap_ing", [0, 1])
@pytest.mark.parametrize("mode", ["off_policy", "on_policy"])
def test_pushed_data_never_waits_for_a_granularity_batch(small_spec, overlap_ing, mode):
    kw = ({"num_minibatches": 2, "schedule": Schedule(overlap_ing, 1, 1, 0.5)}
          if mode == "on_policy" else
          {"batch_size": 4, "sampler": "prioritized", "schedule": Schedule(overlap_ing, 2, 1, 1)})
    with ExperienceDataPlane(spec=small_spec, capacity=8, mode=mode, timeout=5, **kw) as plane:
        if mode == "on_policy":
            plane.push(make_rows(small_spec, 4))
            plane.push(make_rows(small_spec, 4, start=4))
        else:
            plane.push(make_rows(small_spec, 8))  # one unit, g_ing=2
        t0 = time.monotonic()
        assert plane.pull(timeout=5)["obs"].shape[0] == 4
        assert time.monotonic() - t0 < 4  # not the whole timeout


@pytest.mark.parametrize("g", [float("inf"), float("nan")])
def test_non_finite_granularity_is_a_schedule_error(g):
    with pytest.raises(ScheduleError, match="finite"):
        Schedule(0, g, 0, 1)


def test_flush_timeout_is_a_backpressure_timeout(small_spec):
    release = threading.Event()
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2,
                             schedule=Schedule(1, 1, 0, 1), timeout=10) as plane:

        @plane.register_ingestion()
        def slow(actor_in, exp_out):
            release.wait(10)
            exp_out.write(actor_in.read())

        plane.push(make_rows(small_spec, 2))
        with pytest.raises(BackpressureTimeout, match="flush"):
            plane.flush(timeout=0.2)
        release.set()
        plane.flush()
        assert len(plane.buffer) == 2


@pytest.mark.parametrize("schedule", [Schedule(0, 1, 0, 0.5), Schedule(0, 1, 1, 0.5),
                                      Schedule(1, 1, 1, 0.5)], ids=lambda s: s.label())
@pytest.mark.parametrize("failing_call", [1, 2, 3])
def test_an_on_policy_mini_batch_whose_delivery_failed_is_delivered_after_recover(
        small_spec, schedule, failing_call):
    """Defect: the failed invocation's draw was used up, so its rows were never delivered in
    that epoch and the iteration never ended (every later pull and next-version push timed
    out). The mini-batch is now drawn again: the batches are those of a plane that never
    failed, and the next iteration follows."""
    def run(fail_at):
        with ExperienceDataPlane(spec=small_spec, capacity=8, mode="on_policy",
                                 num_minibatches=2, num_epochs=2, schedule=schedule,
                                 timeout=10) as p:
            calls = []

            @p.register_delivery()
            def deliver(exp_in, learn_out):
                calls.append(1)
                if len(calls) == fail_at:
                    raise RuntimeError("transient")
                learn_out.write(exp_in.read())

            got = []
            for version in range(2):
                p.push(make_rows(small_spec, 8, start=100 * version), policy_version=version)
                while len(got) < 4 * (version + 1):
                    try:
                        got.append(p.pull()["id"].tolist())
                    except OperatorError:
                        assert fail_at == len(calls)
                        p.recover()
            assert p.stats()["delivered_batches"] == 8 and p.policy_version == 2
            return got

    got = run(failing_call)
    assert got == run(0)
    for version in range(2):
        for epoch in range(2):
            rows = got[4 * version + 2 * epoch] + got[4 * version + 2 * epoch + 1]
            assert sorted(rows) == list(range(100 * version, 100 * version + 8))


@pytest.mark.parametrize("schedule", [Schedule(0, 1, 0, 0.5), Schedule(1, 1, 1, 0.5)],
                         ids=lambda s: s.label())
def test_minibatches_resumes_a_loop_left_early_and_stays_in_its_iteration(small_spec,
                                                                          schedule):
    """Defect: minibatches() always made M x epochs pulls, so after a loop left early the
    next call ran past the iteration: into the next one's rows when they were pushed, or
    waiting out its timeout when they were not."""
    with ExperienceDataPlane(spec=small_spec, capacity=8, mode="on_policy", num_minibatches=2,
                             num_epochs=2, schedule=schedule, timeout=10) as p:
        p.push(make_rows(small_spec, 8))
        # The next version's rows, pushed as soon as this iteration is consumed.
        actor = threading.Thread(target=p.push, args=(make_rows(small_spec, 8, start=100),),
                                 kwargs={"policy_version": 1})
        actor.start()
        got = []
        for b in p.minibatches():
            got.append(b["id"].tolist())
            break
        got += [b["id"].tolist() for b in p.minibatches()]
        assert len(got) == 4 and all(i < 8 for ids in got for i in ids)
        assert p.policy_version == 1
        actor.join()
        nxt = [b["id"].tolist() for b in p.minibatches()]
        assert len(nxt) == 4 and all(100 <= i < 108 for ids in nxt for i in ids)


def _fails_once_part_way():
    """An ingestion operator that, the first time it gets the unit starting at row 4, writes
    two of its rows and raises."""
    failures = [1]

    def ingest(actor_in, exp_out):
        rows = actor_in.read()
        exp_out.write({k: v[:2] for k, v in rows.items()})
        if failures and int(rows["id"][0]) == 4:
            failures.pop()
            raise RuntimeError("scorer down")
        exp_out.write({k: v[2:] for k, v in rows.items()})
    return ingest


def test_a_minibatch_assembled_early_from_earlier_rows_does_not_keep_failed_rows(small_spec):
    """A mini-batch assembled early from the rows before a failed invocation's cannot hold
    them: they are still taken back, and the rollout pushed again lands once."""
    with ExperienceDataPlane(spec=small_spec, capacity=8, mode="on_policy", num_minibatches=2,
                             schedule=Schedule(1, 0.5, 1, 0.5), timeout=10,
                             sampler=FifoSampler.leading(units=2, num_minibatches=2)) as p:
        p.register_ingestion()(_fails_once_part_way())
        p.push(make_rows(small_spec, 4))
        deadline = time.monotonic() + 10
        while p.stats()["early_batches"] < 1:  # the first mini-batch, from rows 0..3
            assert time.monotonic() < deadline, "no mini-batch was assembled early"
            time.sleep(0.005)
        with pytest.raises(OperatorError):
            p.push(make_rows(small_spec, 4, start=4))
            p.flush()
        p.recover()
        assert len(p.buffer) == 4 and p.stats()["ingested_rows"] == 4
        p.push(make_rows(small_spec, 4, start=4))
        got = [b["id"].tolist() for b in p.minibatches()]
        assert sorted(got[0]) == [0, 1, 2, 3]
        assert sorted(got[0] + got[1]) == list(range(8))


@pytest.mark.parametrize("schedule", [Schedule(0, 0.5, 0, 0.5), Schedule(1, 0.5, 1, 0.5)],
                         ids=lambda s: s.label())
def test_an_on_policy_ingestion_that_fails_part_way_takes_its_rows_back(small_spec, schedule):
    """Defect: an ingestion operator that wrote some of its rows and then raised left them
    in the iteration while its units left the count, so the rollout pushed again landed
    twice (rows delivered twice in an epoch, others never). The rows it wrote are now taken
    back: the iteration holds each row once and the counts agree with the buffer."""
    with ExperienceDataPlane(spec=small_spec, capacity=8, mode="on_policy", num_minibatches=2,
                             schedule=schedule, timeout=10) as p:
        p.register_ingestion()(_fails_once_part_way())
        p.push(make_rows(small_spec, 4))
        p.flush()  # its own invocation (an overlapped worker could take both units at once)
        try:
            p.push(make_rows(small_spec, 4, start=4))
            p.flush()
        except OperatorError:
            pass
        if p.failed is not None:
            p.recover()
        assert len(p.buffer) == 4 and p.stats()["ingested_rows"] == 4
        p.push(make_rows(small_spec, 4, start=4))  # the same rollout again
        got = [b["id"].tolist() for b in p.minibatches()]
        assert sorted(got[0] + got[1]) == list(range(8))
        assert p.stats()["ingested_rows"] == 8 and p.stats()["lost_units"] == 1


@pytest.mark.parametrize("schedule", [Schedule(0, 0.5, 0, 0.5), Schedule(1, 0.5, 1, 0.5)],
                         ids=lambda s: s.label())
@pytest.mark.parametrize("extra", [-1, 1])
def test_an_on_policy_operator_that_writes_another_row_count_fails_its_invocation(
        small_spec, schedule, extra):
    """Defect: an on-policy ingestion operator that wrote fewer rows than its units held left
    an iteration that could never complete (its capacity counts pushed rows), and every pull
    timed out telling the caller to push the whole rollout. The invocation now fails with a
    SpecError naming both counts; its rows are taken back and the plane stays usable."""
    with ExperienceDataPlane(spec=small_spec, capacity=8, mode="on_policy", num_minibatches=2,
                             schedule=schedule, timeout=10) as p:
        wrong = [True]

        @p.register_ingestion()
        def ingest(actor_in, exp_out):
            rows = actor_in.read()
            n = len(rows["id"])
            if wrong and n + extra > 0:
                wrong.clear()
                keep = n + extra if extra < 0 else n
                exp_out.write({k: v[:keep] for k, v in rows.items()})
                if extra > 0:
                    exp_out.write({k: v[:extra] for k, v in rows.items()})
                return
            exp_out.write(rows)

        with pytest.raises(OperatorError) as err:
            p.push(make_rows(small_spec, 4))
            p.flush()
        assert isinstance(err.value.__cause__, SpecError)
        assert "wrote 3 rows" in str(err.value) or "wrote 5 rows" in str(err.value)
        assert "of 4 rows" in str(err.value)
        assert err.value.stored_rows == 0 and "stay in the buffer" not in str(err.value)
        if p.failed is not None:
            p.recover()
        assert len(p.buffer) == 0 and p.stats()["ingested_rows"] == 0
        p.push(make_rows(small_spec, 4))
        p.push(make_rows(small_spec, 4, start=4))
        got = [b["id"].tolist() for b in p.minibatches()]
        assert sorted(got[0] + got[1]) == list(range(8))


@pytest.mark.parametrize("schedule", [Schedule(0, 2, 0, 1), Schedule(1, 2, 0, 1)],
                         ids=lambda s: s.label())
def test_an_off_policy_invocation_that_fails_part_way_names_the_rows_it_left(small_spec,
                                                                           schedule):
    """Defect: an off-policy invocation that wrote one unit and raised on the next reported
    both units' rows as not stored, though the first unit's rows stay in the buffer (pushing
    what the error called lost stored them twice). The error now counts the rows left."""
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=2, schedule=schedule,
                             timeout=10) as p:
        @p.register_ingestion()
        def ingest(actor_in, exp_out):
            for unit in actor_in.read_units():
                if int(unit["id"][0]) >= 100:
                    raise ValueError("bad unit")
                exp_out.write(unit)

        with pytest.raises(OperatorError) as err:
            p.push(make_rows(small_spec, 4))
            p.push(make_rows(small_spec, 3, start=100))
            p.flush()
        assert (err.value.lost_units, err.value.lost_rows, err.value.stored_rows) == (2, 7, 4)
        assert "4 rows the operator wrote before it raised stay in the buffer" in str(err.value)
        assert stored_ids(p) == [0, 1, 2, 3]
        if p.failed is not None:
            p.recover()
        p.push(make_rows(small_spec, 2, start=20))
        p.push(make_rows(small_spec, 2, start=30))
        p.flush()
        assert stored_ids(p) == [0, 1, 2, 3, 20, 21, 30, 31]
