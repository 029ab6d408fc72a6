"""PPO's mini-batch path through a Conduit on-policy plane.

After the learner connector (GAE), RLlib's ``Learner.update`` cuts the train batch into
mini-batches with ``MiniBatchCyclicIterator`` and runs one update per mini-batch.
:class:`ConduitPPOTorchLearner` hands the post-GAE batch to an on-policy plane instead; the
plane delivers the mini-batches one delivery invocation each (``g_del = 1/M``), on a
background worker while the learner updates on the previous one where that worker has a core
the update does not compute on (:func:`delivery_overlaps`), else on the learner's thread.

Which rows form each mini-batch is RLlib's: :class:`CyclicLayout` replays the cyclic
iterator's slicing, its stop rule and its shuffles, each drawn from NumPy's global generator
on the learner's thread at the point RLlib's iterator draws it (``SampleBatch.shuffle`` at an
epoch's wrap, while the mini-batch that reaches the wrap is cut). So for a seed the learner
sees the same mini-batches, element for element, and the update's own draws from that
generator (a loss with NumPy noise) get the same numbers as under RLlib. The worker runs
ahead only over mini-batches laid out already, up to the next wrap's shuffle. Batches whose
mini-batches a plane cannot reproduce (a column of a dtype its specs refuse, a column that is
not one row per timestep, a tensor that requires grad, or no tensor column at all) go
through RLlib's own iterator instead.
"""

from __future__ import annotations

import keyword
from collections.abc import Iterable, Iterator, Sequence
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
from conduit.integrations.rllib.schedule import worker_has_core
from conduit.plane.onpolicy import OnPolicyFlow
from conduit.scheduling import MAX_MINIBATCHES
from conduit.storage import ColumnStore, GatherOutputs, Placement, SampleInfo, Sampler


