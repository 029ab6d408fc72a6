"""The pure draw functions of the sharded plane (no Ray)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from conduit.distributed import sampling


def test_indices_round_trip_owner_and_row_id():
    rows = np.array([0, 5, (1 << 39) + 3], dtype=np.int64)
    owners, back = sampling.decode(sampling.encode(7, rows))
    assert (owners == 7).all() and (back == rows).all()


def test_split_draw_follows_the_weights():
    rng = np.random.default_rng(0)
    weights = np.array([100.0, 300.0, 0.0, 600.0])
    counts = sum(sampling.split_draw(rng, weights, 64) for _ in range(500))
    assert counts[2] == 0 and counts.sum() == 64 * 500
    expected = weights[[0, 1, 3]] / weights.sum() * counts.sum()
    assert stats.chisquare(counts[[0, 1, 3]], expected).pvalue > 1e-3


def test_split_draw_refuses_when_nothing_can_be_drawn():
    with pytest.raises(ValueError, match="no shard"):
        sampling.split_draw(np.random.default_rng(0), np.zeros(3), 4)


def test_global_weights_are_single_buffer_weights():
    # One buffer holding all rows: w = (N P(i))^-beta / max_j (N P(j))^-beta.
    p = np.array([0.5, 2.0, 1.0, 4.0])
    beta = 0.4
    n, total = p.size, p.sum()
    reference = (n * p / total) ** -beta / (n * p.min() / total) ** -beta
    got = sampling.global_weights(p, p.min(), beta)
    np.testing.assert_allclose(got, reference, rtol=1e-6)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_epoch_parts_and_rank_shares_cover_every_row_once(world_size):
    sizes = [7, 0, 12, 5]
    total = sum(sizes)
    parts = sampling.epoch_parts(total, seed=3, iteration=1, epoch=0, num_minibatches=4)
    seen = []
    for part in parts:
        shares = [sampling.rank_share(part, r, world_size) for r in range(world_size)]
        assert sorted(np.concatenate(shares).tolist()) == sorted(part.tolist())
        for share in shares:
            for owner, (slots, at) in sampling.locate(share, sizes).items():
                assert sizes[owner] > 0 and (slots < sizes[owner]).all()
                seen += [(owner, int(s)) for s in slots]
                assert len(at) == len(slots)
    assert sorted(seen) == sorted((k, s) for k, n in enumerate(sizes) for s in range(n))


def test_epoch_parts_are_a_pure_function_of_seed_iteration_epoch():
    a = sampling.epoch_parts(30, seed=1, iteration=2, epoch=1, num_minibatches=3)
    b = sampling.epoch_parts(30, seed=1, iteration=2, epoch=1, num_minibatches=3)
    c = sampling.epoch_parts(30, seed=1, iteration=2, epoch=0, num_minibatches=3)
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    assert any((x != y).any() for x, y in zip(a, c, strict=True))


def test_a_reader_takes_the_current_copy_on_its_node_else_the_primary():
    nodes = ["a", "b", "c", "b"]  # shards 1 and 3 run on node b
    holders = [0, 1, 3]  # shard 0's rows: its primary, then replicas on shards 1 and 3
    assert sampling.nearest_copy(0, holders, nodes, "a", [0, 1, 3]) == 0  # primary is local
    assert sampling.nearest_copy(0, holders, nodes, "b", [0, 1, 3]) == 1  # first local copy
    assert sampling.nearest_copy(0, holders, nodes, "b", [0, 3]) == 3  # shard 1's is stale
    assert sampling.nearest_copy(0, holders, nodes, "b", [0]) == 0  # no current local copy
    assert sampling.nearest_copy(0, holders, nodes, "c", [0, 1, 3]) == 0  # none on node c
    assert sampling.nearest_copy(0, holders, nodes, None, [0, 1, 3]) == 0
    assert sampling.nearest_copy(0, holders, nodes, "b", []) == 0  # restoring: the primary
