"""Flag values the commands refuse at parse time, naming the flag, before any work or output;
and ``--quick``, which changes only the flags left at their defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conduit.cli import main


def _usage_error(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``conduit argv``: a usage error (exit status 2) naming ``flag``; its stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and f"argument {flag}: " in err, err
    assert "Traceback" not in err
    return err


def _no_run(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[Any]:
    """Replace ``module.run`` by a recorder, so that a value let through does no work."""
    calls: list[Any] = []
    monkeypatch.setattr(module, "run", lambda a: calls.append(a) or {})
    return calls


# -- 1. bench rllib --capacities ---------------------------------------------------------------


@pytest.mark.parametrize("value", ["100", "150", "250", "1001"])
def test_rllib_capacities_the_microbenchmark_cannot_fill_are_refused(
        value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from conduit.bench import rllib as bench_rllib

    calls = _no_run(monkeypatch, bench_rllib)
    err = _usage_error(["bench", "rllib", "--capacities", "1000", value,
                        "--out", str(tmp_path / "r")], "--capacities", capsys)
    assert value in err
    assert not calls and not (tmp_path / "r").exists()


def test_rllib_capacities_multiples_of_the_episode_length_are_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from conduit.bench import rllib as bench_rllib

    calls = _no_run(monkeypatch, bench_rllib)
    assert main(["bench", "rllib", "--capacities", "200", "300", "10000",
                 "--out", str(tmp_path / "r")]) == 0
    assert calls[0].capacities == (200, 300, 10_000)


def test_rllib_microbench_fill_ends_although_the_buffer_evicts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """RLlib's buffers evict whole episodes, so one may never report ``capacity`` rows: the
    fill counts what it added instead of waiting for the buffer to be full."""
    pytest.importorskip("ray.rllib")
    from conduit.bench import rllib as bench_rllib
    from conduit.errors import ConfigError

    adds: list[int] = []

    class Evicting:
        """Keeps one episode at most, as a buffer whose capacity is not a multiple of it."""

        def add(self, episodes: list[Any]) -> None:
            adds.append(len(episodes))
            assert len(adds) < 1000, "the fill does not end"

        def get_num_timesteps(self) -> int:
            return 100

        def sample(self, **_: Any) -> list[Any]:
            return []

        def update_priorities(self, *_: Any) -> None:
            pass

    names = ("rllib-uniform", "conduit-uniform", "rllib-prioritized", "conduit-prioritized")
    monkeypatch.setattr(bench_rllib, "micro_buffers", lambda cap: {n: Evicting() for n in names})
    out = bench_rllib.microbench(300, 1)
    assert set(out) == set(names)
    assert sum(adds) == len(names) * (3 + 2)  # 3 episodes to fill, 2 timed, per buffer
    with pytest.raises(ConfigError) as exc:
        bench_rllib.microbench(250, 1)
    assert exc.value.field == "capacities"


# -- 4. values a library would refuse with a traceback ------------------------------------------


@pytest.mark.parametrize("device", ["bogus", "cuda:99", "cuda:x"])
def test_placement_refuses_a_learner_device_it_cannot_use(
        device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from conduit.bench import placement

    calls = _no_run(monkeypatch, placement)
    err = _usage_error(["bench", "placement", "--quick", "--learner-device", device,
                        "--out", str(tmp_path / "p")], "--learner-device", capsys)
    assert repr(device) in err
    assert not calls and not (tmp_path / "p").exists()


def test_placement_run_refuses_a_bad_device_with_a_config_error() -> None:
    from conduit.bench.placement import PlacementBenchArgs, run
    from conduit.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        run(PlacementBenchArgs(quick=True, learner_device="bogus"))
    assert exc.value.field == "learner_device"


def test_grpo_refuses_an_unknown_task_before_building_a_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from conduit.bench import grpo

    calls = _no_run(monkeypatch, grpo)
    err = _usage_error(["bench", "grpo", "--quick", "--task", "bogus",
                        "--out", str(tmp_path / "g")], "--task", capsys)
    assert "'bogus'" in err and "target" in err and "copy" in err
    assert not calls and not (tmp_path / "g").exists()


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "1e400", "4K,inf"])
def test_profile_refuses_sizes_that_are_not_finite(value: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(["profile", "--no-cache", f"--sizes={value}"], "--sizes", capsys)
    assert "usage: conduit profile" in err and "a finite size" in err


# -- 5. unknown names for choice flags -----------------------------------------------------------


@pytest.mark.parametrize("bench, argv, flag", [
    ("rllib", ["--schedule", "bogus"], "--schedule"),
    ("rllib", ["--only", "DQN-CP", "nosuch"], "--only"),
    ("workloads", ["--only", "nosuch"], "--only"),
    ("convergence", ["--algos", "ppo", "sac"], "--algos"),
    ("grpo", ["--pad", "bogus"], "--pad"),
])
def test_an_unknown_name_is_a_usage_error_before_any_output(
        bench: str, argv: list[str], flag: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    module = importlib.import_module(f"conduit.bench.{bench}")
    calls = _no_run(monkeypatch, module)
    err = _usage_error(["bench", bench, *argv, "--out", str(tmp_path / "o")], flag, capsys)
    assert "bogus" in err or "nosuch" in err or "sac" in err
    assert not calls and not (tmp_path / "o").exists()


@pytest.mark.parametrize("bench, argv, field, value", [
    ("rllib", ["--schedule", "prefetch", "--only", "SAC-CP", "PPO-img128"], "schedule",
     "prefetch"),
    ("workloads", ["--only", "DQN-CP", "PPO-CP"], "only", ("DQN-CP", "PPO-CP")),
    ("convergence", ["--algos", "dqn"], "algos", ("dqn",)),
    ("grpo", ["--pad", "iteration", "--task", "copy"], "pad", "iteration"),
])
def test_known_names_are_taken(bench: str, argv: list[str], field: str, value: object,
                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    module = importlib.import_module(f"conduit.bench.{bench}")
    calls = _no_run(monkeypatch, module)
    assert main(["bench", bench, *argv, "--out", str(tmp_path / "o")]) == 0
    assert getattr(calls[0], field) == value


def test_run_refuses_unknown_names_with_a_config_error() -> None:
    from conduit.bench import convergence, grpo, rllib, workloads
    from conduit.errors import ConfigError

    for call, field in ((lambda: rllib.run(rllib.RllibBenchArgs(only=("nosuch",))), "only"),
                        (lambda: rllib.run(rllib.RllibBenchArgs(schedule="x")), "schedule"),
                        (lambda: workloads.run(workloads.WorkloadBenchArgs(only=("x",))), "only"),
                        (lambda: convergence.run(convergence.ConvergenceArgs(algos=("sac",))),
                         "algos"),
                        (lambda: grpo.run(grpo.GRPOBenchArgs(pad="x")), "pad"),
                        (lambda: grpo.run(grpo.GRPOBenchArgs(task="x")), "task")):
        with pytest.raises(ConfigError) as exc:
            call()
        assert exc.value.field == field


# -- 6. --quick changes only the flags left at their defaults ------------------------------------


def _parsed(bench: str, argv: list[str], tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> Any:
    """The arguments ``conduit bench NAME argv`` hands to its ``run``."""
    import importlib

    module = importlib.import_module(f"conduit.bench.{bench}")
    calls = _no_run(monkeypatch, module)
    assert main(["bench", bench, *argv, "--out", str(tmp_path / bench)]) == 0
    return calls[0]


@pytest.mark.parametrize("bench, argv, explicit, quick", [
    ("plane", ["--dim", "16", "--iters", "2", "--batch-size", "16"],
     {"dim": 16, "iters": 2, "batch_size": 16}, {"capacity": 2000, "hidden": 32}),
    ("persist", ["--capacity", "3000", "--every-s", "0.5", "--segments", "2"],
     {"capacity": 3000, "every_s": 0.5, "segments": 2}, {"dim": 64, "loop_s": 1.5}),
    ("rllib", ["--seeds", "2", "--capacities", "2000"],
     {"seeds": 2, "capacities": (2000,)}, {"repeats": 3}),
    ("grpo", ["--steps", "3", "--lengths", "4", "12"],
     {"steps": 3, "lengths": (4, 12)}, {"rounds": 1}),
])
def test_explicit_flags_win_over_quick(bench: str, argv: list[str], explicit: dict[str, Any],
                                       quick: dict[str, Any], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    module = importlib.import_module(f"conduit.bench.{bench}")
    given = _parsed(bench, ["--quick", *argv], tmp_path, monkeypatch)
    args = module.effective(given)
    assert {k: getattr(args, k) for k in explicit} == explicit
    assert {k: getattr(args, k) for k in quick} == quick
    assert args.quick
    # without --quick nothing changes
    plain = module.effective(_parsed(bench, argv, tmp_path, monkeypatch))
    defaults = type(plain)()
    assert {k: getattr(plain, k) for k in quick} == {k: getattr(defaults, k) for k in quick}


def test_placement_quick_keeps_explicit_flags(tmp_path: Path) -> None:
    from conduit.bench import placement
    from conduit.cli_args import command_parser, parse_command

    def parsed(*argv: str) -> placement.PlacementBenchArgs:
        parser = command_parser("conduit bench placement", "", placement.PlacementBenchArgs)
        return parse_command(parser, placement.PlacementBenchArgs,
                             [*argv, "--out", str(tmp_path / "p")])

    explicit = ("--capacity", "50000", "--repeats", "9", "--dims", "64", "300", "700")
    args = placement.effective(parsed("--quick", *explicit))
    assert (args.capacity, args.repeats, args.dims) == (50000, 9, (64, 300, 700))
    assert (args.warmup, args.max_buffer_gb, args.shards) == (2, 0.064, (2,))
    assert placement.effective(parsed("--quick")).dims == (128, 1000)
    plain = placement.effective(parsed(*explicit))
    assert (plain.warmup, plain.shards) == (3, (2, 4))


def test_scale_quick_keeps_explicit_flags() -> None:
    from conduit.bench.scale import ScaleBenchArgs

    e = ScaleBenchArgs(quick=True, dim=512, pushes=100, update_ms=50.0).effective()
    assert (e.dim, e.pushes, e.update_ms) == (512, 100, 50.0)
    assert (e.shards, e.rounds, e.pulls, e.fill_rows) == ((1, 2), 1, 6, 1024)
    assert ScaleBenchArgs(dim=512).effective() == ScaleBenchArgs(dim=512)


def test_plane_run_measures_with_the_explicit_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end through ``run`` (given the arguments after ``--quick``): the loop it starts
    gets the flags asked for."""
    from conduit.bench import plane

    class StopError(Exception):
        pass

    def first_loop(args: Any, **_: Any) -> None:
        raise StopError(args)

    monkeypatch.setattr(plane, "run_loop", first_loop)
    with pytest.raises(StopError) as stop:
        plane.run(plane.effective(plane.PlaneBenchArgs(quick=True, dim=16, iters=2)))
    args = stop.value.args[0]
    assert (args.dim, args.iters, args.batch_size) == (16, 2, 64)


