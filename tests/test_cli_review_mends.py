"""Review mends of ``conduit train`` and ``conduit demo``: SIGTERM and Ctrl-C inside an
operator take the interrupt path, and an interrupted run writes its iterations so far;
``--seed``, ``--plot``, ``--schedule``, ``--hidden``, ``--ent-coef``/``--vf-coef`` and
``--actors`` are refused as usage errors (or one-line errors) naming the flag, before the run;
the demo's first line says what it runs. In-process runs of one or a few iterations, no Ray."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from conduit.cli import main
from tests.conftest import usage_error


def _train(tmp_path: Path, *flags: str) -> list[str]:
    return ["train", "--no-use-ray", "--device", "cpu", "--iters", "3", "--actors", "1",
            "--envs-per-actor", "1", "--steps-per-rollout", "4", "--log-every", "0",
            "--out", str(tmp_path / "t.json"), "--plot", str(tmp_path / "t.png"), *flags]


@pytest.fixture
def sigterm_guard() -> Any:
    """A SIGTERM handler of the test's own (so a SIGTERM nobody handles does not kill pytest):
    it raises an error that is no interrupt. Restored afterwards."""
    def guard(signum: int, frame: object) -> None:
        raise RuntimeError("SIGTERM reached the previous handler")

    previous = signal.signal(signal.SIGTERM, guard)
    yield guard
    signal.signal(signal.SIGTERM, previous)


# -- 1. SIGTERM stops a run as Ctrl-C does ---------------------------------------------------


def test_sigterm_mid_run_stops_train_in_one_line_with_143(
        tmp_path, capsys, monkeypatch: pytest.MonkeyPatch, sigterm_guard) -> None:
    from conduit.workloads import ppo

    real, calls = ppo.compute_gae, [0]

    def gae(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(ppo, "compute_gae", gae)
    assert main(_train(tmp_path, "--algo", "ppo", "--update-epochs", "1")) == 143
    err = capsys.readouterr().err
    assert err == "conduit train: terminated (SIGTERM)\n", err
    assert signal.getsignal(signal.SIGTERM) is sigterm_guard  # the previous handler is back


def test_sigterm_handler_survives_ray_init(monkeypatch: pytest.MonkeyPatch,
                                           sigterm_guard) -> None:
    """``ray.init`` sets SIGTERM handlers of its own: the interrupt handler is set again."""
    import ray

    from conduit.workloads import actors

    def fake_init(**kw: Any) -> None:  # as ray.init does
        signal.signal(signal.SIGTERM, lambda s, f: None)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with actors.sigterm_interrupts(), actors.ray_running(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is sigterm_guard


def test_train_and_demo_help_say_what_sigterm_does(capsys) -> None:
    for cmd in ("train", "demo"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "SIGTERM stops the" in out and "130 or 143" in out, out


# -- 3. Ctrl-C inside an operator ------------------------------------------------------------


def test_ctrl_c_inside_an_operator_is_an_interrupt(tmp_path, capsys,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from conduit.workloads import ppo

    real, calls = ppo.compute_gae, [0]

    def gae(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(ppo, "compute_gae", gae)
    assert main(_train(tmp_path, "--algo", "ppo", "--update-epochs", "1")) == 130
    assert capsys.readouterr().err == "conduit train: interrupted\n"


# -- 2. An interrupted run writes what it recorded -------------------------------------------


def test_an_interrupted_run_writes_its_iterations_so_far(tmp_path, capsys,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from conduit.workloads import ppo

    real, calls = ppo.compute_gae, [0]

    def gae(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == 9:  # the third iteration's first rollout (4 fragments each)
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(ppo, "compute_gae", gae)
    assert main(_train(tmp_path, "--algo", "ppo", "--update-epochs", "1")) == 130
    out, err = capsys.readouterr()
    assert err == "conduit train: interrupted\n"
    assert "interrupted after 2 iterations" in out
    log = json.loads((tmp_path / "t.json").read_text())
    assert log["interrupted"] is True and log["algo"] == "ppo"
    assert [r["iteration"] for r in log["iterations"]] == [0, 1]
    assert log["config"]["iters"] == 3


# -- 6, 7, 9, 10, 11. Flags refused before the run -------------------------------------------


@pytest.mark.parametrize("cmd", [["train", "--algo", "ppo"], ["train", "--algo", "grpo"],
                                 ["demo"]])
def test_a_seed_beyond_32_bits_is_a_usage_error(cmd: list[str], capsys) -> None:
    usage_error([*cmd, "--seed", str(2**32)], "--seed", "must be <= 4294967295", capsys)


@pytest.mark.parametrize("plot, says", [("p.xyz", "must end in .png, .pdf or .svg"),
                                        ("p", "got no suffix")])
def test_a_plot_format_matplotlib_is_not_asked_for_is_refused_before_the_run(
        tmp_path, plot: str, says: str, capsys) -> None:
    argv = _train(tmp_path, "--algo", "ppo")
    argv[argv.index("--plot") + 1] = str(tmp_path / plot)
    usage_error(argv, "--plot", says, capsys)
    assert not (tmp_path / "t.json").exists()


def test_the_same_file_for_out_and_plot_is_refused(tmp_path, capsys) -> None:
    argv = _train(tmp_path, "--algo", "ppo")
    argv[argv.index("--out") + 1] = str(tmp_path / "t.png")
    usage_error(argv, "--plot", "is also the --out path", capsys)


def test_grpo_hidden_must_split_into_its_heads(tmp_path, capsys) -> None:
    if importlib.util.find_spec("trl") is None:
        pytest.skip("needs the [trl] extra")
    usage_error(["train", "--algo", "grpo", "--steps", "1", "--hidden", "12",
                 "--out", str(tmp_path / "g.json")], "--hidden", "must be a multiple of 8",
                capsys)


@pytest.mark.parametrize("flag", ["--ent-coef", "--vf-coef"])
def test_an_infinite_ppo_coefficient_is_a_usage_error(tmp_path, flag: str, capsys) -> None:
    usage_error(_train(tmp_path, "--algo", "ppo", flag, "inf"), flag, "finite", capsys)


def test_demo_first_line_follows_the_flags(tmp_path, capsys,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from conduit.workloads import ppo

    def train(args: object) -> None:
        raise KeyboardInterrupt  # stop after the first line

    monkeypatch.setattr(ppo, "train", train)
    assert main(["demo", "--algo", "ppo", "--image-size", "0", "--no-use-ray", "--device",
                 "cpu", "--out", str(tmp_path / "d")]) == 130
    first = capsys.readouterr().out.splitlines()[0]
    assert "no image payload" in first and "2 in-process workers" in first, first
    assert "0x0" not in first and "Ray" not in first


# -- 8. --schedule inline on-policy; an infeasible --schedule --------------------------------


def test_ppo_runs_schedule_inline(tmp_path) -> None:
    from conduit.workloads import ppo

    res = ppo.train(ppo.Args(schedule="inline", iters=1, use_ray=False, actors=1,
                             envs_per_actor=1, steps_per_rollout=4, update_epochs=1,
                             log_every=0, device="cpu"))
    assert res.plan["schedule"] == "ing(ov=0,g=1) del(ov=0,g=1/4)"


@pytest.mark.parametrize("algo, schedule, says", [
    ("ppo", "1,1,1,1/8", "g_del: 1/8 is not feasible for on_policy"),
    ("dqn", "1,9,1,1", "g_ing: 9 is not feasible for off_policy"),
])
def test_an_infeasible_schedule_is_a_usage_error(tmp_path, algo: str, schedule: str,
                                                 says: str, capsys) -> None:
    usage_error(_train(tmp_path, "--algo", algo, "--schedule", schedule), "--schedule", says,
                capsys)


# -- 5. More Ray actors than the cluster's CPUs ----------------------------------------------


def test_more_actors_than_the_cpus_hold_is_refused() -> None:
    from conduit.errors import ConfigError
    from conduit.workloads.actors import check_actor_cpus

    check_actor_cpus(8, 0.25, 2.0)
    with pytest.raises(ConfigError, match=r"pass a smaller --actors") as exc:
        check_actor_cpus(9, 0.25, 2.0)
    assert exc.value.field == "actors" and "at most 8 actors" in str(exc.value)


def test_actor_group_refuses_before_creating_actors(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from conduit.errors import ConfigError
    from conduit.workloads.actors import ActorGroup

    def no_actors(*a: Any, **k: Any) -> Any:
        raise AssertionError("an actor was created")

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "remote", no_actors)
    with pytest.raises(ConfigError) as exc:
        ActorGroup(9, use_ray=True)
    assert exc.value.field == "actors"
