import ctypes
import gc
import json
import os
import subprocess
import sys

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


# Each probe runs in a fresh interpreter: the allocator policy is process-wide and set once.
_MALLOC_PROBE = r"""
import ctypes, json, sys, torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
how = sys.argv[1]
if how == "opt-outs":  # each opt-out in turn; none may set the policy
    import os
    from conduit.storage.hostmem import retain_freed_memory
    results = []
    for name, value in (("CONDUIT_HOST_MALLOC", "system"), ("MALLOC_TRIM_THRESHOLD_", "131072"),
                        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")):
        os.environ[name] = value
        results.append(retain_freed_memory.__wrapped__())
        del os.environ[name]
    applied = results
elif how == "plane":
    from conduit import ExperienceDataPlane, ExperienceSpec
    ExperienceDataPlane(spec=ExperienceSpec.of(x=((2,), torch.float32)), capacity=8,
                        batch_size=4).close()
    applied = None
else:
    from conduit.storage.hostmem import retain_freed_memory
    applied = retain_freed_memory()
mapped = libc.mallinfo2().hblkhd
t = torch.ones(24 << 18)  # 24 MiB, one block
served_by_mapping = libc.mallinfo2().hblkhd - mapped >= 24 << 20
del t
kept_free = libc.mallinfo2().fordblks >= 24 << 20
print(json.dumps({"applied": applied, "mapped": served_by_mapping, "kept": kept_free}))
"""


def _malloc_probe(how: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "CONDUIT_HOST_MALLOC")}
    out = subprocess.run([sys.executable, "-c", _MALLOC_PROBE, how], env=clean,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


glibc_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "mallinfo2"),
    reason="needs glibc >= 2.33")


@glibc_only
def test_freed_batch_memory_stays_with_the_process():
    # A 24 MiB block comes from the heap and stays there once freed, instead of being mapped
    # for itself and unmapped on free (which the next batch pays for in page faults).
    assert _malloc_probe("direct") == {"applied": True, "mapped": False, "kept": True}


@glibc_only
def test_building_a_plane_sets_the_policy():
    assert _malloc_probe("plane") == {"applied": None, "mapped": False, "kept": True}


@glibc_only
def test_the_allocator_is_left_alone_when_asked_or_already_set():
    # CONDUIT_HOST_MALLOC=system, the user's MALLOC_* variable, the user's GLIBC_TUNABLES.
    assert _malloc_probe("opt-outs") == {"applied": [False, False, False], "mapped": True,
                                         "kept": False}
