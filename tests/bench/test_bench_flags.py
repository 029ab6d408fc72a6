"""What every ``conduit bench`` command shares: ``--quick`` leaves the flags given alone, and
every benchmark but convergence takes it."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from conduit.bench.common import given_flags
from conduit.bench.plane import PlaneBenchArgs


class _RanError(Exception):
    """Raised by a stand-in ``run`` once it has the arguments."""


#: (module, argv after --quick, what the arguments must hold): each flag is given with its
#: default value, which --quick would otherwise replace.
CASES = [
    ("conduit.bench.plane", ["--dim", "1000", "--iters", "40"],
     {"dim": 1000, "iters": 40, "batch_size": 64}),
    ("conduit.bench.plane", ["--cap", "100000"], {"capacity": 100_000, "dim": 64}),
    ("conduit.bench.grpo", ["--lengths", "16", "64"], {"lengths": (16, 64), "rounds": 1}),
    ("conduit.bench.scale", ["--shards", "1", "2", "4"], {"shards": (1, 2, 4), "dim": 16}),
    ("conduit.bench.placement", ["--repeats", "30"], {"repeats": 30, "capacity": 4096}),
    ("conduit.bench.persist", ["--hidden", "256"], {"hidden": 256, "dim": 64}),
    ("conduit.bench.rllib", ["--seeds", "3"], {"seeds": 3, "repeats": 3}),
    ("conduit.bench.schedule", ["--iters", "8"], {"iters": 8, "rounds": 1}),
    ("conduit.bench.peers.harness", ["--repeats", "50"], {"repeats": 50, "capacity": 16384}),
    ("conduit.bench.workloads", ["--actors", "2"],
     {"actors": 2, "only": ("DQN-CP",), "iters": 12}),
]


@pytest.mark.parametrize(("module", "argv", "expected"), CASES,
                         ids=[f"{m.rsplit('.', 1)[-1]}:{a[0]}" for m, a, _ in CASES])
def test_quick_keeps_the_flags_given_even_at_their_default(
        module: str, argv: list[str], expected: dict[str, Any], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    mod = importlib.import_module(module)
    seen: list[Any] = []

    def run(args: Any, **_: Any) -> None:
        seen.append(args)
        raise _RanError

    monkeypatch.setattr(mod, "run", run)
    with pytest.raises(_RanError):
        mod.main(["--quick", *argv, "--out", str(tmp_path / "out")])
    assert {k: getattr(seen[0], k) for k in expected} == expected
    assert seen[0].quick


def test_given_flags_reads_the_command_line_as_its_parser_does() -> None:
    argv = ["--quick", "--dim=1000", "--no-lead-first", "--cap", "5", "--iters", "40"]
    assert given_flags(PlaneBenchArgs, argv) == {"quick", "dim", "lead_first", "capacity",
                                                 "iters"}
    assert given_flags(PlaneBenchArgs, []) == frozenset()
    assert given_flags(PlaneBenchArgs, ["--cap", "5"], allow_abbrev=False) == frozenset()


def test_every_bench_but_convergence_takes_quick(capsys: pytest.CaptureFixture[str]) -> None:
    from conduit import cli

    for name in cli._BENCHES:
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", name, "--help"])
        assert exc.value.code == 0
        assert ("--quick" in capsys.readouterr().out) == (name != "convergence"), name
