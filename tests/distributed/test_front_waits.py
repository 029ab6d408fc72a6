"""On-policy pulls whose timeout runs out while another call holds the front on a stalled shard,
on the three-node test cluster: the settle step of a push's unsettled write, a rank's report
that it consumed the iteration, and the finish of a clear cut short each wait for the front
only until the pull's own deadline, raise :class:`ShardUnavailableError`, and leave the plane
going on with every row delivered exactly once."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from conduit.distributed import ShardUnavailableError
from tests.distributed.helpers import check_rows, make_plane, rows

pytestmark = pytest.mark.ray

PLANE_TIMEOUT = 15.0  # how long the stalled call holds the front at most
BOUND_S = 5.0  # a pull with timeout=1 raises well within this (a bound, not a benchmark)


def _shard_pid(plane, k: int) -> int:
    import ray
    return ray.get(plane._shards.actors[k].__ray_call__.remote(lambda self: os.getpid()))


@contextlib.contextmanager
def stalled(plane, k: int) -> Iterator[None]:
    """While inside, shard ``k``'s process is stopped (``SIGSTOP``); it goes on at exit."""
    pid = _shard_pid(plane, k)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _front_held(plane) -> bool:
    if plane._lock.acquire(blocking=False):
        plane._lock.release()
        return False
    return True


def _wait_front_held(plane, until=lambda: True) -> None:
    for _ in range(400):
        if _front_held(plane) and until():
            return
        time.sleep(0.05)
    raise AssertionError("no call took the front")


def hold_front_by_heal(plane) -> threading.Thread:
    """Start a thread whose ``heal()`` holds the front, waiting on a stalled shard's ping (for
    up to the plane's timeout, or until the shard goes on); it returns once the front is
    held."""
    thread = threading.Thread(target=lambda: _quietly(plane.heal))
    thread.start()
    _wait_front_held(plane)
    return thread


def _quietly(fn) -> None:
    with contextlib.suppress(Exception):  # the outcome is not what these calls test
        fn()


def raises_on_the_front_in_time(fn) -> None:
    """Call ``fn``, which must raise the front-wait :class:`ShardUnavailableError` (its
    timeout ran out while another call held the front) within :data:`BOUND_S`."""
    t0 = time.monotonic()
    with pytest.raises(ShardUnavailableError) as info:
        fn()
    took = time.monotonic() - t0
    assert took < BOUND_S, (took, info.value)
    assert "another call held the front" in str(info.value), info.value
    assert info.value.shard is None


def _ids(batches) -> list[int]:
    out = []
    for batch in batches:
        check_rows(batch)
        out += batch["id"].tolist()
    return sorted(out)


def _outside(plane, owner: int) -> int:
    """A shard that holds no copy of ``owner``'s rows."""
    return next(k for k in range(plane.num_shards) if k not in plane._shards.holders(owner))


def test_the_last_share_behind_a_held_front_times_out_and_is_kept(cluster):
    """pull(timeout=1) of an iteration's last mini-batch, whose report that the rank consumed
    the iteration met a front held by a call on a stalled shard, waited for that call (the
    plane's whole timeout) instead of raising at its own timeout; the batch it formed is
    returned by the next pull, which marks the iteration consumed."""
    plane = make_plane(cluster, capacity=32, mode="on_policy", num_minibatches=4,
                       timeout=PLANE_TIMEOUT)
    nodes = plane._shards.nodes
    try:
        for k in range(4):
            plane.push(rows(8, 8 * k), node=nodes[0], policy_version=0)
        got = [plane.pull(timeout=30) for _ in range(3)]  # the last one's draw is prefetched
        time.sleep(0.5)
        with stalled(plane, _outside(plane, 0)):
            healer = hold_front_by_heal(plane)
            raises_on_the_front_in_time(lambda: plane.pull(timeout=1))
        healer.join(60)
        assert plane.policy_version == 0  # not marked consumed yet
        got.append(plane.pull(timeout=30))  # the kept batch; the iteration is marked consumed
        assert plane.policy_version == 1
        assert _ids(got) == list(range(32))
        for k in range(4):
            plane.push(rows(8, 100 + 8 * k), node=nodes[1], policy_version=1)
        assert _ids(plane.minibatches(timeout=30)) == list(range(100, 132))
        assert plane.policy_version == 2
    finally:
        plane.close()


