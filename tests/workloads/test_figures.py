"""The workloads' PNG figures: Conduit's change labelled with its sign, and no PNG (no error)
without matplotlib."""

from __future__ import annotations

from pathlib import Path

import pytest

from conduit.workloads import figures
from conduit.workloads.figures import change_label, plot_breakdown, plot_comparison

ROWS = {"DQN-CP": {"inline": {"exposed": 0.010, "end_to_end": 0.100},
                   "conduit": {"exposed": 0.004, "end_to_end": 0.110}}}


def test_an_increase_is_labelled_plus_and_a_decrease_minus():
    assert change_label(0.100, 0.110) == "+10%"
    assert change_label(0.010, 0.004) == "-60%"


def test_comparison_bars_carry_signed_labels(tmp_path: Path, monkeypatch):
    pytest.importorskip("matplotlib")
    texts: list[str] = []
    real = figures.pyplot()
    assert real is not None
    original = real.Axes.text

    def spy(self, x, y, s, *a, **kw):
        texts.append(s)
        return original(self, x, y, s, *a, **kw)

    monkeypatch.setattr(real.Axes, "text", spy)
    png = plot_comparison(ROWS, tmp_path / "w.png")
    assert png is not None and png.stat().st_size > 0
    assert texts == ["-60%", "+10%"]


def test_no_png_without_matplotlib(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(figures, "pyplot", lambda: None)
    assert plot_comparison(ROWS, tmp_path / "w.png") is None
    assert plot_breakdown({"run": ROWS["DQN-CP"]["inline"]}, tmp_path / "b.png") is None
    assert not list(tmp_path.iterdir())
