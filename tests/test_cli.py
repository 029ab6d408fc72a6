"""The ``conduit`` command line: help text and environment."""

from __future__ import annotations

import os

import pytest

from conduit.cli import main
from conduit.cli_args import plain_text

BENCHES = ("plane", "placement", "schedule", "peers", "convergence", "workloads", "persist",
           "scale", "grpo", "rllib")


def test_plain_text_removes_rst_inline_markup() -> None:
    text = ("``conduit plan`` uses :func:`~conduit.plane.profile_plane`, "
            ":meth:`Topology.detect() <conduit.placement.Topology.detect>` and "
            ":mod:`conduit.placement`; ``a\nb``")
    assert plain_text(text) == ("conduit plan uses profile_plane, Topology.detect() and "
                                "conduit.placement; a\nb")


@pytest.mark.parametrize("argv", [[], ["--help"], ["plan", "--help"], ["profile", "--help"],
                                  ["bench", "--help"],
                                  *(["bench", b, "--help"] for b in BENCHES)])
def test_help_is_plain_text(argv: list[str], capsys) -> None:
    try:
        main(argv)
    except SystemExit as exc:  # argparse exits after printing a subcommand's help
        assert exc.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out
    assert "``" not in out and ":func:`" not in out and ":meth:`" not in out


def test_the_cli_leaves_ray_authentication_alone(monkeypatch: pytest.MonkeyPatch,
                                                 capsys) -> None:
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    main(["--help"])
    assert "RAY_AUTH_MODE" not in os.environ


@pytest.mark.parametrize("argv, flag, says", [
    (["bench", "plane", "--iters", "0"], "--iters", "must be >= 1, got 0"),
    (["bench", "peers", "--dims", "128", "-5"], "--dims", "must be >= 1, got -5"),
    (["train", "--seed", "-1"], "--seed", "must be >= 0, got -1"),
    (["bench", "persist", "--loop-s", "nan"], "--loop-s", "expected a number, got NaN"),
    (["bench", "rllib", "--iters", "three"], "--iters", "expected int, got 'three'"),
])
def test_a_bad_number_is_a_usage_error_naming_the_flag(argv: list[str], flag: str, says: str,
                                                       capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {says}" in err


def test_bounds_come_from_the_field_metadata() -> None:
    import argparse
    from dataclasses import dataclass

    from conduit.cli_args import add_dataclass_args, arg

    @dataclass(frozen=True)
    class Args:
        n: int = arg(3, "rows", min=2)
        k: int = arg(0, "any count")
        x: float = arg(-1.5, "unbounded")

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, Args)
    ns = parser.parse_args(["--n", "2", "--k", "0", "--x", "-7"])
    assert (ns.n, ns.k, ns.x) == (2, 0, -7.0)
    for bad in (["--n", "1"], ["--k", "-1"], ["--x", "nan"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_a_conduit_error_is_one_line_and_exit_status_2(capsys) -> None:
    assert main(["bench", "persist", "--segments", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("conduit bench persist: error: ConfigError: segments:")
    assert "Traceback" not in err and err.count("\n") == 1


def test_conduit_traceback_lets_the_error_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    from conduit.errors import ConfigError

    monkeypatch.setenv("CONDUIT_TRACEBACK", "1")
    with pytest.raises(ConfigError, match="segments"):
        main(["bench", "persist", "--segments", "3"])


def test_a_benchmark_sets_the_allocator_policy_before_it_runs(monkeypatch) -> None:
    """Every system a benchmark compares runs under the same malloc settings: the policy the
    first plane would set is in force before the benchmark's own code runs."""
    import conduit.cli as cli
    from conduit.storage import hostmem
    order: list[str] = []
    monkeypatch.setattr(hostmem, "retain_freed_memory", lambda: order.append("policy"))
    monkeypatch.setattr(cli, "_call", lambda name, module, func, rest: order.append(name) or 0)
    assert main(["bench", "plane", "--quick"]) == 0
    assert order == ["policy", "conduit bench plane"]
    order.clear()
    assert main(["plan", "--dim", "8"]) == 0
    assert order == ["conduit plan"]  # other commands leave it to the first plane
