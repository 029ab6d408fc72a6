"""The checks a :class:`~conduit.integrations.verl.GRPOBuffer` put passes before any of its
rows reach the plane: the fields, the groups, the step's earlier puts, and that ingestion's
GRPO advantages will be finite."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from verl import DataProto

from conduit.errors import SpecError
from conduit.integrations.verl._checks import check_epsilon
from conduit.integrations.verl.advantages import (
    group_scores,
    group_statistics,
    grpo_group_advantage,
)
from conduit.spec import Batch

ROW, GROUP = "row_id", "group"
"""Fields the buffer adds to a put's rows: each row's number in its step, and its group."""
ADDED = ("advantages", "returns")
"""Fields ingestion computes."""


@dataclass(frozen=True, kw_only=True)
class PutCheck:
    """The checks of one buffer's puts.

    Attributes:
        reward_key: Token-level reward field.
        group_size: Responses per prompt.
        epsilon: Added to each group's standard deviation.
        norm_by_std: Whether advantages are divided by it.
    """

    reward_key: str
    group_size: int
    epsilon: float
    norm_by_std: bool

    def __call__(self, data: Any, step: Any) -> tuple[Batch, torch.Tensor]:
        """The put's tensors and each row's group index (0, 1, ... in order of first
        appearance), once ``data`` passes every check against ``step``, the step being filled
        (None before its first put).

        Raises:
            SpecError: As :meth:`GRPOBuffer.put` documents it.
            ConfigError: ``epsilon`` rounds to 0 in the rewards' dtype.
        """
        if not isinstance(data, DataProto):
            raise SpecError(None, f"put expects a verl DataProto, got {type(data).__name__}; "
                                  f"build one with DataProto.from_dict(tensors, non_tensors)")
        if data.batch is None or len(data) == 0:
            raise SpecError(None, "the DataProto holds no rows; put whole prompt groups")
        tensors = {str(k): v for k, v in data.batch.items()}
        for name, tensor in tensors.items():
            if tensor.is_meta:
                raise SpecError(name, "is on the meta device, which holds no values; put it "
                                      "on the CPU or a CUDA device")
        for name in (self.reward_key, "response_mask"):
            if name not in tensors:
                raise SpecError(name, f"missing from the DataProto's batch; it has "
                                      f"{sorted(tensors)}")
        for name in (ROW, GROUP, *ADDED):
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
        ids: list[int] = []
        for i, u in enumerate(uid.tolist()):
            try:
                ids.append(first.setdefault(u, len(first)))
            except TypeError:
                raise SpecError("uid", f"row {i} has uid {u!r}, which is not hashable; use a "
                                       f"string or a number per prompt") from None
            counts[u] = counts.get(u, 0) + 1
        group = torch.tensor(ids, dtype=torch.int64)
        if step is not None and step.parts:
            try:
                merged_meta([*step.metas, data.meta_info])
            except Exception as exc:  # verl's assertion, or a value that cannot compare
                raise SpecError("meta_info", f"does not merge with this step's earlier puts' "
                                             f"as DataProto.concat merges them ({exc}); give "
                                             f"a key one value within a step") from None
            first = step.parts[0]
            if first.keys() != data.non_tensor_batch.keys():
                raise SpecError("non_tensor_batch", f"has keys {sorted(data.non_tensor_batch)}, "
                                                    f"but this step's first put had "
                                                    f"{sorted(first)}; keep them the same")
            for k, v in data.non_tensor_batch.items():
                got, want = np.shape(v)[1:], first[k].shape[1:]
                if got != want:
                    raise SpecError("non_tensor_batch", f"entry {k!r} has per-row shape {got}, "
                                                        f"but this step's first put had "
                                                        f"{want}; keep each entry's shape")
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
        if self.norm_by_std:
            check_epsilon("epsilon", self.epsilon, norm_by_std=True, dtype=scores.dtype)
        self._advantages(scores, group, uid)
        return tensors, group

    def _advantages(self, scores: torch.Tensor, group: torch.Tensor, uid: Any) -> None:
        """Each group's mean, standard deviation and advantages are finite in the scores'
        dtype, as ingestion will compute them.

        A vectorized bound (in float64) clears every group whose scores are too small for
        any of those to overflow, whatever the order of the sums; only the groups it does not
        clear are computed as ingestion does. Every group has ``group_size`` rows.

        Raises:
            SpecError: A group's statistics or advantages are not finite (field
                ``reward_key``).
        """
        n = self.group_size
        if n == 1:  # mean 0 and std 1: the advantage is the score over 1 + epsilon, finite
            return
        info = torch.finfo(scores.dtype)
        limit, u = info.max / 4, info.eps
        rows = scores.double()[torch.argsort(group, stable=True)].view(-1, n)
        big = rows.abs().amax(dim=1)  # bounds every partial sum: n * big
        spread = (rows - rows.mean(dim=1, keepdim=True)).abs().amax(dim=1)
        numerator = spread + 4 * n * u * big  # |score - mean| with the mean's rounding
        safe = n * big <= limit
        if self.norm_by_std:
            # std + epsilon >= epsilon in the dtype, rounded directly or through float32
            eps = min(float(torch.tensor(self.epsilon, dtype=scores.dtype)),
                      float(torch.tensor(self.epsilon).to(scores.dtype))) / 2
            safe &= (4 * n * big * big <= limit) & (numerator / eps <= limit)
        else:
            safe &= numerator <= limit
        for g in (~safe).nonzero().flatten().tolist():
            self._group(scores, (group == g).nonzero().flatten(), uid)

    def _group(self, scores: torch.Tensor, rows: torch.Tensor, uid: Any) -> None:
        """One group's statistics and advantages, computed as ingestion does, are finite.

        Raises:
            SpecError: They are not (field ``reward_key``).
        """
        mean, std = group_statistics(scores[rows])
        adv = grpo_group_advantage(scores[rows], epsilon=self.epsilon,
                                   norm_by_std=self.norm_by_std)
        finite = bool(torch.isfinite(mean)) and bool(torch.isfinite(adv).all())
        if not finite or (self.norm_by_std and not bool(torch.isfinite(std))):
            raise SpecError(self.reward_key, f"group {uid[int(rows[0])]!r}: the mean or "
                                             f"standard deviation of its scores overflows "
                                             f"{scores.dtype}, so its advantages are not "
                                             f"finite; scale the rewards down or put them "
                                             f"in a wider dtype (.double())")


def merged_meta(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``meta_info`` of the step's puts merged as ``DataProto.concat`` merges those of the
    batches it joins: every key once (two puts giving a key different values fail, as verl
    asserts), and the ``metrics`` of all puts gathered into lists."""
    return DataProto.concat([DataProto(meta_info=dict(m)) for m in metas]).meta_info
