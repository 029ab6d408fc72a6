"""TRL integration: :class:`ConduitGRPOTrainer`, a ``trl.GRPOTrainer`` whose experience path is
a Conduit on-policy plane (needs the ``conduit-rl[trl]`` extra)."""

from conduit.integrations.trl.trainer import ConduitGRPOTrainer

__all__ = ["ConduitGRPOTrainer"]
