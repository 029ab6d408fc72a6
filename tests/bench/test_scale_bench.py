"""``conduit bench scale``: the quick run on a real two-node Ray cluster, and the projection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conduit.bench import scale


def test_projection_follows_the_cost_model_mixture():
    rows = scale.projection(row_bytes=2048, bandwidth=1e9, replication=2, batch_size=256,
                            per_batch_s=1e-3)
    assert [r["nodes"] for r in rows] == list(scale.PROJECTED_NODES)
    for r in rows:
        # a learner reads the rows whose copy (of 2) is on its node locally
        assert r["remote_share"] == pytest.approx((r["nodes"] - 2) / r["nodes"])
        # At least the remote share of every row crosses the network.
        assert r["deliver_us_per_row"] >= r["remote_share"] * 2048 / 1e9 * 1e6 * 0.999
        assert r["ingest_us_per_row"] >= 2048 / 1e9 * 1e6  # one replica copy over the network
        batch_s = 1e-3 + 256 * r["deliver_us_per_row"] / 1e6
        assert r["learner_rows_s"] == pytest.approx(256 / batch_s)
        assert r["all_learners_rows_s"] == pytest.approx(r["nodes"] * r["learner_rows_s"])
    delivers = [r["deliver_us_per_row"] for r in rows]
    assert delivers == sorted(delivers)  # more nodes, more of each batch is remote


def test_quick_run_measures_every_shard_count_and_restores_without_loss(tmp_path, ray_home,
                                                                         monkeypatch, capsys):
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("HOME", str(ray_home))
    from conduit.placement import cluster as ray_cluster
    measured_bw: list[float] = []

    def probe(node_ids, **kwargs):  # the placement profiler's probe, recorded
        measured_bw.append(ray_cluster.inter_node_bandwidth(node_ids, **kwargs))
        return measured_bw[-1]
    monkeypatch.setattr(scale, "inter_node_bandwidth", probe)
    assert scale.main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads(Path(tmp_path, "scale.json").read_text())
    assert len(measured_bw) == 1 and data["inter_node_bandwidth"] == measured_bw[0]
    assert data["inter_node_bandwidth_probe"] == "conduit.placement.cluster.inter_node_bandwidth"
    first = scale.projection(row_bytes=data["row_bytes"], bandwidth=measured_bw[0],
                             replication=2, batch_size=data["args"]["batch_size"],
                             per_batch_s=data["per_batch_s"])
    assert len(data["projection"]) == len(first)
    for got, want in zip(data["projection"], first, strict=True):  # it uses that bandwidth
        assert got == pytest.approx(want)
    measured = data["measured"]
    assert set(measured) == {"1", "2"}
    for m in measured.values():
        assert m["insert_rows_s"] > 0 and m["sample_rows_s"] > 0
        assert m["wait_ms_no_prefetch"] >= 0 and m["hidden"] <= 1
    assert measured["2"]["lost_rows"] == 0 and measured["2"]["restored_rows"] > 0
    assert "recovery_s" not in measured["1"]  # one shard has no replica to restore from
    assert data["inter_node_bandwidth"] > 0
    assert [p["nodes"] for p in data["projection"]] == list(scale.PROJECTED_NODES)
    out = capsys.readouterr().out
    assert "PROJECTION" in out and "shards" in out


def test_an_address_nothing_listens_on_is_refused_without_starting_ray(monkeypatch):
    import socket

    from conduit.errors import ConfigError

    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init was called"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConfigError) as exc:
        scale.LocalCluster(nodes=1, cpus=1, address=f"127.0.0.1:{port}")
    assert exc.value.field == "address"
