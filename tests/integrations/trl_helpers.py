"""A tiny ConduitGRPOTrainer for the TRL tests (needs ``trl``)."""

from __future__ import annotations

import tempfile
from typing import Any

from conduit.workloads import grpo_task


def construct_trainer(model: Any, *, trainer_args: Any = (), **config: Any) -> Any:
    """A ConduitGRPOTrainer for ``model``: 8 rows per generation batch in 2 mini-batches of 4,
    ``config`` added to its GRPOConfig; ``trainer_args`` are keyword arguments of the
    trainer."""
    from trl import GRPOConfig

    from conduit.integrations.trl import ConduitGRPOTrainer

    tok = grpo_task.digit_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(output_dir=tmp, per_device_train_batch_size=4, num_generations=4,
                         steps_per_generation=2, use_cpu=True, report_to="none", **config)
        return ConduitGRPOTrainer(model=model, args=cfg,
                                  reward_funcs=grpo_task.reward_fn("target"),
                                  train_dataset=grpo_task.prompt_dataset(n=8, prompt_len=4,
                                                                         seed=0),
                                  processing_class=tok, **dict(trainer_args))
