"""Column stores: preallocated per-field tensors on a placement, with vectorized set/get."""

from __future__ import annotations

import contextlib
import functools
import math
import operator
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np
import psutil
import torch

from conduit._checks import check_int
from conduit.errors import CapacityError, ConfigError, PlacementError, SpecError, StateError
from conduit.spec import Batch, ExperienceSpec, FieldSpec
from conduit.storage import compiled
from conduit.storage.hostmem import host_zeros
from conduit.storage.layout import Placement, split_rows
from conduit.storage.state import StateDict, entry, integer
from conduit.storage.threads import GatherWorkers


class Store(Protocol):
    """What every store offers; samplers and buffers only use this."""

    spec: ExperienceSpec
    capacity: int
    placement: Placement

    def set(self, indices: torch.Tensor, batch: Batch) -> None:
        """Write ``batch`` rows at ``indices`` (CPU int64)."""

    def set_range(self, start: int, batch: Batch) -> None:
        """Write ``batch`` rows at ``start, start+1, ...`` (no wrap)."""

    def get(self, indices: torch.Tensor, *, device: torch.device | None = None) -> Batch:
        """Gather rows at ``indices`` (CPU int64, any shape); result has that leading shape."""

    def state_dict(self) -> StateDict:
        """Exact copy of the contents."""

    def load_state_dict(self, state: StateDict) -> None:
        """Restore from :meth:`state_dict`."""


_LARGE_ROW_BYTES = 16 << 10
SET_ALIGN = 64
"""Bytes each field of a :class:`GatherOutputs` set is aligned to within its block."""


_row_kernels: Callable[[], Any] = functools.partial(compiled.load, "_row_kernels")
"""The compiled row kernels, or None where Numba cannot be imported (a cached import, called
without a Python frame of its own: a synchronous sample asks for it)."""


def check_slots(indices: torch.Tensor, capacity: int) -> None:
    """Refuse integer ``indices`` (any shape) that name a row outside ``[0, capacity)``.

    Raises:
        IndexError: Such an index.
    """
    if indices.dtype.is_floating_point or indices.dtype.is_complex \
            or indices.dtype == torch.bool or not indices.numel():
        return  # (not slots: the gather refuses their dtype itself)
    flat = indices.reshape(-1)
    kernels = _row_kernels()
    if kernels is not None and flat.dtype == torch.int64 and flat.device.type == "cpu":
        _check_host_slots(kernels, flat.numpy(), capacity)
        return
    lo, hi = int(flat.min()), int(flat.max())
    if lo < 0 or hi >= capacity:
        raise IndexError(f"indices: slot {lo if lo < 0 else hi} lies outside [0, {capacity})")


def _check_host_slots(kernels: Any, slots: np.ndarray, capacity: int) -> None:
    """:func:`check_slots` of 1-D int64 host slots, by the compiled kernel."""
    bad = kernels.first_outside(slots, capacity)
    if bad >= 0:
        raise IndexError(f"indices: slot {int(slots[bad])} lies outside [0, {capacity})")


def _check_1d(indices: torch.Tensor) -> None:
    """Raises ConfigError (field ``indices``) unless ``indices`` is 1-D: one slot per row
    written."""
    if indices.dim() != 1:
        raise ConfigError("indices", f"a write takes a 1-D tensor of slots, one per row, got "
                                     f"shape {tuple(indices.shape)}")


def check_span(start: int, rows: int, capacity: int) -> None:
    """Refuse a contiguous write of ``rows`` rows at ``start`` that leaves ``[0, capacity)``.

    Raises:
        IndexError: It does.
    """
    if start < 0 or start + rows > capacity:
        raise IndexError(f"start: rows [{start}, {start + rows}) leave [0, {capacity})")


def copy_rows(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor,
              src_rows: torch.Tensor | None = None) -> None:
    """``dst[dst_rows] = src[src_rows]`` (all of ``src`` when ``src_rows`` is None).

    Host tensors of a dtype numpy has go through numpy's fancy assignment (a row-wise memcpy)
    or, for rows of 16 KB or more, a compiled row copy that does not hold the GIL, since CPU
    ``Tensor.index_copy_`` walks such rows element by element (``docs/design.md §7``).
    Anything else uses ``index_copy_``.

    Raises:
        IndexError: A row index is out of range (negative ones included), or the rows to
            write and the rows given differ in number; nothing is copied.
    """
    if (dst.device.type == "cpu" and src.device.type == "cpu" and not src.requires_grad
            and dst.dtype == src.dtype):
        try:
            d, s = dst.numpy(), src.numpy()
        except TypeError:  # e.g. bfloat16
            pass
        else:
            di = dst_rows.numpy()
            si = None if src_rows is None else src_rows.numpy()
            _check_row_pairs(di, len(d), si, len(s))  # (numpy would wrap negative rows)
            if si is not None and s.ndim > 1 and s[0].nbytes >= _LARGE_ROW_BYTES:
                # Large rows (images): row by row, without the temporary gathered copy that
                # the fancy assignment below makes.
                _copy_large_rows(d, di, s, si)
            else:
                d[di] = s if si is None else s[si]
            return
    src = src.detach()  # the copy must not make ``dst`` part of the caller's graph
    rows = src if src_rows is None else src.index_select(0, src_rows.to(src.device))
    dst.index_copy_(0, dst_rows.to(dst.device), rows.to(dst.device, non_blocking=True))


