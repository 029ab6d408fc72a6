"""TorchRL through its public API: ``ReplayBuffer`` over ``LazyTensorStorage``.

Measured variants:

* ``torchrl``: ``ReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=batch)``, and
  ``PrioritizedReplayBuffer`` over the same storage for the prioritized metric. Its on-policy
  epoch is the idiom of TorchRL's PPO tutorial: a ``LazyTensorStorage`` of one rollout with
  ``SamplerWithoutReplacement``, sampled ``M`` times.
* ``torchrl-prefetch``: the same uniform buffer built with ``prefetch=4``, so that sampling
  runs ahead on TorchRL's own thread pool. Only uniform sampling is measured for it.

TorchRL's prioritized sampler needs its C++ extension (``torchrl._torchrl``). When that does
not load (TorchRL 0.14.1's prebuilt wheel against torch 2.13.0 fails with an undefined symbol),
the prioritized metric is reported unavailable with the loader's own message. Nothing is
patched or emulated.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from conduit.bench.peers.adapter import (
    Chunk,
    OperationSkipped,
    PeerAdapter,
    PeerUnavailable,
    Workload,
    priorities,
)


def extension_error() -> str | None:
    """Why TorchRL's C++ extension does not load, or ``None`` when it does."""
    try:
        import torchrl._torchrl  # noqa: F401
    except Exception as exc:  # ImportError (undefined symbol) or OSError
        msg = str(exc)
        if "undefined symbol:" in msg:
            lib, _, sym = msg.partition(": undefined symbol: ")
            msg = f"{lib.rsplit('/', 1)[-1]}: undefined symbol {sym[:48]}..."
        return f"{type(exc).__name__}: {msg[:200]}"
    return None


class TorchRLPeer(PeerAdapter):
    """TorchRL ``ReplayBuffer`` / ``PrioritizedReplayBuffer`` over ``LazyTensorStorage``.

    Args:
        prefetch: Batches TorchRL samples ahead on its thread pool (``None``: no prefetch).
            A prefetching adapter measures uniform sampling only.
        alpha: Priority exponent of the prioritized buffer.
        beta: Importance-sampling exponent of the prioritized buffer.
    """

    package = "torchrl"

    def __init__(self, *, prefetch: int | None = None, alpha: float = 0.6,
                 beta: float = 0.4) -> None:
        self._prefetch = prefetch
        self._alpha = alpha
        self._beta = beta
        self.name = "torchrl" if prefetch is None else "torchrl-prefetch"
        self.description = ("torchrl.data.ReplayBuffer(LazyTensorStorage"
                            + (f", prefetch={prefetch})" if prefetch else ")")
                            + ("" if prefetch else
                               " / PrioritizedReplayBuffer / SamplerWithoutReplacement"))
        self.metrics = (("sample_uniform",) if prefetch is not None else None)
        self._rb: Any = None
        self._w: Workload | None = None
        self._prios: Iterator[torch.Tensor] = iter(())

    def check(self) -> None:
        try:
            import tensordict  # noqa: F401
            import torchrl.data  # noqa: F401
        except Exception as exc:
            raise PeerUnavailable(f"torchrl cannot be imported: {exc!r} "
                                  f"(pip install --no-deps torchrl tensordict)") from exc
        # TorchRL logs every storage allocation at INFO on stdout; keep the table readable.
        logging.getLogger("torchrl").setLevel(logging.WARNING)

    def notes(self) -> list[str]:
        err = extension_error()
        out = []
        if err is not None and self._prefetch is None:
            out.append("TorchRL's C++ extension does not load with this torch, so its "
                       "prioritized buffer is unavailable (not patched, not emulated)")
        if self._prefetch is not None:
            out.append(f"prefetch={self._prefetch}: sampling runs ahead on TorchRL's thread "
                       f"pool, so the latency is what the consumer waits, not the work done")
        return out

    def prepare(self, chunk: Chunk) -> Any:
        from tensordict import TensorDict

        n = len(chunk["obs"])
        return TensorDict({k: torch.from_numpy(v) for k, v in chunk.items()}, batch_size=[n])

    def setup(self, workload: Workload) -> None:
        from torchrl.data import LazyTensorStorage, ReplayBuffer

        self._w = workload
        torch.manual_seed(workload.seed)
        self.close()
        kw: dict[str, Any] = {}
        if self._prefetch is not None:
            kw["prefetch"] = self._prefetch
        self._rb = ReplayBuffer(storage=LazyTensorStorage(workload.capacity),
                                batch_size=workload.batch, **kw)

    def insert(self, chunk: Any) -> None:
        self._rb.extend(chunk)

    def sample_uniform(self) -> Any:
        return self._rb.sample()

    def setup_prioritized(self, workload: Workload) -> None:
        if self._prefetch is not None:
            raise OperationSkipped("the prefetch variant measures uniform sampling only")
        from torchrl.data import LazyTensorStorage, PrioritizedReplayBuffer

        self._w = workload
        self.close()
        try:
            self._rb = PrioritizedReplayBuffer(alpha=self._alpha, beta=self._beta,
                                               storage=LazyTensorStorage(workload.capacity),
                                               batch_size=workload.batch)
        except RuntimeError as exc:
            err = extension_error()
            raise PeerUnavailable(
                f"PrioritizedReplayBuffer raised {str(exc).split('. See')[0]!r}"
                + (f"; the C++ extension does not load ({err})" if err else "")) from exc
        self._prios = priorities(workload, torch.from_numpy)

    def sample_prioritized_and_update(self) -> Any:
        assert self._w is not None
        td = self._rb.sample()
        self._rb.update_priority(td["index"], next(self._prios))
        return td

    def setup_on_policy(self, workload: Workload) -> None:
        if self._prefetch is not None:
            raise OperationSkipped("the prefetch variant measures uniform sampling only")
        from torchrl.data import LazyTensorStorage, ReplayBuffer
        from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement

        self._w = workload
        self.close()
        self._rb = ReplayBuffer(storage=LazyTensorStorage(workload.epoch_rows),
                                sampler=SamplerWithoutReplacement(),
                                batch_size=workload.minibatch)

    def on_policy_epoch(self) -> int:
        assert self._w is not None
        rows = 0
        for _ in range(self._w.minibatches):
            rows += self._rb.sample().batch_size[0]
        return rows

    def close(self) -> None:
        rb, self._rb = self._rb, None
        if rb is not None and self._prefetch is not None:
            pool = getattr(rb, "_prefetch_executor", None)
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
