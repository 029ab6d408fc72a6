"""Memory endpoint names shared by the topology and the bandwidth profiler.

Inside a node an endpoint is ``"cpu"`` (pageable host memory), ``"cpu_pinned"`` (page-locked
host memory) or an accelerator named like a torch device (``"cuda:0"``).
"""

from __future__ import annotations

CPU = "cpu"
"""Pageable host memory endpoint."""
CPU_PINNED = "cpu_pinned"
"""Page-locked host memory endpoint."""


def device_kind(name: str) -> str:
    """The kind of an endpoint name: ``"cpu"``, ``"cpu_pinned"`` or the accelerator type.

    Args:
        name: An unqualified endpoint name such as ``"cuda:3"``.

    Returns:
        ``"cpu"``, ``"cpu_pinned"``, or the part before the colon (``"cuda"``).
    """
    if name in (CPU, CPU_PINNED):
        return name
    return name.split(":", 1)[0]


def is_accelerator(name: str) -> bool:
    """True for accelerator endpoints (``"cuda:0"``), False for host endpoints."""
    return device_kind(name) not in (CPU, CPU_PINNED)
