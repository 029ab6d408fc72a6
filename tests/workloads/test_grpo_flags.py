"""GRPO flags TRL's ``GRPOConfig`` would refuse: ``conduit train --algo grpo`` and ``conduit
bench grpo`` report them as usage errors naming the flag, before any output or model."""

from __future__ import annotations

from pathlib import Path

import pytest

from conduit.cli import main
from conduit.errors import ConfigError
from conduit.workloads import grpo
from tests.test_cli_flags import _usage_error


@pytest.mark.parametrize(("flags", "flag"), [
    (["--num-generations", "1"], "--num-generations"),
    (["--num-generations", "3"], "--batch-size"),  # 16 x 4 = 64 completions
    (["--batch-size", "3"], "--batch-size"),  # 3 x 4 = 12 completions, groups of 8
    (["--batch-size", "6", "--steps-per-generation", "2", "--num-generations", "8"],
     "--batch-size")])
def test_train_grpo_refuses_groups_trl_cannot_form(
        flags: list[str], flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[grpo.Args] = []
    monkeypatch.setattr(grpo, "train", lambda args, **kw: calls.append(args))
    out = tmp_path / "sub" / "o.json"
    _usage_error(["train", "--algo", "grpo", "--steps", "1", *flags, "--out", str(out)], flag,
                 capsys)
    assert not calls and not out.parent.exists()


def test_train_grpo_lets_whole_groups_through(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    calls: list[grpo.Args] = []
    monkeypatch.setattr(grpo, "train", lambda args, **kw: calls.append(args) or "done")
    monkeypatch.setattr(grpo, "report", lambda result, args: 0)
    assert main(["train", "--algo", "grpo", "--num-generations", "3", "--batch-size", "6",
                 "--steps-per-generation", "2", "--out", str(tmp_path / "o.json")]) == 0
    assert calls[0].num_generations == 3


@pytest.mark.parametrize(("kw", "field"), [
    ({"num_generations": 1}, "num_generations"), ({"num_generations": 0}, "num_generations"),
    ({"batch_size": 3}, "batch_size"), ({"num_generations": 3}, "batch_size")])
def test_check_and_build_trainer_refuse_before_trl(kw: dict[str, int], field: str) -> None:
    args = grpo.Args(**kw)
    with pytest.raises(ConfigError) as err:
        grpo.check(args)
    assert err.value.field == field
    with pytest.raises(ConfigError):  # before TRL is imported or a model built
        grpo.build_trainer(args, output_dir="/nonexistent")


def test_bench_grpo_refuses_a_batch_that_splits_groups(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from conduit.bench import grpo as bench

    real_run, calls = bench.run, []
    monkeypatch.setattr(bench, "run", lambda a: calls.append(a) or {})
    err = _usage_error(["bench", "grpo", "--quick", "--batch-size", "3",
                        "--out", str(tmp_path / "g")], "--batch-size", capsys)
    assert "12 completions" in err and str(bench.GROUP_SIZE) in err
    assert not calls and not (tmp_path / "g").exists()
    with pytest.raises(ConfigError) as exc:  # run() itself, for callers of the module
        real_run(bench.GRPOBenchArgs(quick=True, batch_size=3))
    assert exc.value.field == "batch_size"


def test_bench_grpo_warm_up_keeps_whole_groups(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """A batch of 2 with 4 mini-batches per generation holds whole groups of 8; a warm-up
    with two mini-batches per generation (4 completions) would not."""
    from conduit.bench import grpo as bench

    seen: list[grpo.Args] = []

    def fake_train(args: grpo.Args, **kw: object) -> None:
        seen.append(args)
        grpo.check(args)
        raise KeyboardInterrupt  # stop after the first warm-up run

    monkeypatch.setattr(grpo, "train", fake_train)
    with pytest.raises(KeyboardInterrupt):
        bench.run(bench.GRPOBenchArgs(quick=True, batch_size=2, steps_per_generation=4,
                                      out=str(tmp_path / "g")))
    assert seen and seen[0].batch_size * seen[0].steps_per_generation % bench.GROUP_SIZE == 0
