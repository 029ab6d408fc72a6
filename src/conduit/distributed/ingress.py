"""The front's push path: check a pushed unit, admit it to the on-policy iteration, and store
it (directly, or through the ingestion operator) on the pushing node's shard and its replicas.

Routing follows the cross-node balance rule: a push goes to a shard on the pushing actor's
node (round robin over several), and a push from a node without a shard goes to the shard
holding the fewest rows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from conduit.distributed._ray import connection_id, lost_object
from conduit.distributed.cluster import ShardSet
from conduit.distributed.errors import ShardUnavailableError
from conduit.distributed.iteration import IterationGate
from conduit.distributed.operators import (
    FrontIngestion,
    QueuedUnit,
    front_until,
    mark_stored,
    mark_unsettled,
    stored_rows_of,
    unsettled_rows_of,
)
from conduit.distributed.replication import Replicator, rollout_failed, rollout_lost
from conduit.distributed.shard import to_wire
from conduit.errors import CapacityError, ConfigError, PlaneClosedError
from conduit.plane.config import PlaneConfig
from conduit.plane.data_plane import admit_rollout
from conduit.scheduling.space import Schedule
from conduit.spec import Batch

SETTLE_GRACE_S = 1.0
"""Seconds past a failed on-policy write's deadline its holders are re-read for."""

WAIT_SLICE_S = 0.5
"""Seconds between looks at whether the plane closed while a push waits for its ObjectRef."""


