"""Thread control for the data path.

Measured on a 2-core machine: ``torch.index_select`` of 512 rows from a 400 MB tensor took 7 ms
with torch's default intra-op threads under load and 0.06 ms with one. Gathers and copies of a
few MB gain nothing from intra-op parallelism, so the data path pins its own thread count
instead of leaving it to whatever the process was configured with. In this torch build the
setting is per OS thread, so a worker thread can use one thread while the learner keeps its own.
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
