"""``conduit train`` / ``conduit demo`` entry points and the workload benchmarks' plumbing,
on tiny budgets with in-process actors (the Ray path is covered by test_trainers.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conduit.workloads.cli import demo_main, train_main, train_parser


def test_train_help_lists_the_trainer_flags(capsys) -> None:
    with pytest.raises(SystemExit):
        train_main(["--algo", "sac", "--help"])
    text = capsys.readouterr().out
    assert "--reward-scale" in text and "--buffer {inline,conduit}" in text
    assert "--image-size" in train_parser("dqn").format_help()


def test_train_writes_json_and_png(tmp_path: Path, capsys) -> None:
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    rc = train_main(["--algo", "dqn", "--no-use-ray", "--iters", "4", "--actors", "1",
                     "--envs-per-actor", "2", "--steps-per-rollout", "8", "--batch-size", "16",
                     "--learning-starts", "32", "--updates-per-iter", "2", "--buffer-size",
                     "500", "--device", "cpu", "--log-every", "2", "--buffer", "inline",
                     "--out", str(out), "--plot", str(png)])
    assert rc == 0
    log = json.loads(out.read_text())
    assert log["algo"] == "dqn" and log["buffer"] == "inline"
    assert len(log["iterations"]) == 4
    assert {"rollout", "ingestion", "delivery", "update", "end_to_end", "exposed"} <= set(
        log["iterations"][-1])
    assert png.stat().st_size > 1000
    assert "iter    2/4" in capsys.readouterr().out


def test_demo_runs_both_modes(tmp_path: Path, capsys) -> None:
    rc = demo_main(["--algo", "ppo", "--image-size", "32", "--iters", "2", "--actors", "1",
                    "--no-use-ray", "--device", "cpu", "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "exposed experience-path latency" in text and "plan Conduit chose" in text
    res = json.loads((tmp_path / "demo.json").read_text())
    assert res["inline"]["buffer"] == "inline" and res["conduit"]["buffer"] == "conduit"
    assert (tmp_path / "demo.png").exists()
    # Two rounds by default (inline, Conduit, Conduit, inline), pooled: one measured
    # iteration per run (the first of each is skipped), so two per mode.
    assert res["rounds"] == 2
    assert "[conduit, round 2/2]" in text
    # Each Conduit round names the schedule it kept; the JSON lists them in round order.
    kept = [line.rsplit("; schedule ", 1)[1] for line in text.splitlines()
            if line.startswith("[conduit, round") and "done in" in line]
    assert kept == res["conduit_schedules"] and len(kept) == 2
    assert all(k.startswith("ing(") for k in kept)
    assert f"plan Conduit chose (round 2): placement {res['conduit']['plan']['placement']}, " \
           f"schedule {kept[-1]}" in text
    assert res["pooled"]["inline"]["iterations_measured"] == 2
    assert res["pooled"]["conduit"]["iterations_measured"] == 2


@pytest.mark.parametrize(("conduit", "said"), [
    ({"exposed": 0.001, "update": 0.140, "end_to_end": 0.180}, "37.0 ms longer"),  # the cost
    ({"exposed": 0.001, "update": 0.110, "end_to_end": 0.180}, None),  # grew less than hidden
    ({"exposed": 0.001, "update": 0.140, "end_to_end": 0.150}, None),  # end to end did not grow
    ({"exposed": 0.013, "update": 0.140, "end_to_end": 0.180}, None),  # nothing was hidden
])
def test_the_demo_names_an_update_slowed_by_more_than_was_hidden(conduit, said) -> None:
    from conduit.workloads.cli import slower_update
    inline = {"exposed": 0.013, "update": 0.103, "end_to_end": 0.155}
    got = slower_update(inline, conduit)
    if said is None:
        assert got is None
    else:
        assert got is not None and said in got and "12.0 ms of experience path" in got


def test_bench_workloads_plumbing(tmp_path: Path) -> None:
    from conduit.bench.workloads import main

    assert main(["--only", "DQN-CP", "--iters", "6", "--actors", "1", "--no-use-ray",
                 "--device", "cpu", "--rounds", "2", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "workloads.json").read_text())
    assert set(res["workloads"]) == {"DQN-CP"}
    row = res["workloads"]["DQN-CP"]
    # Two rounds per mode, pooled: 6 iterations each, none past learning_starts (one actor
    # fills 64 of 512 rows per iteration), so every iteration of both runs counts.
    assert row["inline"]["iterations_measured"] == row["conduit"]["iterations_measured"] == 12
    assert len(row["end_to_end_reduction_per_round"]) == 2
    # Every run is kept with its own schedule, in run order (inline, Conduit, Conduit, inline).
    assert [r["buffer"] for r in row["runs"]] == ["inline", "conduit", "conduit", "inline"]
    assert all(r["schedule"] and r["summary"]["iterations_measured"] == 6 for r in row["runs"])
    assert all({"schedule_trial_ms", "copy_ms_per_unit", "schedule_explain"} <= set(r)
               for r in row["runs"])
    assert row["inline_losses_finite"] and row["conduit_losses_finite"]
    assert (tmp_path / "workloads.png").exists()


def test_summaries_pool_the_runs_they_are_given() -> None:
    from conduit.workloads.breakdown import IterationRecord, summarize_records

    def rec(i: int, e2e: float, learning: bool = True) -> IterationRecord:
        return IterationRecord(iteration=i, end_to_end=e2e, rollout=0.0, ingestion=0.0,
                               delivery=0.0, update=0.0, other=e2e, env_steps=0,
                               learning=learning, wall_time=0.0)

    a = [rec(0, 9.0, False), rec(1, 100.0), rec(2, 1.0), rec(3, 2.0)]
    b = [rec(1, 100.0), rec(2, 3.0)]
    s = summarize_records([a, b], skip=1)
    assert s["iterations_measured"] == 3 and s["end_to_end"] == 2.0
    with pytest.raises(ValueError):
        summarize_records([])


def test_bench_convergence_curve_helpers() -> None:
    from conduit.bench.convergence import first_reach

    pts = [{"iteration": 1, "wall_s": 1.0, "return": float("nan")},
           {"iteration": 2, "wall_s": 2.0, "return": 150.0},
           {"iteration": 3, "wall_s": 3.0, "return": 200.0}]
    assert first_reach(pts, 195)["iteration"] == 3
    assert first_reach(pts, 500) is None


def _conduit_as_a_user(home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``conduit ARGV`` in a subprocess started the way a user starts it (no RAY_AUTH_MODE,
    ``home`` as HOME); it prints the authentication mode Ray chose for the session."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")}
    env["HOME"] = str(home)  # Ray writes its token to ~/.ray/auth_token
    run = ("import os, sys; from conduit.cli import main; rc = main(sys.argv[1:]); "
           "print('RAY_AUTH_MODE=' + os.environ.get('RAY_AUTH_MODE', '')); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", run, *argv], env=env, cwd=home,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "RAY_AUTH_MODE=token" in proc.stdout  # the mode Ray chose for the session
    assert (home / ".ray" / "auth_token").read_text().strip()
    return proc


@pytest.mark.ray
def test_conduit_train_keeps_ray_token_authentication_on(tmp_path: Path) -> None:
    """``conduit train`` on Ray actors, started the way a user starts it (no RAY_AUTH_MODE):
    Ray enables its default token authentication, writes its token, and the run attaches its
    actors with it. The library never sets RAY_AUTH_MODE itself."""
    pytest.importorskip("ray")
    _conduit_as_a_user(
        tmp_path, "train", "--algo", "dqn", "--iters", "2", "--actors", "1",
        "--envs-per-actor", "2", "--steps-per-rollout", "8", "--batch-size", "16",
        "--learning-starts", "16", "--updates-per-iter", "1", "--buffer-size", "500",
        "--device", "cpu", "--log-every", "0", "--buffer", "inline",
        "--out", str(tmp_path / "run.json"), "--plot", str(tmp_path / "run.png"))
    assert json.loads((tmp_path / "run.json").read_text())["config"]["use_ray"] is True


@pytest.mark.ray
def test_conduit_demo_keeps_ray_token_authentication_on(tmp_path: Path) -> None:
    """``conduit demo`` on a small budget, started the way a user starts it: both of its runs
    attach their Ray actors to a Ray with token authentication on."""
    pytest.importorskip("ray")
    proc = _conduit_as_a_user(
        tmp_path, "demo", "--algo", "ppo", "--image-size", "32", "--iters", "2", "--rounds",
        "1", "--actors", "1", "--device", "cpu", "--out", str(tmp_path / "demo"))
    assert "plan Conduit chose" in proc.stdout
    res = json.loads((tmp_path / "demo" / "demo.json").read_text())
    assert res["inline"]["config"]["use_ray"] is True
    assert res["conduit"]["config"]["use_ray"] is True


def _train(tmp_path: Path, *flags: str) -> list[str]:
    return ["--no-use-ray", "--iters", "1", "--actors", "1", "--envs-per-actor", "1",
            "--steps-per-rollout", "4", "--log-every", "0", "--out", str(tmp_path / "t.json"),
            "--plot", str(tmp_path / "t.png"), *flags]


@pytest.mark.parametrize("text", ["bogus", "x,1,0,1", "1,1/0,0,1", "1,1,0"])
def test_a_malformed_schedule_is_a_config_error_naming_the_form(text: str, tmp_path: Path,
                                                                capsys) -> None:
    from conduit.errors import ConfigError
    from conduit.workloads.args import parse_schedule

    with pytest.raises(ConfigError, match="ov_ing,g_ing,ov_del,g_del") as exc:
        parse_schedule(text)
    assert exc.value.field == "schedule"
    with pytest.raises(SystemExit) as exited:  # a usage error naming --schedule
        train_main(_train(tmp_path, "--schedule", text))
    assert exited.value.code == 2
    assert "argument --schedule" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_an_unknown_device_is_a_config_error(tmp_path: Path) -> None:
    from conduit.errors import ConfigError
    from conduit.workloads.learner import resolve_device

    with pytest.raises(ConfigError, match="--device auto, cpu or cuda:N") as exc:
        resolve_device("bogus")
    assert exc.value.field == "device"
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last (cuda:0 without CUDA)
    with pytest.raises(ConfigError, match="CUDA device") as exc:
        resolve_device(missing)
    assert exc.value.field == "device"
    with pytest.raises(ConfigError, match="device"):
        train_main(_train(tmp_path, "--device", "bogus"))
    with pytest.raises(ConfigError, match="device"):
        demo_main(["--no-use-ray", "--device", "bogus", "--out", str(tmp_path / "demo")])


def test_an_unknown_environment_is_a_config_error(tmp_path: Path) -> None:
    from conduit.errors import ConfigError
    from conduit.workloads.envs import make_env

    with pytest.raises(ConfigError, match="CartPole-v1") as exc:
        make_env("NoSuchEnv-v0")
    assert exc.value.field == "env"
    with pytest.raises(ConfigError, match="NoSuchEnv-v0"):
        train_main(_train(tmp_path, "--env", "NoSuchEnv-v0"))


@pytest.mark.parametrize("algo, flag", [("ppo", "--learning-rate"), ("dqn", "--learning-rate"),
                                        ("sac", "--q-lr"), ("sac", "--policy-lr")])
@pytest.mark.parametrize("value", ["-1", "0", "inf"])
def test_a_learning_rate_must_be_finite_and_positive(algo: str, flag: str, value: str,
                                                     tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        train_main(_train(tmp_path, "--algo", algo, flag, value))
    assert exc.value.code == 2
    assert f"argument {flag}: must be a finite number > 0, got {value}" in capsys.readouterr().err


def test_demo_refuses_an_unknown_algorithm_and_lists_the_choices(tmp_path: Path,
                                                                 capsys) -> None:
    from conduit.errors import ConfigError
    from conduit.workloads.cli import DemoArgs, _demo_args

    with pytest.raises(SystemExit) as exc:
        demo_main(["--algo", "foo", "--out", str(tmp_path)])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert "argument --algo: invalid choice: 'foo'" in err and out == ""
    with pytest.raises(SystemExit):
        demo_main(["--help"])
    assert "--algo {dqn,ppo,sac}" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="must be dqn, sac or ppo") as cfg:
        _demo_args(DemoArgs(algo="foo", device="cpu"), "inline")  # type: ignore[arg-type]
    assert cfg.value.field == "algo"
