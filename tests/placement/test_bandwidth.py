"""Bandwidth profiler: runs on tiny sizes, restores threads, cache round-trips, CLI table."""

from __future__ import annotations

import json

import pytest
import torch

from conduit.errors import ConfigError
from conduit.placement import (
    BandwidthProfile,
    Topology,
    format_table,
    load_cached_profile,
    profile_bandwidth,
    run_profile_cli,
)
from conduit.placement.bandwidth import cache_path

TINY = (4096, 32768)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_profile_measures_paths_and_restores_threads(cache) -> None:
    before = torch.get_num_threads()
    prof = profile_bandwidth(sizes=TINY, repeats=2)
    assert torch.get_num_threads() == before
    paths = {s.path for s in prof.samples}
    assert {"pageable->pinned", "gather"} <= paths
    if torch.cuda.is_available():
        assert {"pageable->device", "pinned->device"} <= paths
    assert {s.size_bytes for s in prof.samples if s.path == "pageable->pinned"} == set(TINY)
    assert all(s.seconds > 0 and s.bandwidth > 0 for s in prof.samples)
    gathers = {(s.src, s.dst) for s in prof.samples if s.path == "gather"}
    assert ("cpu", "cpu") in gathers and ("cpu_pinned", "cpu_pinned") in gathers
    assert not prof.from_cache
    table = prof.link_table()
    assert ("cpu", "cpu_pinned") in table and table[("cpu", "cpu")] > 0


def test_cache_round_trip(cache) -> None:
    first = profile_bandwidth(sizes=TINY, repeats=1)
    path = cache_path(first.key)
    assert path.parent == cache and path.is_file()
    again = profile_bandwidth(sizes=TINY, repeats=1)
    assert again.from_cache
    assert again.samples == first.samples and again.key == first.key
    loaded = load_cached_profile()
    assert loaded is not None and loaded.samples == first.samples
    assert BandwidthProfile.from_dict(first.to_dict()) == first
    fresh = profile_bandwidth(sizes=TINY, repeats=1, refresh=True)
    assert not fresh.from_cache
    other = profile_bandwidth(sizes=(8192,), repeats=1)  # different sizes: re-measured
    assert not other.from_cache and other.sizes == (8192,)


def test_no_cache_writes_nothing(cache) -> None:
    profile_bandwidth(sizes=(4096,), repeats=1, use_cache=False)
    assert list(cache.iterdir()) == []


def test_corrupt_cache_is_ignored(cache) -> None:
    prof = profile_bandwidth(sizes=(4096,), repeats=1)
    cache_path(prof.key).write_text("{not json")
    assert load_cached_profile() is None
    data = prof.to_dict()
    data["key"] = "someone-else"
    cache_path(prof.key).write_text(json.dumps(data))
    assert load_cached_profile() is None


def test_detect_uses_cached_profile(cache) -> None:
    assert Topology.detect().estimated
    prof = profile_bandwidth(sizes=TINY, repeats=1)
    t = Topology.detect()
    # Without CUDA there is no pinned endpoint; the measured host link (cpu -> cpu) is used.
    dst = "cpu_pinned" if "cpu_pinned" in t.nodes[0].device_names else "cpu"
    assert t.bandwidth("cpu", dst) == pytest.approx(prof.link_table()[("cpu", dst)])
    assert not t.nodes[0].link("cpu", dst).estimated


def test_format_table_and_cli(cache, capsys) -> None:
    prof = profile_bandwidth(sizes=(4096,), repeats=1)
    text = format_table(prof)
    assert "gather" in text and "GB/s" in text and "4 KiB" in text
    assert run_profile_cli(["--sizes", "4K,8K", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "pageable->pinned" in out and "8 KiB" in out and "cache:" in out
    assert run_profile_cli(["--sizes", "4K", "--repeats", "1", "--json", "--no-cache"]) == 0
    assert json.loads(capsys.readouterr().out)["sizes"] == [4096]


@pytest.mark.parametrize("kwargs, field", [
    ({"sizes": (0,)}, "sizes"),
    ({"sizes": ()}, "sizes"),
    ({"repeats": 0}, "repeats"),
])
def test_bad_arguments(cache, kwargs, field) -> None:
    with pytest.raises(ConfigError) as ei:
        profile_bandwidth(**kwargs)
    assert ei.value.field == field


@pytest.mark.parametrize("argv", [["--sizes", "lots"], ["--sizes", "inf"],
                                  ["--sizes", "4K,0"], ["--repeats", "0"], ["--repeats", "x"]])
def test_bad_flags_are_usage_errors(cache, argv, capsys) -> None:
    with pytest.raises(SystemExit) as ei:
        run_profile_cli(argv)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and "usage: conduit profile" in err and argv[0] in err


def test_sizes_flag_refuses_a_size_the_host_memory_cannot_hold(monkeypatch) -> None:
    import argparse
    from types import SimpleNamespace

    import psutil

    from conduit.placement import bandwidth

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=8 << 30))
    assert bandwidth._sizes_flag("64K,1G") == (64 << 10, 1 << 30)
    with pytest.raises(argparse.ArgumentTypeError, match="at most 1,073,741,824 B"):
        bandwidth._sizes_flag("64K,2G")
    with pytest.raises(argparse.ArgumentTypeError, match="too large"):
        bandwidth._sizes_flag("999999999999999")
