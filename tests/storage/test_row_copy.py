"""A buffer's rows copied while writes go on, made exact once writes stop."""

from __future__ import annotations

import pytest
import torch

from conduit.storage import ExperienceBuffer, Placement
from tests.conftest import make_rows


def assert_blocks_equal(a, b):
    assert [s for s, _ in a] == [s for s, _ in b]
    for (_, x), (_, y) in zip(a, b):
        assert x.keys() == y.keys()
        assert all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("placement", [Placement.pageable(), Placement.sharded(["cpu"] * 3)],
                         ids=lambda p: p.label())
@pytest.mark.parametrize(("before", "during"), [(10, 7), (30, 25), (40, 10), (40, 64), (5, 0)])
def test_finish_copy_equals_the_rows_after_concurrent_writes(small_spec, placement, before,
                                                             during):
    buf = ExperienceBuffer(spec=small_spec, capacity=40, placement=placement)
    buf.extend(make_rows(small_spec, before))
    copy = buf.copy_filled(chunk_bytes=3 * small_spec.bytes_per_sample)
    written = 0
    while written < during:  # writes between the copy and the pause
        n = min(9, during - written)
        buf.extend(make_rows(small_spec, n, start=1000 + written))
        written += n
    assert_blocks_equal(buf.finish_copy(copy), buf.filled_blocks())


def test_finish_copy_after_a_clear(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=16)
    buf.extend(make_rows(small_spec, 16))
    copy = buf.copy_filled()
    buf.clear()
    buf.extend(make_rows(small_spec, 4, start=50))
    assert_blocks_equal(buf.finish_copy(copy), buf.filled_blocks())


def test_refreshes_between_writes_then_finish(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=40, placement=Placement.sharded(["cpu"] * 2))
    buf.extend(make_rows(small_spec, 25))
    copy = buf.copy_filled()
    for k in range(4):
        buf.extend(make_rows(small_spec, 11, start=100 * (k + 1)))
        copy = buf.refresh_copy(copy, chunk_bytes=2 * small_spec.bytes_per_sample)
    buf.extend(make_rows(small_spec, 3, start=999))
    assert_blocks_equal(buf.finish_copy(copy), buf.filled_blocks())
