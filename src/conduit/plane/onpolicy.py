"""The on-policy flow: consume-once iterations of ``capacity`` rows per policy version
(docs/design.md §2, §3).

:class:`OnPolicyFlow` admits an iteration's rows, ingests and writes them, and ends the
iteration once its last mini-batch is delivered. The delivery side of the iteration (early
assembly, the draws in layout order, a failed draw taken back) is its
:class:`~conduit.plane.onpolicy_delivery.IterationDelivery`; its checkpoint entries are
:mod:`conduit.plane.onpolicy_state`'s.

Methods whose name ends in ``_locked`` are called with the plane's lock
(:attr:`conduit.plane.flows.Signals.lock`) held.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, ClassVar

from conduit.errors import CapacityError, ConfigError, StaleRolloutError
from conduit.plane.flows import DeliveryJob, Flow, Unit, check_written_rows
from conduit.plane.onpolicy_delivery import IterationDelivery
from conduit.plane.onpolicy_state import check_iteration_state, iteration_state
from conduit.spec import Batch


class OnPolicyFlow(Flow):
    """Consume-once iterations: ``capacity`` rows per policy version, each delivered exactly
    once per epoch in the sampler's fixed layout; the last mini-batch of the last epoch clears
    the buffer and moves to the next policy version. Pushes tagged with a newer version queue
    up until then.

    Attributes:
        delivery: The delivery side of the current iteration (its mini-batches assembled
            early, drawn and delivered).
        iter_pushed_rows: Rows pushed into the current iteration.
        iter_written_rows: Rows of the current iteration an ingestion began to write.
        iter_landed_rows: Rows of the current iteration whose buffer write finished
            (at most ``iter_written_rows``).
    """

    #: Mini-batches staged ahead with overlapped delivery, and so the most an iteration
    #: assembles early (delivered before all of its rows landed).
    MOST_STAGED: ClassVar[int] = 2

    def __post_init__(self) -> None:
        self.iter_pushed_rows = 0
        self.iter_written_rows = 0
        self.iter_landed_rows = 0
        # (``delivering``: at most one on-policy, see IterationDelivery.take_locked)
        self.delivery = IterationDelivery(self)
        self._write_lock = threading.Lock()  # slot order = write order within an iteration
        self._advancing_to: int | None = None  # see _advance_locked

    @property
    def max_pending_units(self) -> int:
        return 1 << 30

    def admit_locked(self, rows: int, version: int | None) -> bool:
        """Admits the current version's rows up to the capacity; a newer version waits until
        the plane reaches it (the iterations before it consumed). A unit of more rows than an
        iteration holds is refused whatever its version: it can never be admitted."""
        cap = self.config.capacity
        if rows > cap:
            raise CapacityError(
                f"a rollout of {rows} rows is larger than an on-policy iteration, which holds "
                f"{cap} rows (capacity); split it or raise capacity", needed=rows,
                available=cap)
        if version is not None and version < self.policy_version:
            raise StaleRolloutError(
                f"rollout from policy version {version}, but the plane is at version "
                f"{self.policy_version}; on-policy updates use fresh samples only")
        if version is not None and version > self.policy_version:
            return False
        if self.iter_pushed_rows + rows > self.config.capacity:
            raise CapacityError(
                f"on-policy iteration {self.policy_version} holds {self.config.capacity} "
                f"rows; {self.iter_pushed_rows} are pushed and this rollout adds {rows}. "
                f"Pull the iteration's mini-batches first, or tag the rollout with "
                f"policy_version={self.policy_version + 1}",
                needed=self.iter_pushed_rows + rows, available=self.config.capacity)
        return True

    def enqueue_locked(self, unit: Unit) -> None:
        super().enqueue_locked(unit)
        self.iter_pushed_rows += unit.rows

    def withdraw_locked(self, unit: Unit) -> bool:
        if not super().withdraw_locked(unit):
            return False
        self.iter_pushed_rows -= unit.rows
        return True

    def take_ingestion_locked(self, *, force: bool) -> list[Unit] | None:
        if not self.pending:
            return None
        want_rows = max(1, int(self.schedule.g_ing * self.config.capacity))
        complete = self.iter_pushed_rows >= self.config.capacity
        if self.pending_rows < want_rows and not (force or complete):
            return None
        take: list[Unit] = []
        got = 0
        while self.pending and (got < want_rows or force or complete):
            u = self.pending.popleft()
            take.append(u)
            got += u.rows
            if got >= want_rows and not (force or complete):
                break
        return self._taken_locked(take)

    def ingested_locked(self, units: list[Unit], *, failed: bool,
                        written: Sequence[tuple[int, int, int]] = (), rows: int = 0) -> int:
        """Failed units leave the iteration, so it can still fill up with new pushes; so do
        the rows their invocation wrote before it failed, where nothing depends on them yet
        (:meth:`_take_back_locked`). Rows that stay (the returned count) stay counted against
        the iteration's capacity: only the failed units' other rows leave it."""
        kept = super().ingested_locked(units, failed=failed, rows=rows)
        if failed:
            if self._take_back_locked(written):
                kept = 0
            self.iter_pushed_rows -= sum(u.rows for u in units) - kept
        return kept

    def kept_rows_note(self, units: Sequence[Unit], kept: int) -> str | None:
        if not kept:
            return None
        lost = sum(u.rows for u in units)
        prefix, first = 0, None
        for k, u in enumerate(units):
            prefix += u.rows
            if prefix == kept:
                first = k + 1
                break
        which = (f"; an operator that wrote its units in order wrote the rows of the first "
                 f"{first} of the {len(units)}: push again only the last {len(units) - first}"
                 if first is not None else "")
        return (f"conduit: on-policy, the {kept} rows kept stay in iteration "
                f"{self.policy_version} and count against its {self.config.capacity} rows: "
                f"push again only rollouts of the {lost - kept} rows not stored (pushing "
                f"every lost unit again would store the kept rows twice, or be refused with "
                f"CapacityError past the capacity){which}")

    def _take_back_locked(self, written: Sequence[tuple[int, int, int]]) -> bool:
        """Drop the rows of a failed invocation's writes ``(version, start, n)`` from the
        iteration, as if never written: a push of the same rollout then lands each row once.
        Kept where something depends on them: a later write of another invocation, or a
        mini-batch already drawn that may hold them (one assembled early from the rows before
        them does not). True when none is kept."""
        if not written:
            return True
        start, total = written[0][1], sum(n for _, _, n in written)
        if (any(v != self.policy_version for v, _, _ in written)
                or self.delivery.drawn_rows > start
                or self.iter_written_rows != start + total
                or self.iter_landed_rows != self.iter_written_rows):
            return False
        try:
            self.buffer.drop_newest(total)
        except ConfigError:  # a sampler with per-row state: the rows stay, as they were
            return False
        self.iter_written_rows = self.iter_landed_rows = start
        self.counters["ingested_rows"] -= total
        self.delivery.early = {}  # they may hold the dropped rows: the iteration gathers instead
        return True

    def check_ingested(self, units: Sequence[Unit], rows: int) -> None:
        """An iteration is complete when its pushed rows are written, so an invocation must
        write as many rows as its units hold.

        Raises:
            SpecError: It wrote another number of rows.
        """
        check_written_rows(rows, [u.rows for u in units])

    def ingestion_units(self, units: list[Unit]) -> float:
        return sum(u.rows for u in units) / self.config.capacity

    def write(self, data: Batch, n: int) -> tuple[int, int, int]:
        cap = self.config.capacity
        with self._write_lock:
            with self.signals.lock:
                if self.iter_written_rows + n > cap:
                    raise CapacityError(
                        f"ingestion wrote {self.iter_written_rows + n} rows into on-policy "
                        f"iteration {self.policy_version}, which holds {cap}",
                        needed=self.iter_written_rows + n, available=cap)
                start = self.iter_written_rows
                self.iter_written_rows += n
                # one write that lands the whole iteration leaves nothing to assemble early
                plan = start == 0 and n < cap and self.delivery.wants_early()
                version = self.policy_version
            self.delivery.fill_early(data, start, n, version=version, plan=plan)
            # Slots [start, start + n): the buffer was cleared when the iteration began, and
            # the write lock keeps concurrent ingestions in order.
            self.buffer.extend(data, validate=False)
            with self.signals.lock:
                self.iter_landed_rows += n
                self.counters["ingested_rows"] += n
                # the worker takes nothing while the caller's first mini-batch is still due
                self.signals.wake(callers=True, delivery=not self.caller_delivers_locked())
        return version, start, n

    def caller_delivers_locked(self) -> bool:
        return self.delivery.caller_delivers_locked()

    def worker_delivers_locked(self) -> bool:
        return self.delivery.worker_delivers_locked()

    @property
    def prefetch_bound(self) -> int:
        """Two mini-batches with overlapped delivery (one slow gather does not stall the
        learner; the order is fixed by the layout), else one."""
        return self.MOST_STAGED if self.schedule.overlap_del else 1

    @property
    def stage_room(self) -> int:
        return self.prefetch_bound

    @property
    def wake_below(self) -> int:
        return 1

    def take_delivery_locked(self) -> DeliveryJob | None:
        """The next mini-batch in the layout's order, one invocation at a time
        (:meth:`IterationDelivery.take_locked`)."""
        return self.delivery.take_locked()

    def _delivery_done_locked(self, job: DeliveryJob | None) -> None:
        """A delivery invocation finished (staged, handed over or undone): the next may be
        drawn."""
        super()._delivery_done_locked(job)
        self.delivery.wake_refused_locked()

    def undo_delivery_locked(self, job: DeliveryJob) -> None:
        """The mini-batch of a failed invocation is owed: its draw is taken back, so that the
        next invocation (after ``recover()``) draws the same rows and every row is still
        delivered exactly once per epoch. Invocations of an iteration run one at a time
        (:meth:`take_delivery_locked`), so the failed one is the last drawn. Nothing changes
        for a job already done; an interrupt (``KeyboardInterrupt``) leaves the job not done
        (called again, it completes) or the draw taken back."""
        if job.done:
            return
        if job.position < 0 or job.position != self.delivery.drawn_in_iter - 1:
            self._delivery_done_locked(job)  # pragma: no cover - not expected
            return  # pragma: no cover - a later draw or another iteration (not expected)
        self.delivery.take_back_locked(job)

    def starved_locked(self) -> bool:
        return self.iter_written_rows < self.config.capacity

    def delivery_units(self, job: DeliveryJob) -> float:
        return float(Fraction(1, self.config.num_minibatches))

    def _count_delivered_locked(self) -> None:
        self.delivery.count_delivered_locked()

    def _delivered_locked(self) -> None:
        if self.delivery.delivered_in_iter == self.config.batches_per_iteration:
            self._advance_locked()
            # Pushes of the next version wait in push() for admission; the ingestion worker
            # has work only if units were already queued (a push wakes it for its own).
            self.signals.wake(callers=True, ingestion=bool(self.pending))

    def _advance_locked(self) -> None:
        """End the consumed iteration (every mini-batch delivered): clear the buffer and move
        to the next policy version. Until its last statement, which marks the iteration
        ended, it may be called again (an interrupt before it): each step sets what it set
        the first time (the version it moves to is noted first)."""
        if self._advancing_to is None:
            self._advancing_to = self.policy_version + 1
        delivery = self.delivery
        self.buffer.clear()
        delivery.early = {}
        self.policy_version = self._advancing_to
        self.iter_pushed_rows = sum(u.rows for u in self.pending)
        self.iter_written_rows = self.iter_landed_rows = 0
        delivery.drawn_in_iter = delivery.drawn_rows = 0
        delivery.delivered_in_iter, self._advancing_to = 0, None  # (one line: ended)

    def pause_locked(self) -> None:
        """Mini-batches being assembled early fall back to a gather (the buffer may move, the
        spec may grow); dropping them is always safe."""
        self.delivery.early = {}

    def empty_message(self, waited: float) -> str:
        return (f"no on-policy mini-batch within {waited:.1f}s: iteration "
                f"{self.policy_version} has {self.iter_written_rows} of {self.config.capacity} "
                f"rows ingested ({self.iter_pushed_rows} pushed); push the whole rollout "
                f"before pulling")

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Policy version, rows written and mini-batches delivered in the iteration, and,
        part way through an epoch, how that epoch is laid out
        (:func:`~conduit.plane.onpolicy_state.iteration_state`)."""
        return iteration_state(self.config, self.buffer.sampler, version=self.policy_version,
                               written=self.iter_written_rows,
                               delivered=self.delivery.delivered_in_iter)

    def check_state(self, state: Mapping[str, int], *, rows: int) -> None:
        check_iteration_state(state, rows=rows, config=self.config, sampler=self.buffer.sampler,
                              most_early=self.MOST_STAGED)

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore :meth:`state_dict`; the sampler resumes after the last delivered batch."""
        version, written, delivered = check_iteration_state(
            state, rows=len(self.buffer), config=self.config, sampler=self.buffer.sampler,
            most_early=self.MOST_STAGED)
        super().load_state_dict(state)
        self.policy_version = version
        self.iter_pushed_rows = self.iter_written_rows = self.iter_landed_rows = written
        self.delivery.restore_locked(written, delivered)
