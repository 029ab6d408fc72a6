"""The on-policy plane a verl replay buffer passes each step's groups through."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from conduit.errors import ConduitError, ConfigError
from conduit.integrations.verl._weak import weak_ingestion
from conduit.integrations.verl.advantages import grpo_group_advantage
from conduit.plane import ActorIn, BufferOut, ExperienceDataPlane
from conduit.spec import Batch, ExperienceSpec

if TYPE_CHECKING:
    from conduit.integrations.verl.replay import ConduitSamplerConfig

_SPEC = ExperienceSpec.of(key=((), torch.int64), seq_len=((), torch.int64),
                          score=((), torch.float32), advantage=((), torch.float32))
_ROLLOUT_SPEC = ExperienceSpec.of(key=((), torch.int64), seq_len=((), torch.int64),
                                  score=((), torch.float32))


class StepPlane:
    """Passes each step's groups through a Conduit on-policy plane: ingestion computes each
    group's GRPO advantage, delivery lays out the step's mini-batches. The plane is built for
    the first step's size and rebuilt after a failure.

    Args:
        config: The buffer's sampler configuration.
    """

    def __init__(self, config: ConduitSamplerConfig) -> None:
        self.config = config
        self._plane: ExperienceDataPlane | None = None
        self._step_rows = 0

    @property
    def plane(self) -> ExperienceDataPlane | None:
        """The plane (None before the first step and after a failure)."""
        return self._plane

    def run(self, mask: torch.Tensor, scores: torch.Tensor, tags: list[dict],
            groups: int) -> list[int]:
        """Push each group (checked: ``group_size`` rows each) through the plane; the rows'
        order over its mini-batches. Writes each tag's ``conduit_score`` and
        ``conduit_advantage``. If anything fails once a row was pushed, the plane is closed
        (the next call builds a fresh one), so no pushed row outlives the call."""
        plane = self._plane_for(groups * self.config.group_size)
        n = self.config.group_size
        try:
            for start in range(0, len(tags), n):  # one rollout unit per group
                stop = start + n
                plane.push({"key": torch.arange(start, stop),
                            "seq_len": mask[start:stop].sum(-1), "score": scores[start:stop]},
                           policy_version=plane.policy_version)
            order: list[int] = []
            for mb in plane.minibatches():
                for k, s, a in zip(mb["key"].tolist(), mb["score"].tolist(),
                                   mb["advantage"].tolist()):
                    tags[k]["conduit_score"], tags[k]["conduit_advantage"] = s, a
                    order.append(k)
        except BaseException:
            self.reset()
            raise
        return order

    def reset(self) -> None:
        """Drop the plane and the rows it holds; the next step builds a fresh one."""
        plane, self._plane = self._plane, None
        if plane is not None:
            with contextlib.suppress(ConduitError):  # e.g. DataLossError: dropped on purpose
                plane.close()

    def _plane_for(self, rows: int) -> ExperienceDataPlane:
        if self._plane is not None:
            if rows != self._step_rows:
                raise ConfigError("batch_size", f"a step of {rows} rows after steps of "
                                                f"{self._step_rows}; keep the batch size")
            return self._plane
        mb = self.config.mini_batch_size or rows
        if rows % mb:
            raise ConfigError("sampler_kwargs.mini_batch_size", f"{mb} does not divide the "
                                                                f"step's {rows} rows")
        plane = ExperienceDataPlane(
            spec=_SPEC, rollout_spec=_ROLLOUT_SPEC, capacity=rows, mode="on_policy",
            num_minibatches=rows // mb, placement=self.config.placement,
            rollout_rows=self.config.group_size, timeout=self.config.timeout)
        plane.register_ingestion()(weak_ingestion(self._ingest))
        self._plane, self._step_rows = plane, rows
        return plane

    def _ingest(self, actor_in: ActorIn, exp_out: BufferOut) -> None:
        for group in actor_in.read_units():
            exp_out.write(self._with_advantage(group))

    def _with_advantage(self, group: Batch) -> Batch:
        advantage = grpo_group_advantage(group["score"], epsilon=self.config.epsilon,
                                         norm_by_std=self.config.norm_adv_by_std_in_grpo)
        return {**group, "advantage": advantage}


__all__ = ["StepPlane"]
