"""The plane's worker threads yield the CPU to the actors and the learner (``worker_nice``)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from conduit import ExperienceDataPlane, Schedule
from conduit.storage.threads import lower_thread_priority
from tests.conftest import make_rows

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="per-thread priority is a Linux feature")


def _nice(thread: threading.Thread) -> int:
    return os.getpriority(os.PRIO_PROCESS, thread.native_id)


def _workers() -> dict[str, threading.Thread]:
    return {t.name: t for t in threading.enumerate() if t.name.startswith("conduit-")}


@pytest.mark.parametrize("nice", [0, 10])
def test_workers_run_at_the_requested_niceness(small_spec, nice):
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=8,
                             schedule=Schedule(1, 1, 1, 1), worker_nice=nice) as plane:
        plane.push(make_rows(small_spec, 16))
        plane.pull()  # both workers have started and run an invocation
        workers = _workers()
        assert set(workers) == {"conduit-ingestion", "conduit-delivery"}
        for t in workers.values():
            assert _nice(t) == min(19, base + nice), t.name
    # The caller's own thread is untouched.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base


def test_lower_thread_priority_touches_only_the_calling_thread():
    seen: dict[str, int] = {}
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def body() -> None:
        assert lower_thread_priority(3)
        seen["worker"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen["worker"] == min(19, base + 3)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