def test_a_rank_behind_another_ranks_clear_on_a_stalled_shard_keeps_its_timeout(cluster):
    """pull(timeout=1) of a rank that consumed the iteration, while the last rank's clear
    held the front on a stalled shard, waited for that clear (the plane's whole timeout)
    before it raised; the iteration then goes on for both ranks."""
    plane = make_plane(cluster, capacity=32, mode="on_policy", num_minibatches=2,
                       num_learners=2, timeout=PLANE_TIMEOUT)
    nodes = plane._shards.nodes
    r0, r1 = plane.learner(0), plane.learner(1)
    out: dict[str, object] = {}

    def last_share():
        try:
            out["r0"] = r0.pull()
        except Exception as exc:
            out["r0"] = exc
    try:
        for k in range(4):
            plane.push(rows(8, 8 * k), node=nodes[0], policy_version=0)
        got = [r1.pull(timeout=30), r1.pull(timeout=30), r0.pull(timeout=30)]
        time.sleep(0.5)
        thread = threading.Thread(target=last_share)
        with stalled(plane, _outside(plane, 0)):
            thread.start()  # its clear waits on the stalled shard, holding the front
            _wait_front_held(plane, lambda: plane._gate.clearing)
            raises_on_the_front_in_time(lambda: r1.pull(timeout=1))
        thread.join(60)
        assert isinstance(out.get("r0"), dict), out  # its clear finished once the shard went on
        got.append(out["r0"])
        assert plane.policy_version == 1
        assert _ids(got) == list(range(32))
        for k in range(4):
            plane.push(rows(8, 100 + 8 * k), node=nodes[1], policy_version=1)
        got = [r0.pull(timeout=30), r0.pull(timeout=30), r1.pull(timeout=30),
               r1.pull(timeout=30)]
        assert _ids(got) == list(range(100, 132))
        assert plane.policy_version == 2
    finally:
        plane.close()


def test_minibatches_behind_a_held_front_with_a_write_to_settle_keep_their_timeout(cluster):
    """minibatches(timeout=1) with a push's write still to settle (its holders could not be
    re-read) waited for a front held by a call on a stalled shard (the plane's whole timeout)
    before it raised; the write lands and every row of the iteration is delivered once."""
    plane = make_plane(cluster, capacity=32, mode="on_policy", num_minibatches=2,
                       timeout=PLANE_TIMEOUT)
    nodes = plane._shards.nodes
    try:
        for k in range(3):
            plane.push(rows(8, 8 * k), node=nodes[0], policy_version=0)
        with stalled(plane, 1):
            with pytest.raises(ShardUnavailableError) as info:
                plane.push(rows(8, 900), node=nodes[1], policy_version=0, timeout=1)
            assert info.value.unsettled_rows == 8 and plane._replicator.unsettled
            healer = hold_front_by_heal(plane)
            raises_on_the_front_in_time(lambda: next(plane.minibatches(timeout=1)))
        healer.join(60)
        ids = _ids(plane.minibatches(timeout=30))
        assert ids == [*range(24), *range(900, 908)]
        assert plane.policy_version == 1 and not plane._replicator.unsettled
    finally:
        plane.close()


def test_a_heal_behind_a_held_front_keeps_its_timeout(cluster):
    """heal(timeout=1), or a pull that must heal a shard first, while another call held the
    front on a stalled shard waited for that call (the plane's whole timeout); it raises at
    its own timeout, and a later heal goes on."""
    plane = make_plane(cluster, capacity=32, batch_size=4, timeout=PLANE_TIMEOUT)
    try:
        plane.push(rows(8, 0), node=plane._shards.nodes[0])
        with stalled(plane, 0):
            healer = hold_front_by_heal(plane)
            raises_on_the_front_in_time(lambda: plane.heal(timeout=1))
        healer.join(60)
        assert plane.heal(timeout=30) == []  # nothing died: nothing to restore
        assert len(plane) == 8
    finally:
        plane.close()
