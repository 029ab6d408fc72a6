"""A Conduit RLlib replay buffer's samples: assembled from plane batches, and the target of
priority updates.

:class:`SampleAssembler` pulls the batches of one sample from the plane, throws away those
drawn for other arguments or over rows overwritten since, and joins several batches for a
sample larger than the capacity. :class:`PriorityRouter` remembers the slots and rows of the
most recent sample and gives its transitions new priorities, skipping rows overwritten since.
"""

from __future__ import annotations

import numpy as np
import torch

from conduit import ExperienceDataPlane
from conduit.errors import ConduitError, EmptyBufferError, OperatorError, PriorityError
from conduit.integrations.rllib.replay_plane import ReplayPlane
from conduit.integrations.rllib.schedule import G_MAX
from conduit.integrations.rllib.windows import Transitions


class SampleAssembler:
    """The transitions of a sample, from one or several pulls of a :class:`ReplayPlane`.

    Args:
        replay: The plane the batches are pulled from.
        seed: Seed of the choice of transitions dropped from joined batches.

    Attributes:
        discarded_batches: Delivered batches thrown away: drawn for other arguments or
            overwritten rows.
    """

    def __init__(self, replay: ReplayPlane, seed: int) -> None:
        self._replay, self._seed = replay, seed
        self.discarded_batches = 0

    def assemble(self, size: int, sampled_timesteps: int) -> tuple[Transitions, np.ndarray]:
        """``size`` transitions for the request in force, with their rows' numbers in the
        ring's order.

        The plane draws at most ``capacity`` rows a batch: a larger sample joins ``pulls``
        batches of one size and drops the surplus (fewer than ``pulls`` rows) at random
        positions, so each row kept is a draw of the sampler's own distribution.

        Args:
            size: Transitions, at least 1.
            sampled_timesteps: Timesteps the buffer sampled before (seeds the drop).

        Raises:
            EmptyBufferError: See :meth:`pull`; or nothing was added yet.
        """
        pulls = -(-size // self._replay.capacity)
        plane = self._replay.for_batch_size(-(-size // pulls))
        self._replay.schedule.sampling(plane)
        parts, rows = [], []
        for _ in range(pulls):
            pulled, pulled_rows = self.pull(plane)
            parts.append(Transitions.of(pulled))
            rows.append(pulled_rows)
        if pulls == 1:
            return parts[0], rows[0]
        total = sum(len(p.index) for p in parts)
        drop = np.random.default_rng([self._seed, 2, sampled_timesteps]).choice(
            total, total - size, replace=False)
        keep = np.delete(np.arange(total), drop)
        return Transitions.joined(parts, keep), np.concatenate(rows)[keep]

    def pull(self, plane: ExperienceDataPlane) -> tuple[dict[str, torch.Tensor], np.ndarray]:
        """The next batch drawn for the request in force with every row still in the buffer,
        and its rows' numbers in the ring's order; others are discarded (a prefetched batch
        may be either).

        Raises:
            EmptyBufferError: The draw for the request in force, over the rows in the buffer
                now, found no row with a complete n-step window.
        """
        for _ in range(4 * G_MAX + 4):
            try:
                batch = plane.pull()
            except OperatorError as exc:
                cause = exc.__cause__
                if isinstance(cause, ConduitError):
                    plane.recover()
                    raise cause from None
                raise
            sampler = self._replay.sampler
            failed = int(batch.pop("_failed")[0])
            if failed >= 0:  # no row had a complete window when it was drawn
                if failed == sampler.ring_rows and int(batch["_request"][0]) == sampler.serial:
                    raise EmptyBufferError(sampler.failure)
                self.discarded_batches += 1  # drawn before an add, or for other arguments
                continue
            # Rows overwritten by adds since the batch was delivered are stale as well.
            oldest = sampler.ring_rows - self._replay.capacity
            rows = batch.pop("_row").numpy()
            if (batch.pop("_valid").numpy().all() and (rows >= oldest).all()
                    and int(batch.pop("_request")[0]) == sampler.serial):
                return batch, rows
            self.discarded_batches += 1
        raise EmptyBufferError(f"{4 * G_MAX + 4} batches in a row were drawn for other sample "
                               f"arguments or lost rows to adds; sample with schedule='inline'")


class PriorityRouter:
    """The slots and rows of the most recent sample, and their priority updates.

    Args:
        replay: The plane whose rows were sampled.

    Attributes:
        index: The sample's slots (None: no sample since the last update).
        rows: Their rows' numbers in the ring's order (None: unknown, as after a restore).
    """

    def __init__(self, replay: ReplayPlane) -> None:
        self._replay = replay
        self.index: np.ndarray | None = None
        self.rows: np.ndarray | None = None

    def remember(self, index: np.ndarray | None, rows: np.ndarray | None) -> None:
        """Take ``index`` and ``rows`` as the most recent sample's."""
        self.index, self.rows = index, rows

    def update(self, priorities: np.ndarray | torch.Tensor) -> None:
        """Give the transitions of the most recent sample new priorities; rows overwritten
        since keep their own (see the buffer's ``update_priorities``).

        Raises:
            PriorityError: No sample to update, a length that differs from it, or
                priorities that are not finite and non-negative.
        """
        plane = self._replay.plane
        if self.index is None or plane is None:
            raise PriorityError("update_priorities: no sample since the last update")
        try:
            if isinstance(priorities, torch.Tensor):  # e.g. TD errors still in the graph
                pr = priorities.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
            else:
                pr = torch.as_tensor(np.asarray(priorities, dtype=np.float64).reshape(-1))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise PriorityError(f"priorities: must be numbers, got {priorities!r:.80} "
                                f"({exc})") from None
        if pr.numel() != len(self.index):
            raise PriorityError(f"priorities: {pr.numel()} values for the "
                                f"{len(self.index)} transitions of the last sample")
        index = self.index
        rows = self.rows
        if rows is not None and len(rows) == len(index):
            # Rows an add overwrote since the sample are gone: their slots hold new rows,
            # which keep their own priorities (a prefetched draw after the add may have
            # marked those slots delivered again, so the buffer's own check cannot tell).
            kept = rows >= self._replay.sampler.ring_rows - self._replay.capacity
            if not kept.all():
                index, pr = index[kept], pr[torch.from_numpy(kept)]
        plane.update_priorities(torch.from_numpy(index), pr)
        self.index = self.rows = None
