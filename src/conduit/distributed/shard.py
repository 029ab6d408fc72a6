"""One buffer shard: the rows pushed on one node (its primary) and copies of other shards' rows
(its replicas), each an :class:`~conduit.storage.ExperienceBuffer`.

The class is plain Python; :mod:`conduit.distributed.cluster` runs it as a Ray actor pinned to a
node. Every method that changes rows is called by the plane's front in one order for a shard and
all its replicas, so a replica is the same ring, slot for slot, as its primary.

Rows are addressed by row id (their place in their owner's write order): slot = id mod capacity,
and a row is still held while ``id >= total_written - size``. Priority updates for rows that
were overwritten since they were sampled are dropped the same way on the primary and on every
replica.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from conduit.errors import ConduitError, ConfigError, SpecError, StateError
from conduit.plane.config import PlaneConfig
from conduit.spec import ExperienceSpec
from conduit.storage import (
    ExperienceBuffer,
    FifoSampler,
    Placement,
    PrioritizedSampler,
    Sampler,
    UniformSampler,
)
from conduit.storage.state import StateDict

T = TypeVar("T")
SamplerKind = Literal["uniform", "prioritized", "fifo"]


@dataclass(frozen=True)
class ShardSpec:
    """What every shard of a plane is built from.

    Attributes:
        spec: Fields of one row.
        capacity: Rows of each buffer the shard holds (its primary and each replica).
        sampler: ``"uniform"``, ``"prioritized"`` or ``"fifo"`` (on-policy; gathers only).
        alpha: Prioritized: priority exponent.
        beta: Prioritized: importance-weight exponent.
        eps: Prioritized: added to every priority.
        placement: Where the rows live on the shard's node (None: pageable CPU).
        seed: Seed of the primary's sampler (shard ``k`` adds ``k``). Every other copy of a
            shard's rows, and every restored copy, draws from its own stream derived from it,
            so learners that read different copies draw independently.
    """

    spec: ExperienceSpec
    capacity: int
    sampler: SamplerKind = "uniform"
    alpha: float = 0.6
    beta: float = 0.4
    eps: float = 1e-6
    placement: Placement | None = None
    seed: int = 0

    def leaf_bound(self) -> float:
        """Prioritized: the largest leaf, ``(priority + eps) ** alpha``, a shard's sum tree
        accepts (every shard's is the same), so the front refuses an update before any shard
        applies part of it."""
        return PrioritizedSampler(alpha=self.alpha, beta=self.beta,
                                  eps=self.eps).leaf_bound(self.capacity)

    def make_sampler(self, seed: int) -> Sampler:
        """A fresh sampler of this spec's kind."""
        if self.sampler == "prioritized":
            return PrioritizedSampler(alpha=self.alpha, beta=self.beta, eps=self.eps, seed=seed)
        if self.sampler == "fifo":
            return FifoSampler(seed=seed)
        return UniformSampler(seed=seed)


def shard_spec_for(sampler: Any, cfg: PlaneConfig, capacity: int,
                   placement: Placement | None) -> ShardSpec:
    """What every shard of a plane with config ``cfg`` and ``sampler`` is built from.

    Raises:
        ConfigError: ``sampler`` is set on-policy, or is not uniform or prioritized.
    """
    if cfg.on_policy:
        if sampler is not None:
            raise ConfigError("sampler", "on-policy sharded planes deliver every row exactly "
                                         "once per epoch; leave sampler unset")
        return ShardSpec(spec=cfg.spec, capacity=capacity, sampler="fifo",
                         placement=placement, seed=cfg.seed)
    if sampler is None or sampler == "uniform" or type(sampler) is UniformSampler:
        return ShardSpec(spec=cfg.spec, capacity=capacity, placement=placement, seed=cfg.seed)
    if sampler == "prioritized":
        sampler = PrioritizedSampler()
    if type(sampler) is PrioritizedSampler:
        return ShardSpec(spec=cfg.spec, capacity=capacity, sampler="prioritized",
                         alpha=sampler.alpha, beta=sampler.beta, eps=sampler.eps,
                         placement=placement, seed=cfg.seed)
    raise ConfigError("sampler", f"a sharded plane samples 'uniform' or 'prioritized' (or a "
                                 f"UniformSampler / PrioritizedSampler), got {sampler!r}")


@dataclass(frozen=True)
class HeldRows:
    """A shard's view of one owner's rows, sent back after every change.

    Attributes:
        size: Rows held.
        total_written: Rows ever written (the next row id).
        mass: Prioritized: sum of the (exponentiated) priorities; else ``size``.
        min_leaf: Prioritized: the smallest priority held; else 1.
    """

    size: int
    total_written: int
    mass: float
    min_leaf: float


class RemoteError(Exception):
    """A Conduit error raised in a shard, in a form Ray can send back (Conduit's errors take
    keyword-only constructor arguments, which pickling does not replay)."""

    def __init__(self, kind: type[BaseException], message: str, attrs: dict[str, Any]) -> None:
        super().__init__(kind, message, attrs)
        self.kind, self.message, self.attrs = kind, message, attrs

    @classmethod
    def of(cls, exc: BaseException) -> RemoteError:
        return cls(type(exc), str(exc), dict(vars(exc)))

    def rebuild(self) -> BaseException:
        """The original error, of its own type, with its message and attributes."""
        exc = self.kind.__new__(self.kind)
        Exception.__init__(exc, self.message)
        vars(exc).update(self.attrs)
        return exc


def _sent_back(fn: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except ConduitError as exc:
            raise RemoteError.of(exc) from None
    return call


def to_wire(batch: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Columns as numpy where numpy has the dtype, so Ray's object store reads them without a
    copy; other dtypes (bfloat16) stay tensors."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        v = v.detach()
        try:
            out[k] = v.cpu().numpy()
        except TypeError:
            out[k] = v.cpu()
    return out


def _view(column: Any) -> torch.Tensor:
    """A column as a tensor without a copy: numpy arrays from the object store are read-only,
    and the store only reads them (it copies the rows into its own memory)."""
    if not isinstance(column, np.ndarray):
        return torch.as_tensor(column)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": it is only read
        return torch.from_numpy(column)


class BufferShard:
    """The rows of one shard and the replicas it keeps for others.

    Args:
        shard_id: This shard's id (the owner id of its primary).
        config: Shared construction parameters.
    """

    def __init__(self, *, shard_id: int, config: ShardSpec) -> None:
        torch.set_num_threads(1)  # one core per shard; the node's other cores are the actors'
        self.shard_id = shard_id
        self.config = config
        self.buffers: dict[int, ExperienceBuffer] = {}
        self.reads: dict[int, int] = {}  # owner -> rows this shard served (sample, gather)
        self._restores = 0
        self.held(shard_id)

    def held(self, owner: int) -> ExperienceBuffer:
        """The buffer for ``owner``'s rows, made empty on first use."""
        buf = self.buffers.get(owner)
        if buf is None:
            cfg = self.config
            seed = cfg.seed + owner if owner == self.shard_id else self._stream(owner)
            buf = ExperienceBuffer(spec=cfg.spec, capacity=cfg.capacity,
                                   sampler=cfg.make_sampler(seed), placement=cfg.placement)
            self.buffers[owner] = buf
        return buf

    def _stream(self, owner: int) -> int:
        """Seed of this holder's draws from ``owner``'s rows: distinct per holder and per
        restore, so no two live copies replay one sequence."""
        key = [self.config.seed, owner, self.shard_id, self._restores]
        return int(np.random.SeedSequence(key).generate_state(1)[0])

    def node_id(self) -> str:
        """The Ray node this shard runs on ("" outside Ray)."""
        try:
            import ray
            return ray.get_runtime_context().get_node_id()
        except Exception:  # outside a Ray worker there is no node
            return ""

    def read_counts(self) -> dict[int, int]:
        """Rows this shard served to learners so far, per owner (its own rows and the
        replicas it keeps)."""
        return dict(self.reads)

    def _served(self, owner: int, rows: int) -> None:
        self.reads[owner] = self.reads.get(owner, 0) + rows

    def ping(self) -> int:
        """Liveness probe: the shard's id."""
        return self.shard_id

    def rows(self, owner: int) -> HeldRows:
        """What this shard holds of ``owner``'s rows."""
        buf = self.held(owner)
        sampler = buf.sampler
        if isinstance(sampler, PrioritizedSampler) and len(buf):
            tree = sampler.tree
            return HeldRows(len(buf), buf.total_written, float(tree.total), float(tree.min))
        return HeldRows(len(buf), buf.total_written, float(len(buf)), 1.0)

    @_sent_back
    def write(self, owner: int, rows: Mapping[str, Any], validate: bool, first_id: int,
              max_priority: float = 1.0) -> HeldRows:
        """Append rows to ``owner``'s buffer (``validate``: check them against the spec, for
        payloads that did not pass through the plane's front). ``first_id`` is the owner's
        write count before these rows: a repeated write (a retry after a restore that already
        carried it) is a no-op, so every holder applies each write once. Prioritized: new rows
        get the largest priority seen over all shards, ``max_priority``, as in one buffer.

        Raises:
            SpecError: ``validate`` and the rows do not match the spec.
            StateError: This holder missed earlier writes of ``owner`` (never expected).
        """
        buf = self.held(owner)
        if buf.total_written > first_id:
            return self.rows(owner)
        if buf.total_written < first_id:
            raise StateError(f"shard{self.shard_id}.rows[{owner}]",
                             f"holds {buf.total_written} writes, the write expects {first_id}")
        if not isinstance(rows, Mapping):  # an actor's ObjectRef may hold anything
            raise SpecError(None, f"rollout must be a mapping of field name to tensor, got "
                                  f"{type(rows).__name__}")
        data = {k: _view(v) for k, v in rows.items()}
        if isinstance(buf.sampler, PrioritizedSampler):
            buf.sampler.max_priority = max(buf.sampler.max_priority, float(max_priority))
        buf.extend(data, validate=validate)
        return self.rows(owner)

    def _ids(self, buf: ExperienceBuffer, slots: torch.Tensor) -> torch.Tensor:
        total, cap = buf.total_written, buf.capacity
        return slots + cap * torch.div(total - 1 - slots, cap, rounding_mode="floor")

    def sample(self, owner: int, k: int) -> dict[str, Any]:
        """``k`` rows drawn by the owner's sampler, with ``_row_id`` and, prioritized, the
        drawn rows' priorities in ``_priority`` (the front computes global weights)."""
        buf = self.held(owner)
        batch = buf.sample(k)
        slots = batch.pop("_index")
        self._served(owner, len(slots))
        batch.pop("_weight", None)
        batch["_row_id"] = self._ids(buf, slots)
        if isinstance(buf.sampler, PrioritizedSampler):
            batch["_priority"] = buf.sampler.priorities(slots)
        return to_wire(batch)

    def gather(self, owner: int, slots: np.ndarray) -> dict[str, Any]:
        """The rows at ``slots`` of ``owner``'s buffer, in that order, with ``_row_id``."""
        buf = self.held(owner)
        idx = torch.as_tensor(np.asarray(slots, dtype=np.int64))
        batch = buf.gather(idx)
        batch.pop("_index")
        self._served(owner, len(idx))
        batch["_row_id"] = self._ids(buf, idx)
        return to_wire(batch)

    @_sent_back
    def update_priorities(self, owner: int, row_ids: np.ndarray, priorities: np.ndarray
                          ) -> HeldRows:
        """Set priorities of ``owner``'s rows by id; ids of rows no longer held are skipped.

        The row ids say exactly which rows are meant, so the update goes to the sampler as
        is: every holder applies the same update to the same rows whatever it delivered
        itself (a buffer's own filter by the row last delivered from a slot differs between
        a primary, the copies learners read and a restored copy), and the copies stay equal.

        Raises:
            PriorityError: Priorities that are not finite and non-negative, or mismatched
                lengths.
        """
        buf = self.held(owner)
        ids = np.asarray(row_ids, dtype=np.int64)
        pr = np.asarray(priorities, dtype=np.float64)
        keep = (ids >= buf.total_written - len(buf)) & (ids < buf.total_written)
        if pr.shape == ids.shape and not keep.all():
            ids, pr = ids[keep], pr[keep]
        buf.sampler.update_priorities(torch.from_numpy(ids % buf.capacity),
                                      torch.from_numpy(pr))
        return self.rows(owner)

    @_sent_back
    def start_at(self, owner: int, first_id: int) -> HeldRows:
        """Make ``owner``'s rows an empty ring whose first row gets id ``first_id`` (a multiple
        of the capacity, so row ``i`` still lives in slot ``i mod capacity``): a ring
        re-created after every copy of it was lost does not give its new rows the ids of the
        lost ones, and an update for a lost row is skipped as for any row no longer held.

        Raises:
            StateError: ``first_id`` is negative or not a multiple of the capacity.
        """
        buf = self.held(owner)
        if first_id < 0 or first_id % buf.capacity:
            raise StateError(f"shard{self.shard_id}.rows[{owner}]",
                             f"a ring of {buf.capacity} rows cannot start at row {first_id}")
        buf.clear()
        buf.writer.total_written = first_id
        return self.rows(owner)

    def clear(self, owner: int) -> HeldRows:
        """Forget ``owner``'s rows (an on-policy iteration was consumed)."""
        self.held(owner).clear()
        return self.rows(owner)

    def export(self, owner: int) -> StateDict:
        """``owner``'s buffer as a state dict (rows, ring, sampler), to restore another shard."""
        return self.held(owner).state_dict(rows=True)

    @_sent_back
    def restore(self, owner: int, state: StateDict) -> HeldRows:
        """Replace ``owner``'s buffer with :meth:`export`'s state of another shard; its draws
        continue from a stream of its own, not the source's."""
        buf = self.held(owner)
        self._restores += 1
        fresh = np.random.default_rng(self._stream(owner)).bit_generator.state
        # Without the source's torch draws state, a uniform sampler seeds it from ``fresh``.
        sampler = {k: v for k, v in state["sampler"].items() if k != "draws"}
        buf.load_state_dict({**state, "sampler": {**sampler, "rng": fresh}}, rows=True)
        return self.rows(owner)

    def drop(self, owner: int) -> None:
        """Stop holding ``owner``'s rows."""
        self.buffers.pop(owner, None)
