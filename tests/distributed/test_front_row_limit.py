"""Off-policy, the sharded front's ingestion joins at most a shard's ring of rows in one
invocation: ``g_ing`` units whose joined write would not fit it were refused whole by the
shard, and every acknowledged unit of the invocation was lost (a feasible schedule lost data
that ``g_ing = 1`` stored). Both tests fail on the code before the bound."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from conduit.distributed.operators import FrontIngestion, QueuedUnit
from conduit.plane.ports import ActorIn, BufferOut
from conduit.scheduling import Schedule
from tests.distributed.helpers import make_plane, rows


def test_an_invocation_takes_no_more_units_than_fit_the_row_limit():
    writes: list[list[int]] = []

    def store(batch: Mapping[str, Any], unit: QueuedUnit, deadline: float) -> int:
        if len(batch["id"]) > 5:  # what a shard's ring of 5 rows refuses
            raise AssertionError(f"a write of {len(batch['id'])} rows")
        writes.append(batch["id"].tolist())
        return len(batch["id"])

    def op(actor_in: ActorIn, exp_out: BufferOut) -> None:
        exp_out.write(actor_in.read())  # the units joined, as the default operator writes

    ing = FrontIngestion(store=store, timeout=5.0)
    ing.fn, ing.registered, ing.row_limit = op, True, 5
    ing.set_schedule(Schedule(0, 3, 0, 1))
    deadline = time.monotonic() + 5
    for start in (0, 2, 4, 6, 8, 10):
        ing.submit(QueuedUnit({"id": torch.arange(start, start + 2)}, 2, "a", None), deadline)
    ing.flush(deadline)
    assert writes == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert ing.counters["lost_units"] == 0
    ing.close()


@pytest.mark.ray
@pytest.mark.parametrize("overlap", [0, 1])
def test_units_joined_past_a_shards_ring_are_all_stored(cluster, overlap):
    """capacity 24 over 3 shards (rings of 8 rows), g_ing = 4 units of 4 rows pushed on one
    node: each invocation now holds two units."""
    plane = make_plane(cluster, capacity=24, batch_size=4,
                       schedule=Schedule(overlap, 4, 0, 1))
    node = plane._shards.nodes[0]
    try:
        for k in range(8):
            plane.push(rows(4, 4 * k), node=node)
        plane.flush()
        stats = plane.stats()
        assert stats["ingestion"]["lost_units"] == 0 and stats["lost_rows"] == 0
        assert plane.counters["rows"] == 32
        # one node's pushes go to its shard: its ring holds the newest 8 rows
        assert sorted(s["rows"] for s in stats["shards"]) == [0, 0, 8]
    finally:
        plane.close()
