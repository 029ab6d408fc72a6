"""The reward metrics and completion logs TRL records per generation batch, written on a
background thread while the first update of the batch runs."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from trl.trainer.utils import nanstd as trl_nanstd

from conduit.storage import data_path_threads

if TYPE_CHECKING:
    from conduit.integrations.trl.trainer import ConduitGRPOTrainer


class IterationLogs:
    """Sets aside what TRL records per generation batch, writes it into the trainer's metrics
    and logs on a background thread once the batch's first update begins, and lets the trainer
    wait for it.

    Args:
        trainer: The trainer whose ``_metrics`` and ``_logs`` receive the records.
    """

    def __init__(self, trainer: ConduitGRPOTrainer) -> None:
        self._trainer = trainer
        self._job: tuple[Any, ...] | None = None
        self._future: Future[None] | None = None
        self._pool: ThreadPoolExecutor | None = None

    def record(self, prompts: list[Any], completions: list[Any], per_func: torch.Tensor,
               rewards: torch.Tensor, advantages: torch.Tensor) -> None:
        """Set aside a generation batch's records, with the trainer's pending extra logs and
        metrics (taken from it); :meth:`start` writes them."""
        t = self._trainer
        self._job = (prompts, completions, per_func, rewards, advantages,
                     dict(t._pending_extra_logs), dict(t._pending_metrics))
        t._pending_extra_logs.clear()
        t._pending_metrics.clear()

    def start(self) -> None:
        """Write the records set aside, if any, on the background thread."""
        if self._job is None:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="conduit-grpo-logs")
        job, self._job = self._job, None
        self._future = self._pool.submit(self._write, *job)

    def wait(self) -> None:
        """Wait for the background writer; re-raise what it raised."""
        future, self._future = self._future, None
        if future is not None:
            future.result()

    def close(self) -> None:
        """Drop the records not started, wait for the writer and stop its thread; re-raise
        what it raised."""
        self._job = None
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None

    def _write(self, prompts: list[Any], completions: list[Any], per_func: torch.Tensor,
               rewards: torch.Tensor, advantages: torch.Tensor,
               extra_logs: dict[str, list[Any]], extra_metrics: dict[str, list[float]]) -> None:
        """The reward metrics and completion logs TRL records per generation batch, each
        statistic computed as TRL computes it."""
        t = self._trainer
        mode, g = "train", t.num_generations
        with data_path_threads(1):
            stats = [s for i in range(per_func.shape[1])
                     for s in (torch.nanmean(per_func[:, i]), trl_nanstd(per_func[:, i]))]
            std = (trl_nanstd(rewards.view(-1, g), dim=1) if g > 1
                   else torch.zeros(rewards.numel() // g))
            zero_std = torch.isclose(std, torch.zeros_like(std))  # per group (TRL: per row)
            stats += [torch.nanmean(rewards), trl_nanstd(rewards), zero_std.float().mean()]
            values = torch.stack(stats).tolist()
        metrics = t._metrics[mode]
        for i, name in enumerate(t.reward_func_names):
            metrics[f"rewards/{name}/mean"].append(values[2 * i])
            metrics[f"rewards/{name}/std"].append(values[2 * i + 1])
        metrics["reward"].append(values[-3])
        metrics["reward_std"].append(values[-2])
        metrics["frac_reward_zero_std"].append(values[-1])
        t._logs["prompt"].extend(prompts)
        t._logs["completion"].extend(completions)
        for i, name in enumerate(t.reward_func_names):
            t._logs["rewards"][name].extend(per_func[:, i].tolist())
        t._logs["advantages"].extend(advantages.tolist())
        for column in sorted(extra_logs):  # user-logged columns and metrics
            t._logs["extra"][column].extend(extra_logs[column])
        for name in sorted(extra_metrics):
            metrics[name].append(sum(extra_metrics[name]) / len(extra_metrics[name]))


__all__ = ["IterationLogs"]
