"""Proportional prioritized replay over a compiled sum tree."""

from __future__ import annotations

import math
import numbers
from typing import Any, ClassVar

import numpy as np
import torch

from conduit.errors import ConfigError, PriorityError, StateError
from conduit.spec import Batch
from conduit.storage.samplers.base import SampleInfo, Sampler, need_rows
from conduit.storage.state import JSON, StateDict, entry, number
from conduit.storage.sum_tree import SumTree, tree_bytes

_F64_MAX = float(np.finfo(np.float64).max)


def _finite(name: str, value: Any) -> float:
    """``value`` as a float, or ConfigError naming ``name`` when it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value):
        raise ConfigError(name, f"must be a finite number, got {value!r}")
    return float(value)


def _host(values: Any) -> np.ndarray:
    """A flat numpy view of a CPU tensor (a copy for other devices or other array types; a
    float64 copy for floating dtypes numpy lacks, such as bfloat16)."""
    if isinstance(values, torch.Tensor):
        if values.dim() == 1 and values.device.type == "cpu" and not values.requires_grad:
            try:
                return values.numpy()
            except TypeError:  # no numpy dtype (bfloat16, float8, complex32)
                pass
        values = values.detach()
        if values.device.type != "cpu":
            values = values.cpu()
        if values.is_floating_point() and values.dtype not in _NUMPY_FLOATS:
            values = values.to(torch.float64)
        elif values.is_complex() and values.dtype not in _NUMPY_COMPLEX:
            values = values.to(torch.complex128)  # refused as not real by the callers
        return values.reshape(-1).numpy()
    return np.asarray(values).reshape(-1)


_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)
_NUMPY_COMPLEX = (torch.complex64, torch.complex128)


def _leaf(priority: float, alpha: float, eps: float) -> float:
    """The leaf of a raw priority, ``(priority + eps) ** alpha`` (inf where it overflows)."""
    with np.errstate(over="ignore"):
        return float(np.power(np.float64(priority) + eps, alpha))


class PrioritizedSampler(Sampler):
    """Proportional prioritized replay (Schaul et al., 2016) over a vectorized sum tree.

    New rows get the largest priority seen so far. A batch is drawn by stratified prefix-sum
    search; importance weights ``(N·P(i))^-beta`` are normalized by their maximum over the
    buffer.

    Args:
        alpha: Priority exponent (0 = uniform).
        beta: Importance-weight exponent.
        eps: Added to every priority so no row becomes unreachable.
        seed: Generator seed.

    Raises:
        ConfigError: ``alpha``, ``beta`` or ``eps`` is not a finite number (``alpha`` and
            ``beta`` >= 0, ``eps`` > 0), or ``eps ** alpha`` leaves float range, so that no
            row could be drawn.
    """

    invalidates_prefetch: ClassVar[bool] = True

    def __init__(self, *, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6,
                 seed: int = 0) -> None:
        super().__init__(seed=seed)
        alpha, beta, eps = _finite("alpha", alpha), _finite("beta", beta), _finite("eps", eps)
        if not alpha >= 0:
            raise ConfigError("alpha", f"must be >= 0, got {alpha}")
        if not beta >= 0:
            raise ConfigError("beta", f"must be >= 0, got {beta}")
        if not eps > 0:
            raise ConfigError("eps", f"must be > 0, got {eps}")
        try:
            smallest, first = eps ** alpha, (1 + eps) ** alpha
        except OverflowError:
            smallest = first = math.inf
        if not smallest > 0:
            raise ConfigError("alpha", f"eps ** alpha = {eps:g} ** {alpha:g} underflows to 0, "
                                       f"so no row could ever be drawn; lower alpha or raise "
                                       f"eps")
        if not math.isfinite(first):
            raise ConfigError("alpha", f"(1 + eps) ** alpha = {1 + eps:g} ** {alpha:g} "
                                       f"overflows, so every new row's priority would be "
                                       f"infinite; lower alpha or eps")
        self.alpha, self.beta, self.eps = alpha, beta, eps
        self.max_priority = 1.0
        self._tree: SumTree | None = None

    def bind(self, capacity: int) -> None:
        """Allocate the tree (kept when already bound to this capacity: the buffer then resets
        it)."""
        if self._tree is not None and self.capacity == capacity:
            return
        super().bind(capacity)
        self._tree = SumTree(capacity=capacity)

    def bind_bytes(self, capacity: int) -> int:
        """The sum tree (:func:`~conduit.storage.sum_tree.tree_bytes`): a 64-byte line of
        four sums and four minima per inner node of a 4-ary tree over at least ``capacity``
        leaves."""
        return tree_bytes(capacity)

    @property
    def tree(self) -> SumTree:
        """The sum tree (after :meth:`bind`)."""
        if self._tree is None:
            raise ConfigError("sampler", "PrioritizedSampler used before bind(capacity)")
        return self._tree

    def on_write(self, indices: torch.Tensor, batch: Batch, *, size: int) -> None:
        """New rows get the maximum priority seen so far."""
        idx = indices.numpy()
        self.tree.set(idx, np.full(idx.shape, (self.max_priority + self.eps) ** self.alpha))

    def sample(self, size: int, batch_size: int) -> SampleInfo:
        """Stratified proportional draw with importance weights."""
        if size < 1 or batch_size < 1:
            need_rows(size, batch_size, "a prioritized batch")
        tree = self.tree
        if not tree.total > 0:
            raise PriorityError("all priorities are zero; nothing can be sampled")
        idx, w = tree.stratified_draw(self._rng.random(batch_size), size=size, beta=self.beta)
        return SampleInfo(torch.from_numpy(idx), torch.from_numpy(w))

    def update_priorities(self, indices: torch.Tensor, priorities: torch.Tensor) -> None:
        """Set new priorities for ``indices``.

        Raises:
            PriorityError: Indices that are not integers, or not slots holding a row (never
                written since the sampler was bound or reset); priorities that are not real
                numbers (complex, None, text), NaN, infinite or negative; mismatched lengths.
                Nothing is set then.
        """
        raw = _host(indices)
        if raw.dtype.kind not in "iu":
            raise PriorityError(f"indices: must be integer slots (a batch's _index), got "
                                f"{raw.dtype} values")
        idx = np.ascontiguousarray(raw, dtype=np.int64)
        pr = _host(priorities)
        if pr.dtype.kind not in "biuf":
            raise PriorityError(f"priorities: must be real numbers (|TD errors|), got "
                                f"{pr.dtype} values")
        pr = np.ascontiguousarray(pr, dtype=np.float64)
        if idx.shape != pr.shape:
            raise PriorityError(f"priorities: {pr.size} values for {idx.size} indices")
        if not pr.size:
            return
        problem, pmax = self.tree.set_priorities(idx, pr, alpha=self.alpha, eps=self.eps,
                                                 bound=self.leaf_bound())
        if problem == "not finite":
            raise PriorityError("priorities: contain NaN or infinity; pass finite |TD errors|")
        if problem == "negative":
            raise PriorityError("priorities: contain negative values; pass |TD error|")
        if problem == "index":
            raise PriorityError(f"indices: must lie in [0, {self.capacity}), got "
                                f"[{idx.min()}, {idx.max()}]")
        if problem == "unset":
            raise PriorityError("indices: name slots that hold no row (never written since the "
                                "sampler was bound or reset); update only slots a batch "
                                "delivered")
        if problem == "too large":
            raise PriorityError(f"priorities: up to {pr.max():.3g}, too large next to the "
                                f"smallest possible priority (eps={self.eps:g}): the sum "
                                f"over the buffer or the importance weights would leave float "
                                f"range; rescale them (for example clip |TD errors|)")
        self.max_priority = max(self.max_priority, pmax)

    def leaf_bound(self, capacity: int | None = None) -> float:
        """The largest leaf, ``(priority + eps) ** alpha``, the tree accepts: its sum over
        ``capacity`` rows (default: the bound buffer's) stays finite, and the smallest
        importance weight, ``(min_leaf / leaf) ** beta`` with ``min_leaf = eps ** alpha``,
        stays above 1e-30."""
        rows = self.capacity if capacity is None else capacity
        bound = _F64_MAX / (4 * max(rows, 1))
        if self.beta > 0:  # in log10: 1e30 ** (1 / beta) alone may leave float range
            exponent = self.alpha * math.log10(self.eps) + 30 / self.beta
            if exponent < 308:
                bound = min(bound, 10.0 ** exponent)
        return bound

    def priorities(self, indices: torch.Tensor) -> torch.Tensor:
        """Current (exponentiated) priorities of ``indices`` (0 for a slot holding no row).

        Raises:
            PriorityError: Indices that are not integer slots in ``[0, capacity)``.
        """
        raw = _host(indices)
        if raw.dtype.kind not in "iu":
            raise PriorityError(f"indices: must be integer slots (a batch's _index), got "
                                f"{raw.dtype} values")
        if raw.size and (raw.min() < 0 or raw.max() >= self.capacity):
            raise PriorityError(f"indices: must lie in [0, {self.capacity}), got "
                                f"[{raw.min()}, {raw.max()}]")
        shape = tuple(indices.shape) if isinstance(indices, torch.Tensor) else raw.shape
        return torch.from_numpy(self.tree.get(raw).reshape(shape))

    def reset(self) -> None:
        """Clear every priority."""
        self.tree.clear()
        self.max_priority = 1.0

    def config(self) -> dict[str, JSON]:
        """Constructor arguments."""
        return {**super().config(), "alpha": self.alpha, "beta": self.beta, "eps": self.eps}

    def state_dict(self) -> StateDict:
        """Generator, tree leaves and max priority."""
        return {**super().state_dict(), "tree": self.tree.state_dict(),
                "max_priority": self.max_priority}

    def load_state_dict(self, state: StateDict) -> None:
        """Restore from :meth:`state_dict`; a refused state changes nothing.

        Leaves and ``max_priority`` must keep the tree in float range: a set slot's leaf
        positive, and every leaf (the leaf of ``max_priority`` too) small enough that their
        sum over the capacity stays finite. The importance-weight part of :meth:`leaf_bound`
        is not applied: it depends on ``beta``, which is not part of the state and may have
        changed since the priorities were set.

        Raises:
            StateError: A key is missing or a value is out of range (the key is named).
        """
        max_priority = number(state, "max_priority", "sampler")
        bound = max(_F64_MAX / (4 * max(self.capacity, 1)), _leaf(1.0, self.alpha, self.eps))
        if not _leaf(max_priority, self.alpha, self.eps) <= bound:
            raise StateError("sampler.max_priority", f"{max_priority:.6g} gives new rows a "
                                                     f"priority above {bound:.6g}, the most "
                                                     f"the sum tree can hold")
        rng = self._checked_rng(state)
        # checks all, then loads
        self.tree.load_state_dict(entry(state, "tree", "sampler"), bound=bound)
        self._rng.bit_generator.state = rng
        self.max_priority = max_priority

    def check_rows(self, *, size: int, head: int) -> None:
        """Refuse priorities for slots at or after the writer's ``size``, which hold no row
        (they would be drawn), and slots before it without one (their rows would never be
        drawn, and a priority update for them would be refused).

        Raises:
            StateError: Such a slot (key ``sampler.tree.set``).
        """
        is_set = self.tree.is_set()
        beyond = np.flatnonzero(is_set[size:])
        if beyond.size:
            raise StateError("sampler.tree.set", f"slot {size + int(beyond[0])} has a "
                                                 f"priority but the writer holds rows in "
                                                 f"[0, {size}) only")
        unset = np.flatnonzero(~is_set[:size])
        if unset.size:
            raise StateError("sampler.tree.set", f"slot {int(unset[0])} holds a row but has "
                                                 f"no priority ({unset.size} such slots); "
                                                 f"its row would never be drawn")