# -- 7. float flags with bounds --------------------------------------------------------------------


_PLAN = ["plan", "--topology", "a100-8", "--dim", "10", "--capacity", "1000"]


@pytest.mark.parametrize("argv, flag", [
    ([*_PLAN, "--t-update-ms", "-5"], "--t-update-ms"),
    ([*_PLAN, "--t-rollout-ms", "-5"], "--t-rollout-ms"),
    ([*_PLAN, "--t-update-ms", "inf"], "--t-update-ms"),
    ([*_PLAN, "--sync-us=-50"], "--sync-us"),
    ([*_PLAN, "--sync-us", "inf"], "--sync-us"),
    ([*_PLAN, "--op-overhead-us=-1e9"], "--op-overhead-us"),
    (["bench", "persist", "--every-s", "-1"], "--every-s"),
    (["bench", "persist", "--every-s", "0"], "--every-s"),
    (["bench", "persist", "--loop-s", "0"], "--loop-s"),
    (["bench", "placement", "--max-buffer-gb", "-1"], "--max-buffer-gb"),
    (["bench", "placement", "--mem-fraction", "0"], "--mem-fraction"),
    (["bench", "placement", "--mem-fraction", "1.5"], "--mem-fraction"),
    (["bench", "scale", "--update-ms", "-5"], "--update-ms"),
    (["bench", "scale", "--update-ms", "inf"], "--update-ms"),
])
def test_out_of_range_floats_are_usage_errors_naming_the_flag(
        argv: list[str], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = [] if argv[0] == "plan" else ["--out", str(tmp_path / "o")]
    _usage_error([*argv, *out], flag, capsys)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("bench, argv, field, value", [
    ("persist", ["--every-s", "0.25"], "every_s", 0.25),
    ("placement", ["--mem-fraction", "1"], "mem_fraction", 1.0),
    ("placement", ["--max-buffer-gb", "0.5"], "max_buffer_gb", 0.5),
    ("scale", ["--update-ms", "0"], "update_ms", 0.0),
])
def test_floats_in_range_are_taken(bench: str, argv: list[str], field: str, value: float,
                                   tmp_path: Path) -> None:
    import importlib

    from conduit.cli_args import command_parser, parse_command

    module = importlib.import_module(f"conduit.bench.{bench}")
    cls = next(v for k, v in vars(module).items() if k.endswith("BenchArgs"))
    args = parse_command(command_parser(bench, None, cls), cls,
                         [*argv, "--out", str(tmp_path / "o")])
    assert getattr(args, field) == value


def test_plan_takes_zero_costs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_PLAN, "--t-update-ms", "0", "--sync-us", "0", "--op-overhead-us", "0"]) == 0
    assert "schedule" in capsys.readouterr().out.lower()


