"""``ConduitGRPOTrainer``: TRL's ``GRPOTrainer`` with a Conduit on-policy plane as its experience
path.

TRL prepares a whole generation batch at once: after generation it pads every sequence to the
batch's longest, computes old (and reference) log-probs over the batch, scores it, normalizes
advantages, shuffles and splits it, and only then starts the first update. This subclass keeps
generation and scoring as they are (TRL's reward functions, on the learner's thread, right after
generation) and hands the scored groups to a
:class:`~conduit.integrations.grpo.GroupExperiencePath`: ingestion computes each group's
advantages and packs the tokens without padding; the learner's own pull builds the
first mini-batch, and a background worker builds each later one (padded to its own longest
completion, with the log-probs it needs) while the previous update runs. Where TRL computes old
log-probs (``gradient_accumulation_steps`` not a multiple of ``steps_per_generation ×
num_iterations``), the mini-batches of a single-epoch iteration trained before its first
optimizer step are trained under the policy that generated them, so their old log-probs are the
learner's own, detached (the values TRL computes), and need no forward pass; every later one
gets them from a snapshot of that policy, as TRL's. How many that is depends on where the
iteration starts within an accumulation window (an iteration need not start on an optimizer
step), so it is counted per iteration.

The order of the mini-batches, the advantages and the loss are TRL's: the shuffle draws the same
permutation from torch's RNG at the same point, after the reward functions (which may draw from
it too). Where that cannot hold, the constructor refuses the configuration: a policy that draws
random numbers in training (dropout, layer drop, router noise) while old log-probs are computed
(TRL computes them in training mode, drawing from torch's RNG), and a reference model that TRL
syncs during training (``sync_ref_model``: its log-probs are computed per mini-batch in
delivery, after the sync may have moved it). The settings that do not depend on the built
trainer are checked before TRL's constructor runs (so before it starts a vLLM engine or probes
an environment).

Errors reach the caller as TRL raises them: a reward function's exception (and TRL's own check
of the number of rewards) propagates unchanged. One difference: rewards must be finite (NaN for
an unscorable completion); an infinite reward raises :class:`~conduit.errors.SpecError`, where
TRL trains on it.
"""

from __future__ import annotations

import copy
import inspect
import numbers
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import torch
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import nanstd as trl_nanstd

from conduit.errors import ConfigError, ScheduleError
from conduit.integrations.grpo import GroupExperiencePath, LogProbSource, combine_rewards
from conduit.plane.config import PlaneConfig
from conduit.scheduling.space import Schedule
from conduit.spec import ExperienceSpec
from conduit.storage import data_path_threads

PREFETCH_GATE_S = 1.0
"""Seconds a prefetched mini-batch waits, at most, for the next update to begin (see
:class:`~conduit.integrations.grpo.GroupExperiencePath`'s ``gate_prefetch``)."""

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


