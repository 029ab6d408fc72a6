"""The Experience Data Plane: a thin front over flows, runners and the operator runtime
(docs/design.md §2), plus the scheduling policy that tunes it at run time (§6)."""

from conduit.plane.autotune import AutoScheduler, plane_copy_times, profile_plane, tuning_space
from conduit.plane.data_plane import ActorPort, ExperienceDataPlane, LearnerPort
from conduit.plane.ports import ActorIn, BufferIn, BufferOut, LearnerOut
from conduit.plane.tuner import WarmupScheduleTuner

__all__ = [
    "ActorIn",
    "ActorPort",
    "AutoScheduler",
    "BufferIn",
    "BufferOut",
    "ExperienceDataPlane",
    "LearnerOut",
    "LearnerPort",
    "WarmupScheduleTuner",
    "plane_copy_times",
    "profile_plane",
    "tuning_space",
]
