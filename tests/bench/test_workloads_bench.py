"""``conduit bench workloads``: the paired per-round reductions it reports."""

from __future__ import annotations

import pytest

from conduit.bench.workloads import round_reductions
from conduit.workloads.breakdown import IterationRecord


def _run(end_to_end_s):
    """A run whose learning iterations take these end-to-end times (the first is skipped)."""
    return [IterationRecord(k, end_to_end=t, rollout=0.0, ingestion=0.0, delivery=0.0,
                            update=t, other=0.0, env_steps=0, learning=True, wall_time=0.0)
            for k, t in enumerate([9.9, *end_to_end_s])]


def test_each_round_is_paired_with_its_own_inline_run():
    inline = [_run([0.100, 0.100, 0.100]), _run([0.200, 0.200, 0.200])]
    conduit = [_run([0.090, 0.090, 0.090]), _run([0.210, 0.210, 0.210])]
    got = round_reductions(inline, conduit)
    # A slow second round (both modes 2x) does not blur the paired figures: +10 % then -5 %.
    assert got == pytest.approx([0.10, -0.05])
    assert round_reductions(inline, conduit, key="update") == pytest.approx(got)


def test_unpaired_rounds_are_rejected():
    with pytest.raises(ValueError, match="rounds"):
        round_reductions([_run([0.1])], [])


def test_rounds_alternate_which_mode_runs_first():
    from conduit.workloads.breakdown import buffer_order

    assert [buffer_order(r) for r in range(3)] == [
        ("inline", "conduit"), ("conduit", "inline"), ("inline", "conduit")]


def test_quick_runs_one_light_workload(tmp_path):
    import json

    from conduit.bench.workloads import QUICK, main

    assert main(["--quick", "--iters", "3", "--no-use-ray", "--device", "cpu",
                 "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "workloads.json").read_text())
    assert "partial" not in data and data["args"]["quick"] is True
    assert list(data["workloads"]) == ["DQN-CP"]
    runs = data["workloads"]["DQN-CP"]["runs"]
    assert [r["buffer"] for r in runs] == ["inline", "conduit"]
    assert data["args"]["iters"] == 3 and data["args"]["actors"] == QUICK["actors"]
