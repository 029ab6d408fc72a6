"""Conduit as verl's v1 pluggable replay buffer.

verl's v1 trainer asks its replay buffer for each step's batch in ``_step_once``::

    batch, metrics = replay_buffer.sample(global_steps=..., partition_id="train",
                                          batch_size=train_batch_size // parameter_sync_step)

and reads the trajectories of the returned ``KVBatchMeta`` keys from TransferQueue, where its
agent loop stores them as ``{uid}_{trajectory}_{index}``, beside a prompt key ``{uid}`` whose
tag carries the group's status. Select this class with (a file path to this module works too)::

    trainer.v1.sampler.custom_sampler.path=pkg://conduit.integrations.verl.replay
    trainer.v1.sampler.custom_sampler.name=ConduitReplayBuffer
    +trainer.v1.sampler.sampler_kwargs.group_size=<actor_rollout_ref.rollout.n>
    +trainer.v1.sampler.sampler_kwargs.mini_batch_size=<rows per mini-batch>

Each finished group goes through a Conduit on-policy plane: ingestion, once per group, checks
it and computes its GRPO advantage from the rollout's rewards (``rm_scores``); delivery lays
out the step's mini-batches in verl's order. The returned keys follow those mini-batches, and
each tag carries ``conduit_score`` and ``conduit_advantage`` (equal to what verl's
``compute_grpo_outcome_advantage`` gives that response). verl's ``_balance_batch`` reorders
keys across data-parallel ranks; set ``trainer.balance_batch=False`` to train in this order.
"""

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import transfer_queue as tq
from transfer_queue import KVBatchMeta

from conduit._checks import check_bool, check_int, check_key, check_real
from conduit.errors import (
    ConfigError,
    EmptyBufferError,
    PlaneClosedError,
)
from conduit.integrations.verl._checks import check_epsilon
from conduit.integrations.verl.replay_checks import GroupChecks
from conduit.integrations.verl.replay_evictions import GroupEvictor, merge_counts
from conduit.integrations.verl.replay_plane import StepPlane
from conduit.plane import ExperienceDataPlane

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConduitSamplerConfig:
    """``trainer.v1.sampler.sampler_kwargs`` of :class:`ConduitReplayBuffer`.

    Attributes:
        group_size: Responses per prompt (``actor_rollout_ref.rollout.n``).
        mini_batch_size: Rows per mini-batch (0: the whole step is one mini-batch).
        reward_key: Token-level reward field the rollout writes.
        epsilon: Added to each group's standard deviation: a finite number, > 0 when
            ``norm_adv_by_std_in_grpo`` (verl's default 1e-6).
        norm_adv_by_std_in_grpo: GRPO (True) or Dr. GRPO (False).
        placement: ``"auto"`` (Conduit decides from the topology) or None (CPU memory).
        poll_interval: Seconds between looks at TransferQueue while groups are running.
        timeout: Seconds ``sample`` waits for enough finished groups before raising.

    Raises:
        ConfigError: A value of the wrong type or out of range; the field is
            ``sampler_kwargs.<name>``.
    """

    group_size: int = 1
    mini_batch_size: int = 0
    reward_key: str = "rm_scores"
    epsilon: float = 1e-6
    norm_adv_by_std_in_grpo: bool = True
    placement: str | None = "auto"
    poll_interval: float = 0.5
    timeout: float = 3600.0

    def __post_init__(self) -> None:
        def name(f: str) -> str:
            return f"sampler_kwargs.{f}"

        checked = {
            "group_size": check_int(name("group_size"), self.group_size, minimum=1),
            "mini_batch_size": check_int(name("mini_batch_size"), self.mini_batch_size,
                                         minimum=0),
            "reward_key": check_key(name("reward_key"), self.reward_key),
            "norm_adv_by_std_in_grpo": check_bool(name("norm_adv_by_std_in_grpo"),
                                                  self.norm_adv_by_std_in_grpo),
            "poll_interval": check_real(name("poll_interval"), self.poll_interval,
                                        positive=True, what="a number of seconds"),
            "timeout": check_real(name("timeout"), self.timeout, positive=True,
                                  what="a number of seconds"),
        }
        checked["epsilon"] = check_epsilon(name("epsilon"), self.epsilon,
                                           norm_by_std=self.norm_adv_by_std_in_grpo)
        if self.placement not in (None, "auto"):
            raise ConfigError(name("placement"), f"must be 'auto' or null, got "
                                                 f"{self.placement!r}")
        for key, value in checked.items():  # plain Python values (a NumPy int as an int)
            object.__setattr__(self, key, value)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any] | None) -> "ConduitSamplerConfig":
        """Read verl's ``sampler_kwargs`` (a ``DictConfig`` or a dict).

        Raises:
            ConfigError: An unknown key, a value out of range, or no ``group_size`` (verl
                does not pass ``rollout.n`` to the buffer; guessing it would make every group
                of another size malformed, and evicted).
        """
        given = dict(kwargs.items()) if kwargs is not None else {}
        known = {f.name for f in fields(cls)}
        for key in given:
            if key not in known:
                raise ConfigError(f"sampler_kwargs.{key}", f"unknown; expected one of "
                                                           f"{sorted(known)}")
        if "group_size" not in given:
            raise ConfigError("sampler_kwargs.group_size", "required: set it to "
                                                           "actor_rollout_ref.rollout.n (+trainer"
                                                           ".v1.sampler.sampler_kwargs.group_size"
                                                           "=<rollout.n>)")
        return cls(**given)


