"""The arguments every trainer shares, and how their text values are read.

Each trainer's ``Args`` extends :class:`TrainerArgs` with its hyperparameters, and redeclares a
shared field where its default differs; ``conduit train`` makes one ``--flag`` per field.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import gymnasium as gym
import torch

from conduit import Placement, Schedule
from conduit.cli_args import arg, check_reachable
from conduit.errors import ConfigError, PlacementError, ScheduleError
from conduit.placement.cluster import ray_attached
from conduit.scheduling.space import ScheduleSpace
from conduit.workloads.envs import EnvInfo, env_info

MIN_IMAGE_SIZE = 9
"""Smallest image payload side the workloads' conv encoder (a 5x5 then a 3x3 convolution,
both of stride 2, see :class:`~conduit.workloads.nets.ConvEncoder`) can take."""

MAX_SEED = 2**32 - 1
"""Largest ``--seed``: NumPy's global seed (which the learner sets) takes 32 bits."""

ADDRESS_TIMEOUT_S = 3.0
"""Seconds ``--address`` is given to answer before a run is refused (``ray.init`` would retry
an address nothing listens on for minutes)."""

ADAM_BETA1 = 0.9
"""The first-moment decay of the DQN, SAC and PPO learners' Adam optimizers (torch's
default)."""

MAX_LEARNING_RATE = torch.finfo(torch.float32).max * (1 - ADAM_BETA1)
"""Largest learning rate torch's Adam can step float32 weights with (about 3.4e37): its first
step scales the update by ``lr / (1 - beta1)``, a float32 scalar (see
:func:`check_learning_rate`)."""


@dataclass(frozen=True)
class TrainerArgs:
    """The run: environment, actors, experience path, learner device and outputs."""

    env: str = arg("CartPole-v1", "environment id")
    image_size: int = arg(0, "attach a size x size x 3 uint8 image to every observation "
                          f"(0 off, else at least {MIN_IMAGE_SIZE}; 128 ~ 48 KB, 256 ~ 192 KB); "
                          "a payload-size stand-in")
    actors: int = arg(2, "rollout actors (Ray actors unless --no-use-ray)", min=1)
    envs_per_actor: int = arg(4, "environment copies each actor steps in lock-step", min=1)
    steps_per_rollout: int = arg(16, "lock-steps per actor per iteration (one rollout unit)", min=1)
    iters: int = arg(300, "training iterations", min=1)
    buffer: Literal["inline", "conduit"] = arg("conduit", "experience path: 'inline' runs "
                                               "every operator on the caller's thread; "
                                               "'conduit' places and schedules it")
    schedule: str = arg("auto", "conduit schedule: auto, inline, or 'ov_ing,g_ing,ov_del,g_del' "
                        "(--buffer inline runs inline: it takes only auto or inline)")
    placement: str = arg("auto", "conduit placement: auto, pageable, pinned, learner, cuda:0 "
                         "(--buffer inline keeps pageable memory: it takes only auto or "
                         "pageable)")
    seed: int = arg(1, "random seed", max=MAX_SEED)
    device: str = arg("auto", "learner device: auto (CUDA when present), cpu, cuda:0")
    learner_threads: int = arg(0, "torch threads of the learner (0: the cores the actors "
                               "leave free, at least 1)")
    use_ray: bool = arg(True, "run actors as Ray actors (otherwise in the driver process)")
    address: str = arg("", "Ray cluster address HOST:PORT to attach to (empty: start a local "
                       "Ray; refused with --no-use-ray, and when nothing answers at it within "
                       f"{ADDRESS_TIMEOUT_S:g} s)")
    log_every: int = arg(10, "print a progress line every this many iterations (0: never)")
    out: str = arg("", "write the JSON log here (empty: runs/train/<algo>_<env>_<buffer>.json)",
                   output="file")
    plot: str = arg("", "write the PNG breakdown here (empty: "
                    "runs/train/<algo>_<env>_<buffer>.png)", output="file")


