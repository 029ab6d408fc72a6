"""Runners: on which thread each operator's invocations run.

An inline runner (``overlap = 0``) runs invocations on the caller's thread: ingestion inside
``push`` every ``g_ing`` units, delivery inside ``pull``. A threaded runner (``overlap = 1``)
runs them on a background worker, so they overlap the actors' rollout and the learner's update.
The same flow and the same operators run under either; only the runner changes
(docs/design.md §2).
"""

from __future__ import annotations

import threading
import time
from typing import Generic, TypeVar

import torch

from conduit.errors import BackpressureTimeout, OperatorError
from conduit.plane.flows import DeliveryJob, Unit
from conduit.plane.runtime import OperatorRuntime

W = TypeVar("W")


class Runner(Generic[W]):
    """Runs one operator's invocations.

    Args:
        runtime: The operator runtime.
    """

    #: Name of the worker thread (threaded runners).
    thread_name = ""
    #: The operator whose invocations this runner runs.
    operator = ""

    def __init__(self, runtime: OperatorRuntime) -> None:
        self.rt = runtime
        self.thread: threading.Thread | None = None

    @property
    def overlapped(self) -> bool:
        """Whether invocations run on a background worker."""
        return bool(self.thread_name)

    def start(self) -> None:
        """Start the worker (threaded runners)."""
        if self.thread_name:
            self.thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
            self.thread.start()

    def join(self, timeout: float) -> None:
        """Wait for the worker to stop (after the runtime's ``stop`` flag was set); a worker
        not started yet is not waited for.

        Raises:
            OperatorError: The worker is stuck in an operator past ``timeout``.
        """
        thread = self.thread
        if thread is None or thread.ident is None:  # none, or not started yet
            return
        thread.join(timeout=timeout)
        if thread.is_alive():
            raise OperatorError("runtime", TimeoutError(
                f"worker {thread.name} did not stop within {timeout}s"))
        if self.thread is thread:
            self.thread = None

    def _loop(self) -> None:
        """The worker's body: run invocations until stopped or an operator fails."""
        torch.set_num_threads(1)
        while True:
            with self.rt.signals.lock:
                while True:
                    if self.rt.stop or self.rt.errors.error is not None:
                        return
                    try:
                        work = self._take_locked()
                    except BaseException as exc:  # e.g. a custom sampler raising
                        self.rt.errors.fail(self.operator, exc)
                        return
                    if work is not None:
                        break
                    self._wait_locked()
            self._run(work)

    def _take_locked(self) -> W | None:
        """The worker's next invocation, or None to wait (threaded runners)."""
        return None

    def _wait_locked(self) -> None:
        """Wait for work (threaded runners)."""
        return None

    def _run(self, work: W) -> None:
        """Run one invocation on the worker (threaded runners)."""
        return None


class InlineIngestion(Runner[list[Unit]]):
    """Ingestion on the pushing thread, every ``g_ing`` units."""

    operator = "ingestion"

    def after_push(self, unit: Unit, deadline: float) -> None:
        """Ingest if ``g_ing`` units are queued, until ``unit`` (the push's) is taken, waiting
        for other threads' inline invocations until ``deadline`` (see
        :meth:`~conduit.plane.runtime.OperatorRuntime.drain_inline`)."""
        self.rt.drain_inline(force=False, deadline=deadline, current=unit)

    def make_room(self) -> bool:
        """Ingest what is queued so a waiting push gets room; True when it ran (False: another
        thread's inline invocation runs, which makes room)."""
        return self.rt.drain_inline(force=True, deadline=None)

    def flush(self, deadline: float) -> None:
        """Ingest every queued unit now, waiting for other threads' inline invocations until
        ``deadline``.

        Raises:
            BackpressureTimeout: Another thread's inline ingestion ran past ``deadline``.
            OperatorError: An ingestion invocation failed.
        """
        self.rt.drain_inline(force=True, deadline=deadline)

    def hurry(self) -> bool:
        """A learner waits for data: ingest what is queued, however few units, on the
        caller's thread (call without the lock); False when another thread's inline
        invocation runs (it does not wait for it: the learner waits on the plane's condition,
        under its own timeout)."""
        return self.rt.drain_inline(force=True, deadline=None)


