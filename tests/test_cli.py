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


def _persist_run_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``conduit bench persist`` raise, once running, what a run refuses."""
    from conduit.bench import persist
    from conduit.errors import ConfigError

    def run(args: object) -> None:
        raise ConfigError("segments", "refused while running")

    monkeypatch.setattr(persist, "run", run)


def test_a_conduit_error_is_one_line_and_exit_status_2(capsys, tmp_path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _persist_run_refuses(monkeypatch)
    assert main(["bench", "persist", "--quick", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("conduit bench persist: error: ConfigError: segments: refused")
    assert "Traceback" not in err and err.count("\n") == 1


def test_conduit_traceback_lets_the_error_propagate(tmp_path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from conduit.errors import ConfigError

    _persist_run_refuses(monkeypatch)
    monkeypatch.setenv("CONDUIT_TRACEBACK", "1")
    with pytest.raises(ConfigError, match="segments"):
        main(["bench", "persist", "--quick", "--out", str(tmp_path / "p")])


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


@pytest.mark.parametrize("argv, says", [
    (["nosuch"], "conduit: error: unknown command 'nosuch' (choose from demo, train,"),
    (["bench", "nosuch"], "conduit bench: error: unknown benchmark 'nosuch' (choose from plane,"),
])
def test_an_unknown_command_is_a_usage_error_naming_it(argv: list[str], says: str,
                                                      capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert says in err and out == ""


def _train(tmp_path, *flags: str) -> list[str]:
    return ["train", "--no-use-ray", "--iters", "1", "--actors", "1", "--envs-per-actor", "1",
            "--steps-per-rollout", "4", "--log-every", "0", "--out", str(tmp_path / "t.json"),
            "--plot", str(tmp_path / "t.png"), *flags]


@pytest.mark.parametrize("flags, says", [
    (["--schedule", "2,1,0,1"],
     "conduit train: error: argument --schedule: '2,1,0,1': overlap_ing:"),
    (["--placement", "bogus"], "conduit train: error: argument --placement: placement.devices:"),
])
def test_a_bad_schedule_or_placement_exits_2_before_training(tmp_path, flags: list[str],
                                                              says: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:  # a usage error, naming the flag
        main(_train(tmp_path, *flags))
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines()[-1].startswith(says) and out == ""
    assert not (tmp_path / "t.json").exists()


def _blocked(tmp_path) -> str:
    """A path whose folder cannot be created: its parent is a regular file."""
    (tmp_path / "file").write_text("")
    return str(tmp_path / "file" / "sub" / "x.json")


@pytest.mark.parametrize("argv, says", [
    (["plan", "--topology", "a100-8", "--dim", "10", "--capacity", "1000", "--json-out", "{B}"],
     "conduit plan: error: ConfigError: json_out: cannot create the folder"),
    (["plan", "--topology", "a100-8", "--dim", "10", "--capacity", "1000", "--json-out", "{T}"],
     "conduit plan: error: ConfigError: json_out: "),
    (["bench", "placement", "--quick", "--out", "{B}"],
     "conduit bench placement: error: ConfigError: out: cannot create the folder"),
    (["train", "--no-use-ray", "--iters", "1", "--out", "{B}"],
     "conduit train: error: ConfigError: out: cannot create the folder"),
    (["train", "--no-use-ray", "--iters", "1", "--plot", "{T}"],
     "conduit train: error: ConfigError: plot: "),
])
def test_an_unwritable_output_fails_before_the_work_naming_the_flag(
        tmp_path, argv: list[str], says: str, capsys) -> None:
    blocked = _blocked(tmp_path)
    argv = [a.replace("{B}", blocked).replace("{T}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith(says) and err.count("\n") == 1
    assert "is a folder; pass a file path" in err or "in a writable folder" in err
    assert out == ""  # nothing was planned, measured or trained


def test_plan_errors_go_to_stderr_as_usage_errors(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--topology", "nosuch", "--dim", "10"])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "usage: conduit plan" in err and "argument --topology: 'nosuch' is neither" in err


@pytest.mark.parametrize("value", ["-3", "0"])
def test_bytes_per_sample_has_one_bound(value: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--topology", "a100-8", "--bytes-per-sample", value])
    assert exc.value.code == 2
    assert f"argument --bytes-per-sample: must be >= 1, got {value}" in capsys.readouterr().err


def test_profile_help_explains_every_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    out = capsys.readouterr().out
    assert "--repeats REPEATS  timed copies per size and path" in " ".join(out.split("\n"))


def test_an_interrupted_command_says_so_in_one_line(capsys, tmp_path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from conduit.bench import persist

    def run(args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(persist, "run", run)
    assert main(["bench", "persist", "--quick", "--out", str(tmp_path / "p")]) == 130
    assert capsys.readouterr().err == "conduit bench persist: interrupted\n"
    monkeypatch.setenv("CONDUIT_TRACEBACK", "1")
    with pytest.raises(KeyboardInterrupt):
        main(["bench", "persist", "--quick", "--out", str(tmp_path / "p")])
