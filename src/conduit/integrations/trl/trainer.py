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

from typing import Any, Literal

import torch
from trl import GRPOTrainer

from conduit.errors import ConfigError
from conduit.integrations.grpo import GroupExperiencePath, LogProbSource, combine_rewards
from conduit.integrations.trl.checks import (
    check_arguments,
    check_dropout,
    check_schedule,
    check_supported,
    draws_in_training,
)
from conduit.integrations.trl.logs import IterationLogs
from conduit.integrations.trl.old_policy import OldPolicy
from conduit.scheduling.space import Schedule

PREFETCH_GATE_S = 1.0
"""Seconds a prefetched mini-batch waits, at most, for the next update to begin (see
:class:`~conduit.integrations.grpo.GroupExperiencePath`'s ``gate_prefetch``)."""

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
            training while old log-probs are computed (see
            :func:`~conduit.integrations.trl.checks.check_dropout`), or the
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
        check_arguments(args, kwargs)
        super().__init__(*args, **kwargs)
        check_supported(self)
        check_dropout(self)
        if conduit_schedule is not None:
            check_schedule(self, conduit_schedule)
        self._conduit_schedule = conduit_schedule
        self._pad_completions_to = pad_completions_to
        self._conduit: GroupExperiencePath | None = None
        self._conduit_left = 0
        self._conduit_fresh = 0  # mini-batches of this iteration before an optimizer step
        self._window_pos = 0  # micro-steps done in the current gradient-accumulation window
        self._conduit_items: torch.Tensor | None = None
        self._old: OldPolicy | None = None
        self._iteration_logs = IterationLogs(self)

    @property
    def _old_policy(self) -> torch.nn.Module | None:
        """The frozen copy of the policy that old log-probs are computed on, if any."""
        return None if self._old is None else self._old.module

    def _needs_old_logps(self) -> bool:
        """TRL's rule for when old log-probs are computed: ``gradient_accumulation_steps`` not
        a multiple of ``steps_per_generation × num_iterations``."""
        a = self.args
        return a.gradient_accumulation_steps % (a.steps_per_generation * self.num_iterations) != 0

    def _draws_in_training(self) -> bool:
        """Whether a training-mode forward of the policy draws random numbers (see
        :func:`~conduit.integrations.trl.checks.draws_in_training`)."""
        return draws_in_training(self)

    # -- the experience path ------------------------------------------------------------------

    def _build_path(self) -> GroupExperiencePath:
        a = self.args
        sources = []
        if self._needs_old_logps():
            self._old = OldPolicy(self.model)
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
            self._iteration_logs.wait()
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
        if self._old is not None:  # the weights that generate this iteration
            self._old.sync()
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
        self._conduit_items = torch.tensor(sum(len(c) for c in completion_ids),
                                           device=self.accelerator.device)
        path.begin_iteration(order, prompt_width=max(len(p) for p in prompt_ids))
        # generate() returns every group of the batch at once: they arrive, and are ingested,
        # together
        path.push_groups(prompt_ids=prompt_ids, completion_ids=completion_ids, payload=rewards)
        path.flush()
        self._conduit_left = path.num_minibatches * path.num_epochs
        # TRL records these per generation batch: written as the first update begins
        self._iteration_logs.record(prompts, completions, per_func.cpu(), path.rewards,
                                    path.advantages)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``GRPOTrainer.log``, once the generation batch's metrics are written."""
        self._iteration_logs.wait()
        super().log(logs, start_time)

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        """``GRPOTrainer.compute_loss``; the plane's prefetch of the next mini-batch runs
        during it."""
        if self._conduit is not None:
            self._conduit.update_started()
        self._iteration_logs.start()
        return super().compute_loss(*args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``GRPOTrainer.train``; the plane's workers stop, and the copy of the policy that old
        log-probs are computed on is dropped, when it returns (a later call builds both
        again)."""
        try:
            return super().train(*args, **kwargs)
        finally:
            self._iteration_logs.close()
            if self._conduit is not None:
                self._conduit.close()
                self._conduit, self._conduit_left = None, 0
            self._old = None
            self._conduit_items = None
            self._window_pos = 0
