"""``conduit bench rllib``: a quick run writes side-by-side figures for both variants."""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray.rllib")

from conduit.bench import rllib as bench_rllib
from conduit.bench.rllib import (
    QUICK,
    Workload,
    fill,
    main,
    random_episodes,
    replay_capacity,
    run_pair,
    within_noise,
    workloads,
)
from conduit.errors import ConfigError
from conduit.report import pyplot

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_quick_run_compares_both_variants(tmp_path: Path) -> None:
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "rllib.json").read_text())
    assert {"machine", "args", "workloads", "targets", "micro"} <= data.keys()
    assert list(data["workloads"]) == list(QUICK)
    for name, row in data["workloads"].items():
        rllib, conduit = row["rllib"], row["conduit"]
        assert rllib["iterations"] == conduit["iterations"] >= 1, name
        for variant in (rllib, conduit):
            for key in ("iter_s", "path_s", "path_share"):
                assert _positive(variant[key]), (name, key, variant[key])
            assert len(variant["returns"]) == 1 and _positive(variant["returns"][0])
        assert [len(r["records"]) for r in row["runs"]["rllib"]] == \
            [len(r["records"]) for r in row["runs"]["conduit"]]
        for run in row["runs"]["conduit"]:  # one ratio per interleaved round
            assert len(run["paired"]) == len(run["records"])
        goal = data["targets"][name]
        assert _positive(goal["e2e_ratio"]) and goal["e2e_ratio"] == conduit["paired"]
        if row["algo"] != "ppo":
            assert _positive(goal["buffer_share_ratio"])
            assert conduit["schedules"], name  # the buffer reported the schedule it ran
    assert set(data["micro"]) == {"1000", "10000"}
    for figures in data["micro"].values():
        assert set(figures) == {"rllib-uniform", "conduit-uniform", "rllib-prioritized",
                                "conduit-prioritized"}
        for name, m in figures.items():
            for key in ("add_ms", "sample_ms", "add_sample_ms"):
                assert _positive(m[key]), (name, key)
            assert ("update_ms" in m) == ("prioritized" in name)
    if pyplot() is not None:
        assert (tmp_path / "rllib.png").stat().st_size > 0


def test_returns_within_noise_needs_two_seeds() -> None:
    def summary(returns: list[float]) -> dict[str, object]:
        mean = sum(returns) / len(returns)
        std = (sum((r - mean) ** 2 for r in returns) / (len(returns) - 1)) ** 0.5 \
            if len(returns) > 1 else math.nan
        return {"returns": returns, "return_mean": mean, "return_std": std}

    assert within_noise(summary([20.0]), summary([21.0])) is None
    assert within_noise(summary([20.0, 24.0, 22.0]), summary([21.0, 23.0, 25.0])) is True
    assert within_noise(summary([20.0, 21.0, 22.0]), summary([90.0, 91.0, 92.0])) is False


