"""Conduit's own rows: the storage layer driven directly, one buffer operation at a time.

The peers expose buffer operations, so Conduit is measured at the same level: an
:class:`~conduit.storage.ExperienceBuffer` (column store + ring writer + sampler) with

* :class:`~conduit.storage.UniformSampler` for inserts and uniform sampling,
* :class:`~conduit.storage.PrioritizedSampler` for sample + ``update_priorities``,
* :class:`~conduit.storage.FifoSampler` for the consume-once on-policy epoch: ``M`` shuffled
  mini-batches that cover the rollout exactly once, then ``clear()``.

Writes go through ``extend`` with spec validation on, as a user's would. The buffer keeps its
data-path threads at one (its default); the harness sets the same for every peer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from conduit.bench.peers.adapter import Chunk, PeerAdapter, Workload, priorities
from conduit.plane import ExperienceDataPlane
from conduit.scheduling import Schedule
from conduit.spec import ExperienceSpec
from conduit.storage import (
    ExperienceBuffer,
    FifoSampler,
    Placement,
    PrioritizedSampler,
    UniformSampler,
)


def bench_spec(dim: int) -> ExperienceSpec:
    """The benchmark's spec: float32 observation of ``dim``, int64 action, reward, done."""
    return ExperienceSpec.of(obs=((dim,), torch.float32), action=((), torch.int64),
                             reward=((), torch.float32), done=((), torch.bool))


class ConduitPeer(PeerAdapter):
    """Conduit's ``ExperienceBuffer`` on a CPU placement.

    Args:
        placement: Where the rows live (default: pageable CPU memory).
        alpha: Priority exponent of the prioritized sampler.
        beta: Importance-weight exponent of the prioritized sampler.
    """

    name = "conduit"
    description = ("conduit.storage.ExperienceBuffer on pageable CPU memory: UniformSampler / "
                   "PrioritizedSampler + update_priorities / FifoSampler (consume-once)")
    package = "conduit-rl"

    def __init__(self, *, placement: Placement | None = None, alpha: float = 0.6,
                 beta: float = 0.4) -> None:
        self.placement = placement or Placement.pageable()
        self._alpha = alpha
        self._beta = beta
        self._buf: ExperienceBuffer | None = None
        self._w: Workload | None = None
        self._prios: Iterator[torch.Tensor] = iter(())
        self._iteration = 0

    def prepare(self, chunk: Chunk) -> Any:
        return {k: torch.from_numpy(v) for k, v in chunk.items()}

    def _build(self, workload: Workload, capacity: int, sampler: Any) -> None:
        self._w = workload
        self._buf = None  # free the previous buffer before allocating the next
        self._buf = ExperienceBuffer(spec=bench_spec(workload.dim), capacity=capacity,
                                     sampler=sampler, placement=self.placement, threads=1)

    def setup(self, workload: Workload) -> None:
        self._build(workload, workload.capacity, UniformSampler(seed=workload.seed))

    def insert(self, chunk: Any) -> None:
        assert self._buf is not None
        self._buf.extend(chunk)

    def sample_uniform(self) -> Any:
        assert self._buf is not None and self._w is not None
        return self._buf.sample(self._w.batch)

    def setup_prioritized(self, workload: Workload) -> None:
        self._build(workload, workload.capacity,
                    PrioritizedSampler(alpha=self._alpha, beta=self._beta, seed=workload.seed))
        self._prios = priorities(workload, torch.from_numpy)

    def sample_prioritized_and_update(self) -> Any:
        assert self._buf is not None and self._w is not None
        batch = self._buf.sample(self._w.batch)
        self._buf.update_priorities(batch["_index"], next(self._prios))
        return batch

    def setup_on_policy(self, workload: Workload) -> None:
        self._iteration = 0
        self._build(workload, workload.epoch_rows,
                    FifoSampler(num_minibatches=workload.minibatches, seed=workload.seed))

    def on_policy_epoch(self) -> int:
        buf = self._buf
        assert buf is not None and self._w is not None
        sampler = buf.sampler
        assert sampler.consume_once
        sampler.begin_epoch(len(buf), iteration=self._iteration, epoch=0)
        rows = 0
        for _ in range(self._w.minibatches):
            rows += buf.sample(self._w.minibatch)["obs"].shape[0]
        buf.clear()
        self._iteration += 1
        return rows

    def close(self) -> None:
        self._buf = None


