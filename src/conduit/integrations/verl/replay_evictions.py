"""Eviction of failed and malformed groups from TransferQueue, and the metrics that count
them, each reported once."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import transfer_queue as tq


class GroupEvictor:
    """Evicts a verl replay buffer's failed and malformed groups (asking ``refill_fn`` for
    replacements on ``train``) and keeps the eviction counts no returned metrics carried yet.

    Args:
        refill_fn: verl's refill callback (None: no replacements are asked for).
        log: The logger each malformed group's eviction is logged to.
    """

    def __init__(self, refill_fn: Callable[[int], int] | None, log: logging.Logger) -> None:
        self.refill_fn, self._log = refill_fn, log
        self.unreported: dict[str, int] = {}  # evictions no returned metrics counted yet
        self.warned = False  # a malformed group was evicted (and warned about)

    def finished(self, partition_id: str, metrics: dict,
                 listing: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, int]:
        """Finished groups (uid -> the step that issued them); failed ones are evicted."""
        if listing is None:
            listing = tq.kv_list(partition_id).get(partition_id, {})
        finished, failed = {}, []
        for key, tag in listing.items():
            if tag.get("is_prompt", False):
                if tag.get("status") == "finished":
                    finished[key] = int(tag.get("global_steps", 0))
                elif tag.get("status") == "failure":
                    failed.append(key)
        if failed:
            doomed = set(failed)
            tq.kv_clear(keys=[k for k in listing if k.split("_")[0] in doomed],
                        partition_id=partition_id)
            name = f"{'training' if partition_id == 'train' else 'validation'}" \
                   f"/rollout_failure/evicted_samples"
            metrics[name] = metrics.get(name, 0) + len(failed)
            if self.refill_fn is not None and partition_id == "train":
                self.refill_fn(len(failed))
        return finished

    def evict_malformed(self, bad: Mapping[str, tuple[str, str]], partition_id: str,
                        metrics: dict) -> None:
        """Evict the ``bad`` groups as failed ones are: clear their keys, count them in
        ``metrics``, ask ``refill_fn`` for as many on ``train``, and warn about the first
        group this buffer evicts (each is logged)."""
        listing = tq.kv_list(partition_id).get(partition_id, {})  # what landed meanwhile too
        tq.kv_clear(keys=[k for k in listing if k.split("_")[0] in bad],
                    partition_id=partition_id)
        kind = "training" if partition_id == "train" else "validation"
        merge_counts(metrics, {f"{kind}/conduit/evicted_malformed": len(bad)})
        if self.refill_fn is not None and partition_id == "train":
            self.refill_fn(len(bad))
        for field, message in bad.values():
            self._log.info("evicted a malformed group from partition %r (field %r): %s",
                           partition_id, field, message)
        if not self.warned:
            self.warned = True
            field, message = next(iter(bad.values()))
            warnings.warn(f"ConduitReplayBuffer evicted a malformed group from partition "
                          f"{partition_id!r} (field {field!r}): {message}. sample goes on "
                          f"with other groups; later evictions are counted in the metrics "
                          f"({kind}/conduit/evicted_malformed) and logged, not warned about",
                          RuntimeWarning, stacklevel=4)

    def defer(self, metrics: Mapping[str, int]) -> None:
        """Keep eviction counts no returned metrics carried, for the next metrics."""
        merge_counts(self.unreported, metrics)

    def take_unreported(self) -> dict[str, int]:
        """Evictions since the last returned metrics (reported once)."""
        out, self.unreported = self.unreported, {}
        return out


def merge_counts(into: dict, counts: Mapping[str, int]) -> None:
    """Add ``counts`` to ``into``, name by name."""
    for name, value in counts.items():
        into[name] = into.get(name, 0) + value


__all__ = ["GroupEvictor", "merge_counts"]
