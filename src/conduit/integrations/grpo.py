"""GRPO's experience path on a Conduit on-policy plane, independent of any trainer library.

Pure functions first: :func:`combine_rewards` and :func:`group_advantages` follow the
group-normalized advantage of GRPO (TRL's ``sum_then_normalize``, verl's
``compute_grpo_outcome_advantage`` with ``norm_adv_by_std_in_grpo``), so a trainer computes
them on one group as it arrives. :class:`GroupExperiencePath` then runs the path:

* ingestion, once per arrival (one group, or the groups a generator returns together): score
  them in one call, compute their advantages, and pack their prompt and completion tokens into
  a :class:`~conduit.storage.ragged.RaggedStore` (no padding);
* delivery, once per mini-batch: slice the iteration in the trainer's order, pad to the
  mini-batch's longest completion, compute the log-probs it needs (old policy, reference), and
  move it to the learner's device; with overlapped delivery it runs during the previous update.

The plane's buffer holds one fixed-size row per completion (its ragged slot, advantage and
lengths); the tokens stay ragged. Framework code (TRL, verl) lives in the integration packages.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

import torch

from conduit.errors import ConfigError, EmptyBufferError, SpecError, StateError
from conduit.plane import ExperienceDataPlane
from conduit.scheduling.space import Schedule
from conduit.spec import Batch, ExperienceSpec, RaggedFieldSpec, as_indices
from conduit.storage import FifoSampler, data_path_threads
from conduit.storage.ragged import RaggedStore

ScaleRewards = Literal["group", "none"]
ADV_EPS = 1e-4
"""Added to the group's standard deviation before dividing (TRL's and verl's epsilon)."""
_SMALL = 4096
"""Elements up to which a CPU check runs in Python (see :func:`_has_nan`)."""


def nanstd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Standard deviation along ``dim`` ignoring NaNs, with Bessel's correction (NaN for fewer
    than two values)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    corr = torch.where(count > 1, count / (count - 1), torch.full_like(count / 1.0, float("nan")))
    return torch.sqrt(var * corr).squeeze(dim)


def _has_nan(x: torch.Tensor) -> bool:
    """Whether ``x`` holds a NaN."""
    if not x.is_floating_point():
        return False
    if x.device.type == "cpu" and x.numel() <= _SMALL:
        # a few rewards, right after generation: a Python loop costs less than a first
        # (cold) numpy or torch reduction
        return any(map(math.isnan, x.reshape(-1).tolist()))
    return bool(torch.isnan(x).any())


