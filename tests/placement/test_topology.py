"""Topology: presets, JSON round-trip and validation, detection on this machine."""

from __future__ import annotations

import json

import pytest

from conduit.errors import ConfigError, TopologyError
from conduit.placement import (
    CPU,
    CPU_PINNED,
    DeviceInfo,
    Link,
    Topology,
    preset,
    preset_names,
)
from conduit.placement.presets import MI250X_FAST_RANKS


def test_presets_have_expected_shape() -> None:
    assert {"a100-8", "a100-8x2", "mi250x-8"} <= set(preset_names())
    t = preset("a100-8")
    assert not t.is_multi_node
    assert t.nodes[0].accelerators == tuple(f"cuda:{i}" for i in range(8))
    assert t.bandwidth("cuda:0", "cuda:5") == pytest.approx(300e9)
    assert t.bandwidth(CPU_PINNED, "cuda:3") == pytest.approx(25e9)
    assert t.bandwidth(CPU, "cuda:3") < t.bandwidth(CPU_PINNED, "cuda:3")
    assert 40e9 < t.memory("cuda:0") < 80e9
    assert t.memory(CPU) > 1e12
    assert not t.estimated


def test_mi250x_fabric_pattern() -> None:
    t = preset("mi250x-8")
    fast = {f"cuda:{i}" for i in MI250X_FAST_RANKS}
    assert fast == {"cuda:0", "cuda:2", "cuda:4", "cuda:6"}
    bws = {t.bandwidth(f"cuda:{i}", f"cuda:{j}") for i in range(8) for j in range(8) if i != j}
    assert bws == {400e9, 200e9, 100e9}
    for a in fast:
        for b in fast - {a}:
            assert t.bandwidth(a, b) == 400e9
    assert t.bandwidth("cpu_pinned", "cuda:5") == 72e9
    # the Fig. 4b-derived variant: package partners are the fastest peers
    h = preset("mi250x-8-fig4b")
    assert h.bandwidth("cuda:0", "cuda:1") > h.bandwidth("cuda:0", "cuda:2")


def test_unknown_preset() -> None:
    with pytest.raises(ConfigError, match="preset"):
        preset("tpu-v5")


def test_multi_node_naming_and_bandwidth() -> None:
    t = preset("a100-8x2")
    assert t.is_multi_node
    assert t.resolve("node1/cuda:3") == ("node1", "cuda:3")
    assert t.resolve("cuda:3") == ("node0", "cuda:3")  # unqualified: first node
    assert t.qualify("node1", "cuda:3") == "node1/cuda:3"
    # cross-node: limited by the slowest segment (network 25 GB/s here)
    assert t.bandwidth("node0/cuda:0", "node1/cuda:0") == pytest.approx(25e9)
    assert t.bandwidth("node0/cuda:0", "node0/cuda:1") == pytest.approx(300e9)
    with pytest.raises(TopologyError, match="node"):
        t.resolve("node7/cuda:0")


def test_json_round_trip_via_file(tmp_path) -> None:
    for name in ("a100-8", "a100-8x2", "mi250x-8"):
        t = preset(name)
        path = tmp_path / f"{name}.json"
        t.save(path)
        back = Topology.load(path)
        assert back == t
        assert Topology.from_json(t.to_json()) == t
        assert Topology.from_json(str(path)) == t
        assert back.bandwidth("cuda:1", "cuda:2") == t.bandwidth("cuda:1", "cuda:2")


def _doc() -> dict:
    return json.loads(preset("a100-8").to_json())


def test_malformed_json_raises() -> None:
    with pytest.raises(TopologyError, match="malformed"):
        Topology.from_json('{"nodes": [')


def test_missing_file_raises(tmp_path) -> None:
    with pytest.raises(TopologyError, match="cannot read"):
        Topology.load(tmp_path / "nope.json")


