"""``conduit train`` and ``conduit demo`` guard their runs: a diverging run (a loss, or the
policy's output in a rollout, not finite) stops with its summary and JSON, and a rollout of a
diverged policy takes stand-in actions instead of failing; flags, environments and missing
extras that cannot run are refused before the run, naming the flag or the extra; GRPO prints
progress, checks its output path first and writes its steps so far when interrupted; epsilon
goes linearly from --start-e to --end-e. Tiny in-process runs; behaviour only, never timings."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conduit.cli import main
from conduit.workloads import dqn
from conduit.workloads.actors import RolloutWorker
from conduit.workloads.envs import env_info
from tests.conftest import usage_error

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames


def _tiny(tmp_path: Path, *flags: str) -> list[str]:
    return ["train", "--no-use-ray", "--device", "cpu", "--actors", "1", "--envs-per-actor",
            "2", "--steps-per-rollout", "4", "--iters", "3", "--buffer", "inline",
            "--log-every", "0", "--out", str(tmp_path / "t.json"), "--plot",
            str(tmp_path / "t.png"), *flags]


# A diverging run stops with the summary and JSON.

@pytest.mark.parametrize("flags", [
    ["--algo", "sac", "--reward-scale", "1e38", "--learning-starts", "0", "--batch-size", "4",
     "--buffer-size", "100", "--updates-per-iter", "2"],
    ["--algo", "ppo", "--vf-coef", "1e38", "--gamma", "1", "--gae-lambda", "1",
     "--steps-per-rollout", "16", "--rollout-fragments", "1", "--num-minibatches", "2",
     "--update-epochs", "2"],  # returns up to 16: a value loss over 3.4e38 / 1e38
    ["--algo", "ppo", "--learning-rate", "3.4e37"],  # the largest rate Adam can step with
], ids=["sac", "ppo", "ppo-largest-learning-rate"])
def test_a_diverging_run_stops_with_its_summary_and_json(flags: list[str], tmp_path: Path,
                                                         capsys) -> None:
    assert main(_tiny(tmp_path, *flags)) == 1
    out = capsys.readouterr().out
    assert "losses finite: False" in out and "a loss was not finite" in out
    log = json.loads((tmp_path / "t.json").read_text())
    assert log["losses_finite"] is False and len(log["iterations"]) < 3
    assert log["diverged"] == "a loss was not finite"
    assert (tmp_path / "t.png").exists()


_OFF_POLICY = ["--learning-starts", "0", "--batch-size", "4", "--buffer-size", "100",
               "--updates-per-iter", "1"]
_ONE_UPDATE = ["--num-minibatches", "1", "--update-epochs", "1"]


# One update an iteration, at a rate that leaves finite weights whose outputs overflow: the
# next rollout's policy output is not finite before any loss is.
@pytest.mark.parametrize("flags, fix", [
    (["--algo", "ppo", "--image-size", "16", *_ONE_UPDATE, "--learning-rate", "1e30"],
     "lower --learning-rate"),
    (["--algo", "ppo", "--env", "Pendulum-v1", "--image-size", "16", *_ONE_UPDATE,
      "--learning-rate", "1e30"], "lower --learning-rate"),
    (["--algo", "sac", "--policy-lr", "3.4e37", *_OFF_POLICY], "lower --q-lr and --policy-lr"),
    (["--algo", "dqn", "--learning-rate", "1e30", *_OFF_POLICY], "lower --learning-rate"),
], ids=["ppo-discrete", "ppo-continuous", "sac", "dqn"])
def test_a_diverged_policy_stops_the_run_with_its_summary_and_json(
        flags: list[str], fix: str, tmp_path: Path, capsys) -> None:
    assert main(_tiny(tmp_path, *flags)) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    stop = next(ln for ln in out.splitlines() if "stopped after iteration" in ln)
    assert "the policy's output was not finite for" in stop and "the run diverged" in stop
    assert fix in stop
    log = json.loads((tmp_path / "t.json").read_text())
    assert log["diverged"].startswith("the policy's output was not finite for")
    assert len(log["iterations"]) < 3 and not log["iterations"][-1]["learning"]
    assert (tmp_path / "t.png").exists()


@pytest.mark.parametrize("algo, env", [("ppo", "CartPole-v1"), ("ppo", "Pendulum-v1"),
                                       ("sac", "Pendulum-v1"), ("dqn", "CartPole-v1")])
def test_a_rollout_of_a_nan_policy_takes_stand_in_actions(algo: str, env: str) -> None:
    info = env_info(env)
    worker = RolloutWorker(algo=algo, env_id=env, info=info, num_envs=2, seed=0,
                           single_thread=False)
    try:
        nan = {k: torch.full_like(v, float("nan"))
               for k, v in worker.policy.state_dict().items()}
        out = worker.rollout(3, nan)
    finally:
        worker.close()
    assert out["stats"]["nonfinite"] == 6  # every action: 3 steps of 2 envs
    action = out["rollout"]["action"]
    assert np.isfinite(action).all()
    if not info.discrete:
        assert ((info.action_low <= action) & (action <= info.action_high)).all()
    assert np.isfinite(out["rollout"]["obs"]).all()  # the environments took them


# Values refused as usage errors naming the flag, before the run.

def test_ppo_refuses_mini_batches_of_one_row_with_norm_adv(tmp_path: Path, capsys,
                                                           no_ray) -> None:
    flags = ["--algo", "ppo", "--envs-per-actor", "1", "--rollout-fragments", "1",
             "--num-minibatches", "4"]  # 4 rows an iteration
    usage_error(_tiny(tmp_path, *flags), "--num-minibatches", "mini-batches of 1 row",
                capsys)
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("flags, flag, says", [
    (["--algo", "dqn", "--env", "MultiAgentCartPole", "--image-size", "16"], "--image-size",
     "not supported on MultiAgentCartPole"),
    (["--algo", "dqn", "--env", "Blackjack-v1"], "--env", "not one array"),
    (["--algo", "dqn", "--env", "FrozenLake-v1", "--image-size", "16"], "--image-size",
     "drawn from a Box observation"),
    (["--algo", "sac", "--reward-scale", "inf"], "--reward-scale", "must be a finite number"),
    (["--algo", "sac", "--alpha", "inf", "--no-autotune"], "--alpha", "finite"),
    (["--algo", "sac", "--alpha", "-1", "--no-autotune"], "--alpha", "must be >= 0"),
    (["--algo", "dqn", "--prioritized", "--per-alpha", "-1"], "--per-alpha", "must be >= 0"),
    (["--algo", "dqn", "--prioritized", "--per-beta", "inf"], "--per-beta", "finite"),
    (["--algo", "ppo", "--learning-rate", "1e38"], "--learning-rate",
     "must be at most 3.4e+37, got 1e+38: Adam's first step"),
    (["--algo", "dqn", "--learning-rate", "1e38"], "--learning-rate", "must be at most 3.4e+37"),
    (["--algo", "sac", "--q-lr", "1e38"], "--q-lr", "must be at most 3.4e+37"),
    (["--algo", "sac", "--policy-lr", "3.5e37"], "--policy-lr",
     "beyond float32's largest value"),
])
def test_flags_and_environments_that_cannot_run_are_usage_errors(
        flags: list[str], flag: str, says: str, tmp_path: Path, capsys, no_ray) -> None:
    usage_error(_tiny(tmp_path, *flags), flag, says, capsys)
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("value, says", [("inf", "finite"), ("-1", "must be >= 0")])
def test_grpo_beta_must_be_finite_and_not_negative(value: str, says: str, tmp_path: Path,
                                                   capsys) -> None:
    usage_error(["train", "--algo", "grpo", "--beta", value, "--out", str(tmp_path / "g.json")],
                "--beta", says, capsys)


def test_demo_refuses_iters_too_few_for_an_update(tmp_path: Path, capsys, no_ray) -> None:
    err = usage_error(["demo", "--iters", "3", "--actors", "2", "--out", str(tmp_path / "d")],
                      "--iters", "too few for an update", capsys)
    assert "--iters 4 or more" in err  # 512 transitions at 2 x 64 an iteration
    assert not (tmp_path / "d").exists()


def test_demo_with_iters_enough_for_an_update_reports_the_reductions(tmp_path: Path,
                                                                     capsys) -> None:
    assert main(["demo", "--iters", "4", "--rounds", "1", "--image-size", "16", "--actors",
                 "2", "--no-use-ray", "--device", "cpu", "--log-every", "0",
                 "--out", str(tmp_path)]) == 0
    assert "exposed experience-path latency" in capsys.readouterr().out
    res = json.loads((tmp_path / "demo.json").read_text())
    assert res["inline"]["updates"] > 0 and res["conduit"]["updates"] > 0


# Missing optional extras: one line naming the extra.

def test_train_without_ray_names_the_extra(tmp_path: Path, capsys,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    argv = [a for a in _tiny(tmp_path, "--algo", "dqn") if a != "--no-use-ray"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "use_ray" in err and "pip install 'conduit-rl[ray]'" in err
    assert not (tmp_path / "t.json").exists()


def test_train_grpo_without_trl_names_the_extra(tmp_path: Path, capsys,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "trl", None)  # import trl fails
    assert main(["train", "--algo", "grpo", "--steps", "1",
                 "--out", str(tmp_path / "g.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "pip install 'conduit-rl[trl]'" in err
    assert not (tmp_path / "g.json").exists()


# GRPO: the output path before the run, progress lines, and an interrupt writes the steps.

def test_train_grpo_checks_its_default_output_path_before_training(
        tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    from conduit.workloads import grpo

    calls: list[Any] = []
    monkeypatch.setattr(grpo, "train", lambda args, **kw: calls.append(args))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("")  # a file where the default folder would be
    assert main(["train", "--algo", "grpo", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "out: cannot create the folder" in err and "--out" in err
    assert not calls


def _grpo(tmp_path: Path, *flags: str) -> list[str]:
    return ["train", "--algo", "grpo", "--batch-size", "4", "--num-generations", "2",
            "--steps-per-generation", "1", "--max-completion-length", "4", "--hidden", "16",
            "--layers", "1", "--out", str(tmp_path / "g.json"), *flags]


def test_train_grpo_prints_progress(tmp_path: Path, capsys) -> None:
    pytest.importorskip("trl")
    assert main(_grpo(tmp_path, "--steps", "3", "--log-every", "2")) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[grpo")]
    assert [ln.split("|")[0].split()[-1] for ln in lines] == ["2/3", "3/3"], lines
    assert "reward" in lines[0] and "loss" in lines[0]


def test_an_interrupted_grpo_run_writes_its_steps_so_far(
        tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("trl")
    from conduit.workloads import grpo_task

    real, calls = grpo_task.reward_fn, [0]

    def reward_fn(task: str) -> Any:
        score = real(task)

        def interrupting(**kw: Any) -> Any:
            calls[0] += 1
            if calls[0] == 3:  # the third step's generation batch
                raise KeyboardInterrupt
            return score(**kw)

        return interrupting

    monkeypatch.setattr(grpo_task, "reward_fn", reward_fn)
    assert main(_grpo(tmp_path, "--steps", "5", "--log-every", "0")) == 130
    out, err = capsys.readouterr()
    assert err == "conduit train: interrupted\n"
    assert "interrupted after 2 steps" in out
    log = json.loads((tmp_path / "g.json").read_text())
    assert log["interrupted"] is True and len(log["losses"]) == 2
    assert log["args"]["steps"] == 5


# Epsilon goes linearly from --start-e to --end-e, either way.

def test_epsilon_rises_linearly_when_end_e_is_above_start_e() -> None:
    args = dqn.Args(use_ray=False, device="cpu", actors=1, envs_per_actor=1,
                    steps_per_rollout=10, iters=4, buffer="inline", log_every=0,
                    learning_starts=1_000, buffer_size=1_000, start_e=0.1, end_e=0.9,
                    exploration_steps=20)
    res = dqn.train(args)
    seen = [r.metrics["epsilon"] for r in res.records]
    assert seen == pytest.approx([0.1, 0.5, 0.9, 0.9])