def _check_row_pairs(di: np.ndarray, n_dst: int, si: np.ndarray | None, n_src: int) -> None:
    """Refuse rows ``di`` of ``n_dst`` written from rows ``si`` (None: all) of ``n_src`` that
    are out of range or differ in number.

    Raises:
        IndexError: They are.
    """
    given = n_src if si is None else len(si)
    if len(di) != given:
        raise IndexError(f"copy_rows: {len(di)} destination rows for {given} source rows")
    for rows, n, what in ((di, n_dst, "destination"), (si, n_src, "source")):
        if rows is not None and rows.size and (rows.min() < 0 or rows.max() >= n):
            raise IndexError(f"copy_rows: {what} rows out of range: they must lie in "
                             f"[0, {n}), got [{int(rows.min())}, {int(rows.max())}]")


def _copy_large_rows(d: np.ndarray, di: np.ndarray, s: np.ndarray, si: np.ndarray) -> None:
    kernels = compiled.load("_row_kernels")
    if (kernels is not None and d.flags.c_contiguous and s.flags.c_contiguous
            and len(di) == len(si)):
        # One compiled call that does not hold the GIL (see _row_kernels).
        bad = kernels.copy_rows(d.reshape(len(d), -1).view(np.uint8), di.astype(np.int64),
                                s.reshape(len(s), -1).view(np.uint8), si.astype(np.int64))
        if bad:
            raise IndexError(f"copy_rows: row pair {bad - 1} ({int(di[bad - 1])} <- "
                             f"{int(si[bad - 1])}) is out of range for {len(d)} destination "
                             f"and {len(s)} source rows")
        return
    for a, b in zip(di.tolist(), si.tolist()):
        d[a] = s[b]


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


_DATA = operator.attrgetter("data")
"""``t.data``: a new tensor over ``t``'s memory (each batch's own tensor objects)."""


def _memory_key(t: torch.Tensor) -> int:
    """The handle of ``t``'s memory that torch's use count reads (valid while ``t`` lives)."""
    return int(t.untyped_storage()._cdata)


