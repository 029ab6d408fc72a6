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
import numbers
import threading
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, Literal

import torch

from conduit._checks import check_int
from conduit.errors import (
    ConfigError,
    OperatorError,
    PlaneClosedError,
    SpecError,
    StateError,
)
from conduit.integrations.grpo_delivery import MiniBatchDelivery
from conduit.integrations.grpo_gate import PrefetchGate
from conduit.integrations.grpo_logprobs import LogProbPlan, LogProbSource, check_sources
from conduit.integrations.grpo_pushes import IterationPushes, PushUnit, joined
from conduit.plane import ExperienceDataPlane
from conduit.scheduling.space import Schedule, feasible_space
from conduit.spec import Batch, ExperienceSpec, RaggedFieldSpec, as_indices, checked_indices
from conduit.storage import FifoSampler
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


def _has_nan(x: torch.Tensor, *, field: str = "rewards", what: str = "") -> bool:
    """Whether ``x`` holds a NaN (an unscorable completion).

    Raises:
        SpecError: ``x`` holds an infinite value (named ``field``; ``what`` says where).
    """
    if not x.is_floating_point():
        return False
    if x.device.type == "cpu" and x.numel() <= _SMALL:
        # a few rewards, right after generation: a Python loop costs less than a first
        # (cold) numpy or torch reduction
        values = x.reshape(-1).tolist()
        if all(map(math.isfinite, values)):
            return False
        inf = next((i for i, v in enumerate(values) if math.isinf(v)), None)
    else:
        if bool(torch.isfinite(x).all()):
            return False
        where = torch.isinf(x).reshape(-1).nonzero()
        inf = int(where[0]) if where.numel() else None
    if inf is not None:
        raise SpecError(field, f"{what}holds an infinite value at flat index {inf}; rewards "
                               f"must be finite, or NaN for an unscorable completion")
    return True  # not finite, and no infinity: a NaN


def _check_tensor(x: Any, field: str, *, floating: bool) -> None:
    """Raise a :class:`SpecError` naming ``field`` unless ``x`` is a tensor of real numbers
    (floating point where ``floating``)."""
    if not isinstance(x, torch.Tensor):
        raise SpecError(field, f"must be a torch.Tensor, got {type(x).__name__}")
    ok = x.is_floating_point() or (not floating and x.dtype != torch.bool
                                   and not x.is_complex())
    if not ok:
        kind = "a floating-point" if floating else "a real, non-bool"
        raise SpecError(field, f"must have {kind} dtype, got {x.dtype}")


def _check_sequences(x: Any, field: str) -> None:
    """Raise a :class:`SpecError` naming ``field`` unless ``x`` is a sized collection (a list of
    token-id sequences, one per completion)."""
    if isinstance(x, (str, bytes)) or not hasattr(x, "__len__"):
        raise SpecError(field, f"must be a list of token-id sequences, one per completion, got "
                               f"{type(x).__name__}")


def _scored(raw: Any, n: int, what: str) -> torch.Tensor:
    """The scorer's output ``raw`` as ``n`` float32 rewards.

    Raises:
        SpecError: ``raw`` is not ``n`` real numbers (field ``rewards``).
    """
    hint = f"return a real float tensor of shape ({n},), NaN for an unscorable completion"
    try:
        r = torch.as_tensor(raw)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise SpecError("rewards", f"{what}: the scorer returned {type(raw).__name__} "
                                   f"({exc}); {hint}") from exc
    if r.is_complex():
        raise SpecError("rewards", f"{what}: the scorer returned complex values ({r.dtype}); "
                                   f"{hint}")
    if r.shape != (n,):
        raise SpecError("rewards", f"{what}: the scorer returned shape {tuple(r.shape)}, "
                                   f"expected ({n},); {hint}")
    return r.to(torch.float32)


