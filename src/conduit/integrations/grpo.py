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
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

import torch

from conduit._checks import check_int
from conduit.errors import (
    ConfigError,
    EmptyBufferError,
    OperatorError,
    PlaneClosedError,
    SpecError,
    StateError,
)
from conduit.plane import ExperienceDataPlane
from conduit.scheduling.space import Schedule, feasible_space
from conduit.spec import Batch, ExperienceSpec, RaggedFieldSpec, as_indices, checked_indices
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
        fn: ``fn(prompt_ids, prompt_mask, completion_ids, completion_mask)`` -> a
            floating-point tensor shaped as ``completion_ids`` (B, T); anything else fails
            the delivery with a :class:`SpecError` naming ``key``. It must read a policy that
            does not change during the iteration (a snapshot).
        skip_first: Leading mini-batches of a single-epoch iteration that need none (they are
            trained under the policy that generated them, so the learner's own log-probs,
            detached, are the same): an int >= 0, or ``skip_first(iteration)`` -> that int,
            called once per iteration by :meth:`GroupExperiencePath.begin_iteration` (where
            the iteration's start does not fall on an optimizer step, the count differs from
            one iteration to the next).
        reuse_across_epochs: With several epochs, compute a mini-batch's log-probs once per
            iteration and deliver the same tensor in its later epochs (every epoch repeats
            the iteration's mini-batches, and ``fn`` reads a snapshot, so they would not
            change); they are held until the mini-batch's last epoch is delivered. False
            (default): ``fn`` runs on every delivery.
    """

    key: str
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    skip_first: int | Callable[[int], int] = 0
    reuse_across_epochs: bool = False


_OUT_KEYS = frozenset({"prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                       "advantages", "row"})


def _check_sources(logprobs: Any) -> tuple[LogProbSource, ...]:
    """``logprobs`` as a tuple, each a :class:`LogProbSource` with a callable ``fn``, a key
    of its own, an int >= 0 (or callable) ``skip_first`` and a bool ``reuse_across_epochs``.

    Raises:
        ConfigError: One is not (field ``logprobs``, or ``logprobs[i]...``).
    """
    if isinstance(logprobs, (str, bytes)) or not isinstance(logprobs, Sequence):
        raise ConfigError("logprobs", f"must be a sequence of LogProbSource, got {logprobs!r}")
    keys: set[str] = set()
    for i, src in enumerate(logprobs):
        if not isinstance(src, LogProbSource):
            raise ConfigError(f"logprobs[{i}]", f"must be a LogProbSource, got {src!r}")
        if not isinstance(src.key, str) or not src.key or src.key in _OUT_KEYS | keys:
            raise ConfigError(f"logprobs[{i}].key", f"must be a new name for the delivered "
                                                    f"batch, got {src.key!r}")
        keys.add(src.key)
        if not callable(src.fn):
            raise ConfigError(f"logprobs[{i}].fn", f"must be callable, got {src.fn!r}")
        skip = src.skip_first
        if not callable(skip) and (isinstance(skip, bool) or not isinstance(skip, int)
                                   or skip < 0):
            raise ConfigError(f"logprobs[{i}].skip_first", f"must be an int >= 0 or a "
                                                           f"callable, got {skip!r}")
        if not isinstance(src.reuse_across_epochs, bool):
            raise ConfigError(f"logprobs[{i}].reuse_across_epochs", f"must be a bool, got "
                                                                    f"{src.reuse_across_epochs!r}")
    return tuple(logprobs)


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
    sources = _check_sources(logprobs)
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


def _skip_of(i: int, src: LogProbSource, iteration: int) -> int:
    """``src``'s leading mini-batches without log-probs in ``iteration``.

    Raises:
        ConfigError: A callable ``skip_first`` returned something else than an int >= 0.
    """
    n = src.skip_first(iteration) if callable(src.skip_first) else src.skip_first
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ConfigError(f"logprobs[{i}].skip_first", f"must give an int >= 0, got {n!r}")
    return int(n)


@dataclass
class _Unit:
    """Groups pushed together: their first row in generation order, the sequences as given
    (for the scorer) and packed."""

    first: int
    prompt_ids: Sequence[Sequence[int]]
    completion_ids: Sequence[Sequence[int]]
    prompts: tuple[torch.Tensor, torch.Tensor]
    completions: tuple[torch.Tensor, torch.Tensor]
    payload: Any


def _unit_rewards(unit: _Unit, score: Callable[..., Any], group_size: int) -> torch.Tensor:
    """The rewards ``score`` gives the completions of one push, checked.

    Raises:
        SpecError: They are not one finite real number (or NaN) per completion.
    """
    n, what = len(unit.completion_ids), f"groups from {unit.first // group_size}"
    r = _scored(score(unit.payload, unit.prompt_ids, unit.completion_ids), n, what)
    _has_nan(r, what=f"{what}: the scorer's output ")
    return r


def _logprobs_of(src: LogProbSource, batch: Batch) -> torch.Tensor:
    """``src``'s per-token log-probs of a padded mini-batch, on one torch thread (a prefetch
    must not take the learner's cores).

    Raises:
        SpecError: ``src.fn`` returned something else than a floating-point tensor shaped as
            ``completion_ids`` (field ``src.key``).
    """
    completion_ids = batch["completion_ids"]
    with data_path_threads(1):
        logps = src.fn(batch["prompt_ids"], batch["prompt_mask"], completion_ids,
                       batch["completion_mask"])
    if (not isinstance(logps, torch.Tensor) or not logps.is_floating_point()
            or logps.shape != completion_ids.shape):
        got = (f"{logps.dtype} tensor of shape {tuple(logps.shape)}"
               if isinstance(logps, torch.Tensor) else type(logps).__name__)
        raise SpecError(src.key, f"LogProbSource {src.key!r}: fn returned {got}; return "
                                 f"a floating-point tensor of per-token log-probs "
                                 f"shaped as completion_ids, {tuple(completion_ids.shape)}")
    return logps


class _Pushes:
    """The current iteration's pushes, in row order: the rows each reserved, the tokens of
    those ingested (packed in ``ragged``, row ``r`` in slot ``r``), their rewards and
    advantages, and the earliest row a failure lost.

    Pushes, ingestion and delivery run on different threads: ``lock`` guards ``ragged`` and
    the units. A failure marks the first row of the push it lost (:meth:`lose`);
    :meth:`settle` then withdraws that push and every later one, whose rows would no longer
    follow generation order, so that the count of pushed rows is again what the plane holds
    or still ingests.
    """

    def __init__(self, ragged: RaggedStore, *, rows: int, group_size: int) -> None:
        self.ragged, self.lock = ragged, threading.Lock()
        self._rows, self._group_size = rows, group_size
        # by serial, unique for the path's lifetime, so a push that was withdrawn after a
        # failure can never be taken for its replacement
        self.units: dict[int, _Unit] = {}
        self.pushed = 0  # rows reserved by the pushes not withdrawn
        self.rewards = torch.full((rows,), float("nan"))
        self.advantages = torch.zeros(rows)
        self._serial = 0
        self._lost: int | None = None  # first row of the earliest lost push
        self._lost_to: BaseException | None = None  # the failure that lost it
        self._spent: list[dict[int, _Unit]] = []  # earlier iterations' arrivals, to free

    def restart(self) -> None:
        """Empty, for the next iteration (the last one's arrivals wait for
        :meth:`free_spent`)."""
        with self.lock:
            self.ragged.clear()
            self._spent.append(self.units)
            self.units, self.pushed, self._lost, self._lost_to = {}, 0, None, None
        self.rewards = torch.full((self._rows,), float("nan"))
        self.advantages = torch.zeros(self._rows)

    def add(self, unit: _Unit) -> int:
        """Reserve ``unit``'s rows, from :attr:`pushed` on; returns its serial. The caller
        holds the path's push lock."""
        serial = self._serial
        self._serial += 1
        self.units[serial] = unit
        self.pushed += len(unit.completion_ids)
        return serial

    def lose(self, serials: Sequence[int], cause: BaseException | None = None) -> None:
        """The pushes ``serials`` failed (of ``cause``): those still live mark their first row
        lost (a withdrawn one, or one of an earlier iteration, marks nothing)."""
        with self.lock:
            for serial in serials:
                unit = self.units.get(serial)
                if unit is not None and (self._lost is None or unit.first < self._lost):
                    self._lost, self._lost_to = unit.first, cause

    def settle(self) -> None:
        """Withdraw the pushes from the earliest lost row on."""
        with self.lock:
            cut, self._lost, self._lost_to = self._lost, None, None
            if cut is None:
                return
            self.units = {s: u for s, u in self.units.items() if u.first < cut}
            self.pushed = min(self.pushed, cut)
            if len(self.ragged) > cut:  # rows of an invocation that failed after packing
                self._truncate(cut)
        self.rewards[cut:] = float("nan")
        self.advantages[cut:] = 0.0

    def _truncate(self, rows: int) -> None:
        """Keep the ragged store's first ``rows`` rows (with :attr:`lock` held)."""
        state = self.ragged.state_dict()
        fields = {}
        for name, entry in state["fields"].items():
            off = entry["offsets"][:rows + 1]
            fields[name] = {"values": entry["values"][:int(off[-1])], "offsets": off}
        self.ragged.load_state_dict({"rows": rows, "fields": fields})

    def live(self, serials: Sequence[int]) -> list[_Unit]:
        """The pushes ``serials``, which an ingestion invocation holds.

        Raises:
            StateError: One was withdrawn after an earlier push of its iteration failed, or
                follows one that failed and is not withdrawn yet (chained to that failure).
        """
        units = []
        lost, cause = self._lost, self._lost_to
        for serial in serials:
            unit = self.units.get(serial)
            if unit is None:
                raise StateError("unit", "a push withdrawn after an earlier push of its "
                                         "iteration failed; push its groups again")
            if lost is not None and unit.first >= lost:
                g = self._group_size
                raise StateError("unit", f"groups from {unit.first // g} follow groups from "
                                         f"{lost // g}, which failed ({cause!r}); push the "
                                         f"groups again from group {lost // g}") from cause
            units.append(unit)
        return units

    def pack(self, serials: Sequence[int], units: Sequence[_Unit]) -> None:
        """Append the tokens of ``units`` (pushes ``serials``, consecutive), packed as one.

        Raises:
            StateError: They are not the next rows, or one was withdrawn meanwhile.
        """
        packed = {name: tuple(_joined(parts) for parts in zip(
            *(getattr(unit, attr) for unit in units)))
            for name, attr in (("prompt_ids", "prompts"), ("completion_ids", "completions"))}
        with self.lock:  # (joined before: delivery pads under this lock)
            at = len(self.ragged)
            for serial, unit in zip(serials, units):
                if self.units.get(serial) is not unit or unit.first != at:
                    raise StateError("row", f"groups from {unit.first // self._group_size} "
                                            f"were ingested out of order")
                at += len(unit.completion_ids)
            self.ragged.extend_packed(packed)

    def unpack(self, rows: int) -> None:
        """Keep the first ``rows`` rows' tokens (a write after :meth:`pack` failed)."""
        with self.lock:
            self._truncate(rows)

    def free_spent(self) -> None:
        """Drop earlier iterations' arrivals (their tensors)."""
        with self.lock:
            spent, self._spent = self._spent, []
        del spent

    @property
    def spent(self) -> int:
        """Earlier iterations whose arrivals are not freed yet."""
        return len(self._spent)


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
        self._score, self._logprobs = score, sources
        self._skips = tuple(0 for _ in sources)  # per source, for the current iteration
        # (iteration, mini-batch) -> its rows, the log-probs of the sources that reuse them
        # across epochs, and the epochs delivered so far
        self._reused: dict[tuple[int, int], tuple[torch.Tensor, dict[str, torch.Tensor], int]] = {}
        self._pushes = _Pushes(RaggedStore(fields={
            "prompt_ids": RaggedFieldSpec(torch.int64, max_length=max_prompt_length),
            "completion_ids": RaggedFieldSpec(torch.int64, max_length=max_completion_length)},
            capacity=rows), rows=rows, group_size=group_size)
        # held from a push's reservation of rows through plane.push, so the plane queues
        # pushes in row order; ingestion never takes it (a push from inside ingestion, such as
        # from the scorer, is refused: it would wait for the ingestion it runs in)
        self._push_lock = threading.Lock()
        self._ingesting = threading.local()  # set on a thread while it runs the ingestion
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
            rollout_spec=ExperienceSpec.of(unit=((), torch.int64)), timeout=timeout,
            schedule=schedule or _default_schedule(group_size, rows, m))
        self.plane.register_ingestion()(self._ingest)
        self.plane.register_delivery(
            whole_iteration=pad_completions_to == "iteration")(self._deliver)
        self.iteration = -1
        self._part_of = [0] * rows  # row -> its mini-batch within the epoch
        self._all_rows = set(range(rows))
        self._prompt_width = 0

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
        skips = tuple(_skip_of(i, src, iteration) for i, src in enumerate(self._logprobs))
        # checked: from here on nothing raises
        self.iteration, self._skips = iteration, skips
        self._reused = {}
        if not self._closing:  # generation is over and the learner is not updating
            self._permit.clear()
        self._sampler.set_order(self.iteration, order)
        per_part = self.rows // self.num_minibatches  # equal parts, in delivery order
        for position, row in enumerate(in_order):
            self._part_of[row] = position // per_part
        pushes.restart()  # the last iteration's arrivals are freed by a delivery on the worker
        self._prompt_width = int(prompt_width)

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
        if getattr(self._ingesting, "active", False):
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
        pushes = self._pushes
        with self._push_lock:
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
                raise SpecError(None, f"iteration {self.iteration} holds {self.groups} groups "
                                      f"and {pushes.pushed // self.group_size} are pushed; call "
                                      f"begin_iteration for the next one")
            what = f"groups {first}..{first + n // self.group_size - 1}"
            prompts = self.ragged.fields["prompt_ids"].validate(prompt_ids, field="prompt_ids",
                                                                what=what)
            completions = self.ragged.fields["completion_ids"].validate(
                completion_ids, field="completion_ids", what=what)
            if int(prompts[1].max()) > self._prompt_width:
                raise SpecError("prompt_ids", f"{what} hold a prompt longer than the "
                                              f"iteration's prompt_width {self._prompt_width}")
            _check_one_prompt_per_group(prompts, self.group_size, what)
            serial = pushes.add(_Unit(pushes.pushed, prompt_ids, completion_ids, prompts,
                                      completions, payload))
            try:
                self.plane.push({"unit": torch.full((n,), serial, dtype=torch.int64)},
                                policy_version=self.iteration)
            except BaseException:
                # refused, or ingested here and failed: withdrawn (a copy the plane still
                # holds fails its ingestion, as its serial is gone)
                pushes.lose([serial])
                pushes.settle()
                raise

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
        self._closing = True
        self._permit.set()
        self.plane.close()

    # -- operators ----------------------------------------------------------------------------

    def _ingest(self, actor_in: Any, exp_out: Any) -> None:
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
        reward = _joined([_unit_rewards(unit, self._score, self.group_size) for unit in units])
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
        pushes = self._pushes
        if pushes.spent > 1 or (pushes.spent and not getattr(self._pulling, "active", False)):
            pushes.free_spent()  # on the worker; on the learner once two iterations' wait
        rows = exp_in.read()
        slots = rows["_index"]  # generation rows, and ragged slots (see the spec)
        with pushes.lock:
            prompt_ids, prompt_mask = pushes.ragged.padded_with_mask(
                "prompt_ids", slots, pad_value=self.pad_token_id, side="left",
                width=self._prompt_width, mask_dtype=torch.int64)
            width = None
            if self.pad_completions_to == "iteration":
                width = int(pushes.ragged.lengths("completion_ids").max())
            completion_ids, completion_mask = pushes.ragged.padded_with_mask(
                "completion_ids", slots, pad_value=self.pad_token_id, width=width,
                mask_dtype=torch.int64)
        out = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
               "completion_ids": completion_ids, "completion_mask": completion_mask,
               "advantages": rows["advantage"], "row": slots}
        part = self._part_of[int(slots.numpy()[0])] if slots.numel() else 0
        reused = self._reused_logprobs(part, slots)
        for src, skip in zip(self._logprobs, self._skips):
            if src.key in reused:
                out[src.key] = reused[src.key]
            elif self.num_epochs > 1 or part >= skip:
                out[src.key] = _logprobs_of(src, out)
        self._keep_logprobs(part, slots, out, reused)
        learn_out.write(out)

    def _reused_logprobs(self, part: int, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The log-probs an earlier epoch computed for mini-batch ``part`` of the iteration
        (the sources with ``reuse_across_epochs``), if it held the same rows ``slots``."""
        held = self._reused.get((self.iteration, part))
        if held is None or not torch.equal(held[0], slots):
            return {}
        return held[1]

    def _keep_logprobs(self, part: int, slots: torch.Tensor, out: Batch,
                       reused: dict[str, torch.Tensor]) -> None:
        """Hold the log-probs of mini-batch ``part`` (delivered as ``out``) that its later
        epochs reuse; drop them with its last epoch."""
        if self.num_epochs == 1 or not any(s.reuse_across_epochs for s in self._logprobs):
            return
        key = (self.iteration, part)
        held = self._reused.get(key)
        epochs = held[2] + 1 if reused and held is not None else 1
        if epochs >= self.num_epochs:
            self._reused.pop(key, None)
            return
        keep = {s.key: out[s.key] for s in self._logprobs if s.reuse_across_epochs}
        self._reused[key] = (slots.clone(), keep, epochs)

    def __enter__(self) -> GroupExperiencePath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ADV_EPS", "GroupExperiencePath", "LogProbSource", "OrderedFifoSampler",
           "combine_rewards", "group_advantages", "nanstd"]
