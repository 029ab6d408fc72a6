"""``conduit bench placement --quick``: what it reports and writes (never timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conduit.bench.placement import main, transition_spec


def test_quick_run_writes_json_png_and_every_entry(tmp_path: Path, capsys) -> None:
    out = tmp_path / "placement"
    assert main(["--quick", "--dims", "64", "300", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "planner pick" in printed and "wrote" in printed
    data = json.loads((out / "placement.json").read_text())
    assert (out / "placement.png").stat().st_size > 0
    for key in ("machine", "args", "dims", "entries", "planner", "placements", "capacity",
                "capacity_reduced", "learner_device", "speedup_vs_pageable", "png"):
        assert key in data, key
    assert data["dims"] == [64, 300]
    labels = data["placements"]
    assert "pageable" in labels and "cpu-sharded x2" in labels
    assert any(lab.startswith("pinned") for lab in labels)
    if not torch.cuda.is_available():
        assert "pinned (=pageable, no CUDA)" in labels
    # one entry per (d, placement), side by side at the same capacity
    assert len(data["entries"]) == len(labels) * 2
    for d in (64, 300):
        es = [e for e in data["entries"] if e["dim"] == d]
        assert {e["placement"] for e in es} == set(labels)
        assert len({e["capacity"] for e in es}) == 1
        assert es[0]["capacity"] == data["capacity"][str(d)]
        for e in es:
            assert e["bytes_per_sample"] == transition_spec(d).bytes_per_sample
            assert e["inline_ms"] > 0 and e["overlap_ms"] > 0
    # the planner's pick at every d, matched to a measured line when it is one
    assert [p["dim"] for p in data["planner"]] == [64, 300]
    for p in data["planner"]:
        assert p["chosen"] is not None and p["label"]
        assert p["measured_label"] in labels
        assert p["paper_capacity"] == 1_000_000


def test_no_overlap_flag_and_capacity_reduction(tmp_path: Path) -> None:
    out = tmp_path / "p2"
    assert main(["--quick", "--no-overlap", "--dims", "2000", "--capacity", "100000",
                 "--max-buffer-gb", "0.01", "--out", str(out)]) == 0
    data = json.loads((out / "placement.json").read_text())
    assert data["capacity_reduced"] is True
    cap = data["capacity"]["2000"]
    assert 512 <= cap < 100_000
    assert cap * transition_spec(2000).bytes_per_sample <= 0.064e9
    assert all(e["overlap_ms"] is None for e in data["entries"])


def test_fit_capacity_refuses_a_dimension_whose_batch_exceeds_the_budget() -> None:
    import torch

    from conduit.bench.placement import (
        PlacementBenchArgs,
        fit_capacity,
        placements_available,
        transition_spec,
    )
    from conduit.errors import ConfigError

    args = PlacementBenchArgs(dims=(1_000_000,), batch_size=512, max_buffer_gb=0.064)
    targets = placements_available(torch.device("cpu"), (2,))
    x = transition_spec(1_000_000).bytes_per_sample
    with pytest.raises(ConfigError) as exc:
        fit_capacity(args, x, targets)
    assert exc.value.field == "dims" and "--max-buffer-gb" in exc.value.reason
    small = transition_spec(128).bytes_per_sample
    cap = fit_capacity(args, small, targets)
    assert args.batch_size <= cap and cap * small <= 0.064e9


def test_planner_prediction_per_batch_uses_the_batch_size() -> None:
    from conduit.bench.placement import planner_pick, transition_spec
    from conduit.placement import preset

    x = transition_spec(128).bytes_per_sample
    pick = planner_pick(preset("a100-8"), x, 4096, "cuda:0", batch_size=64)
    assert pick["predicted_batch_s"] == pytest.approx(pick["predicted_s_per_sample"] * 64)


def test_the_capacity_reduction_note_names_the_capacity_quick_asked_for(
        tmp_path: Path, capsys) -> None:
    out = tmp_path / "p3"
    assert main(["--quick", "--no-overlap", "--dims", "4000", "--out", str(out)]) == 0
    data = json.loads((out / "placement.json").read_text())
    assert data["capacity_requested"] == 4096 and data["capacity_reduced"] is True
    printed = capsys.readouterr().out
    assert "capacity reduced from 4,096 to fit memory" in printed
    assert "100,000" not in printed
