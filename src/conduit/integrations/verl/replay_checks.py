"""The checks that find malformed groups among the trajectories a verl replay buffer chose."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import transfer_queue as tq

if TYPE_CHECKING:
    from conduit.integrations.verl.replay import ConduitSamplerConfig



class GroupChecks:
    """Reads the chosen groups' response masks and rewards from TransferQueue and finds the
    malformed groups among them (see
    :class:`~conduit.integrations.verl.replay.ConduitReplayBuffer`): each finding maps a
    group's uid to (field, message).

    Args:
        config: The buffer's sampler configuration.
    """

    def __init__(self, config: ConduitSamplerConfig) -> None:
        self.config = config

    def miscounted(self, keys: list[str], chosen: list[str], *, exact: bool
                   ) -> dict[str, tuple[str, str]]:
        """Chosen groups without ``group_size`` trajectories (``exact``) or without any, and
        groups of a multi-output agent loop: uid -> (field, message)."""
        count = dict.fromkeys(chosen, 0)
        multi: set[str] = set()
        for key in keys:
            uid, *rest = key.split("_")
            count[uid] += 1
            if len(rest) >= 2 and rest[-1].isdigit() and int(rest[-1]) > 0:
                multi.add(uid)
        bad = {}
        n = self.config.group_size
        for uid, found in count.items():
            if uid in multi:
                bad[uid] = ("uid", f"finished group {uid!r} has keys {{uid}}_{{trajectory}}_"
                                   f"{{index}} with index > 0, from a multi-output agent loop: "
                                   f"verl gives each trajectory the advantage of its last "
                                   f"output, which this buffer does not compute")
            elif found == 0 or (exact and found != n):
                want = f"group_size={n}" if exact else "at least one"
                bad[uid] = ("uid", f"finished group {uid!r} has {found} trajectories "
                                   f"in TransferQueue, expected {want}")
        return bad

    def read(self, keys: list[str], partition_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The trajectories' response masks and rewards (both padded)."""
        data = tq.kv_batch_get(keys=keys, partition_id=partition_id,
                               select_fields=["response_mask", self.config.reward_key])
        return padded(data["response_mask"]), padded(data[self.config.reward_key])

    def _layout_fault(self, mask: torch.Tensor, reward: torch.Tensor) -> tuple[str, str] | None:
        """What is wrong with the fields' dtype or rank (trajectories stacked), if anything:
        (field, message)."""
        if mask.dim() != 2:
            return ("response_mask", f"must be a [response_length] tensor per trajectory, got "
                                     f"shape {tuple(mask.shape[1:])}")
        if mask.is_floating_point() or mask.is_complex():
            return ("response_mask", f"must be a bool or integer tensor (1 on response "
                                     f"tokens), got {mask.dtype}")
        if reward.dim() != 2:
            key = self.config.reward_key
            return (key, f"must be a token-level [response_length] tensor per trajectory, "
                         f"got shape {tuple(reward.shape[1:])}")
        return None

    def bad_layout(self, keys: list[str], chosen: list[str], mask: torch.Tensor,
                   reward: torch.Tensor, partition_id: str) -> dict[str, tuple[str, str]]:
        """Groups whose ``response_mask`` or rewards have the wrong dtype or rank: uid ->
        (field, message). Only when the stacked fields are wrong does it read the groups one
        by one to find them (all chosen groups when no single one is wrong by itself)."""
        fault = self._layout_fault(mask, reward)
        if fault is None:
            return {}
        bad: dict[str, tuple[str, str]] = {}
        for uid in chosen:
            own = [k for k in keys if k.split("_")[0] == uid]
            m, r = self.read(own, partition_id)
            found = self._layout_fault(m, r)
            if found is not None:
                bad[uid] = (found[0], f"group {uid!r}: {found[0]} {found[1]}")
        return bad or {uid: (fault[0], f"the chosen groups' {fault[0]} {fault[1]}")
                       for uid in chosen}

    def bad_rows(self, keys: list[str], mask: torch.Tensor, scores: torch.Tensor
                 ) -> dict[str, tuple[str, str]]:
        """Groups with an empty response, a score that is not finite, or advantages that are
        not (the group's mean or standard deviation overflows float32): uid -> (field,
        message), for the first such trajectory of each. The trajectories come group by
        group, ``group_size`` each."""
        bad: dict[str, tuple[str, str]] = {}
        reward = self.config.reward_key
        for i in (mask.sum(dim=-1) == 0).nonzero().flatten().tolist():
            bad.setdefault(keys[i].split("_")[0], (
                "response_mask", f"trajectory {keys[i]!r} has an empty response; every "
                                 f"response needs a token"))
        for i in (~torch.isfinite(scores)).nonzero().flatten().tolist():
            bad.setdefault(keys[i].split("_")[0], (
                reward, f"trajectory {keys[i]!r} has a non-finite score {float(scores[i])} "
                        f"(the sum of its {reward}); rewards must be finite"))
        n = self.config.group_size
        if n > 1 and len(keys) % n == 0:
            groups = scores.view(-1, n)
            mean, std = groups.mean(dim=1), groups.std(dim=1)
            ok = torch.isfinite(mean)
            if self.config.norm_adv_by_std_in_grpo:
                adv = (groups - mean[:, None]) / (std[:, None] + self.config.epsilon)
                ok &= torch.isfinite(std)
            else:
                adv = groups - mean[:, None]
            ok &= torch.isfinite(adv).all(dim=1)
            for g in (~ok).nonzero().flatten().tolist():
                bad.setdefault(keys[g * n].split("_")[0], (
                    reward, f"group {keys[g * n].split('_')[0]!r}: the mean or standard "
                            f"deviation of its scores overflows float32, so its advantages "
                            f"are not finite; scale the rewards down"))
        return bad


def padded(t: torch.Tensor) -> torch.Tensor:
    """TransferQueue returns ragged fields as nested tensors: pad them with zeros."""
    return torch.nested.to_padded_tensor(t, 0.0) if t.is_nested else t


__all__ = ["GroupChecks", "padded"]
