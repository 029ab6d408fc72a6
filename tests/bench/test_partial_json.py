"""An interrupted benchmark keeps what it measured: its JSON is rewritten with ``"partial":
true`` after every finished unit, and ``conduit`` says where in its one line (exit 130)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conduit.bench.common import PartialJSON
from conduit.cli import main as conduit
from conduit.workloads.breakdown import IterationRecord


def _interrupt_on(n: int, result: Any) -> Any:
    """A stand-in that returns ``result()`` on its first ``n - 1`` calls and is interrupted
    on call ``n``."""
    calls: list[int] = []

    def call(*_: Any, **__: Any) -> Any:
        calls.append(1)
        if len(calls) >= n:
            raise KeyboardInterrupt
        return result()

    return call


def _records(n: int = 3) -> list[IterationRecord]:
    return [IterationRecord(k, end_to_end=0.01, rollout=0.004, ingestion=0.001,
                            delivery=0.001, update=0.004, other=0.0, env_steps=8,
                            learning=True, wall_time=0.01 * (k + 1)) for k in range(n)]


DIVERGED = "the policy's output was not finite for 2 action(s) of the rollout"


def _train_result() -> SimpleNamespace:
    """A run that stopped early because its policy diverged (its losses were finite)."""
    return SimpleNamespace(records=_records(), returns=[(0, 0.0, 10.0), (2, 0.0, 12.0)],
                           plan={"schedule": "s"}, losses_finite=True, diverged=DIVERGED,
                           summary={"exposed": 0.002, "end_to_end": 0.01})


def _interrupted(argv: list[str], path: Path, capsys: pytest.CaptureFixture[str]
                 ) -> dict[str, Any]:
    """Run ``conduit bench ...`` to its interrupt; the partial JSON it leaves."""
    assert conduit(argv) == 130
    err = capsys.readouterr().err.splitlines()  # peers' progress lines go to stderr too
    assert err[-1] == f"conduit bench {argv[1]}: interrupted; partial results in {path}"
    data = json.loads(path.read_text())
    assert data["partial"] is True and "machine" in data
    return data


def test_workloads_keeps_the_workloads_it_finished(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from conduit.bench import workloads
    from conduit.workloads import dqn

    fake = SimpleNamespace(Args=dqn.Args, train=_interrupt_on(3, _train_result))
    monkeypatch.setitem(workloads.TRAINERS, "dqn", fake)
    data = _interrupted(["bench", "workloads", "--only", "DQN-MC", "DQN-CP", "--no-use-ray",
                         "--device", "cpu", "--out", str(tmp_path)],
                        tmp_path / "workloads.json", capsys)
    assert list(data["workloads"]) == ["DQN-MC"]
    row = data["workloads"]["DQN-MC"]
    assert [r["buffer"] for r in row["runs"]] == ["inline", "conduit"]
    assert row["inline"]["iterations_measured"] > 0 and "end_to_end_reduction" in row
    assert row["inline_diverged"] == row["conduit_diverged"] == DIVERGED


def test_convergence_keeps_the_seeds_it_finished(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from conduit.workloads import ppo

    monkeypatch.setattr(ppo, "train", _interrupt_on(3, _train_result))
    data = _interrupted(["bench", "convergence", "--algos", "ppo", "--seeds", "1", "2",
                         "--ppo-iters", "1", "--no-use-ray", "--device", "cpu",
                         "--out", str(tmp_path)], tmp_path / "convergence.json", capsys)
    assert [(r["seed"], r["buffer"]) for r in data["runs"]] == [(1, "inline"), (1, "conduit")]
    assert [r["diverged"] for r in data["runs"]] == [DIVERGED, DIVERGED]


def test_persist_keeps_the_throughput_phase(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from conduit.bench import persist

    monkeypatch.setattr(persist, "throughput", lambda *a, **k: {"save_gbps": 1.0})
    monkeypatch.setattr(persist, "stall", _interrupt_on(1, dict))
    data = _interrupted(["bench", "persist", "--quick", "--out", str(tmp_path)],
                        tmp_path / "persist.json", capsys)
    assert data["throughput"] == {"save_gbps": 1.0} and "stall" not in data


def test_rllib_keeps_the_pairs_it_finished(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    ray = pytest.importorskip("ray")
    from conduit.bench import rllib

    def pair() -> dict[str, Any]:
        res = {"records": [{"iter_s": 0.01, "path_s": 0.001}], "return": 9.0,
               "paired": [1.0], "schedule": "s"}
        return {"rllib": dict(res), "conduit": dict(res)}

    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # no Ray started
    monkeypatch.setattr(rllib, "register_envs", lambda: None)
    monkeypatch.setattr(rllib, "run_pair", _interrupt_on(2, pair))
    data = _interrupted(["bench", "rllib", "--only", "DQN-CP", "SAC-CP", "--seeds", "1",
                         "--out", str(tmp_path)], tmp_path / "rllib.json", capsys)
    assert list(data["workloads"]) == ["DQN-CP"]
    assert len(data["workloads"]["DQN-CP"]["runs"]["conduit"]) == 1 and data["micro"] == {}


def test_peers_keeps_the_workloads_it_finished(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from conduit.bench.peers import harness

    merge = harness.merge_rounds
    calls: list[int] = []

    def merge_then_interrupt(results: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return merge(results)

    monkeypatch.setattr(harness, "merge_rounds", merge_then_interrupt)
    data = _interrupted(["bench", "peers", "--peers", "conduit", "--dims", "8",
                         "--capacity", "2048", "--batches", "16", "32", "--epoch-rows", "256",
                         "--warmup", "1", "--repeats", "2", "--insert-64-repeats", "2",
                         "--epoch-repeats", "1", "--no-plot", "--out", str(tmp_path)],
                        tmp_path / "peers.json", capsys)
    assert [(r["peer"], r["batch"], r["status"]) for r in data["rows"]] == [
        ("conduit", 16, "ok")]
    assert data["config"]["batches"] == [16, 32]


def test_plane_keeps_the_loops_it_finished(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from conduit.bench import plane

    def loop() -> dict[str, Any]:
        return {"schedule": {}, "label": "s", "median_ms": {"exposed": 1.0}}

    monkeypatch.setattr(plane, "run_loop", _interrupt_on(2, loop))
    data = _interrupted(["bench", "plane", "--quick", "--out", str(tmp_path)],
                        tmp_path / "plane.json", capsys)
    assert data["loops"] == {"off_policy": [{**loop(), "name": "inline"}]}


def test_placement_keeps_the_placements_it_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from conduit.bench import placement

    targets = [t.label for t in placement.placements_available(torch.device("cpu"), (2,))]
    n = len(targets)  # measured once untimed, then at every d
    monkeypatch.setattr(placement, "measure", _interrupt_on(
        2 * n + 2, lambda: {"inline_s": 1e-3, "fill_s": 0.0, "pinned_memory": False}))
    data = _interrupted(["bench", "placement", "--quick", "--dims", "64", "300", "--shards", "2",
                         "--no-overlap", "--learner-device", "cpu", "--out", str(tmp_path)],
                        tmp_path / "placement.json", capsys)
    assert [(e["dim"], e["placement"]) for e in data["entries"]] == [
        *((64, t) for t in targets), (300, targets[0])]
    assert [p["dim"] for p in data["planner"]] == [64] and data["placements"] == targets


def test_grpo_keeps_the_runs_it_finished(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from conduit.bench import grpo as grpo_bench
    from conduit.workloads import grpo

    calls: list[int] = []

    def one_run(args: grpo.Args, *, pad: str) -> dict[str, Any]:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return {"buffer": args.buffer, "max_completion_length": args.max_completion_length,
                "wall_s": 0.2, "step_s": 0.1, "exposed_s": 0.02, "exposed_per_step_s": 0.01,
                "exposed_generation_steps_s": 0.01, "generation_s": 0.1, "losses": [0.5],
                "rewards": [1.0], "params": {"w": torch.zeros(2)}}

    monkeypatch.setattr(grpo, "train", lambda *a, **k: None)  # the untimed warm-up
    monkeypatch.setattr(grpo_bench, "one_run", one_run)
    data = _interrupted(["bench", "grpo", "--lengths", "8", "16", "--rounds", "1", "--steps",
                         "2", "--out", str(tmp_path)], tmp_path / "grpo.json", capsys)
    assert [(r["max_completion_length"], r["buffer"]) for r in data["runs"]] == [
        (8, "trl"), (8, "conduit")]
    assert not any("params" in r for r in data["runs"])
    assert [(s["max_completion_length"], s["identical_params"]) for s in data["summary"]] == [
        (8, True)]


def test_scale_keeps_the_shard_counts_it_finished(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from conduit import distributed
    from conduit.bench import scale

    class Cluster:
        address = "local"

        def __init__(self, **_: Any) -> None:
            pass

        def close(self) -> None:
            pass

    class Plane:
        def __init__(self, *, num_shards: int, **_: Any) -> None:
            self.nodes, self.rows = [f"node{i}" for i in range(num_shards)], 0

        def __len__(self) -> int:
            return self.rows

        def push(self, rows: dict[str, Any], *, node: str) -> None:
            self.rows += len(rows["obs"])

    def figures() -> dict[str, float]:
        return {"insert_rows_s": 1.0, "sample_rows_s": 1.0, "wait_ms_no_prefetch": 1.0,
                "wait_ms_prefetch": 0.5, "hidden": 0.5}

    monkeypatch.setattr(scale, "LocalCluster", Cluster)
    monkeypatch.setattr(distributed, "RayExperienceDataPlane", Plane)
    monkeypatch.setattr(scale, "measure_round", lambda *a, **k: figures())
    monkeypatch.setattr(scale, "measure_recovery", _interrupt_on(1, dict))
    data = _interrupted(["bench", "scale", "--quick", "--shards", "1", "2", "--fill-rows", "64",
                         "--out", str(tmp_path)], tmp_path / "scale.json", capsys)
    assert data["rounds"] == {"1": [figures()], "2": [figures()]}
    assert data["measured"] == {"1": figures()}


def test_partial_json_marks_the_file_and_names_it_on_an_interrupt(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    with pytest.raises(KeyboardInterrupt) as exc, PartialJSON(path):
        raise KeyboardInterrupt  # nothing written yet: nothing to name
    assert not getattr(exc.value, "__notes__", None) and not path.exists()
    with pytest.raises(KeyboardInterrupt) as exc, PartialJSON(path) as partial:
        partial.write({"rows": [1]})
        partial.write({"rows": [1, 2]})
        raise KeyboardInterrupt
    assert exc.value.__notes__ == [f"partial results in {path}"]
    assert json.loads(path.read_text()) == {"machine": json.loads(path.read_text())["machine"],
                                            "rows": [1, 2], "partial": True}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
    with pytest.raises(ValueError) as err, PartialJSON(path) as partial:
        partial.write({"rows": []})
        raise ValueError("not an interrupt")
    assert not getattr(err.value, "__notes__", None)
