"""``conduit train`` / ``conduit demo`` flags: a value that cannot run is a usage error naming
the flag (exit status 2, no traceback, nothing printed or started before it); a flag given is
a flag used; a run says what it did. Tiny runs with in-process actors; behaviour only, never
timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conduit.cli import main
from conduit.cli_args import parse_command
from conduit.errors import ConfigError
from conduit.workloads import dqn, envs, ppo, sac
from conduit.workloads.cli import demo_main, train_main, train_parser
from tests.conftest import usage_error


def _tiny(tmp_path: Path, *flags: str, ray: bool = False) -> list[str]:
    return ["train", *([] if ray else ["--no-use-ray"]), "--device", "cpu", "--actors", "1",
            "--envs-per-actor", "1", "--steps-per-rollout", "4", "--iters", "2",
            "--buffer", "inline", "--log-every", "0", "--out", str(tmp_path / "t.json"),
            "--plot", str(tmp_path / "t.png"), *flags]


def _usage_error(argv: list[str], flag: str, says: str, capsys, tmp_path: Path) -> str:
    err = usage_error(argv, flag, says, capsys)
    assert not (tmp_path / "t.json").exists()
    return err


# 1. PPO on a multi-agent env: refused when parsed, not after Ray started.

def test_ppo_refuses_a_multi_agent_env_before_ray_starts(tmp_path: Path, capsys,
                                                         no_ray) -> None:
    _usage_error(_tiny(tmp_path, "--algo", "ppo", "--env", "MultiAgentCartPole", ray=True),
                 "--env", "PPO here supports single-agent envs", capsys, tmp_path)
    with pytest.raises(ConfigError, match="single-agent") as exc:
        ppo.train(ppo.Args(env="MultiAgentCartPole", use_ray=False, device="cpu"))
    assert exc.value.field == "env"


# 2. Values that crashed mid-run.

@pytest.mark.parametrize("value", ["0", "-5"])
def test_exploration_steps_is_at_least_one(value: str, tmp_path: Path, capsys) -> None:
    _usage_error(_tiny(tmp_path, "--algo", "dqn", "--exploration-steps", value),
                 "--exploration-steps", "must be >= 1", capsys, tmp_path)


@pytest.mark.parametrize("algo", ["dqn", "sac", "ppo"])
@pytest.mark.parametrize("size", ["1", "4", "8"])
def test_an_image_too_small_for_the_encoder_is_refused(algo: str, size: str, tmp_path: Path,
                                                       capsys) -> None:
    _usage_error(_tiny(tmp_path, "--algo", algo, "--image-size", size), "--image-size",
                 "must be 0 (no image) or at least 9", capsys, tmp_path)


def test_demo_refuses_an_image_too_small_for_the_encoder(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--no-use-ray", "--image-size", "4", "--out", str(tmp_path / "d")])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert "argument --image-size: must be 0 (no image) or at least 9" in err and out == ""
    assert not (tmp_path / "d").exists()


def test_the_smallest_image_the_encoder_takes_trains(tmp_path: Path, capsys) -> None:
    assert main(_tiny(tmp_path, "--algo", "dqn", "--image-size", "9", "--learning-starts", "0",
                      "--batch-size", "2", "--updates-per-iter", "1")) == 0
    assert json.loads((tmp_path / "t.json").read_text())["updates"] == 2


# 3. Checks that raised a traceback before Ray: now usage errors naming the flag.

@pytest.mark.parametrize("flags, flag, says", [
    (["--algo", "ppo", "--num-minibatches", "3"], "--num-minibatches",
     "3 does not divide the 16 samples of an iteration"),
    (["--algo", "dqn", "--env", "Pendulum-v1"], "--env", "DQN needs discrete actions"),
    (["--algo", "sac", "--env", "MultiAgentCartPole"], "--env",
     "SAC here needs continuous actions"),
    (["--algo", "sac", "--tau", "5"], "--tau", "must be <= 1.0"),
    (["--algo", "sac", "--tau", "0"], "--tau", "must be a finite number > 0"),
    (["--algo", "sac", "--tau", "nan"], "--tau", "expected a number"),
])
def test_bad_combinations_are_usage_errors_naming_the_flag(flags: list[str], flag: str,
                                                           says: str, tmp_path: Path, capsys,
                                                           no_ray) -> None:
    _usage_error(_tiny(tmp_path, *flags, ray=True), flag, says, capsys, tmp_path)


def test_sac_without_the_metaworld_extra_is_a_usage_error(tmp_path: Path, capsys, no_ray,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    def missing(task: str):
        raise ImportError("Meta-World workloads need the optional extra: pip install "
                          "'metaworld==3.1.1' 'mujoco==3.3.0'")

    monkeypatch.setattr(envs, "_make_metaworld", missing)
    _usage_error(_tiny(tmp_path, "--algo", "sac", "--env", "metaworld/reach-v3", ray=True),
                 "--env", "need the optional extra", capsys, tmp_path)


def test_tau_of_one_is_taken() -> None:
    args = parse_command(train_parser("sac"), sac.Args, ["--algo", "sac", "--tau", "1"],
                         check=sac.check)
    assert args.tau == 1.0


# 4. --learning-starts 0 learns from the first rollout; conflicts name the flags.

@pytest.mark.parametrize("algo", ["dqn", "sac"])
def test_learning_starts_zero_learns_from_the_first_iteration(algo: str, tmp_path: Path,
                                                              capsys) -> None:
    assert main(_tiny(tmp_path, "--algo", algo, "--learning-starts", "0", "--batch-size", "2",
                      "--updates-per-iter", "2")) == 0
    log = json.loads((tmp_path / "t.json").read_text())
    assert [r["learning"] for r in log["iterations"]] == [True, True]
    assert log["updates"] == 4 and log["losses_finite"] is True


@pytest.mark.parametrize("algo", ["dqn", "sac"])
@pytest.mark.parametrize("flags, flag, says", [
    (["--learning-starts", "4", "--buffer-size", "2", "--batch-size", "1"],
     "--learning-starts", "4 exceeds --buffer-size 2"),
    (["--learning-starts", "2", "--batch-size", "50", "--buffer-size", "10"],
     "--batch-size", "50 exceeds --buffer-size 10"),
])
def test_replay_conflicts_name_the_flags(algo: str, flags: list[str], flag: str, says: str,
                                         tmp_path: Path, capsys) -> None:
    err = _usage_error(_tiny(tmp_path, "--algo", algo, *flags), flag, says, capsys, tmp_path)
    assert "min_size" not in err


# 5. --learner-threads holds with in-process actors.

def test_learner_threads_hold_with_in_process_actors() -> None:
    before = torch.get_num_threads()
    seen: list[int] = []
    try:
        args = dqn.Args(use_ray=False, device="cpu", actors=1, envs_per_actor=1,
                        steps_per_rollout=8, iters=2, buffer="inline", log_every=0,
                        learning_starts=4, batch_size=4, updates_per_iter=1,
                        learner_threads=3)
        dqn.train(args, on_batch=lambda b: seen.append(torch.get_num_threads()))
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {3}


# 6. A run with no update says so.

def test_a_run_without_updates_is_not_reported_as_learning(tmp_path: Path, capsys) -> None:
    assert main(_tiny(tmp_path, "--algo", "dqn", "--iters", "3")) == 0  # learning_starts 1000
    out = capsys.readouterr().out
    assert "0 learning iterations (no update ran)" in out
    assert "losses finite: True" not in out
    log = json.loads((tmp_path / "t.json").read_text())
    assert log["updates"] == 0 and log["learning_iterations"] == 0
    assert log["losses_finite"] is None


def test_a_learning_run_counts_its_updates(tmp_path: Path, capsys) -> None:
    assert main(_tiny(tmp_path, "--algo", "ppo", "--num-minibatches", "2", "--update-epochs",
                      "1", "--rollout-fragments", "1")) == 0
    out = capsys.readouterr().out
    assert "medians over 1 learning iterations (ms); 4 updates" in out
    log = json.loads((tmp_path / "t.json").read_text())
    assert log["updates"] == 4 and log["learning_iterations"] == 2
    assert log["losses_finite"] is True


# 7. Flags that cannot apply are refused, not ignored and recorded.

@pytest.mark.parametrize("flags, flag, says", [
    (["--schedule", "1,1,0,1/4"], "--schedule", "does not apply with --buffer inline"),
    (["--placement", "pinned"], "--placement", "does not apply with --buffer inline"),
    (["--address", "10.9.9.9:6379"], "--address", "does not apply with --no-use-ray"),
])
def test_flags_that_cannot_apply_are_usage_errors(flags: list[str], flag: str, says: str,
                                                  tmp_path: Path, capsys) -> None:
    _usage_error(_tiny(tmp_path, "--algo", "dqn", *flags), flag, says, capsys, tmp_path)


@pytest.mark.parametrize("flags", [["--schedule", "inline"], ["--placement", "pageable"],
                                   ["--schedule", "auto", "--placement", "auto"]])
def test_values_that_match_what_inline_runs_are_taken(flags: list[str]) -> None:
    args = parse_command(train_parser("dqn"), dqn.Args,
                         ["--algo", "dqn", "--buffer", "inline", *flags], check=dqn.check)
    assert args.buffer == "inline"


# 8. Progress lines in the demo; the usage line names the command.

def test_demo_prints_progress_lines(tmp_path: Path, capsys) -> None:
    assert demo_main(["--algo", "ppo", "--image-size", "16", "--iters", "2", "--rounds", "1",
                      "--actors", "1", "--no-use-ray", "--device", "cpu", "--log-every", "1",
                      "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for buffer in ("inline", "conduit"):
        assert f"[ppo {buffer}] iter    1/2" in out and f"[ppo {buffer}] iter    2/2" in out
    with pytest.raises(SystemExit):
        demo_main(["--help"])
    assert "--log-every" in capsys.readouterr().out


def test_an_unknown_algo_names_conduit_train_in_the_usage(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        train_main(["--algo", "foo"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: conduit train ")
    assert "conduit train: error: argument --algo: invalid choice: 'foo'" in err
