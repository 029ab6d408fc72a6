"""Pure functions that turn per-shard fill levels and priority masses into a global draw.

No Ray here: the front calls them with numbers it keeps, so they are tested on their own.

* Uniform replay over the union of shards: the batch's rows are split over shards by a
  multinomial draw with probabilities proportional to the rows each primary holds, then each
  shard draws its share uniformly. Every row is then drawn with probability ``1 / N``.
* Prioritized replay: the split uses each primary's priority mass ``S_k``; within a shard the
  sum tree draws row ``i`` with ``p_i / S_k``. Overall ``P(i) = p_i / sum_k S_k``, exactly the
  single-buffer distribution. Importance weights are global: ``(N P(i))^-beta`` normalised by
  the largest over all shards, which is ``(p_i / p_min)^-beta`` with ``p_min`` the smallest
  priority held anywhere.
* On-policy: one permutation of all the iteration's rows per ``(seed, iteration, epoch)``, split
  into ``M`` mini-batches, each split into ``W`` disjoint rank shares.
* Where the bytes come from (the §5.1 local/remote mixture): what is drawn is fixed above; a
  draw from a shard's rows is then served by the copy on the learner's node when that copy is
  current, else by the shard's primary (:func:`nearest_copy`). Every current copy is the same
  ring with the same priorities, so the distribution does not depend on the copy read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from conduit.errors import PriorityError
from conduit.storage.row_ledger import priority_input

ROW_BITS = 40
"""A delivered ``_index`` is ``owner << ROW_BITS | row_id``: shard and place in its order."""


def encode(owner: int, row_ids: np.ndarray) -> np.ndarray:
    """Global indices of ``owner``'s rows."""
    return (np.int64(owner) << ROW_BITS) | np.asarray(row_ids, dtype=np.int64)


def decode(indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(owners, row ids)`` of global indices."""
    idx = np.asarray(indices, dtype=np.int64)
    return idx >> ROW_BITS, idx & ((np.int64(1) << ROW_BITS) - 1)


def split_draw(rng: np.random.Generator, weights: np.ndarray, batch_size: int) -> np.ndarray:
    """Rows of a batch each shard draws: multinomial with probabilities ``weights / sum``.

    Raises:
        ValueError: No weight is positive.
    """
    w = np.asarray(weights, dtype=np.float64)
    total = w.sum()
    if not total > 0:
        raise ValueError("no shard holds a row that can be drawn")
    return rng.multinomial(batch_size, w / total)


def global_weights(priorities: np.ndarray, min_leaf: float, beta: float) -> np.ndarray:
    """Importance weights of drawn rows over the whole sharded buffer, max-normalised."""
    p = np.maximum(np.asarray(priorities, dtype=np.float64), 1e-300)
    return np.power(p / max(min_leaf, 1e-300), -beta).astype(np.float32)


def epoch_parts(total_rows: int, *, seed: int, iteration: int, epoch: int,
                num_minibatches: int) -> list[np.ndarray]:
    """Global row positions of each mini-batch of one epoch (a pure function of its args)."""
    rng = np.random.default_rng([seed, iteration, epoch])
    return list(np.array_split(rng.permutation(total_rows).astype(np.int64), num_minibatches))


def rank_share(part: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank ``rank``'s disjoint share of one mini-batch (sizes differ by at most one)."""
    return np.array_split(part, world_size)[rank]


def locate(positions: np.ndarray, sizes: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Global positions (shard 0's rows first, then shard 1's, ...) as ``owner -> (slots,
    where in the batch)``."""
    bounds = np.cumsum([0, *sizes])
    owner = np.searchsorted(bounds, positions, side="right") - 1
    out = {}
    for k in np.unique(owner):
        at = np.nonzero(owner == k)[0]
        out[int(k)] = (positions[at] - bounds[k], at)
    return out


def nearest_copy(owner: int, holders: list[int], nodes: list[str], node: str | None,
                 current: list[int]) -> int:
    """The shard a reader on ``node`` fetches ``owner``'s rows from.

    Args:
        owner: The shard whose rows are read (its primary).
        holders: Shards holding those rows, the primary first.
        nodes: The node each shard runs on.
        node: The reader's node (None: unknown, read the primary).
        current: Holders whose copy is current (equal to the primary's).

    Returns:
        The first current holder on ``node``, else ``owner``: a stale copy (a missed change or
        an unfinished restore) is never read, and the primary answers for it.
    """
    for h in holders:
        if nodes[h] == node and h in current:
            return h
    return owner


def priority_updates(indices: Any, priorities: Any, written: Sequence[int]
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(owners, row ids, priorities as float64)`` of a priority update, checked.

    Args:
        indices: A delivered batch's ``_index`` (owner and row id of each row).
        priorities: One value per index.
        written: The most rows each shard has written (every row id it ever delivered is
            below that).

    Raises:
        PriorityError: Indices or priorities that are not numbers (None, text); indices that
            are not a delivered ``_index`` of one of the shards (not integers, an owner
            outside them, or a row its shard has not written); complex, NaN, infinite or
            negative priorities; mismatched lengths.
    """
    num_shards = len(written)
    idx = priority_input(indices, "indices")
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise PriorityError(f"indices: must be a batch's integer _index, got {idx.dtype}")
    raw = priority_input(priorities, "priorities")
    if raw.is_complex():
        raise PriorityError(f"priorities: must be real numbers (|TD errors|), got {raw.dtype} "
                            f"values")
    pr = raw.to(torch.float64).numpy()
    if pr.size != idx.numel():
        raise PriorityError(f"priorities: {pr.size} values for {idx.numel()} indices")
    if not np.isfinite(pr).all() or (pr < 0).any():
        raise PriorityError("priorities: must be finite and >= 0 (pass |TD errors|)")
    owners, rows = decode(idx.numpy())
    if owners.size and (owners.min() < 0 or owners.max() >= num_shards):
        raise PriorityError(f"indices: name shards outside [0, {num_shards}); pass the _index "
                            f"of a batch this plane delivered")
    if owners.size:
        limit = np.asarray(written, dtype=np.int64)[owners]
        bad = np.flatnonzero(rows >= limit)
        if bad.size:
            i = int(bad[0])
            raise PriorityError(f"indices: {int(idx[i])} names row {int(rows[i])} of shard "
                                f"{int(owners[i])}, which has written {int(limit[i])} rows; "
                                f"pass the _index of a batch this plane delivered")
    return owners, rows, pr
