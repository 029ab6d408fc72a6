"""The synchronous sample's draw into the batch's own ``_index`` (ColumnStore.gather_drawn):
the same slots and rows as a draw then a gather, never over a batch someone still holds."""

from __future__ import annotations

import pickle

import pytest
import torch

from conduit.errors import ConfigError, EmptyBufferError
from conduit.spec import ExperienceSpec
from conduit.storage import ExperienceBuffer, Placement, column_store
from conduit.storage.samplers import PrioritizedSampler, SampleInfo, UniformSampler
from conduit.storage.threads import GatherWorkers
from tests.conftest import make_rows
from tests.storage.test_gather_path import wide_spec

needs_use_count = pytest.mark.skipif(column_store._storage_use_count is None,
                                     reason="this torch exposes no storage use count")


def two_buffers(spec: ExperienceSpec, *, rows: int = 50, capacity: int = 64,
                **kw) -> tuple[ExperienceBuffer, ExperienceBuffer]:
    out = []
    for _ in range(2):
        buf = ExperienceBuffer(spec=spec, capacity=capacity,
                               sampler=UniformSampler(seed=7), **kw)
        buf.extend(make_rows(spec, rows, start=100))
        out.append(buf)
    return out[0], out[1]


def drawn_gathers(buf: ExperienceBuffer, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the buffer store's gather_drawn calls."""
    calls = []
    real = buf.store.gather_drawn

    def counted(rows, draw):  # type: ignore[no-untyped-def]
        calls.append(rows)
        return real(rows, draw)

    monkeypatch.setattr(buf.store, "gather_drawn", counted)
    return calls


def test_sample_draws_the_slots_and_rows_a_draw_then_a_gather_would(monkeypatch):
    """Every dtype and row shape (bfloat16 through index_select), batch sizes that reuse and
    that outgrow the output sets: sample() through the drawn gather returns what draw() and
    gather() return on a twin buffer with the same seed."""
    spec = wide_spec()
    fast, slow = two_buffers(spec)
    calls = drawn_gathers(fast, monkeypatch)
    for n in (9, 9, 1, 33, 9, 200):
        got = fast.sample(n)
        want = slow.gather(slow.draw(n))
        assert set(got) == set(want) == {*spec.fields, "_index"}
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
        assert got["_index"].shape == (n,) and int(got["_index"].max()) < 50
    assert calls == [9, 9, 1, 33, 9, 200]
    assert torch.equal(fast.sampler.state_dict()["draws"], slow.sampler.state_dict()["draws"])


def test_sample_into_draws_what_sample_draws():
    a, b = UniformSampler(seed=3), UniformSampler(seed=3)
    for size, n in [(1, 4), (17, 64), (100_000, 256), (2**33, 8)]:
        out = torch.full((n,), -1, dtype=torch.int64)
        a.sample_into(size, out)
        assert torch.equal(out, b.sample(size, n).indices)


def test_sample_into_refuses_what_it_cannot_draw():
    with pytest.raises(EmptyBufferError):
        UniformSampler().sample_into(0, torch.empty(4, dtype=torch.int64))
    no_replacement = UniformSampler(replacement=False)
    assert not no_replacement.draws_into
    with pytest.raises(ConfigError) as err:
        no_replacement.sample_into(10, torch.empty(4, dtype=torch.int64))
    assert err.value.field == "sampler"


@needs_use_count
@pytest.mark.parametrize("hold", ["batch", "_index", "a field", "_index as numpy"])
def test_a_held_batch_or_its_index_is_never_overwritten(small_spec, hold):
    buf = ExperienceBuffer(spec=small_spec, capacity=64, sampler=UniformSampler(seed=1))
    buf.extend(make_rows(small_spec, 64))
    first = buf.sample(16)
    keep = {"batch": lambda b: b, "_index": lambda b: b["_index"],
            "a field": lambda b: b["obs"], "_index as numpy": lambda b: b["_index"].numpy()
            }[hold](first)
    index, obs = first["_index"].clone(), first["obs"].clone()
    del first
    for _ in range(8):
        again = buf.sample(16)
        assert not torch.equal(again["_index"], index)  # (16 of 64 slots: not the same draw)
    if hold == "batch":
        assert torch.equal(keep["_index"], index) and torch.equal(keep["obs"], obs)
    elif hold == "a field":
        assert torch.equal(keep, obs)
    else:
        assert torch.equal(torch.as_tensor(keep), index)


@needs_use_count
def test_a_dropped_batch_is_drawn_into_again(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=64)
    buf.extend(make_rows(small_spec, 64))
    first = buf.sample(8)
    mem = first["_index"].data_ptr()
    second = buf.sample(8)
    assert second["_index"].data_ptr() != mem  # the first is still held
    del first
    assert buf.sample(8)["_index"].data_ptr() == mem


def test_the_drawn_gather_runs_only_where_it_draws_what_sample_would(small_spec, monkeypatch):
    """Another sampler, a subclass that overrides sample(), without replacement, two data-path
    threads whose pool may split the gather, a device asked for, or a sharded store: a draw,
    then a gather, as before."""

    class Odd(UniformSampler):
        def sample(self, size: int, batch_size: int) -> SampleInfo:
            return SampleInfo(torch.arange(1, 2 * batch_size, 2) % size)

    cases = {
        "prioritized": dict(sampler=PrioritizedSampler()),
        "overridden sample()": dict(sampler=Odd()),
        "without replacement": dict(sampler=UniformSampler(replacement=False)),
        "two threads": dict(threads=2),
        "sharded": dict(placement=Placement.sharded(["cpu", "cpu"])),
    }
    for name, kw in cases.items():
        buf = ExperienceBuffer(spec=small_spec, capacity=64, **kw)
        buf.extend(make_rows(small_spec, 40))
        if name == "two threads":  # a pool that may split every gather, however small
            buf._reader.workers = GatherWorkers(threads=2, min_bytes=0)
        calls = drawn_gathers(buf, monkeypatch) if hasattr(buf.store, "gather_drawn") else []
        got = buf.sample(6)
        assert calls == [], name
        assert got["_index"].shape == (6,) and int(got["_index"].max()) < 40, name
        if name == "overridden sample()":
            assert got["_index"].tolist() == [1, 3, 5, 7, 9, 11]
    buf = ExperienceBuffer(spec=small_spec, capacity=64)
    buf.extend(make_rows(small_spec, 40))
    calls = drawn_gathers(buf, monkeypatch)
    buf.sample(6, device="cpu")
    assert calls == []
    buf.sample(6)
    assert calls == [6]


def test_a_gather_too_small_to_split_is_drawn_as_on_one_thread(small_spec, monkeypatch):
    """Two data-path threads, a gather under the pool's ``min_bytes``: the one-thread
    buffer's route (the drawn gather, or numpy's take for a prioritized draw), never the
    split's, with the same slots and rows as a one-thread twin."""
    one, two = two_buffers(small_spec)
    two.threads = 2
    calls = drawn_gathers(two, monkeypatch)
    split = []
    real_split = two.store._split_gather
    monkeypatch.setattr(two.store, "_split_gather",
                        lambda *a, **k: split.append(1) or real_split(*a, **k))
    for _ in range(3):
        a, b = one.sample(6), two.sample(6)
        for k in a:
            assert torch.equal(a[k], b[k]), k
    assert calls == [6, 6, 6] and split == []
    per = [ExperienceBuffer(spec=small_spec, capacity=64, threads=t,
                            sampler=PrioritizedSampler(seed=3)) for t in (1, 2)]
    for buf in per:
        buf.extend(make_rows(small_spec, 40))
    monkeypatch.setattr(per[1].store, "_split_gather",
                        lambda *a, **k: split.append(1) or real_split(*a, **k))
    a, b = per[0].sample(6), per[1].sample(6)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert split == []
    per[1]._reader.workers = GatherWorkers(threads=2, min_bytes=0)  # now it may split
    per[1].sample(6)
    assert split == [1]


def test_an_empty_buffer_refuses_the_sample(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=8)
    with pytest.raises(EmptyBufferError):
        buf.sample(4)
    buf.extend(make_rows(small_spec, 3))
    assert buf.sample(4)["_index"].max() < 3


def test_a_slot_drawn_outside_the_store_is_refused_before_the_gather(small_spec):
    class Wild(UniformSampler):
        def sample_into(self, size: int, out: torch.Tensor) -> None:
            out.fill_(size + 5)

    buf = ExperienceBuffer(spec=small_spec, capacity=16, sampler=Wild())
    buf.extend(make_rows(small_spec, 16))
    assert buf.sampler.draws_into
    with pytest.raises(IndexError, match="21 lies outside"):
        buf.sample(4)


def test_a_later_column_moved_to_shared_memory_is_read_where_it_lies_now(monkeypatch):
    """share_memory_() on the last column (as torch.multiprocessing does to a column it sends)
    moves it after the earlier fields' rows are taken: the drawn gather reads every field
    from where it lies now, as a twin's draw and gather do."""
    spec = ExperienceSpec.of(a=((3,), torch.float32), b=((), torch.int64),
                             c=((2,), torch.float32))
    fast, slow = two_buffers(spec)
    calls = drawn_gathers(fast, monkeypatch)
    fast.sample(5), slow.gather(slow.draw(5))
    fast.store.column("c").share_memory_()
    junk = [torch.full((64,), -7.0) for _ in range(8)]  # (in the freed memory, maybe)
    for _ in range(3):
        got, want = fast.sample(7), slow.gather(slow.draw(7))
        for k in ("a", "b", "c", "_index"):
            assert torch.equal(got[k], want[k]), k
    assert calls == [5, 7, 7, 7]
    del junk


def test_index_alone_carries_only_its_own_rows():
    """``_index`` is memory of its own, not a view of the fields' block: sent alone (pickled,
    as Ray and torch.multiprocessing send tensors), it carries 8 bytes a row, not the batch."""
    spec = ExperienceSpec.of(obs=((4096,), torch.float32))
    buf = ExperienceBuffer(spec=spec, capacity=64)
    buf.extend({"obs": torch.randn(64, 4096)})
    batch = buf.sample(32)
    assert len(pickle.dumps(batch["_index"])) < 2048  # the obs rows alone are 512 KiB
    assert batch["_index"].untyped_storage().data_ptr() != batch["obs"].data_ptr()
    again = pickle.loads(pickle.dumps(batch))
    assert torch.equal(again["_index"], batch["_index"]) and torch.equal(again["obs"],
                                                                          batch["obs"])


def test_a_pool_that_keeps_no_set_makes_a_slot_column_only_when_asked():
    """Pinned pools keep no set (each gather allocates): a plain take allocates no slot
    column there; an indexed take gets one of its own each call."""
    pool = column_store.GatherOutputs(wide_spec().fields, keep=0)
    assert pool._other_set_locked(4, False)[6:8] == (None, None)  # (its slots, slot_array)
    assert "_index" not in pool.take(4)
    a, b = pool.take_indexed(4)[0], pool.take_indexed(4)[0]
    assert a["_index"].shape == (4,) and a["_index"].dtype == torch.int64
    assert a["_index"].data_ptr() != b["_index"].data_ptr()
