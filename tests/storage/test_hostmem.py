import gc

import pytest
import torch

from conduit.storage import ExperienceBuffer, UniformSampler, hostmem
from conduit.storage.column_store import ColumnStore
from tests.conftest import make_rows


@pytest.mark.skipif(not hostmem.huge_pages_supported(), reason="no MADV_HUGEPAGE here")
def test_large_columns_use_their_own_mapping_and_own_it(monkeypatch):
    monkeypatch.setattr(hostmem, "HUGE_PAGE_MIN_BYTES", 4096)
    t = hostmem.host_zeros((300, 7), torch.float32)
    assert t.shape == (300, 7) and t.dtype == torch.float32 and t.is_contiguous()
    assert torch.count_nonzero(t) == 0
    # Backed by the anonymous mapping: page-aligned, unlike torch's 64-byte-aligned allocator.
    assert t.data_ptr() % 4096 == 0
    t[17] = 2.5
    gc.collect()  # only the tensor references the mapping now; it must stay alive
    assert float(t.sum()) == pytest.approx(2.5 * 7)


def test_small_columns_and_opt_out_use_torch_allocator():
    assert torch.count_nonzero(hostmem.host_zeros((4, 3), torch.int64)) == 0
    big = hostmem.host_zeros((hostmem.HUGE_PAGE_MIN_BYTES // 4,), torch.float32,
                             huge_pages=False)
    assert big.numel() == hostmem.HUGE_PAGE_MIN_BYTES // 4 and float(big.abs().max()) == 0


@pytest.mark.skipif(not hostmem.huge_pages_supported(), reason="no MADV_HUGEPAGE here")
def test_buffer_on_huge_page_columns_matches_plain_columns(monkeypatch, small_spec):
    rows = make_rows(small_spec, 40)

    def run():
        buf = ExperienceBuffer(spec=small_spec, capacity=32, sampler=UniformSampler(seed=3))
        buf.extend({k: v[:24] for k, v in rows.items()})
        buf.extend({k: v[24:] for k, v in rows.items()})
        return buf, [buf.sample(16) for _ in range(4)]

    plain_buf, plain = run()
    monkeypatch.setattr(hostmem, "HUGE_PAGE_MIN_BYTES", 1)
    huge_buf, huge = run()
    assert huge_buf.store.column("obs").data_ptr() % 4096 == 0
    for a, b in zip(plain, huge):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    state = huge_buf.state_dict()
    restored = ColumnStore(spec=small_spec, capacity=32)
    restored.load_state_dict(state["store"])
    assert torch.equal(restored.get(torch.arange(32))["id"],
                       plain_buf.store.get(torch.arange(32))["id"])
