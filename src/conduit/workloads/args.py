"""The arguments every trainer shares, and how their text values are read.

Each trainer's ``Args`` extends :class:`TrainerArgs` with its hyperparameters, and redeclares a
shared field where its default differs; ``conduit train`` makes one ``--flag`` per field.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import torch

from conduit import Placement, Schedule
from conduit.cli_args import arg
from conduit.errors import ConfigError


@dataclass(frozen=True)
class TrainerArgs:
    """The run: environment, actors, experience path, learner device and outputs."""

    env: str = arg("CartPole-v1", "environment id")
    image_size: int = arg(0, "attach a size x size x 3 uint8 image to every observation "
                          "(0 off; 128 ~ 48 KB, 256 ~ 192 KB); a payload-size stand-in")
    actors: int = arg(2, "rollout actors (Ray actors unless --no-use-ray)", min=1)
    envs_per_actor: int = arg(4, "environment copies each actor steps in lock-step", min=1)
    steps_per_rollout: int = arg(16, "lock-steps per actor per iteration (one rollout unit)", min=1)
    iters: int = arg(300, "training iterations", min=1)
    buffer: Literal["inline", "conduit"] = arg("conduit", "experience path: 'inline' runs "
                                               "every operator on the caller's thread; "
                                               "'conduit' places and schedules it")
    schedule: str = arg("auto", "conduit schedule: auto, inline, or 'ov_ing,g_ing,ov_del,g_del'")
    placement: str = arg("auto", "conduit placement: auto, pageable, pinned, learner, cuda:0")
    seed: int = arg(1, "random seed")
    device: str = arg("auto", "learner device: auto (CUDA when present), cpu, cuda:0")
    learner_threads: int = arg(0, "torch threads of the learner (0: the cores the actors "
                               "leave free, at least 1)")
    use_ray: bool = arg(True, "run actors as Ray actors (otherwise in the driver process)")
    address: str = arg("", "Ray cluster address to attach to (empty: start a local Ray)")
    log_every: int = arg(10, "print a progress line every this many iterations (0: never)")
    out: str = arg("", "write the JSON log here (empty: do not write)", output="file")
    plot: str = arg("", "write the PNG breakdown here (empty: do not write)", output="file")


def parse_schedule(text: str) -> Schedule | Literal["auto"]:
    """``"auto"``, ``"inline"`` or ``"ov_ing,g_ing,ov_del,g_del"`` (g may be ``1/4``).

    Raises:
        ConfigError: Any other text (field ``schedule``).
        ScheduleError: The four values do not form a valid schedule.
    """
    if text == "auto":
        return "auto"
    if text == "inline":
        return Schedule.inline()
    expected = ("expected 'auto', 'inline' or four comma-separated values "
                "'ov_ing,g_ing,ov_del,g_del' (ov 0 or 1, g a positive number or fraction, "
                f"e.g. '1,1,0,1/4'), got {text!r}")
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 4:
        raise ConfigError("schedule", expected)
    try:
        ov_ing, g_ing = int(parts[0]), Fraction(parts[1])
        ov_del, g_del = int(parts[2]), Fraction(parts[3])
    except (ValueError, ZeroDivisionError) as exc:
        raise ConfigError("schedule", expected) from exc
    return Schedule(ov_ing, g_ing, ov_del, g_del)


def parse_placement(text: str, learner_device: torch.device) -> Placement | Literal["auto"]:
    """``"auto"``, ``"pageable"``, ``"pinned"`` (pageable without CUDA), ``"learner"`` (the
    learner's device; pageable for a CPU learner) or a device name such as ``"cuda:0"``."""
    if text == "auto":
        return "auto"
    if text == "pageable":
        return Placement.pageable()
    if text == "pinned":
        return Placement.pinned() if torch.cuda.is_available() else Placement.pageable()
    if text == "learner":
        return (Placement.device(learner_device) if learner_device.type != "cpu"
                else Placement.pageable())
    return Placement.device(text)
