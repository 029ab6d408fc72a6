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
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from verl import DataProto

from conduit._checks import check_bool, check_device, check_int, check_key, check_real
from conduit.errors import (
    CapacityError,
    ConfigError,
    EmptyBufferError,
    OperatorError,
    PlaneClosedError,
    ScheduleError,
    StateError,
)
from conduit.integrations.verl._checks import check_epsilon, check_seed
from conduit.integrations.verl._weak import weak_ingestion
from conduit.integrations.verl.advantages import (
    group_scores,
    grpo_group_advantage,
    token_level_advantage,
)
from conduit.integrations.verl.order import VerlOrderSampler
from conduit.integrations.verl.put_checks import ADDED, GROUP, ROW, PutCheck, merged_meta
from conduit.plane import ActorIn, BufferOut, ExperienceDataPlane
from conduit.plane.config import wait_seconds
from conduit.plane.migration import PlacementArg, check_placement_arg
from conduit.scheduling.space import Schedule, feasible_space
from conduit.spec import Batch, ExperienceSpec, FieldSpec


class LostGroupsError(OperatorError):
    """The ingestion operator failed, and the rows of some put groups were not stored.

    The buffer holds every other group of the step, and its plane is usable again: put the
    listed groups again, in this order, and the step's mini-batches are those a run without
    the failure gives (same rows, advantages and order).

    Attributes:
        uids: The groups to put again, in the order they were put.
        lost_units: The puts taken back (each put is one rollout unit of the plane).
        lost_rows: Their rows.
        stored_rows: 0: rows the failed invocation stored stay, and their groups are not
            in ``uids``.
    """

    def __init__(self, original: BaseException, *, uids: list[Any], units: int,
                 rows: int) -> None:
        super().__init__("ingestion", original, lost_units=units, lost_rows=rows)
        self.uids = list(uids)
        shown = ", ".join(repr(u) for u in self.uids[:8])
        more = f" and {len(self.uids) - 8} more" if len(self.uids) > 8 else ""
        again = (f"put groups [{shown}{more}] again, in this order" if self.uids
                 else "every put group is stored")
        self.args = (f"{self.args[0]}; {again}",)


class _Dropped(Exception):  # noqa: N818 - what the operator raises, not a failure of its own
    """Raised by the ingestion operator for units queued behind a failed invocation."""


