"""Shared helpers of the distributed tests."""

from __future__ import annotations

from typing import Any

import torch

from conduit.distributed import RayExperienceDataPlane, ShardResources
from conduit.spec import ExperienceSpec
from tests.conftest import make_rows

SPEC = ExperienceSpec.of(obs=((4,), torch.float32), id=((), torch.int64), done=((), torch.bool))
SMALL = ShardResources(num_cpus=0.25)


def make_plane(cluster: Any, **kwargs: Any) -> RayExperienceDataPlane:
    """A plane on the test cluster with small shards."""
    kwargs.setdefault("num_shards", 3)
    kwargs.setdefault("timeout", 60.0)
    return RayExperienceDataPlane(spec=SPEC, address=cluster.address, shard_resources=SMALL,
                                  **kwargs)


def rows(n: int, start: int = 0) -> dict[str, torch.Tensor]:
    """``n`` rows whose ``id`` column counts from ``start`` (every column is a function of it)."""
    return make_rows(SPEC, n, start=start)


def check_rows(batch: dict[str, torch.Tensor]) -> None:
    """Every delivered row is intact: its columns are the function of its id they were
    written as."""
    ids = batch["id"]
    assert torch.equal(batch["obs"], ids[:, None].float().expand(-1, 4))
    assert torch.equal(batch["done"], ids % 7 == 6)


def kill(plane: RayExperienceDataPlane, shard: int) -> None:
    """``ray.kill`` a shard's actor and wait until Ray reports it dead (the kill is
    asynchronous)."""
    import ray
    actor = plane._shards.actors[shard]
    ray.kill(actor, no_restart=True)
    for _ in range(200):
        try:
            ray.get(actor.ping.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return
    raise AssertionError(f"shard {shard} still answers after ray.kill")
