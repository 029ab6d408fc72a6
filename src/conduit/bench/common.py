"""What the benchmarks share beyond :mod:`conduit.report`: progress lines, ``--quick`` and the
partial JSON an interrupted run leaves.

Benchmarks print a table and write JSON (and PNG where a picture reads better). They never
assert timings; tests assert behaviour (docs/design.md §9).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from conduit.cli_args import add_dataclass_args, parse_command
from conduit.errors import interrupt_of
from conduit.report import write_json

T = TypeVar("T")


def progress(msg: str) -> None:
    """Print one progress line."""
    print(f"  .. {msg}", flush=True)


def given_flags(cls: type, argv: Sequence[str], *, allow_abbrev: bool = True) -> frozenset[str]:
    """The fields of dataclass ``cls`` whose flags ``argv`` gives, read as the command's parser
    reads them: ``--flag=value``, ``--no-flag`` and (with ``allow_abbrev``) an unambiguous
    prefix of a flag count, whatever the value given.

    Args:
        cls: The dataclass the command's flags come from (see
            :func:`~conduit.cli_args.add_dataclass_args`).
        argv: The command's arguments, already accepted by its parser.
        allow_abbrev: Whether the command's parser takes a prefix of a flag.
    """
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=allow_abbrev)
    add_dataclass_args(probe, cls)
    unset = object()
    probe.set_defaults(**{f.name: unset for f in dataclasses.fields(cls) if f.init})
    ns, _ = probe.parse_known_args(list(argv))
    return frozenset(k for k, v in vars(ns).items() if v is not unset)


def apply_quick(args: T, quick: Mapping[str, Any], given: Collection[str] | None = None) -> T:
    """``args`` with the ``quick`` values where ``args.quick`` is set, for the fields not given:
    flags given explicitly win, whatever their value.

    Args:
        args: A benchmark's arguments: a dataclass with a ``quick`` field, every field
            defaulted.
        quick: Field name -> the value ``--quick`` gives it.
        given: The fields set explicitly (:func:`given_flags` of the command line). None, for
            arguments built in Python, counts the fields that differ from their defaults.
    """
    if not getattr(args, "quick", False):
        return args
    if given is None:
        defaults = type(args)()
        given = {k for k in quick if getattr(args, k) != getattr(defaults, k)}
    return dataclasses.replace(args, **{k: v for k, v in quick.items() if k not in given})


def parse_quick(parser: argparse.ArgumentParser, cls: type[T], argv: Sequence[str] | None,
                effective: Callable[[T, Collection[str] | None], T], *,
                check: Callable[[T], object] | None = None) -> T:
    """Parse a benchmark's ``argv`` into ``cls`` with ``--quick`` applied to the flags it does
    not give, checking the arguments the benchmark will run with.

    Args:
        parser: The command's parser (its ``--help`` and usage errors are the ones shown).
        cls: The benchmark's arguments dataclass.
        argv: The command's arguments (default: ``sys.argv[1:]``).
        effective: ``effective(args, given)``: the arguments after ``--quick`` for the fields
            not in ``given`` (:func:`apply_quick`).
        check: As for :func:`~conduit.cli_args.parse_command`, given the effective
            arguments.

    Returns:
        The effective arguments: pass them to the benchmark's ``run`` as they are.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser.parse_args(argv)  # --help and usage errors, from the command's own parser
    given = given_flags(cls, argv, allow_abbrev=parser.allow_abbrev)
    args = parse_command(parser, cls, argv, check=None if check is None
                         else lambda a: check(effective(a, given)))
    return effective(args, given)


class PartialJSON:
    """A benchmark's JSON, rewritten with ``"partial": true`` after every finished unit of
    work, so an interrupted run keeps what it measured. The finished run writes its own JSON
    over it (without the key).

    Used as a context manager around the measuring loop: an interrupt that ends it after a
    write carries a note naming the file, which ``conduit``'s one-line message shows.

    Args:
        path: The JSON file the benchmark writes at its end.
        with_machine: As for :func:`~conduit.report.write_json`.
    """

    def __init__(self, path: str | Path, *, with_machine: bool = True) -> None:
        self.path = Path(path)
        self.with_machine = with_machine
        self.written = False

    def write(self, data: Mapping[str, Any]) -> Path:
        """Replace the file by ``data`` with ``"partial": true`` (whole or not at all: an
        interrupt while writing leaves the previous version).

        Raises:
            ConfigError: The file cannot be written (field ``out``).
        """
        tmp = self.path.with_name(f".{self.path.name}.partial")
        write_json(tmp, {**data, "partial": True}, with_machine=self.with_machine,
                   field="out")
        os.replace(tmp, self.path)
        self.written = True
        return self.path

    def __enter__(self) -> PartialJSON:
        return self

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        interrupt = None if exc is None else interrupt_of(exc)
        if interrupt is not None and self.written:
            interrupt.add_note(f"partial results in {self.path}")


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
