"""Delivery of GRPO's mini-batches: the iteration's ragged tokens padded, with the log-probs
each mini-batch needs."""

from __future__ import annotations

from typing import Any, Literal

import torch

from conduit.integrations.grpo_gate import PrefetchGate
from conduit.integrations.grpo_logprobs import LogProbPlan
from conduit.integrations.grpo_pushes import IterationPushes


class MiniBatchDelivery:
    """The plane's delivery operator: gathers a mini-batch's rows, pads their prompts (left, to
    the iteration's ``prompt_width``) and completions (right, to the mini-batch's or the
    iteration's longest), and adds the log-probs of :class:`LogProbPlan`.

    Args:
        pushes: The iteration's pushes (their tokens, packed).
        plan: The log-probs each mini-batch carries.
        gate: The prefetch gate a delivery on the worker waits on.
        rows: Rows per iteration.
        pad_token_id: Token that pads ids.
        pad_completions_to: ``"minibatch"`` or ``"iteration"``.
    """

    def __init__(self, pushes: IterationPushes, plan: LogProbPlan, gate: PrefetchGate, *,
                 rows: int, pad_token_id: int,
                 pad_completions_to: Literal["minibatch", "iteration"]) -> None:
        self._pushes, self._plan, self._gate = pushes, plan, gate
        self.pad_token_id, self.pad_completions_to = pad_token_id, pad_completions_to
        self.part_of = [0] * rows  # row -> its mini-batch within the epoch
        self.prompt_width = 0

    def set_order(self, in_order: list[int], num_minibatches: int) -> None:
        """Rows of the iteration in delivery order, split into ``num_minibatches`` equal
        parts."""
        per_part = len(in_order) // num_minibatches  # equal parts, in delivery order
        for position, row in enumerate(in_order):
            self.part_of[row] = position // per_part

    def deliver(self, exp_in: Any, learn_out: Any) -> None:
        """Deliver the mini-batch ``exp_in`` holds to ``learn_out`` (the operator).

        Raises:
            SpecError: A log-prob source's ``fn`` returned something else than per-token
                log-probs.
        """
        self._gate.wait()
        pushes = self._pushes
        if pushes.spent > 1 or (pushes.spent and not self._gate.in_pull):
            pushes.free_spent()  # on the worker; on the learner once two iterations' wait
        rows = exp_in.read()
        slots = rows["_index"]  # generation rows, and ragged slots (see the spec)
        with pushes.lock:
            prompt_ids, prompt_mask = pushes.ragged.padded_with_mask(
                "prompt_ids", slots, pad_value=self.pad_token_id, side="left",
                width=self.prompt_width, mask_dtype=torch.int64)
            width = None
            if self.pad_completions_to == "iteration":
                width = int(pushes.ragged.lengths("completion_ids").max())
            completion_ids, completion_mask = pushes.ragged.padded_with_mask(
                "completion_ids", slots, pad_value=self.pad_token_id, width=width,
                mask_dtype=torch.int64)
        out = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
               "completion_ids": completion_ids, "completion_mask": completion_mask,
               "advantages": rows["advantage"], "row": slots}
        part = self.part_of[int(slots.numpy()[0])] if slots.numel() else 0
        self._plan.attach(out, part, slots)
        learn_out.write(out)


__all__ = ["MiniBatchDelivery"]
