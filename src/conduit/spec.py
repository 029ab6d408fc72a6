"""Experience specification: named fields with a per-sample shape and dtype.

A batch is a ``dict[str, torch.Tensor]`` whose tensors share a leading batch dimension. The spec
checks every batch that enters the plane, converts numpy arrays once at the boundary, and gives
the per-sample size ``x`` that the placement and cost models read.
"""

from __future__ import annotations

import array
import functools
import itertools
import keyword
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from conduit.errors import ConfigError, SpecError

Batch = dict[str, torch.Tensor]
"""A batch: field name -> tensor with a leading batch dimension."""

RESERVED_KEYS = ("_index", "_weight")
"""Keys the plane adds to delivered batches: buffer indices and importance weights."""


STORABLE_DTYPES: tuple[torch.dtype, ...] = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    torch.complex128)
"""Element types a field may have: those whose rows torch can gather and scatter on the CPU
for every field shape (its ``index_select`` has no kernel for 1-D ``uint16``/``uint32``/
``uint64`` columns, and its ``index_copy_`` none for float8 types)."""


@dataclass(frozen=True)
class FieldSpec:
    """Shape and dtype of one field of one sample.

    Attributes:
        shape: Per-sample shape, without the batch dimension. ``()`` for a scalar.
        dtype: Element type.

    Raises:
        ConfigError: ``shape`` is not a sequence of non-negative ints (a bool is not one), or
            ``dtype`` is not a storable ``torch.dtype``.
    """

    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        try:
            shape = tuple(self.shape)
        except TypeError:
            raise ConfigError("shape", f"expected a tuple of non-negative ints, got "
                                       f"{self.shape!r}") from None
        if any(isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)) or s < 0
               for s in shape):
            raise ConfigError("shape", f"expected non-negative ints (True and False are not "
                                       f"sizes), got {self.shape!r}")
        object.__setattr__(self, "shape", tuple(int(s) for s in shape))
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError("dtype", f"expected a torch.dtype, got {self.dtype!r}")
        if self.dtype not in STORABLE_DTYPES:
            width = self.dtype.itemsize
            twin = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}.get(width)
            hint = (f"; store the bits as torch.{twin} (tensor.view(torch.{twin})) and view "
                    f"them back after sampling" if twin else "")
            raise ConfigError("dtype", f"{self.dtype} rows cannot be gathered by torch on the "
                                       f"CPU for every field shape; use one of "
                                       f"{[str(d).removeprefix('torch.') for d in STORABLE_DTYPES]}"
                                       f"{hint}")

    @property
    def numel(self) -> int:
        """Elements per sample."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes per sample."""
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class ExperienceSpec:
    """Named fields of one experience sample.

    Example:
        >>> spec = ExperienceSpec.of(obs=((4,), torch.float32), action=((), torch.int64))
        >>> spec.bytes_per_sample
        24

    Attributes:
        fields: Field name -> :class:`FieldSpec`, in a fixed order.

    Raises:
        ConfigError: ``fields`` is not a non-empty mapping of Python identifiers (not starting
            with ``_``) to :class:`FieldSpec`.
    """

    fields: Mapping[str, FieldSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.fields, Mapping):
            raise ConfigError("spec.fields", f"expected a mapping of field name to FieldSpec, "
                                             f"such as {{'obs': FieldSpec((4,), torch.float32)}}"
                                             f" (or ExperienceSpec.of(obs=((4,), "
                                             f"torch.float32))), got {self.fields!r}")
        if not self.fields:
            raise ConfigError("spec.fields", "an experience spec needs at least one field")
        fixed: dict[str, FieldSpec] = {}
        for name, fs in self.fields.items():
            if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
                raise ConfigError("spec.fields", f"field name {name!r} must be a Python identifier")
            if name.startswith("_"):
                raise ConfigError(
                    "spec.fields", f"field name {name!r} may not start with '_' "
                    f"(reserved for keys the plane adds, such as {RESERVED_KEYS})")
            if not isinstance(fs, FieldSpec):
                raise ConfigError(f"spec.fields[{name!r}]", f"expected a FieldSpec, got {fs!r}")
            fixed[name] = fs
        object.__setattr__(self, "fields", _FrozenDict(fixed))

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt through the constructor, so an unpickled spec is checked like a new one.
        return (type(self), (dict(self.fields),))

    @classmethod
    def of(cls, **fields: tuple[tuple[int, ...], torch.dtype] | FieldSpec) -> ExperienceSpec:
        """Build a spec from keyword arguments ``name=(shape, dtype)`` or ``name=FieldSpec``.

        Raises:
            ConfigError: A value is neither a FieldSpec nor a pair ``((shape...), dtype)``
                (for example ``obs=(4,)``, ``obs=(4, torch.float32)`` or ``obs=None``), its
                shape is not a sequence of non-negative ints, or its dtype is not a
                ``torch.dtype``: the error's field is the keyword (``obs``). A ``torch.dtype``
                the store cannot hold (``torch.uint16``) is refused with field ``dtype``, the
                keyword named in the message.
        """
        form = "expected ((shape...), dtype) such as ((4,), torch.float32), or a FieldSpec"
        out: dict[str, FieldSpec] = {}
        for name, v in fields.items():
            if isinstance(v, FieldSpec):
                out[name] = v
                continue
            if not isinstance(v, (tuple, list)) or len(v) != 2:
                raise ConfigError(name, f"{form}; got {v!r}")
            try:
                out[name] = FieldSpec(shape=v[0], dtype=v[1])
            except ConfigError as exc:
                if exc.field == "dtype" and isinstance(v[1], torch.dtype):
                    # A real dtype the store cannot hold: the dtype is at fault, not the form.
                    raise ConfigError("dtype", f"{exc.reason} (field {name!r})") from None
                raise ConfigError(name, f"{form}; got {v!r}, whose {exc.field} is wrong: "
                                        f"{exc.reason}") from None
        return cls(fields=out)

    @property
    def names(self) -> tuple[str, ...]:
        """Field names in order."""
        return tuple(self.fields)

    @functools.cached_property
    def bytes_per_sample(self) -> int:
        """Bytes of one sample over all fields: the ``x`` of the transfer model (Eq. 1).
        Computed once: the spec and its fields are frozen, and the gathers of a buffer with
        several data-path threads read it per sample."""
        return sum(fs.nbytes for fs in self.fields.values())

    def with_field(self, name: str, spec: FieldSpec) -> ExperienceSpec:
        """Return a copy with ``name`` added or replaced (for example a widened observation)."""
        fields = dict(self.fields)
        fields[name] = spec
        return ExperienceSpec(fields=fields)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly description."""
        return {n: {"shape": list(f.shape), "dtype": str(f.dtype).removeprefix("torch.")}
                for n, f in self.fields.items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExperienceSpec:
        """Inverse of :meth:`to_dict`.

        Raises:
            ConfigError: ``d`` is not a mapping of field name to ``{"shape": [...],
                "dtype": "..."}``, or names an unknown dtype (the field is named).
        """
        if not isinstance(d, Mapping):
            raise ConfigError("spec", f"expected a mapping of field name to {{'shape': [...], "
                                      f"'dtype': '...'}}, got {type(d).__name__}")
        fields = {}
        for n, f in d.items():
            if (not isinstance(f, Mapping) or not isinstance(f.get("shape"), (list, tuple))
                    or "dtype" not in f):
                raise ConfigError(f"spec.fields[{n!r}]", f"expected {{'shape': [...], "
                                                         f"'dtype': '...'}}, got {f!r}")
            dt = getattr(torch, str(f["dtype"]), None)
            if not isinstance(dt, torch.dtype):
                raise ConfigError(f"spec.fields[{n!r}].dtype", f"unknown dtype {f['dtype']!r}")
            fields[n] = FieldSpec(shape=tuple(f["shape"]), dtype=dt)
        return cls(fields=fields)

    def validate(self, batch: Mapping[str, Any], *, device: torch.device | None = None,
                 what: str = "batch") -> tuple[Batch, int]:
        """Check a batch against the spec and convert it to tensors.

        Args:
            batch: Field name -> tensor or numpy array with a leading batch dimension.
            device: If given, every tensor must already be on this device.
            what: Word used in messages ("rollout", "write", ...).

        Returns:
            The batch as a dict of tensors (numpy arrays converted without copy where possible)
            and its number of rows.

        Raises:
            SpecError: A field is missing or unknown, or has the wrong shape, dtype or device,
                or the fields disagree on the number of rows.
        """
        if not isinstance(batch, Mapping):
            raise SpecError(None, f"{what} must be a mapping of field name to tensor, "
                                  f"got {type(batch).__name__}")
        unknown = [k for k in batch if k not in self.fields]
        if unknown:
            raise SpecError(unknown[0], f"unknown field in {what}; the spec has fields "
                                        f"{list(self.fields)}")
        out: Batch = {}
        rows: int | None = None
        first: str | None = None
        for name, fs in self.fields.items():
            if name not in batch:
                raise SpecError(name, f"missing from {what}; expected shape "
                                      f"(N, {', '.join(map(str, fs.shape))}) dtype {fs.dtype}")
            t = as_tensor(batch[name], field=name, dtype=fs.dtype)
            if t.dtype != fs.dtype:
                raise SpecError(name, f"dtype {t.dtype} in {what}, expected {fs.dtype}")
            if t.dim() != len(fs.shape) + 1 or tuple(t.shape[1:]) != fs.shape:
                raise SpecError(name, f"shape {tuple(t.shape)} in {what}, expected "
                                      f"(N, {', '.join(map(str, fs.shape))})".replace(", )", ")"))
            if device is not None and t.device != device:
                raise SpecError(name, f"on device {t.device} in {what}, expected {device}")
            if rows is None:
                rows, first = int(t.shape[0]), name
            elif t.shape[0] != rows:
                raise SpecError(name, f"has {t.shape[0]} rows in {what} but field {first!r} "
                                      f"has {rows}; all fields need the same leading dimension")
            out[name] = t
        assert rows is not None
        return out, rows


@dataclass(frozen=True)
class RaggedFieldSpec:
    """A variable-length field: one 1-D sequence per sample, stored without padding
    (:class:`~conduit.storage.ragged.RaggedStore`) and padded per mini-batch on delivery.

    Attributes:
        dtype: Element type.
        max_length: Longest sequence a sample may hold.
        min_length: Shortest (1 refuses empty sequences).
    """

    dtype: torch.dtype = torch.int64
    max_length: int = 1024
    min_length: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError("dtype", f"expected a torch.dtype, got {self.dtype!r}")
        if self.dtype not in STORABLE_DTYPES:
            names = [str(d).removeprefix("torch.") for d in STORABLE_DTYPES]
            raise ConfigError("dtype", f"{self.dtype} sequences cannot be gathered and padded "
                                       f"by torch; use one of {names}")
        if not isinstance(self.min_length, int) or self.min_length < 0:
            raise ConfigError("min_length", f"must be a non-negative int, got {self.min_length!r}")
        if not isinstance(self.max_length, int) or self.max_length < max(1, self.min_length):
            raise ConfigError("max_length", f"must be an int >= max(1, min_length), got "
                                            f"{self.max_length!r}")

    def validate(self, sequences: Any, *, field: str, what: str = "batch"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Check a list of 1-D sequences and pack them.

        Returns:
            The sequences concatenated (``values``) and their ``lengths`` (int64).

        Raises:
            SpecError: Not a sequence of 1-D sequences, a wrong dtype, or a length outside
                ``[min_length, max_length]``; the message names the field and the sample.
        """
        if isinstance(sequences, (str, bytes, Mapping)) or not hasattr(sequences, "__len__"):
            raise SpecError(field, f"expected a list of 1-D sequences in {what}, got "
                                   f"{type(sequences).__name__}")
        packed = self._pack_lists(sequences)
        if packed is not None:
            return packed
        parts = []
        for i, seq in enumerate(sequences):
            try:
                t = as_tensor(seq, field=field, dtype=self.dtype)
            except SpecError as exc:
                raise SpecError(field, f"sample {i} in {what}: "
                                       f"{str(exc).removeprefix(f'field {field!r}: ')}") from exc
            if t.dim() != 1:
                raise SpecError(field, f"sample {i} in {what} has shape {tuple(t.shape)}, "
                                       f"expected a 1-D sequence")
            if t.numel() and t.dtype != self.dtype:
                raise SpecError(field, f"sample {i} in {what} has dtype {t.dtype}, expected "
                                       f"{self.dtype}")
            if not self.min_length <= t.numel() <= self.max_length:
                raise SpecError(field, f"sample {i} in {what} has length {t.numel()}, expected "
                                       f"{self.min_length}..{self.max_length}; "
                                       + ("drop or fill empty samples" if t.numel() == 0 else
                                          "truncate it or raise max_length"))
            parts.append(t.to(self.dtype).cpu())
        lengths = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
        values = torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype)
        return values, lengths

    def _pack_lists(self, sequences: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Plain Python lists of numbers, packed with one conversion; None when anything is
        off (the per-sample checks then name the sample)."""
        if not isinstance(sequences, (list, tuple)) or set(map(type, sequences)) != {list}:
            return None
        lens = list(map(len, sequences))
        if lens and not self.min_length <= min(lens) <= max(lens) <= self.max_length:
            return None
        flat = list(itertools.chain.from_iterable(sequences))
        if not flat:
            return torch.empty(0, dtype=self.dtype), torch.tensor(lens, dtype=torch.int64)
        try:  # one C loop over the ints (array), or numpy's conversion: faster than torch's
            if self.dtype == torch.int64:
                if not set(map(type, flat)) <= {int}:  # bools (and NumPy ints): checked below
                    return None
                values = torch.frombuffer(array.array("q", flat), dtype=torch.int64)
            else:
                values = torch.from_numpy(np.array(flat))
        except (TypeError, ValueError, RuntimeError, OverflowError):
            return None
        if values.dim() != 1 or values.dtype != self.dtype:
            return None
        return values, torch.frombuffer(array.array("q", lens), dtype=torch.int64)


def as_indices(value: Any) -> torch.Tensor:
    """``value`` as a 1-D int64 CPU tensor of row indices (as it is when it already is one)."""
    if (isinstance(value, torch.Tensor) and value.dtype == torch.int64 and value.dim() == 1
            and value.device.type == "cpu"):
        return value
    return torch.as_tensor(value, dtype=torch.int64).reshape(-1).cpu()


def checked_indices(value: Any, field: str) -> torch.Tensor:
    """``value`` as a 1-D int64 CPU tensor of row indices, refusing what would be truncated
    or flattened into some (fractions, bools, a 2-D array).

    Raises:
        SpecError: It is not a 1-D tensor or sequence of integers (the message starts with
            ``field``).
    """
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise SpecError(field, f"must be a 1-D tensor of row indices, got "
                                   f"{type(value).__name__} ({exc})") from exc
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise SpecError(field, f"must hold integer row indices, got dtype {value.dtype}")
    if value.dim() != 1:
        raise SpecError(field, f"must be 1-D, got shape {tuple(value.shape)}")
    return as_indices(value)


def as_tensor(value: Any, *, field: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Convert a tensor-like value once at the boundary (numpy arrays without a copy).

    A tensor with autograd history comes back detached (the same memory): rows are stored as
    values, and a copy into a column must not join the caller's graph. A conjugate or
    negative view comes back resolved (a copy holding the values it shows). A numpy array of
    the other byte order comes back in this machine's. Python numbers (lists, scalars) are
    read at full precision and, given the field's ``dtype`` of the same kind (floating point,
    integer, complex), converted to it when every value fits; tensors and arrays keep their
    dtype (the caller compares it with the field's).

    Raises:
        SpecError: The value cannot become a tensor, is a tensor without data (on the
            ``meta`` device), a sparse or nested tensor, or Python numbers that do not fit
            ``dtype`` (a float beyond its range, an integer that would wrap).
    """
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            raise SpecError(field, "is a nested tensor; rows are stored dense: pass "
                                   "value.to_padded_tensor(pad) or one tensor per field")
        if value.device.type == "meta":
            raise SpecError(field, "is a tensor on the 'meta' device, which holds no data; "
                                   "materialise it on the CPU or a GPU first")
        if value.layout != torch.strided:
            raise SpecError(field, f"is a {value.layout} tensor; rows are stored dense: "
                                   "pass value.to_dense()")
        if value.is_conj() or value.is_neg():
            value = value.resolve_conj().resolve_neg()
        return value.detach() if value.requires_grad else value
    if isinstance(value, np.ndarray):
        if value.dtype == np.bool_ or value.dtype.kind in "biufc":
            if not value.dtype.isnative:  # torch reads native byte order only
                value = value.astype(value.dtype.newbyteorder("="))
            return torch.from_numpy(np.ascontiguousarray(value))
        raise SpecError(field, f"numpy dtype {value.dtype} cannot become a tensor")
    try:
        t = _python_numbers(value)
        if t is None:
            t = torch.as_tensor(value)
    except Exception as exc:
        raise SpecError(field, f"cannot convert {type(value).__name__} to a tensor: {exc}") from exc
    return t if dtype is None else _to_field_dtype(t, dtype, field)


def _python_numbers(value: Any) -> torch.Tensor | None:
    """Python numbers (a scalar or nested lists of them) at full precision (float64, int64,
    complex128, bool), or None for anything else (torch's default conversion reads Python
    floats as float32, where a larger one becomes inf)."""
    if not isinstance(value, (list, tuple, int, float, complex)):
        return None
    arr = np.asarray(value)
    if arr.dtype == np.bool_ or arr.dtype.kind in "iufc":
        return torch.from_numpy(arr)
    return None


def _to_field_dtype(t: torch.Tensor, dtype: torch.dtype, field: str) -> torch.Tensor:
    """``t`` (read from Python numbers) as ``dtype`` when both are of one kind and every value
    fits; otherwise ``t`` unchanged (the dtype check names the mismatch)."""
    if t.dtype == dtype or t.dtype == torch.bool or dtype == torch.bool:
        return t
    kinds = (t.is_floating_point(), t.is_complex())
    if kinds != (dtype.is_floating_point, dtype.is_complex):
        return t
    out = t.to(dtype)
    if t.is_floating_point() or t.is_complex():
        lost = torch.isfinite(t) & ~torch.isfinite(out)
    else:
        lost = out.to(t.dtype) != t
    if bool(lost.any()):
        bad = t[lost].reshape(-1)[0].item()
        raise SpecError(field, f"value {bad!r} does not fit {dtype}; pass a tensor or array "
                               f"of the field's dtype, or scale the values")
    return out


def batch_rows(batch: Mapping[str, Any], *, what: str = "batch") -> int:
    """Rows of a batch whose fields must share their leading dimension (spec not needed)."""
    if not isinstance(batch, Mapping) or not batch:
        raise SpecError(None, f"{what} must be a non-empty mapping of field name to tensor")
    rows: int | None = None
    first = None
    for k, v in batch.items():
        n = len(v) if not isinstance(v, torch.Tensor) else (v.shape[0] if v.dim() else 0)
        if rows is None:
            rows, first = n, k
        elif n != rows:
            raise SpecError(k, f"has {n} rows in {what} but field {first!r} has {rows}")
    assert rows is not None
    return rows


class _FrozenDict(dict):
    """A dict that refuses mutation, so a frozen spec stays frozen."""

    def _ro(self, *a: Any, **k: Any) -> None:
        raise TypeError("ExperienceSpec.fields is read-only; use with_field() for a new spec")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _ro  # type: ignore

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        # dict's own pickling refills the copy item by item, which this class refuses.
        return (type(self), (dict(self),))
