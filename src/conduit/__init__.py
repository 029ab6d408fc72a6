"""Conduit: an Experience Data Plane for distributed reinforcement learning.

The public surface is small:

* :class:`ExperienceSpec` / :class:`FieldSpec`: what one sample holds;
* :class:`ExperienceDataPlane`: push rollouts in, pull training-ready batches out, with
  ``register_ingestion`` / ``register_delivery`` for framework logic;
* :class:`Schedule`: overlap and granularity of ingestion and delivery;
* :class:`Placement`: where the buffer lives;
* ``plane.save(path)`` / :meth:`ExperienceDataPlane.load`: checkpoints on disk;
* the :class:`ConduitError` family of typed errors.
"""

from conduit.errors import (
    BackpressureTimeout,
    CapacityError,
    ConduitError,
    ConfigError,
    DataLossError,
    EmptyBufferError,
    OperatorError,
    PlacementError,
    PlaneClosedError,
    PriorityError,
    ScheduleError,
    SpecError,
    StaleRolloutError,
    StateError,
    TopologyError,
)
from conduit.plane import ExperienceDataPlane
from conduit.scheduling.space import Schedule, feasible_space
from conduit.spec import ExperienceSpec, FieldSpec
from conduit.storage import CheckpointError, Placement

__version__ = "0.1.0"

__all__ = [
    "BackpressureTimeout",
    "CapacityError",
    "CheckpointError",
    "ConduitError",
    "ConfigError",
    "DataLossError",
    "EmptyBufferError",
    "ExperienceDataPlane",
    "ExperienceSpec",
    "FieldSpec",
    "OperatorError",
    "Placement",
    "PlacementError",
    "PlaneClosedError",
    "PriorityError",
    "Schedule",
    "ScheduleError",
    "SpecError",
    "StaleRolloutError",
    "StateError",
    "TopologyError",
    "__version__",
    "feasible_space",
]
