"""Lazy access to the Numba-compiled kernel modules of the storage layer.

Numba is imported with the first structure that needs a kernel, not with ``conduit``, because
its import is slow. Where it cannot be imported, callers fall back to their numpy path
(``docs/design.md §7``).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


@functools.cache
def load(name: str) -> ModuleType | None:
    """The compiled module ``conduit.storage.<name>``, or None where Numba cannot load."""
    try:
        return importlib.import_module(f"conduit.storage.{name}")
    except ImportError:  # pragma: no cover - depends on the environment
        return None
