"""cpprb through its public API: ``ReplayBuffer`` and ``PrioritizedReplayBuffer``.

cpprb stores numpy arrays in preallocated C++ ring buffers. Its on-policy idiom (the one its
documentation shows for PPO-style training) is a buffer of one rollout's size read whole with
``get_all_transitions()`` and emptied with ``clear()``; the shuffle into mini-batches is then
the user's numpy code, which is what is timed here as the epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from conduit.bench.peers.adapter import Chunk, PeerAdapter, PeerUnavailable, Workload, priorities


def _env_dict(dim: int) -> dict[str, dict[str, Any]]:
    return {
        "obs": {"shape": dim, "dtype": np.float32},
        "action": {"dtype": np.int64},
        "reward": {"dtype": np.float32},
        "done": {"dtype": np.bool_},
    }


class CpprbPeer(PeerAdapter):
    """cpprb ``ReplayBuffer`` (uniform, on-policy) and ``PrioritizedReplayBuffer``.

    Args:
        alpha: Priority exponent of the prioritized buffer.
        beta: Importance-sampling exponent used when sampling it.
    """

    name = "cpprb"
    description = "cpprb.ReplayBuffer / cpprb.PrioritizedReplayBuffer (numpy in, numpy out)"
    package = "cpprb"

    def __init__(self, *, alpha: float = 0.6, beta: float = 0.4) -> None:
        self._alpha = alpha
        self._beta = beta
        self._rb: Any = None
        self._w: Workload | None = None
        self._rng = np.random.default_rng(0)
        self._prios: Iterator[np.ndarray] = iter(())

    def check(self) -> None:
        try:
            import cpprb  # noqa: F401
        except Exception as exc:  # any import failure makes the peer unavailable
            raise PeerUnavailable(f"cpprb cannot be imported: {exc!r} "
                                  f"(pip install cpprb)") from exc

    def setup(self, workload: Workload) -> None:
        import cpprb

        self._w = workload
        self._rng = np.random.default_rng(workload.seed)
        self._rb = None
        self._rb = cpprb.ReplayBuffer(workload.capacity, env_dict=_env_dict(workload.dim))

    def insert(self, chunk: Chunk) -> None:
        self._rb.add(**chunk)

    def sample_uniform(self) -> Any:
        assert self._w is not None
        return self._rb.sample(self._w.batch)

    def setup_prioritized(self, workload: Workload) -> None:
        import cpprb

        self._w = workload
        self._rb = None
        self._rb = cpprb.PrioritizedReplayBuffer(workload.capacity,
                                                 env_dict=_env_dict(workload.dim),
                                                 alpha=self._alpha)
        self._prios = priorities(workload)

    def sample_prioritized_and_update(self) -> Any:
        assert self._w is not None
        batch = self._rb.sample(self._w.batch, beta=self._beta)
        self._rb.update_priorities(batch["indexes"], next(self._prios))
        return batch

    def setup_on_policy(self, workload: Workload) -> None:
        import cpprb

        self._w = workload
        self._rb = None
        self._rb = cpprb.ReplayBuffer(workload.epoch_rows, env_dict=_env_dict(workload.dim))

    def on_policy_epoch(self) -> int:
        assert self._w is not None
        data = self._rb.get_all_transitions()
        self._rb.clear()
        n = len(data["obs"])
        perm = self._rng.permutation(n)
        mb = self._w.minibatch
        rows = 0
        for i in range(self._w.minibatches):
            idx = perm[i * mb:(i + 1) * mb]
            batch = {k: v[idx] for k, v in data.items()}
            rows += len(batch["obs"])
        return rows

    def close(self) -> None:
        self._rb = None
