"""Sampling n-step windows through the plane: the sampler that draws them and the delivery
operator that turns the gathered rows into transitions.

A draw may run ahead of the learner on the plane's delivery worker (prefetch), while the
caller adds episodes. Adds hold :attr:`EpisodeRows.lock` while they change links and ring
together; the delivery operator holds it while it lays the windows over the rows, so every
delivered transition is what RLlib's buffer returns for its row at delivery time. A row that
was overwritten between its draw and its delivery is marked invalid (``_valid``), and the
caller draws again; so is a delivered batch holding a row that an add overwrote before the
caller took the batch (each row carries its row number at the draw, ``_row``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from conduit.errors import ConfigError, SpecError
from conduit.integrations.rllib.episode_rows import EpisodeRows, NStep, Window
from conduit.spec import Batch
from conduit.storage import PrioritizedSampler, SampleInfo, Sampler
from conduit.storage.state import JSON, StateDict, entry, integer


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


@dataclass(frozen=True)
class WindowRequest:
    """What a draw is for.

    Attributes:
        n_step: Steps per window, or a range ``[low, high)`` drawn per row.
        gamma: Discount of the reward sums.
        complete: Redraw rows whose window would be cut short (RLlib's prioritized buffer).
        beta: Importance-weight exponent of a prioritized inner sampler (None: leave it).
    """

    n_step: NStep = 1
    gamma: float = 0.99
    complete: bool = False
    beta: float | None = None

    def __post_init__(self) -> None:
        """Raises ConfigError naming ``n_step``, ``gamma`` or ``beta`` for a value that
        cannot make windows (RLlib's own buffers fail on them with an IndexError or worse)."""
        n = self.n_step
        if isinstance(n, Sequence) and not isinstance(n, str):
            if (len(n) != 2 or not all(_is_int(k) for k in n)
                    or not 1 <= int(n[0]) < int(n[1])):
                raise ConfigError("n_step", f"a range must be two integers (low, high) with "
                                            f"1 <= low < high (high excluded), got {n!r}")
            object.__setattr__(self, "n_step", (int(n[0]), int(n[1])))
        elif not (_is_int(n) and int(n) >= 1):
            raise ConfigError("n_step", f"must be an integer >= 1 or a range (low, high), got "
                                        f"{n!r}")
        else:
            object.__setattr__(self, "n_step", int(n))
        if not (isinstance(self.gamma, (int, float, np.floating)) and math.isfinite(self.gamma)):
            raise ConfigError("gamma", f"must be a finite number, got {self.gamma!r}")
        if self.beta is not None and not (math.isfinite(self.beta) and self.beta >= 0):
            raise ConfigError("beta", f"must be a finite number >= 0, got {self.beta!r}")

    def draw_n(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """The n-step of ``size`` rows."""
        if isinstance(self.n_step, Sequence):
            low, high = self.n_step
            return rng.integers(low, high, size=size)
        return np.full(size, self.n_step, dtype=np.int64)


@dataclass(frozen=True)
class Drawn:
    """One draw, waiting for its delivery.

    Attributes:
        window: The windows as the links stood at the draw.
        next_slots: Slot of the row after each window's end at the draw (-1: none, the next
            observation is a tail).
        request: What the draw was for.
        serial: The request's serial number (see :meth:`WindowSampler.set_request`).
        ring_rows: Rows the ring had received at the draw.
        failed: No row had a complete window (see :attr:`WindowSampler.failure`).
    """

    window: Window
    next_slots: np.ndarray
    request: WindowRequest
    serial: int
    ring_rows: int
    failed: bool = False


class WindowSampler(Sampler):
    """Draws rows with an inner sampler and lays n-step windows over them.

    A draw returns each row's first slot and the slot of the row after its window's end as a
    second column (``[B, 2]``; the first slot again where the window ends its stored episode),
    so one gather reads the observation and action at the start and the next observation.
    Each draw waits in :attr:`drawn`, keyed by ``id`` of its index tensor (the delivered
    ``_index``), for :func:`deliver_windows`. Call :meth:`set_request` before a pull; a draw
    uses the request in force when it runs.

    Args:
        inner: Draws the rows (uniform or prioritized); priorities and state are its own.
        rows: The links the windows follow.
        max_rounds: Redraw rounds before a draw takes the rows it still needs among the rows
            with a complete window.
    """

    def __init__(self, inner: Sampler, rows: EpisodeRows, *, max_rounds: int = 1000) -> None:
        super().__init__(seed=inner.seed)
        self._rng = np.random.default_rng([inner.seed, 1])  # a stream apart from inner's
        self.inner, self.rows, self.max_rounds = inner, rows, max_rounds
        self.invalidates_prefetch = inner.invalidates_prefetch
        self._request: tuple[int, WindowRequest] = (0, WindowRequest())
        self.drawn: dict[int, Drawn] = {}
        #: Rows redrawn because their window was cut short, over the sampler's life.
        self.resamples = 0
        #: Rows the ring has received (counted on write, under the buffer's lock).
        self.ring_rows = 0
        #: Why the latest failed draw found no row (see :func:`deliver_windows`).
        self.failure = ""

    @property
    def request(self) -> WindowRequest:
        """The request draws are made for."""
        return self._request[1]

    @property
    def serial(self) -> int:
        """Serial number of :attr:`request`; it grows whenever the request changes."""
        return self._request[0]

    def set_request(self, request: WindowRequest) -> None:
        """Make draws for ``request`` from now on (batches drawn for another one are stale)."""
        serial, current = self._request
        if request != current:
            self._request = (serial + 1, request)  # one assignment: a worker reads either

    def invalidate(self) -> None:
        """Make every batch drawn so far stale (the next draws get a new :attr:`serial`)."""
        serial, request = self._request
        self._request = (serial + 1, request)

    def bind(self, capacity: int) -> None:
        super().bind(capacity)
        self.inner.bind(capacity)

    def on_write(self, indices: torch.Tensor, batch: Batch, *, size: int) -> None:
        self.ring_rows += len(indices)
        self.inner.on_write(indices, batch, size=size)

    def update_priorities(self, indices: torch.Tensor, priorities: torch.Tensor) -> None:
        self.inner.update_priorities(indices, priorities)

    def sample(self, size: int, batch_size: int) -> SampleInfo:
        """Draw ``batch_size`` rows; with ``request.complete``, only rows whose window holds
        all of its ``n`` steps (as the links read now; the delivery checks them again), as
        RLlib's prioritized buffer does by redrawing. When ``max_rounds`` redraw rounds find
        too few, the rest are drawn among the rows that have a complete window (with their
        own priorities, and the importance weights of those priorities, as the redraws give
        them). When no row has one, the draw is marked failed (:attr:`failure`; its rows
        are delivered invalid) rather than raising on the worker that drew it ahead.
        """
        serial, req = self._request
        if req.beta is not None and hasattr(self.inner, "beta"):
            self.inner.beta = float(req.beta)
        starts, n, weights = [], [], []
        need = batch_size
        for _ in range(self.max_rounds):
            info = self.inner.sample(size, need)
            idx = info.indices.numpy()
            rows_n = req.draw_n(self._rng, len(idx))
            weight = None if info.weights is None else _host(info.weights)
            if req.complete:
                keep = self.rows.complete(idx, rows_n)
                if not keep.all():
                    idx, rows_n = idx[keep], rows_n[keep]
                    weight = None if weight is None else weight[keep]
                    self.resamples += len(keep) - len(idx)
            starts.append(idx)
            n.append(rows_n)
            if weight is not None:
                weights.append(weight)
            need -= len(idx)
            if need == 0:
                break
        else:
            drawn = self._among_complete(size, need, req)
            if drawn is None:
                return self._failed(size, batch_size, req, serial)
            starts.append(drawn[0])
            n.append(drawn[1])
            if drawn[2] is not None:
                weights.append(_host(drawn[2]))
        if len(starts) > 1:  # rows were redrawn
            starts, n = [np.concatenate(starts)], [np.concatenate(n)]
        window = self.rows.windows(starts[0], n[0])
        nxt = self.rows.next_of(window.end)
        pairs = np.empty((len(nxt), 2), dtype=np.int64)  # start, and the row after the end
        pairs[:, 0] = window.starts
        pairs[:, 1] = np.where(nxt >= 0, nxt, window.starts)
        indices = torch.from_numpy(pairs)
        self.drawn[id(indices)] = Drawn(window, nxt, req, serial, self.ring_rows)
        return SampleInfo(indices, torch.from_numpy(
            weights[0] if len(weights) == 1 else np.concatenate(weights)) if weights else None)

    def _among_complete(self, size: int, need: int, req: WindowRequest
                        ) -> tuple[np.ndarray, np.ndarray, torch.Tensor | None] | None:
        """``need`` rows drawn among those of the first ``size`` slots with a complete window
        (for a range of n-steps: pairs of row and n-step), by their priorities if the inner
        sampler keeps them: what redrawing until a row has one gives. Importance weights are
        the inner sampler's for each row, ``(P_min / P(i))^β`` over all rows (RLlib's buffer
        likewise weighs a redrawn row by its probability among all rows). None when no row
        has a complete window."""
        slots = np.arange(size, dtype=np.int64)
        choices = ([req.n_step] if isinstance(req.n_step, int)
                   else list(range(req.n_step[0], req.n_step[1])))
        pairs = [(slots[ok], np.full(int(ok.sum()), k, dtype=np.int64)) for k in choices
                 for ok in [self.rows.complete(slots, np.full(size, k, dtype=np.int64))]]
        cand = np.concatenate([p[0] for p in pairs])
        cand_n = np.concatenate([p[1] for p in pairs])
        if not len(cand):
            return None
        if not isinstance(self.inner, PrioritizedSampler):
            pick = self._rng.integers(len(cand), size=need)
            return cand[pick], cand_n[pick], None
        tree = self.inner.tree
        leaves = self.inner.priorities(torch.from_numpy(cand)).numpy().astype(np.float64)
        pick = self._rng.choice(len(cand), size=need, p=leaves / leaves.sum())
        beta = float(self.inner.beta)
        with np.errstate(divide="ignore", over="ignore"):
            weight = np.power(tree.min / np.maximum(leaves[pick], 1e-300), beta)
        return cand[pick], cand_n[pick], torch.from_numpy(weight.astype(np.float32))

    def _failed(self, size: int, batch_size: int, req: WindowRequest,
                serial: int) -> SampleInfo:
        """A draw that found no row with a complete window: slot 0, marked failed for its
        delivery (see :attr:`failure`)."""
        self.failure = (f"no row among the {size} in the buffer starts a complete "
                        f"{req.n_step}-step window (each ends its stored episode first); add "
                        f"longer episodes or lower n_step")
        starts = np.zeros(batch_size, dtype=np.int64)
        window = self.rows.windows(starts, np.ones(batch_size, dtype=np.int64))
        indices = torch.zeros((batch_size, 2), dtype=torch.int64)
        self.drawn[id(indices)] = Drawn(window, np.full(batch_size, -1, dtype=np.int64), req,
                                        serial, self.ring_rows, failed=True)
        return SampleInfo(indices, torch.ones(batch_size) if isinstance(
            self.inner, PrioritizedSampler) else None)

    def reset(self) -> None:
        self.inner.reset()
        self.drawn.clear()

    def config(self) -> dict[str, JSON]:
        return self.inner.config()

    def state_dict(self) -> StateDict:
        return {**super().state_dict(), "inner": self.inner.state_dict(),
                "ring_rows": self.ring_rows}

    def load_state_dict(self, state: StateDict) -> None:
        super().load_state_dict(state)
        self.inner.load_state_dict(entry(state, "inner", "sampler"))
        self.ring_rows = integer(state, "ring_rows", "sampler")
        self.drawn.clear()


@dataclass(frozen=True)
class Transitions:
    """A delivered batch of n-step transitions, as numpy arrays of ``B`` rows."""

    obs: np.ndarray
    action: np.ndarray
    next_obs: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    n_step: np.ndarray
    episode: np.ndarray
    t: np.ndarray
    index: np.ndarray
    weight: np.ndarray | None = field(default=None)

    @classmethod
    def of(cls, batch: Batch) -> Transitions:
        """From a batch pulled from the plane (see :func:`deliver_windows`), without its
        ``_request``, ``_valid``, ``_row`` and ``_failed`` columns."""
        arrays = {k.lstrip("_"): v.numpy() for k, v in batch.items()
                  if k not in ("_request", "_valid", "_row", "_failed")}
        return cls(**arrays)

    @classmethod
    def joined(cls, parts: Sequence[Transitions], keep: np.ndarray | None = None
               ) -> Transitions:
        """The rows of ``parts`` in order, as one batch; with ``keep``, only the rows at those
        positions of it (in the order ``keep`` gives)."""
        names = [f.name for f in fields(cls)]
        cols = {k: (None if getattr(parts[0], k) is None else
                    getattr(parts[0], k) if len(parts) == 1 else
                    np.concatenate([getattr(p, k) for p in parts])) for k in names}
        if keep is not None:
            cols = {k: None if v is None else v[keep] for k, v in cols.items()}
        return cls(**cols)


def _host(weights: torch.Tensor) -> np.ndarray:
    """Importance weights as a host array (the tensor's own memory where it is on the host)."""
    return weights.numpy() if weights.device.type == "cpu" else weights.cpu().numpy()


def _row_ids(slots: np.ndarray, ring_rows: int, capacity: int) -> np.ndarray:
    """The row each slot held when the ring had received ``ring_rows`` rows."""
    return slots + capacity * ((ring_rows - 1 - slots) // capacity)


def deliver_windows(sampler: WindowSampler, rows: Batch,
                    gather_obs: Callable[[np.ndarray], torch.Tensor]) -> Batch:
    """Training rows for a draw of ``sampler``: observation and action at each window's start,
    the observation after its end, discounted reward sum, end flags, n-step, episode and
    timestep, ``_index`` (the start slots, for priority updates), ``_weight`` if any,
    ``_request`` (the serial of the request it was drawn for), ``_valid`` and ``_row`` (the
    row number of each start: the row is still in the buffer while ``_row >= ring rows -
    capacity``), and ``_failed``: -1, or for a draw that found no row with a complete
    window the rows the ring had received at the draw (its rows are all invalid; the
    sampler's ``failure`` says why).

    The windows are laid over the links as they stand now, under the rows' lock. The next
    observation is the gathered row after the window's end; where that row is another one now
    (an add continued the episode, or the draw read links an add was writing), it is gathered
    again with ``gather_obs(slots)``, and where the window ends the stored episode it is the
    episode's tail. A row is invalid when it was overwritten since its draw, or when a
    complete window was asked for and it no longer has one.

    Raises:
        SpecError: ``rows`` was not drawn by ``sampler``.
    """
    drawn = sampler.drawn.pop(id(rows["_index"]), None)
    if drawn is None:
        raise SpecError("_index", "the delivered rows were not drawn by this WindowSampler")
    links, req = sampler.rows, drawn.request
    obs = rows["obs"]
    next_obs = obs[:, 1]
    starts, n = drawn.window.starts, drawn.window.n
    with links.lock:
        cap = links.capacity
        start_id = _row_ids(starts, drawn.ring_rows, cap)
        valid = start_id >= sampler.ring_rows - cap
        window = links.windows(starts, n)
        if req.complete:
            valid &= window.length == n
        if drawn.failed:
            valid[:] = False
        nxt = links.next_of(window.end)
        tail = valid & (nxt < 0)
        moved = valid & (nxt >= 0) & ((nxt != drawn.next_slots) | (
            _row_ids(drawn.next_slots, drawn.ring_rows, cap) < start_id))
        # The gathered rows are this delivery's own: the next observations are set in place
        # (through numpy where they are on the host: torch's masked assignment costs more).
        host = next_obs.numpy() if next_obs.device.type == "cpu" else None
        if moved.any():
            again = gather_obs(nxt[moved])
            if host is not None:
                host[moved] = again.cpu().numpy()
            else:
                next_obs[torch.from_numpy(moved)] = again.to(next_obs.device)
        if tail.any():
            tails = links.tails_of(window.end[tail])
            if host is not None:
                host[tail] = tails
            else:
                next_obs[torch.from_numpy(tail)] = torch.from_numpy(tails).to(next_obs.device)
        reward, terminated, truncated = links.returns(window, req.gamma)
        episode, t = links.episode[starts], links.t[starts]
    out = {"obs": obs[:, 0], "action": rows["action"][:, 0],
           "next_obs": next_obs,
           "reward": torch.from_numpy(reward), "terminated": torch.from_numpy(terminated),
           "truncated": torch.from_numpy(truncated), "n_step": torch.from_numpy(n),
           "episode": torch.from_numpy(episode), "t": torch.from_numpy(t),
           "_index": torch.from_numpy(starts),
           "_request": torch.from_numpy(np.full(len(starts), drawn.serial, dtype=np.int64)),
           "_valid": torch.from_numpy(valid), "_row": torch.from_numpy(start_id),
           "_failed": torch.from_numpy(np.full(len(starts), drawn.ring_rows if drawn.failed
                                               else -1, dtype=np.int64))}
    if "_weight" in rows:
        out["_weight"] = rows["_weight"]
    return out
