"""Eq. 1: the transfer model and the capacity constraint."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conduit.errors import ConfigError, PlacementError
from conduit.placement import (
    Candidate,
    check_capacity,
    endpoint_shares,
    placement_memory,
    preset,
    transfer_estimate,
    transfer_time,
)
from conduit.storage.layout import Placement

A100 = preset("a100-8")


def test_single_device_is_sum_of_two_legs() -> None:
    x = 40_000.0
    t = transfer_time(Placement.device("cuda:0"), x=x, actor_device="cpu",
                      learner_device="cuda:0", topology=A100)
    expected = x / A100.bandwidth("cpu", "cuda:0") + x / A100.bandwidth("cuda:0", "cuda:0")
    assert t == pytest.approx(expected)
    t3 = transfer_time(Placement.device("cuda:3"), x=x, actor_device="cpu",
                       learner_device="cuda:0", topology=A100)
    assert t3 == pytest.approx(x / A100.bandwidth("cpu", "cuda:3")
                               + x / A100.bandwidth("cuda:3", "cuda:0"))
    assert t < t3  # the learner's own GPU avoids the peer hop


def test_pinned_uses_pinned_endpoint() -> None:
    x = 1000.0
    est = transfer_estimate(Placement.pinned(), x=x, actor_device="cpu",
                            learner_device="cuda:0", topology=A100)
    assert est.ingest_s == pytest.approx(x / A100.bandwidth("cpu", "cpu_pinned"))
    assert est.deliver_s == pytest.approx(x / A100.bandwidth("cpu_pinned", "cuda:0"))
    assert endpoint_shares(Placement.pinned(), A100) == (("cpu_pinned", 1.0),)


def test_sharded_mixture_matches_paper_example() -> None:
    """8 shards, learner on one of them: local w.p. 1/8, peer-to-peer w.p. 7/8."""
    x = 4096.0
    p = Placement.sharded([f"cuda:{i}" for i in range(8)])
    est = transfer_estimate(p, x=x, actor_device="cpu", learner_device="cuda:0", topology=A100)
    local = A100.bandwidth("cuda:0", "cuda:0")
    peer = A100.bandwidth("cuda:1", "cuda:0")
    assert est.deliver_s == pytest.approx(x * (1 / 8 / local + 7 / 8 / peer))
    assert est.ingest_s == pytest.approx(x / A100.bandwidth("cpu", "cuda:0"))
    # the mixture equals x over the harmonic mean of bandwidths
    harmonic = 1.0 / (1 / 8 / local + 7 / 8 / peer)
    assert est.deliver_s == pytest.approx(x / harmonic)


def test_uneven_shares_weight_the_mixture() -> None:
    x = 1.0
    p = Placement.sharded(["cuda:0", "cuda:1"], shares=(0.75, 0.25))
    est = transfer_estimate(p, x=x, actor_device="cpu", learner_device="cuda:0", topology=A100)
    assert est.deliver_s == pytest.approx(0.75 / 1000e9 + 0.25 / 300e9)


@settings(max_examples=30, deadline=None)
@given(x=st.floats(min_value=1.0, max_value=1e7), k=st.integers(min_value=1, max_value=8))
def test_time_is_linear_in_x(x: float, k: int) -> None:
    p = Placement.sharded([f"cuda:{i}" for i in range(k)]) if k > 1 else Placement.device("cuda:0")
    t1 = transfer_time(p, x=1.0, actor_device="cpu", learner_device="cuda:0", topology=A100)
    tx = transfer_time(p, x=x, actor_device="cpu", learner_device="cuda:0", topology=A100)
    assert tx == pytest.approx(x * t1, rel=1e-9)


def test_capacity_check_single_and_sharded() -> None:
    mem = A100.memory("cuda:0")
    c = check_capacity(Placement.device("cuda:0"), capacity=1000, x=mem / 1000, topology=A100)
    assert c.fits and c.available_bytes == mem
    c = check_capacity(Placement.device("cuda:0"), capacity=1000, x=mem / 1000 + 1,
                       topology=A100)
    assert not c.fits and c.limiting_device == "cuda:0"
    two = Placement.sharded(["cuda:0", "cuda:1"])
    assert placement_memory(two, A100) == pytest.approx(2 * mem)
    assert check_capacity(two, capacity=1000, x=1.9 * mem / 1000, topology=A100).fits
    # uneven: the device with the larger share fills first
    skew = Placement.sharded(["cuda:0", "cuda:1"], shares=(0.8, 0.2))
    assert placement_memory(skew, A100) == pytest.approx(mem / 0.8)
    c = check_capacity(skew, capacity=1000, x=1.5 * mem / 1000, topology=A100)
    assert not c.fits and c.limiting_device == "cuda:0"


def test_multi_node_candidate_balances_and_ingests_locally() -> None:
    t = preset("a100-8x2")
    c = Candidate(placement=Placement.device("cuda:0"), nodes=("node0", "node1"))
    assert endpoint_shares(c, t) == (("node0/cuda:0", 0.5), ("node1/cuda:0", 0.5))
    x = 1e6
    est = transfer_estimate(c, x=x, actor_device="cpu", learner_device="cuda:0", topology=t)
    assert est.ingest_s == pytest.approx(x / t.bandwidth("cpu", "cuda:0"))  # node-local push
    assert est.deliver_s == pytest.approx(0.5 * x / 1000e9 + 0.5 * x / 25e9)
    assert placement_memory(c, t) == pytest.approx(2 * t.memory("cuda:0"))


def test_bad_inputs_name_the_field() -> None:
    p = Placement.device("cuda:0")
    with pytest.raises(ConfigError) as ei:
        transfer_time(p, x=-1, actor_device="cpu", learner_device="cuda:0", topology=A100)
    assert ei.value.field == "spec_bytes"
    with pytest.raises(ConfigError) as ei:
        check_capacity(p, capacity=-5, x=10, topology=A100)
    assert ei.value.field == "capacity"
    with pytest.raises(ConfigError) as ei:
        transfer_time(p, x=1, actor_device="cuda:42", learner_device="cuda:0", topology=A100)
    assert ei.value.field == "actor_device"
    with pytest.raises(ConfigError) as ei:
        transfer_time(p, x=1, actor_device="cpu", learner_device="tpu:0", topology=A100)
    assert ei.value.field == "learner_device"
    with pytest.raises(PlacementError, match="cuda:9"):
        transfer_time(Placement.device("cuda:9"), x=1, actor_device="cpu",
                      learner_device="cuda:0", topology=A100)