class ThreadedIngestion(InlineIngestion):
    """Ingestion on the ``conduit-ingestion`` worker, overlapping the actors' rollout."""

    thread_name = "conduit-ingestion"

    def __init__(self, runtime: OperatorRuntime) -> None:
        super().__init__(runtime)
        self.flush_requested = 0
        self.hurried = False

    def hurry(self) -> bool:
        """A learner waits for data: the worker ingests what is queued, however few units
        (call with the lock held). True: the worker was asked."""
        if not self.hurried:
            self.hurried = True
            self.rt.signals.wake(ingestion=True)
        return True

    def after_push(self, unit: Unit, deadline: float) -> None:
        """Nothing: the worker was woken when the unit was queued."""
        return None

    def make_room(self) -> bool:
        """Nothing to do on the caller's thread: wait for the worker."""
        return False

    def flush(self, deadline: float) -> None:
        """Wait until the worker ingested every queued unit (fewer than ``g_ing`` included).

        Raises:
            BackpressureTimeout: Not done by ``deadline``.
            OperatorError: An ingestion invocation failed.
        """
        rt, flow = self.rt, self.rt.flow
        with rt.signals.lock:
            self.flush_requested += 1
            rt.signals.wake(ingestion=True)
            try:
                while flow.pending or flow.inflight_units:
                    rt.errors.raise_if_failed()
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:
                        raise BackpressureTimeout(
                            f"flush: {len(flow.pending)} rollout units still queued and "
                            f"{flow.inflight_units} being ingested when the timeout ran out; "
                            f"pass a longer timeout or check the ingestion operator")
                    rt.signals.callers.wait(remaining)
                rt.errors.raise_if_failed()
            finally:
                self.flush_requested -= 1

    def _take_locked(self) -> list[Unit] | None:
        units = self.rt.take_ingestion_locked(force=self.flush_requested > 0 or self.hurried)
        if units is None or not self.rt.flow.pending:
            self.hurried = False
        return units

    def _wait_locked(self) -> None:
        self.rt.signals.ingestion.wait(1.0)  # wake-ups drive progress; the timeout is a backstop

    def _run(self, work: list[Unit]) -> None:
        self.rt.run_ingestion(work)


class InlineDelivery(Runner[DeliveryJob]):
    """Delivery on the pulling thread."""

    operator = "delivery"

    def take_locked(self) -> DeliveryJob | None:
        """A delivery job for the caller to run now, or None (wait for a staged batch)."""
        return self.rt.take_delivery_locked()


class ThreadedDelivery(InlineDelivery):
    """Delivery on the ``conduit-delivery`` worker, prefetching during the learner's update."""

    thread_name = "conduit-delivery"

    def take_locked(self) -> DeliveryJob | None:
        """A job for the caller only where the flow hands it one (an on-policy iteration's
        first mini-batch under inline ingestion); otherwise None: the worker stages batches
        and the caller waits for them."""
        return self.rt.take_delivery_locked() if self.rt.flow.caller_delivers_locked() else None

    def _take_locked(self) -> DeliveryJob | None:
        return self.rt.take_delivery_locked() if self.rt.flow.worker_delivers_locked() else None

    def _wait_locked(self) -> None:
        self.rt.signals.delivery.wait(1.0)  # wake-ups drive progress; the timeout is a backstop

    def _run(self, work: DeliveryJob) -> None:
        self.rt.deliver_here(work)


def ingestion_runner(runtime: OperatorRuntime, *, overlap: int) -> InlineIngestion:
    """The ingestion runner for an ``overlap_ing`` setting."""
    return ThreadedIngestion(runtime) if overlap else InlineIngestion(runtime)


def delivery_runner(runtime: OperatorRuntime, *, overlap: int) -> InlineDelivery:
    """The delivery runner for an ``overlap_del`` setting."""
    return ThreadedDelivery(runtime) if overlap else InlineDelivery(runtime)
