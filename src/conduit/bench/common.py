"""What the benchmarks share beyond :mod:`conduit.report`: progress lines.

Benchmarks print a table and write JSON (and PNG where a picture reads better). They never
assert timings; tests assert behaviour (docs/design.md §9).
"""

from __future__ import annotations


def progress(msg: str) -> None:
    """Print one progress line."""
    print(f"  .. {msg}", flush=True)
