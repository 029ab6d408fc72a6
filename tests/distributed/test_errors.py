"""Clear, typed errors before any shard starts: bad addresses, a missing Ray, bad arguments."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from conduit.distributed import (
    ClusterConnectionError,
    RayExperienceDataPlane,
    RayUnavailableError,
    ShardResources,
)
from conduit.errors import ConduitError, ConfigError
from tests.distributed.helpers import SPEC


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("address", ["not an address", "host-without-port", "10.0.0.1:99999"])
def test_a_malformed_address_names_the_field(address):
    pytest.importorskip("ray")
    with pytest.raises(ClusterConnectionError, match=r"address: .*host:port") as info:
        RayExperienceDataPlane(spec=SPEC, capacity=100, batch_size=8, address=address)
    assert info.value.field == "address" and isinstance(info.value, ConnectionError)


def test_an_address_nobody_listens_on_fails_fast():
    pytest.importorskip("ray")
    t0 = time.monotonic()
    with pytest.raises(ClusterConnectionError, match="no Ray cluster answers"):
        RayExperienceDataPlane(spec=SPEC, capacity=100, batch_size=8,
                               address=f"127.0.0.1:{free_port()}")
    assert time.monotonic() - t0 < 10


def test_a_missing_ray_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(RayUnavailableError, match=r"pip install 'conduit-rl\[ray\]'") as info:
        RayExperienceDataPlane(spec=SPEC, capacity=100, batch_size=8)
    assert isinstance(info.value, ImportError) and isinstance(info.value, ConduitError)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"replication": 4}, "replication"),
    ({"num_shards": 0}, "num_shards"),
    ({"num_learners": 0}, "num_learners"),
    ({"schedule": object()}, "schedule"),
    ({"store": object()}, "store"),
    ({"sampler": "fifo"}, "sampler"),
    ({"mode": "on_policy", "sampler": "uniform"}, "sampler"),
    ({"mode": "on_policy", "capacity": 8, "num_minibatches": 4, "num_learners": 3},
     "num_learners"),
    ({"placement": "auto"}, "placement"),
    ({"learner_device": "no-such-device"}, "learner_device"),
    ({"learner_device": "cuda:64"}, "learner_device"),
    ({"learner_device": ("cpu", "cpu"), "num_learners": 3}, "learner_device"),
    ({"learner_device": ("cpu", "cuda:64"), "num_learners": 2}, "learner_device[1]"),
    ({"batch_size": 0}, "batch_size"),
])
def test_bad_arguments_name_their_field_before_ray_starts(kwargs, field, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # proves nothing reached Ray
    args = {"spec": SPEC, "capacity": 100, "batch_size": 8, "num_shards": 3, **kwargs}
    with pytest.raises(ConfigError) as info:
        RayExperienceDataPlane(**args)
    assert info.value.field == field


def test_shard_resources_are_validated():
    with pytest.raises(ConfigError, match="num_cpus"):
        ShardResources(num_cpus=-1)
    with pytest.raises(ConfigError, match="memory"):
        ShardResources(memory=0)
    assert ShardResources(num_cpus=0.5, resources={"x": 1}).options() == {
        "num_cpus": 0.5, "num_gpus": 0.0, "resources": {"x": 1}}
