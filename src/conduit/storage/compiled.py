"""Lazy access to the Numba-compiled kernel modules of the storage layer.

Numba is a core dependency, but it is imported with the first structure that needs a kernel,
not with ``conduit``: it adds about 0.3 s to an import. Where it cannot be imported, callers
fall back to their numpy path.
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
