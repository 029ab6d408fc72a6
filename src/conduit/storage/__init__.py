"""Storage layer: where rows live and which rows a batch reads (``docs/design.md §7``).

A store executes a :class:`Placement` it is given; storage knows nothing of scheduling.
"""

from conduit.storage.buffer import ExperienceBuffer
from conduit.storage.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    read_checkpoint,
    write_checkpoint,
)
from conduit.storage.column_store import (
    ColumnStore,
    GatherOutputs,
    ShardedStore,
    Store,
    make_store,
)
from conduit.storage.layout import Placement
from conduit.storage.memmap_store import MemmapColumnStore
from conduit.storage.samplers import (
    FifoSampler,
    PrioritizedSampler,
    SampleInfo,
    Sampler,
    SequenceSampler,
    UniformSampler,
    sampler_from_config,
)
from conduit.storage.snapshot import RowSnapshot
from conduit.storage.sum_tree import SumTree
from conduit.storage.threads import data_path_threads
from conduit.storage.writer import RingWriter

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "ColumnStore",
    "ExperienceBuffer",
    "FifoSampler",
    "GatherOutputs",
    "MemmapColumnStore",
    "Placement",
    "PrioritizedSampler",
    "RingWriter",
    "RowSnapshot",
    "SampleInfo",
    "Sampler",
    "SequenceSampler",
    "ShardedStore",
    "Store",
    "SumTree",
    "UniformSampler",
    "data_path_threads",
    "make_store",
    "read_checkpoint",
    "sampler_from_config",
    "write_checkpoint",
]
