"""GEAR, represented by its placement: experience in pinned (page-locked) host memory.

GEAR cannot be installed next to this project (it pins torch 1.13 and CUDA 11.7). As in the
paper, it is represented by where it keeps experience: pinned host memory, read by the learner
over PCIe. The row is Conduit's own buffer built for ``Placement.pinned()``, so it measures
GEAR's *placement*, not GEAR's code, and is labelled ``gear-placement``.

Pinning needs CUDA. On a CPU-only machine ``Placement.pinned()`` falls back to pageable memory,
so this row then measures exactly what the ``conduit`` row measures; the harness says so next
to the numbers.
"""

from __future__ import annotations

import torch

from conduit.bench.peers.conduit_peer import ConduitPeer
from conduit.storage import Placement


class GearPlacementPeer(ConduitPeer):
    """GEAR's placement (pinned host memory) executed by Conduit's storage."""

    name = "gear-placement"
    description = ("GEAR represented by its placement: pinned host memory "
                   "(conduit ExperienceBuffer on Placement.pinned()); not GEAR's code")
    package = None

    def __init__(self) -> None:
        super().__init__(placement=Placement.pinned())

    def notes(self) -> list[str]:
        out = ["GEAR is not installable here (torch 1.13 / CUDA 11.7 pins); this row is its "
               "placement, run by Conduit's storage, not GEAR itself"]
        if not torch.cuda.is_available():
            out.append("no CUDA on this machine: memory cannot be pinned, so this row ran on "
                       "pageable memory, the same code as the conduit row; its ratios show "
                       "the run's noise floor")
        return out

    def pinned(self) -> bool:
        """Whether the current buffer's memory is actually page-locked."""
        buf = self._buf
        return bool(buf is not None and getattr(buf.store, "pinned", False))
