"""verl's mini-batch order as a Conduit on-policy sampler.

verl's actor update iterates a step's batch with ``verl.utils.tensordict_utils.make_iterator``:
a ``torch.utils.data.DataLoader`` over the row indices, of ``mini_batch_size`` rows, with one
generator seeded once per update and reused across the epochs (``shuffle`` from its
``dataloader_kwargs``). Without shuffling that is ``DataProto.split(mini_batch_size)``.
:class:`VerlOrderSampler` lays out each epoch with the same ``DataLoader`` call, so the
mini-batches Conduit delivers are the ones verl's update would draw for that seed.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from conduit.errors import ConfigError
from conduit.integrations.verl._checks import check_seed
from conduit.storage import FifoSampler


class VerlOrderSampler(FifoSampler):
    """Consume-once sampling in verl's mini-batch order.

    The layout of an epoch depends on ``(seed, epoch, size)`` only, as verl reseeds its
    iterator on every update; the iteration does not change it.

    Args:
        num_minibatches: Mini-batches per epoch; they must divide the iteration's rows.
        shuffle: verl's ``dataloader_kwargs={"shuffle": True}``; otherwise row order.
        seed: The seed verl's update passes to ``make_iterator`` (its default is 42), in
            ``[0, 2**64 - 1]`` (``torch.Generator``'s range).

    Raises:
        ConfigError: An argument is invalid; the message names it.
    """

    def __init__(self, *, num_minibatches: int = 1, shuffle: bool = False,
                 seed: int = 42) -> None:
        super().__init__(num_minibatches=num_minibatches, shuffle=shuffle,
                         seed=check_seed("seed", seed))

    def layout(self, size: int, *, iteration: int, epoch: int) -> list[torch.Tensor]:
        """The rows of each mini-batch of ``epoch``, as verl's ``DataLoader`` yields them.

        Raises:
            ConfigError: ``size`` does not split into ``num_minibatches`` equal mini-batches.
        """
        if size % self.num_minibatches:
            raise ConfigError("num_minibatches", f"{size} rows do not split into "
                                                 f"{self.num_minibatches} equal mini-batches")
        if not self.shuffle:
            return list(torch.arange(size, dtype=torch.int64).chunk(self.num_minibatches))
        generator = torch.Generator()
        generator.manual_seed(self.seed)
        loader = DataLoader(torch.arange(size), batch_size=size // self.num_minibatches,
                            shuffle=True, generator=generator, collate_fn=lambda rows: rows)
        for _ in range(epoch):
            for _batch in loader:
                pass
        return [torch.stack(rows).to(torch.int64) for rows in loader]
