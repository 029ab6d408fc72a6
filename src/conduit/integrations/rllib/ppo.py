"""PPO's mini-batch path through a Conduit on-policy plane.

After the learner connector (GAE), RLlib's ``Learner.update`` cuts the train batch into
mini-batches with ``MiniBatchCyclicIterator`` and runs one update per mini-batch.
:class:`ConduitPPOTorchLearner` hands the post-GAE batch to an on-policy plane instead; the
plane delivers the mini-batches one delivery invocation each (``g_del = 1/M``), on a
background worker while the learner updates on the previous one where that worker has a core
the update does not compute on (:func:`delivery_overlaps`), else on the learner's thread.

Which rows form each mini-batch is RLlib's: :func:`cyclic_minibatches` replays the cyclic
iterator's slicing and its per-epoch shuffles (drawn from NumPy's global generator, as
``SampleBatch.shuffle`` draws them), so for a seed the learner sees the same mini-batches,
element for element. Batches a plane cannot hold (a column of a dtype its specs refuse, or
no tensor column at all) go through RLlib's own iterator instead.
"""

from __future__ import annotations

import keyword
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

import numpy as np
import torch
import tree
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator

from conduit import ExperienceDataPlane, ExperienceSpec, FieldSpec, Schedule
from conduit._checks import check_int
from conduit.errors import ConfigError, EmptyBufferError, SpecError
from conduit.scheduling import MAX_MINIBATCHES, spare_core
from conduit.storage import ColumnStore, GatherOutputs, Placement, SampleInfo, Sampler


def cyclic_minibatches(size: int, *, num_epochs: int, minibatch_size: int,
                       shuffle: bool) -> list[np.ndarray]:
    """The row indices of each mini-batch RLlib's ``MiniBatchCyclicIterator`` yields over a
    batch of ``size`` rows: consecutive slices of ``minibatch_size`` rows that wrap around the
    batch, ``num_epochs`` wraps in all, the batch shuffled at every wrap (including the last)
    with ``np.random.permutation``. Empty for ``num_epochs`` below 1.

    Raises:
        ConfigError: ``num_epochs`` is at least 1 and ``size`` or ``minibatch_size`` is below 1
            (no slice would ever complete an epoch).
    """
    if num_epochs < 1:
        return []
    check_int("size", size, minimum=1)
    check_int("minibatch_size", minibatch_size, minimum=1)
    order = np.arange(size)
    start, covered, out = 0, 0, []
    while covered < num_epochs:
        need, parts = minibatch_size, []
        while start + need >= size:
            parts.append(order[start:])
            need -= size - start
            start, covered = 0, covered + 1
            if shuffle:
                order = order[np.random.permutation(size)]
        if need > 0:
            parts.append(order[start:start + need])
            start += need
        out.append(np.concatenate(parts))
    return out


def plane_epoch(count: int, *, size: int, minibatch_size: int) -> int:
    """Mini-batches per plane epoch for ``count`` planned mini-batches of a ``size``-row batch.

    A plane's "epochs" only group its deliveries: :class:`PlannedSampler` hands out the
    planned mini-batches in order whatever the grouping, so any ``M`` that divides ``count``
    delivers the same data. The plane takes ``M`` up to ``size`` (rows per iteration) and
    :data:`~conduit.scheduling.MAX_MINIBATCHES`. Where ``minibatch_size`` divides the batch,
    ``M`` is RLlib's own epoch (``size // minibatch_size``) if that is within those limits;
    else (RLlib's epochs do not fall on mini-batch boundaries, so each wrap would have no
    whole mini-batches of its own) the largest divisor of ``count`` within them, down to one
    mini-batch per plane epoch. So every layout RLlib's iterator cuts keeps the plane path,
    in one plane iteration (the batch is pushed once, rather than once per iteration of a
    pass split over several), and the mini-batches stay RLlib's.
    """
    limit = min(size, MAX_MINIBATCHES)
    if size % minibatch_size == 0 and size // minibatch_size <= limit:
        return size // minibatch_size
    return next(m for m in range(min(count, limit), 0, -1) if count % m == 0)


