"""Alg. 1: candidate set and linear scan, on the paper's nodes (Fig. 12 regimes)."""

from __future__ import annotations

import math

import pytest
import torch

from conduit.errors import CapacityError, ConfigError
from conduit.placement import (
    Topology,
    candidate_set,
    check_capacity,
    greedy_accelerator_order,
    plan_placement,
    preset,
)
from conduit.spec import ExperienceSpec

A100 = preset("a100-8")
MI = preset("mi250x-8")
C_BUF = 10**6
DIMS = (128, 512, 1000, 2000, 5000, 10000, 20000)


def transition_spec(d: int) -> ExperienceSpec:
    """A float32 transition of dimension d: obs, next_obs, action, reward, done."""
    return ExperienceSpec.of(obs=((d,), torch.float32), next_obs=((d,), torch.float32),
                             action=((), torch.int64), reward=((), torch.float32),
                             done=((), torch.bool))


def plan(d: int, **kw):
    kw.setdefault("topology", A100)
    return plan_placement(spec=transition_spec(d), capacity=C_BUF, actor_device="cpu",
                          learner_device="cuda:0", **kw)


@pytest.mark.parametrize("d", [128, 512, 1000, 2000, 5000])
def test_a100_single_gpu_while_it_fits(d: int) -> None:
    dec = plan(d)
    assert dec.placement.kind == "device"
    assert dec.placement.devices == ("cuda:0",)  # the learner's own GPU


@pytest.mark.parametrize("d", [10000, 20000])
def test_a100_sharded_once_buffer_exceeds_one_gpu(d: int) -> None:
    dec = plan(d)
    assert dec.placement.kind == "sharded"
    assert "cuda:0" in dec.placement.devices
    needed = C_BUF * transition_spec(d).bytes_per_sample
    assert needed > A100.memory("cuda:0")
    # the fewest GPUs that hold the buffer (uniform fabric: more shards, more remote reads)
    k = len(dec.placement.devices)
    assert k == math.ceil(needed / A100.memory("cuda:0"))


def test_a100_single_field_float32_dim_20000_crosses() -> None:
    """Brief's example: 10^6 x 20000 float32 = 80 GB exceeds one 80 GB GPU's free memory."""
    fits = plan_placement(spec_bytes=4 * 5000, capacity=C_BUF, actor_device="cpu",
                          learner_device="cuda:0", topology=A100)
    big = plan_placement(spec_bytes=4 * 20000, capacity=C_BUF, actor_device="cpu",
                         learner_device="cuda:0", topology=A100)
    assert fits.placement.kind == "device"
    assert big.placement.kind == "sharded"


@pytest.mark.parametrize("d", DIMS)
def test_never_cpu_when_a_gpu_placement_fits(d: int) -> None:
    dec = plan(d)
    gpu_fits = any(e.feasible for e in dec.candidates
                   if e.placement.kind in ("device", "sharded"))
    assert gpu_fits
    assert dec.placement.kind not in ("pageable", "pinned")
    # and the bandwidth ordering of Fig. 12: single GPU < pinned < pageable per sample
    t = {e.placement.label(): e.time_s for e in dec.candidates}
    assert t["device[cuda:0]"] < t["pinned"] < t["pageable"]


def test_decision_explains_itself() -> None:
    dec = plan(20000)
    text = dec.explain()
    assert "chosen" in text and "does not fit" in text and "pageable" in text
    rejected = [e for e in dec.candidates if not e.feasible]
    assert rejected and all("needs" in e.reason and "available" in e.reason for e in rejected)
    assert all(e.reason == "" for e in dec.candidates if e.feasible)
    chosen = dec.chosen_evaluation
    assert chosen.feasible
    assert chosen.time_s == min(e.time_s for e in dec.candidates if e.feasible)
    assert dec.to_dict()["chosen"]["placement"]["kind"] == "sharded"


def test_mi250x_four_gpus_pick_fast_ranks() -> None:
    order = greedy_accelerator_order(topology=MI, node="node0", learner_device="cuda:0")
    assert set(order[:4]) == {"cuda:0", "cuda:2", "cuda:4", "cuda:6"}
    # a buffer that needs exactly four GCDs
    x = int(3.5 * MI.memory("cuda:0") / C_BUF)
    dec = plan_placement(spec_bytes=x, capacity=C_BUF, actor_device="cpu",
                         learner_device="cuda:0", topology=MI)
    assert dec.placement.kind == "sharded"
    assert set(dec.placement.devices) == {"cuda:0", "cuda:2", "cuda:4", "cuda:6"}


