"""``conduit bench persist --quick``: what it writes, its row check, and TorchRL's skipped row."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from conduit.bench.persist import (
    PEERS_HINT,
    PersistBenchArgs,
    main,
    rows_checksum,
    torchrl_buffer,
)
from conduit.errors import ConfigError


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_quick_run_writes_sane_numbers_and_loads_the_same_rows(tmp_path: Path) -> None:
    out = tmp_path / "persist"
    assert main(["--quick", "--out", str(out)]) == 0
    data = json.loads((out / "persist.json").read_text())
    assert {"machine", "args", "throughput", "stall"} <= data.keys()
    tp = data["throughput"]
    assert tp["rows"] == 8000 and _positive(tp["bytes"])
    systems = tp["systems"]
    assert {"conduit", "dd", "torchrl"} <= systems.keys()
    measured = [n for n, s in systems.items() if "skipped" not in s]
    assert "conduit" in measured
    for name in measured:
        for op in ("save", "load"):
            assert len(systems[name][op]["seconds"]) == 2
            assert _positive(systems[name][op]["median_s"])
            assert _positive(systems[name][op]["gb_per_s"])
    assert systems["conduit"]["rows_match"] is True
    assert systems["conduit"]["file_bytes"] >= tp["bytes"]
    if importlib.util.find_spec("torchrl") is not None:
        assert systems["torchrl"]["rows_match"] is True
    st = data["stall"]
    assert st["with"]["snapshots"] >= 1 and st["with"]["failures"] == 0
    assert all(_positive(t) for t in st["with"]["pause_s"])
    assert st["with"]["overlapped"] and all(
        0 <= i < len(st["with"]["iterations_s"]) for i in st["with"]["overlapped"])
    assert _positive(st["median_iteration_s"])
    assert len(st["without"]["iterations_s"]) > 10 and len(st["with"]["iterations_s"]) > 10
    assert isinstance(st["target_met"], bool)
    assert st["stall_same_run_s"] >= 0
    assert st["stall_same_run_s"] == pytest.approx(
        st["stall_same_run_fraction"] * st["median_iteration_s"])
    assert not list((out).glob("persist-*"))  # the scratch folder is removed


def test_without_torchrl_its_row_is_skipped_with_the_install_hint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchrl", None)  # import torchrl -> ImportError
    monkeypatch.setitem(sys.modules, "tensordict", None)
    reason = torchrl_buffer({"obs": torch.zeros(4, 2)}, tmp_path)
    assert isinstance(reason, str) and PEERS_HINT in reason


def test_the_row_checksum_sees_one_changed_element() -> None:
    cols = {"obs": torch.arange(12, dtype=torch.float32).reshape(6, 2),
            "done": torch.zeros(6, dtype=torch.bool)}
    before = rows_checksum(cols)
    assert rows_checksum({k: v.clone() for k, v in cols.items()}) == before
    cols["done"][3] = True
    assert rows_checksum(cols) != before


def test_the_loop_segments_must_be_an_even_number(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="segments"):
        PersistBenchArgs(segments=3)
    with pytest.raises(SystemExit) as usage:  # an odd count: a usage error naming the flag
        main(["--quick", "--segments", "3", "--out", str(tmp_path / "p")])
    assert usage.value.code == 2 and "argument --segments: " in capsys.readouterr().err
    assert not (tmp_path / "p").exists()
    with pytest.raises(SystemExit) as usage:  # below --segments' minimum: argparse refuses it
        main(["--quick", "--segments", "0", "--out", str(tmp_path)])
    assert usage.value.code == 2
