"""The pushes of a GRPO iteration: the rows each reserved, the tokens of those ingested, their
rewards and advantages, and the withdrawal of the pushes a failure lost.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from conduit.errors import StateError
from conduit.storage.ragged import RaggedStore


def joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts`` end to end; a single part as it is (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


@dataclass
class PushUnit:
    """Groups pushed together: their first row in generation order, the sequences as given
    (for the scorer) and packed."""

    first: int
    prompt_ids: Sequence[Sequence[int]]
    completion_ids: Sequence[Sequence[int]]
    prompts: tuple[torch.Tensor, torch.Tensor]
    completions: tuple[torch.Tensor, torch.Tensor]
    payload: Any



class IterationPushes:
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
        self.units: dict[int, PushUnit] = {}
        self.pushed = 0  # rows reserved by the pushes not withdrawn
        self.rewards = torch.full((rows,), float("nan"))
        self.advantages = torch.zeros(rows)
        self._serial = 0
        self._lost: int | None = None  # first row of the earliest lost push
        self._lost_to: BaseException | None = None  # the failure that lost it
        self._spent: list[dict[int, PushUnit]] = []  # earlier iterations' arrivals, to free

    def restart(self) -> None:
        """Empty, for the next iteration (the last one's arrivals wait for
        :meth:`free_spent`)."""
        with self.lock:
            self.ragged.clear()
            self._spent.append(self.units)
            self.units, self.pushed, self._lost, self._lost_to = {}, 0, None, None
        self.rewards = torch.full((self._rows,), float("nan"))
        self.advantages = torch.zeros(self._rows)

    def add(self, unit: PushUnit) -> int:
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

    def live(self, serials: Sequence[int]) -> list[PushUnit]:
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

    def pack(self, serials: Sequence[int], units: Sequence[PushUnit]) -> None:
        """Append the tokens of ``units`` (pushes ``serials``, consecutive), packed as one.

        Raises:
            StateError: They are not the next rows, or one was withdrawn meanwhile.
        """
        packed = {name: tuple(joined(parts) for parts in zip(
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



__all__ = ["IterationPushes", "PushUnit", "joined"]
