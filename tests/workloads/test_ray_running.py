"""ray_running() starts its own local Ray unless given an address: a cluster that happens to
run on the machine (the latest `ray start`, another process's test cluster) is never joined."""

from __future__ import annotations

import pytest

from conduit.workloads.actors import ray_running


@pytest.mark.parametrize(("address", "expected"),
                         [("", "local"), ("10.0.0.1:6379", "10.0.0.1:6379")])
def test_without_an_address_a_local_ray_is_started(monkeypatch, address, expected):
    ray = pytest.importorskip("ray")
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    with ray_running(address):
        pass
    assert calls[0]["address"] == expected and calls[-1] == "shutdown"
