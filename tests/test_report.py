"""``conduit.report``: strict JSON, tables, signed percentages, optional matplotlib."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from conduit import report


def test_write_json_is_strict_and_can_describe_the_machine(tmp_path: Path) -> None:
    path = report.write_json(tmp_path / "a" / "r.json", {"x": [1.0, math.nan, -math.inf]},
                             with_machine=True)
    data = json.loads(path.read_text())
    assert next(iter(data)) == "machine" and data["machine"]["cores"] >= 1
    assert data["x"] == [1.0, None, None]
    assert "machine" not in json.loads(report.write_json(tmp_path / "b.json", {"y": 1})
                                       .read_text())


def test_table_and_signed_percent() -> None:
    lines = report.table(["a", "long header"], [[1.23456, "x"], [12345.6, "yy"]]).splitlines()
    assert lines[0].split() == ["a", "long", "header"]
    assert lines[2].split() == ["1.235", "x"] and lines[3].split() == ["12346", "yy"]
    assert report.signed_percent(0.1) == "+10%" and report.signed_percent(-0.25) == "-25%"


def test_pyplot_is_none_with_one_note_when_matplotlib_is_absent(
        monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(report, "_NOTED", False)
    assert report.pyplot() is None
    assert report.pyplot() is None
    assert capsys.readouterr().err.count("matplotlib is not installed") == 1


def test_check_output_path_refuses_what_cannot_be_written(tmp_path: Path) -> None:
    from conduit.errors import ConfigError

    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="--json-out") as exc:
        report.check_output_path(tmp_path / "file" / "x.json", "json_out")
    assert exc.value.field == "json_out"
    with pytest.raises(ConfigError, match="is a folder; pass a file path to --out"):
        report.check_output_path(tmp_path, "out")
    with pytest.raises(ConfigError, match="is a file, not a folder; pass a folder to --out"):
        report.check_output_path(tmp_path / "file", "out", directory=True)
    assert report.check_output_path(tmp_path / "new" / "r.json", "out") == (
        tmp_path / "new" / "r.json")
    assert (tmp_path / "new").is_dir()
    assert report.check_output_path(tmp_path / "d" / "e", "out", directory=True).is_dir()


def test_write_json_turns_an_os_error_into_a_config_error(tmp_path: Path) -> None:
    from conduit.errors import ConfigError

    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cannot write") as exc:
        report.write_json(tmp_path / "file" / "r.json", {"x": 1}, field="out")
    assert exc.value.field == "out"
    with pytest.raises(ConfigError) as exc:
        report.write_json(tmp_path, {"x": 1})
    assert exc.value.field == "path"
