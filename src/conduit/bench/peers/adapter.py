"""The interface every peer adapter implements, and the plain data it exchanges.

A *peer* is a replay-buffer implementation a user could pick instead of Conduit (TorchRL, cpprb,
RLlib, Reverb, GEAR's placement). Its adapter drives the peer through the peer's own public API
on the four operations the benchmark measures:

* :meth:`PeerAdapter.insert` — add one chunk of rows (64 or 1024) to a uniform buffer;
* :meth:`PeerAdapter.sample_uniform` — draw one uniform batch;
* :meth:`PeerAdapter.sample_prioritized_and_update` — draw one prioritized batch and write
  new priorities for it;
* :meth:`PeerAdapter.on_policy_epoch` — deliver ``M`` shuffled mini-batches that together
  cover the rollout exactly once.

The harness owns timing, warm-up and repetition; an adapter only performs the operation. Data
conversion into the peer's native form happens in :meth:`PeerAdapter.prepare`, outside the
timed region, the way an actor would hand the peer data it already holds in that form.

An adapter that cannot run raises :class:`PeerUnavailable` (its package is missing or broken);
an operation the peer does not offer raises :class:`OperationSkipped`. Neither is a benchmark
failure: the harness reports the reason and moves on.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import numpy as np


class PeerUnavailable(Exception):  # noqa: N818 - a status, not a programming error
    """The peer cannot run in this environment (not installed, or broken on import)."""


class OperationSkipped(Exception):  # noqa: N818 - a status, not a programming error
    """The peer does not offer this operation through its public API."""


@dataclass(frozen=True)
class Workload:
    """One benchmark workload: a spec of dimension ``dim`` and the buffer sizes.

    Attributes:
        dim: Observation dimension ``d`` (float32).
        capacity: Rows a replay buffer holds.
        batch: Rows per uniform or prioritized sample.
        epoch_rows: Rows of one on-policy rollout.
        minibatches: Shuffled mini-batches per on-policy epoch (``M``).
        seed: Seed of every random draw the adapters make.
    """

    dim: int
    capacity: int
    batch: int = 512
    epoch_rows: int = 8192
    minibatches: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("dim", "capacity", "batch", "epoch_rows", "minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.batch > self.capacity:
            raise ValueError(f"batch: {self.batch} rows exceed capacity {self.capacity}; "
                             f"lower --batches or raise --capacity")
        if self.epoch_rows % self.minibatches:
            raise ValueError(f"epoch_rows: {self.epoch_rows} is not a multiple of "
                             f"minibatches={self.minibatches}")

    @property
    def minibatch(self) -> int:
        """Rows per on-policy mini-batch."""
        return self.epoch_rows // self.minibatches

    @property
    def bytes_per_row(self) -> int:
        """Bytes of one row: float32 obs, int64 action, float32 reward, bool done."""
        return 4 * self.dim + 8 + 4 + 1


Chunk = dict[str, np.ndarray]
"""Rows in the benchmark's neutral form: ``obs`` (n, d) float32, ``action`` (n,) int64,
``reward`` (n,) float32, ``done`` (n,) bool."""


PRIORITY_POOL = 64
"""Priority arrays drawn per prioritized workload before timing starts (see
:func:`priorities`)."""


def priorities(workload: Workload, convert: Callable[[np.ndarray], Any] = np.asarray
               ) -> Iterator[Any]:
    """New priorities for each prioritized update, endlessly: :data:`PRIORITY_POOL` arrays of
    ``workload.batch`` float64 values in ``[1e-3, 1 + 1e-3)``, drawn once and cycled, so that
    a timed sample + update measures the buffer and not a random generator. Every peer gets
    the same values, each array passed through ``convert`` (to the peer's own type, for
    example ``torch.from_numpy``) before timing starts."""
    rng = np.random.default_rng(workload.seed)
    return itertools.cycle([convert(rng.random(workload.batch) + 1e-3)
                            for _ in range(PRIORITY_POOL)])


def make_chunk(rows: int, dim: int, *, seed: int = 0) -> Chunk:
    """Random rows of the benchmark spec (values do not matter, shapes and dtypes do)."""
    rng = np.random.default_rng(seed)
    done = np.zeros(rows, dtype=bool)
    done[-1] = True
    return {
        "obs": rng.standard_normal((rows, dim), dtype=np.float32),
        "action": rng.integers(0, 16, size=rows, dtype=np.int64),
        "reward": rng.standard_normal(rows, dtype=np.float32),
        "done": done,
    }


class PeerAdapter(abc.ABC):
    """Drives one peer buffer through its public API.

    Lifecycle, per workload: :meth:`setup` → (:meth:`insert`)* → (:meth:`sample_uniform`)* →
    :meth:`setup_prioritized` → (:meth:`insert` / :meth:`sample_prioritized_and_update`)* →
    :meth:`setup_on_policy` → (:meth:`insert`, :meth:`on_policy_epoch`)* → :meth:`close`.
    Each ``setup_*`` replaces the buffer built before it, so only one is alive at a time.

    Class attributes:
        name: Short row label (``"cpprb"``).
        description: What exactly is measured (class names, options).
        package: Distribution whose version is reported (``None`` for Conduit's own rows).
    """

    name: str = "peer"
    description: str = ""
    package: str | None = None

    def check(self) -> None:  # noqa: B027 - optional hook
        """Raise :class:`PeerUnavailable` with the reason if the peer cannot run here."""

    def version(self) -> str | None:
        """The installed version of :attr:`package`, if any."""
        if self.package is None:
            return None
        try:
            return metadata.version(self.package)
        except metadata.PackageNotFoundError:
            return None

    def notes(self) -> list[str]:
        """Caveats to print and record next to this peer's numbers."""
        return []

    def prepare(self, chunk: Chunk) -> Any:
        """Convert a chunk to the peer's native form (untimed). Default: unchanged."""
        return chunk

    @abc.abstractmethod
    def setup(self, workload: Workload) -> None:
        """Build an empty uniform replay buffer for ``workload``."""

    @abc.abstractmethod
    def insert(self, chunk: Any) -> None:
        """Add one prepared chunk to the current buffer."""

    @abc.abstractmethod
    def sample_uniform(self) -> Any:
        """Draw one uniform batch of ``workload.batch`` rows from the uniform buffer."""

    def setup_prioritized(self, workload: Workload) -> None:
        """Build an empty prioritized buffer (replacing the uniform one)."""
        raise OperationSkipped("no prioritized buffer")

    def sample_prioritized_and_update(self) -> Any:
        """Draw one prioritized batch and write a fresh priority for each of its rows."""
        raise OperationSkipped("no prioritized buffer")

    def setup_on_policy(self, workload: Workload) -> None:
        """Build an empty on-policy buffer of ``workload.epoch_rows`` rows."""
        raise OperationSkipped("no on-policy path")

    def on_policy_epoch(self) -> int:
        """Deliver one epoch of ``workload.minibatches`` shuffled mini-batches.

        The buffer was just filled with ``workload.epoch_rows`` rows; after the epoch it may
        be empty (consume-once). Returns the number of rows delivered.
        """
        raise OperationSkipped("no on-policy path")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the buffers and any threads or servers."""
