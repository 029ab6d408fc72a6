"""Ordered, replicated changes to the shards' rows, and the heal-and-retry around them.

Every change of a shard's rows (a write, a priority update, an on-policy clear) is sent to the
shard and all its replicas under the front's lock, so each holder applies the same changes in
the same order and a replica stays the same ring as its primary, slot for slot. A change
returns once every holder has applied it (it then survives the loss of ``replication - 1``
shards), and what each holder reports is recorded for reads (:meth:`ShardSet.read_from`).

A change that finds a shard dead heals the set (re-create it, restore its rows from a replica)
and is tried again. A write carries the owner's write count from before it, so a retry that the
restore already carried is a no-op on every holder and each write is applied once.

A change that was sent but not acknowledged (it timed out, or raised) may still be applied by
the holders, so the front's record of the owner's rows is no longer known to be exact; the
next change of that owner first asks its holders for their state again (each holder answers
after the changes sent before, in order). A write's count is therefore always the holders'
own, and only a true retry of that write is skipped.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from conduit.distributed._ray import failed_task, lost_object
from conduit.distributed.cluster import ShardRecovery, ShardSet
from conduit.distributed.errors import ShardUnavailableError
from conduit.distributed.operators import front_until
from conduit.errors import ConfigError, PlaneClosedError, PriorityError

T = TypeVar("T")


def rollout_failed(exc: BaseException) -> ConfigError:
    """The error for a pushed ``ObjectRef`` whose task raised (``exc`` is its error)."""
    cause = getattr(exc, "cause", None) or exc
    return ConfigError("rollout", f"the ObjectRef's task raised ({type(cause).__name__}: "
                                  f"{cause}); no rows were made, so none were stored")


def rollout_lost(exc: BaseException) -> ConfigError:
    """The error for a pushed ``ObjectRef`` whose object is gone (``exc`` says so)."""
    return ConfigError("rollout", f"the ObjectRef's object is gone ({type(exc).__name__}: the "
                                  f"actor that put it died, or every copy was lost); put the "
                                  f"rollout again and push the new ObjectRef")


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
        # owners a change was sent to but not acknowledged: the holders may have applied it,
        # so the front's record of their rows is re-read before the next change
        self._unsure: set[int] = set()
        self._leaf_bound: float | None = None  # prioritized: the shards' largest leaf
        self._sent: tuple[int, int] | None = None  # the last write sent: owner, count before
        # on-policy: owner -> (count before, rows) of a write that raised and whose holders
        # could not be re-read; settled (``on_settled``) by the owner's next successful re-read
        self.unsettled: dict[int, tuple[int, int]] = {}
        #: Called (with the lock held) with a write's rows and whether its holders applied
        #: it, once an :attr:`unsettled` write is settled.
        self.on_settled: Callable[[int, bool], None] = lambda rows, applied: None

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

    def _sync(self, owners: list[int], deadline: float) -> None:
        """Re-read what every holder of the ``owners`` not known exactly holds (after a change
        that was sent but not acknowledged), so the next change starts from their real state.

        Raises:
            ShardUnavailableError: A holder could not be reached or restored by ``deadline``.
        """
        shards = self.shards
        todo = [o for o in owners if o in self._unsure]
        if not todo:
            return

        def read() -> None:
            refs = {o: [shards.actors[h].rows.remote(o) for h in shards.holders(o)]
                    for o in todo}
            flat = shards.get([r for rs in refs.values() for r in rs], deadline, shard=None)
            at = 0
            for o, rs in refs.items():
                states = flat[at:at + len(rs)]
                at += len(rs)
                # A copy that differs from the primary (a change only some holders applied)
                # becomes the primary's again: copies must stay the same ring.
                stale = [h for h, st in zip(shards.holders(o), states, strict=True)
                         if st != states[0]]
                if stale:
                    self._copy(o, o, stale, deadline)
                    states = shards.get([shards.actors[h].rows.remote(o)
                                         for h in shards.holders(o)], deadline, shard=o)
                shards.acknowledged(o, states)
                if o in self.unsettled:  # the holders answered after that write: it is known
                    first, rows = self.unsettled.pop(o)
                    self.on_settled(rows, shards.held[o].total_written >= first + rows)
        self.run(read, deadline)
        self._unsure.difference_update(todo)

    def _copy(self, owner: int, source: int, targets: list[int], deadline: float) -> None:
        """Replace ``owner``'s rows on the holders ``targets`` with holder ``source``'s."""
        shards = self.shards
        state = shards.actors[source].export.remote(owner)
        shards.get([shards.actors[h].restore.remote(owner, state) for h in targets], deadline,
                   shard=owner)

    def _roll_back(self, owner: int, refs: list[Any], payload: Any, deadline: float) -> None:
        """A write whose payload is gone was refused by some holders: the holders
        that applied it (they read the object before it went) get the rows of one that did
        not, so no holder keeps rows of a write that was refused."""
        shards = self.shards
        applied, refused = [], []
        for h, ref in zip(shards.holders(owner), refs, strict=True):
            try:
                shards.get(ref, deadline, shard=h)
                applied.append(h)
            except Exception as err:
                if not lost_object(shards.ray, err, payload):
                    raise  # a dead holder: heal, and the write is tried again
                refused.append(h)
        if applied and refused:
            self._copy(owner, refused[0], applied, deadline)

    def _landed(self, owner: int, deadline: float) -> int:
        """``owner``'s write count once its holders were re-read (copies that differ get the
        primary's rows, so every holder keeps the same writes)."""
        self._unsure.add(owner)
        self._sync([owner], deadline)
        return self.shards.held[owner].total_written

    def _change(self, owners: list[int], fn: Callable[[], T], deadline: float) -> T:
        """:meth:`run` a change of ``owners``' rows from their holders' real state; when it is
        not acknowledged, they are re-read before the next change."""
        self._sync(owners, deadline)
        try:
            return self.run(fn, deadline)
        except BaseException:
            self._unsure.update(owners)
            raise

    def write(self, owner: int, payload: Any, validate: bool, deadline: float) -> int:
        """Append ``payload`` (a wire batch, or an actor's ``ObjectRef`` to ``validate``) to
        ``owner``'s rows on every holder.

        Returns:
            The rows the write added (what an ``ObjectRef`` held is known only here).

        Raises:
            SpecError: ``validate`` and the rows do not match the spec (no holder took them).
            ConfigError: ``validate`` and the ``ObjectRef``'s object is gone (its owner died
                or every copy was lost) or its task raised (field ``rollout``; no holder took
                it). A try of the write that a holder applied before the object went (a heal
                restored the others from it) stored its rows: the write returns them.
            ShardUnavailableError: Not done by ``deadline``.
        """
        shards = self.shards
        # The owner's write count before this write (re-read from the holders when an earlier
        # change was not acknowledged): a retry after a restore that already carried the rows
        # is then a no-op on every holder. A restore with nothing to copy from (all holders
        # lost) starts a fresh ring, and the write goes there: its count is the new ring's.
        self._sync([owner], deadline)
        before = shards.held[owner].total_written
        restarts = shards.restarts[owner]

        self._sent = None
        tries = 0

        def attempt() -> int:
            nonlocal before, restarts, tries
            tries += 1
            if shards.restarts[owner] != restarts:  # every copy was lost: a fresh ring,
                before = shards.held[owner].total_written  # where the write is no retry
                restarts = shards.restarts[owner]
            first = min(before, shards.held[owner].total_written)
            self._sent = (owner, first)
            refs = [shards.actors[h].write.remote(owner, payload, validate, first,
                                                  self.max_priority)
                    for h in shards.holders(owner)]
            try:
                states = shards.get(refs, deadline, shard=owner)
            except Exception as exc:
                # The rollout's object, not a shard, is gone: no retry can write it.
                if validate and lost_object(shards.ray, exc, payload):
                    self._roll_back(owner, refs, payload, deadline)
                    if tries > 1 and self._landed(owner, deadline) > first:
                        # An earlier try was applied (by a holder a heal restored the others
                        # from) before the object went: the rows are stored, on every holder.
                        return shards.held[owner].total_written - first
                    raise rollout_lost(exc) from exc
                # The rollout's task raised: every holder refused it with that error.
                if validate and failed_task(shards.ray, exc, payload,
                                            max(0.0, deadline - time.monotonic())):
                    raise rollout_failed(exc) from exc
                raise
            shards.acknowledged(owner, states)
            return shards.held[owner].total_written - first
        result = self._change([owner], attempt, deadline)
        self._sent = None
        return result

    def applied(self, owner: int, rows: int, deadline: float) -> bool | None:
        """After :meth:`write` of ``rows`` rows to ``owner`` raised: whether its holders
        applied it. They are re-read first (a copy that differs from the primary gets the
        primary's rows), so either every holder keeps the write or none does. False when
        the write was never sent. None when the holders could not be read by ``deadline``:
        the write may still land, so it is :attr:`unsettled` until the owner's next
        successful re-read (:meth:`settle`, or before its next change), which reports it to
        :attr:`on_settled`. A re-read cut short by an interrupt leaves it unsettled too, and
        the interrupt goes on."""
        sent, self._sent = self._sent, None
        if sent is None or sent[0] != owner:
            return False
        try:
            self._sync([owner], deadline)
        except BaseException as exc:
            self.unsettled[owner] = (sent[1], rows)
            if not isinstance(exc, Exception):
                raise
            return None
        return self.shards.held[owner].total_written >= sent[1] + rows

    def sent(self, owner: int) -> bool:
        """After :meth:`write` to ``owner`` raised (off-policy, where it is not re-read):
        whether it was sent, so its holders may apply it all the same."""
        sent, self._sent = self._sent, None
        return sent is not None and sent[0] == owner

    def settle(self, deadline: float) -> None:
        """Re-read the owners of :attr:`unsettled` writes, which settles them.

        Raises:
            ShardUnavailableError: A holder could not be reached or restored by ``deadline``.
        """
        if self.unsettled:
            self._sync(list(self.unsettled), deadline)

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
        self._change(list(range(len(shards))), clear, deadline)

    def update_priorities(self, owners: np.ndarray, rows: np.ndarray, priorities: np.ndarray,
                          deadline: float) -> None:
        """Give ``priorities`` to the rows ``rows`` of ``owners`` on every holder, all or
        nothing: the whole update is checked before any shard gets its part.

        Raises:
            PriorityError: A priority is too large for the shards' sum trees, whether its
                row is still held or not (nothing was changed).
            ShardUnavailableError: Not done by ``deadline``.
        """
        shards = self.shards
        self._sync(np.unique(owners).tolist(), deadline)
        self._check_priorities(owners, rows, priorities)

        def update() -> None:
            for o in np.unique(owners).tolist():
                sel = owners == o
                refs = [shards.actors[h].update_priorities.remote(o, rows[sel], priorities[sel])
                        for h in shards.holders(o)]
                shards.acknowledged(o, shards.get(refs, deadline, shard=o))
        self._change(np.unique(owners).tolist(), update, deadline)
        self.priority_updates += 1
        kept = priorities[self._held(owners, rows)]  # the shards skipped the others
        if kept.size:
            self.max_priority = max(self.max_priority, float(kept.max()))

    def _held(self, owners: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Which of the rows ``rows`` of ``owners`` their shards still hold."""
        written = np.array([h.total_written for h in self.shards.held], dtype=np.int64)[owners]
        size = np.array([h.size for h in self.shards.held], dtype=np.int64)[owners]
        return (rows >= written - size) & (rows < written)

    def _check_priorities(self, owners: np.ndarray, rows: np.ndarray, priorities: np.ndarray
                          ) -> None:
        """Refuse an update a shard's sum tree would refuse (a leaf above its bound), checked
        over every priority, also those of rows the shards no longer hold (they skip them),
        so a value is refused wherever it falls, as one buffer checks all of an update before
        it changes anything.

        Raises:
            PriorityError: A priority is too large.
        """
        if not priorities.size:
            return
        cfg = self.shards.config
        if self._leaf_bound is None:
            self._leaf_bound = cfg.leaf_bound()
        pr = priorities
        with np.errstate(over="ignore", invalid="ignore"):
            leaves = (pr + cfg.eps) ** cfg.alpha
        if not np.all(leaves <= self._leaf_bound):
            raise PriorityError(f"priorities: up to {pr.max():.3g}, too large next to the "
                                f"smallest possible priority (eps={cfg.eps:g}): the sum over "
                                f"a shard or the importance weights would leave float range; "
                                f"rescale them (for example clip |TD errors|)")

    def heal(self, deadline: float) -> list[ShardRecovery]:
        """Re-create dead shards and restore their rows; warn about and report rows lost.

        Raises:
            ShardUnavailableError: A shard could not be restored by ``deadline``, or
                ``deadline`` passed while another call held the front (it may wait on a
                stalled shard).
            PlaneClosedError: The plane closed (its shards were ended; none is re-created).
        """
        with front_until(self._cond, deadline, "no shard was restored"):
            done: list[ShardRecovery] = []
            while True:
                try:
                    done += self.shards.heal(deadline)
                    break
                except (ShardUnavailableError, PlaneClosedError):
                    raise
                except Exception as exc:  # a re-created shard died before it answered
                    if not self.shards.is_death(exc):
                        raise
                    if time.monotonic() >= deadline:
                        raise ShardUnavailableError(None, f"re-created shards kept dying until "
                                                          f"the deadline ({exc})") from exc
            for r in done:
                if r.lost_rows:
                    warnings.warn(f"shard {r.shard} died on node {r.old_node} with no live "
                                  f"replica: {r.lost_rows} rows lost (replication="
                                  f"{self.replication})", RuntimeWarning, stacklevel=3)
                    self._on_lost(r.lost_rows)
            self._cond.notify_all()
            return done
