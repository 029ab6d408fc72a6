"""Helpers the plane tests share."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from conduit import ExperienceDataPlane, ExperienceSpec, Schedule
from tests.conftest import make_rows


def stored_ids(plane: ExperienceDataPlane) -> list[int]:
    """The ``id`` of every row the plane's buffer holds, sorted."""
    idx = torch.arange(len(plane.buffer), dtype=torch.int64)
    return sorted(plane.buffer.store.get(idx)["id"].tolist())


def refusing_ingestion(plane: ExperienceDataPlane) -> None:
    """Register an ingestion operator that refuses rollouts with a negative id."""

    @plane.register_ingestion()
    def ingest(actor_in, exp_out) -> None:  # type: ignore[no-untyped-def]
        data = actor_in.read()
        if (data["id"] < 0).any():
            raise ValueError("bad rollout")
        exp_out.write(data)


@contextmanager
def frozen_elsewhere(plane: ExperienceDataPlane, *, hold_s: float = 10.0) -> Iterator[None]:
    """Hold ``plane.frozen(flush=False)`` on another thread (what a checkpoint taken there
    does) for the block; the thread lets go when the block ends, at the latest after
    ``hold_s`` seconds."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with plane.frozen(flush=False):
            held.set()
            release.wait(hold_s)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5)
        yield
    finally:
        release.set()
        holder.join(hold_s)


def filled_plane(spec: ExperienceSpec, schedule: Schedule, **kw: Any) -> ExperienceDataPlane:
    """A plane of capacity 64 and batch 8 (seed 5) holding 40 rows of ``make_rows`` (ids 100
    to 139), ingested."""
    plane = ExperienceDataPlane(spec=spec, capacity=64, batch_size=8, schedule=schedule,
                                seed=5, **kw)
    plane.push(make_rows(spec, 40, start=100))
    plane.flush()
    return plane
