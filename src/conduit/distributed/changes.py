"""The changes of the shards' rows that the sharded front orders besides pushes: priority
updates, and on-policy, the clear of a consumed iteration. Each is made under the front's
lock, waited for only until the caller's deadline while another call holds it (it may wait on
a stalled shard), and sent to every holder in order (:mod:`conduit.distributed.replication`).
"""

from __future__ import annotations

import threading
import time

import torch

from conduit.distributed.cluster import ShardSet
from conduit.distributed.iteration import IterationGate
from conduit.distributed.operators import front_until
from conduit.distributed.replication import Replicator
from conduit.distributed.sampling import priority_updates
from conduit.errors import PriorityError


class FrontChanges:
    """Priority updates and on-policy iteration clears, as the front orders them.

    Args:
        cond: The front's condition (over its re-entrant lock).
        gate: On-policy iteration gating.
        replicator: Sends changes to every holder.
        shards: The shard actors.
        prioritized: Whether the shards sample in proportion to priority.
        timeout: The plane's timeout in seconds.
    """

    def __init__(self, *, cond: threading.Condition, gate: IterationGate,
                 replicator: Replicator, shards: ShardSet, prioritized: bool,
                 timeout: float) -> None:
        self._cond, self._gate, self._replicator = cond, gate, replicator
        self._shards, self._prioritized, self._timeout = shards, prioritized, timeout

    def rank_done(self, rank: int, iteration: int, deadline: float, *,
                  clear_by: float | None = None) -> None:
        """On-policy: ``rank`` pulled its last share of ``iteration``; the last rank clears
        every holder of every shard's rows and opens the next iteration. Reporting it again is
        harmless (a rank counts once; an iteration the front moved past is ignored).

        Args:
            rank: The rank.
            iteration: The iteration it consumed.
            deadline: Until when another call that holds the front (it may wait on a stalled
                shard) is waited for (``time.monotonic()``; the pulling call's).
            clear_by: When the clear must be done (None: the plane's timeout from now).

        Raises:
            ShardUnavailableError: ``deadline`` passed while another call held the front
                (nothing was marked: the rank's next pull reports it again), or the clear did
                not finish in time (the iteration stays consumed: :meth:`finish_clear`
                completes it).
        """
        by = time.monotonic() + self._timeout if clear_by is None else clear_by
        with front_until(self._cond, deadline, "the mini-batch formed is kept for the "
                                               "rank's next pull, which marks the iteration "
                                               "consumed"):
            self._gate.consumed(rank, iteration, lambda: self._replicator.clear_all(by))

    def finish_clear(self, deadline: float) -> None:
        """On-policy: finish clearing a consumed iteration whose clear was cut short (an
        interrupt or a timeout in :meth:`rank_done`), so the next iteration opens.

        Raises:
            ShardUnavailableError: ``deadline`` passed while another call held the front, or
                the clear did not finish by it (the iteration stays consumed, for a later call
                to clear).
        """
        with front_until(self._cond, deadline, "the consumed iteration was not cleared (a "
                                               "later call clears it)"):
            self._gate.finish(lambda: self._replicator.clear_all(deadline))

    def update_priorities(self, indices: torch.Tensor, priorities: torch.Tensor) -> None:
        """Give new priorities to delivered rows, on the shard that owns each row and on its
        replicas, all or nothing; see :meth:`RayExperienceDataPlane.update_priorities
        <conduit.distributed.RayExperienceDataPlane.update_priorities>`.

        Raises:
            PriorityError: Not a prioritized plane, or the update is invalid (nothing is
                changed).
            ShardUnavailableError: A shard could not be updated or restored in time, or the
                plane's timeout ran out while another call held the front.
        """
        if not self._prioritized:
            raise PriorityError("sampler: this plane samples uniformly; build it with "
                                "sampler='prioritized' to update priorities")
        deadline = time.monotonic() + self._timeout
        with front_until(self._cond, deadline, "no priority was changed"):
            owners, rows, pr = priority_updates(
                indices, priorities, self._shards.high_water)
            self._replicator.update_priorities(owners, rows, pr, deadline)