# -- bare commands and the command list ------------------------------------------------------------


@pytest.mark.parametrize("argv", [[], ["bench"]])
def test_a_bare_command_prints_its_help_and_exits_0(argv: list[str],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0  # as --help: the help on stdout, nothing on stderr
    out, err = capsys.readouterr()
    assert out.startswith("usage: conduit") and err == ""


def test_the_command_list_says_train_runs_grpo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "train DQN, SAC or PPO" in out and "GRPO" in out.split("train DQN", 1)[1][:120]


@pytest.mark.parametrize(("flag", "value"), [("--task", "bogus"), ("--buffer", "reverb")])
def test_train_grpo_refuses_unknown_names_before_building_a_model(
        flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(["train", "--algo", "grpo", flag, value], flag, capsys)
    assert value in err


# -- cross-flag values refused before any work, naming a real flag --------------------------------


def _closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _no_ray_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``ray.init`` fail the test: an unreachable address retries it for minutes."""
    ray = pytest.importorskip("ray")

    def init(*_: Any, **__: Any) -> None:
        raise AssertionError("ray.init was called for an address nothing listens on")

    monkeypatch.setattr(ray, "init", init)


def test_plan_refuses_a_ray_address_nothing_listens_on(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _no_ray_init(monkeypatch)
    address = f"127.0.0.1:{_closed_port()}"
    err = _usage_error(["plan", "--topology", f"ray:{address}"], "--topology", capsys)
    assert address in err


def test_scale_refuses_an_address_nothing_listens_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from conduit.bench import scale

    _no_ray_init(monkeypatch)
    calls = _no_run(monkeypatch, scale)
    address = f"127.0.0.1:{_closed_port()}"
    err = _usage_error(["bench", "scale", "--quick", "--address", address,
                        "--out", str(tmp_path / "s")], "--address", capsys)
    assert address in err
    assert not calls and not (tmp_path / "s").exists()


@pytest.mark.parametrize(("argv", "flag"), [
    (["plan", "--g-max", "65"], "--g-max"),
    (["plan", "--g-max", "2000"], "--g-max"),
    (["bench", "schedule", "--g-max", "65"], "--g-max"),
    (["bench", "schedule", "--granularities", "1", "16", "--g-max", "8"], "--granularities"),
    (["bench", "plane", "--quick", "--capacity", "32"], "--batch-size"),
    (["bench", "plane", "--quick", "--capacity", "100", "--batch-size", "16",
      "--rollout-rows", "200"], "--rollout-rows"),
    (["bench", "plane", "--quick", "--minibatches", "1000"], "--minibatches"),
    (["bench", "persist", "--quick", "--capacity", "32"], "--batch-size"),
    (["bench", "persist", "--quick", "--capacity", "100", "--batch-size", "16",
      "--rollout-rows", "200"], "--rollout-rows"),
    (["bench", "persist", "--quick", "--capacity", "100", "--rollout-rows", "60"],
     "--rollout-rows"),
    (["bench", "peers", "--quick", "--capacity", "100"], "--capacity"),
    (["bench", "peers", "--quick", "--epoch-rows", "10"], "--epoch-rows"),
    (["bench", "peers", "--quick", "--epoch-rows", "4"], "--epoch-rows"),
    (["bench", "placement", "--quick", "--dims", "10000000"], "--dims"),
])
def test_cross_flag_values_are_usage_errors_before_any_work(
        argv: list[str], flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import conduit.plan_cli as plan_cli
    from conduit.bench import persist, placement, plane, schedule
    from conduit.bench.peers import harness

    recorded = [_no_run(monkeypatch, m) for m in (persist, placement, plane, schedule, harness)]
    monkeypatch.setattr(plan_cli, "plan", lambda a: recorded[0].append(a))
    out = [] if argv[0] == "plan" else ["--out", str(tmp_path / "o")]
    err = _usage_error([*argv, *out], flag, capsys)
    assert "g_max_ing" not in err and "num_minibatches" not in err and "--batch " not in err
    assert not any(recorded) and not (tmp_path / "o").exists()


def test_schedule_quick_clips_its_granularities_to_an_explicit_g_max(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from conduit.bench import schedule

    calls = _no_run(monkeypatch, schedule)
    assert main(["bench", "schedule", "--quick", "--g-max", "2",
                 "--out", str(tmp_path / "s")]) == 0
    ran = schedule.check_args(calls[0])
    assert ran.g_max == 2 and ran.granularities == (1, 2)


def test_plan_and_schedule_take_the_largest_g_max(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from conduit.bench import schedule
    from conduit.plan_cli import MAX_G_FLAG

    calls = _no_run(monkeypatch, schedule)
    assert main(["bench", "schedule", "--g-max", str(schedule.MAX_G_FLAG),
                 "--out", str(tmp_path / "s")]) == 0
    assert calls[0].g_max == schedule.MAX_G_FLAG
    assert main(["plan", "--topology", "a100-8", "--g-max", str(MAX_G_FLAG)]) == 0


def test_peers_flags_are_not_abbreviated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--quick`` keeps the flags written out; an abbreviation would be overwritten."""
    from conduit.bench.peers import harness

    calls: list[Any] = []

    def record(cfg: Any, **_: Any) -> Any:
        calls.append(cfg)
        raise SystemExit(0)

    monkeypatch.setattr(harness, "run", record)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "peers", "--quick", "--peers", "conduit", "--dim", "64",
              "--out", str(tmp_path / "p")])
    assert exc.value.code == 2
    assert "--dim" in capsys.readouterr().err
    assert not calls