class CyclicLayout:
    """The row indices of each mini-batch RLlib's ``MiniBatchCyclicIterator`` yields over a
    batch of ``size`` rows, laid out as an iteration over them reaches them.

    The mini-batches are consecutive slices of ``minibatch_size`` rows that wrap around the
    batch; with ``shuffle`` the batch is permuted at every wrap (the last one included) with
    ``np.random.permutation`` from NumPy's global generator, as ``SampleBatch.shuffle``
    permutes it. The iteration stops as RLlib's does: after ``num_total_minibatches``
    mini-batches where that is above 0 (epochs then do not count, whole or not), else once
    ``num_epochs`` wraps are complete.

    Every permutation is drawn by :meth:`reach` of the mini-batch during whose cutting RLlib's
    iterator draws it (the one that reaches the wrap), so draws made between two mini-batches
    interleave with the shuffles exactly as under RLlib. :attr:`parts` holds the mini-batches
    laid out so far: every one reached, and those after them that need no permutation not
    drawn yet (up to the next wrap's shuffle), which a plane may deliver ahead.

    Args:
        size: Rows of the batch.
        num_epochs: RLlib's ``num_epochs``.
        minibatch_size: RLlib's ``minibatch_size``.
        shuffle: Permute the batch at every wrap (RLlib's ``shuffle_batch_per_epoch``).
        num_total_minibatches: RLlib's ``num_total_minibatches`` (0: stop by epochs).

    Raises:
        ConfigError: ``num_total_minibatches`` is not an integer of at least 0; or there are
            mini-batches to cut and ``size`` or ``minibatch_size`` is below 1 (no slice would
            ever complete an epoch).
    """

    def __init__(self, size: int, *, num_epochs: int, minibatch_size: int, shuffle: bool,
                 num_total_minibatches: int = 0) -> None:
        total = check_int("num_total_minibatches", num_total_minibatches, minimum=0)
        #: Mini-batches of the iteration, in all.
        self.count = 0
        #: Row indices (``int64``) of the mini-batches laid out so far, in order.
        self.parts: list[np.ndarray] = []
        #: Mini-batches reached so far (their permutations are drawn).
        self.reached = 0
        self._size, self._step, self._shuffle = size, minibatch_size, shuffle
        if total or num_epochs >= 1:
            check_int("size", size, minimum=1)
            check_int("minibatch_size", minibatch_size, minimum=1)
            # RLlib counts a wrap when a slice reaches the batch's end: after k mini-batches
            # floor(k * minibatch_size / size) epochs are complete.
            self.count = total or -(-num_epochs * size // minibatch_size)
        self._order = np.arange(max(size, 0), dtype=np.int64)
        self._start = 0
        self._owed = False  # the last part laid out ends at a wrap whose shuffle is not drawn
        self._lay_ahead()

    def reach(self, k: int) -> np.ndarray:
        """Mini-batch ``k``, as RLlib's iterator cuts it when asked for its next mini-batch.

        The permutations RLlib draws while cutting it are drawn now (none, one, or one per
        wrap it reaches), and the mini-batches after it that need no further draw are laid
        out (:attr:`parts`).

        Raises:
            ConfigError: ``k`` is not the next mini-batch (:attr:`reached`) or is past the
                last (``field`` ``k``).
        """
        if k != self.reached or k >= self.count:
            raise ConfigError("k", f"mini-batches are reached in order, one at a time: the "
                                   f"next is {self.reached} of {self.count}, got {k}")
        if k < len(self.parts):
            if self._owed and k == len(self.parts) - 1:
                self._draw()
                self._owed = False
        else:
            self.parts.append(self._cut())
        self.reached += 1
        self._lay_ahead()
        return self.parts[k]

    def extend(self) -> None:
        """Count one more mini-batch: the iteration goes on cutting the batch cyclically."""
        self.count += 1
        self._lay_ahead()

    def _draw(self) -> None:
        """Permute the batch's rows as ``SampleBatch.shuffle`` does at a wrap."""
        self._order = self._order[np.random.permutation(self._size)]

    def _cut(self) -> np.ndarray:
        """The next mini-batch, drawing the shuffle of every wrap it reaches (RLlib's loop:
        a slice that reaches the batch's end wraps, even one that ends there)."""
        size, need, start, pieces = self._size, self._step, self._start, []
        while start + need >= size:
            pieces.append(self._order[start:])
            need -= size - start
            start = 0
            if self._shuffle:
                self._draw()
        if need > 0:
            pieces.append(self._order[start:start + need])
            start += need
        self._start = start
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _lay_ahead(self) -> None:
        """Lay out the mini-batches that need no shuffle not drawn yet: up to the one that
        ends at the next wrap (its shuffle is owed until it is reached), or up to the one
        before a mini-batch that runs past a wrap."""
        while not self._owed and len(self.parts) < self.count:
            end = self._start + self._step
            if self._shuffle and end > self._size:
                return  # its rows after the wrap follow the wrap's shuffle
            if self._shuffle and end == self._size:
                self.parts.append(self._order[self._start:])
                self._start, self._owed = 0, True
                return
            self.parts.append(self._cut())


def cyclic_minibatches(size: int, *, num_epochs: int, minibatch_size: int, shuffle: bool,
                       num_total_minibatches: int = 0) -> list[np.ndarray]:
    """The row indices of every mini-batch RLlib's ``MiniBatchCyclicIterator`` yields over a
    batch of ``size`` rows (:class:`CyclicLayout`), with every shuffle drawn now, one after
    another. Empty for ``num_epochs`` below 1 without ``num_total_minibatches``.

    Raises:
        ConfigError: As :class:`CyclicLayout`.
    """
    layout = CyclicLayout(size, num_epochs=num_epochs, minibatch_size=minibatch_size,
                          shuffle=shuffle, num_total_minibatches=num_total_minibatches)
    return [layout.reach(k) for k in range(layout.count)]


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
    pass split over several), and the mini-batches stay RLlib's. (With RLlib's
    ``num_total_minibatches``, ``count`` need not be whole epochs of RLlib's; then the divisor
    rule applies too.)
    """
    limit = min(size, MAX_MINIBATCHES)
    epoch = size // minibatch_size
    if size % minibatch_size == 0 and epoch <= limit and count % epoch == 0:
        return epoch
    return next(m for m in range(min(count, limit), 0, -1) if count % m == 0)


class PlannedSampler(Sampler):
    """A consume-once sampler that delivers mini-batches laid out by its owner.

    Args:
        parts: Row indices of the mini-batches, in delivery order. With ``count``, those laid
            out so far: the owner appends the others to this same sequence, in order, before
            the plane draws them (a :class:`CyclicLayout`'s ``parts``).
        num_minibatches: Mini-batches per epoch (``count`` must be a multiple of it).
        count: Mini-batches in all (default: ``len(parts)`` after ``first``).
        first: Index in ``parts`` of the first mini-batch delivered.

    Raises:
        ConfigError: ``count`` is not a positive multiple of ``num_minibatches``.
    """

    consume_once: ClassVar[bool] = True

    def __init__(self, parts: Sequence[np.ndarray], *, num_minibatches: int,
                 count: int | None = None, first: int = 0) -> None:
        super().__init__()
        count = len(parts) - first if count is None else count
        if count < 1 or count % num_minibatches:
            raise ConfigError("num_minibatches", f"{count} mini-batches do not form "
                                                 f"epochs of {num_minibatches}")
        self.parts = parts
        self.count, self.first = count, first
        self.num_minibatches = num_minibatches
        self.epoch, self.cursor = 0, 0

    def layout(self, size: int, *, iteration: int, epoch: int) -> list[torch.Tensor]:
        """The mini-batches of ``epoch`` laid out so far."""
        m, first = self.num_minibatches, self.first
        return [_indices(p) for p in self.parts[first + epoch * m:first + (epoch + 1) * m]]

    def begin_epoch(self, size: int, *, iteration: int, epoch: int) -> None:
        self.epoch, self.cursor = epoch, 0

    def seek(self, position: int) -> None:
        self.cursor = position

    def sample(self, size: int, batch_size: int = 0) -> SampleInfo:
        """The epoch's next mini-batch.

        Raises:
            EmptyBufferError: The epoch's mini-batches are all delivered, or the next one is
                not laid out yet.
        """
        k = self.epoch * self.num_minibatches + self.cursor
        if self.cursor >= self.num_minibatches or k >= self.count:
            raise EmptyBufferError("the epoch's mini-batches are all delivered")
        k += self.first
        if k >= len(self.parts):
            raise EmptyBufferError(f"mini-batch {k} is drawn before it is laid out")
        self.cursor += 1
        return SampleInfo(_indices(self.parts[k]))


def _indices(part: np.ndarray) -> torch.Tensor:
    """A mini-batch's row indices as the plane draws them (``int64``, shared where they are
    already)."""
    return torch.from_numpy(np.ascontiguousarray(part, dtype=np.int64))


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
    the order and with the shuffles of RLlib's ``MiniBatchCyclicIterator``
    (:class:`CyclicLayout`).

    Tensor columns with one row per timestep live in the plane; other columns (if any) are
    indexed with each mini-batch's rows, nested ones (a Dict or Tuple space's) leaf by leaf.
    The plane groups the mini-batches into epochs of :func:`plane_epoch` (RLlib's epochs where
    ``minibatch_size`` divides the batch and they are whole).

    Each wrap's shuffle is drawn from NumPy's global generator on the iterating thread when
    the iteration asks for the mini-batch that reaches the wrap, as RLlib's iterator draws it,
    so the consumer's own draws between mini-batches see the numbers they see under RLlib.
    With ``overlap`` the plane's worker delivers the mini-batches laid out already ahead of
    the consumer; where its look-ahead (:attr:`OnPolicyFlow.MOST_STAGED` mini-batches) would
    reach one whose rows follow a shuffle not drawn yet, delivery runs on the consumer's thread
    until that shuffle is drawn (``set_schedule``).

    A batch whose mini-batches the plane would not give as RLlib's iterator does is cut by
    that iterator instead: a plane column of a dtype :class:`~conduit.FieldSpec` refuses (such
    as ``uint16``: torch cannot gather rows of those dtypes for every shape, where RLlib's
    iterator only slices and concatenates them), a column (or a leaf of a nested one) that is
    neither a tensor nor a NumPy array with one row per row of the batch (RLlib slices every
    column, keeps a list column such as ``infos`` a list, and leaves it out of its shuffles),
    a tensor that requires grad (RLlib's slices keep the autograd graph; the plane's rows are
    copies), or no plane column at all. That is decided here, before any shuffle is drawn.

    Args:
        batch: The post-connector train batch (one module).
        num_epochs: RLlib's ``num_epochs``.
        minibatch_size: RLlib's ``minibatch_size``.
        shuffle: RLlib's ``shuffle_batch_per_epoch`` (with ``num_epochs > 1``).
        device: Where the learner trains (the plane's rows and batches live there).
        overlap: Deliver on a background worker, ahead of the learner.
        columns: Where the plane's columns come from and go back to, so that updates
            share their memory (default: columns of its own).
        num_total_minibatches: RLlib's ``num_total_minibatches``: above 0, exactly that many
            mini-batches, cycling over the batch whatever ``num_epochs`` is (RLlib's
            ``LearnerGroup`` sets it for every learner of several).

    Without ``num_total_minibatches`` and with ``num_epochs`` below 1 it yields no
    mini-batches, as RLlib's iterator. Iterating it again once it has run yields nothing, as
    RLlib's iterator. An iteration abandoned part-way (its consumer stops asking, as a
    ``break`` does) is taken up where it stopped, as RLlib's iterator takes it up: the next
    iteration yields the mini-batches not handed out yet, on a plane of its own. RLlib's
    iterator counts a mini-batch towards ``num_total_minibatches`` only once the next one is
    asked for, so with ``num_total_minibatches`` each abandoned iteration adds one mini-batch,
    here as there.

    Raises:
        SpecError: The module's batch is empty and there are mini-batches to cut (``field``
            None; RLlib's iterator raises ``ValueError`` there, which this error also is).
        ConfigError: ``minibatch_size`` is below 1, or ``num_total_minibatches`` below 0.
    """

    def __init__(self, batch: MultiAgentBatch, *, num_epochs: int, minibatch_size: int,
                 shuffle: bool, device: torch.device, overlap: bool = True,
                 columns: ColumnCache | None = None, num_total_minibatches: int = 0) -> None:
        ((self.module_id, self.rows),) = batch.policy_batches.items()
        self.env_steps = len(batch)
        size = len(self.rows)
        self.device, self.overlap = torch.device(device), overlap
        self.columns = columns
        self.spec: ExperienceSpec | None = None
        self.rllib: MiniBatchCyclicIterator | None = None
        self.layout: CyclicLayout | None = None
        self.num_minibatches = 0
        self._handed = 0  # mini-batches handed out (the next iteration starts there)
        total = check_int("num_total_minibatches", num_total_minibatches, minimum=0)
        self._minibatch_size, self._by_total = minibatch_size, bool(total)
        if not total and num_epochs < 1:
            return  # nothing to deliver
        if size == 0:
            raise SpecError(None, f"the batch of module {self.module_id!r} is empty: no "
                                  f"mini-batch of it would ever complete an epoch")
        check_int("minibatch_size", minibatch_size, minimum=1)
        self.spec = _plane_spec(self.rows, size)
        if self.spec is None:
            self.rllib = MiniBatchCyclicIterator(batch, num_epochs=num_epochs,
                                                 minibatch_size=minibatch_size,
                                                 shuffle_batch_per_epoch=shuffle,
                                                 num_total_minibatches=total)
            return
        self.layout = CyclicLayout(size, num_epochs=num_epochs, minibatch_size=minibatch_size,
                                   shuffle=shuffle, num_total_minibatches=total)
        self.num_minibatches = plane_epoch(self.layout.count, size=size,
                                           minibatch_size=minibatch_size)

    def _schedule(self, overlap: bool) -> Schedule:
        return Schedule(0, 1, int(overlap), Fraction(1, self.num_minibatches))

    def _ahead(self, delivered: int) -> bool:
        """Whether the plane's worker may deliver ahead once ``delivered`` mini-batches are
        handed over: every mini-batch it could draw before the next hand-over is laid out."""
        layout = self.layout
        assert layout is not None
        return self.overlap and len(layout.parts) >= min(
            layout.count, delivered + OnPolicyFlow.MOST_STAGED)

    def __iter__(self) -> Iterator[MultiAgentBatch]:
        if self.spec is None or self.layout is None:  # RLlib's path, or no epochs
            if self.rllib is not None:
                yield from self.rllib
            return
        size, spec, layout, first = len(self.rows), self.spec, self.layout, self._handed
        if first >= layout.count:
            return  # every mini-batch was handed out
        cols = {k: v for k, v in self.rows.items() if k in spec.fields}
        rest = {k: v for k, v in self.rows.items() if k not in cols}
        count = layout.count - first
        m = self.num_minibatches = plane_epoch(count, size=size,
                                               minibatch_size=self._minibatch_size)
        kept = self.columns.take(spec, size, self.device) if self.columns is not None else None
        store = kept.store(size) if kept is not None else None
        ahead = self._ahead(first)
        try:
            plane = ExperienceDataPlane(
                spec=spec, capacity=size, mode="on_policy", num_minibatches=m,
                num_epochs=count // m, learner_device=self.device,
                sampler=PlannedSampler(layout.parts, num_minibatches=m, count=count,
                                       first=first),
                store=store,
                placement=(store.placement if store is not None else
                           Placement.device(self.device) if self.device.type == "cuda"
                           else None),
                schedule=self._schedule(ahead))
            with plane:
                plane.push(cols)
                for k in range(first, layout.count):
                    # RLlib's shuffles for this mini-batch are drawn now (where an iteration
                    # that failed before handing it out drew them, they stay as drawn).
                    rows = layout.reach(k) if k == layout.reached else layout.parts[k]
                    if self._ahead(k + 1) != ahead:
                        ahead = not ahead
                        plane.set_schedule(self._schedule(ahead))
                    minibatch = plane.pull()
                    index: dict[torch.device, torch.Tensor] = {}
                    out = {name: v for name, v in minibatch.items() if name != "_index"}
                    out.update({name: _take(v, rows, index) for name, v in rest.items()})
                    self._handed = k + 1
                    try:
                        yield MultiAgentBatch({self.module_id: SampleBatch(out)},
                                              self.env_steps)
                    except BaseException:  # abandoned (closed) at this mini-batch
                        if self._by_total:
                            layout.extend()  # RLlib's count has not reached it yet
                        raise
        finally:
            if kept is not None:
                self.columns.give_back(kept)  # the plane is closed: nothing writes them


