"""The Experience Data Plane: control points, ports, and the operator runtime."""

from conduit.plane.autotune import AutoScheduler, profile_plane
from conduit.plane.data_plane import ActorPort, ExperienceDataPlane, LearnerPort
from conduit.plane.ports import ActorIn, BufferIn, BufferOut, LearnerOut

__all__ = [
    "ActorIn",
    "ActorPort",
    "AutoScheduler",
    "BufferIn",
    "BufferOut",
    "ExperienceDataPlane",
    "LearnerOut",
    "LearnerPort",
    "profile_plane",
]