class GatherOutputs:
    """Host tensors that gathers write into, reused once nothing refers to them.

    A set holds one ``[rows, *shape]`` tensor per field, all views of one block of memory (each
    field starts on a 64-byte boundary). A set is handed out again only when no tensor, view or
    numpy array made from any of its fields is alive (torch's use count of the block is back to
    the pool's own), so a batch a caller still holds, even one field of it, is never
    overwritten: a learner that holds one batch while it pulls the next gets double buffering,
    one that holds more gets more sets. With ``keep`` sets in use, a gather gets new memory, as
    without the pool; where torch exposes no use count, nothing is kept
    (``docs/design.md §7``). A Python storage object alone (``t.untyped_storage()``,
    ``t.storage()``) does not count as a reference: keep a tensor or view of the field to
    hold its memory.

    Each set also holds an int64 ``[rows]`` slot column in memory of its own (so that
    ``_index`` alone pickles as its own rows), handed out only by :meth:`take_indexed` (as the
    batch's ``_index``), under the same rule.

    A set whose memory was moved to shared memory (``share_memory_()``, as
    :mod:`torch.multiprocessing` does to a tensor it sends to another process) is never
    handed out again: the pool drops it, since another process may still read it while no
    reference to it is left in this one. A set's memory is fixed in size (the pool writes it
    through numpy arrays): a handed-out tensor cannot be grown in place (``resize_``, an
    ``out=`` of another size); clone it first.

    Args:
        fields: Field specs of a set.
        keep: Sets kept for reuse.
        pinned: Allocate the sets in page-locked memory (needs CUDA), so that a batch
            gathered into one leaves for a GPU by DMA, with no staging copy. Pinned sets are
            not kept: each comes from torch's pinned-memory cache, which hands a block out
            again only after the asynchronous copies made from it have completed, so a
            caller may drop a batch while its copy to a GPU is still in flight.
    """

    def __init__(self, fields: Mapping[str, FieldSpec], *, keep: int = 4,
                 pinned: bool = False) -> None:
        self._fields = dict(fields)
        self._keep = keep if _storage_use_count is not None and not pinned else 0
        self.pinned = pinned
        self._sets: list[_Set] = []  # in hand-out order
        self._lock = threading.Lock()

    @property
    def fields(self) -> dict[str, FieldSpec]:
        """Field specs of a set."""
        return dict(self._fields)

    def _allocate(self, rows: int) -> tuple[torch.Tensor, dict[str, torch.Tensor],
                                            dict[str, np.ndarray]]:
        """One block for every field of a ``rows``-row set, the fields' views of it, and
        numpy views of the fields whose dtype numpy has."""
        spans, total = [], 0
        for fs in self._fields.values():
            nbytes = rows * fs.dtype.itemsize * math.prod(fs.shape)
            spans.append((total, nbytes))
            total += -(-nbytes // SET_ALIGN) * SET_ALIGN
        block = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=self.pinned)
        views = {name: block[a:a + n].view(fs.dtype).view(rows, *fs.shape)
                 for (name, fs), (a, n) in zip(self._fields.items(), spans)}
        arrays: dict[str, np.ndarray] = {}
        for name, view in views.items():
            with contextlib.suppress(TypeError):  # (bfloat16 and the like: torch only)
                arrays[name] = view.numpy()  # (which makes the block's memory fixed in size)
        return block, views, arrays

    def take(self, rows: int) -> dict[str, torch.Tensor]:
        """New ``[rows, *shape]`` tensors per field, over memory that nothing else refers to
        (the pool's again once these, and everything made from them, are gone)."""
        return self.take_arrays(rows)[0]

    def take_arrays(self, rows: int) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
        """As :meth:`take`, with numpy arrays over the same memory for the fields whose dtype
        numpy has, for the taker to write through before it hands the tensors out (they are
        the pool's: do not hand them out)."""
        outs, arrays, _ = self._take(rows, False)
        return outs, arrays

    def take_indexed(self, rows: int) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray],
                                               np.ndarray]:
        """As :meth:`take_arrays`, with the set's slot column as ``_index`` among the tensors
        (int64 ``[rows]``, its values left as they were) and a numpy array over it, for the
        taker to draw the slots into before it gathers them."""
        outs, arrays, host = self._take(rows, True)
        assert host is not None  # (indexed: made with the set)
        return outs, arrays, host

    def _take(self, rows: int, indexed: bool
              ) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray], np.ndarray | None]:
        """:meth:`take_arrays`, or :meth:`take_indexed` where ``indexed`` (the numpy slot
        array None otherwise). The tensors handed out are made under the pool's lock, so no
        other taker can find their set free before they count as references to it."""
        count = _storage_use_count
        with self._lock:
            sets = self._sets
            got = sets[-1] if sets else None  # the usual case: the set handed out last is free
            if not (got is not None and got.rows == rows and count(got.key) == got.idle
                    and count(got.slot_key) == got.slot_idle
                    and not got.block.untyped_storage().is_shared()
                    and not got.slots.untyped_storage().is_shared()):
                got = self._other_set_locked(rows, indexed)
            views = got.views
            outs = dict(zip(views, map(_DATA, views.values())))  # {name: t.data}, in C
            if indexed:
                outs["_index"] = got.slots.data
            return outs, got.arrays, got.slot_array

    def _other_set_locked(self, rows: int, indexed: bool) -> _Set:
        """A free ``rows``-row set other than by the usual case, or a new one. A kept set has
        its slot column; a new set the pool does not keep (pinned, or beyond ``keep``) has
        one only when ``indexed`` (its slot fields None otherwise): a pinned gather allocates
        per call. Sets shared with another process are dropped on the way."""
        count = _storage_use_count
        sets, free = self._sets, None
        # Most recently handed out first (``sets`` is in hand-out order): a free set that was
        # written last is the one most likely still in the cache.
        for k in range(len(sets) - 1, -1, -1):
            got = sets[k]
            if count(got.key) == got.idle and count(got.slot_key) == got.slot_idle:
                if (got.block.untyped_storage().is_shared()  # another process may read it
                        or got.slots.untyped_storage().is_shared()):
                    del sets[k]
                    if free is not None:
                        free -= 1
                    continue
                if got.rows == rows:
                    if k != len(sets) - 1:
                        sets.append(sets.pop(k))
                    return got
                free = k
        block, views, arrays = self._allocate(rows)
        if len(sets) >= self._keep and free is not None:
            del sets[free]  # a free set of another size makes room
        slots = (torch.empty(rows, dtype=torch.int64, pin_memory=self.pinned)
                 if indexed or len(sets) < self._keep else None)
        slot_array = None if slots is None else slots.numpy()
        if len(sets) >= self._keep:  # handed out once: no use counts to keep
            return _Set(rows, views, arrays, block, 0, 0, slots, slot_array, 0, 0)
        key, skey = _memory_key(block), _memory_key(slots)
        made = _Set(rows, views, arrays, block, key, count(key), slots, slot_array, skey,
                    count(skey))
        sets.append(made)
        return made


