"""The frozen copy of the policy that old log-probs are computed on."""

from __future__ import annotations

import copy

import torch


class OldPolicy:
    """A frozen copy of ``model`` in eval mode, loaded with the model's weights each time an
    iteration is generated, so that its log-probs are the generating policy's.

    Args:
        model: The policy to copy.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.params = (list(self.module.parameters()), list(model.parameters()))

    def sync(self) -> None:
        """Load the policy's current weights (those that generate the next iteration)."""
        with torch.no_grad():
            torch._foreach_copy_(*self.params)


__all__ = ["OldPolicy"]