class PlannedSampler(Sampler):
    """A consume-once sampler that delivers mini-batches fixed in advance.

    Args:
        parts: Row indices of every mini-batch, in delivery order.
        num_minibatches: Mini-batches per epoch (``len(parts)`` must be a multiple of it).
    """

    consume_once: ClassVar[bool] = True

    def __init__(self, parts: list[np.ndarray], *, num_minibatches: int) -> None:
        super().__init__()
        if not parts or len(parts) % num_minibatches:
            raise ConfigError("num_minibatches", f"{len(parts)} mini-batches do not form "
                                                 f"epochs of {num_minibatches}")
        self.parts = [torch.from_numpy(np.ascontiguousarray(p, dtype=np.int64)) for p in parts]
        self.num_minibatches = num_minibatches
        self.epoch, self.cursor = 0, 0

    def layout(self, size: int, *, iteration: int, epoch: int) -> list[torch.Tensor]:
        """The mini-batches of ``epoch``."""
        m = self.num_minibatches
        return self.parts[epoch * m:(epoch + 1) * m]

    def begin_epoch(self, size: int, *, iteration: int, epoch: int) -> None:
        self.epoch, self.cursor = epoch, 0

    def seek(self, position: int) -> None:
        self.cursor = position

    def sample(self, size: int, batch_size: int = 0) -> SampleInfo:
        part = self.layout(size, iteration=0, epoch=self.epoch)
        if self.cursor >= len(part):
            raise EmptyBufferError("the epoch's mini-batches are all delivered")
        self.cursor += 1
        return SampleInfo(part[self.cursor - 1])


def _spec(columns: dict[str, torch.Tensor]) -> ExperienceSpec:
    return ExperienceSpec(fields={k: FieldSpec(tuple(v.shape[1:]), v.dtype)
                                  for k, v in columns.items()})


@dataclass
class _Columns:
    """Kept column memory: one ``[rows, *shape]`` tensor per field of ``spec``, and the
    memory its stores' host gathers land in."""

    spec: ExperienceSpec
    device: torch.device
    tensors: dict[str, torch.Tensor]
    outputs: GatherOutputs

    @property
    def rows(self) -> int:
        return int(next(iter(self.tensors.values())).shape[0])

    def store(self, rows: int) -> ColumnStore:
        """A store over the first ``rows`` rows."""
        return ColumnStore.over(spec=self.spec,
                                columns={k: v[:rows] for k, v in self.tensors.items()},
                                outputs=self.outputs)