class _Step:
    """Host-side bookkeeping of one step: its puts (groups, rows and non-tensor entries, in
    put order), and the mini-batches pulled from the plane so far.

    A put records its groups here before it pushes them (a mini-batch of its rows may be
    delivered as soon as the push returns) and takes them back if the push raises; after an
    ingestion failure, :meth:`keep` drops the puts whose rows the plane did not store. Pulled
    mini-batches stay here until the whole step is pulled, so a :meth:`GRPOBuffer.minibatches`
    that raised (a timeout) loses none of them and a retry resumes where it stopped.
    """

    def __init__(self) -> None:
        self.rows = 0
        self.uids: set[Any] = set()
        self.puts: list[tuple[list[Any], int]] = []  # each put's uids and rows
        self.parts: list[dict[str, np.ndarray]] = []
        self.metas: list[dict[str, Any]] = []  # each put's meta_info
        self.pulled: list[Batch] = []  # the step's mini-batches, as the plane delivered them
        self.pulled_all = False  # the plane has moved on to the next step
        self._joined: dict[str, np.ndarray] | None = None

    def add(self, uids: list[Any], part: dict[str, np.ndarray], rows: int,
            meta_info: Mapping[str, Any]) -> None:
        """Record one put's groups (its rows follow the step's earlier rows)."""
        self.metas.append(dict(meta_info))
        self.uids.update(uids)
        self.puts.append((uids, rows))
        self.parts.append(part)
        self.rows += rows
        self._joined = None

    def remove_last(self) -> None:
        """Take back the last :meth:`add` (its push raised, or its rows were not stored)."""
        uids, rows = self.puts.pop()
        self.uids.difference_update(uids)
        self.parts.pop()
        self.metas.pop()
        self.rows -= rows
        self._joined = None

    def keep(self, rows: int) -> list[tuple[list[Any], int]]:
        """Keep the first puts, which hold the step's first ``rows`` rows (the plane stores
        rows in put order); take back the others and return them (uids and rows, in put
        order)."""
        kept = total = 0
        while kept < len(self.puts) and total + self.puts[kept][1] <= rows:
            total += self.puts[kept][1]
            kept += 1
        if total != rows:
            raise StateError("step.rows", f"the plane stores {rows} rows of the step, which "
                                          f"do not end where a put ends; close the buffer and "
                                          f"build a new one")
        dropped = self.puts[kept:]
        for _ in dropped:
            self.remove_last()
        return dropped

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
        seed: Seed of that shuffle (verl's update passes 42), in ``[0, 2**64 - 1]``.
        reward_key: Token-level reward field of the put batches (floating point).
        epsilon: Added to each group's standard deviation: a finite number, > 0 (also in
            float32 and in the rewards' dtype) when ``norm_adv_by_std_in_grpo`` (verl's
            default 1e-6).
        norm_adv_by_std_in_grpo: Divide by it (GRPO) or only centre (Dr. GRPO).
        placement: Where the step's rows live: ``"auto"`` (default) lets Conduit decide from
            this machine's topology and the rows' size (Alg. 1), or any placement
            :class:`~conduit.ExperienceDataPlane` takes (a
            :class:`~conduit.storage.Placement`, a :class:`~conduit.placement.PlacementMap`
            solved for ``group_size × groups_per_step`` rows, or None for CPU memory).
        schedule: Overlap and granularity of ingestion and delivery (default inline); a
            :class:`~conduit.Schedule` feasible on-policy for ``num_minibatches``.
        learner_device: Device the mini-batches are delivered to: the CPU or a CUDA device
            this machine has, given as :class:`~conduit.ExperienceDataPlane` takes it.
        timeout: Seconds a put or a mini-batch may wait before raising.

    Non-tensor entries are copied at put; the elements of an object array (a dict, a list)
    are not: the delivered mini-batch shares them with the put ``DataProto``. Each mini-batch
    carries the step's ``meta_info``: its puts' merged as ``DataProto.concat`` merges them
    (every key once, ``metrics`` gathered into lists).

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
        seed = check_seed("seed", seed)
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
        check_placement_arg(placement, self.rows_per_step)
        _check_schedule(schedule, self.num_minibatches)
        learner_device = check_device("learner_device", learner_device)
        self.shuffle, self.seed = shuffle, seed
        self.reward_key, self.epsilon = reward_key, epsilon
        self.norm_by_std = norm_adv_by_std_in_grpo
        self._checks = PutCheck(reward_key=reward_key, group_size=group_size, epsilon=epsilon,
                                norm_by_std=norm_adv_by_std_in_grpo)
        self._plane_args: dict[str, Any] = dict(
            placement=placement, schedule=schedule, learner_device=learner_device,
            timeout=timeout)
        self._plane: ExperienceDataPlane | None = None
        self._steps: dict[int, _Step] = {}
        self._filling = 0  # step that puts go to
        self._delivering = 0  # step that minibatches() reads
        self._put_lock = threading.Lock()  # puts, and settling a failure, one at a time
        self._lost_seen = 0  # the plane's lost_units once the last failure was settled
        self._failure: BaseException | None = None  # what the operator raised, until settled
        self._arrived = threading.Condition()  # a put recorded rows, or close() ran
        self._closed = False

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
                ``non_tensor_batch["uid"]`` (the prompt of each response, hashable); every uid has
                exactly ``group_size`` rows, each with at least one response token. Other
                tensor and non-tensor entries travel along.

        A put refused before its rows reach the plane (a ``SpecError``, a
        ``CapacityError``, a timeout) leaves the step as it was: its groups can be put again.
        A put that meets an ingestion failure (of an invocation over this put's groups, or
        over earlier puts' groups still waiting to be ingested) leaves the step holding
        exactly the groups whose rows the plane stored, and raises
        :class:`LostGroupsError` naming every other group of its puts, in put order; rows
        stored before the failure stay, and their groups are not named. No group of a put
        that raised is stored later.

        Raises:
            SpecError: ``data`` is not a ``DataProto``, lacks a field, has a group of the wrong
                size or already put this step, a uid that is not hashable, a field whose
                name starts with ``_``, a tensor on the ``meta`` device, an empty response,
                rewards that are not floating point, whose sum over a response is not
                finite, or whose group's mean or standard deviation overflows their dtype
                (field ``reward_key``), a field whose shape or dtype differs from the first
                put's, a non-tensor entry whose per-row shape differs from this step's first
                put's (field ``non_tensor_batch``), or a ``meta_info`` that does not merge
                with this step's earlier puts' (a key with another value; field
                ``meta_info``).
            ConfigError: ``epsilon`` rounds to 0 in the rewards' dtype.
            CapacityError: The groups overflow the step being filled.
            BackpressureTimeout: The next step could not start within the timeout.
            LostGroupsError: The ingestion operator failed (here, or earlier on the ingestion
                worker); ``uids`` lists the groups to put again, this put's among them
                unless its rows were stored. An operator interrupted on this thread
                (``KeyboardInterrupt``, ``SystemExit``) raises that interrupt instead, with
                the same list in a note; the buffer is settled the same way.
            OperatorError: The delivery operator failed; the plane recovers, and this put can
                be made again.
            PlaneClosedError: The buffer was closed.
        """
        with self._put_lock:
            if self._closed:
                raise PlaneClosedError("the GRPOBuffer is closed; build a new one")
            tensors, group = self._checks(data, self._steps.get(self._filling))
            step = self._steps.get(self._filling) or _Step()
            rows = len(data)
            if step.rows + rows > self.rows_per_step:
                raise CapacityError(f"a put of {rows} rows overflows the step, which has "
                                    f"{self.rows_per_step - step.rows} rows left; put whole "
                                    f"steps of {self.groups_per_step} groups", needed=rows,
                                    available=self.rows_per_step - step.rows)
            plane = self._plane or self._build(tensors)
            unit = {**tensors, ROW: torch.arange(step.rows, step.rows + rows), GROUP: group}
            uids = list(dict.fromkeys(data.non_tensor_batch["uid"].tolist()))  # its groups
            # Recorded before the push: its rows may be delivered as soon as it returns.
            step.add(uids, {k: np.array(v, copy=True) for k, v in data.non_tensor_batch.items()},
                     rows, data.meta_info)
            with self._arrived:  # minibatches() sees it with the plane built
                self._steps[self._filling] = step
                self._arrived.notify_all()
            try:
                plane.push(unit, policy_version=self._filling)
            except BaseException as exc:
                if not self._ingestion_failed():
                    step.remove_last()  # refused: nothing of it is queued
                    if isinstance(exc, OperatorError) and plane.failed is not None:
                        plane.recover()  # a delivery failure, reported here
                    raise
                raise self._settled(exc)  # noqa: B904 - its cause is set
            if self._ingestion_failed():  # an invocation over earlier puts' groups failed
                raise self._settled(None)
            if step.rows == self.rows_per_step:
                self._filling += 1

    def minibatches(self, *, timeout: float | None = None) -> list[DataProto]:
        """Every mini-batch of the oldest undelivered step (``epochs × num_minibatches``),
        in verl's order; the step is then released.

        It may be called while the step's groups are still being put (from another thread,
        with an overlapped schedule): it returns once the whole step is delivered. If it
        raises, the mini-batches it pulled so far stay with the step, and the next call
        resumes there and returns all of them.

        A call made before the step's first put (before any put at all, or after the
        previous step was delivered) waits for it, within the timeout of the call's first
        mini-batch (one deadline for both): another thread may be about to put.

        Args:
            timeout: Seconds to wait for each mini-batch (default: the buffer's ``timeout``).

        Raises:
            EmptyBufferError: A mini-batch was not ready within the timeout (the step is not
                full yet, or has no groups); call again once its groups are put.
            LostGroupsError: The ingestion operator failed on this step's groups, and this
                call met the failure first (an interrupt raises itself instead, as in
                :meth:`put`): the step holds exactly the groups whose rows were stored, and
                ``uids`` lists the groups to put again; call again once they are put.
            OperatorError: An operator failure that another call already settled (and
                reported), or a delivery failure; the plane recovers: call again.
            ConfigError: ``timeout`` is not a number of seconds >= 0.
            PlaneClosedError: The buffer was closed.
        """
        if self._closed:
            raise PlaneClosedError("the GRPOBuffer is closed; build a new one")
        wait = self._wait_for(timeout)
        deadline = time.monotonic() + wait
        with self._arrived:
            started = self._arrived.wait_for(lambda: self._closed or self._has_rows(), wait)
            step = self._steps.get(self._delivering)
        if self._closed:
            raise PlaneClosedError("the GRPOBuffer is closed; build a new one")
        if not started or step is None or self._plane is None:
            raise EmptyBufferError(f"step {self._delivering} had no groups within {wait} s; "
                                   f"call again once its groups are put")
        plane = self._plane
        if not step.pulled_all:
            version = plane.policy_version  # the step's last pull moves it on
            limit = max(0.0, deadline - time.monotonic())  # the first pull: what is left
            while plane.policy_version == version:
                try:
                    step.pulled.append(plane.pull(timeout=limit))
                except BaseException as exc:
                    if self._ingestion_failed():
                        with self._put_lock:  # (a put may be settling it meanwhile)
                            if self._ingestion_failed():
                                raise self._settled(exc)  # noqa: B904 - its cause is set
                    elif isinstance(exc, OperatorError) and plane.failed is not None:
                        plane.recover()  # a delivery failure, reported here
                    raise
                limit = wait
            step.pulled_all = True
        # Converted once the step is whole: every row's non-tensor entries are recorded.
        meta = merged_meta(step.metas)
        out = [self._to_dataproto(b, step, meta) for b in step.pulled]
        del self._steps[self._delivering]
        self._delivering += 1
        return out

    def close(self) -> None:
        """Stop the plane's workers; later puts and mini-batches raise
        :class:`~conduit.errors.PlaneClosedError`. Idempotent."""
        with self._arrived:
            self._closed = True
            self._arrived.notify_all()
        if self._plane is not None:
            self._plane.close()

    def _has_rows(self) -> bool:
        step = self._steps.get(self._delivering)
        return step is not None and step.rows > 0

    def _wait_for(self, timeout: float | None) -> float:
        """Seconds a call may wait: ``timeout``, or the buffer's when None.

        Raises:
            ConfigError: ``timeout`` is not a number of seconds >= 0 (as the plane checks it).
        """
        if self._plane is not None:
            return self._plane.config.wait_for(timeout)
        return wait_seconds(timeout, default=float(self._plane_args["timeout"]))

    def _ingestion_failed(self) -> bool:
        """Whether an ingestion invocation failed since the last failure was settled."""
        plane = self._plane
        return plane is not None and plane.counters["lost_units"] != self._lost_seen

    def _settled(self, exc: BaseException | None) -> BaseException:
        """Settle an ingestion failure (:meth:`_settle_locked`, with the put lock held) that
        the call met as ``exc`` (None: it returned), and what the call raises: ``exc`` itself
        when it is an interrupt, with a note naming the groups to put again, else a
        :class:`LostGroupsError` naming them, caused by what the operator raised."""
        plane = self._plane
        assert plane is not None  # (a failure needs a plane)
        latched = plane.failed
        cause = (self._failure
                 or (exc.__cause__ if exc is not None and exc.__cause__ is not None else exc)
                 or (latched.__cause__ if latched is not None else None)
                 or RuntimeError("an ingestion invocation failed"))
        lost = self._settle_locked()
        uids = [u for put_uids, _ in lost for u in put_uids]
        if exc is not None and not isinstance(exc, Exception):  # an interrupt stays one
            exc.add_note(f"conduit: the GRPOBuffer's groups {uids} were not stored; put "
                         f"them again, in this order")
            return exc
        err = LostGroupsError(cause, uids=uids, units=len(lost),
                              rows=sum(rows for _, rows in lost))
        err.__cause__, err.__suppress_context__ = cause, True
        return err

    def _settle_locked(self) -> list[tuple[list[Any], int]]:
        """Make the steps match the rows the plane stored, after an ingestion failure.

        Until this returns, the ingestion operator refuses every invocation
        (:meth:`_ingest`), so no row lands after the failure: the units still queued are
        flushed out (each refusal fails on the plane, which then recovers), and the rows
        stored are the first rows of the plane's current step, in put order. Every put
        holding other rows is taken back (those of later steps too), and the next puts go
        to the first step that is not full.

        Returns:
            The puts taken back (their uids and rows), in put order.
        """
        plane = self._plane
        assert plane is not None
        while True:
            plane.recover()
            try:
                plane.flush()
            except OperatorError as e:
                if e.operator != "ingestion":
                    raise
                continue  # a refused invocation; more units may be queued
            break
        plane.recover()  # also forgets the losses of inline invocations on other threads
        stats = plane.stats()
        version, stored = stats["policy_version"], stats["size"]
        lost: list[tuple[list[Any], int]] = []
        with self._arrived:
            for index in sorted(i for i in self._steps if i >= version):
                step = self._steps[index]
                lost += step.keep(stored if index == version else 0)
                if index > version:  # (the current step stays: a minibatches() may hold it)
                    del self._steps[index]
            current = self._steps.get(version)
        full = current is not None and current.rows == self.rows_per_step
        self._filling = version + 1 if full else version
        self._lost_seen = stats["lost_units"]
        self._failure = None
        return lost

    def __enter__(self) -> GRPOBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self, tensors: Batch) -> ExperienceDataPlane:
        fields = {k: FieldSpec(shape=tuple(v.shape[1:]), dtype=v.dtype)
                  for k, v in tensors.items()}
        ids = FieldSpec(shape=(), dtype=torch.int64)
        mask = tensors["response_mask"]
        adv = FieldSpec(shape=tuple(mask.shape[1:]),
                        dtype=torch.promote_types(tensors[self.reward_key].dtype, mask.dtype))
        rollout_spec = ExperienceSpec(fields={**fields, ROW: ids, GROUP: ids})
        spec = ExperienceSpec(fields={**fields, **dict.fromkeys(ADDED, adv), ROW: ids})
        sampler = VerlOrderSampler(num_minibatches=self.num_minibatches, shuffle=self.shuffle,
                                   seed=self.seed)
        plane = ExperienceDataPlane(
            spec=spec, capacity=self.rows_per_step, mode="on_policy",
            num_minibatches=self.num_minibatches, num_epochs=self.epochs, sampler=sampler,
            rollout_spec=rollout_spec, seed=self.seed, **self._plane_args)
        plane.register_ingestion()(weak_ingestion(self._ingest))
        self._plane = plane
        return plane

    def _ingest(self, actor_in: ActorIn, exp_out: BufferOut) -> None:
        """The ingestion operator. Once an invocation has failed, it refuses every unit
        until the failure is settled (:meth:`_settle_locked`), so no row lands after the
        failed invocation's."""
        if self._ingestion_failed():
            raise _Dropped("the unit was queued behind a failed ingestion invocation; the "
                           "GRPOBuffer names its groups to put again")
        try:
            for unit in actor_in.read_units():
                exp_out.write(self._with_advantages(unit))
        except BaseException as exc:
            if self._failure is None:
                self._failure = exc
            raise

    def _with_advantages(self, unit: Batch) -> Batch:
        """One put's rows with each group's GRPO advantages and returns."""
        scores = group_scores(unit[self.reward_key])
        advantage = torch.empty_like(scores)
        group = unit[GROUP]
        for g in range(int(group.max()) + 1):
            rows = (group == g).nonzero().flatten()
            advantage[rows] = grpo_group_advantage(scores[rows], epsilon=self.epsilon,
                                                   norm_by_std=self.norm_by_std)
        tokens = token_level_advantage(advantage, unit["response_mask"])
        out = {k: v for k, v in unit.items() if k != GROUP}
        out["advantages"], out["returns"] = tokens, tokens.clone()
        return out

    def _to_dataproto(self, batch: Batch, step: _Step, meta: dict[str, Any]) -> DataProto:
        tensors = {k: v for k, v in batch.items() if not k.startswith("_") and k != ROW}
        return DataProto.from_dict(tensors=tensors, non_tensors=step.non_tensors(batch[ROW]),
                                   meta_info=dict(meta))


def _check_schedule(schedule: Any, num_minibatches: int) -> None:
    """Raise ConfigError('schedule') unless ``schedule`` is None or feasible on-policy."""
    if schedule is None:
        return
    if not isinstance(schedule, Schedule):
        raise ConfigError("schedule", f"expected a Schedule or None, got {schedule!r}")
    try:
        feasible_space(mode="on_policy", num_minibatches=num_minibatches).check(schedule)
    except ScheduleError as e:
        raise ConfigError("schedule", str(e)) from None