def _plane_spec(rows: SampleBatch, size: int) -> ExperienceSpec | None:
    """The spec of a batch's plane columns, or None where the plane path would not cut the
    batch as RLlib's iterator does: a plane column of a dtype the plane refuses, another
    column that is not cut row by row (:func:`_cut_by_rows`), or no plane column."""
    plane: dict[str, torch.Tensor] = {}
    for name, column in rows.items():
        if _plane_column(name, column, size):
            plane[name] = column
        elif not _cut_by_rows(column, size):
            return None
    if not plane:
        return None
    try:
        return _spec(plane)
    except ConfigError:
        return None


def _plane_column(name: str, column: object, size: int) -> bool:
    """Whether a column can be a plane field: a tensor with one row per timestep that does
    not require grad, under a name a spec accepts."""
    return (_row_leaf(column, size) and isinstance(column, torch.Tensor)
            and name.isidentifier() and not name.startswith("_") and not keyword.iskeyword(name))


def _cut_by_rows(column: object, size: int) -> bool:
    """Whether indexing a column kept outside the plane with a mini-batch's rows gives what
    RLlib's slicing and concatenation give: a tensor or array with one row per timestep, or a
    dict or tuple (a Dict or Tuple space's) of them."""
    if isinstance(column, (dict, tuple)):
        return all(_row_leaf(leaf, size) for leaf in tree.flatten(column))
    return _row_leaf(column, size)


