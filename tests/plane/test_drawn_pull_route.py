"""An inline pull whose batch is the buffer's own sample takes the drawn route
(:class:`~conduit.plane.drawn_pull.DrawnPull`) and hands every case it cannot finish to the
general route, which then behaves as for any pull."""

from __future__ import annotations

import threading

import pytest
import torch

from conduit import ExperienceDataPlane, Schedule
from conduit.errors import OperatorError
from conduit.plane.engine import PlaneEngine
from conduit.storage import ExperienceBuffer, PrioritizedSampler, UniformSampler
from tests.conftest import make_rows
from tests.plane.helpers import filled_plane


def assert_settled(plane: ExperienceDataPlane, *, delivered: int, invocations: int) -> None:
    """Every job finished, no batch staged, and these counts."""
    stats = plane.stats()
    assert stats["delivered_batches"] == delivered and stats["invocations_del"] == invocations
    assert stats["staged_batches"] == 0 and plane._engine.flow.delivering == 0


def general_route_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the pulls that ran the general route (``PlaneEngine.next_batch``)."""
    calls: list[int] = []
    real = PlaneEngine.next_batch

    def counted(self, **kw):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(self, **kw)

    monkeypatch.setattr(PlaneEngine, "next_batch", counted)
    return calls


def twin(spec) -> ExperienceBuffer:  # type: ignore[no-untyped-def]
    buf = ExperienceBuffer(spec=spec, capacity=64, sampler=UniformSampler(seed=5))
    buf.extend(make_rows(spec, 40, start=100))
    return buf


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_inline_uniform_pulls_take_the_drawn_route_and_are_recorded(small_spec, monkeypatch):
    plane = filled_plane(small_spec, Schedule(0, 1, 0, 1))
    general = general_route_calls(monkeypatch)
    want = twin(small_spec)
    try:
        assert plane._engine.drawn_pull is not None
        for _ in range(5):
            assert_same(plane.pull(), want.sample(8))
        assert general == []
        assert_settled(plane, delivered=5, invocations=5)
        assert plane.timings.count("pull") == 5 and plane.timings.count("delivery") == 5
    finally:
        plane.close()


@pytest.mark.parametrize("schedule,kw", [
    (Schedule(0, 1, 1, 1), {}),  # overlapped delivery: the worker samples
    (Schedule(0, 1, 0, 2), {}),  # two batches per invocation: drawn before the gather
    (Schedule(0, 1, 0, 1), {"sampler": PrioritizedSampler(seed=5)}),  # draws go stale
])
def test_no_drawn_route_where_the_batch_is_not_the_buffer_sample(small_spec, schedule, kw):
    plane = filled_plane(small_spec, schedule, **kw)
    try:
        assert plane._engine.drawn_pull is None
        assert plane.pull()["_index"].shape == (8,)
    finally:
        plane.close()


def test_a_pull_with_a_timeout_takes_the_general_route_with_the_same_rows(small_spec,
                                                                          monkeypatch):
    plane = filled_plane(small_spec, Schedule(0, 1, 0, 1))
    general = general_route_calls(monkeypatch)
    want = twin(small_spec)
    try:
        assert_same(plane.pull(timeout=5.0), want.sample(8))
        assert_same(plane.pull(), want.sample(8))
        assert general == [1]
        assert plane.stats()["delivered_batches"] == 2
    finally:
        plane.close()


def test_the_route_follows_the_schedule(small_spec, monkeypatch):
    plane = filled_plane(small_spec, Schedule(0, 1, 0, 1))
    try:
        route = plane._engine.drawn_pull
        assert route is not None
        plane.set_schedule(Schedule(0, 1, 1, 1))
        assert plane._engine.drawn_pull is None
        # a route read before the switch is not used after it
        assert route.pull(0.0) is None
        general = general_route_calls(monkeypatch)
        plane.pull()
        assert general == [1]
        plane.set_schedule(Schedule(0, 1, 0, 1))
        assert plane._engine.drawn_pull is not None
        while plane.stats()["staged_batches"]:  # what the worker staged goes first
            plane.pull()
        taken = len(general)
        plane.pull()
        plane.pull()
        assert len(general) == taken
    finally:
        plane.close()


def test_an_interrupt_before_the_sample_takes_the_job_back(small_spec, monkeypatch):
    plane = filled_plane(small_spec, Schedule(0, 1, 0, 1))
    rt = plane._engine.runtime

    def interrupted(job, records):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    try:
        with monkeypatch.context() as m:
            m.setattr(rt, "run_drawn", interrupted)
            with pytest.raises(KeyboardInterrupt):
                plane.pull()
        assert plane._engine.flow.delivering == 0
        assert plane.stats()["delivered_batches"] == 0
        assert plane.pull()["_index"].shape == (8,)
        assert plane.stats()["delivered_batches"] == 1
    finally:
        plane.close()  # would wait for the job in flight if it were not taken back


def test_an_error_latched_during_the_sample_drops_the_batch_and_is_raised(small_spec,
                                                                        monkeypatch):
    plane = filled_plane(small_spec, Schedule(0, 1, 0, 1))
    rt = plane._engine.runtime
    buf = plane.buffer
    real = buf.sample
    cause = RuntimeError("a worker failed")

    def sample_then_latch(batch_size, **kw):  # type: ignore[no-untyped-def]
        rows = real(batch_size, **kw)
        rt.errors.latch(OperatorError("ingestion", cause))
        return rows

    monkeypatch.setattr(buf, "sample", sample_then_latch)
    try:
        with pytest.raises(OperatorError) as info:
            plane.pull()
        assert info.value.operator == "ingestion" and "a worker failed" in str(info.value)
        assert_settled(plane, delivered=0, invocations=1)
        assert plane.timings.count("delivery") == 1
    finally:
        monkeypatch.undo()
        plane.recover()
        plane.close()


def test_a_batch_staged_during_the_sample_is_delivered_first(small_spec, monkeypatch):
    plane = filled_plane(small_spec, Schedule(0, 1, 0, 1))
    flow = plane._engine.flow
    buf = plane.buffer
    real = buf.sample
    first = {k: v.clone() for k, v in real(8).items()}
    staged_once = threading.Event()

    def sample_beside_a_staged_batch(batch_size, **kw):  # type: ignore[no-untyped-def]
        rows = real(batch_size, **kw)
        if not staged_once.is_set():
            staged_once.set()
            with plane._engine.signals.lock:  # as another caller's invocation could
                flow.stage_locked([first], flow.priority_generation, None, None)
        return rows

    monkeypatch.setattr(buf, "sample", sample_beside_a_staged_batch)
    try:
        got = plane.pull()
        assert_same(got, first)
        assert plane.stats()["staged_batches"] == 1  # the sampled batch waits its turn
        second = plane.pull()
        assert not torch.equal(second["_index"], first["_index"])
        stats = plane.stats()
        assert stats["staged_batches"] == 0 and stats["delivered_batches"] == 2
        assert flow.delivering == 0
    finally:
        plane.close()


def test_a_pull_waits_while_another_thread_holds_the_plane_paused(small_spec):
    plane = filled_plane(small_spec, Schedule(0, 1, 0, 1))
    got: list[dict[str, torch.Tensor]] = []
    try:
        with plane.paused():
            puller = threading.Thread(target=lambda: got.append(plane.pull()))
            puller.start()
            puller.join(0.3)
            assert puller.is_alive() and got == []
        puller.join(10)
        assert len(got) == 1 and got[0]["_index"].shape == (8,)
    finally:
        plane.close()


def test_a_pull_after_close_raises_plane_closed(small_spec):
    from conduit.errors import PlaneClosedError

    plane = filled_plane(small_spec, Schedule(0, 1, 0, 1))
    plane.pull()
    plane.close()
    with pytest.raises(PlaneClosedError):
        plane.pull()


def test_pulls_from_two_threads_each_get_their_own_batches(small_spec):
    plane = filled_plane(small_spec, Schedule(0, 1, 0, 1))
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def learner(k: int) -> None:
        try:
            for _ in range(200):
                batch = plane.pull()
                ids = batch["id"].clone()
                # each row whole, and its own (obs is a function of id; a torn or shared
                # batch would mix rows)
                assert torch.equal(batch["obs"], ids.to(torch.float32)[:, None].expand(8, 4))
                assert ((ids >= 100) & (ids < 140)).all()
                got[k].append(ids)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=learner, args=(k,)) for k in (0, 1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == [] and all(not t.is_alive() for t in threads)
        assert len(got[0]) == len(got[1]) == 200
        assert_settled(plane, delivered=400, invocations=400)
        assert plane.timings.count("pull") == 400
    finally:
        plane.close()