def test_peers_quick_keeps_flags_written_out(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    from conduit.bench.peers import harness

    calls: list[Any] = []

    def record(cfg: Any, **_: Any) -> Any:
        calls.append(cfg)
        raise SystemExit(0)

    monkeypatch.setattr(harness, "run", record)
    with pytest.raises(SystemExit):
        main(["bench", "peers", "--quick", "--peers", "conduit", "--dims", "64",
              "--capacity", "2048", "--out", str(tmp_path / "p")])
    assert calls[0].dims == (64,) and calls[0].capacity == 2048


def test_profile_refuses_a_size_larger_than_memory_can_hold(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from conduit.placement import bandwidth

    calls: list[Any] = []
    monkeypatch.setattr(bandwidth, "profile_bandwidth", lambda **kw: calls.append(kw))
    err = _usage_error(["profile", "--no-cache", "--repeats", "1",
                        "--sizes", "64K,999999999999999"], "--sizes", capsys)
    assert "999,999,999,999,999" in err and not calls


def test_check_reachable_connects_once_and_refuses_what_does_not_answer() -> None:
    import socket

    from conduit.cli_args import check_reachable
    from conduit.errors import ConfigError

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        check_reachable("address", f"127.0.0.1:{port}")
        check_reachable("address", f"ray://127.0.0.1:{port}")
    for address in (f"127.0.0.1:{_closed_port()}", "127.0.0.1", "host:port", "127.0.0.1:0"):
        with pytest.raises(ConfigError) as exc:
            check_reachable("address", address, timeout=1.0)
        assert exc.value.field == "address"
    for address in ("", "auto", "local"):  # no host: left to the client
        check_reachable("address", address)
