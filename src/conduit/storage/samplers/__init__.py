"""Samplers: which rows a batch reads, one per module. Each works with any store.

Samplers draw CPU ``int64`` indices from their own seeded numpy generator, independent of where
the store lives, so the same seed gives the same batches on pageable, pinned, GPU and sharded
stores.
"""

import inspect
from collections.abc import Mapping

from conduit.errors import ConfigError
from conduit.storage.samplers.base import SampleInfo, Sampler
from conduit.storage.samplers.fifo import FifoSampler
from conduit.storage.samplers.prioritized import PrioritizedSampler
from conduit.storage.samplers.sequence import SequenceSampler
from conduit.storage.samplers.uniform import UniformSampler
from conduit.storage.state import JSON

BUILT_IN: dict[str, type[Sampler]] = {
    cls.__name__: cls for cls in (UniformSampler, PrioritizedSampler, FifoSampler, SequenceSampler)
}


def sampler_from_config(kind: str, config: dict[str, JSON]) -> Sampler:
    """A built-in sampler from its class name and :meth:`Sampler.config`.

    Raises:
        ConfigError: ``kind`` is not a built-in sampler (pass the sampler itself instead), or
            ``config`` is not a mapping of its constructor's keyword arguments (an unknown
            key, or a required one missing), field ``sampler``; or a value the constructor
            refuses (its field).
    """
    cls = BUILT_IN.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ConfigError("sampler", f"{kind!r} is not a built-in sampler ({sorted(BUILT_IN)}); "
                                     f"pass sampler= with an instance of it")
    if not isinstance(config, Mapping) or not all(isinstance(k, str) for k in config):
        raise ConfigError("sampler", f"the config of {kind} must be a mapping of its "
                                     f"constructor's keyword arguments, got {config!r}")
    try:
        inspect.signature(cls).bind(**config)
    except TypeError as e:
        raise ConfigError("sampler", f"config {dict(config)!r} does not fit {kind}: {e}; "
                                     f"pass the keys of {kind}.config()") from None
    return cls(**config)


__all__ = [
    "BUILT_IN",
    "FifoSampler",
    "PrioritizedSampler",
    "SampleInfo",
    "Sampler",
    "SequenceSampler",
    "UniformSampler",
    "sampler_from_config",
]
