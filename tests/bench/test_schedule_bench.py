"""Smoke test of ``conduit bench schedule --quick`` (behaviour and output shape, no timings)."""

from __future__ import annotations

import json
import statistics

import pytest

from conduit.bench.schedule import main


def test_quick_run_writes_json_and_png(tmp_path, capsys):
    out = tmp_path / "sched"
    argv = ["--quick", "--out", str(out), "--batch-sizes", "16", "--dims", "32", "64",
            "--base-dim", "32", "--base-batch", "16", "--granularities", "1", "2",
            "--g-max", "2", "--placements", "pageable", "pinned"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "auto pick" in text and "pearson r" in text and "2 alternating rounds" in text

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
        best = p["best_manual"]
        assert best["wall_ms"] == min(m["wall_ms"] for m in p["manual"])
        # The gap comes from the alternating rounds of the auto pick and the sweep's best, not
        # from the sweep (whose configurations ran minutes apart).
        for paired in (auto["paired"], best["paired"]):
            assert paired["rounds"] == 2 and len(paired["round_wall_ms"]) == 2
            assert paired["wall_ms"] == statistics.median(paired["round_wall_ms"])
        assert p["gap"] == auto["paired"]["wall_ms"] / best["paired"]["wall_ms"] - 1
        assert p["gap_sweep"] == auto["wall_ms"] / best["wall_ms"] - 1
        assert p["within_target"] == (p["gap"] <= 0.05)
        fid = p["fidelity"]
        assert fid is not None and fid["n"] == 4  # the auto placement's manual configs
        assert {"pearson_r", "mape", "top_k_match", "best_match"} <= set(fid)
    s = data["summary"]
    assert s["n_points"] == 2 and s["fidelity_points"] == 2
    assert {"max_gap", "points_within_target", "fidelity_pooled", "top_k_matches"} <= set(s)


def test_paired_rounds_alternate_which_plane_goes_first(monkeypatch):
    from conduit.bench import schedule as bench
    from conduit.scheduling import Schedule

    class FakePlane:
        def __init__(self, name):
            self.name, self.schedule = name, None

        def flush(self):
            pass

        def set_schedule(self, schedule):
            self.schedule = schedule

    calls = []

    def measure(plane, step, *, iters, warmup):
        calls.append((plane.name, iters, warmup))
        wall = {"a": 0.002, "b": 0.001}[plane.name] * (1 + len(calls) / 100)
        return {"wall": wall, "rollout": 0.0, "update": 0.0, "exposed": wall, "iters": iters}

    monkeypatch.setattr(bench.synthetic, "measure", measure)
    args = bench.ScheduleBenchArgs(iters=3, warmup=1, paired_rounds=4)
    pt = bench._Point(args, batch=8, dim=16)
    a, b = FakePlane("a"), FakePlane("b")
    sa, sb = Schedule(1, 2, 1, 2), Schedule(0, 1, 0, 1)
    ra, rb = pt.paired([(a, sa), (b, sb)])
    assert a.schedule == sa and b.schedule == sb
    # One warm-up call each (iters=0), then rounds that alternate the first plane.
    assert calls[:2] == [("a", 0, 2), ("b", 0, 1)]
    order = [c[0] for c in calls[2:]]
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    # Whole g cycles per round, one cycle of warm-up each.
    assert {c[1:] for c in calls[2:] if c[0] == "a"} == {(4, 2)}
    assert {c[1:] for c in calls[2:] if c[0] == "b"} == {(3, 1)}
    assert ra["rounds"] == rb["rounds"] == 4
    assert ra["wall_ms"] == statistics.median(ra["round_wall_ms"])
    assert ra["wall_ms"] > rb["wall_ms"]


def test_the_median_round_of_an_even_count_is_the_mean_of_the_middle_two():
    from conduit.bench.schedule import _median_round

    def rnd(wall, exposed):
        return {"wall": wall, "exposed": exposed, "rollout": 0.0, "update": 0.0}

    rounds = [rnd(0.004, 0.4), rnd(0.001, 0.1), rnd(0.003, 0.3), rnd(0.002, 0.2)]
    got = _median_round(rounds, iters=5)
    assert got["wall_ms"] == statistics.median(got["round_wall_ms"]) == 2.5
    assert got["exposed_ms"] == pytest.approx(250.0)  # the same two rounds
    odd = _median_round(rounds[:3], iters=5)
    assert odd["wall_ms"] == 3.0 and odd["exposed_ms"] == 300.0
