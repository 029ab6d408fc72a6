"""Where a store's memory lives: the placement descriptor that storage executes.

The placement layer *decides* (see :mod:`conduit.placement`); storage only reads this
descriptor. Keeping it here lets every store be built for any placement without the storage
layer importing the planner.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from conduit.errors import PlacementError

PlacementKind = Literal["pageable", "pinned", "device", "sharded"]
_KINDS = ("pageable", "pinned", "device", "sharded")


@dataclass(frozen=True)
class Placement:
    """Where buffer state resides.

    Use the named constructors: :meth:`pageable`, :meth:`pinned`, :meth:`device`,
    :meth:`sharded`.

    Attributes:
        kind: ``"pageable"`` (CPU, ordinary memory), ``"pinned"`` (CPU, page-locked),
            ``"device"`` (one accelerator), ``"sharded"`` (rows split over several devices).
        devices: Device names (``"cpu"``, ``"cuda:0"``...). One for every kind but sharded.
        shares: For sharded placements, the fraction of rows on each device (each > 0, sum
            1).

    Raises:
        PlacementError: An unknown kind or device, ``devices`` that is not a list or tuple of
            device names (a bare string such as ``"cpu"`` or None is refused), the wrong
            number of devices for the kind, or shares that are not finite, positive and
            summing to 1.
    """

    kind: PlacementKind
    devices: tuple[str, ...] = ("cpu",)
    shares: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise PlacementError(f"placement.kind: {self.kind!r} is not one of {_KINDS}")
        if not isinstance(self.devices, (list, tuple)):
            raise PlacementError(f"placement.devices: must be a sequence of device names such "
                                 f"as ('cpu',) or ('cuda:0', 'cuda:1'), got {self.devices!r}")
        devs = tuple(str(d) for d in self.devices)
        if not devs:
            raise PlacementError("placement.devices: at least one device is needed")
        for d in devs:
            try:
                torch.device(d)
            except (RuntimeError, TypeError) as exc:
                raise PlacementError(f"placement.devices: {d!r} is not a device name "
                                     f"(try 'cpu' or 'cuda:0')") from exc
        object.__setattr__(self, "devices", devs)
        if self.kind in ("pageable", "pinned") and (
                any(torch.device(d).type != "cpu" for d in devs) or len(devs) != 1):
            raise PlacementError(f"placement.devices: a {self.kind} placement lives on "
                                 f"exactly one 'cpu' device, got {devs}")
        if self.kind == "device" and len(devs) != 1:
            raise PlacementError(f"placement.devices: a device placement takes one device, "
                                 f"got {devs}; use Placement.sharded for several")
        if self.kind == "sharded":
            shares = self.shares or tuple(1.0 / len(devs) for _ in devs)
            if not isinstance(shares, (list, tuple)):
                raise PlacementError(f"placement.shares: must be a sequence of numbers, one "
                                     f"per device, such as (0.5, 0.5), got {shares!r}")
            if len(shares) != len(devs):
                raise PlacementError(f"placement.shares: {len(shares)} shares for "
                                     f"{len(devs)} devices")
            if any(isinstance(s, bool) or not isinstance(s, numbers.Real)
                   or not (math.isfinite(s) and s > 0) for s in shares) \
                    or abs(sum(shares) - 1.0) > 1e-6:
                raise PlacementError(f"placement.shares: must be finite numbers > 0 (one per "
                                     f"device) that sum to 1, got {shares}")
            object.__setattr__(self, "shares", tuple(float(s) for s in shares))
        elif self.shares is not None:
            raise PlacementError("placement.shares: only sharded placements take shares")

    @classmethod
    def pageable(cls) -> Placement:
        """Ordinary CPU memory (Reverb's placement)."""
        return cls(kind="pageable", devices=("cpu",))

    @classmethod
    def pinned(cls) -> Placement:
        """Page-locked CPU memory (GEAR's placement); falls back to pageable without CUDA."""
        return cls(kind="pinned", devices=("cpu",))

    @classmethod
    def device(cls, device: str | torch.device) -> Placement:
        """One device, for example ``"cuda:0"`` (``"cpu"`` is allowed and means pageable)."""
        return cls(kind="device", devices=(str(device),))

    @classmethod
    def sharded(cls, devices: list[str] | tuple[str, ...],
                shares: tuple[float, ...] | None = None) -> Placement:
        """Rows split over ``devices`` (even split unless ``shares`` says otherwise).

        Raises:
            PlacementError: As the constructor (``devices`` must be a list or tuple).
        """
        return cls(kind="sharded", devices=devices, shares=shares)

    @property
    def primary_device(self) -> torch.device:
        """The first device: where a single-device store allocates."""
        return torch.device(self.devices[0])

    @property
    def is_pinned(self) -> bool:
        """True when host memory should be page-locked (and CUDA can pin it)."""
        return self.kind == "pinned"

    def label(self) -> str:
        """Short human-readable name, for tables."""
        if self.kind == "sharded":
            return f"sharded[{','.join(self.devices)}]"
        if self.kind == "device":
            return f"device[{self.devices[0]}]"
        return self.kind

    def to_dict(self) -> dict:
        """JSON-friendly description."""
        return {"kind": self.kind, "devices": list(self.devices),
                "shares": list(self.shares) if self.shares else None}

    @classmethod
    def from_dict(cls, d: dict) -> Placement:
        """Inverse of :meth:`to_dict`.

        Raises:
            PlacementError: ``d`` is not a mapping, lacks a key, or describes no valid
                placement (as the constructor).
        """
        if not isinstance(d, Mapping):
            raise PlacementError(f"placement: expected a mapping with keys 'kind', 'devices' "
                                 f"and 'shares', got {d!r}")
        try:
            return cls(kind=d["kind"], devices=d["devices"], shares=d.get("shares") or None)
        except KeyError as exc:
            raise PlacementError(f"placement: missing key {exc.args[0]!r}") from exc


def split_rows(total: int, shares: Sequence[float]) -> list[int]:
    """Rows of a ``total``-row buffer per share: largest-remainder rounding, so the counts sum
    exactly to ``total`` and each is within one row of ``total * share`` (the layout a sharded
    store allocates, and the one capacity checks and transfer plans count)."""
    raw = [total * s for s in shares]
    out = [math.floor(r) for r in raw]
    rest = total - sum(out)
    order = sorted(range(len(raw)), key=lambda k: (-(raw[k] - out[k]), k))
    for k in order[:rest]:
        out[k] += 1
    return out
