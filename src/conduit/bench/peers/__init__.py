"""``conduit bench peers``: Conduit next to TorchRL, cpprb, RLlib, Reverb and GEAR's placement.

Run it with ``conduit bench peers`` or ``python -m conduit.bench.peers`` (``--help`` lists
every option). See :mod:`conduit.bench.peers.harness` for what is measured and how.
"""

from conduit.bench.peers.harness import main

__all__ = ["main"]
