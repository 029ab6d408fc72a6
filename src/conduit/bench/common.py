"""Shared helpers for benchmarks: medians, tables, JSON and machine description.

Benchmarks print a table and write JSON (and PNG where a picture reads better). They never
assert timings; tests assert behaviour.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
import torch


def machine() -> dict[str, Any]:
    """What the numbers were measured on, including the load other processes put on it."""
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


def median_time(fn: Callable[[], Any], *, repeats: int = 30, warmup: int = 3,
                sync: Callable[[], None] | None = None) -> float:
    """Median wall seconds of ``fn()`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table."""
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


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (plus the machine description) as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2, default=str))
    return path


def progress(msg: str) -> None:
    """One progress line on stderr-like output (kept simple: no extra dependency)."""
    print(f"  .. {msg}", flush=True)
