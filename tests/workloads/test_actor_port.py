"""``rollout_and_push``: who pushes, and how the learner's time is attributed."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conduit import ExperienceDataPlane, Schedule, SpecError
from conduit.workloads.actor_port import rollout_and_push
from conduit.workloads.breakdown import BreakdownRecorder
from tests.conftest import make_rows


class FakeActors:
    """Two in-process 'actors' whose rollouts take ``delay`` seconds each to arrive. They
    record the order of ``result`` calls and refuse two at once (``ActorGroup`` is not
    thread-safe)."""

    def __init__(self, spec, *, rows=8, delay=0.02, bad_unit=None, lost_unit=None):
        self.spec, self.rows, self.delay, self.bad_unit = spec, rows, delay, bad_unit
        self.lost_unit = lost_unit
        self.n = 0
        self.collected = []
        self._busy = threading.Lock()

    def submit(self, num_steps, weights, params=None):
        handles = [self.n, self.n + 1]
        self.n += 2
        return handles

    def result(self, handle):
        assert self._busy.acquire(blocking=False), "two actors.result calls at once"
        try:
            time.sleep(self.delay)
        finally:
            self._busy.release()
        self.collected.append((handle, threading.current_thread().name))
        if handle == self.lost_unit:
            raise RuntimeError(f"unit {handle} lost")
        rollout = make_rows(self.spec, self.rows, start=handle * self.rows)
        if handle == self.bad_unit:
            rollout["obs"] = rollout["obs"][:, :2]  # wrong shape
        return {"rollout": rollout, "stats": {"rows": self.rows, "episode_returns": [1.0]}}


def _plane(spec, schedule):
    return ExperienceDataPlane(spec=spec, capacity=256, batch_size=8, schedule=schedule,
                               timeout=20)


@pytest.mark.parametrize("overlap", [0, 1])
def test_pushes_and_attribution(small_spec, overlap):
    pushers = []
    with _plane(small_spec, Schedule(overlap, 1, 0, 1)) as plane:
        push = plane.push

        def spy(*a, **k):
            pushers.append(threading.current_thread().name)
            return push(*a, **k)

        plane.push = spy
        actors = FakeActors(small_spec)
        rec = BreakdownRecorder(plane, total_iters=1, log_every=0)
        with rec.iteration(0):
            got = rollout_and_push(plane, actors, 4, None, fragments=3)
        plane.flush()
        assert got["rows"] == 6 * 8 and len(got["episode_returns"]) == 6
        assert len(plane.buffer) == 48
        assert sorted(plane.buffer.store.get(torch.arange(48))["id"].tolist()) == list(
            range(48))
        r = rec.records[0]
        t = plane.timings
        learner = threading.current_thread().name
        assert [h for h, _ in actors.collected] == list(range(6))  # in order, one at a time
        if overlap:
            # The actor port's thread collected and pushed every unit but the last; the
            # learner collected the last after it, waited for the port's last push and then
            # pushed the last unit itself.
            assert pushers == ["conduit-actor-port"] * 5 + [learner]
            assert [name for _, name in actors.collected] == ["conduit-actor-port"] * 5 + [
                learner]
            assert t.count("push_offthread") == 5 and t.count("push_wait") == 1
            assert r.ingestion == pytest.approx(max(0.0, (
                t.total("push") - t.total("push_offthread") + t.total("push_wait"))), abs=1e-9)
            # The port's pushes are not the learner's time: each push_offthread window
            # encloses its push record, so what remains is the final wait and the learner's
            # own push (a timing-free check).
            own = t.records("push")[-1].seconds
            assert t.total("push") - own <= t.total("push_offthread")
            assert r.ingestion <= t.total("push_wait") + own + 1e-9
        else:
            assert set(pushers) == {threading.current_thread().name}
            assert t.count("push_offthread") == 0
            assert r.ingestion == pytest.approx(t.total("push"), abs=1e-9)
        # Six units of 20 ms arrive one after another: the learner waited for them.
        assert r.rollout >= 6 * 0.02 * 0.9
        assert t.count("rollout") == 6


@pytest.mark.parametrize("bad_unit", [1, 2, 3])  # pushed by the port thread, or the learner
def test_a_failing_push_reaches_the_learner(small_spec, bad_unit):
    with (_plane(small_spec, Schedule(1, 1, 0, 1)) as plane,
          pytest.raises(SpecError, match="obs")):
        rollout_and_push(plane, FakeActors(small_spec, delay=0, bad_unit=bad_unit), 4, None,
                         fragments=2)


@pytest.mark.parametrize("lost_unit", [0, 2, 3])
def test_a_unit_that_cannot_be_collected_reaches_the_learner(small_spec, lost_unit):
    """A failure to collect a unit on the port thread (0, 2) or the learner's (3) is raised
    on the learner's thread once the port thread has finished, with no unit collected twice
    or after the port thread failed."""
    actors = FakeActors(small_spec, delay=0, lost_unit=lost_unit)
    with (_plane(small_spec, Schedule(1, 1, 0, 1)) as plane,
          pytest.raises(RuntimeError, match=f"unit {lost_unit} lost")):
        rollout_and_push(plane, actors, 4, None, fragments=2)
    assert [h for h, _ in actors.collected] == list(range(lost_unit + 1))
