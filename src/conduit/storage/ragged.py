"""Variable-length fields without padding: one flat value pool per field, plus per-row offsets
and lengths. Rows are padded only when they are read, to the longest row of that read (one
mini-batch), never to a global maximum.

A row is addressed by its slot (its position in write order since the last :meth:`clear`), so a
fixed-shape buffer row can refer to its ragged fields with one integer column.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from conduit._checks import check_int
from conduit.errors import CapacityError, ConfigError, SpecError, StateError
from conduit.spec import RaggedFieldSpec, checked_indices

Side = Literal["left", "right"]
SMALL_READ = 16384
"""Values up to which a read of an int64 field is padded with Python lists."""
_MASK_TYPECODES = {torch.bool: "b", torch.int64: "q", torch.int32: "i", torch.int16: "h",
                   torch.uint8: "B", torch.float32: "f", torch.float64: "d"}
_MASK_DTYPES = {code: dtype for dtype, code in _MASK_TYPECODES.items()}
_NUMPY_MASK = {torch.int64: np.int64, torch.int32: np.int32, torch.uint8: np.uint8,
               torch.float32: np.float32, torch.float64: np.float64}


def _one_length(lens: Sequence[int]) -> int | None:
    """The length every row in ``lens`` (non-empty) has, or None when they differ."""
    lo = min(lens)
    return lo if lo == max(lens) else None


def _host(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view of the CPU tensor ``t``, or None for a dtype numpy lacks (bfloat16)."""
    try:
        return t.numpy()
    except (TypeError, RuntimeError):
        return None


