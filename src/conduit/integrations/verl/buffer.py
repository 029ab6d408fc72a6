"""Conduit as verl's GRPO experience path: ``DataProto`` groups in, ``DataProto`` mini-batches out.

A step's rows live in an on-policy :class:`~conduit.ExperienceDataPlane`, which decides where
they are placed (``placement``) and when ingestion and delivery run (``schedule``):

* ingestion runs once per put (one or more whole prompt groups): it checks the groups and
  computes their GRPO advantages (:mod:`conduit.integrations.verl.advantages`), equal to
  ``verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage`` over the whole step;
* delivery runs once per mini-batch, in the order verl's actor update would iterate the step
  (:class:`~conduit.integrations.verl.order.VerlOrderSampler`), and turns the rows back into a
  ``DataProto`` with the ``non_tensor_batch`` entries (``uid`` and the rest) they came with.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from verl import DataProto

from conduit._checks import check_bool, check_int, check_key, check_real
from conduit.errors import CapacityError, ConfigError, SpecError
from conduit.integrations.verl._checks import check_epsilon
from conduit.integrations.verl.advantages import (
    group_scores,
    grpo_group_advantage,
    token_level_advantage,
)
from conduit.integrations.verl.order import VerlOrderSampler
from conduit.plane import ActorIn, BufferOut, ExperienceDataPlane
from conduit.plane.migration import PlacementArg
from conduit.scheduling.space import Schedule
from conduit.spec import Batch, ExperienceSpec, FieldSpec

_ROW, _GROUP = "row_id", "group"
_ADDED = ("advantages", "returns")


class _Step:
    """Host-side bookkeeping of one step: its groups, their non-tensor entries, and the
    mini-batches pulled from the plane so far.

    A put records its groups here before it pushes them (a mini-batch of its rows may be
    delivered as soon as the push returns) and takes them back if the push raises. Pulled
    mini-batches stay here until the whole step is pulled, so a :meth:`GRPOBuffer.minibatches`
    that raised (a timeout) loses none of them and a retry resumes where it stopped.
    """

    def __init__(self, meta_info: Mapping[str, Any]) -> None:
        self.rows = 0
        self.uids: set[Any] = set()
        self.parts: list[dict[str, np.ndarray]] = []
        self.meta_info = dict(meta_info)
        self.pulled: list[Batch] = []  # the step's mini-batches, as the plane delivered them
        self.pulled_all = False  # the plane has moved on to the next step
        self._joined: dict[str, np.ndarray] | None = None

    def add(self, uids: list[Any], part: dict[str, np.ndarray], rows: int,
            meta_info: Mapping[str, Any]) -> None:
        """Record one put's groups (its rows follow the step's earlier rows)."""
        if self.rows == 0:
            self.meta_info = dict(meta_info)
        self.uids.update(uids)
        self.parts.append(part)
        self.rows += rows
        self._joined = None

    def remove_last(self, uids: list[Any], rows: int) -> None:
        """Take back the last :meth:`add` (its push raised)."""
        self.uids.difference_update(uids)
        self.parts.pop()
        self.rows -= rows
        self._joined = None

    def non_tensors(self, row_ids: torch.Tensor) -> dict[str, np.ndarray]:
        """The non-tensor entries of the given rows of the step."""
        joined = self._joined
        if joined is None:  # joined again after every put: later rows follow the earlier
            keys = self.parts[0].keys()
            joined = {k: np.concatenate([p[k] for p in self.parts]) for k in keys}
            self._joined = joined
        idx = row_ids.cpu().numpy()
        return {k: v[idx] for k, v in joined.items()}


class GRPOBuffer:
    """A step of GRPO experience between verl's rollout and its actor update.

    Example:
        >>> buf = GRPOBuffer(group_size=4, groups_per_step=8, mini_batch_size=16)
        >>> for group in groups:           # DataProto, 4 responses of one prompt each
        ...     buf.put(group)
        >>> for mb in buf.minibatches():   # DataProto with "advantages" and "returns"
        ...     update(mb)

    Args:
        group_size: Responses per prompt (verl's ``actor_rollout_ref.rollout.n``).
        groups_per_step: Prompt groups per step (verl's ``data.train_batch_size``).
        mini_batch_size: Rows per mini-batch; must divide ``group_size * groups_per_step``.
        epochs: Passes over each step (verl's ``ppo_epochs``).
        shuffle: Shuffle each epoch as verl's ``dataloader_kwargs={"shuffle": True}`` does;
            otherwise the mini-batches are ``DataProto.split(mini_batch_size)`` of the step.
        seed: Seed of that shuffle (verl's update passes 42).
        reward_key: Token-level reward field of the put batches (floating point).
        epsilon: Added to each group's standard deviation: a finite number, > 0 when
            ``norm_adv_by_std_in_grpo`` (verl's default 1e-6).
        norm_adv_by_std_in_grpo: Divide by it (GRPO) or only centre (Dr. GRPO).
        placement: Where the step's rows live: ``"auto"`` (default) lets Conduit decide from
            this machine's topology and the rows' size (Alg. 1), or any placement
            :class:`~conduit.ExperienceDataPlane` takes.
        schedule: Overlap and granularity of ingestion and delivery (default inline).
        learner_device: Device the mini-batches are delivered to.
        timeout: Seconds a put or a mini-batch may wait before raising.

    Raises:
        ConfigError: An argument is invalid; the message names it.
    """

    def __init__(self, *, group_size: int, groups_per_step: int, mini_batch_size: int,
                 epochs: int = 1, shuffle: bool = False, seed: int = 42,
                 reward_key: str = "token_level_rewards", epsilon: float = 1e-6,
                 norm_adv_by_std_in_grpo: bool = True, placement: PlacementArg = "auto",
                 schedule: Schedule | None = None, learner_device: str | torch.device = "cpu",
                 timeout: float = 60.0) -> None:
        group_size = check_int("group_size", group_size, minimum=1)
        groups_per_step = check_int("groups_per_step", groups_per_step, minimum=1)
        mini_batch_size = check_int("mini_batch_size", mini_batch_size, minimum=1)
        epochs = check_int("epochs", epochs, minimum=1)
        shuffle = check_bool("shuffle", shuffle)
        seed = check_int("seed", seed, minimum=0)
        reward_key = check_key("reward_key", reward_key)
        norm_adv_by_std_in_grpo = check_bool("norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo)
        epsilon = check_epsilon("epsilon", epsilon, norm_by_std=norm_adv_by_std_in_grpo)
        timeout = check_real("timeout", timeout, positive=True, what="a number of seconds")
        self.group_size, self.groups_per_step = group_size, groups_per_step
        self.rows_per_step = group_size * groups_per_step
        if self.rows_per_step % mini_batch_size:
            raise ConfigError("mini_batch_size", f"{mini_batch_size} does not divide the "
                                                 f"{self.rows_per_step} rows of a step "
                                                 f"(group_size × groups_per_step)")
        self.mini_batch_size, self.epochs = mini_batch_size, epochs
        self.num_minibatches = self.rows_per_step // mini_batch_size
        self.shuffle, self.seed = shuffle, seed
        self.reward_key, self.epsilon = reward_key, epsilon
        self.norm_by_std = norm_adv_by_std_in_grpo
        self._plane_args: dict[str, Any] = dict(
            placement=placement, schedule=schedule, learner_device=learner_device,
            timeout=timeout)
        self._plane: ExperienceDataPlane | None = None
        self._steps: dict[int, _Step] = {}
        self._filling = 0  # step that puts go to
        self._delivering = 0  # step that minibatches() reads
        self._put_lock = threading.Lock()  # puts one at a time: a failed one is taken back

    @property
    def plane(self) -> ExperienceDataPlane | None:
        """The plane holding the rows (built by the first :meth:`put`)."""
        return self._plane

    def put(self, data: DataProto) -> None:
        """Add whole prompt groups to the step being filled; ingestion computes their
        advantages. A step is full after ``groups_per_step`` groups; puts beyond it go to
        the next step, which waits until this one is delivered.

        Args:
            data: Responses with ``batch[reward_key]`` (floating point, finite) and
                ``batch["response_mask"]`` (``[rows, response_length]``) and
                ``non_tensor_batch["uid"]`` (the prompt of each response); every uid has
                exactly ``group_size`` rows, each with at least one response token. Other
                tensor and non-tensor entries travel along.

        A put that raises leaves the step as it was: its groups can be put again.

        Raises:
            SpecError: ``data`` is not a ``DataProto``, lacks a field, has a group of the wrong
                size or already put this step, a field whose name starts with ``_``, an
                empty response, rewards that are not floating point or whose sum over a
                response is not finite (field ``reward_key``), or a field whose shape or
                dtype differs from the first put's.
            CapacityError: The groups overflow the step being filled.
            BackpressureTimeout: The next step could not start within the timeout.
        """
        with self._put_lock:
            tensors, group = self._check(data)
            step = self._steps.get(self._filling) or _Step(data.meta_info)
            rows = len(data)
            if step.rows + rows > self.rows_per_step:
                raise CapacityError(f"a put of {rows} rows overflows the step, which has "
                                    f"{self.rows_per_step - step.rows} rows left; put whole "
                                    f"steps of {self.groups_per_step} groups", needed=rows,
                                    available=self.rows_per_step - step.rows)
            plane = self._plane or self._build(tensors)
            unit = {**tensors, _ROW: torch.arange(step.rows, step.rows + rows), _GROUP: group}
            uids = data.non_tensor_batch["uid"].tolist()
            # Recorded before the push: its rows may be delivered as soon as it returns.
            step.add(uids, {k: np.asarray(v) for k, v in data.non_tensor_batch.items()}, rows,
                     data.meta_info)
            self._steps[self._filling] = step  # minibatches() sees it with the plane built
            try:
                plane.push(unit, policy_version=self._filling)
            except BaseException:
                step.remove_last(uids, rows)
                raise
            if step.rows == self.rows_per_step:
                self._filling += 1

    def minibatches(self, *, timeout: float | None = None) -> list[DataProto]:
        """Every mini-batch of the oldest undelivered step (``epochs × num_minibatches``),
        in verl's order; the step is then released.

        It may be called while the step's groups are still being put (from another thread,
        with an overlapped schedule): it returns once the whole step is delivered. If it
        raises, the mini-batches it pulled so far stay with the step, and the next call
        resumes there and returns all of them.

        Args:
            timeout: Seconds to wait for each mini-batch (default: the buffer's ``timeout``).

        Raises:
            EmptyBufferError: A mini-batch was not ready within the timeout (the step is not
                full yet); call again once its groups are put.
            ConfigError: Nothing was put yet.
        """
        if self._plane is None:
            raise ConfigError("put", "no group was put yet; put a step's groups first")
        step = self._steps.get(self._delivering)
        if step is None or step.rows == 0:
            raise ConfigError("put", f"step {self._delivering} has no groups yet")
        if not step.pulled_all:
            for batch in self._plane.minibatches(timeout=timeout):
                step.pulled.append(batch)
            step.pulled_all = True
        # Converted once the step is whole: every row's non-tensor entries are recorded.
        out = [self._to_dataproto(b, step) for b in step.pulled]
        del self._steps[self._delivering]
        self._delivering += 1
        return out

    def close(self) -> None:
        """Stop the plane's workers. Idempotent."""
        if self._plane is not None:
            self._plane.close()

    def __enter__(self) -> GRPOBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, data: Any) -> tuple[Batch, torch.Tensor]:
        if not isinstance(data, DataProto):
            raise SpecError(None, f"put expects a verl DataProto, got {type(data).__name__}; "
                                  f"build one with DataProto.from_dict(tensors, non_tensors)")
        if data.batch is None or len(data) == 0:
            raise SpecError(None, "the DataProto holds no rows; put whole prompt groups")
        tensors = {str(k): v for k, v in data.batch.items()}
        for name in (self.reward_key, "response_mask"):
            if name not in tensors:
                raise SpecError(name, f"missing from the DataProto's batch; it has "
                                      f"{sorted(tensors)}")
        for name in (_ROW, _GROUP, *_ADDED):
            if name in tensors:
                raise SpecError(name, "is computed by the buffer; drop it from the put batch")
        for name in tensors:
            if name.startswith("_"):
                raise SpecError(name, "names starting with '_' are reserved for keys the "
                                      "plane adds; rename the field")
        mask, reward = tensors["response_mask"], tensors[self.reward_key]
        if mask.dim() != 2 or tuple(reward.shape) != tuple(mask.shape):
            raise SpecError(self.reward_key, f"expected [rows, response_length] like "
                                             f"response_mask {tuple(mask.shape)}, got "
                                             f"{tuple(reward.shape)}")
        if not reward.is_floating_point():
            raise SpecError(self.reward_key, f"must have a floating-point dtype (GRPO takes "
                                             f"the mean and standard deviation of the "
                                             f"scores), got {reward.dtype}; convert it with "
                                             f".float()")
        uid = data.non_tensor_batch.get("uid")
        if uid is None or len(uid) != len(data):
            raise SpecError("uid", "non_tensor_batch['uid'] must name the prompt of each row")
        first: dict[Any, int] = {}
        counts: dict[Any, int] = {}
        group = torch.empty(len(data), dtype=torch.int64)
        for i, u in enumerate(uid.tolist()):
            group[i] = first.setdefault(u, len(first))
            counts[u] = counts.get(u, 0) + 1
        step = self._steps.get(self._filling)
        if step is not None and step.parts and step.parts[0].keys() != data.non_tensor_batch.keys():
            raise SpecError("non_tensor_batch", f"has keys {sorted(data.non_tensor_batch)}, but "
                                                f"this step's first put had "
                                                f"{sorted(step.parts[0])}; keep them the same")
        for u, n in counts.items():
            if n != self.group_size:
                raise SpecError("uid", f"group {u!r} has {n} responses, expected group_size="
                                       f"{self.group_size}; put whole groups")
            if step is not None and u in step.uids:
                raise SpecError("uid", f"group {u!r} was already put in this step")
        empty = (mask.sum(dim=-1) == 0).nonzero().flatten().tolist()
        if empty:
            raise SpecError("response_mask", f"response {empty[0]} (group {uid[empty[0]]!r}) "
                                             f"is empty; every response needs at least one "
                                             f"token")
        scores = group_scores(reward)
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:
            r = bad[0]
            raise SpecError(self.reward_key, f"response {r} (group {uid[r]!r}) has a "
                                             f"non-finite score {float(scores[r])} (the sum of "
                                             f"its rewards); rewards must be finite")
        return tensors, group

    def _build(self, tensors: Batch) -> ExperienceDataPlane:
        fields = {k: FieldSpec(shape=tuple(v.shape[1:]), dtype=v.dtype)
                  for k, v in tensors.items()}
        ids = FieldSpec(shape=(), dtype=torch.int64)
        mask = tensors["response_mask"]
        adv = FieldSpec(shape=tuple(mask.shape[1:]),
                        dtype=torch.promote_types(tensors[self.reward_key].dtype, mask.dtype))
        rollout_spec = ExperienceSpec(fields={**fields, _ROW: ids, _GROUP: ids})
        spec = ExperienceSpec(fields={**fields, **dict.fromkeys(_ADDED, adv), _ROW: ids})
        sampler = VerlOrderSampler(num_minibatches=self.num_minibatches, shuffle=self.shuffle,
                                   seed=self.seed)
        plane = ExperienceDataPlane(
            spec=spec, capacity=self.rows_per_step, mode="on_policy",
            num_minibatches=self.num_minibatches, num_epochs=self.epochs, sampler=sampler,
            rollout_spec=rollout_spec, seed=self.seed, **self._plane_args)
        plane.register_ingestion()(self._ingest)
        self._plane = plane
        return plane

    def _ingest(self, actor_in: ActorIn, exp_out: BufferOut) -> None:
        for unit in actor_in.read_units():
            exp_out.write(self._with_advantages(unit))

    def _with_advantages(self, unit: Batch) -> Batch:
        """One put's rows with each group's GRPO advantages and returns."""
        scores = group_scores(unit[self.reward_key])
        advantage = torch.empty_like(scores)
        group = unit[_GROUP]
        for g in range(int(group.max()) + 1):
            rows = (group == g).nonzero().flatten()
            advantage[rows] = grpo_group_advantage(scores[rows], epsilon=self.epsilon,
                                                   norm_by_std=self.norm_by_std)
        tokens = token_level_advantage(advantage, unit["response_mask"])
        out = {k: v for k, v in unit.items() if k != _GROUP}
        out["advantages"], out["returns"] = tokens, tokens.clone()
        return out

    def _to_dataproto(self, batch: Batch, step: _Step) -> DataProto:
        tensors = {k: v for k, v in batch.items() if not k.startswith("_") and k != _ROW}
        return DataProto.from_dict(tensors=tensors, non_tensors=step.non_tensors(batch[_ROW]),
                                   meta_info=dict(step.meta_info))
