"""Thread control for the data path.

The data path sets its own torch intra-op thread count (one by default) instead of inheriting
the process's: gathers and copies of a few MB gain nothing from intra-op parallelism, and a
thread pool competing with the learner for cores slows them down (``docs/design.md §7``). The
setting applies to the calling OS thread, so a worker can run with one thread while the learner
keeps its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def data_path_threads(n: int = 1) -> Iterator[None]:
    """Run the body with ``n`` torch intra-op threads on this OS thread, then restore."""
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
