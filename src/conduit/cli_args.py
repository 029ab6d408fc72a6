"""Build ``argparse`` parsers from frozen dataclasses, so every CLI flag documents itself.

Each dataclass field becomes ``--field-name``; its help text comes from
``field(metadata={"help": ...})``; ``Literal`` types become ``choices``; ``bool`` fields become
``--flag/--no-flag``. Numeric flags are checked as they are parsed: an ``int`` is at least
``metadata["min"]`` (0 when unset), a ``float`` is a number (not NaN) and at least
``metadata["min"]`` when set, a ``float`` with ``metadata["finite"]`` is not infinite, and a
``float`` with ``metadata["positive"]`` is finite and above 0; a number is at most
``metadata["max"]`` when set; a ``str`` (or each item of a tuple of ``str``) is one of
``metadata["choices"]`` when set. So a bad value is a usage error naming the flag. A field with
``metadata["output"]`` (``"file"`` or ``"dir"``) names an output path, checked by
:func:`parse_dataclass` before any work is done. Checks that need more than one value (or a
library) run in :func:`parse_command`, whose ``check`` turns a
:class:`~conduit.errors.ConfigError` into a usage error naming the flag too. Docstrings used as
help are turned into plain text (:func:`plain_text`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~?)([^`]*?)(?:\s*<[^`>]*>)?`")
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)


def plain_text(text: str) -> str:
    """``text`` with reStructuredText inline markup removed, for a terminal.

    Literals lose their double backquotes. A cross-reference (a role such as ``:func:``)
    becomes its title when it has one, otherwise its target, shortened to the last dotted
    component when the target starts with a tilde.
    """
    def role(m: re.Match[str]) -> str:
        short, target = m.groups()
        return target.rsplit(".", 1)[-1] if short else target

    return _LITERAL.sub(r"\1", _ROLE.sub(role, text))


def command_parser(prog: str, doc: str | None, cls: type | None = None
                   ) -> argparse.ArgumentParser:
    """The parser of one ``conduit`` command.

    Args:
        prog: Command name shown in usage (``"conduit bench plane"``).
        doc: Description, usually the command module's docstring; printed as plain text with
            its line breaks kept.
        cls: Dataclass whose fields become the flags (see :func:`add_dataclass_args`).
    """
    parser = argparse.ArgumentParser(prog=prog, description=plain_text(doc or ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if cls is not None:
        add_dataclass_args(parser, cls)
    return parser


def arg(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with CLI help text: ``x: int = arg(3, "what x is")``.

    Keyword arguments go into the field's metadata: ``min=`` and ``max=`` are the smallest
    and largest values the flag accepts, ``finite=True`` refuses infinities,
    ``positive=True`` asks a ``float`` to be finite and above 0, ``choices=`` lists the values
    a ``str`` flag (or each item of a tuple of ``str``) accepts (see
    :func:`add_dataclass_args`), and ``output="file"`` or ``output="dir"`` marks
    an output path (see :func:`parse_dataclass`).
    """
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: default, metadata={"help": help, **kw})
    return dataclasses.field(default=default, metadata={"help": help, **kw})


