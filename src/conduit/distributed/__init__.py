"""Scale-out on Ray: one plane whose buffer is sharded over Ray actors on several nodes
(``pip install 'conduit-rl[ray]'``).

Ray is imported only when a plane is built, so ``import conduit.distributed`` works without it
and building a plane without it raises :class:`RayUnavailableError`.
"""

from conduit.distributed.cluster import ShardRecovery, ShardResources
from conduit.distributed.delivery import LearnerPort
from conduit.distributed.errors import (
    ClusterConnectionError,
    RayUnavailableError,
    ShardUnavailableError,
)
from conduit.distributed.plane import ActorPort, RayExperienceDataPlane

__all__ = [
    "ActorPort",
    "ClusterConnectionError",
    "LearnerPort",
    "RayExperienceDataPlane",
    "RayUnavailableError",
    "ShardRecovery",
    "ShardResources",
    "ShardUnavailableError",
]
