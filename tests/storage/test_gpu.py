"""CUDA placements: skipped cleanly on machines without a GPU (run with ``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch

from conduit import ExperienceDataPlane, ExperienceSpec, Placement, Schedule
from conduit.plane import plane_copy_times
from conduit.storage import ExperienceBuffer, PrioritizedSampler, UniformSampler
from tests.conftest import make_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("sampler", [UniformSampler, PrioritizedSampler])
def test_same_seed_same_batches_on_cuda_and_pageable(small_spec, sampler):
    placements = [Placement.pageable(), Placement.pinned(), Placement.device("cuda:0"),
                  Placement.sharded(["cuda:0", "cpu"])]
    if torch.cuda.device_count() > 1:
        placements.append(Placement.sharded(["cuda:0", "cuda:1"]))
    runs = []
    for p in placements:
        buf = ExperienceBuffer(spec=small_spec, capacity=50, sampler=sampler(seed=9),
                               placement=p)
        rows = make_rows(small_spec, 70)
        buf.extend({k: v[:40] for k, v in rows.items()})
        buf.extend({k: v[40:] for k, v in rows.items()})  # wraps: 20 of the first 40 go
        batches = [buf.sample(16, device=torch.device("cpu")) for _ in range(5)]
        runs.append(batches)
    for p, got in zip(placements[1:], runs[1:]):
        for a, b in zip(runs[0], got):
            for k in a:
                assert torch.equal(a[k].cpu(), b[k].cpu()), (p, k)


def test_plane_with_cuda_learner_delivers_on_cuda_and_migrates(small_spec):
    for sched in (Schedule(0, 1, 0, 1), Schedule(1, 1, 1, 2)):
        with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=8,
                                 placement=Placement.pageable(), learner_device="cuda:0",
                                 schedule=sched, seed=1) as plane:
            plane.push(make_rows(small_spec, 40))
            plane.flush()
            b = plane.pull()
            assert all(v.device.type == "cuda" for k, v in b.items() if not k.startswith("_"))
            before = plane.buffer.store.get(torch.arange(40), device=torch.device("cpu"))
            for target in (Placement.device("cuda:0"), Placement.sharded(["cuda:0", "cpu"]),
                           Placement.pinned()):
                plane.migrate(target)
                after = plane.buffer.store.get(torch.arange(40), device=torch.device("cpu"))
                for k in before:
                    assert torch.equal(before[k], after[k]), (target, k)
                b = plane.pull()
                assert b["obs"].device.type == "cuda"
                assert torch.equal(b["obs"][:, 0].cpu(), b["id"].cpu().to(torch.float32))


def test_pinned_store_batches_leave_from_page_locked_sets_and_arrive_intact():
    """A pinned store gathers into page-locked sets and copies each to the learner in one
    asynchronous copy; no set is written again while its copy may still be in flight, so every
    batch arrives as its rows (16 MiB batches make a premature reuse visible)."""
    spec = ExperienceSpec.of(obs=((4096,), torch.float32), id=((), torch.int64),
                             done=((), torch.bool))
    for sched in (Schedule(0, 1, 0, 1), Schedule(1, 1, 1, 1)):  # inline, then overlapped
        with ExperienceDataPlane(spec=spec, capacity=4096, batch_size=1024,
                                 placement=Placement.pinned(), learner_device="cuda:0",
                                 schedule=sched, seed=3) as plane:
            plane.push(make_rows(spec, 4096))
            plane.flush()
            assert plane.buffer.store.get(torch.arange(8))["obs"].is_pinned()
            ids = []
            for _ in range(40):
                b = plane.pull()
                assert b["obs"].device.type == "cuda"
                assert torch.equal(b["obs"], b["id"][:, None].to(torch.float32).expand(-1, 4096))
                # The set left in one copy: its fields are views of one device block.
                assert (b["obs"].untyped_storage().data_ptr()
                        == b["id"].untyped_storage().data_ptr()
                        == b["done"].untyped_storage().data_ptr())
                ids.append(b["id"])
            assert len(torch.unique(torch.cat(ids))) > 1024  # different rows each pull


def test_a_cuda_learner_leaves_delivery_out_of_the_copy_time_bound(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=8, placement="auto",
                             learner_device="cuda:0") as plane:
        plane.push(make_rows(small_spec, 16))
        c = plane_copy_times(plane)
        assert c.t_copy_del is None and c.t_copy_ing is not None


def test_a_pinned_sample_dropped_while_its_copy_is_in_flight_is_not_overwritten():
    """``sample`` from a pinned store returns page-locked rows; a caller that copies them to
    the GPU without blocking and drops them at once still gets its rows."""
    spec = ExperienceSpec.of(obs=((4096,), torch.float32), id=((), torch.int64))
    buf = ExperienceBuffer(spec=spec, capacity=4096, sampler=UniformSampler(seed=5),
                           placement=Placement.pinned())
    buf.extend(make_rows(spec, 4096))
    got = []
    for _ in range(40):
        b = buf.sample(1024)
        assert b["obs"].is_pinned()
        got.append({k: v.to("cuda:0", non_blocking=True) for k, v in b.items()})
        del b
    torch.cuda.synchronize()
    for g in got:
        assert torch.equal(g["obs"], g["id"][:, None].to(torch.float32).expand(-1, 4096))


@pytest.mark.parametrize("placement", [Placement.pinned(), Placement.device("cuda:0")],
                         ids=["pinned", "device"])
def test_a_batch_dropped_while_the_learners_kernels_still_read_it_is_not_overwritten(placement):
    """Overlapped delivery makes batches on the plane's copy stream. A learner that queues
    kernels reading a batch and drops it before they run still has them read its rows: the
    batches the worker makes meanwhile do not land in its memory. (A sleep kernel holds the
    learner's stream back while six more batches are copied, so a premature reuse would be
    overwritten before the read.)"""
    spec = ExperienceSpec.of(obs=((4096,), torch.float32), id=((), torch.int64))
    with ExperienceDataPlane(spec=spec, capacity=4096, batch_size=1024, placement=placement,
                             learner_device="cuda:0", schedule=Schedule(0, 1, 1, 1),
                             seed=4) as plane:
        plane.push(make_rows(spec, 4096))
        plane.flush()
        for _ in range(3):
            b = plane.pull()
            want = b["id"].cpu().to(torch.float32)  # waits for the learner's stream: intact
            torch.cuda._sleep(200_000_000)  # about 0.1 s on the learner's stream
            late = b["obs"][:, 0].clone()  # queued behind the sleep
            del b
            ids = [plane.pull()["id"] for _ in range(6)]  # copied while the learner sleeps
            torch.cuda.synchronize()
            assert torch.equal(late.cpu(), want)
            assert all(i.device.type == "cuda" for i in ids)