@pytest.mark.parametrize("mutate, key", [
    (lambda d: d.pop("nodes"), "nodes"),
    (lambda d: d["nodes"][0]["devices"][2].pop("memory_bytes"),
     "nodes[0].devices[2].memory_bytes"),
    (lambda d: d["nodes"][0]["devices"][3].__setitem__("memory_bytes", -5),
     "nodes[0].devices[3].memory_bytes"),
    (lambda d: d["nodes"][0]["links"][1].__setitem__("bandwidth", -1.0),
     "nodes[0].links[1].bandwidth"),
    (lambda d: d["nodes"][0]["links"][0].__setitem__("bandwidth", 0),
     "nodes[0].links[0].bandwidth"),
    (lambda d: d["nodes"][0]["links"][4].__setitem__("dst", "cuda:9"),
     "nodes[0].links[4].dst"),
    (lambda d: d["nodes"][0]["links"][4].pop("src"), "nodes[0].links[4].src"),
    (lambda d: d["nodes"][0].pop("name"), "nodes[0].name"),
    (lambda d: d.__setitem__("inter_node_bandwidth", -3), "inter_node_bandwidth"),
    (lambda d: d.__setitem__("version", 99), "version"),
    (lambda d: d["nodes"][0]["devices"].__setitem__(0, "cpu"), "nodes[0].devices[0]"),
])
def test_invalid_json_names_the_key(mutate, key) -> None:
    d = _doc()
    mutate(d)
    with pytest.raises(TopologyError) as ei:
        Topology.from_json(json.dumps(d))
    assert key in str(ei.value)


def test_duplicate_and_bad_device_names() -> None:
    d = _doc()
    d["nodes"][0]["devices"][3]["name"] = "cuda:0"
    with pytest.raises(TopologyError, match="duplicate"):
        Topology.from_dict(d)
    d = _doc()
    d["nodes"][0]["devices"][3]["name"] = "gpu zero"
    with pytest.raises(TopologyError, match=r"nodes\[0\]\.devices\[3\]"):
        Topology.from_dict(d)
    d = _doc()
    d["nodes"][0]["devices"] = [dv for dv in d["nodes"][0]["devices"] if dv["name"] != "cpu"]
    d["nodes"][0]["links"] = [ln for ln in d["nodes"][0]["links"]
                              if "cpu" not in (ln["src"], ln["dst"])]
    with pytest.raises(TopologyError, match="'cpu' device"):
        Topology.from_dict(d)


def test_direct_construction_validates() -> None:
    with pytest.raises(TopologyError, match="memory_bytes"):
        DeviceInfo(name="cuda:0", memory_bytes=-1)
    with pytest.raises(TopologyError, match="bandwidth"):
        Link(src="cpu", dst="cpu", bandwidth=float("nan"))
    with pytest.raises(TopologyError, match="unknown device 'cuda:1'"):
        Topology.single_node(devices=[DeviceInfo(name="cpu", memory_bytes=10)],
                             links=[Link(src="cpu", dst="cuda:1", bandwidth=1e9)])


def test_missing_link_and_symmetric_fallback() -> None:
    t = Topology.single_node(
        devices=[DeviceInfo(name="cpu", memory_bytes=10), DeviceInfo(name="cuda:0",
                                                                     memory_bytes=10)],
        links=[Link(src="cpu", dst="cuda:0", bandwidth=5e9)])
    assert t.bandwidth("cuda:0", "cpu") == 5e9  # reverse direction assumed symmetric
    with pytest.raises(TopologyError, match="cuda:0->cuda:0"):
        t.bandwidth("cuda:0", "cuda:0")
    with pytest.raises(TopologyError, match="cuda:3"):
        t.bandwidth("cuda:3", "cpu")


def test_detect_on_this_machine(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path))
    t = Topology.detect()
    names = t.nodes[0].device_names
    import torch
    assert CPU in names
    # Pinned memory needs a CUDA driver; without one it is not offered as a placement.
    assert (CPU_PINNED in names) == torch.cuda.is_available()
    assert t.memory(CPU) > 0
    assert t.source == "detected"
    assert t.estimated  # no profile cached in an empty cache dir
    if torch.cuda.is_available():
        assert t.bandwidth(CPU, CPU_PINNED) > 0
    assert Topology.from_json(t.to_json()) == t
    if not torch.cuda.is_available():
        assert t.nodes[0].accelerators == ()


def test_from_json_with_a_non_json_string_reads_it_as_a_path(tmp_path) -> None:
    with pytest.raises(TopologyError, match="cannot read"):
        Topology.from_json(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("nodes: 1")
    with pytest.raises(TopologyError, match="malformed"):
        Topology.from_json(str(bad))