class ConduitSplitPeer(ConduitPeer):
    """``ExperienceBuffer(threads=2)``: a large gather may run on two threads, split over row
    ranges on the buffer's own pool or on torch's intra-op threads, whichever the buffer
    measured faster than one thread (``GatherWorkers``)."""

    name = "conduit-split"
    description = ("conduit.storage.ExperienceBuffer(threads=2): uniform and prioritized "
                   "samples whose gathers of 1 MB or more run on two threads (split over the "
                   "buffer's pool, or torch's intra-op threads) where measured faster")
    metrics = ("sample_uniform", "sample_per_update")

    #: Samples the first call may take for the buffer's trials (3 modes x 8 by default).
    TRIAL_SAMPLES = 64

    def _two_threads(self) -> None:
        """Two threads from the first sample on (the fill before it stays on one thread, as
        for every other peer); that first call also runs the buffer's trials, so they fall in
        the harness's untimed warm-up, not in the timed calls."""
        buf, w = self._buf, self._w
        assert buf is not None and w is not None
        if buf.threads == 2:
            return
        buf.threads = 2
        for _ in range(self.TRIAL_SAMPLES):
            if buf.gather_mode is not None:
                break
            buf.sample(w.batch)

    def sample_uniform(self) -> Any:
        self._two_threads()
        return super().sample_uniform()

    def sample_prioritized_and_update(self) -> Any:
        self._two_threads()
        return super().sample_prioritized_and_update()

    def notes(self) -> list[str]:
        return ["conduit-split may run a gather of 1 MB or more on two threads; its first "
                "(untimed) call runs the buffer's trials of one thread, the split over its "
                "pool and torch's intra-op threads, and keeps the fastest where it beats one "
                "thread by 10 %"]


class ConduitPlanePeer(PeerAdapter):
    """Uniform sampling through the learner port: ``ExperienceDataPlane.pull()``.

    Args:
        schedule: The plane's schedule; with overlapped delivery a worker draws and gathers
            ahead while the caller consumes staged batches, so ``pull()`` measures the latency
            the learner sees, as TorchRL's prefetch row does.
    """

    package = "conduit-rl"
    metrics = ("sample_uniform",)

    def __init__(self, schedule: Schedule) -> None:
        self._schedule = schedule
        self._plane: ExperienceDataPlane | None = None

    def prepare(self, chunk: Chunk) -> Any:
        return {k: torch.from_numpy(v) for k, v in chunk.items()}

    def setup(self, workload: Workload) -> None:
        self.close()
        self._plane = ExperienceDataPlane(
            spec=bench_spec(workload.dim), capacity=workload.capacity,
            batch_size=workload.batch, schedule=self._schedule, seed=workload.seed)

    def insert(self, chunk: Any) -> None:
        assert self._plane is not None
        self._plane.push(chunk)

    def sample_uniform(self) -> Any:
        assert self._plane is not None
        return self._plane.pull()

    def close(self) -> None:
        if self._plane is not None:
            self._plane.close()
            self._plane = None


class ConduitPullPeer(ConduitPlanePeer):
    """``pull()`` with inline delivery: draw, gather, delivery operator and port on the
    caller's thread, the synchronous path a learner meets first."""

    name = "conduit-pull"
    description = ("conduit.ExperienceDataPlane(schedule=Schedule(0, 1, 0, 1)).pull(): "
                   "inline delivery through the identity operator and the learner port")

    def __init__(self) -> None:
        super().__init__(Schedule(0, 1, 0, 1))


class ConduitPrefetchPeer(ConduitPlanePeer):
    """``pull()`` with delivery overlapped, ``Schedule(0, 1, 1, 4)``: the counterpart of
    TorchRL's ``prefetch``."""

    name = "conduit-prefetch"
    description = ("conduit.ExperienceDataPlane(schedule=Schedule(0, 1, 1, 4)).pull(): "
                   "delivery prefetches 4 batches per invocation on a background worker")

    def __init__(self) -> None:
        super().__init__(Schedule(0, 1, 1, 4))

    def notes(self) -> list[str]:
        return ["pull() latency with delivery running ahead on one worker thread (like "
                "torchrl-prefetch); in a tight loop its median reflects staged batches"]
