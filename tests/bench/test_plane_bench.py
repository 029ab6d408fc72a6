"""``conduit bench plane --quick``: what it writes, with and without matplotlib."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conduit import report
from conduit.bench.plane import main


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
