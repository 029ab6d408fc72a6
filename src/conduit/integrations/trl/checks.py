"""The checks :class:`~conduit.integrations.trl.ConduitGRPOTrainer` runs on its configuration:
the settings the Conduit path does not carry, a policy that draws random numbers where old
log-probs are computed, and a schedule outside the plane's feasible space."""

from __future__ import annotations

import inspect
import numbers
import re
from typing import TYPE_CHECKING, Any

import torch
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from conduit.errors import ConfigError, ScheduleError
from conduit.plane.config import PlaneConfig
from conduit.scheduling.space import Schedule
from conduit.spec import ExperienceSpec

if TYPE_CHECKING:
    from conduit.integrations.trl.trainer import ConduitGRPOTrainer

_TRL_SIGNATURE = inspect.signature(GRPOTrainer.__init__)
"""The parameters of ``GRPOTrainer``'s constructor (``self`` first)."""

_RANDOM_ATTR = re.compile(r"drop|jitter|noise", re.IGNORECASE)
"""Names of the numbers a module keeps for a draw it makes in training (``dropout``,
``attention_dropout``, ``resid_pdrop``, ``layerdrop``, ``drop_path_rate``, ``jitter_noise``)."""


def _refused_settings(args: Any, *, tools: Any, rollout_func: Any, environment_factory: Any
                      ) -> list[tuple[str, bool, str]]:
    """The settings the Conduit path does not carry, read from a ``GRPOConfig`` (``args``; None
    stands for its defaults) and the trainer's keyword arguments: ``(name, set, fix)`` each."""
    def get(name: str, default: Any) -> Any:
        return default if args is None else getattr(args, name, default)

    return [
        ("use_vllm", bool(get("use_vllm", False)), "generate with the model (use_vllm=False)"),
        ("tools", bool(tools), "drop tools"),
        ("environment_factory", environment_factory is not None, "drop environments"),
        ("rollout_func", rollout_func is not None, "drop rollout_func"),
        ("scale_rewards", get("scale_rewards", "group") not in ("group", "none"),
         "use 'group' or 'none' (per-group ingestion)"),
        ("multi_objective_aggregation", get("multi_objective_aggregation", "sum_then_normalize")
         != "sum_then_normalize", "use 'sum_then_normalize'"),
        ("mask_truncated_completions", bool(get("mask_truncated_completions", False)),
         "set it to False"),
        ("pad_to_multiple_of", get("pad_to_multiple_of", None) is not None, "leave it unset"),
        # TRL computes reference log-probs at generation; the path computes them per
        # mini-batch in delivery, after SyncRefModelCallback may have moved the model
        ("sync_ref_model", bool(get("sync_ref_model", False)), "set it to False"),
    ]


def _refuse(checks: list[tuple[str, bool, str]]) -> None:
    """Raise a :class:`ConfigError` for the first setting of ``checks`` that is set."""
    for name, bad, fix in checks:
        if bad:
            raise ConfigError(name, f"ConduitGRPOTrainer does not carry this setting; {fix}")


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    """The states of torch's CPU RNG and, for a CUDA ``device``, of its RNG."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def check_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse, before TRL's constructor runs, the settings that the arguments of
    ``GRPOTrainer`` already show (its ``args`` config, ``tools``, ``rollout_func``,
    ``environment_factory``). Arguments that do not fit its signature are left to it.

    Raises:
        ConfigError: One of them is set (see :func:`_refused_settings`).
    """
    try:
        bound = _TRL_SIGNATURE.bind_partial(None, *args, **kwargs)
    except TypeError:
        return  # GRPOTrainer's own constructor reports it
    given = bound.arguments
    _refuse(_refused_settings(given.get("args"), tools=given.get("tools"),
                              rollout_func=given.get("rollout_func"),
                              environment_factory=given.get("environment_factory")))


def check_supported(trainer: ConduitGRPOTrainer) -> None:
    """Refuse, on the built trainer, the settings the Conduit path does not carry, several
    processes, ``beta`` without a reference model, a generation batch that does not split into
    groups, and a pad token that is not an int.

    Raises:
        ConfigError: One of them (named by the error's field).
    """
    a = trainer.args
    _refuse([*_refused_settings(a, tools=trainer.tools, rollout_func=trainer.rollout_func,
                                environment_factory=trainer.environment_factories),
             ("num_processes", trainer.accelerator.num_processes != 1, "run one process"),
             ("beta", trainer.beta != 0.0 and trainer.ref_model is None,
              "give a reference model (PEFT adapters are not carried)")])
    if a.generation_batch_size % trainer.num_generations:
        raise ConfigError("generation_batch_size", "must be a multiple of num_generations")
    pad = getattr(trainer._tokenizer, "pad_token_id", None)
    if isinstance(pad, bool) or not isinstance(pad, int):
        raise ConfigError("pad_token_id", f"the tokenizer's pad token id must be an int, "
                                          f"got {pad!r}")


