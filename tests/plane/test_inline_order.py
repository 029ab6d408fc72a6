"""Inline ingestion run from several threads at once (an actor's push, a flush or save on
another thread) stores rows in push order."""

import threading
import time
from fractions import Fraction

import pytest
import torch

from conduit import ExperienceDataPlane, Schedule
from tests.conftest import make_rows


def _slow_identity(actor_in, buffer_out):
    # An invocation on the flushing thread is slow: meanwhile the actor pushes the next
    # units and ingests them on its own thread.
    if threading.current_thread().name == "flusher":
        time.sleep(0.003)
    for unit in actor_in.read_units():
        buffer_out.write(unit)


@pytest.mark.parametrize("mode", ["off_policy", "on_policy"])
def test_rows_land_in_push_order_while_another_thread_flushes(small_spec, mode):
    units, rows = 40, 7
    # The pusher's own thread ingests every few units; the flusher takes what is queued.
    kw = (dict(mode="on_policy", num_minibatches=4,
               schedule=Schedule(0, Fraction(1, 4), 0, Fraction(1, 4)))
          if mode == "on_policy" else dict(schedule=Schedule(0, 3, 0, 1)))
    with ExperienceDataPlane(spec=small_spec, capacity=units * rows, batch_size=rows, timeout=20,
                             **kw) as plane:
        plane.register_ingestion()(_slow_identity)
        stop = threading.Event()

        def flusher():
            while not stop.is_set():
                plane.flush()

        t = threading.Thread(target=flusher, name="flusher")
        t.start()
        try:
            for k in range(units):
                plane.push(make_rows(small_spec, rows, start=k * rows), policy_version=0
                           if mode == "on_policy" else None)
                time.sleep(0.0003)  # lets the flusher take a unit now and then
        finally:
            stop.set()
            t.join()
        plane.flush()
        buf = plane.buffer
        stored = buf.store.get(buf.writer.logical_order())["id"]
        assert torch.equal(stored, torch.arange(units * rows))
