"""Learner ports of the sharded plane: each rank draws its own batches, with the next delivery
invocation's remote fetch in flight while the learner updates (delivery prefetch,
``overlap_del = 1``). One invocation draws ``g_del`` batches' rows at once and runs the
delivery operator over them on the pulling thread; the batches it writes are handed out one
per ``pull``.

A port never holds the front's lock while it waits on Ray: it plans a draw and submits its
remote calls under the lock (so they are ordered after every acknowledged push), then waits
for the results outside it.

Each port has a node and a device. A draw fixes which rows are read; each shard's part is then
fetched from the current copy of that shard's rows on the port's node when there is one, else
from the shard's primary (the §5.1 local/remote mixture, :func:`sampling.nearest_copy`). The
delivery operator's batches end up on the port's device.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from conduit.distributed import sampling
from conduit.distributed.errors import ShardUnavailableError
from conduit.distributed.operators import deliver, front_until
from conduit.errors import ConfigError, EmptyBufferError
from conduit.spec import Batch

if TYPE_CHECKING:
    from conduit.distributed.plane import RayExperienceDataPlane

DeviceArg = str | torch.device | Sequence[str | torch.device]
"""One device for every learner rank, or one per rank."""


def _available(device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    if device.type == "mps":
        return torch.backends.mps.is_available()
    return False


def rank_devices(value: DeviceArg, num_learners: int) -> tuple[torch.device, ...]:
    """The device of each learner rank: ``value`` for all, or ``value[r]`` for rank ``r``.

    Raises:
        ConfigError: Not a device or one per rank, or a device this process cannot use; the
            field is ``learner_device`` (``learner_device[r]`` for one rank's).
    """
    if isinstance(value, str | torch.device):
        items, names = [value] * num_learners, ["learner_device"] * num_learners
    elif isinstance(value, Sequence) and len(value) == num_learners:
        items, names = list(value), [f"learner_device[{r}]" for r in range(num_learners)]
    else:
        raise ConfigError("learner_device", f"expected one device for every rank or a sequence "
                                            f"of {num_learners} (one per rank), got {value!r}")
    out = []
    for item, name in zip(items, names, strict=True):
        try:
            device = torch.device(item)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(name, f"{item!r} is not a device ({exc})") from exc
        if not _available(device):
            raise ConfigError(name, f"{device} is not available in this process "
                                    f"(cuda devices: {torch.cuda.device_count()}); pick one "
                                    f"it has, or 'cpu'")
        out.append(device)
    return tuple(out)


@dataclass
class Pending:
    """A draw whose remote fetches are in flight.

    Attributes:
        refs: ``owner -> ObjectRef`` of each shard's part.
        where: ``owner -> positions of its rows in the batch``.
        stamp: The front's priority-update count when the draw was planned.
        min_leaf: Smallest priority held over all shards at planning (prioritized).
        issued: ``time.perf_counter()`` at submission.
        key: On-policy: ``(iteration, epoch, mini-batch, losses)``, ``losses`` the heals
            that had lost rows when it was planned (a later one makes it stale).
        probes: ``shard -> ObjectRef`` of pings to the shards the draw reads nothing from.
    """

    refs: dict[int, Any]
    where: dict[int, np.ndarray]
    stamp: int
    min_leaf: float = 1.0
    issued: float = field(default_factory=time.perf_counter)
    key: tuple[int, int, int, int] | None = None
    probes: dict[int, Any] = field(default_factory=dict)


class LearnerPort:
    """One learner rank's side of the plane: ``pull`` training-ready batches.

    Off-policy, ranks draw independent batches (each with its own generator). On-policy, each
    mini-batch is split into ``world_size`` disjoint shares and this rank gets share ``rank``;
    the union over ranks is every row of the iteration exactly once per epoch.

    Args:
        plane: The front.
        rank: This learner's rank.
        world_size: Learner ranks of the plane.
        device: Where this rank's batches end up.
        node: The Ray node this rank reads on (local copies are preferred there).
    """

    def __init__(self, plane: RayExperienceDataPlane, *, rank: int, world_size: int,
                 device: torch.device, node: str | None) -> None:
        self._plane, self.rank, self.world_size = plane, rank, world_size
        self.device, self.node = device, node
        self._rng = np.random.default_rng([plane.config.seed, rank, 0x5EED])
        self._next: Pending | None = None
        self._staged: list[Batch] = []  # batches of the last invocation not pulled yet
        self._staged_from: Pending | None = None
        # a batch formed (its position committed) but not returned, with the on-policy
        # iteration it is of: an interrupt landed before pull() handed it back
        self._owed: tuple[Batch, int] | None = None
        self._position = (0, 0, 0)  # on-policy: iteration, epoch, mini-batch
        # on-policy: the iteration this rank consumed whose report to the front was cut
        # short (the front may not know it); the next pull reports it again
        self._unreported: int | None = None
        # on-policy: iteration, epoch and the gate's losses when this epoch's first
        # mini-batch was planned; epochs started again because rows were lost in them
        self._layout: tuple[int, int, int] | None = None
        self.epoch_restarts = 0
        self.remote_wait_s = 0.0  # time pull() waited on Ray for a batch's rows
        self.pulls = 0

    # -- off-policy -------------------------------------------------------------------------
    def _plan_off_policy(self) -> Pending | None:
        """Submit one batch's shard draws; None while fewer than ``min_size`` rows are held."""
        plane, shards = self._plane, self._plane._shards
        held = shards.held
        prioritized = plane._prioritized
        weights = np.array([h.mass if prioritized else h.size for h in held], dtype=np.float64)
        if sum(h.size for h in held) < plane.min_size or not weights.sum() > 0:
            return None
        n = plane.batch_size * plane._g_del
        counts = sampling.split_draw(self._rng, weights, n)
        source = {k: shards.read_from(k, self.node) for k, c in enumerate(counts) if c > 0}
        refs = {k: shards.actors[h].sample.remote(k, int(counts[k])) for k, h in source.items()}
        # Shards' rows interleave in the batch, as one buffer's draw would.
        order = self._rng.permutation(n)
        ends = np.cumsum(counts)
        where = {k: order[ends[k] - counts[k]:ends[k]] for k in refs}
        min_leaf = min((h.min_leaf for h in held if h.size), default=1.0)
        return Pending(refs, where, plane._replicator.priority_updates, min_leaf,
                       probes=shards.probe(set(source.values())))

    def _fresh(self, pending: Pending | None) -> bool:
        plane = self._plane
        if pending is None:
            return False
        if pending.key is not None:
            return pending.key == (*self._position, plane._gate.losses)
        lag = plane._replicator.priority_updates - pending.stamp
        return not plane._prioritized or lag <= plane.config.max_priority_lag

    def _assemble(self, pending: Pending, parts: dict[int, dict[str, Any]]) -> Batch:
        """The draw's rows from the shards' parts, in the draw's order (on the host)."""
        plane = self._plane
        owners = sorted(parts)
        where = pending.where
        n = sum(len(where[k]) for k in owners)
        batch: Batch = {}
        for name in [*plane.spec.fields, "_row_id", "_priority"]:
            if name not in parts[owners[0]]:
                continue
            first = parts[owners[0]][name]
            if isinstance(first, np.ndarray):
                col = np.empty((n, *first.shape[1:]), dtype=first.dtype)
                for k in owners:
                    col[where[k]] = parts[k][name]
                batch[name] = torch.from_numpy(col)
            else:
                out = torch.empty((n, *first.shape[1:]), dtype=first.dtype)
                for k in owners:
                    out[torch.from_numpy(where[k])] = torch.as_tensor(parts[k][name])
                batch[name] = out
        owner = np.empty(n, dtype=np.int64)
        for k in owners:
            owner[where[k]] = k
        rid = batch.pop("_row_id").numpy()
        batch["_index"] = torch.from_numpy((owner << sampling.ROW_BITS) | rid)
        pr = batch.pop("_priority", None)
        if pr is not None:
            batch["_weight"] = torch.from_numpy(sampling.global_weights(
                pr.numpy(), pending.min_leaf, plane._beta))
        return batch

    # -- on-policy --------------------------------------------------------------------------
    def _plan_on_policy(self) -> Pending | None:
        """Submit this rank's share of its next mini-batch; None until the iteration's rows
        are all in."""
        plane, shards = self._plane, self._plane._shards
        iteration, epoch, m = self._position
        gate = plane._gate
        if gate.iteration != iteration or not gate.ready or gate.clearing:
            return None
        if m and self._layout != (iteration, epoch, gate.losses):
            # Rows were lost (and taken again) since the epoch began: its permutation is of
            # rows no longer all held, so it starts again over the rows held now.
            warnings.warn(f"on-policy iteration {iteration}: rows were lost during epoch "
                          f"{epoch}; rank {self.rank} starts the epoch again (rows it was "
                          f"delivered before the loss are delivered again)", RuntimeWarning,
                          stacklevel=4)
            m, self._position = 0, (iteration, epoch, 0)
            self.epoch_restarts += 1
        if not m:
            self._layout = (iteration, epoch, gate.losses)
        sizes = [h.size for h in shards.held]
        part = sampling.epoch_parts(sum(sizes), seed=plane.config.seed, iteration=iteration,
                                    epoch=epoch, num_minibatches=plane.num_minibatches)[m]
        share = sampling.rank_share(part, self.rank, self.world_size)
        located = sampling.locate(share, sizes)
        source = {k: shards.read_from(k, self.node) for k in located}
        refs = {k: shards.actors[source[k]].gather.remote(k, slots)
                for k, (slots, _) in located.items()}
        return Pending(refs, {k: at for k, (_, at) in located.items()},
                       plane._replicator.priority_updates, key=(*self._position, gate.losses),
                       probes=shards.probe(set(source.values())))

    def _advance(self, deadline: float) -> None:
        """Move past the mini-batch just formed; after the iteration's last, tell the front
        this rank consumed it (the position is committed first, so a clear cut short is
        finished by the next call rather than planned from again, and a report cut short is
        made again by the next pull: :meth:`_report`).

        Raises:
            ShardUnavailableError: ``deadline`` passed while another call held the front, or
                the clear did not finish in time.
        """
        plane = self._plane
        iteration, epoch, m = self._position
        m += 1
        if m == plane.num_minibatches:
            m, epoch = 0, epoch + 1
        if epoch < plane.num_epochs:
            self._position = (iteration, epoch, m)
            return
        self._position, self._unreported = (iteration + 1, 0, 0), iteration
        self._report(deadline)

    def _report(self, deadline: float, *, clear_by: float | None = None) -> None:
        """Tell the front this rank consumed the iteration :attr:`_unreported` names, if any.

        Args:
            deadline: Until when another call that holds the front is waited for.
            clear_by: When the clear this may run must be done (None: the plane's timeout
                from now).

        Raises:
            ShardUnavailableError: ``deadline`` passed while another call held the front (the
                report stays to be made), or the clear did not finish in time.
        """
        iteration = self._unreported
        if iteration is None:
            return
        self._plane._changes.rank_done(self.rank, iteration, deadline, clear_by=clear_by)
        self._unreported = None

    # -- both -------------------------------------------------------------------------------
    def _plan(self) -> Pending | None:
        if self._plane.config.on_policy:
            return self._plan_on_policy()
        return self._plan_off_policy()

    def pull(self, *, timeout: float | None = None) -> Batch:
        """Take this rank's next training batch.

        Off-policy: ``batch_size`` rows drawn across shards (``_index`` identifies each row
        for :meth:`~conduit.distributed.RayExperienceDataPlane.update_priorities`; prioritized
        batches carry global ``_weight``). On-policy: this rank's share of the next mini-batch.
        Both as the delivery operator wrote them.

        An interrupt (such as ``KeyboardInterrupt``) or a :class:`ShardUnavailableError`
        after the batch was formed (while the iteration is marked consumed and the shards
        cleared, or the next draw is submitted) keeps it: the next pull returns it first,
        after marking the iteration consumed and finishing a clear cut short. On-policy
        the kept batch is of the iteration it was formed in: :meth:`minibatches` yields it
        first only in a loop over that iteration, and a loop started for a later iteration
        (the interrupt cut short the last mini-batch's pull, so it ended the loop the batch
        was of) drops it, so a loop yields only its own iteration's mini-batches.

        Raises:
            EmptyBufferError: No batch could be formed within ``timeout``.
            OperatorError: The delivery operator raised (on-policy, the same share is drawn
                again by the next pull), or the ingestion operator failed on the front's
                thread (until ``recover()``).
            ShardUnavailableError: A shard's rows could not be read or restored in time, or
                the timeout ran out while another call held the front (waiting on a shard).
            PlaneClosedError: The plane is closed.
        """
        with self._plane._life.in_flight():  # close() keeps Ray up until it returns
            return self._pull(timeout)

    def _pull(self, timeout: float | None) -> Batch:
        plane = self._plane
        plane._check_open()
        plane._ingestion.raise_if_failed()
        deadline = time.monotonic() + plane.config.wait_for(timeout)
        if plane.config.on_policy and plane._replicator.unsettled:
            # a push's write that may still land counts once it is known; another call may
            # hold the front while it waits on a stalled shard: wait for it only until the
            # pull's deadline
            with front_until(plane._cond, deadline, "no batch was drawn"):
                plane._replicator.settle(deadline)
        # this rank's last share was formed but its report cut short (the clear it may run
        # is bounded by the pull's deadline, as a clear cut short is)
        self._report(deadline, clear_by=deadline)
        if plane.config.on_policy and plane._gate.clearing:
            plane._changes.finish_clear(deadline)  # a clear cut short by an interrupt or a timeout
        if self._owed is not None:  # formed, then an interrupt kept it from being returned
            return self._hand_out(self._owed[0])
        if self._staged and self._fresh(self._staged_from):
            batch = self._staged.pop(0)
            self._owed = batch, self._position[0]
            if plane.prefetch and not self._staged:
                self._prefetch()
            return self._hand_out(batch)
        self._staged = []
        pending, self._next = self._next, None
        while True:
            if plane._shards.unrestored:  # a restore cut short by an earlier deadline
                plane._replicator.heal(deadline)
                pending = None
            if not self._fresh(pending):
                pending = self._wait_plan(deadline)
            t0 = time.perf_counter()
            try:
                owners = list(pending.refs)
                got = plane._shards.get([pending.refs[k] for k in owners], deadline,
                                        shard=None)
                parts = dict(zip(owners, got, strict=True))
            except Exception as exc:
                if not plane._shards.is_death(exc):
                    raise
                plane._replicator.heal(deadline)
                pending = None
                continue
            self.remote_wait_s += time.perf_counter() - t0
            break
        if plane._shards.any_died(pending.probes):  # a shard this draw did not need
            with contextlib.suppress(ShardUnavailableError):  # finished by the next call
                plane._replicator.heal(deadline)
        rows = self._assemble(pending, parts)
        on = plane.config.on_policy
        batches = 1 if on else plane._g_del
        staged = deliver(plane._ingestion.deliver_fn, rows, batches=batches,
                         batch_size=len(rows["_index"]) // batches, device=self.device)
        batch, self._staged, self._staged_from = staged[0], staged[1:], pending
        # From here the batch is this rank's: an interrupt below leaves it for the next pull.
        self._owed = batch, self._position[0]
        if on:
            self._advance(deadline)
        if plane.prefetch and not self._staged:
            self._prefetch()
        return self._hand_out(batch)

    def _prefetch(self) -> None:
        """Submit the next draw, unless the plane closed meanwhile (its shards are ended) or
        another call holds the front (it may wait on a stalled shard; the next pull draws)."""
        plane = self._plane
        if not plane._cond.acquire(blocking=False):
            return
        try:
            self._next = None if plane.closed else self._plan()
        finally:
            plane._cond.release()

    def _hand_out(self, batch: Batch) -> Batch:
        """Return ``batch``, the one :attr:`_owed` to the caller."""
        self._owed = None
        self.pulls += 1
        return batch

    def _wait_plan(self, deadline: float) -> Pending:
        plane = self._plane
        ingestion = plane._ingestion
        while True:
            ingestion.hurry()  # rows queued for ingestion are what this learner waits for
            # Another call may hold the front's lock while it waits on a stalled shard: wait
            # for it only until the pull's deadline.
            with front_until(plane._cond, deadline, "no batch was drawn"):
                plane._check_open()
                ingestion.raise_if_failed()
                pending = self._plan()
                if pending is not None:
                    return pending
                left = deadline - time.monotonic()
                if left <= 0:
                    held = sum(h.size for h in plane._shards.held)
                    need = plane.capacity if plane.config.on_policy else plane.min_size
                    raise EmptyBufferError(f"no batch within the timeout: the shards hold "
                                           f"{held} rows, a batch needs {need}")
                # Queued units (and a failure on the ingestion thread) do not signal the
                # front's condition; look again shortly.
                plane._cond.wait(left if ingestion.direct else min(left, 0.05))

    def bind(self, node: str) -> None:
        """Read on ``node`` from now on (a draw already in flight is dropped).

        Raises:
            ShardUnavailableError: The plane's timeout ran out while another call held the
                front (waiting on a shard); the port reads where it did.
        """
        plane = self._plane
        with front_until(plane._cond, time.monotonic() + plane.timeout,
                         "the port still reads where it did"):
            self.node, self._next = node, None

    def minibatches(self, *, timeout: float | None = None) -> Iterator[Batch]:
        """On-policy: this rank's share of every mini-batch of the current iteration
        (M × epochs), in order. A batch an interrupt kept from an earlier iteration's last
        pull is dropped, not yielded (see :meth:`pull`).

        Raises:
            ConfigError: The plane is off-policy.
        """
        plane = self._plane
        if not plane.config.on_policy:
            raise ConfigError("mode", "minibatches() is for on-policy planes; use pull()")
        iteration = self._position[0]
        if self._owed is not None and self._owed[1] < iteration:
            self._owed = None  # the loop it was of ended with the interrupt that kept it
        while self._position[0] == iteration:  # its last share moves this rank on
            yield self.pull(timeout=timeout)
