"""Smoke test of ``conduit bench schedule --quick`` (behaviour and output shape, no timings)."""

from __future__ import annotations

import json

from conduit.bench.schedule import main


def test_quick_run_writes_json_and_png(tmp_path, capsys):
    out = tmp_path / "sched"
    argv = ["--quick", "--out", str(out), "--batch-sizes", "16", "--dims", "32", "64",
            "--base-dim", "32", "--base-batch", "16", "--granularities", "1", "2",
            "--g-max", "2", "--placements", "pageable", "pinned"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "auto pick" in text and "pearson r" in text

    data = json.loads((out / "schedule.json").read_text())
    assert (out / "schedule.png").stat().st_size > 0
    assert {"machine", "args", "points", "summary", "target_gap"} <= set(data)
    assert data["target_gap"] == 0.05
    pts = data["points"]
    assert [(p["batch_size"], p["dim"]) for p in pts] == [(16, 32), (16, 64)]
    for p in pts:
        # 2 placements x 2 overlap settings x 2 granularities
        assert len(p["manual"]) == 8
        assert {m["placement"] for m in p["manual"]} == {"pageable", "pinned"}
        assert {m["label"] for m in p["manual"]} == {
            f"ing(ov={o},g={g}) del(ov={o},g={g})" for o in (0, 1) for g in (1, 2)}
        for m in p["manual"]:
            assert m["wall_ms"] > 0 and m["exposed_ms"] >= 0
        auto = p["auto"]
        assert {"placement", "schedule", "label", "wall_ms", "predicted_ms", "profile",
                "top_candidates", "model_pick", "schedule_explain"} <= set(auto)
        assert set(auto["profile"]["t_ing"]) == {"1", "2"}  # the profile covers the space
        # The trainers' tuner chose: the model's pick, or the threadless schedule it was tried
        # (or, without threads, priced) against.
        assert auto["top_candidates"][0]["schedule"] == auto["model_pick"]
        kept = auto["schedule"]
        assert kept == auto["model_pick"] or kept["overlap_ing"] == kept["overlap_del"] == 0
        assert p["best_manual"]["wall_ms"] == min(m["wall_ms"] for m in p["manual"])
        assert p["gap"] == auto["wall_ms"] / p["best_manual"]["wall_ms"] - 1
        fid = p["fidelity"]
        assert fid is not None and fid["n"] == 4  # the auto placement's manual configs
        assert {"pearson_r", "mape", "top_k_match", "best_match"} <= set(fid)
    s = data["summary"]
    assert s["n_points"] == 2 and s["fidelity_points"] == 2
    assert {"max_gap", "points_within_target", "fidelity_pooled", "top_k_matches"} <= set(s)