class ConduitReplayBuffer:
    """verl's v1 replay buffer, with each step's groups passing through a Conduit plane.

    The constructor takes the keyword arguments verl's ``_build_replay_buffer`` passes to a
    custom sampler. It serves verl's ``sync`` trainer mode, where groups are on-policy and
    ``max_off_policy_threshold`` has no effect (as in verl's own sync buffer). Failed groups (a
    rollout that errored) are evicted and replaced through ``refill_fn``, as verl's async
    buffer does. A malformed finished group (trajectories other than ``group_size`` of them,
    an empty response, a ``response_mask`` that is not a bool or integer tensor of a token per
    position, a reward that is not token-level or not finite, or scores whose advantages
    overflow) is evicted and replaced the same way, as verl's buffer evicts the groups its
    filters reject: ``sample`` counts it in its metrics, warns about the first one (and
    logs each), and goes on with the other groups, so one bad group does not end a run.
    Keyword arguments a later verl adds are accepted and ignored. ``sample`` needs the
    rewards in TransferQueue when it runs, as verl's streaming reward loop writes them
    (rule-based rewards, or a reward model on its own resource pool).

    verl's multi-output agent loops (several outputs of one trajectory, keys
    ``{uid}_{trajectory}_{index}`` with ``index > 0``) give groups of varying size whose
    advantages verl takes from each trajectory's last output; such a group counts as malformed.

    Raises:
        ConfigError: ``sampler_kwargs`` is invalid, or the trainer mode is not ``sync``.
    """

    def __init__(self, *, trainer_mode: str, trainer_config: Any,
                 max_off_policy_threshold: int | None, max_off_policy_strategy: str,
                 sampler_kwargs: Mapping[str, Any] | None,
                 refill_fn: Callable[[int], int] | None = None, **_unused: Any) -> None:
        if trainer_mode != "sync":
            raise ConfigError("trainer.v1.trainer_mode", f"ConduitReplayBuffer is on-policy "
                                                         f"and runs under 'sync', got "
                                                         f"{trainer_mode!r}")
        self.trainer_mode, self.trainer_config = trainer_mode, trainer_config
        self.max_off_policy_strategy = max_off_policy_strategy
        self.config = ConduitSamplerConfig.from_kwargs(sampler_kwargs)
        self.poll_interval = self.config.poll_interval
        self._evictor = GroupEvictor(refill_fn, _log)
        self._checks = GroupChecks(self.config)
        self._steps = StepPlane(self.config)
        self._closed = False

    @property
    def refill_fn(self) -> Callable[[int], int] | None:
        """verl's callback that replaces evicted groups (None: no replacements)."""
        return self._evictor.refill_fn

    @refill_fn.setter
    def refill_fn(self, fn: Callable[[int], int] | None) -> None:
        self._evictor.refill_fn = fn

    @property
    def plane(self) -> ExperienceDataPlane | None:
        """The plane of the training partition (built by the first ``sample``)."""
        return self._steps.plane

    def get_sampleable_count(self, global_steps: int, partition_id: str) -> int:
        """Finished groups in ``partition_id`` (evicting failed ones first; they are counted
        in the metrics the next ``wait_for_sampleable`` or ``sample`` returns)."""
        metrics: dict = {}
        try:
            return len(self._evictor.finished(partition_id, metrics))
        finally:
            self._evictor.defer(metrics)

    def wait_for_sampleable(self, global_steps: int, partition_id: str, target_count: int, *,
                            timeout: float | None = None) -> tuple[set[str], dict]:
        """Wait until ``target_count`` groups are finished; returns their uids and metrics.

        The metrics count the groups evicted while waiting, and those evicted since the last
        returned metrics (by a call that raised, or by ``get_sampleable_count``): each
        eviction is reported once.

        Args:
            global_steps: The trainer's step (unused: groups are on-policy).
            partition_id: The TransferQueue partition.
            target_count: Finished groups to wait for.
            timeout: Seconds to wait at most (default ``sampler_kwargs.timeout``).

        Raises:
            EmptyBufferError: Not enough groups finished within the timeout (its evictions
                are reported by the next metrics).
            ConfigError: ``timeout`` is not a number >= 0.
        """
        limit = self.config.timeout if timeout is None else check_real(
            "timeout", timeout, positive=False, what="a number of seconds")
        deadline = time.monotonic() + limit
        metrics: dict = {}
        try:
            while True:
                finished = self._evictor.finished(partition_id, metrics)
                if len(finished) >= target_count:
                    merge_counts(metrics, self._evictor.take_unreported())
                    return set(finished), metrics
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EmptyBufferError(f"{len(finished)} of {target_count} groups "
                                           f"finished within {round(limit, 2)} s in partition "
                                           f"{partition_id!r}")
                time.sleep(min(self.config.poll_interval, left))
        except BaseException:
            self._evictor.defer(metrics)
            raise

    def sample(self, global_steps: int, partition_id: str, batch_size: int
               ) -> tuple[KVBatchMeta, dict]:
        """The ``batch_size`` oldest finished groups, keys in Conduit's mini-batch order.

        Every chosen group is checked before any of it enters the plane. A malformed one
        (see the class) is evicted from TransferQueue (its prompt and trajectory keys;
        counted in the metrics as ``{training,validation}/conduit/evicted_malformed``) and
        the call goes on: on ``train`` it is replaced through ``refill_fn`` and the call
        chooses again among the finished groups (the fine ones are chosen again), waiting
        for enough of them within the same deadline; on a validation partition, where no
        replacement comes, the batch goes on without it, as verl's buffer returns a
        validation batch without the trajectories a group lacks. The first group a buffer
        evicts is warned about (``RuntimeWarning``); each is logged. If the plane fails once
        rows were pushed, it is closed and the next call builds a fresh one. The groups are
        chosen from the listing that counted them; if some left the pool meanwhile (another
        consumer), it waits for more, within the same ``sampler_kwargs.timeout`` (one
        deadline for the whole call). Evictions of a call that raises are counted in the
        next metrics returned.

        Raises:
            ConfigError: ``batch_size`` is not a positive integer, or differs from the
                earlier steps'.
            EmptyBufferError: Not enough well-formed groups finished within
                ``sampler_kwargs.timeout`` (the message counts the malformed ones evicted
                meanwhile), or every chosen group of a validation partition was malformed.
            PlaneClosedError: The buffer was closed.
        """
        if self._closed:
            raise PlaneClosedError("the ConduitReplayBuffer is closed; build a new one")
        batch_size = check_int("batch_size", batch_size, minimum=1)
        metrics: dict = {}
        try:
            return self._sample(global_steps, partition_id, batch_size, metrics)
        except BaseException:
            self._evictor.defer(metrics)  # reported by the next metrics returned
            raise

    def _sample(self, global_steps: int, partition_id: str, batch_size: int, metrics: dict
                ) -> tuple[KVBatchMeta, dict]:
        """:meth:`sample`, counting evictions in ``metrics`` as it goes."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.config.timeout
        train = partition_id == "train"
        while True:
            listing, chosen = self._choose(global_steps, partition_id, batch_size, deadline,
                                           metrics)
            keys, tags = self._trajectories(listing, chosen)
            bad = self._checks.miscounted(keys, chosen, exact=train)
            if not bad and train:
                mask, reward = self._checks.read(keys, partition_id)
                bad = self._checks.bad_layout(keys, chosen, mask, reward, partition_id)
                if not bad:
                    scores = reward.sum(dim=-1).to(torch.float32)
                    bad = self._checks.bad_rows(keys, mask, scores)
            if not bad:
                break
            self._evictor.evict_malformed(bad, partition_id, metrics)
            if not train:  # no replacement comes: the batch goes on without them, as verl's
                chosen = [u for u in chosen if u not in bad]
                if not chosen:
                    raise EmptyBufferError(f"every chosen group of partition {partition_id!r} "
                                           f"was malformed, and evicted")
                kept = [i for i, k in enumerate(keys) if k.split("_")[0] not in bad]
                keys, tags = [keys[i] for i in kept], [tags[i] for i in kept]
                break
        if not train:
            tq.kv_clear(keys=chosen, partition_id=partition_id)
            return KVBatchMeta(partition_id=partition_id, keys=keys, tags=tags), metrics
        order = self._steps.run(mask, scores, tags, batch_size)
        tq.kv_clear(keys=chosen, partition_id=partition_id)  # the groups leave the pool
        prefix = "training/conduit"
        metrics.update({f"{prefix}/score_mean": float(scores.mean()),
                        f"{prefix}/sample_s": time.perf_counter() - t0})
        return KVBatchMeta(partition_id=partition_id, keys=[keys[i] for i in order],
                           tags=[tags[i] for i in order]), metrics

    def _choose(self, global_steps: int, partition_id: str, batch_size: int, deadline: float,
                metrics: dict) -> tuple[Mapping[str, Mapping[str, Any]], list[str]]:
        """The listing of ``partition_id`` and the ``batch_size`` oldest finished groups in
        it, waiting for them until ``deadline`` (``time.monotonic()``).

        Raises:
            EmptyBufferError: Not enough groups finished by ``deadline``.
        """
        while True:
            left = max(0.0, deadline - time.monotonic())
            try:
                _, waited = self.wait_for_sampleable(global_steps, partition_id, batch_size,
                                                     timeout=left)
            except EmptyBufferError as e:
                name = (f"{'training' if partition_id == 'train' else 'validation'}"
                        f"/conduit/evicted_malformed")
                evicted = (f"; {metrics[name]} malformed group(s) were evicted meanwhile"
                           if metrics.get(name) else "")
                raise EmptyBufferError(f"{e} (sample waits sampler_kwargs.timeout="
                                       f"{self.config.timeout} s in all{evicted})") from None
            merge_counts(metrics, waited)
            listing = tq.kv_list(partition_id).get(partition_id, {})
            finished = self._evictor.finished(partition_id, metrics, listing=listing)
            if len(finished) >= batch_size:
                return listing, sorted(finished, key=lambda u: (finished[u], u))[:batch_size]

    def close(self) -> None:
        """Stop the plane's workers; a later ``sample`` raises
        :class:`~conduit.errors.PlaneClosedError`. Idempotent."""
        self._closed = True
        if self._steps.plane is not None:
            self._steps.plane.close()

    @staticmethod
    def _trajectories(listing: Mapping[str, Mapping[str, Any]], chosen: list[str]
                      ) -> tuple[list[str], list[dict]]:
        """The chosen groups' trajectory keys, group by group, ordered by trajectory and index."""
        rank = {u: i for i, u in enumerate(chosen)}
        found = [k for k, tag in listing.items()
                 if not tag.get("is_prompt", False) and k.split("_")[0] in rank]

        def position(key: str) -> tuple[int, ...]:
            uid, *rest = key.split("_")
            return (rank[uid], *(int(r) if r.isdigit() else 0 for r in rest))

        keys = sorted(found, key=position)
        return keys, [dict(listing[k]) for k in keys]
