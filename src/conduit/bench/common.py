"""What the benchmarks share beyond :mod:`conduit.report`: progress lines, and ``--quick``.

Benchmarks print a table and write JSON (and PNG where a picture reads better). They never
assert timings; tests assert behaviour (docs/design.md §9).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def progress(msg: str) -> None:
    """Print one progress line."""
    print(f"  .. {msg}", flush=True)


def apply_quick(args: T, quick: Mapping[str, Any]) -> T:
    """``args`` with the ``quick`` values where ``args.quick`` is set, for the fields left at
    their defaults only: flags given explicitly win, as in ``conduit bench schedule`` and
    ``conduit bench peers``. (A flag given with its default value counts as left at it.)

    Args:
        args: A benchmark's arguments: a dataclass with a ``quick`` field, every field
            defaulted.
        quick: Field name -> the value ``--quick`` gives it.
    """
    if not getattr(args, "quick", False):
        return args
    defaults = type(args)()
    return dataclasses.replace(args, **{k: v for k, v in quick.items()
                                        if getattr(args, k) == getattr(defaults, k)})


def check_rows(*, batch_size: int, capacity: int, rollout_rows: int) -> None:
    """Refuse ``--batch-size`` or ``--rollout-rows`` above ``--capacity`` (the flags of a
    benchmark that fills a plane with rollout units and samples batches from it).

    Raises:
        ConfigError: Naming ``batch_size`` or ``rollout_rows``.
    """
    from conduit.errors import ConfigError

    if batch_size > capacity:
        raise ConfigError("batch_size", f"{batch_size} rows exceed --capacity {capacity}; "
                                        "lower --batch-size or raise --capacity")
    if rollout_rows > capacity:
        raise ConfigError("rollout_rows", f"one rollout unit of {rollout_rows} rows exceeds "
                                          f"--capacity {capacity}; lower --rollout-rows or "
                                          "raise --capacity")
