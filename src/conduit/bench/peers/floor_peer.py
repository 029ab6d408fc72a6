"""The memory floor of a uniform sample: the gather alone, with nothing around it.

Not a buffer. It draws a batch of random row indices and runs one ``torch.index_select`` per
field from columns preallocated exactly like Conduit's (huge-page-backed where the kernel allows)
into one output per field allocated once, with no sampler object, lock, validation, allocation
or dict of results. Its outputs are its own memory, as Conduit's reused gather sets are: a
fresh output per call would also measure the allocator (it lands in whichever block was freed
last, and over glibc's mapping threshold it page-faults on every call).
"""

from __future__ import annotations

from typing import Any

import torch

from conduit.bench.peers.adapter import Chunk, PeerAdapter, Workload
from conduit.bench.peers.conduit_peer import bench_spec
from conduit.storage.hostmem import host_zeros


class GatherFloorPeer(PeerAdapter):
    """Raw per-field ``index_select`` of uniformly drawn rows (a reference, not a peer)."""

    name = "gather-floor"
    description = ("reference, not a buffer: torch.randint + one torch.index_select per field "
                   "from preallocated columns into preallocated outputs, nothing else")
    package = None
    metrics = ("insert_1024", "sample_uniform")

    def __init__(self) -> None:
        self._cols: dict[str, torch.Tensor] = {}
        self._outs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._filled = 0
        self._batch = 0
        self._gen = torch.Generator()

    def notes(self) -> list[str]:
        return ["gather-floor is the gather alone (no sampler, lock or validation): the "
                "least work a uniform sample can do on this machine"]

    def prepare(self, chunk: Chunk) -> Any:
        return {k: torch.from_numpy(v) for k, v in chunk.items()}

    def setup(self, workload: Workload) -> None:
        self._cols = {}
        self._cols = {name: host_zeros((workload.capacity, *fs.shape), fs.dtype)
                      for name, fs in bench_spec(workload.dim).fields.items()}
        self._capacity, self._filled, self._batch = workload.capacity, 0, workload.batch
        self._outs = [(col, torch.empty((workload.batch, *col.shape[1:]), dtype=col.dtype))
                      for col in self._cols.values()]
        self._gen = torch.Generator().manual_seed(workload.seed)

    def insert(self, chunk: Any) -> None:
        n = next(iter(chunk.values())).shape[0]
        start = self._filled % self._capacity
        n = min(n, self._capacity - start)
        for name, col in self._cols.items():
            col[start:start + n].copy_(chunk[name][:n])
        self._filled = min(self._capacity, self._filled + n)

    def sample_uniform(self) -> Any:
        idx = torch.randint(0, self._filled, (self._batch,), generator=self._gen)
        return [torch.index_select(col, 0, idx, out=out) for col, out in self._outs]

    def close(self) -> None:
        self._cols, self._outs = {}, []