def _row_leaf(value: object, size: int) -> bool:
    """A tensor (that does not require grad) or a NumPy array, of ``size`` rows."""
    if isinstance(value, torch.Tensor):
        return value.dim() > 0 and len(value) == size and not value.requires_grad
    return isinstance(value, np.ndarray) and value.ndim > 0 and len(value) == size


def _take(column: object, rows: np.ndarray, index: dict[torch.device, torch.Tensor]) -> object:
    """A mini-batch's ``rows`` of a column kept outside the plane (:func:`_cut_by_rows`).

    A nested column is cut leaf by leaf with the same rows, as RLlib's iterator slices and
    concatenates every leaf. NumPy leaves are indexed with ``rows`` (host memory, whatever
    device the learner trains on); tensor leaves with a tensor of them on the leaf's device,
    made once per device and kept in ``index``.
    """
    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            on = index.get(value.device)
            if on is None:
                on = index[value.device] = _indices(rows).to(value.device)
            return value[on]
        return value[rows]

    if isinstance(column, (dict, tuple)):
        return tree.map_structure(leaf, column)
    return leaf(column)


def delivery_overlaps(setting: bool | None, device: torch.device) -> bool:
    """Whether the plane delivers mini-batches on a background worker: ``setting``, or for
    None, where the worker has a core the update does not compute on
    (:func:`~conduit.integrations.rllib.schedule.worker_has_core`: an update on an
    accelerator, or fewer torch threads than cores)."""
    if setting is not None:
        return bool(setting)
    return worker_has_core(accelerator=device.type != "cpu")


