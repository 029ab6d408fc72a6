"""Storage layer: where rows live and which rows a batch reads. Knows nothing of scheduling."""

from conduit.storage.buffer import ExperienceBuffer
from conduit.storage.column_store import ColumnStore, ShardedStore, Store, make_store
from conduit.storage.layout import Placement
from conduit.storage.samplers import (
    FifoSampler,
    PrioritizedSampler,
    SampleInfo,
    Sampler,
    SequenceSampler,
    UniformSampler,
)
from conduit.storage.sum_tree import SumTree
from conduit.storage.threads import data_path_threads
from conduit.storage.writer import RingWriter

__all__ = [
    "ColumnStore",
    "ExperienceBuffer",
    "FifoSampler",
    "Placement",
    "PrioritizedSampler",
    "RingWriter",
    "SampleInfo",
    "Sampler",
    "SequenceSampler",
    "ShardedStore",
    "Store",
    "SumTree",
    "UniformSampler",
    "data_path_threads",
    "make_store",
]