class Ingress:
    """Pushed units from check to acknowledgement.

    Args:
        config: The plane's configuration.
        ray: The ``ray`` module (connected).
        shards: The shard actors.
        replicator: Sends writes to every holder.
        gate: On-policy iteration gating.
        cond: The front's condition variable.
        schedule: The schedule the ingestion operator starts with.
        here: The driver's node (pushes without a node come from it).
    """

    def __init__(self, *, config: PlaneConfig, ray: Any, shards: ShardSet,
                 replicator: Replicator, gate: IterationGate, cond: threading.Condition,
                 schedule: Schedule, here: str) -> None:
        self.config, self._ray, self._shards = config, ray, shards
        self._replicator, self._gate, self._cond, self._here = replicator, gate, cond, here
        self._route_turn = 0
        self._conn = connection_id(ray)
        self.counters = {"units": 0, "rows": 0}
        replicator.on_settled = self._settled
        self.ingestion = FrontIngestion(store=self._store_output, timeout=config.timeout,
                                        on_lost=self._release, prepare=self._prepare_output,
                                        commit=self._commit_output)
        if config.on_policy:
            self.ingestion.iteration = (config.capacity, lambda: gate.pushed >= gate.capacity)
        else:
            self.ingestion.row_limit = self.row_limit
        self.ingestion.set_schedule(schedule)

    @property
    def row_limit(self) -> int:
        """Most rows one write may hold: the iteration on-policy, a shard off-policy."""
        return self.config.capacity if self.config.on_policy else self._shards.config.capacity

    def route(self, node: str | None) -> int:
        """The shard a push from ``node`` goes to (call with the lock held)."""
        local = self._shards.shards_on(self._here if node is None else node)
        self._route_turn += 1
        if local:
            return local[self._route_turn % len(local)]
        return min(range(len(self._shards)), key=lambda k: self._shards.held[k].size)

    def push(self, rollout: Mapping[str, Any] | Any, *, node: str | None,
             policy_version: int | None, deadline: float) -> None:
        """Check, admit and store (or queue) one unit; see
        :meth:`~conduit.distributed.RayExperienceDataPlane.push` for what it raises."""
        ing, cfg = self.ingestion, self.config
        ing.raise_if_failed()
        if isinstance(rollout, self._ray.ObjectRef):
            if cfg.on_policy:
                raise ConfigError("rollout", "on-policy rollouts are pushed as mappings (the "
                                             "iteration counts their rows)")
            self._wait_ready(rollout, deadline)
            if ing.direct and cfg.rollout_spec is None:
                self._store(rollout, 0, node, deadline, validate=True)
                self._acknowledged()
                return
            ref = rollout
            try:
                rollout = self._shards.get(ref, deadline, shard=None)
            except Exception as exc:
                if lost_object(self._ray, exc, ref):
                    raise rollout_lost(exc) from exc
                if isinstance(exc, self._ray.exceptions.RayTaskError):  # its task raised
                    raise rollout_failed(exc) from exc
                raise
        if ing.registered or cfg.rollout_spec is not None:
            data, rows = admit_rollout(rollout, spec=cfg.spec, rollout_spec=cfg.rollout_spec,
                                       capacity=self.row_limit, raw=True)
        else:
            data, rows = self._admit(rollout, what="rollout")
        unit = QueuedUnit(data, rows, node, policy_version, threading.current_thread())
        if cfg.on_policy:
            with front_until(self._cond, deadline, "nothing was counted or sent"):
                # a write whose holders could not be re-read is settled before rows are counted
                self._replicator.settle(deadline)
                # a consumed iteration whose clear was cut short is cleared by the push
                self._gate.admit(rows, policy_version, deadline,
                                 clear=lambda: self._replicator.clear_all(deadline))
        if ing.direct:
            try:
                self._store(data, rows, node, deadline)
            except BaseException as exc:
                self._release([unit], stored_rows_of(exc) + unsettled_rows_of(exc))
                raise
        else:
            ing.submit(unit, deadline)  # a unit it does not store, it releases
        self._acknowledged()

    def _wait_ready(self, ref: Any, deadline: float) -> None:
        """Wait until a pushed ``ObjectRef``'s object exists (or its task failed), without
        fetching it: a write sent for an object not made yet would wait on every holder,
        ahead of every later change.

        Raises:
            ShardUnavailableError: Not ready by ``deadline`` (nothing was sent).
            PlaneClosedError: The plane closed while it waited (nothing was sent).
        """
        left = max(0.0, deadline - time.monotonic())
        while True:
            if self._shards.closed:
                raise PlaneClosedError("the sharded plane is closed")
            wait = min(max(0.0, deadline - time.monotonic()), WAIT_SLICE_S)
            ready, _ = self._ray.wait([ref], timeout=wait, fetch_local=False)
            if ready:
                return
            if time.monotonic() >= deadline:
                raise ShardUnavailableError(None, f"the pushed ObjectRef's object was not made "
                                                  f"within the {left:g} s left of the push's "
                                                  f"timeout (its task is still running); "
                                                  f"nothing was sent")

    def _admit(self, batch: Mapping[str, Any], *, what: str) -> tuple[Batch, int]:
        """``batch`` checked against the spec and the row limit."""
        data, rows = self.config.spec.validate(batch, what=what)
        limit = self.row_limit
        if rows > limit:
            where = "an iteration's" if self.config.on_policy else "a shard's"
            raise CapacityError(f"a {what} of {rows} rows is larger than {where} {limit} rows; "
                                f"split it or raise capacity", needed=rows, available=limit)
        return data, rows

    def _acknowledged(self) -> None:
        with self._cond:
            self.counters["units"] += 1

    def _settled(self, rows: int, applied: bool) -> None:
        """On-policy: a write of ``rows`` rows whose holders could not be re-read when it
        raised is settled: its rows count as stored if they ``applied`` it, else they leave
        the iteration (call with the lock held)."""
        if applied:
            self.counters["rows"] += rows
            self._gate.stored(rows)
        else:
            self._gate.released(rows)

    def _release(self, units: list[QueuedUnit], stored: int = 0) -> None:
        """On-policy: admitted units that will not be stored leave the iteration, less the
        ``stored`` rows of theirs that were stored all the same or are not settled yet."""
        if self.config.on_policy:
            with self._cond:
                self._gate.released(sum(u.rows for u in units) - stored)

    def _prepare_output(self, batch: Mapping[str, Any]) -> tuple[Any, int]:
        """What an ingestion operator writes, checked as :meth:`_store_output` checks it and
        put in the object store (the operator may reuse its tensors), not yet stored."""
        data, rows = self._admit(batch, what="write")
        self._check_open()
        return self._ray.put(to_wire(data)), rows

    def _check_open(self) -> None:
        """Refuse to touch Ray once the shards were ended (a plane's ``close()``, which may
        shut Ray down; ``ray.put`` would start a new one): an ingestion thread ``close()``
        gave up on, or a call racing it."""
        if self._shards.closed or connection_id(self._ray) != self._conn:
            raise PlaneClosedError("the sharded plane is closed")

    def _commit_output(self, payload: Any, rows: int, unit: QueuedUnit, deadline: float
                       ) -> None:
        """Store an output :meth:`_prepare_output` readied."""
        self._store(payload, rows, unit.node, deadline, prepared=True)

    def _store_output(self, batch: Mapping[str, Any], unit: QueuedUnit, deadline: float) -> int:
        """What an ingestion operator writes for ``unit``: checked, then stored."""
        payload, rows = self._prepare_output(batch)
        self._commit_output(payload, rows, unit, deadline)
        return rows

    def _store(self, data: Any, rows: int, node: str | None, deadline: float, *,
               validate: bool = False, prepared: bool = False) -> None:
        """Write checked rows (``prepared``: already in the object store; ``validate``: an
        actor's ``ObjectRef``, checked by the shard) to the shard of ``node`` and its
        replicas.

        On-policy, a write that raised (a timeout, an interrupt) after it was sent is settled
        before the error goes on: the owner's holders are re-read (copies that differ get the
        primary's rows); when they applied it, its rows count as stored (the error carries
        them, :func:`~conduit.distributed.operators.stored_rows_of`), otherwise no holder
        keeps them. The re-read waits until the write's own ``deadline`` plus a short grace;
        when it cannot settle the write by then (the write may still land), its rows stay
        counted against the iteration (the error carries them,
        :func:`~conduit.distributed.operators.unsettled_rows_of`) until the owner's next
        successful re-read settles them. Off-policy the holders are not re-read: the rows of a
        write that raised after it was sent are carried as not settled. A write whose
        ``deadline`` passed while it waited for the front's lock is not sent
        (:class:`ShardUnavailableError`, no rows stored or unsettled)."""
        self._check_open()
        payload = data if validate or prepared else self._ray.put(to_wire(data))
        with front_until(self._cond, deadline, "nothing was sent") as waited:
            self._check_open()
            on = self.config.on_policy
            if on:
                self._gate.check_store(rows)
            owner = self.route(node)
            if waited and time.monotonic() >= deadline:
                # its time went waiting for another call: a write sent now would outlive it
                raise ShardUnavailableError(owner, "the call's timeout ran out while another "
                                                   "call held the front (waiting on a shard); "
                                                   "nothing was sent: pass a longer timeout")
            try:
                added = self._replicator.write(owner, payload, validate, deadline)
            except BaseException as exc:
                if on:
                    self._settle_failed(exc, owner, rows, deadline)
                elif self._replicator.sent(owner):
                    mark_unsettled(exc, rows)  # the holders may apply it all the same
                raise
            self.counters["rows"] += added if validate else rows
            if self.config.on_policy:
                self._gate.stored(rows)
            self._cond.notify_all()

    def _settle_failed(self, exc: BaseException, owner: int, rows: int,
                       deadline: float) -> None:
        """On-policy: settle a write of ``rows`` rows to ``owner`` that raised ``exc``, by
        re-reading the holders until ``deadline`` (or now, when it passed) plus
        :data:`SETTLE_GRACE_S` (call with the lock held); what was found is recorded on
        ``exc``."""
        until = max(deadline, time.monotonic()) + min(SETTLE_GRACE_S, self.config.timeout)
        try:
            applied = self._replicator.applied(owner, rows, until)
        except BaseException as again:  # an interrupt of the re-read: it stays unsettled
            mark_unsettled(again, rows)
            raise
        if applied is None:
            mark_unsettled(exc, rows)
        elif applied:
            self.counters["rows"] += rows
            self._gate.stored(rows)
            mark_stored(exc, rows)