def test_run_pair_interleaves_the_variants_and_pairs_each_round(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class FakeRun:
        """Stands in for an Algorithm: Conduit's iterations take half of RLlib's."""

        def __init__(self, w: Workload, variant: str, **_: object) -> None:
            self.variant, self.records, self.stopped = variant, [], False
            made.append(self)

        def train(self) -> float:
            calls.append(self.variant)
            wall = 0.5 if self.variant == "conduit" else 1.0
            if calls.count(self.variant) > 1:  # the first is the warm-up
                self.records.append({"iter_s": wall * len(calls), "path_s": 0.0})
            return wall

        def summary(self) -> dict[str, object]:
            return {"records": self.records, "return": 1.0}

        def stop(self) -> None:
            self.stopped = True

    made: list[FakeRun] = []
    monkeypatch.setattr(bench_rllib, "AlgorithmRun", FakeRun)
    w = Workload("DQN-CP", "dqn", False, 3)
    out = run_pair(w, seed=1, iters=3, quick=True, schedule="auto")
    # Odd seed: Conduit first, then the order flips every round (warm-up included).
    assert calls == ["conduit", "rllib", "rllib", "conduit", "conduit", "rllib",
                     "rllib", "conduit"]
    assert all(r.stopped for r in made)
    # Each round's ratio uses that round's two iterations, whatever the drift between rounds.
    conduit = [r["iter_s"] for r in out["conduit"]["records"]]
    rllib = [r["iter_s"] for r in out["rllib"]["records"]]
    assert out["conduit"]["paired"] == pytest.approx([c / r for c, r in zip(conduit, rllib)])
    assert out["rllib"]["paired"] == pytest.approx([r / c for c, r in zip(conduit, rllib)])


def test_a_full_workload_trains_from_a_buffer_filled_to_capacity(tmp_path: Path) -> None:
    """The fill's episodes are what the env runners add later (dtypes, spaces): both
    buffers take them, then train from them."""
    assert main(["--quick", "--only", "DQN-CP-full", "--capacities", "1000", "--repeats", "1",
                 "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "rllib.json").read_text())["workloads"]["DQN-CP-full"]
    for variant in ("rllib", "conduit"):
        assert row[variant]["iterations"] == 1 and _positive(row[variant]["path_s"])
        # 2000 timesteps in a smoke run; whole episodes are evicted (CartPole: <= 500 steps)
        assert 1_500 <= row["runs"][variant][0]["buffer_timesteps"] <= 2_000


def test_random_episodes_are_cartpole_episodes_as_env_runners_give_them() -> None:
    import gymnasium as gym

    episodes = random_episodes(300, seed=4)
    steps = sum(len(e) for e in episodes)
    assert 300 <= steps < 300 + 500  # the last episode completes (CartPole: at most 500)
    space = gym.make("CartPole-v1").observation_space
    for eps in episodes:
        assert eps.is_done and eps.is_numpy and eps.observation_space == space
        assert eps.actions.data.dtype == np.int32 and eps.observations.data.dtype == np.float32
        assert len(eps.observations) == len(eps) + 1
    assert [len(e) for e in random_episodes(300, seed=4)] == [len(e) for e in episodes]
    for bad in (0, -5, 2.0, True):
        with pytest.raises(ConfigError, match="steps"):
            random_episodes(bad, seed=0)


def test_fill_brings_rllibs_and_conduits_buffers_to_capacity() -> None:
    from ray.rllib.utils.replay_buffers import PrioritizedEpisodeReplayBuffer

    from conduit.integrations.rllib import ConduitPrioritizedEpisodeReplayBuffer

    episodes = random_episodes(1_000, seed=2)
    theirs = PrioritizedEpisodeReplayBuffer(capacity=600, alpha=0.6)
    ours = ConduitPrioritizedEpisodeReplayBuffer(capacity=600, alpha=0.6, schedule="inline")
    fill(theirs, episodes, chunk=7)
    fill(ours, episodes, chunk=7)
    longest = max(len(e) for e in episodes)
    for buffer in (theirs, ours):  # both evict whole episodes, oldest first
        assert 600 - longest < len(buffer) <= 600
        assert buffer.get_added_timesteps() == sum(len(e) for e in episodes)
    ours.plane.close()


def test_run_pair_fills_both_variants_alike_and_freezes_what_exists_before_the_rounds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fills: list[object] = []
    frozen: list[int] = []

    class FakeRun:
        def __init__(self, w: Workload, variant: str, *, filled: object = None,
                     **_: object) -> None:
            fills.append(filled)

        def train(self) -> float:
            frozen.append(gc.get_freeze_count())
            raise RuntimeError("stop here")

        def stop(self) -> None:
            pass

    monkeypatch.setattr(bench_rllib, "AlgorithmRun", FakeRun)
    monkeypatch.setattr(bench_rllib, "replay_capacity", lambda w, quick: 50)
    with pytest.raises(RuntimeError, match="stop here"):
        run_pair(Workload("DQN-CP-full", "dqn", False, 1, full=True), seed=0, iters=1,
                 quick=True, schedule="inline")
    assert len(fills) == 2 and fills[0] is fills[1]
    assert sum(len(e) for e in fills[0]) >= 50
    assert frozen and frozen[0] > 0
    assert gc.get_freeze_count() == 0  # unfrozen, also when a round fails
    fills.clear()
    with pytest.raises(RuntimeError):
        run_pair(Workload("DQN-CP", "dqn", False, 1), seed=0, iters=1, quick=True,
                 schedule="inline")
    assert fills == [None, None]


def test_replay_capacities_per_workload() -> None:
    by_name = {w.name: w for w in workloads()}
    expected = {"DQN-CP": 50_000, "SAC-CP-full": 50_000, "DQN-img128": 2_000,
                "DQN-CP-1M-full": 1_000_000}
    for name, capacity in expected.items():
        assert replay_capacity(by_name[name], quick=False) == capacity
        assert replay_capacity(by_name[name], quick=True) == 2_000  # a smoke run's
    assert {w.name for w in workloads() if w.full} == {"DQN-CP-full", "SAC-CP-full",
                                                       "DQN-CP-1M-full"}
