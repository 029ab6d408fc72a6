"""The ``conduit`` CLI refuses bad input with a one-line usage error naming the flag (or the
variable) at fault, exit status 2, before any work and without a traceback; its ``--help``
says what the commands do. Parse-level checks, and one tiny in-process training run."""

from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path

import pytest

from conduit.cli import main
from tests.conftest import usage_error

# -- helpers ---------------------------------------------------------------------------------


def _train(tmp_path: Path, *flags: str, ray: bool = False) -> list[str]:
    return ["train", *([] if ray else ["--no-use-ray"]), "--device", "cpu", "--iters", "1",
            "--actors", "1", "--envs-per-actor", "1", "--steps-per-rollout", "4",
            "--log-every", "0", "--out", str(tmp_path / "t.json"),
            "--plot", str(tmp_path / "t.png"), *flags]


def _free_port() -> int:
    """A local port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- 1. train's --out/--plot help says where the files go by default --------------------------


@pytest.mark.parametrize("algo", ["dqn", "sac", "ppo"])
def test_train_help_says_where_the_log_and_plot_go_by_default(algo: str, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--algo", algo, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "do not write" not in text
    assert "(empty: runs/train/<algo>_<env>_<buffer>.json)" in text
    assert "(empty: runs/train/<algo>_<env>_<buffer>.png)" in text


def test_train_writes_the_log_where_the_help_says(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--algo", "dqn", "--no-use-ray", "--device", "cpu", "--iters", "1",
                 "--actors", "1", "--envs-per-actor", "1", "--steps-per-rollout", "4",
                 "--buffer", "inline", "--log-every", "0"]) == 0
    log = tmp_path / "runs" / "train" / "dqn_CartPole-v1_inline.json"
    assert json.loads(log.read_text())["algo"] == "dqn"
    assert f"wrote {Path('runs/train/dqn_CartPole-v1_inline.json')}" in capsys.readouterr().out


# -- 2. PPO refuses an environment whose optional extra is missing, before Ray --------------


@pytest.mark.skipif(importlib.util.find_spec("metaworld") is not None,
                    reason="the metaworld extra is installed")
def test_ppo_without_the_metaworld_extra_is_ausage_error(tmp_path: Path, capsys,
                                                          no_ray) -> None:
    usage_error(_train(tmp_path, "--algo", "ppo", "--env", "metaworld/reach-v3", ray=True),
                 "--env", "optional extra", capsys)
    assert not (tmp_path / "t.json").exists()


# -- 3. profile: a cache folder that cannot be written --------------------------------------


def _no_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    from conduit.placement import bandwidth

    def refuse(*_a, **_k):
        raise AssertionError("measured although the cache cannot be written")

    monkeypatch.setattr(bandwidth, "_measure", refuse)


@pytest.mark.parametrize("where", ["a file", "under a file", "under /proc"])
def test_profile_refuses_a_cache_dir_it_cannot_write(where: str, tmp_path: Path, monkeypatch,
                                                     capsys) -> None:
    (tmp_path / "file").write_text("")
    folder = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "sub",
              "under /proc": Path("/proc/nope")}[where]
    if where == "under /proc" and not Path("/proc").is_dir():
        pytest.skip("no /proc")
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(folder))
    _no_measurement(monkeypatch)
    assert main(["profile", "--sizes", "64K", "--repeats", "1", "--refresh"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("conduit profile: error: ConfigError: CONDUIT_CACHE_DIR: ")
    assert str(folder) in err and err.count("\n") == 1 and out == ""


def test_saving_a_profile_names_the_cache_variable(tmp_path: Path, monkeypatch) -> None:
    from conduit.errors import ConfigError
    from conduit.placement import bandwidth

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path / "file"))
    prof = bandwidth.profile_bandwidth(sizes=(4096,), repeats=1, use_cache=False)
    with pytest.raises(ConfigError, match="not a folder") as exc:
        bandwidth.save_profile(prof)
    assert exc.value.field == "CONDUIT_CACHE_DIR"
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path / "ok"))
    assert bandwidth.save_profile(prof).parent == tmp_path / "ok"


# -- 4. train --address nothing answers at is refused in seconds, before Ray -----------------


@pytest.mark.parametrize("algo", ["dqn", "ppo"])
def test_train_refuses_an_address_nothing_listens_on(algo: str, tmp_path: Path, capsys,
                                                     no_ray) -> None:
    port = _free_port()
    usage_error(_train(tmp_path, "--algo", algo, "--address", f"127.0.0.1:{port}", ray=True),
                 "--address", "nothing answers at", capsys)


def test_train_refuses_an_address_that_is_not_host_port(tmp_path: Path, capsys,
                                                        no_ray) -> None:
    usage_error(_train(tmp_path, "--algo", "dqn", "--address", "nowhere", ray=True),
                 "--address", "expected HOST:PORT", capsys)


# -- 5. ranges of the hyperparameters ---------------------------------------------------------


@pytest.mark.parametrize("algo, flag, value, says", [
    ("dqn", "--gamma", "inf", "must be <= 1, got inf"),
    ("dqn", "--gamma", "-1", "must be >= 0, got -1"),
    ("dqn", "--gamma", "nan", "expected a number, got NaN"),
    ("sac", "--gamma", "1.5", "must be <= 1, got 1.5"),
    ("ppo", "--gamma", "-0.1", "must be >= 0, got -0.1"),
    ("dqn", "--start-e", "7", "must be <= 1, got 7"),
    ("dqn", "--end-e", "-3", "must be >= 0, got -3"),
    ("ppo", "--gae-lambda", "3", "must be <= 1, got 3"),
    ("ppo", "--clip-coef", "-1", "must be a finite number > 0, got -1"),
    ("ppo", "--clip-coef", "0", "must be a finite number > 0, got 0"),
    ("ppo", "--max-grad-norm", "-1", "must be a finite number > 0, got -1"),
    ("ppo", "--max-grad-norm", "inf", "must be a finite number > 0, got inf"),
])
def test_out_of_range_hyperparameters_are_usage_errors(algo: str, flag: str, value: str,
                                                       says: str, tmp_path: Path,
                                                       capsys) -> None:
    usage_error(_train(tmp_path, "--algo", algo, flag, value), flag, says, capsys)


@pytest.mark.parametrize("algo, flags", [
    ("dqn", ["--gamma", "0", "--start-e", "1", "--end-e", "0"]),
    ("dqn", ["--gamma", "1", "--start-e", "0", "--end-e", "1"]),
    ("sac", ["--gamma", "1"]),
    ("ppo", ["--gamma", "0", "--gae-lambda", "1", "--clip-coef", "10", "--max-grad-norm", "1"]),
])
def test_hyperparameters_at_their_bounds_are_taken(algo: str, flags: list[str]) -> None:
    from conduit.cli_args import parse_command
    from conduit.workloads.cli import TRAINERS, train_parser

    mod = TRAINERS[algo]
    args = parse_command(train_parser(algo), mod.Args, ["--algo", algo, "--no-use-ray",
                                                         *flags], check=mod.check)
    assert args.gamma == float(flags[1])


def test_the_ranges_are_in_the_help(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--algo", "ppo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "discount factor (default: 0.98; at least 0; at most 1)" in text
    assert "GAE lambda (default: 0.8; at least 0; at most 1)" in text
    assert "surrogate clipping coefficient (default: 0.2; above 0)" in text
    assert "gradient clipping norm (default: 0.5; above 0)" in text


# -- 6. errors of --schedule, --placement, --learner-device name the flag ---------------------


@pytest.mark.parametrize("flags, flag, says", [
    (["--schedule", "1,0,1,1"], "--schedule", "'1,0,1,1': g_ing: must be a finite positive"),
    (["--schedule", "2,1,0,1"], "--schedule", "overlap_ing: must be 0 or 1"),
    (["--schedule", "bogus"], "--schedule", "expected 'auto', 'inline' or four"),
    (["--placement", "moon"], "--placement", "'moon' is not a device name"),
])
def test_a_bad_schedule_or_placement_is_a_usage_error_naming_the_flag(
        flags: list[str], flag: str, says: str, tmp_path: Path, capsys, no_ray) -> None:
    usage_error(_train(tmp_path, "--algo", "dqn", *flags, ray=True), flag, says, capsys)
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("flags", [["--schedule", "1,1,0,2"], ["--schedule", "inline"],
                                   ["--placement", "pageable"], ["--placement", "learner"],
                                   ["--placement", "cpu"]])
def test_good_schedules_and_placements_are_taken(flags: list[str]) -> None:
    from conduit.cli_args import parse_command
    from conduit.workloads import dqn
    from conduit.workloads.cli import _check_trainer, train_parser

    args = parse_command(train_parser("dqn"), dqn.Args, ["--no-use-ray", "--device", "cpu",
                                                         *flags],
                         check=lambda a: _check_trainer(dqn, a))
    assert getattr(args, flags[0][2:]) == flags[1]


@pytest.mark.parametrize("flags, flag", [
    (["--topology", "a100-8", "--learner-device", "banana"], "--learner-device"),
    (["--learner-device", "banana"], "--learner-device"),
    (["--topology", "a100-8", "--actor-device", "banana"], "--actor-device"),
])
def test_plan_refuses_an_unknown_device_naming_the_flag(flags: list[str], flag: str, tmp_path,
                                                        capsys) -> None:
    json_out = tmp_path / "sub" / "plan.json"
    usage_error(["plan", "--dim", "10", *flags, "--json-out", str(json_out)], flag,
                 "'banana' is not a device of the topology", capsys)
    assert not json_out.parent.exists()


def test_plan_reports_a_late_config_error_as_ausage_error(monkeypatch, capsys) -> None:
    """A flag only the cluster can judge (``--topology ray``) is refused by :func:`plan`;
    ``main`` names its flag too."""
    from conduit import plan_cli
    from conduit.errors import ConfigError

    def late(_args):
        raise ConfigError("learner_device", "'banana' is not a device of the topology")

    monkeypatch.setattr(plan_cli, "plan", late)
    usage_error(["plan", "--topology", "a100-8"], "--learner-device", "'banana'", capsys)


# -- 7. help text -----------------------------------------------------------------------------


def test_profile_help_says_where_the_cache_is_and_what_k_means(capsys, monkeypatch) -> None:
    monkeypatch.delenv("CONDUIT_CACHE_DIR", raising=False)
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "$CONDUIT_CACHE_DIR" in text and "~/.cache/conduit" in text
    assert str(Path.home() / ".cache" / "conduit") in text
    assert "K (KiB)" in text and "M (MiB)" in text


def test_bench_help_describes_the_command(capsys) -> None:
    assert main(["bench", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Run one benchmark: conduit bench BENCH [flags]" in text
    assert "runs/bench/BENCH" in text and "'conduit bench BENCH --help'" in text



# -- bench peers: ranges its options need -----------------------------------------------------


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--reverb-timeout-s", "-1", "must be a finite number > 0"),
    ("--memory-fraction", "0", "must be a finite number > 0"),
    ("--memory-fraction", "1.5", "must be <= 1"),
    ("--insert-64-repeats", "0", "must be >= 1"),
    ("--batches", "0", "must be >= 1"),
    ("--warmup", "-1", "must be >= 0"),
])
def test_bench_peers_refuses_values_out_of_range(flag: str, value: str, says: str,
                                                 tmp_path: Path, capsys) -> None:
    usage_error(["bench", "peers", flag, value, "--out", str(tmp_path / "p")], flag, says,
                 capsys)
    assert not (tmp_path / "p").exists()