def _number(tp: type, low: float | None, positive: bool = False,
            high: float | None = None, finite: bool = False) -> Any:
    """An argparse ``type`` that parses ``tp`` and refuses NaN, values below ``low`` and
    values above ``high``; with ``finite``, also infinities; with ``positive``, also
    infinities and values that are not above 0."""
    def parse(text: str) -> Any:
        try:
            value = tp(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {tp.__name__}, got {text!r}") from None
        if value != value:
            raise argparse.ArgumentTypeError("expected a number, got NaN")
        if low is not None and value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        if finite and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if positive and not (0 < value < math.inf):
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {text}")
        return value

    parse.__name__ = tp.__name__
    return parse


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one ``--flag`` per field of dataclass ``cls`` to ``parser``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_text = plain_text(f.metadata.get("help", ""))
        least = (f"; at least {f.metadata['min']}" if "min" in f.metadata
                 else "; above 0" if f.metadata.get("positive") else "")
        if "max" in f.metadata:
            least += f"; at most {f.metadata['max']}"
        kw: dict[str, Any] = {"dest": f.name, "default": default,
                              "help": f"{help_text} (default: {default!r}{least})"}
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
            non_none = [a for a in args if a is not type(None)]
            tp = non_none[0] if len(non_none) == 1 else str
            origin, args = typing.get_origin(tp), typing.get_args(tp)
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif origin is typing.Literal:
            kw["choices"] = list(args)
            kw["type"] = type(args[0])
        elif origin in (list, tuple):
            kw["nargs"] = "+"
            item = args[0] if args else str
            kw["type"] = _number(item, f.metadata.get("min", 0 if item is int else None),
                                 f.metadata.get("positive", False), f.metadata.get("max"),
                                 f.metadata.get("finite", False)) \
                if item in (int, float) else item
            if "choices" in f.metadata:  # listed once in the help, not per item in usage
                kw["choices"] = list(f.metadata["choices"])
                kw["metavar"] = f.name.upper()
                kw["help"] = (f"{help_text}: any of {', '.join(map(str, kw['choices']))} "
                              f"(default: {default!r})")
        elif tp in (int, float):
            kw["type"] = _number(tp, f.metadata.get("min", 0 if tp is int else None),
                                 f.metadata.get("positive", False), f.metadata.get("max"),
                                 f.metadata.get("finite", False))
        elif tp is str:
            kw["type"] = tp
            if "choices" in f.metadata:
                kw["choices"] = list(f.metadata["choices"])
        else:
            kw["type"] = str
        parser.add_argument(flag, **kw)


def check_reachable(field: str, address: str, *, timeout: float = 3.0) -> None:
    """Refuse a ``HOST:PORT`` address (optionally ``scheme://HOST:PORT``) nothing listens on.

    A TCP connection is opened and closed within ``timeout`` seconds, so a client that would
    retry an unreachable address for minutes (``ray.init``) is not started at all. ``auto``,
    ``local`` and the empty string are left to the client: they name no host.

    Raises:
        ConfigError: ``address`` is not ``HOST:PORT`` with an integer port, or no connection
            opens within ``timeout`` seconds (field: ``field``).
    """
    import socket

    from conduit.errors import ConfigError

    if address in ("", "auto", "local"):
        return
    host, _, port = address.partition("://")[2].rpartition(":") if "://" in address \
        else address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(field, f"expected HOST:PORT, got {address!r}")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise ConfigError(field, f"nothing answers at {address!r} within {timeout:g} s ({exc}); "
                                 "start the cluster or give its address") from exc


def usage_error(parser: argparse.ArgumentParser, field: str, message: str) -> NoReturn:
    """Exit with a usage error (status 2) naming the flag of dataclass field ``field``."""
    parser.error(f"argument --{field.replace('_', '-')}: {message}")


def parse_command(parser: argparse.ArgumentParser, cls: type[T],
                  argv: Sequence[str] | None = None, *,
                  check: Callable[[T], object] | None = None) -> T:
    """Parse ``argv`` with ``parser`` into ``cls``, running ``check`` before any output folder
    is created.

    ``check`` gets the instance and raises :class:`~conduit.errors.ConfigError` naming a field
    for a value the flags' own checks cannot judge (one that depends on another flag, on a
    library or on this machine); it becomes a usage error naming that field's flag (exit
    status 2). The output paths are then checked as :func:`parse_dataclass` does.
    """
    from conduit.errors import ConfigError

    ns = parser.parse_args(argv)
    if check is not None:
        try:
            check(cls(**_values(cls, ns)))
        except ConfigError as exc:
            usage_error(parser, exc.field, exc.reason)
    return parse_dataclass(cls, ns)


def _values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if f.init and hasattr(args, f.name)}
    for f in dataclasses.fields(cls):
        if f.name in values and isinstance(values[f.name], list):
            hint = typing.get_type_hints(cls)[f.name]
            if typing.get_origin(hint) is tuple:
                values[f.name] = tuple(values[f.name])
    return values


def parse_dataclass(cls: type[T], args: argparse.Namespace) -> T:
    """Instantiate ``cls`` from the parsed ``args``.

    A non-empty field marked ``output="file"`` or ``output="dir"`` is checked with
    :func:`~conduit.report.check_output_path` first, so an output that cannot be written fails
    before the command does its work.

    Raises:
        ConfigError: An output path cannot be written (field: the dataclass field).
    """
    values = _values(cls, args)
    outputs = [(f.name, f.metadata["output"]) for f in dataclasses.fields(cls)
               if f.metadata.get("output") and values.get(f.name)]
    if outputs:
        from conduit.report import check_output_path

        for name, kind in outputs:
            check_output_path(values[name], name, directory=kind == "dir")
    return cls(**values)
