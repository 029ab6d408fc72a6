"""A plane's one-batch uniform delivery draws the batch as it gathers it (the buffer's drawn
gather): the same slots and rows as a draw then a gather, and a batch the learner still
holds is never drawn into."""

from __future__ import annotations

import pytest
import torch

from conduit import ExperienceDataPlane, Schedule
from conduit.storage import ExperienceBuffer, PrioritizedSampler, UniformSampler
from tests.conftest import make_rows
from tests.plane.helpers import filled_plane


def counted_drawn_gathers(plane: ExperienceDataPlane,
                          monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    store = plane.buffer.store
    real = store.gather_drawn

    def counted(rows, draw):  # type: ignore[no-untyped-def]
        calls.append(rows)
        return real(rows, draw)

    monkeypatch.setattr(store, "gather_drawn", counted)
    return calls


def test_inline_pulls_draw_into_the_batch_the_slots_a_twin_buffer_samples(small_spec,
                                                                           monkeypatch):
    plane = filled_plane(small_spec, Schedule(0, 1, 0, 1))
    twin = ExperienceBuffer(spec=small_spec, capacity=64, sampler=UniformSampler(seed=5))
    twin.extend(make_rows(small_spec, 40, start=100))
    calls = counted_drawn_gathers(plane, monkeypatch)
    try:
        for _ in range(4):
            got, want = plane.pull(), twin.sample(8)
            assert set(got) == set(want)
            for k in want:
                assert torch.equal(got[k], want[k]), k
        assert calls == [8] * 4
        assert plane.stats()["delivered_batches"] == 4
    finally:
        plane.close()


@pytest.mark.parametrize("schedule", [Schedule(0, 1, 0, 2), Schedule(0, 1, 1, 2)])
def test_several_batches_per_invocation_are_drawn_before_the_gather(small_spec, monkeypatch,
                                                                    schedule):
    plane = filled_plane(small_spec, schedule)
    calls = counted_drawn_gathers(plane, monkeypatch)
    try:
        batches = [plane.pull() for _ in range(4)]
        assert calls == []
        assert all(b["_index"].shape == (8,) for b in batches)
    finally:
        plane.close()


def test_a_prioritized_plane_draws_before_the_gather(small_spec, monkeypatch):
    plane = filled_plane(small_spec, Schedule(0, 1, 0, 1), sampler=PrioritizedSampler(seed=5))
    calls = counted_drawn_gathers(plane, monkeypatch)
    try:
        batch = plane.pull()
        assert calls == [] and "_weight" in batch
    finally:
        plane.close()


def test_batches_staged_by_the_delivery_worker_are_never_drawn_into(small_spec, monkeypatch):
    plane = filled_plane(small_spec, Schedule(0, 1, 1, 1))
    calls = counted_drawn_gathers(plane, monkeypatch)
    try:
        held = [plane.pull() for _ in range(6)]
        copies = [{k: v.clone() for k, v in b.items()} for b in held]
        for _ in range(6):
            plane.pull()
        for b, c in zip(held, copies):
            for k in c:
                assert torch.equal(b[k], c[k]), k
        assert len({b["_index"].data_ptr() for b in held}) == len(held)
        assert len(calls) >= 6  # the worker drew them as it gathered them
    finally:
        plane.close()


@pytest.mark.parametrize("raised", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_a_sample_that_raises_in_an_inline_pull_goes_to_that_caller_only(small_spec,
                                                                         monkeypatch, raised):
    plane = filled_plane(small_spec, Schedule(0, 1, 0, 1))
    buf = plane.buffer
    real = buf.sample
    calls = []

    def failing(batch_size, **kw):  # type: ignore[no-untyped-def]
        calls.append(batch_size)
        if len(calls) == 1:
            raise raised
        return real(batch_size, **kw)

    monkeypatch.setattr(buf, "sample", failing)
    try:
        if isinstance(raised, KeyboardInterrupt):
            with pytest.raises(KeyboardInterrupt) as info:
                plane.pull()
            assert any("delivery" in note for note in info.value.__notes__)
        else:
            from conduit.errors import OperatorError
            with pytest.raises(OperatorError) as info:
                plane.pull()
            assert info.value.__cause__ is raised
        stats = plane.stats()
        assert stats["delivered_batches"] == 0 and stats["invocations_del"] == 1
        assert plane.failed is None  # not latched: the plane stays usable
        assert plane._engine.flow.delivering == 0
        assert plane.timings.count("delivery") == 1
        batch = plane.pull()
        assert batch["_index"].shape == (8,) and calls == [8, 8]
        assert plane.stats()["delivered_batches"] == 1
    finally:
        plane.close()


def test_a_delivery_operator_takes_the_rows_a_drawn_pull_would_hand_over(small_spec):
    plane = filled_plane(small_spec, Schedule(0, 1, 0, 1))
    twin = filled_plane(small_spec, Schedule(0, 1, 0, 1))
    seen = []

    @plane.register_delivery()
    def double(exp_in, learn_out):  # type: ignore[no-untyped-def]
        rows = exp_in.read()
        seen.append(rows["_index"].clone())
        learn_out.write({**rows, "obs": rows["obs"] * 2})

    try:
        for _ in range(3):
            got, want = plane.pull(), twin.pull()
            assert torch.equal(got["_index"], want["_index"])
            assert torch.equal(got["obs"], want["obs"] * 2)
        assert len(seen) == 3
    finally:
        plane.close()
        twin.close()