class ColumnCache:
    """Column memory for an update's plane, kept for the next update with the same fields.

    An update's plane holds the whole train batch; for image batches, allocating its columns
    and faulting their pages in is a large part of the plane's cost. RLlib's train batches
    differ by a few rows from one update to the next, so the columns are kept (with an eighth
    more rows than asked for, and made anew when a batch has more) and each plane's store is
    the first rows of them (:meth:`~conduit.storage.ColumnStore.over`). So is the memory its
    mini-batches are gathered into, a set at a time once the learner holds none of its
    tensors. One plane uses them at a time: an iterator takes them, and gives them back once
    its plane is closed.
    """

    def __init__(self) -> None:
        self._kept: _Columns | None = None

    def take(self, spec: ExperienceSpec, rows: int, device: torch.device) -> _Columns:
        """Columns for ``rows`` rows of ``spec`` on ``device``: the kept ones where they fit
        (no longer kept until :meth:`give_back`), else new ones."""
        kept, self._kept = self._kept, None
        if kept is None or kept.spec != spec or kept.device != device or kept.rows < rows:
            kept = None  # the old memory goes before the new is made
            kept = _Columns(spec, device, {
                name: torch.empty((rows + rows // 8, *fs.shape), dtype=fs.dtype, device=device)
                for name, fs in spec.fields.items()}, GatherOutputs(spec.fields))
        return kept

    def give_back(self, columns: _Columns) -> None:
        """Keep ``columns``, whose plane is closed, for the next update."""
        self._kept = columns


class ConduitMiniBatchIterator:
    """Mini-batches of one module's train batch, delivered by a Conduit on-policy plane in
    the order :func:`cyclic_minibatches` gives.

    Tensor columns with one row per timestep live in the plane; other columns (if any) are
    indexed with each mini-batch's rows, nested ones (a Dict or Tuple space's) leaf by leaf.
    The plane groups the mini-batches into epochs of :func:`plane_epoch` (RLlib's epochs where
    ``minibatch_size`` divides the batch).

    A batch the plane cannot hold (a plane column of a dtype :class:`~conduit.FieldSpec`
    refuses, such as ``uint16``, or no plane column at all) is cut by RLlib's own
    ``MiniBatchCyclicIterator`` instead: that is decided here, before any shuffle is drawn,
    so the mini-batches (and NumPy's global generator) are RLlib's either way. Falling back
    rather than keeping such columns outside the plane: torch cannot gather rows of those
    dtypes for every shape, and RLlib's iterator only slices and concatenates them.

    Args:
        batch: The post-connector train batch (one module).
        num_epochs: RLlib's ``num_epochs``.
        minibatch_size: RLlib's ``minibatch_size``.
        shuffle: RLlib's ``shuffle_batch_per_epoch`` (with ``num_epochs > 1``).
        device: Where the learner trains (the plane's rows and batches live there).
        overlap: Deliver on a background worker, ahead of the learner.
        columns: Where the plane's columns come from and go back to, so that updates
            share their memory (default: columns of its own).

    With ``num_epochs`` below 1 it yields no mini-batches, as RLlib's iterator.

    Raises:
        SpecError: The module's batch is empty (``field`` None; RLlib's iterator raises
            ``ValueError`` there, which this error also is).
        ConfigError: ``minibatch_size`` is below 1.
    """

    def __init__(self, batch: MultiAgentBatch, *, num_epochs: int, minibatch_size: int,
                 shuffle: bool, device: torch.device, overlap: bool = True,
                 columns: ColumnCache | None = None) -> None:
        ((self.module_id, self.rows),) = batch.policy_batches.items()
        self.env_steps = len(batch)
        size = len(self.rows)
        self.device, self.overlap = torch.device(device), overlap
        self.columns = columns
        self.spec: ExperienceSpec | None = None
        self.rllib: MiniBatchCyclicIterator | None = None
        self.parts: list[np.ndarray] = []
        self.num_minibatches = 0
        if num_epochs < 1:
            return  # nothing to deliver
        if size == 0:
            raise SpecError(None, f"the batch of module {self.module_id!r} is empty: no "
                                  f"mini-batch of it would ever complete an epoch")
        check_int("minibatch_size", minibatch_size, minimum=1)
        try:
            self.spec = _spec({k: v for k, v in self.rows.items() if _plane_column(k, v, size)})
        except ConfigError:
            self.rllib = MiniBatchCyclicIterator(batch, num_epochs=num_epochs,
                                                 minibatch_size=minibatch_size,
                                                 shuffle_batch_per_epoch=shuffle)
            return
        self.parts = cyclic_minibatches(size, num_epochs=num_epochs,
                                        minibatch_size=minibatch_size, shuffle=shuffle)
        self.num_minibatches = plane_epoch(len(self.parts), size=size,
                                           minibatch_size=minibatch_size)

    def __iter__(self) -> Iterator[MultiAgentBatch]:
        if self.spec is None:  # RLlib's path, or no epochs
            if self.rllib is not None:
                yield from self.rllib
            return
        size = len(self.rows)
        spec = self.spec
        cols = {k: v for k, v in self.rows.items() if k in spec.fields}
        rest = {k: v for k, v in self.rows.items() if k not in cols}
        m = self.num_minibatches
        kept = self.columns.take(spec, size, self.device) if self.columns is not None else None
        store = kept.store(size) if kept is not None else None
        try:
            plane = ExperienceDataPlane(
                spec=spec, capacity=size, mode="on_policy", num_minibatches=m,
                num_epochs=len(self.parts) // m, learner_device=self.device,
                sampler=PlannedSampler(self.parts, num_minibatches=m), store=store,
                placement=(store.placement if store is not None else
                           Placement.device(self.device) if self.device.type == "cuda"
                           else None),
                schedule=Schedule(0, 1, int(self.overlap), Fraction(1, m)))
            with plane:
                plane.push(cols)
                for minibatch in plane.minibatches():
                    index = minibatch.pop("_index")
                    out = {**minibatch, **{k: _take(v, index, size) for k, v in rest.items()}}
                    yield MultiAgentBatch({self.module_id: SampleBatch(out)}, self.env_steps)
        finally:
            if kept is not None:
                self.columns.give_back(kept)  # the plane is closed: nothing writes them


def _plane_column(name: str, column: object, size: int) -> bool:
    """Whether a column can be a plane field: a tensor with one row per timestep, under a
    name a spec accepts."""
    return (isinstance(column, torch.Tensor) and column.dim() > 0 and len(column) == size
            and name.isidentifier() and not name.startswith("_") and not keyword.iskeyword(name))


def _take(column: object, index: torch.Tensor, size: int) -> object:
    """A mini-batch's rows of a column kept outside the plane (others pass as they are).

    A nested column (a Dict or Tuple space's dict or tuple of arrays) is cut leaf by leaf
    with the same rows, as RLlib's iterator slices and concatenates every leaf.
    """
    if isinstance(column, (dict, tuple)):
        return tree.map_structure(lambda leaf: _take_leaf(leaf, index, size), column)
    return _take_leaf(column, index, size)


def _take_leaf(column: object, index: torch.Tensor, size: int) -> object:
    """:func:`_take` for a column that is not nested."""
    if isinstance(column, torch.Tensor):
        return column[index.to(column.device)] if column.dim() and len(column) == size \
            else column
    array = np.asarray(column)
    return array[index.numpy()] if array.ndim and len(array) == size else column


def delivery_overlaps(setting: bool | None, device: torch.device) -> bool:
    """Whether the plane delivers mini-batches on a background worker: ``setting``, or for
    None, where the worker has a core the update does not compute on
    (:func:`~conduit.scheduling.spare_core`: an update on an accelerator, or fewer torch
    threads than cores)."""
    if setting is not None:
        return bool(setting)
    return spare_core(cores=os.cpu_count() or 1, compute_threads=torch.get_num_threads(),
                      accelerator=device.type != "cpu")


class ConduitPPOTorchLearner(PPOTorchLearner):
    """RLlib's ``PPOTorchLearner`` with Conduit delivering its mini-batches.

    Usage: ``config.learners(learner_class=ConduitPPOTorchLearner)``. Epochs, shuffling and
    mini-batch sizes are RLlib's (without ``minibatch_size``, ``num_epochs > 1`` cuts
    mini-batches of the batch's env steps, ``batch.count``, as RLlib's ``Learner`` does,
    whatever rows the module's batch has). Batches RLlib itself would not cut into
    mini-batches (one epoch without ``minibatch_size``), multi-module batches, recurrent
    modules and data iterators take RLlib's own path; so do batches a plane cannot hold
    (:class:`ConduitMiniBatchIterator`). Updates share their planes' column memory
    (:class:`ColumnCache`).
    """

    #: Deliver mini-batches on a background worker, ahead of the update (True), on the
    #: learner's thread (False), or, with None, where :func:`delivery_overlaps` finds the
    #: worker a core of its own.
    overlap: ClassVar[bool | None] = None

    def _column_cache(self) -> ColumnCache:
        """This learner's :class:`ColumnCache` (plane memory kept between updates)."""
        cache = self.__dict__.get("_conduit_columns")
        if cache is None:
            cache = self.__dict__["_conduit_columns"] = ColumnCache()
        return cache

    def _create_iterator_if_necessary(self, *, training_data: TrainingData,
                                      num_total_minibatches: int = 0, num_epochs: int = 1,
                                      minibatch_size: int | None = None,
                                      shuffle_batch_per_epoch: bool = False, **kwargs: Any
                                      ) -> Iterable[MultiAgentBatch]:
        plain = (not training_data.data_iterators and not num_total_minibatches
                 and (minibatch_size or num_epochs > 1))
        if plain:
            batch = self._make_batch_if_necessary(training_data=training_data)
            for module_id in list(batch.policy_batches):
                if not self.should_module_be_updated(module_id, batch):
                    del batch.policy_batches[module_id]
            if not batch.policy_batches:
                return {}
            ((module_id, rows),) = list(batch.policy_batches.items())[:1]
            if (len(batch.policy_batches) == 1 and not self.module[module_id].is_stateful()
                    and rows.get("seq_lens") is None):
                return ConduitMiniBatchIterator(
                    batch, num_epochs=num_epochs, minibatch_size=minibatch_size or batch.count,
                    shuffle=shuffle_batch_per_epoch and num_epochs > 1, device=self.device,
                    overlap=delivery_overlaps(self.overlap, torch.device(self.device)),
                    columns=self._column_cache())
            training_data = TrainingData(batch=batch)
        return super()._create_iterator_if_necessary(
            training_data=training_data, num_total_minibatches=num_total_minibatches,
            num_epochs=num_epochs, minibatch_size=minibatch_size,
            shuffle_batch_per_epoch=shuffle_batch_per_epoch, **kwargs)
