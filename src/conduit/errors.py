"""Typed errors raised by Conduit.

Every error derives from :class:`ConduitError`, so callers can catch the whole family with one
``except`` clause, and from the builtin a caller would expect (``ValueError``, ``RuntimeError``,
``TimeoutError``). Messages name the offending field (in the user's terms) and say what was
expected, so that the fix is obvious from the message alone (``docs/design.md §8``).
"""

from __future__ import annotations

from typing import Any


class ConduitError(Exception):
    """Base class of every error Conduit raises on purpose.

    Every subclass pickles with its message and attributes, whatever its constructor takes, so
    an error raised in a Ray task or actor reaches the caller as itself.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, dict(self.__dict__))


def _rebuild(cls: type[ConduitError], args: tuple[Any, ...], state: dict[str, Any]
             ) -> ConduitError:
    """An error of ``cls`` with ``args`` and attributes ``state``, its constructor skipped."""
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class ConfigError(ConduitError, ValueError):
    """A constructor argument or configuration value is invalid.

    Attributes:
        field: The name of the argument or configuration field at fault.
        reason: What is wrong with it (the message without the field's name).
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.reason = message
        super().__init__(f"{field}: {message}")


class SpecError(ConduitError, ValueError):
    """Data does not match the :class:`~conduit.spec.ExperienceSpec`.

    Attributes:
        field: The experience field at fault (``None`` when the whole batch is at fault).
    """

    def __init__(self, field: str | None, message: str) -> None:
        self.field = field
        prefix = f"field {field!r}: " if field is not None else ""
        super().__init__(prefix + message)


class CapacityError(ConduitError, ValueError):
    """A write or a placement does not fit.

    Attributes:
        needed: Rows or bytes needed.
        available: Rows or bytes available.
    """

    def __init__(self, message: str, *, needed: int | float | None = None,
                 available: int | float | None = None) -> None:
        self.needed = needed
        self.available = available
        super().__init__(message)


class PriorityError(ConduitError, ValueError):
    """Priorities are NaN, infinite, negative, or do not match their indices."""


class ScheduleError(ConduitError, ValueError):
    """A schedule lies outside the feasible space derived from the RL configuration."""


class PlacementError(ConduitError, ValueError):
    """A placement is malformed, names an unknown device, or cannot fit anywhere."""


class TopologyError(ConduitError, ValueError):
    """A topology description is malformed or inconsistent."""


class StaleRolloutError(ConduitError):
    """An on-policy rollout was produced by an older policy version than the current one."""


class EmptyBufferError(ConduitError):
    """A pull found no data and none arrived before the timeout."""


class PlaneClosedError(ConduitError, RuntimeError):
    """The plane was used after :meth:`~conduit.plane.ExperienceDataPlane.close`."""


class OperatorError(ConduitError, RuntimeError):
    """A registered ingestion or delivery operator raised.

    The original exception is attached as ``__cause__``, so its traceback is printed with this
    one.

    Attributes:
        operator: ``"ingestion"``, ``"delivery"`` or ``"runtime"`` (a worker that did not
            stop).
        lost_units: Rollout units whose ingestion failed, so their rows were not stored.
        lost_rows: Rows of those units.
        stored_rows: Rows the failed ingestion invocation wrote before it raised that stay
            in the buffer (0 when it wrote none, or they could be taken back); pushing the
            lost units again stores those rows a second time.
        unsettled_rows: Rows the failed invocation wrote whose write was sent but not
            acknowledged, and not found stored or not (a sharded plane's shard did not answer
            in time): they may still land, so pushing the lost units again may store them a
            second time (always 0 on a local plane).
    """

    def __init__(self, operator: str, original: BaseException, *, lost_units: int = 0,
                 lost_rows: int = 0, stored_rows: int = 0, unsettled_rows: int = 0) -> None:
        self.operator = operator
        self.lost_units = lost_units
        self.lost_rows = lost_rows
        self.stored_rows = stored_rows
        self.unsettled_rows = unsettled_rows
        lost = (f" ({lost_units} rollout units, {lost_rows} rows, were not stored)"
                if lost_units else "")
        if lost_units and (stored_rows or unsettled_rows):
            kept = (f"{stored_rows} rows the operator wrote before it raised stay in the "
                    f"buffer" if stored_rows else "")
            unknown = (f"{unsettled_rows} rows it wrote may still land (their shard did not "
                       f"answer in time)" if unsettled_rows else "")
            lost = (f" ({lost_units} rollout units, {lost_rows} rows, failed to ingest; "
                    f"{'; '.join(x for x in (kept, unknown) if x)})")
        super().__init__(f"{operator} operator raised {type(original).__name__}: "
                         f"{original}{lost}")


class DataLossError(ConduitError, RuntimeError):
    """``close()`` could not store every rollout that ``push`` acknowledged.

    The operator error that caused it, if any, is attached as ``__cause__``.

    Attributes:
        lost_units: Rollout units not stored.
        lost_rows: Rows of those units.
    """

    def __init__(self, message: str, *, lost_units: int, lost_rows: int) -> None:
        self.lost_units = lost_units
        self.lost_rows = lost_rows
        super().__init__(message)


class StateError(ConduitError, ValueError):
    """A state dict given to ``load_state_dict`` (or read from a checkpoint) is missing a key
    or holds a value that would corrupt the buffer.

    Attributes:
        key: Where the bad value sits, as a path (``"buffer.writer.cursor"``).
    """

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"state {key}: {message}")


class BackpressureTimeout(ConduitError, TimeoutError):  # noqa: N818 - reads as Reverb names it
    """A push waited longer than its timeout for room in the bounded actor queue, or a flush
    for ingestion to finish."""


def interrupt_of(exc: BaseException) -> KeyboardInterrupt | None:
    """The interrupt ``exc`` is or carries: ``exc`` itself, or the cause of an error an
    operator raised because it was interrupted (the plane wraps it, see
    :class:`OperatorError`); None for any other error."""
    if isinstance(exc, KeyboardInterrupt):
        return exc
    cause = exc.__cause__
    return cause if isinstance(cause, KeyboardInterrupt) else None


def raised_again(err: BaseException) -> BaseException:
    """A copy of the kept error ``err`` to raise to a caller: same type, arguments,
    attributes, causes and traceback. Raising ``err`` itself again and again would add every
    caller's frames, and whatever they refer to, to the kept object for good."""
    new = type(err).__new__(type(err), *err.args)
    new.__dict__.update(getattr(err, "__dict__", {}))
    if isinstance(getattr(err, "__notes__", None), list):
        new.__notes__ = list(err.__notes__)  # a note added to the copy stays on the copy
    new.args = err.args
    new.__cause__, new.__context__ = err.__cause__, err.__context__
    new.__suppress_context__ = err.__suppress_context__
    return new.with_traceback(err.__traceback__)
