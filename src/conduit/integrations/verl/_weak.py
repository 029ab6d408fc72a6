"""The ingestion operator a verl buffer registers on its plane, holding the buffer weakly."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from conduit.errors import PlaneClosedError
from conduit.plane import ActorIn, BufferOut


def weak_ingestion(method: Callable[[ActorIn, BufferOut], None]
                   ) -> Callable[[ActorIn, BufferOut], None]:
    """An operator that calls the bound ``method`` while its object lives.

    The plane's workers hold their operator; an operator holding the buffer (a bound method)
    would keep the buffer, its plane and those workers alive after the buffer is dropped, so
    the plane's cleanup of a dropped plane would never run.

    Raises:
        PlaneClosedError: (from the operator) The buffer was dropped.
    """
    ref: weakref.WeakMethod[Any] = weakref.WeakMethod(method)

    def ingest(actor_in: ActorIn, exp_out: BufferOut) -> None:
        bound = ref()
        if bound is None:
            raise PlaneClosedError("the buffer that owns this plane was dropped")
        bound(actor_in, exp_out)

    return ingest
