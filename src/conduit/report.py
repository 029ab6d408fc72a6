"""Output shared by the benchmarks, the trainers and the CLI: JSON files, text tables, and
PNG figures when the optional ``plots`` extra (matplotlib) is installed.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import torch

from conduit.errors import ConfigError


def machine() -> dict[str, Any]:
    """What a figure was measured on, including the load other processes put on it."""
    return {"host": platform.node(), "cpu": _cpu_model(), "cores": os.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def finite(data: Any) -> Any:
    """``data`` with every non-finite float (NaN, ±inf) replaced by None, recursively, so
    that it serialises as strict JSON."""
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite(v) for v in data]
    if isinstance(data, float) and not math.isfinite(data):
        return None
    return data


def check_output_path(path: str | Path, field: str, *, directory: bool = False) -> Path:
    """Check, before any work is done, that an output can be written at ``path``.

    Creates the folder that will hold the output (``path`` itself when ``directory``, else
    its parent) when it does not exist yet.

    Args:
        path: The output file, or the output folder when ``directory`` is true.
        field: The option that named ``path`` (``"json_out"`` for ``--json-out``); errors
            name it.
        directory: ``path`` is a folder that outputs are written into.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ConfigError: ``path`` is a folder where a file is expected (or a file where a folder
            is), or its folder cannot be created or written (field ``field``).
    """
    p = Path(path)
    flag = "--" + field.replace("_", "-")
    if directory and p.exists() and not p.is_dir():
        raise ConfigError(field, f"{str(p)!r} is a file, not a folder; pass a folder to {flag}")
    if not directory and p.is_dir():
        raise ConfigError(field, f"{str(p)!r} is a folder; pass a file path to {flag}")
    folder = p if directory else p.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(field, f"cannot create the folder {str(folder)!r} "
                                 f"({exc.strerror or exc}); pass a {flag} path in a writable "
                                 "folder") from exc
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(field, f"the folder {str(folder)!r} is not writable; pass a {flag} "
                                 "path in a writable folder")
    return p


FIGURE_SUFFIXES = (".png", ".pdf", ".svg")
"""The figure formats :func:`save_figure` is asked to write (matplotlib takes the format from
the file's suffix)."""


def check_figure_path(path: str | Path, field: str) -> None:
    """Check, before any work is done, that ``path`` names a figure format
    (:data:`FIGURE_SUFFIXES`), so a run does not fail at its end when saving its figure.

    Raises:
        ConfigError: ``path`` ends in another suffix, or none (field ``field``).
    """
    suffix = Path(path).suffix
    if suffix.lower() not in FIGURE_SUFFIXES:
        raise ConfigError(field, f"{str(path)!r} must end in {', '.join(FIGURE_SUFFIXES[:-1])} "
                                 f"or {FIGURE_SUFFIXES[-1]} (the figure's format), got "
                                 + (f"{suffix!r}" if suffix else "no suffix"))


def write_json(path: str | Path, data: Any, *, with_machine: bool = False,
               field: str = "path") -> Path:
    """Write ``data`` as indented, strict JSON, creating parent folders.

    Args:
        path: File to write.
        data: JSON-friendly data; non-finite floats become null, other objects their ``str``.
        with_machine: Put :func:`machine` under the key ``"machine"`` first (``data`` must
            then be a dict).
        field: The option that named ``path``; an error names it.

    Returns:
        The path written.

    Raises:
        ConfigError: ``path`` cannot be written (field ``field``).
    """
    p = Path(path)
    payload = {"machine": machine(), **data} if with_machine else data
    text = json.dumps(finite(payload), indent=2, default=str)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    except OSError as exc:
        raise ConfigError(field, f"cannot write {str(p)!r} ({exc.strerror or exc}); pass a "
                                 f"path in a writable folder") from exc
    return p


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain, left-aligned text table."""
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join([line, sep, *body])


def _fmt(c: Any) -> str:
    if isinstance(c, float):
        return f"{c:.3f}" if abs(c) < 1000 else f"{c:.0f}"
    return str(c)


def signed_percent(change: float) -> str:
    """A relative change as a signed percentage: ``0.1 -> "+10%"``, ``-0.25 -> "-25%"``."""
    return f"{100 * change:+.0f}%"


_NOTED = False


def pyplot() -> ModuleType | None:
    """matplotlib's ``pyplot`` on the non-interactive Agg backend, or None when the optional
    ``plots`` extra is not installed (a one-line note then goes to stderr, once per process).
    """
    global _NOTED
    try:
        import matplotlib
    except ImportError:
        if not _NOTED:
            print("note: matplotlib is not installed, so no PNG is written "
                  "(pip install 'conduit-rl[plots]')", file=sys.stderr, flush=True)
            _NOTED = True
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, *, dpi: int = 120) -> Path:
    """Save a figure made with :func:`pyplot` as PNG (creating parent folders) and close it."""
    plt = pyplot()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=dpi, bbox_inches="tight")
    if plt is not None:
        plt.close(fig)
    return p