class ConduitPPOTorchLearner(PPOTorchLearner):
    """RLlib's ``PPOTorchLearner`` with Conduit delivering its mini-batches.

    Usage: ``config.learners(learner_class=ConduitPPOTorchLearner)``. Epochs, shuffling and
    mini-batch sizes are RLlib's (without ``minibatch_size``, ``num_epochs > 1`` cuts
    mini-batches of the batch's env steps, ``batch.count``, as RLlib's ``Learner`` does,
    whatever rows the module's batch has). With several learners, RLlib hands each the
    ``num_total_minibatches`` all of them run; each then delivers exactly that many, as
    RLlib's iterator does. Batches RLlib itself would not cut into mini-batches (one epoch
    without ``minibatch_size``), multi-module batches, recurrent modules and data iterators
    take RLlib's own path; so do batches whose mini-batches a plane would not give as RLlib
    does (:class:`ConduitMiniBatchIterator`). Updates share their planes' column memory
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
        plain = not training_data.data_iterators and (minibatch_size or num_epochs > 1)
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
                    columns=self._column_cache(), num_total_minibatches=num_total_minibatches)
            training_data = TrainingData(batch=batch)
        return super()._create_iterator_if_necessary(
            training_data=training_data, num_total_minibatches=num_total_minibatches,
            num_epochs=num_epochs, minibatch_size=minibatch_size,
            shuffle_batch_per_epoch=shuffle_batch_per_epoch, **kwargs)
