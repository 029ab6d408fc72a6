"""``conduit bench grpo --quick``: both trainers run side by side and agree."""

import json

import pytest

pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames

from conduit.bench import grpo  # noqa: E402


def test_quick_bench_writes_the_comparison(tmp_path, capsys):
    assert grpo.main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "grpo.json").read_text())
    (s,) = data["summary"]
    assert s["max_completion_length"] == 8
    assert s["identical_losses"] and s["identical_rewards"] and s["identical_params"]
    assert {r["buffer"] for r in data["runs"]} == {"trl", "conduit"}
    for r in data["runs"]:
        assert r["exposed_s"] > 0 and r["generation_s"] > 0 and len(r["losses"]) == 8
        # one generation batch per steps_per_generation steps: some steps, not all, generate
        assert 0 < r["exposed_generation_steps_s"] < r["exposed_s"]
    out = capsys.readouterr().out
    assert "exposed lower" in out and "share of the exposed path on generation steps" in out
