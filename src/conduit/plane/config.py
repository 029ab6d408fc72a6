"""The plane's validated configuration: one frozen record, checked once at construction."""

from __future__ import annotations

import numbers
import threading
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from conduit._checks import check_device, check_int
from conduit.errors import ConfigError
from conduit.scheduling.space import MAX_MINIBATCHES, Mode, Schedule, ScheduleSpace, feasible_space
from conduit.spec import ExperienceSpec


def policy_version(v: object) -> int | None:
    """A push's ``policy_version`` as an ``int`` (None stays None).

    Raises:
        ConfigError: Not an integer (a Python or NumPy integer, or a 0-d integer tensor).
    """
    if v is None:
        return None
    if isinstance(v, torch.Tensor) and v.dim() == 0 and not (
            v.is_floating_point() or v.is_complex() or v.dtype == torch.bool):
        return int(v)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):  # (NumPy's are Integral)
        raise ConfigError("policy_version", f"must be an integer (the version of the policy "
                                            f"that produced the rollout) or None, got {v!r}")
    return int(v)



def wait_seconds(timeout: float | None, *, default: float) -> float:
    """Seconds a call may wait: ``timeout``, or ``default`` when None.

    Raises:
        ConfigError: (field ``timeout``) It is not a number >= 0 and at most
            ``threading.TIMEOUT_MAX`` (a longer wait than the platform's clock takes).
    """
    if timeout is None:
        return default
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
            or not 0 <= timeout <= threading.TIMEOUT_MAX):
        raise ConfigError("timeout", f"must be a number of seconds >= 0 and at most "
                                     f"{threading.TIMEOUT_MAX:.4g} (threading.TIMEOUT_MAX), "
                                     f"got {timeout!r}")
    return float(timeout)


@dataclass(frozen=True, kw_only=True)
class PlaneConfig:
    """What an :class:`~conduit.plane.ExperienceDataPlane` was asked to be (see its Args).

    Every field is validated in ``__post_init__``; a bad value raises
    :class:`~conduit.errors.ConfigError` naming the field.

    Raises:
        ConfigError: A field is invalid, among them a ``rollout_spec`` that is neither None nor
            an ExperienceSpec, and a ``num_epochs`` other than 1 off-policy (epochs are
            on-policy only).
    """

    spec: ExperienceSpec
    capacity: int
    mode: Mode = "off_policy"
    batch_size: int = 256
    num_minibatches: int = 1
    num_epochs: int = 1
    min_size: int | None = None
    rollout_spec: ExperienceSpec | None = None
    rollout_rows: int | None = None
    g_max: int = 8
    max_priority_lag: int = 0
    timeout: float = 60.0
    seed: int = 0
    learner_device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        if not isinstance(self.spec, ExperienceSpec):
            raise ConfigError("spec", f"expected an ExperienceSpec, got "
                                      f"{type(self.spec).__name__}")
        if self.mode not in ("off_policy", "on_policy"):
            raise ConfigError("mode", f"must be 'off_policy' or 'on_policy', got {self.mode!r}")
        # Integers are stored as Python ints (a NumPy integer is taken, and kept as JSON's int).
        for name in ("capacity", "batch_size", "num_minibatches", "num_epochs", "g_max"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=1))
        if self.rollout_spec is not None and not isinstance(self.rollout_spec, ExperienceSpec):
            raise ConfigError("rollout_spec", f"expected None or an ExperienceSpec (the spec "
                                              f"pushed rollouts must match), got "
                                              f"{self.rollout_spec!r}")
        if self.mode == "off_policy" and self.num_epochs != 1:
            raise ConfigError("num_epochs", f"only applies on-policy (passes over each "
                                            f"iteration's rows); an off-policy plane samples "
                                            f"without epochs, so leave it at 1 or pass "
                                            f"mode='on_policy', got {self.num_epochs}")
        if self.mode == "off_policy" and self.batch_size > self.capacity:
            raise ConfigError("batch_size", f"{self.batch_size} exceeds capacity {self.capacity}")
        if self.mode == "on_policy" and self.num_minibatches > self.capacity:
            raise ConfigError("num_minibatches", f"{self.num_minibatches} mini-batches cannot be "
                                                 f"cut from {self.capacity} rows per iteration")
        if (isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float))
                or not 0 < self.timeout <= threading.TIMEOUT_MAX):
            raise ConfigError("timeout", f"must be a number of seconds > 0 and at most "
                                         f"{threading.TIMEOUT_MAX:.4g} (threading.TIMEOUT_MAX), "
                                         f"got {self.timeout!r}")
        object.__setattr__(self, "max_priority_lag",
                           check_int("max_priority_lag", self.max_priority_lag, minimum=0))
        for name in ("min_size", "rollout_rows"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)
                                  or not 1 <= v <= self.capacity):
                raise ConfigError(name, f"must be an integer in [1, capacity={self.capacity}], "
                                        f"got {v!r}")
            if v is not None:
                object.__setattr__(self, name, int(v))
        if self.rollout_rows is not None and self.mode != "on_policy":
            raise ConfigError("rollout_rows", "only applies on-policy; off-policy "
                                              "granularity already counts rollout units")
        object.__setattr__(self, "seed", check_int("seed", self.seed, minimum=0))
        object.__setattr__(self, "learner_device",
                           check_device("learner_device", self.learner_device))

    def wait_for(self, timeout: float | None) -> float:
        """Seconds a call may wait: ``timeout``, or the plane's when None.

        Raises:
            ConfigError: ``timeout`` is not a number >= 0 and at most ``threading.TIMEOUT_MAX``
                (a longer wait than the platform's clock takes).
        """
        return wait_seconds(timeout, default=self.timeout)

    @property
    def on_policy(self) -> bool:
        """Whether the plane delivers each iteration's rows exactly once per epoch."""
        return self.mode == "on_policy"

    @property
    def train_batch_size(self) -> int:
        """Rows per training batch: ``batch_size`` off-policy, ``capacity // M`` on-policy."""
        return self.capacity // self.num_minibatches if self.on_policy else self.batch_size

    @property
    def first_batch_rows(self) -> int:
        """Rows needed before the first batch: ``min_size``, by default one batch off-policy
        and the whole iteration on-policy."""
        if self.min_size is not None:
            return self.min_size
        return self.capacity if self.on_policy else self.batch_size

    @property
    def batches_per_iteration(self) -> int:
        """On-policy: mini-batches delivered per iteration (M × epochs)."""
        return self.num_minibatches * self.num_epochs

    def schedule_space(self) -> ScheduleSpace:
        """The feasible schedules (docs/design.md §6). A fixed on-policy rollout size adds
        its share of the iteration to the ingestion granularities, when representable."""
        unit = None
        if self.rollout_rows is not None:
            unit = Fraction(self.rollout_rows, self.capacity)
            if unit.denominator > MAX_MINIBATCHES:
                unit = None
        return feasible_space(mode=self.mode, num_minibatches=self.num_minibatches,
                              g_max_ing=self.g_max, g_max_del=self.g_max,
                              unit_fraction_ing=unit)

    def default_schedule(self) -> Schedule:
        """Everything inline, one unit per invocation (on-policy delivery: one mini-batch)."""
        return Schedule(0, 1, 0, Fraction(1, self.num_minibatches) if self.on_policy else 1)