def _check_one_prompt_per_group(prompts: tuple[torch.Tensor, torch.Tensor], g: int,
                                what: str) -> None:
    """Refuse packed ``prompts`` (values, lengths) unless each run of ``g`` rows repeats one
    prompt: every token equals the one a row earlier in its group (vectorized).

    Raises:
        SpecError: A group holds two different prompts (field ``prompt_ids``).
    """
    if g == 1:
        return
    values, lengths = prompts
    per_group = lengths.view(-1, g)
    if bool((per_group == per_group[:, :1]).all()):
        if bool((lengths == lengths[0]).all()):  # one length throughout: one comparison
            rows = values.view(-1, g, int(lengths[0]))
            same = bool((rows == rows[:, :1]).all())
        else:  # each token against the same position one row earlier, within its group
            later = (torch.arange(lengths.numel()) % g) != 0
            at = torch.arange(values.numel())[torch.repeat_interleave(later, lengths)]
            shift = torch.repeat_interleave(lengths, lengths)[at]
            same = bool((values[at] == values[at - shift]).all())
        if same:
            return
    raise SpecError("prompt_ids", f"{what}: a group's {g} completions must share one "
                                  f"prompt (push the G completions of a prompt together, "
                                  f"group after group)")


def combine_rewards(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One reward per completion from ``per_func`` (completions × reward functions): the
    weighted sum ignoring NaN; NaN where every function returned None (unscorable).

    Raises:
        SpecError: ``per_func`` is not a floating-point (completions, len(weights)) tensor or
            holds an infinite reward (field ``rewards``), or ``weights`` is not a 1-D tensor
            of finite real numbers (field ``weights``).
    """
    _check_tensor(per_func, "rewards", floating=True)
    _check_tensor(weights, "weights", floating=False)
    if weights.dim() != 1:
        raise SpecError("weights", f"must be 1-D (one per reward function), got shape "
                                   f"{tuple(weights.shape)}")
    if weights.is_floating_point() and not bool(torch.isfinite(weights).all()):
        raise SpecError("weights", f"must be finite, got {weights.tolist()}")
    if per_func.dim() != 2 or per_func.shape[1] != weights.numel():
        raise SpecError("rewards", f"expected shape (completions, {weights.numel()}), got "
                                   f"{tuple(per_func.shape)}")
    nan = _has_nan(per_func, what="a reward function's output ")
    rewards = (per_func * weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)
    if nan:
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
        SpecError: ``rewards`` is not a floating-point tensor, is not 1-D, does not split into
            groups of ``group_size``, or holds an infinite reward.
        ConfigError: ``scale`` is unknown or ``group_size`` is not a positive int.
    """
    group_size = check_int("group_size", group_size, minimum=1)
    if scale not in ("group", "none"):
        raise ConfigError("scale_rewards", f"must be 'group' or 'none', got {scale!r}")
    _check_tensor(rewards, "rewards", floating=True)
    if rewards.dim() != 1 or rewards.numel() == 0 or rewards.numel() % group_size:
        raise SpecError("rewards", f"{tuple(rewards.shape)} does not split into groups of "
                                   f"{group_size} completions")
    nan = _has_nan(rewards)
    grouped = rewards.view(-1, group_size)
    if scale == "group" and group_size > 1 and not nan:
        # Every group full: ATen's NaN-skipping means add in the order plain means do, so
        # these are nanmean's and nanstd's values, with one correction for all groups.
        adv = grouped - grouped.mean(dim=1, keepdim=True)
        var = (adv ** 2).mean(dim=1, keepdim=True)
        var *= _bessel(group_size).to(rewards.device)  # in place, as TRL: the dtype stays
        adv = adv / (torch.sqrt(var) + ADV_EPS)
        return torch.nan_to_num(adv.reshape(-1), nan=0.0)
    adv = grouped - torch.nanmean(grouped, dim=1, keepdim=True)
    if scale == "group" and group_size > 1:  # nanstd's steps, sharing the mean
        var = torch.nanmean(adv ** 2, dim=1, keepdim=True)
        count = torch.sum(~torch.isnan(grouped), dim=1, keepdim=True)
        corr = torch.where(count > 1, count / (count - 1),
                           torch.full_like(count / 1.0, float("nan")))
        var *= corr  # in place, as TRL's nanstd: the dtype stays
        adv = adv / (torch.sqrt(var) + ADV_EPS)
    elif scale == "group":  # one completion per group: a standard deviation of zero
        adv = adv / ADV_EPS
    return torch.nan_to_num(adv.reshape(-1), nan=0.0)


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


def _checked_options(*, group_size: int, groups: int, num_minibatches: int, pad_token_id: Any,
                     score: Any, schedule: Any, logprobs: Any, learner_device: Any,
                     scale_rewards: Any, gate_prefetch: Any, pad_completions_to: Any
                     ) -> tuple[tuple[LogProbSource, ...], torch.device]:
    """:class:`GroupExperiencePath`'s arguments besides its sizes, checked in turn: the
    log-prob sources and the learner's device, as the path keeps them.

    Raises:
        ConfigError: An argument is invalid (named by the error's field).
    """
    if (isinstance(pad_token_id, bool) or not isinstance(pad_token_id, numbers.Integral)
            or not -(1 << 63) <= int(pad_token_id) < 1 << 63):
        raise ConfigError("pad_token_id", f"must be an int within int64, got "
                                          f"{pad_token_id!r}")
    if not callable(score):
        raise ConfigError("score", f"must be callable, got {score!r}")
    if schedule is not None and not isinstance(schedule, Schedule):
        raise ConfigError("schedule", f"must be a conduit Schedule or None, got "
                                      f"{schedule!r}")
    sources = check_sources(logprobs)
    try:
        learner_device = torch.device(learner_device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError("learner_device", f"not a device: {learner_device!r} "
                                            f"({exc})") from exc
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
    return sources, learner_device


def _default_schedule(group_size: int, rows: int, m: int) -> Schedule:
    """Inline ingestion of one group per invocation, overlapped delivery of one
    mini-batch: the largest feasible ingestion granularity that a single group fills
    (a group's share of the iteration itself, or a multiple of 1/M below it when a group
    does not end on a mini-batch boundary)."""
    unit = Fraction(group_size, rows)
    space = feasible_space(mode="on_policy", num_minibatches=m, unit_fraction_ing=unit)
    g_ing = max(g for g in space.g_ing if g <= unit)
    return Schedule(0, g_ing, 1, Fraction(1, m))


def _unit_rewards(unit: PushUnit, score: Callable[..., Any], group_size: int) -> torch.Tensor:
    """The rewards ``score`` gives the completions of one push, checked.

    Raises:
        SpecError: They are not one finite real number (or NaN) per completion.
    """
    n, what = len(unit.completion_ids), f"groups from {unit.first // group_size}"
    r = _scored(score(unit.payload, unit.prompt_ids, unit.completion_ids), n, what)
    _has_nan(r, what=f"{what}: the scorer's output ")
    return r


class _GroupIngestion:
    """The plane's ingestion operator: scores the groups of each push in one call, computes
    their advantages, packs their tokens and writes one row per completion.

    Args:
        pushes: The iteration's pushes.
        score: The path's scorer.
        group_size: Completions per prompt (G).
        scale_rewards: ``"group"`` or ``"none"`` (see :func:`group_advantages`).
    """

    def __init__(self, pushes: IterationPushes, score: Callable[..., Any], *, group_size: int,
                 scale_rewards: ScaleRewards) -> None:
        self._pushes, self._score = pushes, score
        self.group_size, self.scale_rewards = group_size, scale_rewards
        self._ingesting = threading.local()  # set on a thread while it runs the ingestion

    @property
    def active(self) -> bool:
        """Whether the calling thread runs the ingestion (a call from the scorer)."""
        return getattr(self._ingesting, "active", False)

    def ingest(self, actor_in: Any, exp_out: Any) -> None:
        """Ingest the pushes ``actor_in`` holds into ``exp_out`` (the operator); a failure
        loses them (see :meth:`IterationPushes.lose`)."""
        serials = [int(u["unit"].numpy()[0]) for u in actor_in.read_units()]
        if not serials:
            return
        self._ingesting.active = True
        try:
            self._ingest_units(serials, exp_out)
        except BaseException as exc:
            self._pushes.lose(serials, exc)  # the plane drops the invocation's units
            raise
        finally:
            self._ingesting.active = False

    def _ingest_units(self, serials: list[int], exp_out: Any) -> None:
        pushes = self._pushes
        units = pushes.live(serials)
        reward = joined([_unit_rewards(unit, self._score, self.group_size) for unit in units])
        adv = group_advantages(reward, self.group_size, scale=self.scale_rewards)
        start, n = units[0].first, reward.numel()  # consecutive rows, in push order
        pushes.pack(serials, units)
        try:
            exp_out.write({"advantage": adv})
        except BaseException:
            pushes.unpack(start)
            raise
        pushes.rewards[start:start + n] = reward
        pushes.advantages[start:start + n] = adv


class _GroupIntake:
    """Takes pushes of whole groups: checks them against the iteration, reserves their rows
    and queues them on the plane, in row order.

    Args:
        plane: The path's plane.
        pushes: The iteration's pushes.
        group_size: Completions per prompt (G).
        rows: Rows per iteration.
    """

    def __init__(self, plane: ExperienceDataPlane, pushes: IterationPushes, *, group_size: int,
                 rows: int) -> None:
        self._plane, self._pushes = plane, pushes
        self.group_size, self.rows = group_size, rows
        # held from a push's reservation of rows through plane.push, so the plane queues
        # pushes in row order; ingestion never takes it (a push from inside ingestion, such as
        # from the scorer, is refused: it would wait for the ingestion it runs in)
        self._lock = threading.Lock()

    def push(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
             payload: Any, *, iteration: int, prompt_width: int) -> None:
        """Check the groups of one push, reserve their rows and push them to the plane.

        Raises:
            SpecError, OperatorError, BackpressureTimeout, PlaneClosedError: As
                :meth:`GroupExperiencePath.push_groups`.
        """
        pushes = self._pushes
        with self._lock:
            pushes.settle()
            first = pushes.pushed // self.group_size
            n = len(completion_ids)
            if n == 0 or n % self.group_size:
                raise SpecError("completion_ids", f"groups from {first} have {n} completions, "
                                                  f"expected a multiple of group_size="
                                                  f"{self.group_size}")
            if len(prompt_ids) != n:
                raise SpecError("prompt_ids", f"groups from {first} have {len(prompt_ids)} "
                                              f"prompts for {n} completions")
            if pushes.pushed + n > self.rows:
                raise SpecError(None, f"iteration {iteration} holds "
                                      f"{self.rows // self.group_size} groups and "
                                      f"{pushes.pushed // self.group_size} are pushed; call "
                                      f"begin_iteration for the next one")
            what = f"groups {first}..{first + n // self.group_size - 1}"
            prompts = pushes.ragged.fields["prompt_ids"].validate(prompt_ids, field="prompt_ids",
                                                                  what=what)
            completions = pushes.ragged.fields["completion_ids"].validate(
                completion_ids, field="completion_ids", what=what)
            if int(prompts[1].max()) > prompt_width:
                raise SpecError("prompt_ids", f"{what} hold a prompt longer than the "
                                              f"iteration's prompt_width {prompt_width}")
            _check_one_prompt_per_group(prompts, self.group_size, what)
            serial = pushes.add(PushUnit(pushes.pushed, prompt_ids, completion_ids, prompts,
                                         completions, payload))
            try:
                self._plane.push({"unit": torch.full((n,), serial, dtype=torch.int64)},
                                 policy_version=iteration)
            except BaseException:
                # refused, or ingested here and failed: withdrawn (a copy the plane still
                # holds fails its ingestion, as its serial is gone)
                pushes.lose([serial])
                pushes.settle()
                raise


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
            push, real numbers of shape (k × G,) (a float tensor), NaN for unscorable
            completions; anything else fails the ingestion with a :class:`SpecError` naming
            ``rewards``. Runs in ingestion, once per push (:meth:`push_group` or
            :meth:`push_groups`).
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

    A push or ingestion that fails (a scorer that raises, a push the plane refuses) loses
    its groups, and with them every group pushed after them in the iteration (their rows
    would no longer follow generation order; the plane reports each one's ingestion as it
    fails): the path then counts as pushed only the groups before them
    (:attr:`pushed_groups`), so pushing the lost groups again, in order, completes the
    iteration; an iteration with no group left can also be begun again with
    :meth:`begin_iteration`. With overlapped ingestion, clear the plane's latched error with
    :meth:`recover` first; call it too when a call on another thread (a flush, a save) ran
    the failed ingestion, or ``close()`` reports the lost groups (``DataLossError``).

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
        (group_size, groups, num_minibatches, num_epochs, max_prompt_length,
         max_completion_length) = (check_int(name, v, minimum=1) for name, v in (
            ("group_size", group_size), ("groups", groups),
            ("num_minibatches", num_minibatches), ("num_epochs", num_epochs),
            ("max_prompt_length", max_prompt_length),
            ("max_completion_length", max_completion_length)))
        sources, learner_device = _checked_options(
            group_size=group_size, groups=groups, num_minibatches=num_minibatches,
            pad_token_id=pad_token_id, score=score, schedule=schedule, logprobs=logprobs,
            learner_device=learner_device, scale_rewards=scale_rewards,
            gate_prefetch=gate_prefetch, pad_completions_to=pad_completions_to)
        rows = group_size * groups
        self.group_size, self.groups, self.rows = group_size, groups, rows
        self.num_minibatches, self.num_epochs = num_minibatches, num_epochs
        self.pad_token_id, self.scale_rewards = int(pad_token_id), scale_rewards
        self.pad_completions_to = pad_completions_to
        self._pushes = IterationPushes(RaggedStore(fields={
            "prompt_ids": RaggedFieldSpec(torch.int64, max_length=max_prompt_length),
            "completion_ids": RaggedFieldSpec(torch.int64, max_length=max_completion_length)},
            capacity=rows), rows=rows, group_size=group_size)
        self._plan = LogProbPlan(sources, num_epochs=num_epochs)
        self._gate = PrefetchGate(gate_prefetch)
        self._ingestion = _GroupIngestion(self._pushes, score, group_size=group_size,
                                          scale_rewards=scale_rewards)
        self._delivery = MiniBatchDelivery(self._pushes, self._plan, self._gate, rows=rows,
                                           pad_token_id=self.pad_token_id,
                                           pad_completions_to=pad_completions_to)
        # A completion's buffer slot is its row in generation order and its ragged slot
        # (both are filled in push order from 0 each iteration), so a row holds only its
        # advantage; delivery reads the rest through ``_index``.
        spec = ExperienceSpec.of(advantage=((), torch.float32))
        self._sampler = OrderedFifoSampler(num_minibatches=num_minibatches)
        m = num_minibatches
        self.plane = ExperienceDataPlane(
            spec=spec, capacity=rows, mode="on_policy", num_minibatches=m, num_epochs=num_epochs,
            sampler=self._sampler, rollout_rows=group_size, learner_device=learner_device,
            rollout_spec=ExperienceSpec.of(unit=((), torch.int64)), timeout=timeout,
            schedule=schedule or _default_schedule(group_size, rows, m))
        self._intake = _GroupIntake(self.plane, self._pushes, group_size=group_size, rows=rows)
        self.plane.register_ingestion()(self._ingestion.ingest)
        self.plane.register_delivery(
            whole_iteration=pad_completions_to == "iteration")(self._delivery.deliver)
        self.iteration = -1
        self._all_rows = set(range(rows))

    @property
    def ragged(self) -> RaggedStore:
        """The iteration's prompt and completion tokens, packed (row ``r`` in slot ``r``)."""
        return self._pushes.ragged

    # -- the trainer's side -------------------------------------------------------------------

    def begin_iteration(self, order: torch.Tensor, *, prompt_width: int) -> None:
        """Start the next iteration: its rows will be delivered in ``order`` (a permutation of
        ``0 .. rows-1``, split into the mini-batches in turn), with prompts left-padded to
        ``prompt_width``. Every argument is checked before anything changes.

        An iteration that holds no group (none was pushed, or every push failed) may be begun
        again: the call restarts it with the new ``order`` and ``prompt_width``.

        Raises:
            SpecError: ``order`` is not a 1-D tensor (or sequence) of integers that permutes
                the iteration's rows.
            ConfigError: ``prompt_width`` is not an int in ``[1, max_prompt_length]``, or a
                source's ``skip_first(iteration)`` is not an int >= 0.
            StateError: The previous iteration holds groups and has not been consumed.
            PlaneClosedError: The path is closed.
        """
        if self.plane.closed:
            raise PlaneClosedError("begin_iteration: the experience path is closed")
        order = checked_indices(order, "order")
        # Python on the ints: this runs right after generation, where a first numpy or torch
        # reduction costs more than a loop over an iteration's rows (docs/design.md §2)
        in_order = order.tolist()
        if len(in_order) != self.rows or set(in_order) != self._all_rows:
            raise SpecError("order", f"expected a permutation of {self.rows} rows")
        longest = self.ragged.fields["prompt_ids"].max_length
        if (isinstance(prompt_width, bool) or not isinstance(prompt_width, numbers.Integral)
                or not 1 <= int(prompt_width) <= longest):
            raise ConfigError("prompt_width", f"must be an int in [1, max_prompt_length="
                                              f"{longest}], got {prompt_width!r}")
        pushes = self._pushes
        pushes.settle()
        restart = self.iteration >= 0 and self.plane.policy_version <= self.iteration
        if restart and pushes.pushed:
            raise StateError("iteration", f"iteration {self.iteration} still has mini-batches "
                                          f"to pull")
        iteration = self.iteration if restart else self.iteration + 1
        skips = self._plan.skips_for(iteration)
        # checked: from here on nothing raises
        self.iteration = iteration
        self._plan.begin(iteration, skips)
        self._gate.rearm()
        self._sampler.set_order(self.iteration, order)
        self._delivery.set_order(in_order, self.num_minibatches)
        pushes.restart()  # the last iteration's arrivals are freed by a delivery on the worker
        self._delivery.prompt_width = int(prompt_width)

    @property
    def pushed_groups(self) -> int:
        """Groups of the iteration pushed and not lost: the next push holds the groups from
        this one on (after a failure, the first lost group)."""
        self._pushes.settle()
        return self._pushes.pushed // self.group_size

    def push_group(self, *, prompt_ids: Sequence[Sequence[int]],
                   completion_ids: Sequence[Sequence[int]], payload: Any = None) -> None:
        """Hand one group (G completions of one prompt, in generation order) to ingestion;
        :meth:`push_groups` with one group.

        Raises:
            SpecError, StateError, OperatorError, BackpressureTimeout, PlaneClosedError: See
                :meth:`push_groups`.
        """
        self.push_groups(prompt_ids=prompt_ids, completion_ids=completion_ids, payload=payload)

    def push_groups(self, *, prompt_ids: Sequence[Sequence[int]],
                    completion_ids: Sequence[Sequence[int]], payload: Any = None) -> None:
        """Hand whole groups that arrived together (k × G completions, group after group, in
        generation order) to ingestion as one unit: one ``score`` call covers them all.

        Safe to call from several threads: each push takes the next rows of the iteration and
        is queued in that order.

        Raises:
            SpecError: ``prompt_ids`` or ``completion_ids`` is not a list of sequences, the
                completions do not split into whole groups, the prompts do not match them one
                to one, a group's G prompts are not one prompt (field ``prompt_ids``), a
                sequence is empty or longer than its maximum, a prompt is wider than the
                iteration's ``prompt_width``, or the iteration is full.
            StateError: No iteration was begun (call :meth:`begin_iteration` first), or the
                call comes from inside ingestion (from ``score``): push from the generator.
            OperatorError, BackpressureTimeout, PlaneClosedError: As
                :meth:`ExperienceDataPlane.push`; the groups are lost (see the class).
        """
        if self._ingestion.active:
            raise StateError("push_groups", "called from inside ingestion (the scorer): a push "
                                            "there would wait for the ingestion it runs in; "
                                            "push groups from the generator, not from score()")
        if self.plane.closed:
            raise PlaneClosedError("push_groups: the experience path is closed")
        if self.iteration < 0:
            raise StateError("begin_iteration", "no iteration was begun; call begin_iteration "
                                                "before pushing groups")
        _check_sequences(prompt_ids, "prompt_ids")
        _check_sequences(completion_ids, "completion_ids")
        self._intake.push(prompt_ids, completion_ids, payload, iteration=self.iteration,
                          prompt_width=self._delivery.prompt_width)

    def recover(self) -> OperatorError | None:
        """Clear the plane's latched operator error (:meth:`ExperienceDataPlane.recover`) and
        withdraw the groups a failed ingestion lost; returns the error. Pushes withdrawn with
        them that the plane still holds are run out first (each fails and leaves the
        iteration), so that pushing the lost groups again then completes the iteration.

        Raises:
            BackpressureTimeout: The withdrawn pushes were not run out within the timeout.
        """
        err = self.plane.recover()
        # The pushes withdrawn with the lost groups may still be queued or being ingested on
        # the worker: each fails (its serial is gone) and leaves the iteration. They are run
        # out here, so that pushing the lost groups again finds the plane holding only the
        # groups kept, and no stale failure is latched after this returns.
        while True:
            try:
                self.plane.flush()
                break
            except OperatorError:
                self.plane.recover()
        self._pushes.settle()
        return err

    def pull(self) -> Batch:
        """The next mini-batch: ``prompt_ids``/``prompt_mask`` (left-padded),
        ``completion_ids``/``completion_mask`` (right-padded), ``advantages``, the
        :class:`LogProbSource` keys it needs, and ``row`` (its rows in generation order).

        Raises:
            EmptyBufferError, OperatorError, PlaneClosedError: As
                :meth:`ExperienceDataPlane.pull`.
        """
        return self._gate.pull(self.plane)

    def update_started(self) -> None:
        """The learner began its update on the mini-batch it pulled last: with
        ``gate_prefetch``, the next mini-batch's delivery may start now."""
        self._gate.open()

    def flush(self) -> None:
        """Ingest every pushed group now.

        Raises:
            OperatorError, BackpressureTimeout, PlaneClosedError: As
                :meth:`ExperienceDataPlane.flush`; a failed ingestion's groups are lost (see
                the class).
        """
        try:
            self.plane.flush()
        finally:
            self._pushes.settle()

    @property
    def rewards(self) -> torch.Tensor:
        """Rewards of the iteration's ingested rows, in generation order (NaN before)."""
        return self._pushes.rewards

    @property
    def advantages(self) -> torch.Tensor:
        """Advantages of the iteration's ingested rows, in generation order."""
        return self._pushes.advantages

    def completion_tokens(self) -> int:
        """Completion tokens of the iteration ingested so far."""
        with self._pushes.lock:
            return self._pushes.ragged.tokens("completion_ids")

    def close(self) -> None:
        """Stop the plane's workers (a delivery waiting for :meth:`update_started` is let
        go)."""
        self._gate.close()
        self.plane.close()

    def __enter__(self) -> GroupExperiencePath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ADV_EPS", "GroupExperiencePath", "LogProbSource", "OrderedFifoSampler",
           "combine_rewards", "group_advantages", "nanstd"]
