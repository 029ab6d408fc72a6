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

    Raised by a push of a mapping whose write failed, it says what became of the rows: when
    ``stored_rows`` and ``unsettled_rows`` are both 0 no holder keeps any of them and pushing
    the rollout again stores it once; otherwise a retry may store rows twice. For a pushed
    ``ObjectRef`` the front does not know the rows, so both stay 0 and say nothing: its write
    may have landed.

    Attributes:
        shard: The shard's id, or None when no single shard is at fault (no node can host
            the shards, or a pushed ``ObjectRef``'s object was not made in time).
        lost_rows: Rows known lost with it (0 while a replica holds them).
        stored_rows: Rows of the failed write that its holders applied all the same
            (on-policy, where they are re-read before the error is raised): they stay
            stored and count against the iteration.
        unsettled_rows: Rows of the failed write whose holders were not re-read (off-policy)
            or could not be re-read in time (on-policy): they may still land.
    """

    def __init__(self, shard: int | None, message: str, *, lost_rows: int = 0) -> None:
        self.shard = shard
        self.lost_rows = lost_rows
        self.stored_rows = 0
        self.unsettled_rows = 0
        super().__init__(message if shard is None else f"shard {shard}: {message}")
