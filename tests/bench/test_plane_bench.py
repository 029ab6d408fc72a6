"""``conduit bench plane --quick``: what it writes, with and without matplotlib."""

from __future__ import annotations

import json
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from conduit import report
from conduit.bench.plane import PlaneBenchArgs, main, run_loop
from conduit.scheduling.space import Schedule


def test_quick_run_writes_json_and_png(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plane"
    assert main(["--quick", "--out", str(out)]) == 0
    data = json.loads((out / "plane.json").read_text())
    assert {"machine", "args", "loops", "exposed_reduction", "gather_vs_copy"} <= data.keys()
    assert [c["name"] for c in data["loops"]["off_policy"]] == ["inline", "overlap"]
    assert data["gather_vs_copy"]["sample_over_floor"] > 0
    assert (out / "plane.png").stat().st_size > 0
    assert f"and {out / 'plane.png'}" in capsys.readouterr().out


def test_without_matplotlib_the_plot_is_skipped_with_a_note(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(report, "_NOTED", False)
    out = tmp_path / "plane"
    assert main(["--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "matplotlib is not installed" in printed.err
    assert (out / "plane.json").exists()
    assert not (out / "plane.png").exists()
    assert "plane.png" not in printed.out


def test_an_on_policy_loop_of_one_unit_runs_with_lead_first() -> None:
    # Lead-first with one unit is the plain shuffle (there is no earlier unit to lead from).
    args = PlaneBenchArgs(dim=16, rollout_rows=32, iters=2, warmup=1, hidden=8,
                          onpolicy_units=1, minibatches=4, lead_first=True)
    got = run_loop(args, on_policy=True, schedule=Schedule(1, Fraction(1, 4), 1, Fraction(1, 4)))
    assert got["median_ms"]["wall"] > 0 and got["operator_median_ms"]


def test_gather_vs_copy_takes_a_batch_as_large_as_the_buffer() -> None:
    from conduit.bench.plane import gather_vs_copy

    got = gather_vs_copy(dim=4, capacity=8, batch=8, repeats=1)
    assert got["bytes"] == 8 * 4 * 4 and got["copy_ms"] > 0


def test_the_off_policy_fill_holds_at_least_one_batch_in_whole_units(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from conduit.bench import plane as plane_bench

    class FilledError(Exception):
        pass

    pushed: list[int] = []

    def fill(plane, work, *, rollout_rows: int, units: int) -> None:
        pushed.append(rollout_rows * units)
        raise FilledError

    monkeypatch.setattr(plane_bench, "fill", fill)
    args = PlaneBenchArgs(dim=4, hidden=4, rollout_rows=3, batch_size=64, capacity=2000,
                          iters=1, warmup=0)
    with pytest.raises(FilledError):
        run_loop(args, on_policy=False, schedule=Schedule(0, 1, 0, 1))
    assert pushed[0] >= 64 and pushed[0] % 3 == 0


@pytest.mark.parametrize("on_policy", [False, True])
def test_operator_figures_cover_the_measured_iterations_only(
        on_policy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from conduit.timing import Timings

    summaries: list[dict[str, dict[str, float]]] = []
    summary = Timings.summary

    def spy(self: Timings) -> dict[str, dict[str, float]]:
        summaries.append(summary(self))
        return summaries[-1]

    monkeypatch.setattr(Timings, "summary", spy)
    args = PlaneBenchArgs(dim=8, rollout_rows=16, batch_size=16, capacity=256, iters=3,
                          warmup=2, hidden=8, onpolicy_units=2, minibatches=2)
    got = run_loop(args, on_policy=on_policy, schedule=Schedule(0, 1, 0, 1) if not on_policy
                   else Schedule(0, 1, 0, Fraction(1, 2)))
    counts = {k: v["count"] for k, v in summaries[-1].items()}
    # Inline: every operator of an iteration is recorded within it; the fill's pushes and the
    # warm-up iterations are not counted.
    assert counts["rollout"] == counts["update"] == counts["ingestion"] == args.iters
    assert got["operator_counts"] == counts
    assert set(got["operator_median_ms"]) == set(counts)
