"""The inline pull whose batch is the buffer's own sample, outside the general route's loop.

Where a pull's batch is the buffer's ``sample`` as it stands (:meth:`OperatorRuntime.run_drawn`:
inline off-policy delivery of one batch per invocation, drawn as it is gathered, through the
identity operator from a host column store to a host learner without a copy stream),
:class:`DrawnPull` takes the job, samples and hands the batch over with one lock section on
each side of the sample, and records the delivery and the pull in one call. Wherever it cannot
take a job now (the plane is closed, failed or paused, a batch is staged, the buffer holds too
few rows, a delivery operator was registered, the schedule changed), it returns None, and the
general route (:meth:`PlaneEngine.next_batch`) runs, raising, waiting or handing over the staged
batch as it does for every pull (docs/design.md §7).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from conduit.plane.flows import DeliveryJob, OffPolicyFlow
from conduit.plane.runtime import OperatorRuntime, identity_delivery
from conduit.spec import Batch
from conduit.timing import TimingRecord, record_from

if TYPE_CHECKING:
    from conduit.plane.engine import PlaneEngine


class DrawnPull:
    """An engine's inline pull whose batch is the buffer's own sample.

    Built by :meth:`build` when the engine starts a schedule, and used while it is the
    engine's :attr:`~PlaneEngine.drawn_pull`: a pull that read it just before a restart finds
    it replaced and takes the general route.

    Args:
        engine: The engine whose pulls it runs.
        flow: The engine's flow (off-policy, drawing as it gathers).
    """

    __slots__ = ("_engine", "_flow", "_lock", "_runtime", "_timings")

    def __init__(self, *, engine: PlaneEngine, flow: OffPolicyFlow) -> None:
        self._engine = engine
        self._flow = flow
        self._runtime: OperatorRuntime = engine.runtime
        self._lock = engine.signals.lock
        self._timings = engine.runtime.timings

    @classmethod
    def build(cls, engine: PlaneEngine) -> DrawnPull | None:
        """The route for ``engine`` under its schedule, or None where its pulls' batches are
        not the buffer's sample as it stands: overlapped delivery, an on-policy flow or one
        that draws before it gathers (:attr:`~conduit.plane.flows.Flow.draws_as_gathered`),
        or samples that are not batches where they are
        (:attr:`OperatorRuntime.samples_are_batches`; a delivery operator registered later
        is checked per pull)."""
        flow = engine.flow
        if (engine.schedule.overlap_del or not isinstance(flow, OffPolicyFlow)
                or not flow.draws_as_gathered or not engine.runtime.samples_are_batches):
            return None
        return cls(engine=engine, flow=flow)

    def pull(self, t0: float) -> Batch | None:
        """The next batch, sampled here, with the pull that began at ``t0`` recorded (its
        ``"delivery"`` and ``"pull"`` records, in one call); None where the general route
        must run (nothing was taken, or a batch staged before this one or an error latched
        meanwhile made it staged or dropped, as the general route would).

        Raises:
            OperatorError: The sample raised (to this caller only, as an inline invocation's
                error; its interrupt instead for a ``KeyboardInterrupt``); the job is taken
                back and the delivery recorded.
        """
        rt, flow = self._runtime, self._flow
        job: DeliveryJob | None = None
        try:
            with self._lock:
                if (self._engine.drawn_pull is not self or self._engine.closed
                        or rt.errors.error is not None or rt.paused
                        or rt.deliver_fn is not identity_delivery):
                    return None
                job = flow.take_drawn_locked()
            if job is None:
                return None
            records: list[TimingRecord] = []
            batch = rt.run_drawn(job, records)
        except BaseException:
            with self._lock:  # a job taken and not finished is taken back
                rt.abandon_locked(job)
            raise
        if batch is not None:
            records.append(record_from(("pull", time.perf_counter() - t0, 1.0, t0)))
        self._timings.add(records)
        return batch
