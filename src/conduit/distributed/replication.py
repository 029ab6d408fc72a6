"""Ordered, replicated changes to the shards' rows, and the heal-and-retry around them.

Every change of a shard's rows (a write, a priority update, an on-policy clear) is sent to the
shard and all its replicas under the front's lock, so each holder applies the same changes in
the same order and a replica stays the same ring as its primary, slot for slot. A change
returns once every holder has applied it (it then survives the loss of ``replication - 1``
shards), and what each holder reports is recorded for reads (:meth:`ShardSet.read_from`).

A change that finds a shard dead heals the set (re-create it, restore its rows from a replica)
and is tried again. A write carries the owner's write count from before it, so a retry that the
restore already carried is a no-op on every holder and each write is applied once.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from conduit.distributed.cluster import ShardRecovery, ShardSet
from conduit.distributed.errors import ShardUnavailableError

T = TypeVar("T")


class Replicator:
    """Sends changes to every holder of a shard's rows, in one order, healing dead shards.

    Every method is called with the front's lock (``cond``) held, except :meth:`heal`, which
    takes it.

    Args:
        shards: The shard actors.
        cond: The front's condition variable (notified after a heal).
        replication: Copies of each row (named in the loss warning).
        on_lost: Called with the rows lost by a heal (with the lock held), when any.
    """

    def __init__(self, *, shards: ShardSet, cond: threading.Condition, replication: int,
                 on_lost: Callable[[int], None]) -> None:
        self.shards, self._cond = shards, cond
        self.replication = replication
        self._on_lost = on_lost
        self.priority_updates = 0  # how many updates went out (delivery checks its draws)
        self.max_priority = 1.0  # prioritized: the largest priority given to any shard

    def run(self, fn: Callable[[], T], deadline: float) -> T:
        """Run ``fn`` (remote calls to shards); when a shard is found dead, heal and retry.

        Raises:
            ShardUnavailableError: A shard could not be reached or restored by ``deadline``.
        """
        while True:
            if self.shards.unrestored:  # a restore cut short by an earlier deadline
                self.heal(deadline)
            try:
                return fn()
            except ShardUnavailableError:
                raise
            except Exception as exc:
                if not self.shards.is_death(exc):
                    raise
                self.heal(deadline)

    def write(self, owner: int, payload: Any, validate: bool, deadline: float) -> int:
        """Append ``payload`` (a wire batch, or an actor's ``ObjectRef`` to ``validate``) to
        ``owner``'s rows on every holder.

        Returns:
            The rows the write added (what an ``ObjectRef`` held is known only here).

        Raises:
            SpecError: ``validate`` and the rows do not match the spec (no holder took them).
            ShardUnavailableError: Not done by ``deadline``.
        """
        shards = self.shards
        # The owner's write count before this write: a retry after a restore that already
        # carried the rows is then a no-op on every holder. A restore with nothing to copy
        # from (all holders lost) starts a fresh ring, and the write goes there.
        before = shards.held[owner].total_written

        def attempt() -> int:
            first = min(before, shards.held[owner].total_written)
            refs = [shards.actors[h].write.remote(owner, payload, validate, first,
                                                  self.max_priority)
                    for h in shards.holders(owner)]
            shards.acknowledged(owner, shards.get(refs, deadline, shard=owner))
            return shards.held[owner].total_written - first
        return self.run(attempt, deadline)

    def clear_all(self, deadline: float) -> None:
        """Forget every shard's rows on every holder (an on-policy iteration was consumed)."""
        shards = self.shards

        def clear() -> None:
            refs = {o: [shards.actors[h].clear.remote(o) for h in shards.holders(o)]
                    for o in range(len(shards))}
            flat = shards.get([r for rs in refs.values() for r in rs], deadline, shard=None)
            at = 0
            for o, rs in refs.items():
                shards.acknowledged(o, flat[at:at + len(rs)])
                at += len(rs)
        self.run(clear, deadline)

    def update_priorities(self, owners: np.ndarray, rows: np.ndarray, priorities: np.ndarray,
                          deadline: float) -> None:
        """Give ``priorities`` to the rows ``rows`` of ``owners`` on every holder."""
        shards = self.shards

        def update() -> None:
            for o in np.unique(owners).tolist():
                sel = owners == o
                refs = [shards.actors[h].update_priorities.remote(o, rows[sel], priorities[sel])
                        for h in shards.holders(o)]
                shards.acknowledged(o, shards.get(refs, deadline, shard=o))
        self.run(update, deadline)
        self.priority_updates += 1
        if priorities.size:
            self.max_priority = max(self.max_priority, float(priorities.max()))

    def heal(self, deadline: float) -> list[ShardRecovery]:
        """Re-create dead shards and restore their rows; warn about and report rows lost.

        Raises:
            ShardUnavailableError: A shard could not be restored by ``deadline``.
        """
        with self._cond:
            done = self.shards.heal(deadline)
            for r in done:
                if r.lost_rows:
                    warnings.warn(f"shard {r.shard} died on node {r.old_node} with no live "
                                  f"replica: {r.lost_rows} rows lost (replication="
                                  f"{self.replication})", RuntimeWarning, stacklevel=3)
                    self._on_lost(r.lost_rows)
            self._cond.notify_all()
            return done
