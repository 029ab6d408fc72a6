"""Lifecycle faults of the plane: an inline invocation's error stays with its caller, a worker
stuck past the timeout during a pause leaves a recoverable plane, ``close()`` stores or counts
what is queued while operators are held or inline ingestions run elsewhere, and timeouts and
learner devices are checked when the plane is made."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conduit import (
    ConfigError,
    DataLossError,
    ExperienceDataPlane,
    OperatorError,
    Schedule,
)
from conduit._checks import check_device
from conduit.plane.config import PlaneConfig
from conduit.plane.operator_errors import OperatorErrors
from conduit.plane.runtime import OperatorRuntime
from conduit.storage import UniformSampler
from tests.conftest import make_rows
from tests.plane.helpers import frozen_elsewhere, refusing_ingestion, stored_ids


def slow_raise_own(monkeypatch: pytest.MonkeyPatch, during=None) -> None:  # type: ignore[no-untyped-def]
    """Widen the window between an inline invocation's failure and its caller raising it,
    and run ``during`` (if given) inside it."""
    original = OperatorErrors.raise_own

    def raise_own(self: OperatorErrors, err: OperatorError | None) -> None:
        if err is not None:
            if during is not None:
                during()
            time.sleep(0.1)  # a worker that sees a latched error exits well within this
        original(self, err)

    monkeypatch.setattr(OperatorErrors, "raise_own", raise_own)


# -- an inline invocation's error goes to its caller only -----------------------------------------


def test_inline_ingestion_error_does_not_stop_the_delivery_worker(small_spec, monkeypatch):
    slow_raise_own(monkeypatch)
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                             schedule=Schedule(0, 1, 1, 1), timeout=2) as plane:
        refusing_ingestion(plane)
        plane.push(make_rows(small_spec, 8))
        plane.pull()
        with pytest.raises(OperatorError):
            plane.push(make_rows(small_spec, 8, start=-100))
        assert plane.failed is None
        assert plane._engine.delivery.thread is not None
        assert plane._engine.delivery.thread.is_alive()
        plane.push(make_rows(small_spec, 8, start=8))
        for _ in range(3):
            assert plane.pull(timeout=1)["obs"].shape[0] == 4


def test_inline_delivery_error_is_not_seen_by_pushes_or_the_ingestion_worker(small_spec,
                                                                            monkeypatch):
    seen: list[BaseException | None] = []

    def push_from_actor() -> None:
        def actor() -> None:
            try:
                plane.push(make_rows(small_spec, 4, start=100), timeout=1)
                seen.append(None)
            except BaseException as exc:
                seen.append(exc)

        t = threading.Thread(target=actor)
        t.start()
        t.join(5)

    slow_raise_own(monkeypatch, during=push_from_actor)
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(1, 1, 0, 1), timeout=2)
    calls = [0]

    @plane.register_delivery()
    def deliver(exp_in, learn_out) -> None:  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 2:
            raise ValueError("refused batch")
        learn_out.write(exp_in.read())

    with plane:
        plane.push(make_rows(small_spec, 8))
        plane.pull()
        with pytest.raises(OperatorError, match="refused batch"):
            plane.pull()
        assert seen == [None]  # the actor's push is not answered with the learner's error
        assert plane.failed is None
        assert plane._engine.ingestion.thread is not None
        assert plane._engine.ingestion.thread.is_alive()
        plane.push(make_rows(small_spec, 4, start=200))
        plane.flush(timeout=2)
        assert plane.pull(timeout=1)["obs"].shape[0] == 4
    assert stored_ids(plane) == [*range(8), *range(100, 104), *range(200, 204)]


# -- a worker stuck past the timeout while pausing ----------------------------------------------


def test_worker_stuck_past_the_timeout_in_pause_leaves_a_recoverable_plane(small_spec):
    plane = ExperienceDataPlane(spec=small_spec, capacity=256, batch_size=4,
                                schedule=Schedule(1, 1, 1, 1), timeout=0.3)
    entered, release = threading.Event(), threading.Event()

    @plane.register_ingestion()
    def ingest(actor_in, exp_out) -> None:  # type: ignore[no-untyped-def]
        if not release.is_set():
            entered.set()
            release.wait(5)
        exp_out.write(actor_in.read())

    plane.push(make_rows(small_spec, 4))
    assert entered.wait(5)
    with pytest.raises(OperatorError, match="did not stop"), plane.paused():
        pass
    assert plane.failed is not None  # the plane says it needs recover(), not a silent stall
    with pytest.raises(OperatorError, match="did not stop"):
        plane.push(make_rows(small_spec, 4, start=4))
    release.set()
    time.sleep(0.1)  # the slow invocation returns
    assert isinstance(plane.recover(), OperatorError)
    assert plane.failed is None
    for i in range(1, 4):
        plane.push(make_rows(small_spec, 4, start=4 * i), timeout=2)
    plane.flush(timeout=2)
    assert plane.pull(timeout=2)["obs"].shape[0] == 4
    plane.set_schedule(Schedule(1, 1, 1, 2))
    assert plane.pull(timeout=2)["obs"].shape[0] == 4
    plane.close()
    assert stored_ids(plane) == list(range(16))


# -- close() while operators are held or inline ingestions run elsewhere -------------------------


@pytest.mark.parametrize("hold", ["paused", "frozen", "writes_held"])
def test_close_waits_for_a_hold_on_another_thread_then_stores_the_queue(small_spec, hold):
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(0, 4, 0, 1), timeout=5)
    for i in range(3):  # g_ing = 4: all three stay queued
        plane.push(make_rows(small_spec, 4, start=4 * i))
    entered = threading.Event()

    def holder() -> None:
        held = {"paused": plane.paused, "frozen": lambda: plane.frozen(flush=False),
                "writes_held": plane._engine.writes_held}[hold]()
        with held:
            entered.set()
            time.sleep(0.3)

    t = threading.Thread(target=holder)
    t.start()
    assert entered.wait(5)
    plane.close()
    t.join(5)
    assert stored_ids(plane) == list(range(12))
    assert plane.stats()["pending_units"] == 0


def test_close_counts_the_queue_held_past_the_timeout_as_lost(small_spec):
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(1, 4, 0, 1), timeout=0.3)
    for i in range(3):
        plane.push(make_rows(small_spec, 4, start=4 * i))
    with frozen_elsewhere(plane, hold_s=5), pytest.raises(DataLossError, match="held") as info:
        plane.close()
    assert (info.value.lost_units, info.value.lost_rows) == (3, 12)
    assert plane.closed


def test_close_inside_its_own_pause_stores_the_queue_without_waiting(small_spec):
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(0, 4, 0, 1), timeout=5)
    for i in range(3):
        plane.push(make_rows(small_spec, 4, start=4 * i))
    t0 = time.perf_counter()
    with plane.paused():
        plane.close()
    assert time.perf_counter() - t0 < 2
    assert stored_ids(plane) == list(range(12))


def test_close_waits_for_an_inline_ingestion_on_another_thread_and_leaves_its_loss_to_it(
        small_spec):
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(0, 1, 0, 1), timeout=5)
    entered, release = threading.Event(), threading.Event()

    @plane.register_ingestion()
    def ingest(actor_in, exp_out) -> None:  # type: ignore[no-untyped-def]
        data = actor_in.read()
        if (data["id"] < 0).any():
            entered.set()
            release.wait(5)
            raise ValueError("bad rollout")
        exp_out.write(data)

    plane.push(make_rows(small_spec, 4))
    got: dict[str, BaseException | None] = {}

    def run(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        try:
            fn()
            got[name] = None
        except BaseException as exc:
            got[name] = exc

    pusher = threading.Thread(target=run, args=(
        "push", lambda: plane.push(make_rows(small_spec, 4, start=-50))))
    pusher.start()
    assert entered.wait(5)
    closer = threading.Thread(target=run, args=("close", plane.close))
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive()  # close waits for the ingestion running on the pusher's thread
    release.set()
    closer.join(5)
    pusher.join(5)
    assert isinstance(got["push"], OperatorError)
    assert (got["push"].lost_units, got["push"].lost_rows) == (1, 4)
    # The failed unit was the raising push's own, never acknowledged: close counts no loss.
    assert got["close"] is None
    assert stored_ids(plane) == list(range(4))


def test_close_counts_a_worker_failure_while_it_stops_the_worker(small_spec):
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(1, 1, 0, 1), timeout=5)
    entered, release = threading.Event(), threading.Event()

    @plane.register_ingestion()
    def ingest(actor_in, exp_out) -> None:  # type: ignore[no-untyped-def]
        entered.set()
        release.wait(5)
        raise ValueError("bad rollout")

    plane.push(make_rows(small_spec, 4))
    assert entered.wait(5)
    threading.Timer(0.2, release.set).start()
    with pytest.raises(DataLossError) as info:
        plane.close()
    assert (info.value.lost_units, info.value.lost_rows) == (1, 4)


def test_close_counts_a_worker_failure_recorded_before_another_worker_is_found_stuck(
        small_spec):
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(1, 1, 1, 1), timeout=0.5)
    delivering, release, failing = threading.Event(), threading.Event(), threading.Event()

    @plane.register_ingestion()
    def ingest(actor_in, exp_out) -> None:  # type: ignore[no-untyped-def]
        data = actor_in.read()
        if (data["id"] < 0).any():
            failing.set()
            while not plane.closed:  # fails once close() records failures
                time.sleep(0.005)
            raise ValueError("bad rollout")
        exp_out.write(data)

    @plane.register_delivery()
    def deliver(exp_in, learn_out) -> None:  # type: ignore[no-untyped-def]
        delivering.set()
        release.wait(5)  # the delivery worker is stuck past the timeout
        learn_out.write(exp_in.read())

    try:
        plane.push(make_rows(small_spec, 4))
        assert delivering.wait(5)
        plane.push(make_rows(small_spec, 4, start=-50))  # acknowledged; fails while closing
        assert failing.wait(5)
        with pytest.raises(DataLossError) as info:
            plane.close()
    finally:
        release.set()
    assert (info.value.lost_units, info.value.lost_rows) == (1, 4)
    assert isinstance(info.value.__cause__, OperatorError)
    assert isinstance(info.value.__cause__.__cause__, ValueError)


# -- a worker stuck past the timeout in paused(), whose invocation then fails ----------------------


def stuck_then_failing(small_spec):  # type: ignore[no-untyped-def]
    """A plane whose ingestion worker is stuck in paused() past the timeout (the error is
    latched), then fails that invocation; returns the plane once the worker has exited."""
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(1, 1, 0, 1), timeout=0.3)
    entered, release = threading.Event(), threading.Event()

    @plane.register_ingestion()
    def ingest(actor_in, exp_out) -> None:  # type: ignore[no-untyped-def]
        data = actor_in.read()
        if (data["id"] < 0).any():
            entered.set()
            release.wait(5)
            raise ValueError("the slow invocation fails")
        exp_out.write(data)

    worker = None
    try:
        plane.push(make_rows(small_spec, 4, start=-50))  # acknowledged
        assert entered.wait(5)
        worker = plane._engine.ingestion.thread
        with pytest.raises(OperatorError, match="did not stop"), plane.paused():
            pass
        assert plane.failed is not None and plane.failed.lost_units == 0
    finally:
        release.set()
    assert worker is not None
    worker.join(5)  # the invocation failed and the worker exited
    return plane


def test_a_stuck_workers_own_failure_replaces_the_timeout_error_it_latched(small_spec):
    plane = stuck_then_failing(small_spec)
    failed = plane.failed
    assert isinstance(failed, OperatorError)
    assert isinstance(failed.__cause__, ValueError)
    assert (failed.lost_units, failed.lost_rows) == (1, 4)
    err = plane.recover()
    assert err is failed
    assert plane.failed is None
    plane.push(make_rows(small_spec, 4, start=4))
    plane.flush(timeout=2)
    plane.close()  # the loss was reported by recover()
    assert stored_ids(plane) == [4, 5, 6, 7]


def test_close_reports_a_stuck_workers_failure_after_its_timeout_error(small_spec):
    plane = stuck_then_failing(small_spec)
    with pytest.raises(DataLossError) as info:
        plane.close()
    assert (info.value.lost_units, info.value.lost_rows) == (1, 4)
    assert isinstance(info.value.__cause__.__cause__, ValueError)
    assert len(plane.buffer) == 0


def test_the_first_real_error_still_wins_over_later_ones(small_spec):
    from conduit.plane.flows import Signals
    from conduit.timing import Timings
    rt = OperatorRuntime(flow=_NoFlow(), signals=Signals(), timings=Timings(),  # type: ignore[arg-type]
                         learner_device=torch.device("cpu"))
    stuck = OperatorError("runtime", TimeoutError("stuck"))
    rt.errors.latch(stuck, provisional=True)
    rt.errors.latch(OperatorError("runtime", TimeoutError("stuck again")), provisional=True)
    assert rt.errors.error is stuck
    first = rt.errors.fail("ingestion", ValueError("first"))
    rt.errors.fail("delivery", ValueError("second"))
    assert rt.errors.error is first
    assert rt.errors.recover() is first and rt.errors.error is None


class _NoFlow:
    deliver_ready = None


# -- recover() racing close() ---------------------------------------------------------------------


def test_close_during_recovers_worker_restart_waits_and_stops_the_new_worker(small_spec,
                                                                            monkeypatch):
    from conduit.plane.runners import ThreadedIngestion

    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(1, 1, 0, 1), timeout=3)
    refusing_ingestion(plane)
    plane.push(make_rows(small_spec, 4, start=-50))
    with pytest.raises(OperatorError):
        plane.flush(timeout=5)
    got: dict[str, BaseException | None] = {}

    def close() -> None:
        try:
            plane.close()
            got["close"] = None
        except BaseException as exc:
            got["close"] = exc

    closer = threading.Thread(target=close)
    created: list[threading.Thread] = []

    def start(self: ThreadedIngestion) -> None:
        # close() runs between the worker's creation and its start (if it can).
        self.thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
        created.append(self.thread)
        closer.start()
        closer.join(0.3)
        self.thread.start()

    monkeypatch.setattr(ThreadedIngestion, "start", start)
    assert isinstance(plane.recover(), OperatorError)
    closer.join(5)
    assert not closer.is_alive()
    assert got["close"] is None
    assert plane.closed
    assert created  # the restart ran
    for worker in created:  # every worker the restart made has stopped
        worker.join(2)
        assert not worker.is_alive()


def test_joining_a_worker_never_started_returns(small_spec):
    from conduit.plane.runners import ThreadedIngestion

    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(0, 1, 0, 1), timeout=1)
    runner = ThreadedIngestion(plane._engine.runtime)
    runner.thread = threading.Thread(target=lambda: None)
    runner.join(0.1)  # no RuntimeError from Thread.join
    plane.close()


# -- timeouts and devices are checked when the plane is made --------------------------------------


def test_a_timeout_beyond_threading_timeout_max_is_a_config_error(small_spec):
    too_long = threading.TIMEOUT_MAX * 2
    with pytest.raises(ConfigError) as info:
        ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4, timeout=too_long)
    assert info.value.field == "timeout"
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                                schedule=Schedule(1, 2, 0, 1), timeout=threading.TIMEOUT_MAX)
    plane.push(make_rows(small_spec, 4))  # g_ing = 2: the unit stays queued
    for call in (lambda: plane.push(make_rows(small_spec, 4, start=4), timeout=too_long),
                 lambda: plane.flush(timeout=too_long),
                 lambda: plane.pull(timeout=too_long)):
        with pytest.raises(ConfigError) as info:
            call()
        assert info.value.field == "timeout"
    plane.close()  # the plane's own timeout (TIMEOUT_MAX) works: the queued unit is stored
    assert stored_ids(plane) == list(range(4))


def absent_cuda() -> str:
    return f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"


def absent_cuda_index() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("device", ["bogus", absent_cuda_index(), -1, True, 1.5, None, "meta",
                                    absent_cuda()])
def test_plane_config_refuses_a_device_it_cannot_use(small_spec, device):
    with pytest.raises(ConfigError) as info:
        PlaneConfig(spec=small_spec, capacity=64, batch_size=4, learner_device=device)
    assert info.value.field == "learner_device"


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_plane_config_takes_a_device_or_a_device_string(small_spec, device):
    cfg = PlaneConfig(spec=small_spec, capacity=64, batch_size=4, learner_device=device)
    assert cfg.learner_device == torch.device("cpu")
    assert check_device("d", device) == torch.device("cpu")


def test_an_absent_cuda_learner_is_a_config_error_through_the_plane(small_spec):
    with pytest.raises(ConfigError) as info:
        ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4,
                            learner_device=absent_cuda())
    assert info.value.field == "learner_device"


def test_an_absent_cuda_learner_is_a_config_error_through_the_grpo_path():
    from conduit.integrations.grpo import GroupExperiencePath

    with pytest.raises(ConfigError) as info:
        GroupExperiencePath(group_size=2, groups=2, num_minibatches=1, num_epochs=1,
                            max_prompt_length=4, max_completion_length=4, pad_token_id=0,
                            score=lambda *a: torch.zeros(4), learner_device=absent_cuda())
    assert info.value.field == "learner_device"


class _FailingOnce(UniformSampler):
    """A custom sampler whose next draw raises while ``fail`` is set."""

    fail = False

    def sample(self, size: int, batch_size: int):  # type: ignore[no-untyped-def]
        if self.fail:
            self.fail = False
            raise ValueError("sampler broke")
        return super().sample(size, batch_size)


@pytest.mark.parametrize("overlap_del", [0, 1])
def test_a_sampler_raising_reaches_pull_as_an_operator_error(small_spec, overlap_del) -> None:
    sampler = _FailingOnce(seed=0)
    plane = ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=4, sampler=sampler,
                                schedule=Schedule(0, 1, overlap_del, 1), timeout=5)
    try:
        sampler.fail = True  # the first draw raises (a worker would prefetch ahead of a later one)
        plane.push(make_rows(small_spec, 16))  # (ingested inline: no flush, which would raise
        with pytest.raises(OperatorError) as exc:  # the worker's error if it came first)
            plane.pull()
        assert isinstance(exc.value.__cause__, ValueError)
        plane.recover()
        assert plane.pull()["id"].shape == (4,)  # the plane goes on
    finally:
        plane.close()