class ConduitGRPOTrainer(GRPOTrainer):
    """A ``trl.GRPOTrainer`` whose experience path runs through Conduit; a drop-in replacement.

    Args:
        *args: Those of ``trl.GRPOTrainer``.
        conduit_schedule: Schedule of the plane (default: ingestion inline once per arrival
            of groups, delivery overlapped once per mini-batch).
        pad_completions_to: ``"minibatch"`` (default: each mini-batch's longest completion) or
            ``"iteration"`` (the generation batch's longest, as TRL pads).
        **kwargs: Those of ``trl.GRPOTrainer``.

    Raises:
        ConfigError: ``conduit_schedule`` is not a Schedule or None, ``pad_completions_to`` is
            unknown, or a feature the Conduit path does not carry is enabled (vLLM, tools,
            environments, ``rollout_func``, ``scale_rewards="batch"``, ``normalize_then_sum``,
            ``mask_truncated_completions``, ``pad_to_multiple_of``, ``sync_ref_model``; all
            of these checked before TRL's constructor runs; then several processes, or
            ``beta`` without a reference model), or the policy draws random numbers in
            training while old log-probs are computed (see :meth:`_check_dropout`), or the
            tokenizer's pad token is not an int. Image inputs are refused when training
            meets them.
        ScheduleError: ``conduit_schedule`` lies outside the plane's feasible space for this
            configuration (``steps_per_generation``, ``generation_batch_size`` and
            ``num_generations`` fix it).
    """

    def __init__(self, *args: Any, conduit_schedule: Schedule | None = None,
                 pad_completions_to: Literal["minibatch", "iteration"] = "minibatch",
                 **kwargs: Any) -> None:
        if conduit_schedule is not None and not isinstance(conduit_schedule, Schedule):
            raise ConfigError("conduit_schedule", f"must be a conduit Schedule or None, got "
                                                  f"{conduit_schedule!r}")
        if pad_completions_to not in ("minibatch", "iteration"):
            raise ConfigError("pad_completions_to", f"must be 'minibatch' or 'iteration', got "
                                                    f"{pad_completions_to!r}")
        self._check_arguments(args, kwargs)
        super().__init__(*args, **kwargs)
        self._check_supported()
        self._check_dropout()
        if conduit_schedule is not None:
            self._check_schedule(conduit_schedule)
        self._conduit_schedule = conduit_schedule
        self._pad_completions_to = pad_completions_to
        self._conduit: GroupExperiencePath | None = None
        self._conduit_left = 0
        self._conduit_fresh = 0  # mini-batches of this iteration before an optimizer step
        self._window_pos = 0  # micro-steps done in the current gradient-accumulation window
        self._conduit_items: torch.Tensor | None = None
        self._conduit_per_func: torch.Tensor | None = None
        self._old_policy: torch.nn.Module | None = None
        self._old_params: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._log_job: tuple[Any, ...] | None = None
        self._log_future: Future[None] | None = None
        self._log_pool: ThreadPoolExecutor | None = None

    @staticmethod
    def _check_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
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

    def _check_supported(self) -> None:
        a = self.args
        _refuse([*_refused_settings(a, tools=self.tools, rollout_func=self.rollout_func,
                                    environment_factory=self.environment_factories),
                 ("num_processes", self.accelerator.num_processes != 1, "run one process"),
                 ("beta", self.beta != 0.0 and self.ref_model is None,
                  "give a reference model (PEFT adapters are not carried)")])
        if a.generation_batch_size % self.num_generations:
            raise ConfigError("generation_batch_size", "must be a multiple of num_generations")
        pad = getattr(self._tokenizer, "pad_token_id", None)
        if isinstance(pad, bool) or not isinstance(pad, int):
            raise ConfigError("pad_token_id", f"the tokenizer's pad token id must be an int, "
                                              f"got {pad!r}")

    def _needs_old_logps(self) -> bool:
        """TRL's rule for when old log-probs are computed: ``gradient_accumulation_steps`` not
        a multiple of ``steps_per_generation × num_iterations``."""
        a = self.args
        return a.gradient_accumulation_steps % (a.steps_per_generation * self.num_iterations) != 0

    def _check_dropout(self) -> None:
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
        if not self._needs_old_logps():
            return
        why = ("old log-probs are computed (gradient_accumulation_steps is not a multiple of "
               "steps_per_generation × num_iterations), and TRL computes them in training "
               "mode, drawing random numbers that ConduitGRPOTrainer does not reproduce")
        instead = ("(or make gradient_accumulation_steps a multiple of steps_per_generation × "
                   "num_iterations)")
        for name, module in self.model.named_modules():
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
        if self._draws_in_training():
            raise ConfigError(
                "model", f"the model draws random numbers in a training-mode forward (torch's "
                f"RNG state moved over one forward of a two-token input; a dropout or other "
                f"stochastic layer that disable_dropout does not reset, such as one reading "
                f"its probability from the model's config) while {why}; set its probability "
                f"to 0 in the model's config {instead}")

    def _draws_in_training(self) -> bool:
        """Whether one no-grad forward of the policy in training mode, as TRL computes old
        log-probs (a two-token sequence of the pad token, its last token scored, gradient
        checkpointing off), moves torch's CPU RNG or, on a CUDA device, that device's RNG.
        The forward runs on forked RNG states; the modules' training flags and the policy's
        buffers are put back. False where the forward raises (nothing is learnt)."""
        model, device = self.model, self.accelerator.device
        ids = torch.full((1, 2), int(self._tokenizer.pad_token_id), dtype=torch.long,
                         device=device)
        modes = [(m, m.training) for m in model.modules()]
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
        cuda = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            before = _rng_states(device)
            try:
                model.train()
                with torch.no_grad(), disable_gradient_checkpointing(
                        model, self.args.gradient_checkpointing_kwargs):
                    self._get_per_token_logps_and_entropies(model, ids, torch.ones_like(ids), 1,
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

    def _check_schedule(self, schedule: Schedule) -> None:
        """Check ``schedule`` against the feasible space of the plane that :meth:`_build_path`
        builds (the same geometry: one on-policy iteration of ``generation_batch_size`` rows in
        ``steps_per_generation`` mini-batches, pushed in groups of ``num_generations``).

        Raises:
            ScheduleError: ``schedule`` is outside that space.
        """
        a = self.args
        space = PlaneConfig(
            spec=ExperienceSpec.of(advantage=((), torch.float32)), capacity=a.generation_batch_size,
            mode="on_policy", num_minibatches=a.steps_per_generation,
            num_epochs=self.num_iterations, rollout_rows=self.num_generations).schedule_space()
        try:
            space.check(schedule)
        except ScheduleError as exc:
            raise ScheduleError(
                f"conduit_schedule: {exc} (steps_per_generation={a.steps_per_generation}, "
                f"generation_batch_size={a.generation_batch_size}, num_generations="
                f"{self.num_generations})") from exc

    # -- the experience path ------------------------------------------------------------------

    def _build_path(self) -> GroupExperiencePath:
        a = self.args
        sources = []
        if self._needs_old_logps():
            self._old_policy = copy.deepcopy(self.model).eval()
            for p in self._old_policy.parameters():
                p.requires_grad_(False)
            self._old_params = (list(self._old_policy.parameters()),
                                list(self.model.parameters()))
            # TRL computes them for every mini-batch; those before the iteration's first
            # optimizer step (one epoch) are the learner's own, detached, so need none
            skip = self._fresh_minibatches if self.num_iterations == 1 else 0
            # TRL computes both once per generation batch: later epochs reuse them
            sources.append(LogProbSource("old_per_token_logps",
                                         self._logps_of(self._old_policy), skip_first=skip,
                                         reuse_across_epochs=True))
        if self.beta != 0.0:
            sources.append(LogProbSource("ref_per_token_logps", self._logps_of(self.ref_model),
                                         reuse_across_epochs=True))
        max_prompt = a.max_prompt_length if getattr(a, "max_prompt_length", None) else 1 << 20
        return GroupExperiencePath(
            group_size=self.num_generations, groups=a.generation_batch_size // self.num_generations,
            num_minibatches=a.steps_per_generation, num_epochs=self.num_iterations,
            max_prompt_length=max_prompt, max_completion_length=self._completion_limit(),
            pad_token_id=self._tokenizer.pad_token_id, score=self._score,
            scale_rewards=self.scale_rewards, logprobs=sources,
            pad_completions_to=self._pad_completions_to, learner_device=self.accelerator.device,
            schedule=self._conduit_schedule, gate_prefetch=PREFETCH_GATE_S)

    def _completion_limit(self) -> int:
        """The longest completion generation returns: the ``max_new_tokens`` of the generation
        config TRL built (``max_completion_length`` unless ``generation_kwargs`` overrides it);
        no bound where that is unset (generation then stops at a ``max_length``, which the
        model's own generation config may set)."""
        n = getattr(getattr(self, "generation_config", None), "max_new_tokens", None)
        if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
            return n
        return 1 << 20

    def _fresh_minibatches(self, iteration: int) -> int:
        """Mini-batches of the iteration being begun that are trained before the next
        optimizer step: the rest of the current accumulation window (set when it was
        generated, see :meth:`_generate_iteration`)."""
        return self._conduit_fresh

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        """``GRPOTrainer.training_step``, counting the micro-steps of the accumulation window
        (the optimizer steps after the one where the trainer syncs gradients)."""
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._window_pos = 0 if self.accelerator.sync_gradients else self._window_pos + 1

    def _logps_of(self, model: torch.nn.Module) -> Any:
        def logps(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                  completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
            dev = self.accelerator.device
            ids = torch.cat([prompt_ids, completion_ids], dim=1).to(dev)
            mask = torch.cat([prompt_mask, completion_mask], dim=1).to(dev)
            with torch.no_grad():
                out, _, _ = self._get_per_token_logps_and_entropies(
                    model, ids, mask, completion_ids.size(1),
                    batch_size=self.args.per_device_train_batch_size)
            return out
        return logps

    @staticmethod
    def _score(payload: Any, prompt_ids: Any, completion_ids: Any) -> torch.Tensor:
        """The path's scorer: the rewards :meth:`_generate_iteration` computed, pushed as the
        payload."""
        return payload

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        """Training: the next mini-batch from the plane, generating a new iteration when the
        previous one is consumed. Evaluation: TRL's own path."""
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        if self._conduit is None:
            self._conduit = self._build_path()
        if self._conduit_left == 0:
            self._wait_logs()
            self._generate_iteration(generation_batch)
        batch = self._conduit.pull()
        self._conduit_left -= 1
        batch.pop("row")
        batch["num_items_in_batch"] = self._conduit_items
        return batch

    def _generate_iteration(self, inputs: list[dict[str, Any]]) -> None:
        path = self._conduit
        assert path is not None
        prompts = [x["prompt"] for x in inputs]
        if "images" in inputs[0] or "image" in inputs[0]:
            raise ConfigError("train_dataset", "image inputs are not carried by "
                                               "ConduitGRPOTrainer")
        if self._old_policy is not None:  # the weights that generate this iteration
            with torch.no_grad():
                torch._foreach_copy_(*self._old_params)
        prompt_ids, completion_ids, _, completions, _, extra, _, _ = self._generate(prompts)
        if extra:
            raise ConfigError("rollout_func", "extra fields are not carried")
        # scored as TRL scores them, on this thread: a reward function's exception reaches the
        # caller unchanged, and its draws from torch's RNG come before the shuffle's
        per_func = self._calculate_rewards(inputs, prompts, completions, completion_ids)
        rewards = combine_rewards(per_func, self.reward_weights).cpu()  # SpecError: infinite
        order = torch.randperm(len(prompts))  # TRL's shuffle, drawn at the same point
        # this micro-step and the rest of its accumulation window run under the generating
        # policy (the window is shorter at the end of an epoch)
        window = getattr(self, "current_gradient_accumulation_steps",
                         self.args.gradient_accumulation_steps)
        self._conduit_fresh = max(0, window - self._window_pos)
        self._conduit_per_func = per_func.cpu()
        self._conduit_items = torch.tensor(sum(len(c) for c in completion_ids),
                                           device=self.accelerator.device)
        path.begin_iteration(order, prompt_width=max(len(p) for p in prompt_ids))
        # generate() returns every group of the batch at once: they arrive, and are ingested,
        # together
        path.push_groups(prompt_ids=prompt_ids, completion_ids=completion_ids, payload=rewards)
        path.flush()
        self._conduit_left = path.num_minibatches * path.num_epochs
        self._log_iteration(prompts, completions)

    def _log_iteration(self, prompts: list[Any], completions: list[Any]) -> None:
        """Set aside what TRL records per generation batch; :meth:`compute_loss` hands it to a
        background thread as the first update begins, and :meth:`log` waits for it."""
        path = self._conduit
        assert path is not None and self._conduit_per_func is not None
        self._log_job = (prompts, completions, self._conduit_per_func, path.rewards,
                         path.advantages, dict(self._pending_extra_logs),
                         dict(self._pending_metrics))
        self._pending_extra_logs.clear()
        self._pending_metrics.clear()

    def _write_logs(self, prompts: list[Any], completions: list[Any], per_func: torch.Tensor,
                    rewards: torch.Tensor, advantages: torch.Tensor,
                    extra_logs: dict[str, list[Any]], extra_metrics: dict[str, list[float]]
                    ) -> None:
        """The reward metrics and completion logs TRL records per generation batch, each
        statistic computed as TRL computes it."""
        mode, g = "train", self.num_generations
        with data_path_threads(1):
            stats = [s for i in range(per_func.shape[1])
                     for s in (torch.nanmean(per_func[:, i]), trl_nanstd(per_func[:, i]))]
            std = (trl_nanstd(rewards.view(-1, g), dim=1) if g > 1
                   else torch.zeros(rewards.numel() // g))
            zero_std = torch.isclose(std, torch.zeros_like(std))  # per group (TRL: per row)
            stats += [torch.nanmean(rewards), trl_nanstd(rewards), zero_std.float().mean()]
            values = torch.stack(stats).tolist()
        metrics = self._metrics[mode]
        for i, name in enumerate(self.reward_func_names):
            metrics[f"rewards/{name}/mean"].append(values[2 * i])
            metrics[f"rewards/{name}/std"].append(values[2 * i + 1])
        metrics["reward"].append(values[-3])
        metrics["reward_std"].append(values[-2])
        metrics["frac_reward_zero_std"].append(values[-1])
        self._logs["prompt"].extend(prompts)
        self._logs["completion"].extend(completions)
        for i, name in enumerate(self.reward_func_names):
            self._logs["rewards"][name].extend(per_func[:, i].tolist())
        self._logs["advantages"].extend(advantages.tolist())
        for column in sorted(extra_logs):  # user-logged columns and metrics
            self._logs["extra"][column].extend(extra_logs[column])
        for name in sorted(extra_metrics):
            metrics[name].append(sum(extra_metrics[name]) / len(extra_metrics[name]))

    def _wait_logs(self) -> None:
        """Wait for the background log writer; re-raise what it raised."""
        future, self._log_future = self._log_future, None
        if future is not None:
            future.result()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``GRPOTrainer.log``, once the generation batch's metrics are written."""
        self._wait_logs()
        super().log(logs, start_time)

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        """``GRPOTrainer.compute_loss``; the plane's prefetch of the next mini-batch runs
        during it."""
        if self._conduit is not None:
            self._conduit.update_started()
        if self._log_job is not None:
            if self._log_pool is None:
                self._log_pool = ThreadPoolExecutor(1, thread_name_prefix="conduit-grpo-logs")
            job, self._log_job = self._log_job, None
            self._log_future = self._log_pool.submit(self._write_logs, *job)
        return super().compute_loss(*args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``GRPOTrainer.train``; the plane's workers stop, and the copy of the policy that old
        log-probs are computed on is dropped, when it returns (a later call builds both
        again)."""
        try:
            return super().train(*args, **kwargs)
        finally:
            self._log_job = None
            try:
                self._wait_logs()
            finally:
                if self._log_pool is not None:
                    self._log_pool.shutdown()
                    self._log_pool = None
            if self._conduit is not None:
                self._conduit.close()
                self._conduit, self._conduit_left = None, 0
            self._old_policy, self._old_params = None, ([], [])
            self._conduit_items = self._conduit_per_func = None
            self._window_pos = 0
