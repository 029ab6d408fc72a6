"""The plane a trainer runs on: its experience spec and its buffer mode (inline or Conduit)."""

from __future__ import annotations

from typing import Any

import torch

from conduit import ExperienceDataPlane, ExperienceSpec, Schedule
from conduit.plane.tuner import WarmupScheduleTuner
from conduit.scheduling import start_schedule
from conduit.workloads.args import TrainerArgs, parse_placement, parse_schedule
from conduit.workloads.envs import EnvInfo


def transition_spec(info: EnvInfo) -> ExperienceSpec:
    """Spec of an off-policy transition ``(s, a, r, s', done)`` for an environment, with the
    image payload (``pixels`` / ``next_pixels``) when the environment has one."""
    action = ((), torch.int64) if info.discrete else ((info.action_dim,), torch.float32)
    fields: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "obs": ((info.obs_dim,), torch.float32), "action": action,
        "reward": ((), torch.float32), "next_obs": ((info.obs_dim,), torch.float32),
        "done": ((), torch.bool)}
    if info.image_size:
        img = ((info.image_size, info.image_size, 3), torch.uint8)
        fields["pixels"] = img
        fields["next_pixels"] = img
    return ExperienceSpec.of(**fields)


def make_plane(args: TrainerArgs, *, learner_device: torch.device, mode: str,
               num_minibatches: int = 1, **plane_kw: Any
               ) -> tuple[ExperienceDataPlane, dict[str, object], WarmupScheduleTuner | None]:
    """Build the :class:`~conduit.ExperienceDataPlane` for ``args.buffer``.

    ``"inline"`` is the sequential baseline: pageable CPU memory, every operator on the
    caller's thread. ``"conduit"`` takes ``args.schedule`` and ``args.placement``: ``"auto"``
    placement runs the planner (Eq. 1, Alg. 1) inside the plane; ``"auto"`` schedule starts
    on :func:`~conduit.scheduling.start_schedule` and leaves the choice to a
    :class:`~conduit.plane.tuner.WarmupScheduleTuner`.

    Args:
        args: The run's arguments.
        learner_device: Where the learner trains.
        mode: ``"off_policy"`` or ``"on_policy"``.
        num_minibatches: On-policy mini-batches per epoch.
        **plane_kw: The rest of the plane's arguments (``spec``, ``capacity``, ...).

    Returns:
        The plane, a JSON-friendly description of its plan (the tuner completes it), and the
        tuner to step once per iteration (None when nothing is left to decide).
    """
    if args.buffer not in ("inline", "conduit"):
        raise ValueError(f"buffer: must be 'inline' or 'conduit', got {args.buffer!r}")
    if args.buffer == "inline":
        plane = ExperienceDataPlane(
            mode=mode, num_minibatches=num_minibatches, placement=None,
            learner_device=learner_device,
            schedule=Schedule.inline(num_minibatches=num_minibatches if mode == "on_policy"
                                     else 1), **plane_kw)
        return plane, describe_plan(plane, buffer=args.buffer), None
    schedule = parse_schedule(args.schedule, num_minibatches=num_minibatches
                              if mode == "on_policy" else 1)
    plane = ExperienceDataPlane(mode=mode, num_minibatches=num_minibatches,
                                learner_device=learner_device,
                                schedule=None if schedule == "auto" else schedule,
                                placement=parse_placement(args.placement, learner_device),
                                **plane_kw)
    prioritized = plane.buffer.sampler.invalidates_prefetch
    if schedule == "auto":
        plane.set_schedule(start_schedule(plane.space, prioritized=prioritized))
    plan = describe_plan(plane, buffer=args.buffer)
    if plane.placement_decision is not None:
        plan["placement_plan"] = plane.placement_decision.explain()
    tuner = (WarmupScheduleTuner(plane, plan, prioritized=prioritized) if schedule == "auto"
             else None)
    return plane, plan, tuner


def describe_plan(plane: ExperienceDataPlane, *, buffer: str) -> dict[str, object]:
    """The buffer mode, schedule and placement a plane runs, as plain data."""
    return {"buffer": buffer, "schedule": plane.schedule.label(),
            "placement": plane.buffer.placement.label(),
            "bytes_per_sample": plane.spec.bytes_per_sample}
