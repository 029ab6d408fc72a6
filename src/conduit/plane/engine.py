"""The plane's engine: the schedule's runners over a flow, and the waits of the two ports.

It starts and stops the runners a schedule asks for, quiesces them (``paused``), admits pushes
under the flow's backpressure, and hands out staged batches. The front
(:class:`~conduit.plane.ExperienceDataPlane`) validates and times the calls; the engine waits.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from conduit.errors import (
    BackpressureTimeout,
    ConfigError,
    EmptyBufferError,
    OperatorError,
    PlaneClosedError,
    StateError,
)
from conduit.plane.config import PlaneConfig
from conduit.plane.drain import close_and_drain
from conduit.plane.drawn_pull import DrawnPull
from conduit.plane.flows import DeliveryJob, Flow, OffPolicyFlow, Signals, Unit
from conduit.plane.holds import OperatorHolds
from conduit.plane.onpolicy import OnPolicyFlow
from conduit.plane.runners import delivery_runner, ingestion_runner
from conduit.plane.runtime import OperatorRuntime
from conduit.scheduling.space import Schedule
from conduit.spec import Batch
from conduit.storage import ExperienceBuffer, data_path_threads
from conduit.storage.state import StateDict, entry
from conduit.timing import TimingRecord, Timings


class PlaneEngine:
    """Runs a flow's operators under a schedule.

    Args:
        flow: The off- or on-policy flow.
        signals: The plane's lock and conditions (shared with the flow).
        timings: Where operator invocations are recorded.
        learner_device: Where delivered batches end up.
        timeout: Seconds a worker may take to stop.
    """

    def __init__(self, *, flow: Flow, signals: Signals, timings: Timings,
                 learner_device: torch.device, timeout: float) -> None:
        self.flow = flow
        self.signals = signals
        self.timeout = timeout
        self.runtime = OperatorRuntime(flow=flow, signals=signals, timings=timings,
                                       learner_device=learner_device)
        self.holds = OperatorHolds(runtime=self.runtime, signals=signals, timeout=timeout)
        self.schedule = flow.schedule
        self.closed = False
        # One thread at a time holds the plane paused (a migration, set_schedule, a load);
        # re-entrant, so that a thread that holds it may pause again inside.
        self._pause_lock = threading.RLock()
        self._pause_depth = 0  # paused() blocks open on the thread holding _pause_lock
        self.ingestion = ingestion_runner(self.runtime, overlap=0)
        self.delivery = delivery_runner(self.runtime, overlap=0)
        #: The inline pull whose batch is the buffer's own sample, for the schedule started
        #: last (None where it does not apply; see :class:`DrawnPull`).
        self.drawn_pull: DrawnPull | None = None

    @classmethod
    def build(cls, config: PlaneConfig, buffer: ExperienceBuffer,
              timings: Timings) -> PlaneEngine:
        """An engine over the flow ``config.mode`` asks for, not started yet."""
        signals = Signals()
        flow_cls = OnPolicyFlow if config.on_policy else OffPolicyFlow
        flow = flow_cls(config=config, buffer=buffer, signals=signals,
                        schedule=config.default_schedule())
        return cls(flow=flow, signals=signals, timings=timings,
                   learner_device=config.learner_device, timeout=config.timeout)

    def stats(self) -> dict[str, Any]:
        """Counters, fill level, schedule and placement (JSON-friendly)."""
        flow = self.flow
        with self.signals.lock:
            return {**flow.counters, "size": len(flow.buffer), "pending_units": len(flow.pending),
                    "staged_batches": len(flow.staged), "policy_version": flow.policy_version,
                    "schedule": self.schedule.to_dict(),
                    "placement": flow.buffer.placement.to_dict(), "mode": flow.config.mode}

    def start(self, schedule: Schedule) -> None:
        """Start the runners ``schedule`` asks for (the previous ones must be stopped)."""
        self.schedule = self.flow.schedule = schedule
        self.runtime.stop = False
        self.ingestion = ingestion_runner(self.runtime, overlap=schedule.overlap_ing)
        self.delivery = delivery_runner(self.runtime, overlap=schedule.overlap_del)
        self.drawn_pull = DrawnPull.build(self)
        self.ingestion.start()
        self.delivery.start()

    def refuse_inside_operator(self, call: str) -> None:
        """Raise if the calling thread runs an operator invocation of this plane: ``call``
        waits for every invocation to end, its caller's included, so it would wait for
        itself.

        Raises:
            ConfigError: (field ``call``) It does.
        """
        op = self.runtime.inside_operator()
        if op is not None:
            raise ConfigError(call, f"called from inside the {op} operator: it waits for the "
                                    f"operators' invocations to end, this one included; call "
                                    f"it from the thread that pushes or pulls (to fail the "
                                    f"invocation, raise from the operator)")

    def stop(self) -> None:
        """Stop the workers (in-flight invocations finish).

        Raises:
            OperatorError: A worker is stuck in an operator past the timeout.
        """
        with self.signals.lock:
            self.runtime.stop = True
            self.signals.wake(callers=True, ingestion=True, delivery=True)
        self.ingestion.join(self.timeout)
        self.delivery.join(self.timeout)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Quiesce both operators: workers stopped, no invocation in flight, early assembly
        dropped. The schedule's workers restart on exit (unless the plane closed), also when
        the block or the wait for the workers is interrupted (``KeyboardInterrupt``).

        One thread at a time holds the plane paused: a call on another thread waits until
        that block ends (within the plane's timeout), so what the block reads of the buffer
        and the spec stays as it read it. The thread holding it may pause again inside.

        Raises:
            OperatorError: A worker is stuck in an operator past the timeout. The error is
                latched (dependent calls raise it) until the stuck invocation's own error, if
                it raises, replaces it, and :meth:`recover`, once the invocation has returned,
                restarts the workers. An invocation on another caller's thread
                (inline) still running after the timeout raises it too, not latched, and so
                does another thread holding the plane paused past the timeout
                (``operator="runtime"``, a ``TimeoutError`` as its cause; nothing changes).
            ConfigError: Called from inside an operator (nothing changes).
        """
        self.refuse_inside_operator("paused")
        if not self._pause_lock.acquire(timeout=self.timeout):
            late = TimeoutError(
                f"another thread held the plane paused (a migration, set_schedule(), "
                f"load_state_dict(), a save or paused()) past the plane's timeout "
                f"({self.timeout}s); nothing was changed: retry once it returns")
            raise OperatorError("runtime", late) from late
        self._pause_depth += 1
        restart = True
        try:
            try:
                self.stop()
            except OperatorError as stuck:
                # The stuck worker exits when its invocation returns (``stop`` is set); a
                # worker started beside it would run invocations out of order, so recover()
                # restarts.
                restart = False
                self.runtime.errors.latch(stuck, provisional=True)
                raise
            with self.quiesced():
                with self.signals.lock:
                    self.flow.pause_locked()
                yield
        finally:
            self._pause_depth -= 1
            try:
                if restart and not self._pause_depth:
                    self._restart()
            finally:
                self._pause_lock.release()

    def _restart(self) -> None:
        """Start the schedule's workers again at the end of the outermost ``paused`` block,
        unless the plane closed. A ``stop`` whose wait was interrupted left the workers
        finishing their invocations: they are waited for first (a worker started beside one
        would run invocations out of order); one still running after the timeout is latched
        as ``stop`` would have (:meth:`recover` restarts)."""
        with self.signals.lock:
            if self.closed or not self.runtime.stop:
                return
        try:
            self.ingestion.join(self.timeout)
            self.delivery.join(self.timeout)
        except OperatorError as stuck:
            self.runtime.errors.latch(stuck, provisional=True)
            return
        with self.signals.lock:  # one step with close()'s check: no worker starts after it
            if not self.closed and self.runtime.stop:
                self.start(self.schedule)

    def quiesced(self) -> contextlib.AbstractContextManager[None]:
        """No operator invocation runs inside the block (in-flight ones finish first); the
        workers stay alive and idle, so entering and leaving costs no thread start.

        Raises:
            OperatorError: An invocation did not finish within the timeout (see
                :meth:`~conduit.plane.holds.OperatorHolds.hold`).
            ConfigError: Called from inside an operator.
        """
        self.refuse_inside_operator("paused")
        return self.holds.hold("paused", until_idle="busy")

    def writes_held(self, *, atomic_buffer: bool = False
                    ) -> contextlib.AbstractContextManager[None]:
        """No ingestion invocation runs inside the block, so the buffer's rows do not change;
        delivery goes on where it never changes rows (off-policy), else it is held too.

        With ``atomic_buffer`` the caller reads the buffer in one call under the buffer's own
        lock (``begin_snapshot``); where the flow's state says nothing about the rows
        (off-policy), that read is already a consistent instant and nothing is held.

        Raises:
            OperatorError: An invocation did not finish within the timeout (see
                :meth:`~conduit.plane.holds.OperatorHolds.hold`).
            ConfigError: Called from inside an operator.
        """
        self.refuse_inside_operator("frozen")
        if atomic_buffer and self.flow.state_is_buffer:
            return contextlib.nullcontext()
        if self.flow.delivery_changes_rows:
            return self.quiesced()
        return self.holds.hold("writes_held", until_idle="ingesting")

    def capture(self, *, rows: bool, buffer: bool = True) -> StateDict:
        """The plane's state (see ``ExperienceDataPlane.state_dict``; without the buffer's
        entry unless ``buffer``); call while paused or while writes are held. The buffer's
        state is read under the buffer's own lock, before the plane's lock is taken, so pushes
        and pulls are not held while its ids are copied."""
        own = {"buffer": self.flow.buffer.state_dict(rows=rows)} if buffer else {}
        with self.signals.lock:
            counters = dict(self.flow.counters)
            # Units queued and not ingested are not part of the state: neither are their
            # pushes, so that a plane loaded from it counts as many rows pushed as ingested.
            counters["pushed_units"] -= len(self.flow.pending)
            counters["pushed_rows"] -= self.flow.pending_rows
            return {**own,
                    "counters": counters, "flow": self.flow.state_dict(),
                    "schedule": self.schedule.to_dict(), "spec": self.flow.spec.to_dict()}

    def restore(self, state: StateDict, *, rows: bool) -> None:
        """Load :meth:`capture`'s state; call while paused.

        Raises:
            StateError: A key is missing or a value would corrupt the buffer.
        """
        with self.signals.lock:
            counters = entry(state, "counters", "plane")
            if not isinstance(counters, dict) or any(
                    isinstance(v, bool) or not isinstance(v, int) or v < 0
                    for v in counters.values()):
                raise StateError("counters", "expected non-negative integers")
            if self.flow.pending and self.flow.config.mode == "on_policy":
                raise StateError("pending", f"{len(self.flow.pending)} rollout units "
                                            f"({self.flow.pending_rows} rows) pushed to this "
                                            f"on-policy plane wait for ingestion and would "
                                            f"join the loaded iteration; pull the current "
                                            f"iteration (or call flush()) first, or load into "
                                            f"a new plane")
            flow, buffer = entry(state, "flow", "plane"), entry(state, "buffer", "plane")
            # Nothing changes unless everything fits: the flow's entry is checked against the
            # rows the buffer will hold, then the buffer loads (all or nothing), then the flow.
            self.flow.check_state(flow, rows=self.flow.buffer.rows_in(buffer))
            self.flow.buffer.load_state_dict(buffer, rows=rows)
            self.flow.load_state_dict(flow)
            self.flow.counters.update(counters)

    def check_open(self) -> None:
        """Raise :class:`PlaneClosedError` once the plane is closed."""
        if self.closed:
            raise PlaneClosedError("the plane is closed; create a new ExperienceDataPlane")

    def submit(self, unit: Unit, *, deadline: float, waited: float) -> None:
        """Queue ``unit`` once the flow admits it, then run inline ingestion if due. A unit
        checked against an older buffer spec (``unit.spec``; a migration completed since) is
        widened to the current one when it is queued (fields the migration added
        zero-filled).

        Raises:
            BackpressureTimeout: No room by ``deadline`` (``waited`` is for the message), or,
                on-policy, the plane did not reach the unit's newer policy version by then.
            OperatorError, StaleRolloutError, CapacityError, PlaneClosedError.
        """
        flow, rt, lock = self.flow, self.runtime, self.signals.lock
        with lock:
            while True:
                self.check_open()  # under the lock: close() then drains whatever was queued
                rt.errors.raise_if_failed()
                if flow.admit_locked(unit.rows, unit.version):
                    break
                if flow.room_by_ingesting and not (rt.paused or rt.writes_held):
                    lock.release()
                    try:
                        if self.ingestion.make_room():
                            continue
                    finally:
                        lock.acquire()
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    if unit.version is not None and unit.version > flow.policy_version:
                        raise BackpressureTimeout(
                            f"push of a rollout of policy version {unit.version} waited "
                            f"{waited:.1f}s for the plane to reach that version; it is at "
                            f"version {flow.policy_version}, whose iteration (and each one "
                            f"after it, before {unit.version}) the learner consumes first")
                    raise BackpressureTimeout(
                        f"push waited {waited:.1f}s for room: {len(flow.pending)} units "
                        f"queued, {flow.inflight_units} being ingested, policy version "
                        f"{flow.policy_version}")
                self.signals.callers.wait(remaining)
            if unit.spec is not None and unit.spec is not flow.spec:
                # A migration widened the spec between the push's check and here: the unit
                # is widened as those queued before it were (migrate's ``widen_pending``).
                from conduit.plane.migration import widen_batch  # (it imports this module)
                unit.data = widen_batch(unit.data, unit.spec, flow.spec, add_fields=True)
                unit.spec = flow.spec
            flow.enqueue_locked(unit)
            self.signals.wake(ingestion=True)
            ingestion = self.ingestion
        ingestion.after_push(unit, deadline)

    def next_batch(self, *, deadline: float, waited: float,
                   records: list[TimingRecord]) -> Batch:
        """The next training batch: a staged one, or, when nothing is staged, one that inline
        delivery makes here (its timing records are appended to ``records``).

        Raises:
            EmptyBufferError: No batch by ``deadline`` (``waited`` is for the message).
            OperatorError: The delivery operator, or the sampler drawing the batch, raised:
                latched when a worker ran it; when this call ran it inline, raised to this
                call only.
            PlaneClosedError: The plane is closed.

        An interrupt (``KeyboardInterrupt``) leaves the batch it was making not drawn (the
        next call draws it again) or counted delivered, never in between.
        """
        drawn: list[DeliveryJob | None] = [None]  # the last job this call took
        try:
            return self._next_batch(deadline, waited, records, drawn)
        except BaseException:
            with self.signals.lock:  # one this call took and did not finish is taken back
                self.runtime.abandon_locked(drawn[0])
            raise

    def _next_batch(self, deadline: float, waited: float, records: list[TimingRecord],
                    drawn: list[DeliveryJob | None]) -> Batch:
        rt, flow = self.runtime, self.flow
        busy = False  # the last hurry found another thread's inline ingestion running
        while True:
            job = None
            with self.signals.lock:
                self.check_open()
                rt.errors.raise_if_failed()
                staged = flow.pop_staged_locked()
                if staged is not None:
                    return staged.batch
                try:
                    job = drawn[0] = self.delivery.take_locked()
                except Exception as exc:  # e.g. a custom sampler raising, as on the worker
                    raise rt.errors.fail("delivery", exc, latch=False) from exc
                # Data already pushed never waits for a granularity batch to fill.
                hurry = (job is None and bool(flow.pending) and not (rt.paused or rt.writes_held)
                         and flow.starved_locked())
                if hurry and self.ingestion.overlapped:
                    self.ingestion.hurry()
                    hurry = False
                if job is None and (busy or not hurry):
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:
                        raise EmptyBufferError(flow.empty_message(waited))
                    # (the end of that ingestion wakes callers; the short wait covers an end
                    # that came before this wait began)
                    self.signals.callers.wait(min(remaining, 0.05 if busy else 0.5))
                    busy = False
                    continue
            if job is None:
                busy = not self.ingestion.hurry()
                continue
            busy = False
            if rt.hands_over_drawn(job):  # the buffer's sample is the batch
                batch = rt.run_drawn(job, records)
            else:
                with data_path_threads(1):
                    err, batch = rt.run_delivery(job, caller_records=records)
                rt.errors.raise_own(err)
            if batch is not None:
                return batch

    def recover(self) -> OperatorError | None:
        """Unlatch the operator error and restart the schedule's workers; the buffer's rows
        and the queued units are kept. Returns the error that was latched, if any.

        Raises:
            OperatorError: A worker is still stuck in an operator past the timeout (the
                error is latched again; call again once the invocation has returned).
        """
        self.refuse_inside_operator("recover")
        err = self.runtime.errors.recover()
        if err is not None and not self.closed:
            with self.paused():
                pass  # the workers exited on the error; paused() restarts them
        return err

    def close(self) -> None:
        """Refuse new calls, stop the workers, and ingest every queued unit.

        Inline ingestions already running on other threads finish first, and operators held
        by other threads (``paused()``, ``frozen()``, a save) are waited for, each wait
        within the timeout, so that the queued units can be ingested in push order. The
        queued units are then ingested on the calling thread, each invocation taking as long
        as the ingestion operator takes (the timeout bounds the waits, not the operator).

        Raises:
            DataLossError: Some acknowledged units could not be stored (a latched ingestion
                failure not cleared by :meth:`recover`, whether or not a call raised it
                meanwhile, a failure while closing on a worker or in close's own ingestion,
                a worker stuck in an operator, or operators held by another thread past the
                timeout); the first cause is attached. An inline ingestion failing on
                another thread is raised to that thread's caller, and only the units that
                caller's thread pushed are not counted here again: those other threads
                pushed (their pushes returned) are counted, as nobody told their callers,
                unless :meth:`recover` cleared them.
            KeyboardInterrupt: (or another interrupt that is not an ``Exception``) The
                ingestion operator raised it in close's own ingestion: the units still
                queued are not ingested, the plane is closed all the same, and the interrupt
                is raised with the ``DataLossError`` message as a note.
        """
        if not self.closed:  # once closed, a call returns at once from any thread
            self.refuse_inside_operator("close")
        close_and_drain(self)