class _Set(NamedTuple):
    """One set of :class:`GatherOutputs`: its rows, the pool's views per field, numpy arrays
    over them, their block, the block's memory handle and its use count while only the pool
    holds the set; then the same for the slot column (tensor, numpy array, handle, idle use
    count; the tensor and array None for a set the pool does not keep, made unindexed)."""

    rows: int
    views: dict[str, torch.Tensor]
    arrays: dict[str, np.ndarray]
    block: torch.Tensor
    key: int
    idle: int
    slots: torch.Tensor | None
    slot_array: np.ndarray | None
    slot_key: int
    slot_idle: int


def _check_capacity(capacity: int) -> int:
    return check_int("capacity", capacity, minimum=1)


class ColumnStore:
    """One preallocated tensor per field on a single device (pageable, pinned, or one GPU).

    Args:
        spec: Fields to store.
        capacity: Rows.
        placement: A non-sharded :class:`Placement`. Pinned placements pin host memory when
            CUDA is available and fall back to pageable memory otherwise.

    Raises:
        PlacementError: A sharded placement, or a device other than CPU memory or a CUDA
            device this machine has (``meta``, ``mps``, ``xpu``...).
        CapacityError: The columns do not fit the memory available on their device.
    """

    _outputs: GatherOutputs | None = None

    def __init__(self, *, spec: ExperienceSpec, capacity: int,
                 placement: Placement | None = None) -> None:
        self.spec = spec
        self.capacity = _check_capacity(capacity)
        self.placement = placement or Placement.pageable()
        if self.placement.kind == "sharded":
            raise PlacementError("placement: a ColumnStore lives on one device; use "
                                 "ShardedStore (or make_store) for sharded placements")
        self.device = self.placement.primary_device
        if self.device.type not in ("cpu", "cuda"):
            raise PlacementError(f"placement.devices: {self.device} is neither CPU memory nor "
                                 f"a CUDA device; Conduit's stores live on 'cpu' or 'cuda[:index]'")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise PlacementError(f"placement.devices: {self.device} requested but CUDA is "
                                 f"not available on this machine")
        if (self.device.type == "cuda" and self.device.index is not None
                and self.device.index >= torch.cuda.device_count()):
            raise PlacementError(f"placement.devices: {self.device} requested but this machine "
                                 f"has {torch.cuda.device_count()} CUDA devices")
        pin = self.placement.is_pinned and torch.cuda.is_available()
        self.pinned = pin
        need = self.capacity * spec.bytes_per_sample
        if self.device.type == "cpu":
            # Columns are written through at allocation: a buffer larger than the memory left
            # would be killed by the OS part way, not refused.
            free = int(psutil.virtual_memory().available)
            if need > free:
                raise CapacityError(f"capacity: {self.capacity:,} rows x "
                                    f"{spec.bytes_per_sample:,} B = {need / 1e9:.2f} GB do not "
                                    f"fit the {free / 1e9:.2f} GB of host memory available; "
                                    f"reduce capacity or the per-sample size, or use a "
                                    f"MemmapColumnStore", needed=need, available=free)
        try:
            self._cols: dict[str, torch.Tensor] = {
                name: self._alloc((self.capacity, *fs.shape), fs.dtype)
                for name, fs in spec.fields.items()}
        except (RuntimeError, MemoryError, OSError) as exc:
            raise CapacityError(f"capacity: cannot allocate {need:,} bytes for "
                                f"{self.capacity:,} rows on {self.placement.label()}: {exc}",
                                needed=need) from exc
        self._make_views()

    #: numpy views of the host columns whose dtype numpy has (not bfloat16 etc.), for writes
    #: and gathers, and the address of each column they were made at (one attribute, so a
    #: thread reads views and addresses of the same making).
    _host: tuple[dict[str, np.ndarray], dict[str, int]]
    #: The same, as a host gather reads it: ``(name, column, view, address)`` per field with a
    #: view, then ``(name, column)`` per field without one (made with :attr:`_host`).
    _takes: tuple[tuple[tuple[str, torch.Tensor, np.ndarray, int], ...],
                  tuple[tuple[str, torch.Tensor], ...]]

    def _make_views(self) -> None:
        """Make :attr:`_host` and :attr:`_takes` for the columns as they are now."""
        views: dict[str, np.ndarray] = {}
        if self.device.type == "cpu":
            for name, col in self._cols.items():
                with contextlib.suppress(TypeError):
                    views[name] = col.numpy()  # (which makes the column fixed in size)
        ptrs = {name: self._cols[name].data_ptr() for name in views}
        self._takes = (tuple((name, self._cols[name], view, ptrs[name])
                             for name, view in views.items()),
                       tuple((name, col) for name, col in self._cols.items()
                             if name not in views))
        self._host = (views, ptrs)

    def _views(self) -> dict[str, np.ndarray]:
        """The host columns' numpy views, made again first if a column's memory moved
        (``share_memory_()``, as :mod:`torch.multiprocessing` does to a column it sends, puts
        a column in new memory and frees the old). The column tensors are the store's own
        (:meth:`column` hands out aliases) and fixed in size, so a column at its recorded
        address is the memory its view covers (``docs/design.md §7``)."""
        views, ptrs = self._host
        cols = self._cols
        for name, ptr in ptrs.items():
            if cols[name].data_ptr() != ptr:
                self._moved(name)
                self._make_views()
                return self._host[0]
        return views

    def _moved(self, name: str) -> None:
        """Column ``name``'s memory moved (see :meth:`_views`): its views are made again."""

    def __getstate__(self) -> dict[str, Any]:
        # numpy views and addresses belong to this process's memory, the gather pool to
        # this store (and holds a lock): a copy or an unpickled store makes its own.
        state = dict(self.__dict__)
        state.pop("_host", None)
        state.pop("_takes", None)
        state.pop("_outputs", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._make_views()

    @classmethod
    def over(cls, *, spec: ExperienceSpec, columns: Mapping[str, torch.Tensor],
             outputs: GatherOutputs | None = None) -> ColumnStore:
        """A store whose columns are ``columns``, used as they are (rows written land in
        them): memory its caller reuses, such as the first rows of larger blocks kept from
        one store to the next. Their contents are the store's rows; the caller must not
        change them while the store is in use.

        Args:
            spec: Fields to store.
            columns: One tensor per field of ``spec``, each ``[rows, *shape]`` of the field's
                dtype and contiguous, all with the same rows, on the CPU or on one GPU.
            outputs: Where host gathers land, shared with the other stores made over the
                same memory, so that their batches reuse each other's (default: the store's
                own). A set is still handed out only when nothing refers to it.

        Raises:
            SpecError: A column is missing, extra, does not match its field, requires grad
                or is a conjugate or negative view (named).
            ConfigError: The columns hold no rows, or ``outputs`` has other fields.
            PlacementError: The columns live on more than one device.
        """
        if outputs is not None and outputs.fields != dict(spec.fields):
            raise ConfigError("outputs", f"gathers fields {outputs.fields}, the spec has "
                                         f"{dict(spec.fields)}; pass GatherOutputs made for "
                                         f"this spec's fields")
        for name in columns:
            if name not in spec.fields:
                raise SpecError(name, "is not a field of the spec")
        first = columns.get(next(iter(spec.fields)))
        capacity = int(first.shape[0]) if first is not None and first.dim() else -1
        for name, fs in spec.fields.items():
            col = columns.get(name)
            if col is None:
                raise SpecError(name, "has no column")
            if (col.dtype != fs.dtype or tuple(col.shape) != (capacity, *fs.shape)
                    or not col.is_contiguous()):
                raise SpecError(name, f"column is {col.dtype} {tuple(col.shape)}"
                                      f"{'' if col.is_contiguous() else ', not contiguous'}; "
                                      f"expected a contiguous {fs.dtype} column of shape "
                                      f"{(capacity, *fs.shape)}")
            if col.requires_grad or col.is_conj() or col.is_neg():
                raise SpecError(name, "column requires grad or is a conjugate or negative "
                                      "view; pass plain memory (col.detach(), "
                                      "col.resolve_conj(), col.resolve_neg())")
        devices = {col.device for col in columns.values()}
        if len(devices) != 1 or next(iter(devices)).type not in ("cpu", "cuda"):
            raise PlacementError(f"columns: on {sorted(map(str, devices))}; a ColumnStore lives "
                                 f"on one device, the CPU or a GPU")
        device = devices.pop()
        store = cls.__new__(cls)
        store.spec, store.capacity = spec, _check_capacity(capacity)
        store.placement = Placement.pageable() if device.type == "cpu" else Placement.device(
            device)
        store.device, store.pinned = device, False
        store._cols = {name: columns[name].data for name in spec.fields}  # (aliases: see column)
        store._make_views()
        if outputs is not None:
            store._outputs = outputs
        return store

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu" and not self.pinned:
            return host_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device, pin_memory=self.pinned)

    @property
    def nbytes(self) -> int:
        """Bytes allocated."""
        return self.capacity * self.spec.bytes_per_sample

    def column(self, name: str) -> torch.Tensor:
        """The column of ``name``: a tensor over the store's memory (not a copy; writes to it
        are the store's rows). It is an alias: ``set_`` on it leaves the store's column as it
        was, and its memory cannot be resized."""
        return self._cols[name].data

    def set(self, indices: torch.Tensor, batch: Batch) -> None:
        """Write rows at ``indices``; one vectorized copy per field.

        Raises:
            ConfigError: ``indices`` is not 1-D (field ``indices``).
            IndexError: An index lies outside ``[0, capacity)``.
        """
        _check_1d(indices)
        for name, col in self._cols.items():
            copy_rows(col, indices, batch[name])

    def set_range(self, start: int, batch: Batch) -> None:
        """Write contiguous rows starting at ``start``; a plain slice copy per field.

        Raises:
            IndexError: The rows leave ``[0, capacity)``.
        """
        check_span(start, next(iter(batch.values())).shape[0], self.capacity)
        host = self._views()
        for name, col in self._cols.items():
            src = batch[name]
            view = host.get(name)
            if view is not None and src.device.type == "cpu" and not src.requires_grad:
                # The same memcpy through numpy, without torch's per-call dispatch, which
                # dominates for the small fields (reward, done) of small chunks.
                view[start:start + src.shape[0]] = src.numpy()
            else:  # (detached: a column never joins a caller's autograd graph)
                col[start:start + src.shape[0]].copy_(src.detach(), non_blocking=True)

    def get(self, indices: torch.Tensor, *, device: torch.device | None = None,
            workers: GatherWorkers | None = None) -> Batch:
        """Gather rows at ``indices`` with one row copy per field (``docs/design.md §7``).

        Host rows gathered for the host land in :class:`GatherOutputs` tensors that nothing
        else refers to: every call returns new tensors, whose memory may be a batch dropped
        earlier (a pinned store's are page-locked). With ``workers``, a large host gather may
        be split over row ranges (see :class:`~conduit.storage.threads.GatherWorkers`); the
        result is the same.

        Raises:
            IndexError: An index lies outside ``[0, capacity)``.
        """
        if self.device.type != "cpu" or (device is not None and device != self.device):
            return self._get_new(indices.reshape(-1), tuple(indices.shape), device)
        outputs = self._gather_outputs()
        kernels = _row_kernels()
        if indices.dtype == torch.int64 and kernels is not None and indices.dim() >= 1:
            # The common case: the rows checked once, then numpy's take per field, where
            # torch's index_select checks them again per field behind a dispatch that costs
            # more than a small field's copy (docs/design.md §7); the copies are the same.
            # With ``workers`` too, for a gather that runs on one thread. Indices of more
            # dimensions are taken flat, then viewed in their shape.
            lead = tuple(indices.shape)
            flat = indices.reshape(-1)
            idx = flat.numpy()
            _check_host_slots(kernels, idx, self.capacity)
            outs, arrays = outputs.take_arrays(idx.shape[0])
            if workers is None or workers.alone(idx.shape[0] * self.spec.bytes_per_sample):
                self._take_rows(flat, idx, outs, arrays)
            else:
                self._split_gather(flat, outs, workers,
                                   one=lambda: self._take_rows(flat, idx, outs, arrays))
            return outs if len(lead) == 1 else self._in_shape(outs, lead)
        check_slots(indices, self.capacity)
        if workers is not None and indices.dim() == 1:
            outs = outputs.take(indices.shape[0])
            self._split_gather(indices, outs, workers)
            return outs
        lead = tuple(indices.shape)
        flat = indices.reshape(-1)
        outs = outputs.take(flat.shape[0])
        for name, col in self._cols.items():
            torch.index_select(col, 0, flat, out=outs[name])
        return outs if indices.dim() == 1 else self._in_shape(outs, lead)

    def _in_shape(self, outs: Batch, lead: tuple[int, ...]) -> Batch:
        """``outs`` (gathered flat) with each field viewed as ``[*lead, *row shape]``."""
        for name, col in self._cols.items():
            outs[name] = outs[name].view(lead + tuple(col.shape[1:]))
        return outs

    @property
    def gathers_drawn(self) -> bool:
        """Whether :meth:`gather_drawn` runs here: a host store, with the compiled slot
        check."""
        return self.device.type == "cpu" and _row_kernels() is not None

    def gather_drawn(self, rows: int, draw: Callable[[torch.Tensor], None]) -> Batch:
        """Draw ``rows`` slots and gather them, into one reused output set: ``draw`` fills the
        set's slot column (an int64 ``[rows]`` tensor) in place, and the rows of those slots
        are taken into the set's fields. The slot column is the batch's ``_index``
        (``docs/design.md §7``). The batch is the caller's, as :meth:`get`'s.

        Only where :attr:`gathers_drawn`.

        Raises:
            IndexError: ``draw`` wrote a slot outside ``[0, capacity)``.
            Exception: Whatever ``draw`` raises (nothing is gathered).
        """
        # (take_indexed without its wrapper, and the pool without _gather_outputs's call once
        # made: a synchronous sample's calls weigh where rows are small, docs/design.md §7)
        outs, arrays, idx = (self._outputs or self._gather_outputs())._take(rows, True)
        indices = outs["_index"]
        draw(indices)
        kernels = _row_kernels()
        if kernels.first_outside(idx, self.capacity) >= 0:  # (raises, naming the slot)
            _check_host_slots(kernels, idx, self.capacity)
        self._take_rows(indices, idx, outs, arrays)
        return outs

    def _gather_outputs(self) -> GatherOutputs:
        outputs = self._outputs
        if outputs is None:  # made here, so subclasses with their own columns get one
            outputs = self._outputs = GatherOutputs(self.spec.fields, pinned=self.pinned)
        return outputs

    def _take_rows(self, indices: torch.Tensor, idx: np.ndarray, outs: Batch,
                   arrays: dict[str, np.ndarray]) -> None:
        """Take the host rows at checked slots (``indices``, and ``idx`` over the same
        memory) into a set's tensors ``outs`` (through its ``arrays``): numpy's take per
        field, ``index_select`` where numpy has no dtype."""
        takes, torch_only = self._takes
        for name, col, src, ptr in takes:
            if col.data_ptr() != ptr:  # a column moved: view them again, then take them all
                self._views()
                self._take_rows(indices, idx, outs, arrays)
                return
            src.take(idx, axis=0, out=arrays[name], mode="wrap")
        for name, col in torch_only:  # (no numpy dtype: bfloat16 and the like)
            torch.index_select(col, 0, indices, out=outs[name])

    def _split_gather(self, indices: torch.Tensor, outs: Batch, workers: GatherWorkers, *,
                      one: Callable[[], None] | None = None) -> None:
        """Gather into ``outs`` whole, or as one row range per worker, as ``workers`` chose
        (``one``: the gather on the caller's thread alone, as ``workers.gather`` takes it)."""
        cols, n = self._cols, indices.shape[0]

        def rows(a: int, b: int) -> Callable[[], None]:
            def run() -> None:
                idx = indices[a:b]
                for name, col in cols.items():
                    torch.index_select(col, 0, idx, out=outs[name][a:b])
            return run

        k = max(1, min(workers.threads, n))
        bounds = [n * j // k for j in range(k + 1)]
        workers.gather(n * self.spec.bytes_per_sample, rows(0, n),
                       [rows(bounds[j], bounds[j + 1]) for j in range(k)], one=one)

    def _get_new(self, flat: torch.Tensor, lead: tuple[int, ...],
                 device: torch.device | None) -> Batch:
        """Gather ``flat`` into newly allocated tensors of leading shape ``lead``."""
        idx = flat.to(self.device) if self.device.type != "cpu" else flat
        out: Batch = {}
        for name, col in self._cols.items():
            rows = torch.index_select(col, 0, idx)
            if device is not None and device != self.device:
                rows = rows.to(device, non_blocking=True)
            out[name] = rows.reshape(*lead, *col.shape[1:])
        return out

    def state_dict(self) -> StateDict:
        """Exact copy of every column, on CPU."""
        return {"spec": self.spec.to_dict(), "capacity": self.capacity,
                "columns": {n: c.detach().to("cpu", copy=True) for n, c in self._cols.items()}}

    def load_state_dict(self, state: StateDict) -> None:
        """Restore columns saved by :meth:`state_dict` (same spec and capacity)."""
        _check_state(self.spec, self.capacity, state)
        _check_columns(self.spec, self.capacity, state)
        for n, c in self._cols.items():
            c.copy_(state["columns"][n])


def _check_state(spec: ExperienceSpec, capacity: int, state: StateDict) -> None:
    saved_capacity = integer(state, "capacity", "store")
    if saved_capacity != capacity:
        raise CapacityError(f"state has capacity {saved_capacity}, store has {capacity}",
                            needed=saved_capacity, available=capacity)
    saved = ExperienceSpec.from_dict(entry(state, "spec", "store"))
    for name, fs in spec.fields.items():
        if name not in saved.fields:
            raise SpecError(name, "missing from the saved state")
        if saved.fields[name] != fs:
            raise SpecError(name, f"saved as {saved.fields[name]}, store expects {fs}")
    for name in saved.fields:
        if name not in spec.fields:
            raise SpecError(name, f"is saved in the state ({saved.fields[name]}) but not in "
                                  f"this store's spec (its rows would be dropped); load it "
                                  f"into a buffer built with the saved spec")


def _check_columns(spec: ExperienceSpec, capacity: int, state: StateDict) -> None:
    columns = entry(state, "columns", "store")
    for name, fs in spec.fields.items():
        col = entry(columns, name, "store.columns")
        if (not isinstance(col, torch.Tensor) or col.dtype != fs.dtype
                or tuple(col.shape) != (capacity, *fs.shape)):
            raise StateError(f"store.columns.{name}", f"expected a {fs.dtype} tensor of shape "
                                                      f"{(capacity, *fs.shape)}")


class ShardedStore:
    """Rows split over several devices; global index ↔ (shard, local index).

    Shard ``k`` owns the contiguous global range ``[bounds[k], bounds[k+1])``. Gathers are
    vectorized per shard (a loop over at most a handful of shards, never over rows) and the
    result keeps the order of ``indices``, so a sampler gives the same batches on any store.

    Args:
        spec: Fields to store.
        capacity: Total rows.
        placement: A sharded :class:`Placement`; several ``"cpu"`` shards are allowed, so the
            sharding logic runs on machines without GPUs.
    """

    def __init__(self, *, spec: ExperienceSpec, capacity: int, placement: Placement) -> None:
        self.spec = spec
        self.capacity = _check_capacity(capacity)
        if placement.kind != "sharded":
            raise PlacementError("placement: ShardedStore needs a sharded placement")
        self.placement = placement
        shares = placement.shares or ()
        counts = split_rows(capacity, shares)
        if any(c < 1 for c in counts):
            raise CapacityError(f"capacity {capacity} is too small to give every one of "
                                f"{len(counts)} shards at least one row",
                                needed=len(counts), available=capacity)
        self.bounds = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()],
                                   dtype=torch.int64)
        self.shards = [ColumnStore(spec=spec, capacity=c, placement=Placement.device(d))
                       for c, d in zip(counts, placement.devices)]
        self.device = torch.device(placement.devices[0])
        self._outputs = GatherOutputs(spec.fields)

    @property
    def nbytes(self) -> int:
        """Bytes allocated over all shards."""
        return self.capacity * self.spec.bytes_per_sample

    def locate(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Map global indices to ``(shard id, local index)``.

        Raises:
            IndexError: An index lies outside ``[0, capacity)``.
        """
        check_slots(indices, self.capacity)
        shard = torch.searchsorted(self.bounds, indices, right=True) - 1
        return shard, indices - self.bounds[shard]

    def set(self, indices: torch.Tensor, batch: Batch) -> None:
        """Write rows at global ``indices``.

        Raises:
            ConfigError: ``indices`` is not 1-D (field ``indices``).
            IndexError: An index lies outside ``[0, capacity)``.
        """
        _check_1d(indices)
        shard, local = self.locate(indices)
        for k, st in enumerate(self.shards):
            sel = (shard == k).nonzero().squeeze(1)
            if sel.numel():
                st.set(local[sel], {n: v[sel.to(v.device)] for n, v in batch.items()})

    def set_range(self, start: int, batch: Batch) -> None:
        """Write contiguous global rows, split at shard boundaries into slice copies.

        Raises:
            IndexError: The rows leave ``[0, capacity)``.
        """
        n = next(iter(batch.values())).shape[0]
        check_span(start, n, self.capacity)
        end = start + n
        for k, st in enumerate(self.shards):
            lo, hi = max(start, int(self.bounds[k])), min(end, int(self.bounds[k + 1]))
            if lo < hi:
                st.set_range(lo - int(self.bounds[k]),
                             {name: v[lo - start:hi - start] for name, v in batch.items()})

    def get(self, indices: torch.Tensor, *, device: torch.device | None = None) -> Batch:
        """Gather rows at global ``indices``, in that order, onto ``device`` (host results
        in :class:`GatherOutputs` tensors, as :meth:`ColumnStore.get`).

        Raises:
            IndexError: An index lies outside ``[0, capacity)``.
        """
        out_dev = torch.device(device or self.device)
        flat = indices.reshape(-1)
        shard, local = self.locate(flat)
        out = (self._outputs.take(flat.numel()) if out_dev.type == "cpu" else
               {name: torch.empty((flat.numel(), *fs.shape), dtype=fs.dtype, device=out_dev)
                for name, fs in self.spec.fields.items()})
        for k, st in enumerate(self.shards):
            sel = (shard == k).nonzero().squeeze(1)
            if not sel.numel():
                continue
            # A shard's share of a batch varies per call: new tensors, not the shard's outputs.
            part = st._get_new(local[sel], (sel.numel(),), out_dev)
            dsel = sel.to(out_dev)
            for name, v in part.items():
                out[name].index_copy_(0, dsel, v)
        lead = tuple(indices.shape)
        return {n: v.view(lead + tuple(v.shape[1:])) for n, v in out.items()}

    def state_dict(self) -> StateDict:
        """Exact copy of every column, concatenated in global order, on CPU."""
        parts = [s.state_dict()["columns"] for s in self.shards]
        return {"spec": self.spec.to_dict(), "capacity": self.capacity,
                "columns": {n: torch.cat([p[n] for p in parts]) for n in self.spec.fields}}

    def load_state_dict(self, state: StateDict) -> None:
        """Restore from a state saved by any store of the same spec and capacity."""
        _check_state(self.spec, self.capacity, state)
        _check_columns(self.spec, self.capacity, state)
        self.set_range(0, state["columns"])


def make_store(*, spec: ExperienceSpec, capacity: int,
               placement: Placement | None = None) -> ColumnStore | ShardedStore:
    """Build the store that executes ``placement``."""
    placement = placement or Placement.pageable()
    if placement.kind == "sharded":
        return ShardedStore(spec=spec, capacity=capacity, placement=placement)
    return ColumnStore(spec=spec, capacity=capacity, placement=placement)
