"""Topology.detect() on a Ray cluster: every node, and the network between them measured."""

from __future__ import annotations

import pytest

from conduit.errors import ConfigError
from conduit.placement import Topology, plan_placement
from conduit.placement.cluster import inter_node_bandwidth, node_name

pytestmark = pytest.mark.ray


def test_detect_sees_every_node_and_measures_the_network(cluster):
    import ray

    ids = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    topo = Topology.detect()  # attached to a 3-node cluster: the cluster is described
    assert len(ids) == 3 and topo.source == "detected:ray"
    assert [n.name for n in topo.nodes] == [node_name(i) for i in ids]
    assert all(n.has("cpu") for n in topo.nodes)
    assert topo.is_multi_node and 1e6 < topo.inter_node_bandwidth < 1e12  # measured, finite
    assert len(Topology.detect(cluster=False).nodes) == 1  # this machine only
    # the planner spreads the buffer over the nodes (cross-node balance)
    decision = plan_placement(capacity=1000, actor_device="cpu",
                              learner_device=f"{topo.nodes[0].name}/cpu", topology=topo,
                              spec_bytes=4000)
    assert decision.chosen.nodes == tuple(n.name for n in topo.nodes)
    # the topology round-trips through JSON with the measured figure
    assert Topology.from_json(topo.to_json()).inter_node_bandwidth == topo.inter_node_bandwidth


def test_bad_probe_arguments_are_typed_errors(cluster):
    import ray

    ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    with pytest.raises(ConfigError, match="node_ids"):
        inter_node_bandwidth(ids[:1])
    with pytest.raises(ConfigError, match="probe_bytes"):
        inter_node_bandwidth(ids, probe_bytes=0)
    assert inter_node_bandwidth(ids, probe_bytes=1 << 16, repeats=1) > 0


def test_conduit_plan_explains_the_clusters_cross_node_decision(cluster, capsys):
    from conduit.plan_cli import main

    assert main(["--topology", f"ray:{cluster.address}", "--dim", "1000", "--capacity",
                 "10000", "--t-rollout-ms", "5", "--t-update-ms", "5"]) == 0
    out = capsys.readouterr().out
    assert "placement: 3 nodes x" in out and "== across nodes" in out
    assert "local with probability 0.333 and remote with 0.667" in out
