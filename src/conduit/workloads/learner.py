"""Where the learner runs (its seeds, its device and its torch threads), and what stops a
diverging run."""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch

from conduit.errors import ConfigError
from conduit.workloads.args import TrainerArgs


def resolve_device(name: str, *, field: str = "device") -> torch.device:
    """``"auto"`` -> the first CUDA device when present, else CPU; otherwise ``name``.

    Args:
        name: ``"auto"`` or a torch device name.
        field: The argument that gave it (errors name it, and its flag ``--field``).

    Raises:
        ConfigError: ``name`` is not a torch device name, or names a CUDA device this
            machine does not have (field ``field``).
    """
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    flag = f"--{field.replace('_', '-')}"
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(field, f"{name!r} is not a device; pass {flag} auto, cpu or "
                                 "cuda:N") from exc
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ConfigError(field, f"{name!r}: this machine has {count} CUDA "
                                     f"device(s); pass {flag} auto or cpu"
                                     + (f", or cuda:0..cuda:{count - 1}" if count else ""))
    return device


def set_learner_threads(n: int, *, actors: int, use_ray: bool) -> int:
    """Set torch's intra-op threads for the learner and return the count.

    ``0`` picks one thread per core left over by the Ray actors (at least one): an
    oversubscribed learner slows down several-fold on a small machine.
    """
    if n <= 0:
        spare = (os.cpu_count() or 1) - (actors if use_ray else 0)
        n = max(1, min(torch.get_num_threads(), spare))
    torch.set_num_threads(n)
    return n


def setup_learner(args: TrainerArgs) -> torch.device:
    """Seed torch and numpy, set the learner's torch threads, and return its device.

    Also silences torch's warning on wrapping the read-only numpy arrays that Ray hands
    back: the plane copies every pushed rollout once.
    """
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    set_learner_threads(args.learner_threads, actors=args.actors, use_ray=args.use_ray)
    return resolve_device(args.device)


LOSS_NOT_FINITE = "a loss was not finite"
"""Why a run stopped when one of its losses was not finite."""


def policy_not_finite(actions: int) -> str:
    """Why a run stopped when the policy's output was not finite for ``actions`` actions of a
    rollout (each given a stand-in, see
    :meth:`~conduit.workloads.actors.RolloutWorker.rollout`)."""
    return f"the policy's output was not finite for {actions} action(s) of the rollout"
