"""Executing a placement migration (Alg. 2): move a buffer's rows to a new placement, and
optionally a wider spec, while the plane is paused.

The decisions come from :mod:`conduit.placement.migration`: where to go (``M(x)`` of a
:class:`~conduit.placement.PlacementMap`) and the Eq. 3 transfer plan between the endpoints.
Rows keep their slots, so the ring cursor and every sampler's per-row state stay valid
(docs/design.md §5).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from conduit._checks import check_int
from conduit.errors import ConfigError, SpecError
from conduit.placement import (
    PlacementDecision,
    PlacementMap,
    Topology,
    plan_placement,
    rows_per_endpoint,
)
from conduit.plane.config import PlaneConfig
from conduit.plane.engine import PlaneEngine
from conduit.plane.flows import Staged
from conduit.plane.runtime import identity_delivery
from conduit.spec import Batch, ExperienceSpec
from conduit.storage import ExperienceBuffer, Placement, Store

PlacementArg = Placement | PlacementMap | Literal["auto"] | None


@dataclass(frozen=True)
class InitialPlacement:
    """Where a new plane's buffer starts, and what decided it.

    Attributes:
        placement: The placement (None: pageable CPU memory).
        decision: Alg. 1's decision, for ``placement="auto"``.
        placement_map: The map the plane follows as its spec grows, when given one.
    """

    placement: Placement | None
    decision: PlacementDecision | None = None
    placement_map: PlacementMap | None = None


def check_placement_arg(placement: Any, capacity: int) -> None:
    """Refuse a ``placement`` argument no plane of ``capacity`` rows takes (before its spec is
    known).

    Raises:
        ConfigError: ``placement`` is none of the accepted kinds (a
            :class:`~conduit.storage.Placement`, a :class:`~conduit.placement.PlacementMap`,
            ``"auto"`` or None), or a map solved for another capacity.
    """
    if placement is None or isinstance(placement, Placement):
        return
    if isinstance(placement, PlacementMap):
        if placement.capacity != capacity:
            raise ConfigError("placement", f"the PlacementMap was solved for "
                                           f"{placement.capacity:,} rows, the plane holds "
                                           f"{capacity:,}: its placements need not "
                                           f"fit; build it with capacity={capacity}")
        return
    if not (isinstance(placement, str) and placement == "auto"):
        raise ConfigError("placement", f"expected a Placement, a PlacementMap, 'auto' or None, "
                                       f"got {placement!r}")


def initial_placement(placement: PlacementArg, config: PlaneConfig) -> InitialPlacement:
    """Resolve a plane's ``placement`` argument.

    ``"auto"`` runs Alg. 1 over this machine's detected topology; a
    :class:`~conduit.placement.PlacementMap` gives ``M(x)`` for the spec's per-sample size.

    Raises:
        ConfigError: ``placement`` is none of the accepted kinds, or a map solved for another
            capacity.
        CapacityError: The map holds no placement for the spec's size.
    """
    check_placement_arg(placement, config.capacity)
    if placement is None or isinstance(placement, Placement):
        return InitialPlacement(placement)
    if isinstance(placement, PlacementMap):
        return InitialPlacement(placement.lookup(config.spec.bytes_per_sample),
                                placement_map=placement)
    dev = config.learner_device
    learner = "cuda:0" if dev.type == "cuda" and dev.index is None else str(dev)
    decision = plan_placement(capacity=config.capacity, spec=config.spec, actor_device="cpu",
                              learner_device=learner, topology=Topology.detect(cluster=False))
    return InitialPlacement(decision.placement, decision=decision)


def check_growth(old: ExperienceSpec, new: ExperienceSpec) -> None:
    """Check that ``new`` only widens ``old``: same fields and dtypes, shapes that grow.

    Raises:
        SpecError: A field is dropped, changes dtype or rank, or narrows.
    """
    for name, fs in old.fields.items():
        if name not in new.fields:
            raise SpecError(name, "a migration may widen fields but not drop them")
        nf = new.fields[name]
        if nf.dtype != fs.dtype:
            raise SpecError(name, f"dtype changes from {fs.dtype} to {nf.dtype}; a migration "
                                  f"only widens shapes")
        if len(nf.shape) != len(fs.shape) or any(a < b for a, b in zip(nf.shape, fs.shape)):
            raise SpecError(name, f"shape {fs.shape} -> {nf.shape} is not a growth")


def pad_to(data: Batch, spec: ExperienceSpec) -> Batch:
    """``data`` laid out for ``spec``: narrower fields zero-padded, new fields zero."""
    n = next(iter(data.values())).shape[0]
    out: Batch = {}
    for name, fs in spec.fields.items():
        v = data.get(name)
        if v is None:
            out[name] = torch.zeros((n, *fs.shape), dtype=fs.dtype)
        elif tuple(v.shape[1:]) != fs.shape:
            pad = torch.zeros((n, *fs.shape), dtype=fs.dtype, device=v.device)
            pad[(slice(None), *(slice(0, s) for s in v.shape[1:]))] = v
            out[name] = pad
        else:
            out[name] = v
    return out


def _device_ranges(store: Store) -> list[tuple[str, int, int]]:
    """``(device label, first slot, end slot)`` of each part of a store."""
    bounds = getattr(store, "bounds", None)
    if bounds is None:
        return [(str(store.placement.devices[0]), 0, store.capacity)]
    return [(f"{d}[{k}]", int(bounds[k]), int(bounds[k + 1]))
            for k, d in enumerate(store.placement.devices)]


def _range_flows(old: Store, new: Store, start: int, n: int) -> list[tuple[str, str, int]]:
    out = []
    for a, a0, a1 in _device_ranges(old):
        for b, b0, b1 in _device_ranges(new):
            lo, hi = max(a0, b0, start), min(a1, b1, start + n)
            if lo < hi:
                out.append((a, b, hi - lo))
    return out


def grow_target(pmap: PlacementMap | None, current: Placement, old: ExperienceSpec,
                new: ExperienceSpec) -> Placement:
    """Alg. 2's decision for a spec growth: ``M(x)`` of the new per-sample size.

    Raises:
        ConfigError: There is no map to follow.
        SpecError: ``new`` is not a growth of ``old``.
        CapacityError: No placement of the map holds the new size.
    """
    if pmap is None:
        raise ConfigError("placement", "grow() follows a PlacementMap; build the plane with "
                                       "placement=PlacementMap.build(...), or call migrate() "
                                       "with an explicit placement")
    check_growth(old, new)
    target = pmap.lookup(new.bytes_per_sample)
    return current if target == current else target


def migrate(engine: PlaneEngine, placement: Placement | None, *,
            spec: ExperienceSpec | None, chunk_rows: int, placement_map: PlacementMap | None,
            widen_pending: bool = True) -> dict[str, Any]:
    """Pause ``engine``, move its flow's buffer (see :func:`move_buffer`), and resume.

    The buffer, its spec and placement are read once the plane is paused, which one thread
    at a time holds (:meth:`~conduit.plane.engine.PlaneEngine.paused`): migrations on several
    threads run one after the other, each from the buffer the one before left.

    Rollout units queued before the growth (acknowledged by ``push`` against the old spec)
    are widened with the rows, fields the growth adds zero-filled, so nothing acknowledged is
    refused by the new spec; with ``widen_pending`` False (units are checked against a
    rollout spec, or an ingestion operator reshapes them) they are left as pushed. Training
    batches staged before the growth are widened as well (:func:`widen_staged`).

    Args:
        engine: The plane's engine.
        placement: Where the rows go; None: where ``placement_map`` puts the new spec's
            per-sample size (:func:`grow_target`).
        spec: The new spec; None keeps the buffer's.
        chunk_rows: Rows copied per step.
        placement_map: The plane's map (for the Eq. 3 plan, and the target when
            ``placement`` is None).
        widen_pending: Widen the queued rollout units too.

    Raises:
        SpecError: ``spec`` is not a growth of the buffer's spec.
        ConfigError: ``placement`` is None and there is no map to follow.
        CapacityError: The new placement cannot hold the buffer.
        OperatorError: The plane could not be paused within its timeout (another thread
            held it paused, or an operator invocation did not return); nothing changes.
    """
    if spec is not None:  # refused before pausing; checked again once paused
        check_growth(engine.flow.spec, spec)
    with engine.paused():
        old = engine.flow.buffer
        old_spec = old.spec
        spec = old_spec if spec is None else spec
        check_growth(old_spec, spec)
        if placement is None:
            placement = grow_target(placement_map, old.placement, old_spec, spec)
        new, report = move_buffer(old, placement=placement, spec=spec,
                                  chunk_rows=chunk_rows, placement_map=placement_map)
        with engine.signals.lock:
            engine.flow.buffer = new
            if old_spec != spec:
                # (the delivery operator's own batches may not carry the fields it adds)
                add = engine.runtime.deliver_fn is identity_delivery
                for staged in engine.flow.staged:  # prefetched before the growth
                    staged.batch = widen_staged(staged, old_spec, spec, add_fields=add)
                if widen_pending:
                    for unit in engine.flow.pending:  # pushed before the growth, not ingested
                        unit.data = widen_batch(unit.data, old_spec, spec, add_fields=True)
    return report


def widen_batch(batch: Batch, old: ExperienceSpec, new: ExperienceSpec, *,
                add_fields: bool) -> Batch:
    """``batch`` laid out for ``new``: every field that still has ``old``'s shape
    zero-padded to ``new``'s and, with ``add_fields``, the fields ``new`` adds zero-filled
    (as :func:`pad_to` lays out a buffer's rows); other keys (``_index``, fields a delivery
    operator made) are kept as they are.

    A new dict with new tensors for what changed: the tensors of ``batch`` are never written,
    so a batch someone holds stays as it is. ``batch`` itself when nothing changes, or when
    it holds none of ``old``'s fields (a delivery operator's own layout: its row count is not
    known).
    """
    like = next((v for k, v in batch.items() if k in old.fields), None)
    if like is None:
        return batch
    changed: Batch = {}
    for name, fs in new.fields.items():
        v = batch.get(name)
        if name in old.fields:
            was = old.fields[name].shape
            if v is None or fs.shape == was or tuple(v.shape[1:]) != was:
                continue
            pad = torch.zeros((v.shape[0], *fs.shape), dtype=fs.dtype, device=v.device)
            pad[(slice(None), *(slice(0, s) for s in was))] = v
            changed[name] = pad
        elif add_fields and v is None:
            changed[name] = torch.zeros((like.shape[0], *fs.shape), dtype=fs.dtype,
                                        device=like.device)
    return {**batch, **changed} if changed else batch


def widen_staged(staged: Staged, old: ExperienceSpec, new: ExperienceSpec, *,
                 add_fields: bool) -> Batch:
    """A staged training batch widened for ``new`` (:func:`widen_batch`): the learner may be
    handed it, so its tensors are not written, and device tensors are read once the copy that
    made them is done (its event); the new ones are complete when this returns, so the
    learner's stream waits for nothing but the staged event, which still covers the tensors
    kept as they were."""
    batch = staged.batch
    if staged.event is not None:
        staged.event.synchronize()  # the copy stream's writes, before they are read here
    out = widen_batch(batch, old, new, add_fields=add_fields)
    if out is not batch:
        for dev in {t.device for k, t in out.items() if t.is_cuda and batch.get(k) is not t}:
            torch.cuda.current_stream(dev).synchronize()  # the pads and zeros are written
    return out


def move_buffer(old: ExperienceBuffer, *, placement: Placement, spec: ExperienceSpec,
                chunk_rows: int, placement_map: PlacementMap | None = None
                ) -> tuple[ExperienceBuffer, dict[str, Any]]:
    """Copy every filled row of ``old`` into a new buffer on ``placement`` with ``spec``.

    The new buffer shares ``old``'s sampler and writer state; rows keep their slots.

    Args:
        old: The buffer to move (its operators must be paused).
        placement: Where the rows go.
        spec: The new spec (a growth of ``old.spec``; see :func:`check_growth`).
        chunk_rows: Rows copied per step (bounds the transient memory).
        placement_map: When given and both placements are regions of it, the Eq. 3 plan
            between them is part of the report.

    Returns:
        The new buffer and a report: ``rows``, ``bytes``, ``seconds``, ``from`` / ``to``
        placements, ``migrated`` (the placement changed), ``flows_rows`` (rows per
        ``"src->dst"`` device pair as moved) and, with a map, ``plan`` (Eq. 3: bytes per
        endpoint pair and the predicted makespan).

    Raises:
        ConfigError: ``chunk_rows`` is not a positive integer.
        CapacityError: The new placement cannot hold the buffer.
    """
    chunk_rows = check_int("chunk_rows", chunk_rows, minimum=1)
    t0 = time.perf_counter()
    # (its own sampler until it adopts the old buffer's, with the rows' priorities and such)
    new = ExperienceBuffer(spec=spec, capacity=old.capacity, placement=placement)
    rows = len(old)
    to_host = torch.device("cpu") if placement.primary_device.type == "cpu" else None
    flows: dict[str, int] = {}
    for start in range(0, rows, chunk_rows):
        idx = torch.arange(start, min(rows, start + chunk_rows), dtype=torch.int64)
        new.store.set_range(start, pad_to(old.store.get(idx, device=to_host), spec))
        for a, b, n in _range_flows(old.store, new.store, start, len(idx)):
            flows[f"{a}->{b}"] = flows.get(f"{a}->{b}", 0) + n
    new.adopt(old)
    report: dict[str, Any] = {
        "rows": rows, "bytes": rows * spec.bytes_per_sample,
        "seconds": time.perf_counter() - t0, "from": old.placement.to_dict(),
        "to": placement.to_dict(), "migrated": placement != old.placement,
        "flows_rows": flows}
    if placement_map is not None and report["migrated"] and rows:
        volumes = {e: r * old.spec.bytes_per_sample for e, r in
                   rows_per_endpoint(old.placement, rows, placement_map.topology).items()}
        plan = placement_map.plan_between(old.placement, placement, volumes)
        report["plan"] = {"flows_bytes": {f"{s}->{d}": f for s, d, f in plan.transfers()},
                          "makespan_s": plan.makespan_s}
    return new, report
