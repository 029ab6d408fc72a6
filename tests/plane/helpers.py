"""Helpers the plane tests share."""

from __future__ import annotations

import torch

from conduit import ExperienceDataPlane


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