def test_mi250x_sharded_learner_off_fast_rank_still_prefers_fast_ranks() -> None:
    x = int(3.5 * MI.memory("cuda:0") / C_BUF)
    dec = plan_placement(spec_bytes=x, capacity=C_BUF, actor_device="cpu",
                         learner_device="cuda:2", topology=MI, allowed_kinds=["sharded"])
    assert set(dec.placement.devices) == {"cuda:0", "cuda:2", "cuda:4", "cuda:6"}


def test_candidate_set_shape() -> None:
    cands = candidate_set(topology=A100, learner_device="cuda:0")
    kinds = [c.placement.kind for c in cands]
    assert kinds[:2] == ["pageable", "pinned"]
    assert kinds.count("device") == 8 and kinds.count("sharded") == 7
    assert cands[2].placement.devices == ("cuda:0",)  # learner's own GPU first
    sizes = [len(c.placement.devices) for c in cands if c.placement.kind == "sharded"]
    assert sizes == list(range(2, 9))
    assert len(cands) <= 2 * 8 + 2


def test_user_restrictions() -> None:
    dec = plan(128, allowed_kinds=["pinned", "pageable"])
    assert dec.placement.kind == "pinned"
    dec = plan(128, allowed_kinds="pageable")
    assert dec.placement.kind == "pageable"
    dec = plan(10000, devices=["cuda:4", "cuda:5", "cuda:6"])
    assert set(dec.placement.devices) <= {"cuda:4", "cuda:5", "cuda:6"}
    assert dec.placement.kind == "sharded"
    with pytest.raises(ConfigError) as ei:
        plan(128, allowed_kinds=["tape"])
    assert ei.value.field == "allowed_kinds"
    with pytest.raises(ConfigError) as ei:
        plan(128, devices=["cuda:11"])
    assert ei.value.field == "devices"
    with pytest.raises(ConfigError) as ei:
        plan(128, nodes=["node9"])
    assert ei.value.field == "nodes"


def test_fits_nowhere_raises_capacity_error() -> None:
    with pytest.raises(CapacityError) as ei:
        plan_placement(spec_bytes=10**7, capacity=10**6, actor_device="cpu",
                       learner_device="cuda:0", topology=A100)
    err = ei.value
    assert err.needed == pytest.approx(1e13)
    assert err.available == pytest.approx(A100.memory("cpu"))  # the largest placement
    assert "GB" in str(err)
    # a restricted candidate set reports its own largest
    with pytest.raises(CapacityError) as ei:
        plan(20000, allowed_kinds=["device"])
    assert ei.value.available == pytest.approx(A100.memory("cuda:0"))


@pytest.mark.parametrize("kwargs, field", [
    ({"spec_bytes": -4}, "spec_bytes"),
    ({"spec_bytes": 0}, "spec_bytes"),
    ({"spec_bytes": float("nan")}, "spec_bytes"),
    ({"spec_bytes": 16, "capacity": -1}, "capacity"),
    ({"spec_bytes": 16, "capacity": 2.5}, "capacity"),
    ({"spec_bytes": 16, "actor_device": "cuda:8"}, "actor_device"),
    ({"spec_bytes": 16, "learner_device": "cuda:99"}, "learner_device"),
    ({}, "spec_bytes"),
])
def test_bad_inputs_name_the_field(kwargs, field) -> None:
    args = {"capacity": C_BUF, "actor_device": "cpu", "learner_device": "cuda:0",
            "topology": A100}
    args.update(kwargs)
    with pytest.raises(ConfigError) as ei:
        plan_placement(**args)
    assert ei.value.field == field
    assert field in str(ei.value)


def test_both_spec_and_bytes_rejected() -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        plan_placement(spec=transition_spec(4), spec_bytes=16, capacity=1,
                       actor_device="cpu", learner_device="cuda:0", topology=A100)


def test_multi_node_balances_across_nodes() -> None:
    t = preset("a100-8x2")
    dec = plan(10000, topology=t)
    assert dec.chosen.nodes == ("node0", "node1")
    # 80 GB over two nodes: 40 GB per node fits each node's cuda:0
    assert dec.placement == dec.placement.device("cuda:0")
    assert check_capacity(dec.chosen, capacity=C_BUF, x=transition_spec(10000).bytes_per_sample,
                          topology=t).fits
    big = plan(20000, topology=t)
    assert big.placement.kind == "sharded" and len(big.chosen.nodes) == 2
    one = plan(128, topology=t, nodes=["node1"])
    assert one.chosen.nodes == ("node1",)


def test_detected_cpu_only_machine_plans_on_host(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path))
    t = Topology.detect()
    dec = plan_placement(spec_bytes=64, capacity=1000, actor_device="cpu",
                         learner_device="cpu", topology=t)
    assert dec.placement.kind in ("pageable", "pinned", "device", "sharded")
    if not t.nodes[0].accelerators:
        assert dec.placement.kind in ("pageable", "pinned")