class RaggedStore:
    """Ragged fields of up to ``capacity`` rows, packed end to end.

    Example:
        >>> store = RaggedStore(fields={"tokens": RaggedFieldSpec(torch.int64, 8)}, capacity=4)
        >>> slots = store.extend({"tokens": [[1, 2, 3], [4]]})
        >>> store.padded("tokens", slots, pad_value=0)
        tensor([[1, 2, 3], [4, 0, 0]])

    Args:
        fields: Field name -> :class:`~conduit.spec.RaggedFieldSpec`.
        capacity: Rows held until :meth:`clear`.

    Raises:
        ConfigError: No fields, a field that is not a RaggedFieldSpec, or a capacity that is
            not a positive integer (a bool is not one).
    """

    def __init__(self, *, fields: Mapping[str, RaggedFieldSpec], capacity: int) -> None:
        if not fields:
            raise ConfigError("fields", "a ragged store needs at least one field")
        for name, fs in fields.items():
            if not isinstance(fs, RaggedFieldSpec):
                raise ConfigError(f"fields[{name!r}]", f"expected a RaggedFieldSpec, got {fs!r}")
        capacity = check_int("capacity", capacity, minimum=1)
        self.fields = dict(fields)
        self.capacity = capacity
        self._rows = 0
        self._offsets = {n: torch.zeros(capacity + 1, dtype=torch.int64) for n in fields}
        # Pools grow geometrically; a full buffer of max-length rows is the upper bound.
        self._pools = {n: torch.empty(capacity * 4, dtype=fs.dtype) for n, fs in fields.items()}
        # The one length of every row of a field since the last clear (None: they differ), so
        # a read of rows that need no padding is one gather from a 2-D view of the pool.
        self._uniform: dict[str, int | None] = dict.fromkeys(fields)

    def __len__(self) -> int:
        return self._rows

    def lengths(self, name: str, slots: torch.Tensor | None = None) -> torch.Tensor:
        """Lengths of ``name`` in ``slots`` (all rows when None)."""
        off = self._offsets[self._field(name)]
        lens = off[1:self._rows + 1] - off[:self._rows]
        return lens if slots is None else lens[self._slots(slots)]

    def tokens(self, name: str) -> int:
        """Elements stored for ``name`` (the unpadded size)."""
        return int(self._offsets[self._field(name)][self._rows])

    def extend(self, rows: Mapping[str, Sequence[Any]]) -> torch.Tensor:
        """Append rows: each field a list of 1-D sequences (one per row).

        Returns:
            The rows' slots.

        Raises:
            SpecError: A field is missing or unknown, a sequence is not 1-D, has the wrong
                dtype or a length outside the field's bounds, or fields disagree on rows.
            CapacityError: More rows than ``capacity`` since the last :meth:`clear`.
        """
        unknown = [k for k in rows if k not in self.fields]
        if unknown:
            raise SpecError(unknown[0], f"unknown ragged field; the store has {list(self.fields)}")
        packed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        n: int | None = None
        for name, fs in self.fields.items():
            if name not in rows:
                raise SpecError(name, "missing from the ragged rows")
            values, lens = fs.validate(rows[name], field=name, what="ragged rows")
            if n is None:
                n = int(lens.numel())
            elif lens.numel() != n:
                raise SpecError(name, f"has {lens.numel()} rows but the other fields have {n}")
            packed[name] = (values, lens)
        assert n is not None
        return self._append_rows(packed, n)

    def extend_packed(self, packed: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
                      ) -> torch.Tensor:
        """Append rows already checked and packed by
        :meth:`~conduit.spec.RaggedFieldSpec.validate`: per field, the values end to end and
        the int64 lengths.

        Returns:
            The rows' slots.

        Raises:
            SpecError: A field is missing or unknown, lengths and values disagree, or the
                values have another dtype.
            CapacityError: More rows than ``capacity`` since the last :meth:`clear`.
        """
        if set(packed) != set(self.fields):
            raise SpecError(None, f"packed rows have fields {sorted(packed)}, the store has "
                                  f"{sorted(self.fields)}")
        n: int | None = None
        lengths: dict[str, list[int]] = {}
        for name, (values, lens) in packed.items():
            ln = lengths[name] = lens.tolist()
            if n is None:
                n = len(ln)
            if len(ln) != n or values.dim() != 1 or sum(ln) != values.numel():
                raise SpecError(name, "packed lengths and values disagree, or fields disagree "
                                      "on rows")
            if values.dtype != self.fields[name].dtype:
                raise SpecError(name, f"packed values have dtype {values.dtype}, expected "
                                      f"{self.fields[name].dtype}")
        assert n is not None
        return self._append_rows(packed, n, lengths)

    def _append_rows(self, packed: Mapping[str, tuple[torch.Tensor, torch.Tensor]], n: int,
                     lengths: Mapping[str, list[int]] | None = None) -> torch.Tensor:
        """Append ``n`` checked rows of every field (``lengths``: their lengths as lists,
        when the caller has them); their slots."""
        if self._rows + n > self.capacity:
            raise CapacityError(f"the ragged store holds {self.capacity} rows, {self._rows} are "
                                f"stored and {n} more arrived; clear it or raise capacity",
                                needed=self._rows + n, available=self.capacity)
        for name, (values, lens) in packed.items():
            self._append(name, values, lengths[name] if lengths else lens.tolist())
        start = self._rows
        self._rows += n
        return torch.arange(start, start + n, dtype=torch.int64)

    def _append(self, name: str, values: torch.Tensor, lens: list[int]) -> None:
        # Python and numpy slices: an arrival is a few hundred values, right after generation,
        # where a first (cold) torch or numpy reduction costs more than a loop over the rows
        r, k = self._rows, len(lens)
        if k:
            one = _one_length(lens)
            self._uniform[name] = one if r == 0 or self._uniform[name] == one else None
        off = self._offsets[name].numpy()
        end = int(off[r])
        need = end + int(values.numel())
        pool = self._pools[name]
        if need > pool.numel():
            grown = torch.empty(max(need, 2 * pool.numel()), dtype=pool.dtype)
            grown[:end] = pool[:end]
            self._pools[name] = pool = grown
        dst, src = _host(pool), _host(values)
        if dst is not None and src is not None:
            dst[end:need] = src
        else:
            pool[end:need] = values
        ends = array.array("q", itertools.accumulate(lens, initial=end))
        off[r:r + 1 + k] = np.frombuffer(ends, dtype=np.int64)

    def rows(self, name: str, slots: torch.Tensor) -> list[torch.Tensor]:
        """The unpadded sequences of ``name`` in ``slots`` (views of the pool)."""
        off, pool = self._offsets[self._field(name)], self._pools[name]
        return [pool[int(off[s]):int(off[s + 1])] for s in self._slots(slots).tolist()]

    def padded(self, name: str, slots: torch.Tensor, *, pad_value: float | int = 0,
               side: Side = "right", width: int | None = None) -> torch.Tensor:
        """``name`` of ``slots`` as a ``(len(slots), width)`` tensor, padded on ``side`` to the
        longest of these rows (or to ``width``).

        Raises:
            SpecError: ``width`` is shorter than one of the rows.
            ConfigError: ``side`` is neither "left" nor "right".
        """
        return self.padded_with_mask(name, slots, pad_value=pad_value, side=side,
                                     width=width)[0]

    def padded_with_mask(self, name: str, slots: torch.Tensor, *, pad_value: float | int = 0,
                         side: Side = "right", width: int | None = None,
                         mask_dtype: torch.dtype = torch.bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`padded`, and its mask: 1 (True) where a value is, 0 on padding, of
        ``mask_dtype``.

        Raises:
            SpecError: ``width`` is shorter than one of the rows; ``slots`` are not integers
                of filled slots in one dimension (field ``_slot``).
            ConfigError: ``side`` is neither "left" nor "right"; ``pad_value`` is not a value
                of the field's dtype (a fraction or a value out of range for an integer
                field).
        """
        if side not in ("left", "right"):
            raise ConfigError("side", f"must be 'left' or 'right', got {side!r}")
        name = self._field(name)
        _check_pad(pad_value, self._pools[name].dtype)
        slots = self._slots(slots)
        common = self._uniform[name]
        if common is not None and self._rows and (width is None or width == common):
            # every row has the same length: nothing to pad
            rows = self._pools[name][:self._rows * common].view(self._rows, common)
            out = rows.index_select(0, slots)
            return out, torch.ones(out.shape, dtype=mask_dtype)
        if self._pools[name].dtype == torch.int64:
            small = self._padded_small(name, slots, pad_value, side, width, mask_dtype)
            if small is not None:
                return small
        # numpy: a mini-batch is a few hundred values, where torch's per-op overhead dominates
        s = slots.numpy()
        off = self._offsets[name].numpy()
        pool = self._pools[name]
        starts = off[s]
        lens = off[s + 1] - starts
        longest = int(lens.max()) if lens.size else 0
        w = longest if width is None else width
        if w < longest:
            raise SpecError(name, f"a row of length {longest} does not fit width {w}")
        col = np.arange(w, dtype=np.int64)[None, :]
        pos = col if side == "right" else col - (w - lens)[:, None]
        valid = (pos < lens[:, None]) if side == "right" else (pos >= 0)
        src = np.where(valid, starts[:, None] + pos, 0)
        mask = torch.from_numpy(valid if mask_dtype == torch.bool else
                                valid.astype(_NUMPY_MASK.get(mask_dtype, np.int64)))
        if mask.dtype != mask_dtype:
            mask = mask.to(mask_dtype)
        if not pool.numel():
            return torch.full(src.shape, pad_value, dtype=pool.dtype), mask
        values = _host(pool)
        if values is None:  # a dtype numpy lacks (bfloat16)
            idx = torch.from_numpy(src)
            return pool[idx].masked_fill_(torch.from_numpy(~valid), pad_value), mask
        out = values[src]
        out[~valid] = pad_value
        return torch.from_numpy(out), mask

    def _padded_small(self, name: str, slots: torch.Tensor, pad_value: float | int, side: Side,
                      width: int | None, mask_dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`padded_with_mask` of an int64 field built with Python lists, for a read that
        holds at most :data:`SMALL_READ` values whatever its rows' lengths; None otherwise, or
        for a pad value that is not an int64.

        Delivery reads right after generation, when a first (cold) numpy or torch operation
        costs more than a loop over a mini-batch's tokens. ``slots`` are checked."""
        bound = width if width is not None else self.fields[name].max_length
        if (slots.numel() * bound > SMALL_READ or isinstance(pad_value, bool)
                or not isinstance(pad_value, int) or not -(1 << 63) <= pad_value < 1 << 63):
            return None
        s = slots.tolist()
        off = self._offsets[name].numpy()
        starts = [int(off[i]) for i in s]
        lens = [int(off[i + 1]) - a for i, a in zip(s, starts)]
        longest = max(lens, default=0)
        w = longest if width is None else width
        if w < longest:
            raise SpecError(name, f"a row of length {longest} does not fit width {w}")
        values = self._pools[name].numpy()
        flat: list[int] = []
        marks: list[int] = []
        for a, n in zip(starts, lens):
            pad = w - n
            if side == "right":
                flat += values[a:a + n].tolist()
                flat += [pad_value] * pad
                marks += [1] * n
                marks += [0] * pad
            else:
                flat += [pad_value] * pad
                flat += values[a:a + n].tolist()
                marks += [0] * pad
                marks += [1] * n
        shape = (len(s), w)
        if not flat:
            return (torch.empty(shape, dtype=torch.int64), torch.empty(shape, dtype=mask_dtype))
        out = torch.frombuffer(array.array("q", flat), dtype=torch.int64).view(shape)
        code = _MASK_TYPECODES.get(mask_dtype, "q")
        mask = torch.frombuffer(array.array(code, marks), dtype=_MASK_DTYPES[code]).view(shape)
        return out, (mask if mask.dtype == mask_dtype else mask.to(mask_dtype))

    def clear(self) -> None:
        """Drop every row (the pools keep their memory)."""
        self._rows = 0
        self._uniform = dict.fromkeys(self.fields)

    def state_dict(self) -> dict[str, Any]:
        """Rows, and per field the packed values and offsets (copies)."""
        return {"rows": self._rows,
                "fields": {n: {"values": self._pools[n][:self.tokens(n)].clone(),
                               "offsets": self._offsets[n][:self._rows + 1].clone()}
                           for n in self.fields}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; a refused state changes nothing.

        Raises:
            StateError: A key is missing; ``rows`` is not an integer in ``[0, capacity]``; a
                field's values are not a 1-D tensor of its dtype, or its offsets not a 1-D
                int64 tensor that describes ``rows`` rows of those values with lengths within
                the field's ``[min_length, max_length]`` (the key names the field).
        """
        rows = state.get("rows") if isinstance(state, Mapping) else None
        if isinstance(rows, bool) or not isinstance(rows, int) \
                or not 0 <= rows <= self.capacity:
            raise StateError("ragged.rows", f"expected an int in [0, {self.capacity}], got "
                                            f"{rows!r}")
        fields = state.get("fields", {})
        if not isinstance(fields, Mapping):
            raise StateError("ragged.fields", f"expected a mapping of field -> values and "
                                              f"offsets, got {type(fields).__name__}")
        for name, fs in self.fields.items():
            entry = fields.get(name)
            if not isinstance(entry, Mapping) or {"values", "offsets"} - set(entry):
                raise StateError(f"ragged.fields.{name}", "missing values or offsets")
            _check_saved_field(f"ragged.fields.{name}", fs, rows, entry["values"],
                               entry["offsets"])
        for name in self.fields:
            values, off = fields[name]["values"], fields[name]["offsets"]
            self._pools[name] = values.detach().to("cpu", copy=True)
            self._offsets[name][:rows + 1] = off
            o = self._offsets[name][:rows + 1].numpy()
            self._uniform[name] = _one_length((o[1:] - o[:-1]).tolist()) if rows else None
        self._rows = rows

    def _field(self, name: str) -> str:
        if name not in self.fields:
            raise SpecError(name, f"unknown ragged field; the store has {list(self.fields)}")
        return name

    def _slots(self, slots: torch.Tensor) -> torch.Tensor:
        slots = checked_indices(slots, "_slot")
        s = slots.tolist()  # a mini-batch's slots: Python, where a cold reduction costs more
        if s and (min(s) < 0 or max(s) >= self._rows):
            raise SpecError("_slot", f"slots must lie in [0, {self._rows}), got "
                                     f"{min(s)}..{max(s)}")
        return slots


def _check_saved_field(key: str, fs: RaggedFieldSpec, rows: int, values: Any,
                       off: Any) -> None:
    """Refuse a saved field (``values``, ``off``) that is not ``rows`` rows of ``fs``.

    Raises:
        StateError: It is not (``key`` and the part are named).
    """
    if not isinstance(values, torch.Tensor) or values.dim() != 1 or values.dtype != fs.dtype:
        got = (f"a {values.dtype} tensor of shape {tuple(values.shape)}"
               if isinstance(values, torch.Tensor) else type(values).__name__)
        raise StateError(f"{key}.values", f"expected a 1-D {fs.dtype} tensor, got {got}")
    if not isinstance(off, torch.Tensor) or off.dim() != 1 or off.dtype != torch.int64:
        got = (f"a {off.dtype} tensor of shape {tuple(off.shape)}"
               if isinstance(off, torch.Tensor) else type(off).__name__)
        raise StateError(f"{key}.offsets", f"expected a 1-D int64 tensor, got {got}")
    if (off.numel() != rows + 1 or int(off[0]) != 0 or int(off[-1]) != values.numel()
            or bool((off[1:] < off[:-1]).any())):
        raise StateError(f"{key}.offsets", f"{off.numel()} offsets do not describe {rows} "
                                           f"rows of {values.numel()} values")
    lens = off[1:] - off[:-1]
    if rows and not fs.min_length <= int(lens.min()) <= int(lens.max()) <= fs.max_length:
        raise StateError(f"{key}.offsets", f"rows of {int(lens.min())}..{int(lens.max())} "
                                           f"values, outside the field's "
                                           f"{fs.min_length}..{fs.max_length}")


def _check_pad(pad_value: Any, dtype: torch.dtype) -> None:
    """Refuse a ``pad_value`` that a field of ``dtype`` cannot hold as it is.

    Raises:
        ConfigError: It is not a real number, a fraction for an integer field, out of an
            integer field's range, or neither 0 nor 1 for a bool field.
    """
    if isinstance(pad_value, torch.Tensor) and pad_value.numel() == 1:
        pad_value = pad_value.item()
    if not isinstance(pad_value, (int, float, np.integer, np.floating)):
        raise ConfigError("pad_value", f"must be a number, got {pad_value!r}")
    if dtype.is_floating_point:
        return
    if not np.isfinite(pad_value) or pad_value != int(pad_value):
        raise ConfigError("pad_value", f"{pad_value!r} is not a whole number; the field "
                                       f"holds {dtype} values")
    info = (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    if not info[0] <= int(pad_value) <= info[1]:
        raise ConfigError("pad_value", f"{pad_value!r} is out of range for a {dtype} field "
                                       f"([{info[0]}, {info[1]}])")


__all__ = ["RaggedStore"]
