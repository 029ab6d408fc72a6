"""Typed errors of the Ray-sharded plane (the ``conduit.errors`` family, raised only here)."""

from __future__ import annotations

from conduit.errors import ConduitError

RAY_HINT = "pip install 'conduit-rl[ray]'"
"""The command that installs the Ray extra."""


class RayUnavailableError(ConduitError, ImportError):
    """Ray is not installed (or fails to import) in this environment."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"conduit.distributed needs Ray, which could not be imported "
                         f"({type(original).__name__}: {original}); install it with "
                         f"{RAY_HINT}")


class ClusterConnectionError(ConduitError, ConnectionError):
    """``address`` names no reachable Ray cluster.

    Attributes:
        field: Always ``"address"``.
        address: The address that was given.
    """

    def __init__(self, address: str, message: str) -> None:
        self.field = "address"
        self.address = address
        super().__init__(f"address: {address!r}: {message}")


class ShardUnavailableError(ConduitError, TimeoutError):
    """A shard's data could not be read or written within the plane's timeout: its actor died
    and its restore did not finish in time, or no node can host it.

    Attributes:
        shard: The shard's id.
        lost_rows: Rows known lost with it (0 while a replica holds them).
    """

    def __init__(self, shard: int, message: str, *, lost_rows: int = 0) -> None:
        self.shard = shard
        self.lost_rows = lost_rows
        super().__init__(f"shard {shard}: {message}")
