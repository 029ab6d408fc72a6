"""A priority update and a learner port's ``bind`` wait for a front another call holds (on a
stalled shard) only until the plane's timeout, then raise ShardUnavailableError with nothing
changed; they took the front without bound. Both fail on the code before the bound."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conduit.distributed import ShardUnavailableError
from tests.distributed.helpers import make_plane, rows

pytestmark = pytest.mark.ray

TIMEOUT = 6.0
HOLD_S = 40.0  # how long the other call holds the front at most
BOUND_S = 20.0  # the call raises well within this, and before the hold ends


def _hold_front(plane) -> tuple[threading.Thread, threading.Event]:
    """A thread holding the plane's front until the event is set (or HOLD_S passes)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with plane._cond:
            held.set()
            release.wait(HOLD_S)
    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(10)
    return thread, release


def _raises_in_time(fn) -> None:
    t0 = time.monotonic()
    with pytest.raises(ShardUnavailableError, match="another call held the front"):
        fn()
    assert time.monotonic() - t0 < BOUND_S


def test_a_priority_update_behind_a_held_front_keeps_the_planes_timeout(cluster):
    plane = make_plane(cluster, capacity=64, batch_size=8, min_size=1, sampler="prioritized",
                       timeout=TIMEOUT)
    try:
        plane.push(rows(16, 0), node=plane._shards.nodes[0])
        batch = plane.pull(timeout=30)
        thread, release = _hold_front(plane)
        try:
            _raises_in_time(lambda: plane.update_priorities(batch["_index"],
                                                            torch.full((8,), 5.0)))
        finally:
            release.set()
            thread.join(30)
        plane.update_priorities(batch["_index"], torch.full((8,), 5.0))  # goes on
    finally:
        plane.close()


def test_a_bind_behind_a_held_front_keeps_the_planes_timeout(cluster):
    plane = make_plane(cluster, capacity=64, batch_size=8, min_size=1, timeout=TIMEOUT)
    try:
        port = plane.learner(0)
        before, other = port.node, plane._shards.nodes[-1]
        thread, release = _hold_front(plane)
        try:
            _raises_in_time(lambda: port.bind(other))
            assert port.node == before  # nothing changed
        finally:
            release.set()
            thread.join(30)
        port.bind(other)
        assert port.node == other
    finally:
        plane.close()