def combine_rewards(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One reward per completion from ``per_func`` (completions × reward functions): the
    weighted sum ignoring NaN; NaN where every function returned None (unscorable)."""
    if per_func.dim() != 2 or per_func.shape[1] != weights.numel():
        raise SpecError("rewards", f"expected shape (completions, {weights.numel()}), got "
                                   f"{tuple(per_func.shape)}")
    rewards = (per_func * weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)
    if _has_nan(per_func):
        rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
    return rewards


@functools.lru_cache(maxsize=16)
def _bessel(n: int) -> torch.Tensor:
    """Bessel's correction ``n / (n - 1)`` for ``n`` values, as nanstd's int64 division gives
    it (float32)."""
    count = torch.tensor([n], dtype=torch.int64)
    return count / (count - 1)


def group_advantages(rewards: torch.Tensor, group_size: int, *,
                     scale: ScaleRewards = "group") -> torch.Tensor:
    """Group-normalized advantages: each reward minus its group's mean, divided by the group's
    standard deviation plus :data:`ADV_EPS` (``scale="group"``) or not (``"none"``). Groups are
    consecutive runs of ``group_size`` completions; NaN rewards are left out of the statistics
    and get advantage 0.

    Raises:
        SpecError: ``rewards`` is not 1-D or does not split into groups of ``group_size``.
        ConfigError: ``scale`` is unknown or ``group_size`` is not positive.
    """
    if not isinstance(group_size, int) or group_size < 1:
        raise ConfigError("group_size", f"must be a positive int, got {group_size!r}")
    if scale not in ("group", "none"):
        raise ConfigError("scale_rewards", f"must be 'group' or 'none', got {scale!r}")
    if rewards.dim() != 1 or rewards.numel() == 0 or rewards.numel() % group_size:
        raise SpecError("rewards", f"{tuple(rewards.shape)} does not split into groups of "
                                   f"{group_size} completions")
    grouped = rewards.view(-1, group_size)
    if scale == "group" and group_size > 1 and not _has_nan(rewards):
        # Every group full: ATen's NaN-skipping means add in the order plain means do, so
        # these are nanmean's and nanstd's values, with one correction for all groups.
        adv = grouped - grouped.mean(dim=1, keepdim=True)
        var = (adv ** 2).mean(dim=1, keepdim=True)
        adv = adv / (torch.sqrt(var * _bessel(group_size).to(rewards.device)) + ADV_EPS)
        return torch.nan_to_num(adv.reshape(-1), nan=0.0)
    adv = grouped - torch.nanmean(grouped, dim=1, keepdim=True)
    if scale == "group" and group_size > 1:  # nanstd's steps, sharing the mean
        var = torch.nanmean(adv ** 2, dim=1, keepdim=True)
        count = torch.sum(~torch.isnan(grouped), dim=1, keepdim=True)
        corr = torch.where(count > 1, count / (count - 1),
                           torch.full_like(count / 1.0, float("nan")))
        adv = adv / (torch.sqrt(var * corr) + ADV_EPS)
    elif scale == "group":  # one completion per group: a standard deviation of zero
        adv = adv / ADV_EPS
    return torch.nan_to_num(adv.reshape(-1), nan=0.0)


def _joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts`` end to end; a single part as it is (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


class OrderedFifoSampler(FifoSampler):
    """Consume-once sampling in an order the trainer gives per iteration (its shuffle), split
    into ``num_minibatches`` equal parts; every epoch repeats the iteration's order."""

    def __init__(self, *, num_minibatches: int) -> None:
        super().__init__(num_minibatches=num_minibatches, shuffle=False)
        self._orders: dict[int, torch.Tensor] = {}

    def set_order(self, iteration: int, order: torch.Tensor) -> None:
        """Rows of ``iteration`` in delivery order (a permutation of its rows)."""
        self._orders = {iteration: as_indices(order).clone()}

    def layout(self, size: int, *, iteration: int, epoch: int) -> list[torch.Tensor]:
        order = self._orders.get(iteration)
        if order is None or order.numel() != size:
            raise StateError("sampler.order", f"no order of {size} rows for iteration "
                                              f"{iteration}; call begin_iteration first")
        return list(torch.tensor_split(order, self.num_minibatches))


@dataclass(frozen=True)
class LogProbSource:
    """Per-token log-probs a delivered mini-batch needs, computed during delivery.

    Attributes:
        key: Name in the delivered batch (``old_per_token_logps``, ``ref_per_token_logps``).
        fn: ``fn(prompt_ids, prompt_mask, completion_ids, completion_mask)`` -> (B, T) tensor;
            it must read a policy that does not change during the iteration (a snapshot).
        skip_first: Leading mini-batches of a single-epoch iteration that need none (they are
            computed under the policy that generated them, so the learner's own log-probs,
            detached, are the same).
    """

    key: str
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    skip_first: int = 0


@dataclass
class _Unit:
    """Groups pushed together: the sequences as given (for the scorer) and packed."""

    prompt_ids: Sequence[Sequence[int]]
    completion_ids: Sequence[Sequence[int]]
    prompts: tuple[torch.Tensor, torch.Tensor]
    completions: tuple[torch.Tensor, torch.Tensor]
    payload: Any


class GroupExperiencePath:
    """GRPO's experience path: groups in, padded mini-batches out, through an on-policy plane.

    Args:
        group_size: Completions per prompt (G).
        groups: Groups per iteration (one generation batch holds ``groups × G`` rows).
        num_minibatches: Mini-batches per epoch (TRL's ``steps_per_generation``).
        num_epochs: Passes over each iteration (TRL's ``num_iterations``).
        max_prompt_length: Longest prompt, in tokens.
        max_completion_length: Longest completion, in tokens.
        pad_token_id: Token that pads ids.
        score: ``score(payload, prompt_ids, completion_ids)`` -> rewards of the groups of one
            push, shape (k × G,), NaN for unscorable completions. Runs in ingestion, once per
            push (:meth:`push_group` or :meth:`push_groups`).
        scale_rewards: ``"group"`` or ``"none"`` (see :func:`group_advantages`).
        logprobs: Log-probs computed per mini-batch in delivery.
        pad_completions_to: ``"minibatch"`` (its longest completion) or ``"iteration"``.
        learner_device: Where delivered mini-batches end up.
        schedule: The plane's schedule (default: ingestion inline, one group per invocation;
            delivery overlapped, one mini-batch per invocation, so the next mini-batch is
            prepared during the update).
        timeout: Seconds a push or pull may wait.
        gate_prefetch: Seconds a prefetched mini-batch's delivery (gather, padding, log-prob
            passes) waits, at most, for the learner to begin the update before it
            (:meth:`update_started`) or to wait in a :meth:`pull` that finds nothing staged;
            0 (default) never waits. While the learner does its own work between two updates
            a worker would only compete with it for the cores and the interpreter; the bound
            keeps a learner that does something else there (saving, evaluating) from holding
            the worker longer. The trainer calls :meth:`update_started` as each update
            begins.

    Raises:
        ConfigError: An argument is invalid.
    """

    def __init__(self, *, group_size: int, groups: int, num_minibatches: int, num_epochs: int,
                 max_prompt_length: int, max_completion_length: int, pad_token_id: int,
                 score: Callable[[Any, list[Sequence[int]], list[Sequence[int]]], torch.Tensor],
                 scale_rewards: ScaleRewards = "group",
                 logprobs: Sequence[LogProbSource] = (),
                 pad_completions_to: Literal["minibatch", "iteration"] = "minibatch",
                 learner_device: str | torch.device = "cpu", schedule: Schedule | None = None,
                 timeout: float = 600.0, gate_prefetch: float = 0.0) -> None:
        for name, v in (("group_size", group_size), ("groups", groups),
                        ("num_minibatches", num_minibatches), ("num_epochs", num_epochs)):
            if not isinstance(v, int) or v < 1:
                raise ConfigError(name, f"must be a positive int, got {v!r}")
        rows = group_size * groups
        if rows % num_minibatches:
            raise ConfigError("num_minibatches", f"{rows} rows per iteration do not split into "
                                                 f"{num_minibatches} equal mini-batches")
        if scale_rewards not in ("group", "none"):
            raise ConfigError("scale_rewards", f"per-group ingestion supports 'group' or "
                                               f"'none', got {scale_rewards!r}")
        if (isinstance(gate_prefetch, bool) or not isinstance(gate_prefetch, (int, float))
                or not 0 <= gate_prefetch < math.inf):
            raise ConfigError("gate_prefetch", f"must be a finite number of seconds >= 0, got "
                                               f"{gate_prefetch!r}")
        if pad_completions_to not in ("minibatch", "iteration"):
            raise ConfigError("pad_completions_to", f"must be 'minibatch' or 'iteration', got "
                                                    f"{pad_completions_to!r}")
        self.group_size, self.groups, self.rows = group_size, groups, rows
        self.num_minibatches, self.num_epochs = num_minibatches, num_epochs
        self.pad_token_id, self.scale_rewards = int(pad_token_id), scale_rewards
        self.pad_completions_to = pad_completions_to
        self._score, self._logprobs = score, tuple(logprobs)
        self.ragged = RaggedStore(fields={
            "prompt_ids": RaggedFieldSpec(torch.int64, max_length=max_prompt_length),
            "completion_ids": RaggedFieldSpec(torch.int64, max_length=max_completion_length)},
            capacity=rows)
        self._ragged_lock = threading.Lock()
        self._permit = threading.Event()  # set: the next prefetched delivery may start
        self._pulling = threading.local()  # set on the learner's thread inside pull()
        self._gate_s, self._closing = float(gate_prefetch), False
        # A completion's buffer slot is its row in generation order and its ragged slot
        # (both are filled in push order from 0 each iteration), so a row holds only its
        # advantage; delivery reads the rest through ``_index``.
        spec = ExperienceSpec.of(advantage=((), torch.float32))
        self._sampler = OrderedFifoSampler(num_minibatches=num_minibatches)
        m = num_minibatches
        self.plane = ExperienceDataPlane(
            spec=spec, capacity=rows, mode="on_policy", num_minibatches=m, num_epochs=num_epochs,
            sampler=self._sampler, rollout_rows=group_size, learner_device=learner_device,
            rollout_spec=ExperienceSpec.of(row=((), torch.int64)), timeout=timeout,
            schedule=schedule or Schedule(0, Fraction(group_size, rows), 1, Fraction(1, m)))
        self.plane.register_ingestion()(self._ingest)
        self.plane.register_delivery()(self._deliver)
        self.iteration = -1
        self._units: dict[int, _Unit] = {}
        self._part_of = [0] * rows  # row -> its mini-batch within the epoch
        self._all_rows = set(range(rows))
        self._spent: list[dict[int, _Unit]] = []
        self._prompt_width = 0
        self._pushed = 0
        self._rewards = torch.full((rows,), float("nan"))
        self._advantages = torch.zeros(rows)

    # -- the trainer's side -------------------------------------------------------------------

    def begin_iteration(self, order: torch.Tensor, *, prompt_width: int) -> None:
        """Start the next iteration: its rows will be delivered in ``order`` (a permutation of
        ``0 .. rows-1``, split into the mini-batches in turn), with prompts left-padded to
        ``prompt_width``.

        Raises:
            StateError: The previous iteration has not been consumed.
            SpecError: ``order`` is not a permutation of the iteration's rows.
        """
        order = as_indices(order)
        # Python on the ints: this runs right after generation, where a first numpy or torch
        # reduction costs more than a loop over an iteration's rows (docs/design.md §2)
        in_order = order.tolist()
        if len(in_order) != self.rows or set(in_order) != self._all_rows:
            raise SpecError("order", f"expected a permutation of {self.rows} rows")
        if self.iteration >= 0 and self.plane.policy_version <= self.iteration:
            raise StateError("iteration", f"iteration {self.iteration} still has mini-batches "
                                          f"to pull")
        self.iteration += 1
        if not self._closing:  # generation is over and the learner is not updating
            self._permit.clear()
        self._sampler.set_order(self.iteration, order)
        per_part = self.rows // self.num_minibatches  # equal parts, in delivery order
        for position, row in enumerate(in_order):
            self._part_of[row] = position // per_part
        with self._ragged_lock:
            self.ragged.clear()
            # the last iteration's arrivals are freed by the next delivery on the worker
            self._spent.append(self._units)
        self._units, self._pushed, self._prompt_width = {}, 0, int(prompt_width)
        self._rewards = torch.full((self.rows,), float("nan"))
        self._advantages = torch.zeros(self.rows)

    def push_group(self, *, prompt_ids: Sequence[Sequence[int]],
                   completion_ids: Sequence[Sequence[int]], payload: Any = None) -> None:
        """Hand one group (G completions of one prompt, in generation order) to ingestion;
        :meth:`push_groups` with one group.

        Raises:
            SpecError: See :meth:`push_groups`.
        """
        self.push_groups(prompt_ids=prompt_ids, completion_ids=completion_ids, payload=payload)

    def push_groups(self, *, prompt_ids: Sequence[Sequence[int]],
                    completion_ids: Sequence[Sequence[int]], payload: Any = None) -> None:
        """Hand whole groups that arrived together (k × G completions, group after group, in
        generation order) to ingestion as one unit: one ``score`` call covers them all.

        Raises:
            SpecError: The completions do not split into whole groups, the prompts do not
                match them one to one, a sequence is empty or longer than its maximum, a
                prompt is wider than the iteration's ``prompt_width``, or the iteration is
                full.
        """
        first = self._pushed // self.group_size
        n = len(completion_ids)
        if n == 0 or n % self.group_size:
            raise SpecError("completion_ids", f"groups from {first} have {n} completions, "
                                              f"expected a multiple of group_size="
                                              f"{self.group_size}")
        if len(prompt_ids) != n:
            raise SpecError("prompt_ids", f"groups from {first} have {len(prompt_ids)} prompts "
                                          f"for {n} completions")
        if self._pushed + n > self.rows:
            raise SpecError(None, f"iteration {self.iteration} holds {self.groups} groups and "
                                  f"{self._pushed // self.group_size} are pushed; call "
                                  f"begin_iteration for the next one")
        what = f"groups {first}..{first + n // self.group_size - 1}"
        prompts = self.ragged.fields["prompt_ids"].validate(prompt_ids, field="prompt_ids",
                                                            what=what)
        completions = self.ragged.fields["completion_ids"].validate(
            completion_ids, field="completion_ids", what=what)
        if int(prompts[1].max()) > self._prompt_width:
            raise SpecError("prompt_ids", f"{what} hold a prompt longer than the iteration's "
                                          f"prompt_width {self._prompt_width}")
        self._units[self._pushed] = _Unit(prompt_ids, completion_ids, prompts, completions,
                                          payload)
        rows = torch.arange(self._pushed, self._pushed + n)
        self._pushed += n
        self.plane.push({"row": rows}, policy_version=self.iteration)

    def pull(self) -> Batch:
        """The next mini-batch: ``prompt_ids``/``prompt_mask`` (left-padded),
        ``completion_ids``/``completion_mask`` (right-padded), ``advantages``, the
        :class:`LogProbSource` keys it needs, and ``row`` (its rows in generation order).

        Raises:
            EmptyBufferError, OperatorError, PlaneClosedError: As
                :meth:`ExperienceDataPlane.pull`.
        """
        if not self._gate_s:
            return self.plane.pull()
        self._pulling.active = True  # a delivery this thread runs itself never waits
        try:
            try:
                return self.plane.pull(timeout=0)
            except EmptyBufferError:
                self._permit.set()  # the learner waits: the next delivery costs it nothing
                return self.plane.pull()
        finally:
            self._pulling.active = False

    def update_started(self) -> None:
        """The learner began its update on the mini-batch it pulled last: with
        ``gate_prefetch``, the next mini-batch's delivery may start now."""
        self._permit.set()

    def flush(self) -> None:
        """Ingest every pushed group now."""
        self.plane.flush()

    @property
    def rewards(self) -> torch.Tensor:
        """Rewards of the iteration's ingested rows, in generation order (NaN before)."""
        return self._rewards

    @property
    def advantages(self) -> torch.Tensor:
        """Advantages of the iteration's ingested rows, in generation order."""
        return self._advantages

    def completion_tokens(self) -> int:
        """Completion tokens of the iteration ingested so far."""
        with self._ragged_lock:
            return self.ragged.tokens("completion_ids")

    def close(self) -> None:
        """Stop the plane's workers (a delivery waiting for :meth:`update_started` is let
        go)."""
        self._closing = True
        self._permit.set()
        self.plane.close()

    # -- operators ----------------------------------------------------------------------------

    def _ingest(self, actor_in: Any, exp_out: Any) -> None:
        units = [(int(u["row"].numpy()[0]), u["row"]) for u in actor_in.read_units()]
        if not units:
            return
        rewards = []
        for first, rows in units:
            unit = self._units[first]
            r = torch.as_tensor(self._score(unit.payload, unit.prompt_ids, unit.completion_ids),
                                dtype=torch.float32)
            if r.shape != (rows.numel(),):
                raise SpecError("rewards", f"groups from {first // self.group_size}: the scorer "
                                           f"returned shape {tuple(r.shape)}, expected "
                                           f"({rows.numel()},)")
            rewards.append(r)
        rows = _joined([r for _, r in units])
        reward = _joined(rewards)
        adv = group_advantages(reward, self.group_size, scale=self.scale_rewards)
        packed = {name: tuple(_joined(parts) for parts in zip(
            *(getattr(self._units[first], attr) for first, _ in units)))
            for name, attr in (("prompt_ids", "prompts"), ("completion_ids", "completions"))}
        start, n = units[0][0], rows.numel()  # consecutive rows, in push order
        with self._ragged_lock:
            if len(self.ragged) != start:
                raise StateError("row", f"groups from {start // self.group_size} were "
                                        f"ingested out of order")
            self.ragged.extend_packed(packed)
        self._rewards[start:start + n] = reward
        self._advantages[start:start + n] = adv
        exp_out.write({"advantage": adv})

    def _wait_for_permit(self) -> None:
        """With ``gate_prefetch``: a delivery on the worker starts once the learner updates
        (or waits in :meth:`pull`), at the latest after ``gate_prefetch`` seconds, and takes
        that permission."""
        if not self._gate_s or getattr(self._pulling, "active", False):
            return
        self._permit.wait(self._gate_s)
        if not self._closing:
            self._permit.clear()

    def _deliver(self, exp_in: Any, learn_out: Any) -> None:
        self._wait_for_permit()
        if self._spent and (len(self._spent) > 1 or not getattr(self._pulling, "active", False)):
            # on the worker; on the learner only once two iterations' arrivals wait
            with self._ragged_lock:
                spent, self._spent = self._spent, []
            del spent
        rows = exp_in.read()
        slots = rows["_index"]  # generation rows, and ragged slots (see the spec)
        with self._ragged_lock:
            prompt_ids, prompt_mask = self.ragged.padded_with_mask(
                "prompt_ids", slots, pad_value=self.pad_token_id, side="left",
                width=self._prompt_width, mask_dtype=torch.int64)
            width = None
            if self.pad_completions_to == "iteration":
                width = int(self.ragged.lengths("completion_ids").max())
            completion_ids, completion_mask = self.ragged.padded_with_mask(
                "completion_ids", slots, pad_value=self.pad_token_id, width=width,
                mask_dtype=torch.int64)
        out = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
               "completion_ids": completion_ids, "completion_mask": completion_mask,
               "advantages": rows["advantage"], "row": slots}
        part = self._part_of[int(slots.numpy()[0])] if slots.numel() else 0
        for src in self._logprobs:
            if self.num_epochs == 1 and part < src.skip_first:
                continue
            with data_path_threads(1):  # a prefetch must not take the learner's cores
                out[src.key] = src.fn(prompt_ids, prompt_mask, completion_ids, completion_mask)
        learn_out.write(out)

    def __enter__(self) -> GroupExperiencePath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ADV_EPS", "GroupExperiencePath", "LogProbSource", "OrderedFifoSampler",
           "combine_rewards", "group_advantages", "nanstd"]
