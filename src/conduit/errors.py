"""Typed errors raised by Conduit.

Every error derives from :class:`ConduitError`, so callers can catch the whole family with one
``except`` clause. Messages name the offending field (in the user's terms) and say what was
expected, so that the fix is obvious from the message alone.
"""

from __future__ import annotations


class ConduitError(Exception):
    """Base class of every error Conduit raises on purpose."""


class ConfigError(ConduitError, ValueError):
    """A constructor argument or configuration value is invalid.

    Attributes:
        field: The name of the argument or configuration field at fault.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
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
        operator: ``"ingestion"`` or ``"delivery"``.
    """

    def __init__(self, operator: str, original: BaseException) -> None:
        self.operator = operator
        super().__init__(f"{operator} operator raised {type(original).__name__}: {original}")


class BackpressureTimeout(ConduitError, TimeoutError):  # noqa: N818 - reads as Reverb names it
    """A push waited longer than its timeout for room in the bounded actor queue."""
