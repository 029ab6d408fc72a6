"""The learner side of an actor-rollout phase: collect every actor's rollout units and push each
through the plane's actor port, on the learner's thread or on a port thread of its own."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from conduit import ExperienceDataPlane
from conduit.workloads.actors import ActorGroup, Params


def rollout_and_push(plane: ExperienceDataPlane, actors: ActorGroup, num_steps: int,
                     weights: dict[str, torch.Tensor] | None,
                     params: Params | None = None, *, on_policy: bool = False,
                     fragments: int = 1) -> dict[str, Any]:
    """One actor-rollout phase.

    Every actor produces ``fragments`` rollout units of ``num_steps`` steps each, back to
    back; each unit is pushed through the plane's actor port as soon as it is collected, in
    (fragment, actor) order, so batches never depend on which actor finished first. While
    fragment k is pushed, the actors already step fragment k+1. A unit that a dead Ray actor did
    not deliver is collected again from the actor re-created in its place (see
    :class:`~conduit.workloads.actors.ActorGroup`) with the same weights, and pushed in its own
    slot of that order, so the phase pushes every unit under the same policy version.

    Who pushes depends on the schedule. With inline ingestion the learner's thread collects and
    pushes every unit itself. With overlapped ingestion a port thread receives and pushes every
    unit but the last while the learner's thread waits; once the port thread has collected the
    last but one, the learner's thread collects the last unit, waits for the port thread's
    remaining push, and pushes the last unit itself. The learner's path after the last arrival
    is then that one push: not the port thread's push of it, the thread's exit and the join,
    which on a 2-core machine wait for the GIL while ingestion runs.

    Timing records: the learner's wait for the actors is ``"rollout"``, one record per unit
    (the per-unit ``T_rollout`` the cost model reads). Time inside ``push`` is the plane's own
    ``"push"`` record; pushes made by the port thread are also recorded as
    ``"push_offthread"``, and the learner's wait for the port thread after the last unit
    arrived as ``"push_wait"`` (see :class:`~conduit.workloads.breakdown.BreakdownRecorder`).

    Args:
        plane: The plane to push into.
        actors: The rollout actors.
        num_steps: Lock-steps per rollout unit.
        weights: Policy weights for the actors (sent with the first fragment), or None.
        params: Exploration parameters for the actors.
        on_policy: Tag every push with the plane's policy version.
        fragments: Rollout units per actor.

    Returns:
        ``rows`` pushed, the finished ``episode_returns``, and ``nonfinite``: the actions for
        which the policy's output was not finite (each given a stand-in, see
        :meth:`~conduit.workloads.actors.RolloutWorker.rollout`).

    Raises:
        Whatever a push raised, also when the port thread pushed.
    """
    t0 = time.perf_counter()
    # Ray runs an actor's calls in order, so all fragments can be queued at once; the weights
    # travel with the first.
    handles = [h for k in range(fragments)
               for h in actors.submit(num_steps, weights if k == 0 else None, params)]
    got: dict[str, Any] = {"rows": 0, "episode_returns": [], "nonfinite": 0,
                           "waited": time.perf_counter() - t0}

    def receive(call: Any, offthread: bool) -> None:
        """Collect one unit and push it."""
        t1 = time.perf_counter()
        out = actors.result(call)
        got["waited"] += time.perf_counter() - t1
        push(out, offthread)

    def push(out: dict[str, Any], offthread: bool) -> None:
        version = {"policy_version": plane.policy_version} if on_policy else {}
        t2 = time.perf_counter()
        plane.push(out["rollout"], **version)
        if offthread:
            plane.timings.record("push_offthread", time.perf_counter() - t2, start=t2)
        got["rows"] += out["stats"]["rows"]
        got["episode_returns"] += out["stats"]["episode_returns"]
        got["nonfinite"] += out["stats"].get("nonfinite", 0)

    if plane.schedule.overlap_ing and len(handles) > 1:
        *ahead, last = handles
        collected = threading.Event()  # the port thread made its last actors.result call
        port_failed: list[BaseException] = []

        def port_body() -> None:
            try:
                for call in ahead[:-1]:
                    receive(call, offthread=True)
                out = actors.result(ahead[-1])
            except BaseException as exc:
                port_failed.append(exc)  # before the wake-up: the learner then collects no more
                collected.set()
                raise
            collected.set()
            push(out, offthread=True)

        port = _PortThread(port_body)
        try:
            collected.wait()
            if not port_failed:  # one caller of actors.result at a time
                out = actors.result(last)
                arrived = time.perf_counter()
        finally:
            port.join()  # re-raises what the port thread raised
        plane.timings.record("push_wait", time.perf_counter() - arrived, start=arrived)
        waited = arrived - t0  # the learner's thread waited for the actors until here
        push(out, offthread=False)
    else:
        for call in handles:
            receive(call, offthread=False)
        waited = got["waited"]
    for _ in handles:
        plane.timings.record("rollout", waited / len(handles), start=t0)
    return {"rows": got["rows"], "episode_returns": got["episode_returns"],
            "nonfinite": got["nonfinite"]}


class _PortThread:
    """The actor port's thread, running ``body``; :meth:`join` waits for it and re-raises what
    it raised."""

    def __init__(self, body: Callable[[], None]) -> None:
        self._failure: list[BaseException] = []

        def run() -> None:
            try:
                body()
            except BaseException as exc:  # handed to the learner's thread by join()
                self._failure.append(exc)

        self._thread = threading.Thread(target=run, name="conduit-actor-port", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Wait for the thread; re-raise what the body raised."""
        self._thread.join()
        if self._failure:
            raise self._failure[0]
