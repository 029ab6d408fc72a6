"""The delivery side of an on-policy iteration: its first mini-batches assembled while its
rows arrive, every mini-batch drawn in the sampler's layout order one invocation at a time, a
failed invocation's draw taken back, and the mini-batches delivered counted (docs/design.md
§2).

Methods whose name ends in ``_locked`` are called with the plane's lock
(:attr:`conduit.plane.flows.Signals.lock`) held.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from conduit.errors import EmptyBufferError
from conduit.plane.early import EarlyBatch, plan_early
from conduit.plane.flows import DeliveryJob
from conduit.spec import Batch

if TYPE_CHECKING:
    from conduit.plane.onpolicy import OnPolicyFlow


class IterationDelivery:
    """Which of an on-policy iteration's mini-batches are assembled early, drawn and
    delivered, and the draws themselves.

    The flow owns the stage, the count of delivery invocations in flight
    (:attr:`~conduit.plane.flows.Flow.delivering`), the counters, the buffer and the policy
    version; this object reads them through :attr:`flow`, and changes ``delivering`` and the
    ``early_batches`` / ``delivered_batches`` counters in the same statements as its own
    counts, so that an interrupt (``KeyboardInterrupt``) leaves them consistent. The flow
    resets the counts when an iteration ends, and drops the early mini-batches where they
    can no longer be completed (a pause, a failed write taken back).

    Attributes:
        flow: The on-policy flow it delivers for.
        drawn_in_iter: Mini-batches drawn from the iteration (all epochs): the next draw is
            mini-batch ``drawn_in_iter`` of the iteration.
        drawn_rows: Rows ``[0, drawn_rows)`` may be in a mini-batch drawn this iteration.
        delivered_in_iter: Mini-batches delivered from the iteration (all epochs).
        early: The mini-batches being assembled early, by their place in the iteration.
    """

    def __init__(self, flow: OnPolicyFlow) -> None:
        self.flow = flow
        self.drawn_in_iter = 0
        self.drawn_rows = 0
        self.delivered_in_iter = 0
        self.early: dict[int, EarlyBatch] = {}
        self._refused = False  # a draw waited on an invocation in flight: wake the worker

    # -- early assembly ----------------------------------------------------------------------

    def wants_early(self) -> bool:
        """Whether to assemble the first mini-batches while rows arrive: only when delivery
        is overlapped (it stages them first), the rows live in host memory and the delivery
        operator does not read the whole iteration (``assemble_early``)."""
        flow = self.flow
        return flow.assemble_early and bool(flow.schedule.overlap_del) and all(
            torch.device(d).type == "cpu" for d in flow.buffer.placement.devices)

    def fill_early(self, data: Batch, start: int, n: int, *, version: int,
                   plan: bool) -> None:
        """Copy the rows of one write (slots ``start .. start + n`` of iteration ``version``)
        into the mini-batches being assembled early, releasing each as soon as it is filled
        (the ingestion worker delivers it when ingestion is overlapped).

        Called with the flow's write lock held and the plane's lock not held (it takes it
        for each change); the iteration cannot end meanwhile, since its last mini-batch
        needs this write.

        Args:
            data: The write's validated rows.
            start: The iteration's slot of its first row.
            n: Its rows.
            version: The iteration's policy version.
            plan: Lay the early mini-batches out first (the iteration's first write).
        """
        flow = self.flow
        # Planned outside the lock (a permutation of the iteration's rows).
        planned = (plan_early(flow.buffer.sampler, capacity=flow.config.capacity,
                              iteration=version, count=flow.prefetch_bound,
                              batches_per_iteration=flow.config.batches_per_iteration)
                   if plan else None)
        with flow.signals.lock:
            if planned is not None:
                self.early = planned
            early = list(self.early.values())
        for e in early:  # in delivery order, each released as soon as it is filled
            k = e.fill(flow.spec, data, start, n)
            if k:
                with flow.signals.lock:
                    e.filled += k
                    flow.signals.wake(delivery=True)
                    ready = e.complete and bool(flow.schedule.overlap_ing)
                if ready:
                    flow.deliver_ready()

    # -- which thread draws ------------------------------------------------------------------

    @property
    def first_by_caller(self) -> bool:
        """With inline ingestion and overlapped delivery, the learner's own ``pull`` assembles
        each iteration's first mini-batch, and the worker prefetches from the second on, once
        the first is staged (docs/design.md §2)."""
        return bool(self.flow.schedule.overlap_del) and not self.flow.schedule.overlap_ing

    def caller_delivers_locked(self) -> bool:
        """Whether a waiting ``pull`` draws the next mini-batch itself (the iteration's
        first, see :attr:`first_by_caller`)."""
        return self.first_by_caller and self.drawn_in_iter == 0

    def worker_delivers_locked(self) -> bool:
        """Whether the delivery worker may draw the next mini-batch (not while the caller's
        first is drawn but neither staged nor delivered, see :attr:`first_by_caller`)."""
        if not self.first_by_caller:
            return True
        first_pending = self.drawn_in_iter == 1 and not (self.delivered_in_iter
                                                         or self.flow.staged)
        return self.drawn_in_iter > 0 and not first_pending

    # -- draws -------------------------------------------------------------------------------

    def take_locked(self) -> DeliveryJob | None:
        """The next mini-batch in the layout's order, or None while another delivery
        invocation is in flight (the ingestion worker stages an early-assembled mini-batch
        while the delivery worker runs): an iteration's invocations run one at a time, each
        staged before the next is drawn, so the learner gets the mini-batches in layout order
        under every schedule, and a failed invocation is always the last drawn
        (:meth:`take_back_locked`). The invocation that finishes wakes the delivery worker if
        a draw was refused meanwhile (:meth:`wake_refused_locked`). None too while the stage
        is full, the iteration's mini-batches are all drawn, or the next one can be formed
        neither from the landed iteration nor early.

        A draw is all or nothing: a sampler error, or an interrupt (``KeyboardInterrupt``)
        anywhere in it, puts back what it changed, the sampler's cursor included.
        """
        flow = self.flow
        if flow.delivering:
            self._refused = True
            return None
        cap = flow.config.capacity
        if (len(flow.staged) >= flow.stage_room
                or self.drawn_in_iter >= flow.config.batches_per_iteration):
            return None
        landed = flow.iter_landed_rows >= cap
        early = self.early.get(self.drawn_in_iter)
        if early is not None and landed and not early.complete:
            early = None  # could not be assembled (rows were not in host memory): gather
        if not (landed or (early is not None and early.complete)):
            return None
        saved = (self.drawn_in_iter, self.drawn_rows, flow.delivering,
                 flow.counters["early_batches"], self.early.get(self.drawn_in_iter))
        try:
            return self._draw_locked(early, landed)
        except BaseException:
            self._undraw_locked(*saved)
            raise

    def _draw_locked(self, early: EarlyBatch | None, landed: bool) -> DeliveryJob:
        """Draw the next mini-batch (see :meth:`take_locked`)."""
        flow = self.flow
        cap, position = flow.config.capacity, self.drawn_in_iter
        sampler = flow.buffer.sampler
        m = flow.config.num_minibatches
        if position % m == 0:
            sampler.begin_epoch(cap, iteration=flow.policy_version, epoch=position // m)
        info = sampler.sample(cap, 0)
        if early is not None and not torch.equal(early.indices, info.indices):
            early = None  # pragma: no cover - the layout is a pure function
        if early is None and not landed:  # pragma: no cover - follows from the above
            raise EmptyBufferError("on-policy delivery started before the iteration landed")
        self.early.pop(position, None)
        if early is not None:
            flow.counters["early_batches"] += 1
            if info.indices.numel():
                self.drawn_rows = max(self.drawn_rows, int(info.indices.max()) + 1)
        else:
            self.drawn_rows = cap  # drawn from the landed iteration: any row
        self.drawn_in_iter, flow.delivering = position + 1, flow.delivering + 1
        return DeliveryJob(info, 1, int(info.indices.numel()), flow.priority_generation, early,
                           position=position)

    def _undraw_locked(self, position: int, drawn_rows: int, delivering: int, early_count: int,
                       early: EarlyBatch | None) -> None:
        """Put back what a draw of mini-batch ``position`` changed (the values before it):
        the next draw is that mini-batch again (an epoch's first lays the epoch out again)."""
        flow = self.flow
        with contextlib.suppress(Exception):  # (the draw's own error is raised)
            flow.buffer.sampler.seek(position % flow.config.num_minibatches)
        if early is not None:
            self.early[position] = early
        flow.counters["early_batches"] = early_count
        self.drawn_in_iter, self.drawn_rows, flow.delivering = position, drawn_rows, delivering

    def take_back_locked(self, job: DeliveryJob) -> None:
        """Take back the draw of ``job``, the last drawn and not done: the next draw is its
        mini-batch again (an epoch's first lays the epoch out again), and the job is done.
        An interrupt (``KeyboardInterrupt``) leaves the job not done or the draw taken
        back."""
        flow = self.flow
        flow.buffer.sampler.seek(job.position % flow.config.num_minibatches)
        # one statement: the draw is taken back and the job done together
        self.drawn_in_iter, job.done, flow.delivering = (job.position, True,
                                                         flow.delivering - 1)
        self.wake_refused_locked()

    def wake_refused_locked(self) -> None:
        """A delivery invocation finished: wake the delivery worker if a draw was refused
        while it was in flight."""
        if self._refused:
            self._refused = False
            self.flow.signals.wake(delivery=True)

    # -- deliveries --------------------------------------------------------------------------

    def count_delivered_locked(self) -> None:
        """Count a delivered mini-batch, in the plane's counters and the iteration's, in one
        statement."""
        counters = self.flow.counters
        counters["delivered_batches"], self.delivered_in_iter = (
            counters["delivered_batches"] + 1, self.delivered_in_iter + 1)

    def restore_locked(self, written: int, delivered: int) -> None:
        """Resume a loaded iteration of ``written`` rows with ``delivered`` mini-batches
        delivered: the next draw is the mini-batch after the last delivered one, the
        sampler's cursor is placed after that one, and nothing is assembled early. Called
        with the flow's policy version already restored."""
        flow = self.flow
        self.delivered_in_iter = self.drawn_in_iter = delivered
        self.drawn_rows = written if delivered else 0
        self.early = {}
        if self.drawn_in_iter:
            m = flow.config.num_minibatches
            flow.buffer.sampler.begin_epoch(flow.config.capacity, iteration=flow.policy_version,
                                            epoch=(self.drawn_in_iter - 1) // m)
            flow.buffer.sampler.seek((self.drawn_in_iter - 1) % m + 1)