def parse_schedule(text: str, *, num_minibatches: int = 1) -> Schedule | Literal["auto"]:
    """``"auto"``, ``"inline"`` or ``"ov_ing,g_ing,ov_del,g_del"`` (g may be ``1/4``);
    ``"inline"`` delivers one of ``num_minibatches`` mini-batches at a time (on-policy ``M``).

    Raises:
        ConfigError: Any other text (field ``schedule``).
        ScheduleError: The four values do not form a valid schedule.
    """
    if text == "auto":
        return "auto"
    if text == "inline":
        return Schedule.inline(num_minibatches=num_minibatches)
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
    learner's device; pageable for a CPU learner) or a device name such as ``"cuda:0"``.

    Raises:
        PlacementError: ``text`` names no device.
    """
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


def check_image_size(size: int) -> None:
    """Refuse an image payload side the conv encoder cannot take.

    Raises:
        ConfigError: ``size`` is neither 0 nor at least :data:`MIN_IMAGE_SIZE` (field
            ``image_size``).
    """
    if 0 < size < MIN_IMAGE_SIZE:
        raise ConfigError("image_size", f"must be 0 (no image) or at least {MIN_IMAGE_SIZE} "
                                        f"(the image encoder's smallest input), got {size}")


def check_learning_rate(field: str, lr: float) -> None:
    """Refuse a learning rate that no Adam step can take on float32 weights.

    Adam's first step scales the update by ``lr / (1 - beta1)`` (ten times ``lr``), a
    float32 scalar in torch's default kernels (for-loop and foreach, on CPU and CUDA); above
    :data:`MAX_LEARNING_RATE` it overflows and the first optimizer step fails. A smaller
    rate, however large, is left to the run: when it diverges, the trainer's divergence stop
    reports it.

    Args:
        field: The ``Args`` field that gave ``lr`` (the error names its flag).
        lr: The learning rate.

    Raises:
        ConfigError: ``lr`` is above :data:`MAX_LEARNING_RATE` (field ``field``).
    """
    if lr > MAX_LEARNING_RATE:
        raise ConfigError(field, f"must be at most {MAX_LEARNING_RATE:.3g}, got {lr:g}: "
                                 "Adam's first step scales the update by lr / (1 - beta1) = "
                                 f"{lr / (1 - ADAM_BETA1):.3g}, beyond float32's largest "
                                 "value (3.4e+38)")


def check_trainer_args(args: TrainerArgs) -> None:
    """The checks of the shared flags that need more than one value, run before Ray starts.

    Raises:
        ConfigError: The image payload is too small (field ``image_size``); ``--buffer
            inline`` is given a schedule or placement it would not run (fields ``schedule``,
            ``placement``); ``--no-use-ray`` is given a Ray address, or nothing answers at
            the address within :data:`ADDRESS_TIMEOUT_S` seconds (field ``address``).
    """
    check_image_size(args.image_size)
    if args.buffer == "inline":
        # The inline baseline always runs the inline schedule on pageable memory.
        if args.schedule not in ("auto", "inline"):
            raise ConfigError("schedule", f"{args.schedule!r} does not apply with --buffer "
                                          "inline (it runs every operator inline); pass "
                                          "--buffer conduit, or leave --schedule out")
        if args.placement not in ("auto", "pageable"):
            raise ConfigError("placement", f"{args.placement!r} does not apply with --buffer "
                                           "inline (it keeps the buffer in pageable memory); "
                                           "pass --buffer conduit, or leave --placement out")
    if not args.use_ray and args.address:
        raise ConfigError("address", f"{args.address!r} does not apply with --no-use-ray (the "
                                     "actors run in this process); drop --no-use-ray or "
                                     "--address")
    if args.use_ray and args.address and not ray_attached():
        # Refused in seconds: ray.init retries an address nothing listens on for minutes.
        check_reachable("address", args.address, timeout=ADDRESS_TIMEOUT_S)


def check_schedule_and_placement(schedule: str, placement: str, device: torch.device, *,
                                 space: ScheduleSpace | None = None) -> None:
    """``--schedule`` and ``--placement`` as the run will read them, before Ray starts.

    Args:
        schedule: The ``--schedule`` text (see :func:`parse_schedule`).
        placement: The ``--placement`` text (see :func:`parse_placement`).
        device: The learner device ``--placement learner`` resolves to.
        space: The schedules the run's plane can take; a schedule outside it is refused
            (None: not checked). ``inline`` is read with its on-policy ``M``.

    Raises:
        ConfigError: The text is malformed, or names a schedule or placement that cannot be
            built, or a schedule outside ``space`` (field ``schedule`` or ``placement``; the
            reason is that of the :class:`~conduit.errors.ScheduleError` or
            :class:`~conduit.errors.PlacementError`).
    """
    m = space.g_del[0].denominator if space is not None and space.mode == "on_policy" else 1
    try:
        parsed = parse_schedule(schedule, num_minibatches=m)
        if space is not None and parsed != "auto":
            space.check(parsed)
    except ScheduleError as exc:
        raise ConfigError("schedule", f"{schedule!r}: {exc}") from exc
    try:
        parse_placement(placement, device)
    except ConfigError as exc:
        raise ConfigError("placement", exc.reason) from exc
    except PlacementError as exc:
        raise ConfigError("placement", str(exc)) from exc


def check_replay(*, buffer_size: int, batch_size: int, learning_starts: int) -> None:
    """The replay flags of an off-policy trainer (DQN, SAC) against each other.

    Raises:
        ConfigError: ``--batch-size`` or ``--learning-starts`` exceeds ``--buffer-size``
            (field ``batch_size`` or ``learning_starts``).
    """
    if batch_size > buffer_size:
        raise ConfigError("batch_size", f"{batch_size} exceeds --buffer-size {buffer_size}; "
                                        "pass a smaller batch or a larger buffer")
    if learning_starts > buffer_size:
        raise ConfigError("learning_starts", f"{learning_starts} exceeds --buffer-size "
                                             f"{buffer_size}: the buffer never holds that "
                                             "many transitions, so learning would never start")


def probe_env(env_id: str, **kw: object) -> EnvInfo | None:
    """The environment's :class:`EnvInfo` for a check before Ray starts, or None when the id
    is unknown (the trainer then raises its own :class:`ConfigError` naming it).

    Args:
        env_id: The environment id.
        **kw: More :func:`~conduit.workloads.envs.env_info` arguments (``image_size``,
            ``num_agents``).

    Raises:
        ConfigError: The environment needs an optional extra that is not installed, or its
            observation is not one array (field ``env``), or it cannot take the image payload
            (field ``image_size``).
    """
    try:
        return env_info(env_id, **kw)  # type: ignore[arg-type]
    except ImportError as exc:
        raise ConfigError("env", f"{env_id}: {exc}") from exc
    except ConfigError as exc:
        if exc.field == "env" and isinstance(exc.__cause__, gym.error.Error):
            return None  # Gymnasium does not know the id
        raise