def check_dropout(trainer: ConduitGRPOTrainer) -> None:
    """Refuse a policy that draws random numbers in training where old log-probs are
    computed.

    TRL computes them with the policy in training mode, drawing dropout masks (and any
    other training-time randomness) from torch's RNG; the path takes the learner's own for
    the mini-batches trained before an optimizer step and computes the rest on a snapshot
    in eval mode, in delivery. The log-probs, and torch's RNG stream after them (so the
    next shuffle), would differ. Without old log-probs both paths draw the same numbers in
    the same order (in the learner's updates), and nothing is refused.

    Three checks, in turn: the policy's ``torch.nn`` dropout modules; the numbers its
    modules keep under a name containing ``drop``, ``jitter`` or ``noise`` (such as
    Llama's ``attention_dropout``, OPT's ``layerdrop``, DBRX's ``resid_pdrop``, Mixtral's
    ``jitter_noise``); and one no-grad forward of a two-token input in training mode (the
    pass TRL makes), which must leave torch's CPU and CUDA RNG states as they were (it
    runs on forked RNG states, and the policy's modes and buffers are put back). Where
    that forward fails, the first two checks stand alone.

    Raises:
        ConfigError: ``disable_dropout`` is False and a ``torch.nn.Dropout`` of the policy
            has ``p > 0`` (field ``disable_dropout``); or another kind of dropout module
            has ``p > 0`` (field ``model``); or such a number is above 0 (field: its
            name); or the training-mode forward draws random numbers (field ``model``).
    """
    if not trainer._needs_old_logps():
        return
    why = ("old log-probs are computed (gradient_accumulation_steps is not a multiple of "
           "steps_per_generation × num_iterations), and TRL computes them in training "
           "mode, drawing random numbers that ConduitGRPOTrainer does not reproduce")
    instead = ("(or make gradient_accumulation_steps a multiple of steps_per_generation × "
               "num_iterations)")
    for name, module in trainer.model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            if isinstance(module, torch.nn.Dropout):  # what disable_dropout resets
                raise ConfigError(
                    "disable_dropout", f"the model drops out in training ({name or 'model'}: "
                    f"p={module.p}) while {why}; set disable_dropout=True {instead}")
            raise ConfigError(
                "model", f"{name or 'model'} ({type(module).__name__}) drops out with "
                f"p={module.p}, which disable_dropout does not reset, while {why}; set its "
                f"p to 0 {instead}")
        for attr, v in vars(module).items():
            if (_RANDOM_ATTR.search(attr) and isinstance(v, numbers.Real)
                    and not isinstance(v, bool) and v > 0):
                raise ConfigError(
                    attr, f"the model draws random numbers in training ({name or 'model'}."
                    f"{attr}={v}, which disable_dropout does not reset) while {why}; set "
                    f"{attr}=0 in the model's config {instead}")
    if trainer._draws_in_training():
        raise ConfigError(
            "model", f"the model draws random numbers in a training-mode forward (torch's "
            f"RNG state moved over one forward of a two-token input; a dropout or other "
            f"stochastic layer that disable_dropout does not reset, such as one reading "
            f"its probability from the model's config) while {why}; set its probability "
            f"to 0 in the model's config {instead}")


def draws_in_training(trainer: ConduitGRPOTrainer) -> bool:
    """Whether one no-grad forward of the policy in training mode, as TRL computes old
    log-probs (a two-token sequence of the pad token, its last token scored, gradient
    checkpointing off), moves torch's CPU RNG or, on a CUDA device, that device's RNG.
    The forward runs on forked RNG states; the modules' training flags and the policy's
    buffers are put back. False where the forward raises (nothing is learnt)."""
    model, device = trainer.model, trainer.accelerator.device
    ids = torch.full((1, 2), int(trainer._tokenizer.pad_token_id), dtype=torch.long,
                     device=device)
    modes = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        before = _rng_states(device)
        try:
            model.train()
            with torch.no_grad(), disable_gradient_checkpointing(
                    model, trainer.args.gradient_checkpointing_kwargs):
                trainer._get_per_token_logps_and_entropies(model, ids, torch.ones_like(ids), 1,
                                                           batch_size=1)
        except Exception:  # an input this model cannot take: no verdict
            return False
        finally:
            for m, training in modes:
                m.training = training
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
        after = _rng_states(device)
    return any(not torch.equal(x, y) for x, y in zip(before, after))


def check_schedule(trainer: ConduitGRPOTrainer, schedule: Schedule) -> None:
    """Check ``schedule`` against the feasible space of the plane the trainer's ``_build_path``
    builds (the same geometry: one on-policy iteration of ``generation_batch_size`` rows in
    ``steps_per_generation`` mini-batches, pushed in groups of ``num_generations``).

    Raises:
        ScheduleError: ``schedule`` is outside that space.
    """
    a = trainer.args
    space = PlaneConfig(
        spec=ExperienceSpec.of(advantage=((), torch.float32)), capacity=a.generation_batch_size,
        mode="on_policy", num_minibatches=a.steps_per_generation,
        num_epochs=trainer.num_iterations, rollout_rows=trainer.num_generations).schedule_space()
    try:
        space.check(schedule)
    except ScheduleError as exc:
        raise ScheduleError(
            f"conduit_schedule: {exc} (steps_per_generation={a.steps_per_generation}, "
            f"generation_batch_size={a.generation_batch_size}, num_generations="
            f"{trainer.num_generations})") from exc


__all__ = ["check_arguments", "check_dropout", "check_schedule", "check_supported",
           "draws_in_training"]
