"""``conduit bench peers``: the harness's own logic, always; each peer adapter when installed.

Workloads are tiny (a few thousand rows of dimension 8): these tests check behaviour — what
gets reported, with which status and reason, in which format — never timings.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conduit.bench.peers import harness
from conduit.bench.peers.adapter import (
    PRIORITY_POOL,
    Chunk,
    OperationSkipped,
    PeerAdapter,
    PeerUnavailable,
    Workload,
    make_chunk,
    priorities,
)
from conduit.bench.peers.harness import (
    METRICS,
    MetricResult,
    PeersConfig,
    RowResult,
    fit_capacity,
    format_reasons,
    format_table,
    measure_adapter,
    merge_rounds,
    ratios,
    rows_from_worker,
    speedup,
)

TINY = Workload(dim=8, capacity=2048, batch=32, epoch_rows=256, minibatches=8, seed=0)
TINY_CFG = PeersConfig(dims=(8,), capacity=2048, batches=(32,), epoch_rows=256, warmup=1,
                       repeats=2, insert_64_repeats=2, epoch_repeats=1, plot=False)


def quiet(_: str) -> None:
    """Progress sink for tests."""


class NumpyPeer(PeerAdapter):
    """A minimal in-memory peer: enough to drive every harness path without a package."""

    name = "numpy"
    description = "test double"

    def __init__(self, *, fail_on_policy: bool = False, short_epoch: bool = False) -> None:
        self.fail_on_policy = fail_on_policy
        self.short_epoch = short_epoch
        self.rows: list[Chunk] = []
        self.w: Workload | None = None
        self.calls: list[str] = []

    def setup(self, workload: Workload) -> None:
        self.w, self.rows = workload, []
        self.calls.append("setup")

    def insert(self, chunk: Any) -> None:
        self.rows.append(chunk)

    def sample_uniform(self) -> Any:
        assert self.w is not None
        return np.random.default_rng(0).integers(0, 10, self.w.batch)

    def setup_prioritized(self, workload: Workload) -> None:
        raise OperationSkipped("no prioritized buffer in this test double")

    def setup_on_policy(self, workload: Workload) -> None:
        if self.fail_on_policy:
            raise RuntimeError("boom")
        self.w, self.rows = workload, []

    def on_policy_epoch(self) -> int:
        n = sum(len(c["obs"]) for c in self.rows)
        self.rows = []
        return n - 1 if self.short_epoch else n


def row(peer: str, dim: int = 8, batch: int = 32, **values: float) -> RowResult:
    r = RowResult(peer=peer, dim=dim, capacity=2048, batch=batch)
    for m, v in values.items():
        r.metrics[m] = MetricResult(status="ok", unit=METRICS[m][1], value=v, samples=3)
    return r


# --- pure logic ------------------------------------------------------------------------------


def test_speedup_reads_the_same_way_for_throughput_and_latency() -> None:
    assert speedup("insert_64", 200.0, 100.0) == 2.0  # rows/s: Conduit/peer
    assert speedup("sample_uniform", 0.5, 1.0) == 2.0  # ms: peer/Conduit
    with pytest.raises(ValueError):
        speedup("sample_uniform", 0.0, 1.0)


def test_ratios_pair_each_peer_with_conduit_on_the_same_dim_and_metric() -> None:
    rows = [row("conduit", sample_uniform=0.1, insert_64=1000.0),
            row("cpprb", sample_uniform=0.3, insert_64=500.0),
            row("cpprb", dim=16, sample_uniform=0.3),  # no Conduit row at d=16
            RowResult(peer="reverb", dim=8, capacity=2048, status="skipped", reason="no venv")]
    rows[1].metrics["onpolicy_epoch"] = MetricResult.missing("onpolicy_epoch", "skipped", "x")
    got = {(r["peer"], r["dim"], r["metric"]): r["speedup"] for r in ratios(rows)}
    assert got == {("cpprb", 8, "sample_uniform"): pytest.approx(3.0),
                   ("cpprb", 8, "insert_64"): pytest.approx(2.0)}


def test_ratios_and_the_floor_pair_rows_of_the_same_batch_size() -> None:
    rows = [row("conduit", batch=32, sample_uniform=0.2),
            row("conduit", batch=64, sample_uniform=0.4),
            row("cpprb", batch=32, sample_uniform=0.4), row("cpprb", batch=64, sample_uniform=0.4),
            row("gather-floor", batch=32, sample_uniform=0.1),
            row("gather-floor", batch=64, sample_uniform=0.4)]
    got = {(r["batch"], r["peer"]): r["speedup"] for r in ratios(rows)}
    assert got[32, "cpprb"] == pytest.approx(2.0) and got[64, "cpprb"] == pytest.approx(1.0)
    floor = {(r["batch"], r["peer"]): r["over_floor"] for r in harness.over_floor(rows)}
    assert floor == {(32, "conduit"): pytest.approx(2.0), (64, "conduit"): pytest.approx(1.0),
                     (32, "cpprb"): pytest.approx(4.0), (64, "cpprb"): pytest.approx(1.0)}
    text = harness.format_over_floor(rows)
    assert "conduit" in text.splitlines()[0] and "4.00" in text
    targets = harness.check_targets(rows, dim=8)
    assert {t["batch"] for t in targets} == {32, 64}


def test_side_by_side_medians_make_the_ratio_and_the_floor_row_divides_the_rest() -> None:
    rows = [row("conduit", sample_uniform=0.3), row("cpprb", sample_uniform=0.4),
            row("conduit-prefetch", sample_uniform=0.02),
            row("gather-floor", sample_uniform=0.1)]
    # In the side-by-side loop: conduit 0.3 against the floor's 0.25, cpprb 0.2 against 0.25.
    rows[0].side_ms, rows[0].floor_ms = 0.3, 0.25
    rows[1].side_ms, rows[1].floor_ms = 0.2, 0.25
    got = {r["peer"]: (r["over_floor"], r["side_by_side"]) for r in harness.over_floor(rows)}
    assert got == {"conduit": (pytest.approx(1.2), True), "cpprb": (pytest.approx(0.8), True),
                   "conduit-prefetch": (pytest.approx(0.2), False)}
    lines = harness.format_over_floor(rows).splitlines()
    assert "1.20" in lines[2] and "0.20*" in lines[2] and "0.80" in lines[2]


def test_fast_path_targets_read_the_side_by_side_loop() -> None:
    def rows_with(side: tuple[float, float, float], per: tuple[float, float],
                  prefetch: float, split: float | None = None) -> list[RowResult]:
        conduit_ms, cpprb_ms, floor_ms = side
        # The phases' own medians point the other way: only the loop must count.
        rows = [row("conduit", sample_uniform=1.0, sample_per_update=per[0]),
                row("cpprb", sample_uniform=0.5, sample_per_update=per[1]),
                row("conduit-prefetch", sample_uniform=prefetch),
                row("conduit-pull", sample_uniform=1.0),
                row("gather-floor", sample_uniform=0.1),
                row("conduit-split", sample_per_update=0.01)]
        rows[0].side_ms, rows[1].side_ms, rows[3].side_ms = conduit_ms, cpprb_ms, conduit_ms
        rows[0].floor_ms = rows[1].floor_ms = rows[3].floor_ms = floor_ms
        # The prioritized loop: its own pair, against phase medians 0.3 / 0.3 (speed-up 1).
        rows[0].side_per_ms, rows[1].side_per_ms = per
        rows[5].side_per_ms = split  # None: not in the loop (its phase does not count)
        rows[0].metrics["sample_per_update"] = rows[1].metrics["sample_per_update"] = \
            row("x", sample_per_update=0.3).metrics["sample_per_update"]
        return rows

    def verdicts(rows: list[RowResult]) -> dict[str, bool | None]:
        return {t["target"]: t["met"] for t in harness.fast_path_targets(rows)}

    split = "PER speed-up vs cpprb, 2 threads (conduit-split)"
    met = verdicts(rows_with((0.21, 0.22, 0.2), per=(0.2, 0.31), prefetch=0.01, split=0.2))
    assert met == {"uniform over floor": True, "inline pull over floor": True,
                   "uniform vs cpprb's": True,
                   "PER sample+update speed-up vs cpprb": True, split: True,
                   "prefetched pull ms": True}
    missed = verdicts(rows_with((0.24, 0.22, 0.2), per=(0.2, 0.29), prefetch=0.06, split=0.2))
    assert missed == {"uniform over floor": False, "inline pull over floor": False,
                      "uniform vs cpprb's": False,
                      "PER sample+update speed-up vs cpprb": False, split: False,
                      "prefetched pull ms": False}
    # The split row is judged on its own loop time against cpprb's there, and only there.
    assert verdicts(rows_with((0.21, 0.22, 0.2), per=(0.25, 0.3), prefetch=0.01,
                              split=0.18))[split] is True
    assert verdicts(rows_with((0.21, 0.22, 0.2), per=(0.25, 0.3), prefetch=0.01,
                              split=None))[split] is None
    alone = [row("conduit", sample_uniform=0.2)]  # nothing to compare with: unmeasured
    assert set(verdicts(alone).values()) == {None}
    # Without the prioritized loop, the two phases' medians decide.
    phases = [row("conduit", sample_per_update=0.2), row("cpprb", sample_per_update=0.31)]
    assert verdicts(phases)["PER sample+update speed-up vs cpprb"] is True
    phases[1] = row("cpprb", sample_per_update=0.29)
    assert verdicts(phases)["PER sample+update speed-up vs cpprb"] is False
    text = harness.format_fast_path(rows_with((0.24, 0.22, 0.2), per=(0.2, 0.29),
                                              prefetch=0.06))
    assert "1.2 NOT met" in text and "<= 1.1" in text.splitlines()[0]


def test_interleaved_calls_take_turns_in_orders_that_vary_each_round() -> None:
    calls: list[str] = []
    times = harness.interleaved_times({k: (lambda k=k: calls.append(k)) for k in "abc"},
                                      repeats=60, warmup=1)
    assert {k: len(v) for k, v in times.items()} == {"a": 60, "b": 60, "c": 60}
    assert "".join(calls[:3]) == "abc"  # the warm-up round
    rounds = ["".join(calls[i:i + 3]) for i in range(3, len(calls), 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)  # each once a round
    # every call comes after each of the others now and then (a rotation of one order
    # would give each the same predecessor every round)
    before = {(r[i - 1], r[i]) for r in rounds for i in (1, 2)}
    assert before == {(x, y) for x in "abc" for y in "abc" if x != y}
    again = []
    harness.interleaved_times({k: (lambda k=k: again.append(k)) for k in "abc"}, repeats=60,
                              warmup=1)
    assert again == calls  # the orders come from the seed


def test_side_by_side_fills_every_buffer_and_skips_peers_that_cannot_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    filled: dict[str, int] = {}

    class Counting(NumpyPeer):
        def insert(self, chunk: Any) -> None:
            filled[self.name] = filled.get(self.name, 0) + len(chunk["obs"])
            super().insert(chunk)

    class Floor(Counting):
        name = "gather-floor"

    class Broken(NumpyPeer):
        name = "cpprb"

        def check(self) -> None:
            raise PeerUnavailable("not installed")

    made = {"gather-floor": Floor, "conduit": Counting, "cpprb": Broken}
    monkeypatch.setattr(harness, "_make", lambda name: made[name]())
    got = harness.measure_side_by_side(TINY, ["conduit", "cpprb"], TINY_CFG, quiet)
    assert set(got) == {"gather-floor", "conduit"} and all(v > 0 for v in got.values())
    assert filled == {"gather-floor": TINY.capacity, "numpy": TINY.capacity}
    made["gather-floor"] = Broken  # no floor: nothing to compare with
    assert harness.measure_side_by_side(TINY, ["conduit"], TINY_CFG, quiet) == {}


def test_side_by_side_progress_counts_the_repetitions_it_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    class Floor(NumpyPeer):
        name = "gather-floor"

    made = {"gather-floor": Floor, "conduit": NumpyPeer}
    monkeypatch.setattr(harness, "_make", lambda name: made[name]())
    runs: list[int] = []
    times = harness.interleaved_times

    def counting(calls: Any, *, repeats: int, warmup: int) -> Any:
        runs.append(repeats)
        return times(calls, repeats=repeats, warmup=warmup)

    monkeypatch.setattr(harness, "interleaved_times", counting)
    lines: list[str] = []
    cfg = replace(TINY_CFG, repeats=2, rounds=3)
    assert harness.measure_side_by_side(TINY, ["conduit"], cfg, lines.append)
    assert runs == [6]
    assert any(line.endswith("side by side: 6 rounds") for line in lines), lines


def test_busy_threads_counts_threads_whose_cpu_time_grew() -> None:
    assert harness.busy_threads({1: 0.5, 2: 1.0}, {1: 0.5, 2: 1.25, 3: 0.01}) == 2
    assert harness.busy_threads({}, harness.thread_times()) >= 1


def test_metric_from_times_takes_the_median_in_the_metric_unit() -> None:
    lat = MetricResult.from_times("sample_uniform", [0.003, 0.001, 0.002], 512)
    assert lat.status == "ok" and lat.value == pytest.approx(2.0) and lat.samples == 3
    thr = MetricResult.from_times("insert_1024", [0.001, 0.002, 0.004], 1024)
    assert thr.value == pytest.approx(1024 / 0.002)
    assert MetricResult.from_times("insert_64", [], 64).status == "error"


def test_capacity_is_kept_when_it_fits_and_lowered_with_a_reason_when_not() -> None:
    assert fit_capacity(100_000, 4013, 64 * 2**30, fraction=0.5, minimum=1024) == (100_000,
                                                                                   None)
    cap, note = fit_capacity(100_000, 20_013, 2 * 2**30, fraction=0.5, minimum=1024)
    assert 1024 <= cap < 100_000 and cap % 1024 == 0
    assert cap * 20_013 * harness.PEER_OVERHEAD <= 2**30
    assert note is not None and "100000" in note and str(cap) in note
    assert fit_capacity(100_000, 10**9, 2**20, fraction=0.5, minimum=1024)[0] == 1024


def test_quick_applies_only_to_flags_left_at_their_default() -> None:
    cfg = PeersConfig(quick=True, repeats=7)
    q = harness.effective(cfg, {"repeats"})
    assert q.repeats == 7 and q.dims == harness.QUICK["dims"]
    assert q.capacity == harness.QUICK["capacity"]
    assert harness.effective(PeersConfig(), set()) == PeersConfig()


def test_config_rejects_unknown_peers_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match="unknown"):
        PeersConfig(peers=("conduit", "nope"))
    with pytest.raises(ValueError, match="repeats"):
        PeersConfig(repeats=0)
    with pytest.raises(ValueError, match="multiple"):
        Workload(dim=8, capacity=2048, epoch_rows=100, minibatches=8)


def test_chunks_have_the_benchmark_spec() -> None:
    c = make_chunk(64, 5)
    assert c["obs"].shape == (64, 5) and c["obs"].dtype == np.float32
    assert c["action"].dtype == np.int64 and c["reward"].dtype == np.float32
    assert c["done"].dtype == np.bool_ and c["done"][-1]


# --- the harness around adapters ---------------------------------------------------------------


def test_measure_adapter_reports_measured_skipped_and_failed_metrics() -> None:
    r = measure_adapter(NumpyPeer(fail_on_policy=True), TINY, TINY_CFG, quiet)
    assert r.status == "ok"
    for m in ("insert_64", "insert_1024", "sample_uniform"):
        assert r.metrics[m].status == "ok" and r.metrics[m].value > 0
    assert r.metrics["sample_per_update"].status == "skipped"
    assert "test double" in (r.metrics["sample_per_update"].reason or "")
    assert r.metrics["onpolicy_epoch"].status == "error"
    assert "boom" in (r.metrics["onpolicy_epoch"].reason or "")


def test_rounds_merge_to_the_median_of_round_medians() -> None:
    def row(ms: float | None, rate: float, note: str) -> RowResult:
        sample = (MetricResult.missing("sample_uniform", "error", "boom") if ms is None else
                  MetricResult(status="ok", unit="ms", value=ms, median_s=ms / 1e3,
                               min_s=ms / 2e3, samples=10, rows_per_op=512))
        ins = MetricResult(status="ok", unit="rows/s", value=rate, median_s=1024 / rate,
                           min_s=512 / rate, samples=5, rows_per_op=1024)
        return RowResult(peer="p", dim=8, capacity=64, notes=[note],
                         metrics={"sample_uniform": sample, "insert_1024": ins})

    merged = merge_rounds([row(3.0, 100.0, "a"), row(None, 300.0, "b"), row(1.0, 200.0, "a")])
    s, i = merged.metrics["sample_uniform"], merged.metrics["insert_1024"]
    assert s.status == "ok" and s.value == 2.0 and s.samples == 20 and s.min_s == 0.5e-3
    assert i.value == 200.0 and i.samples == 15
    assert merged.notes == ["a", "b"]
    failed = merge_rounds([row(None, 1.0, "x"), row(None, 1.0, "x")])
    assert failed.metrics["sample_uniform"].status == "error"
    with pytest.raises(ValueError):
        merge_rounds([])


def test_an_epoch_that_loses_rows_is_an_error_not_a_number() -> None:
    r = measure_adapter(NumpyPeer(short_epoch=True), TINY, TINY_CFG, quiet)
    assert r.metrics["onpolicy_epoch"].status == "error"
    assert "expected 256" in (r.metrics["onpolicy_epoch"].reason or "")


def test_unavailable_peers_are_reported_with_their_reason(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    class Broken(NumpyPeer):
        def check(self) -> None:
            raise PeerUnavailable("libfoo missing (pip install foo)")

    def make(name: str) -> PeerAdapter:
        if name == "cpprb":
            return Broken()
        if name == "rllib":
            raise ImportError("No module named 'ray'")
        return NumpyPeer()

    monkeypatch.setattr(harness, "_make", make)
    got = {n: (a is not None, reason) for n, a, reason in
           harness.build_adapters(["conduit", "cpprb", "rllib", "reverb"])}
    assert got["conduit"] == (True, None)
    assert got["cpprb"] == (False, "libfoo missing (pip install foo)")
    assert got["rllib"][0] is False and "ray" in (got["rllib"][1] or "")
    assert "reverb" not in got  # runs out of process, reported separately


def test_worker_rows_become_results_with_medians_and_reasons() -> None:
    doc = [{"peer": "reverb-inproc", "dim": 8, "capacity": 2048, "description": "d",
            "metrics": {"sample_uniform": {"times_s": [0.01, 0.03, 0.02], "rows_per_op": 32},
                        "insert_64": {"status": "skipped", "reason": "same writer"},
                        "not_a_metric": {"times_s": [1.0], "rows_per_op": 1}}},
           {"peer": "reverb-grpc", "dim": 8, "capacity": 2048, "status": "unavailable",
            "reason": "worker exited with 1"}]
    rows = rows_from_worker(doc, "0.14.0")
    assert rows[0].metrics["sample_uniform"].value == pytest.approx(20.0)
    assert rows[0].metrics["insert_64"].status == "skipped"
    assert "not_a_metric" not in rows[0].metrics and rows[0].version == "0.14.0"
    assert rows[1].status == "unavailable" and "exited" in (rows[1].reason or "")


def test_table_and_reasons_show_ratios_statuses_and_why() -> None:
    rows = [row("conduit", sample_uniform=0.1), row("cpprb", sample_uniform=0.3),
            RowResult(peer="reverb", dim=8, capacity=2048, status="skipped",
                      reason=".venv-reverb not found; build it with `make peers`")]
    rows[1].metrics["sample_per_update"] = MetricResult.missing("sample_per_update",
                                                                "unavailable", "no tree")
    table = format_table(rows)
    assert "×3" in table and "skipped" in table and "unavailable" in table
    reasons = format_reasons(rows)
    assert "make peers" in reasons and "no tree" in reasons


def test_reverb_without_its_venv_is_skipped_with_the_build_command(tmp_path: Path) -> None:
    from conduit.bench.peers.reverb_peer import ReverbPeer

    status, reason = ReverbPeer(python=tmp_path / "missing" / "python").availability() or ("", "")
    assert status == "skipped" and "make peers" in reason


def test_main_writes_json_and_never_fails_because_of_a_peer(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture
                                                            ) -> None:
    out = tmp_path / "out"
    argv = ["--peers", "conduit", "reverb", "--reverb-python", str(tmp_path / "nope"),
            "--dims", "8", "--capacity", "2048", "--batches", "32", "--epoch-rows", "256",
            "--warmup", "1", "--repeats", "2", "--insert-64-repeats", "2",
            "--epoch-repeats", "1", "--rounds", "2", "--out", str(out)]
    assert harness.main(argv) == 0
    doc = json.loads((out / "peers.json").read_text())
    by_peer = {r["peer"]: r for r in doc["rows"]}
    assert by_peer["conduit"]["status"] == "ok"
    assert set(by_peer["conduit"]["metrics"]) == set(METRICS)
    assert all(m["status"] == "ok" for m in by_peer["conduit"]["metrics"].values())
    assert by_peer["reverb"]["status"] == "skipped"
    assert doc["config"]["dims"] == [8] and doc["machine"]["cores"] >= 1
    assert doc["config"]["rounds"] == 2
    # Two rounds of 2 timed repetitions each were merged.
    assert by_peer["conduit"]["metrics"]["sample_uniform"]["samples"] == 4
    assert doc["command"].startswith("conduit bench peers")
    printed = capsys.readouterr().out
    assert "conduit" in printed and "make peers" in printed


def test_every_batch_size_is_a_workload_and_inserts_run_once_per_dim(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture
                                                                    ) -> None:
    out = tmp_path / "out"
    argv = ["--peers", "conduit", "conduit-pull", "gather-floor", "--dims", "8",
            "--capacity", "2048", "--batches", "16", "32", "--epoch-rows", "256",
            "--warmup", "1", "--repeats", "2", "--insert-64-repeats", "2",
            "--epoch-repeats", "1", "--no-plot", "--out", str(out)]
    assert harness.main(argv) == 0
    doc = json.loads((out / "peers.json").read_text())
    rows = {(r["peer"], r["batch"]): r for r in doc["rows"]}
    assert set(rows) == {(p, b) for p in ("conduit", "conduit-pull", "gather-floor")
                         for b in (16, 32)}
    assert set(rows["conduit", 16]["metrics"]) == set(METRICS)
    assert set(rows["conduit", 32]["metrics"]) == {"sample_uniform", "sample_per_update"}
    assert rows["conduit", 32]["metrics"]["sample_uniform"]["rows_per_op"] == 32
    assert all(r["threads"] >= 1 for r in doc["rows"])
    assert {(f["peer"], f["batch"]) for f in doc["over_floor"]} == {
        (p, b) for p in ("conduit", "conduit-pull") for b in (16, 32)}
    printed = capsys.readouterr().out
    assert "threads" in printed and "over the gather floor" in printed


def test_plot_is_written_when_there_are_ratios(tmp_path: Path) -> None:
    rows = [row("conduit", sample_uniform=0.1, insert_64=1000.0),
            row("cpprb", sample_uniform=0.3, insert_64=500.0)]
    assert harness.write_plot(rows, tmp_path / "p.png") is None
    assert (tmp_path / "p.png").stat().st_size > 0
    assert harness.write_plot([row("conduit", sample_uniform=0.1)], tmp_path / "q.png")


def test_without_matplotlib_the_plot_is_skipped_with_its_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rows = [row("conduit", sample_uniform=0.1), row("cpprb", sample_uniform=0.3)]
    assert harness.write_plot(rows, tmp_path / "p.png") == "matplotlib is not installed"
    assert not (tmp_path / "p.png").exists()


# --- each real adapter on a tiny workload, when its package is importable ----------------------


def _importable(*mods: str) -> bool:
    try:
        return all(importlib.util.find_spec(m) is not None for m in mods)
    except (ImportError, ValueError):
        return False


ADAPTERS = [
    ("conduit", ()),
    ("conduit-pull", ()),
    ("conduit-prefetch", ()),
    ("conduit-split", ()),
    ("gather-floor", ()),
    ("gear-placement", ()),
    ("cpprb", ("cpprb",)),
    ("torchrl", ("torchrl", "tensordict")),
    ("torchrl-prefetch", ("torchrl", "tensordict")),
    ("rllib", ("ray.rllib",)),
]


@pytest.mark.parametrize(("name", "modules"), ADAPTERS, ids=[a[0] for a in ADAPTERS])
def test_adapter_runs_every_metric_on_a_tiny_workload(name: str, modules: tuple[str, ...]
                                                      ) -> None:
    if not _importable(*modules):
        pytest.skip(f"{name}: {', '.join(modules)} not installed (pip install conduit-rl[peers])")
    [(_, adapter, reason)] = harness.build_adapters([name])
    if adapter is None:
        pytest.skip(f"{name} unavailable: {reason}")
    r = measure_adapter(adapter, TINY, TINY_CFG, quiet)
    wanted = getattr(adapter, "metrics", None) or tuple(METRICS)
    assert set(r.metrics) == set(wanted)
    for m in wanted:
        res = r.metrics[m]
        if name == "torchrl" and m == "sample_per_update" and res.status == "unavailable":
            # TorchRL's prioritized buffer needs its C++ extension; the reason must say so.
            assert "extension" in (res.reason or "") or "SumSegmentTree" in (res.reason or "")
            continue
        assert res.status == "ok", f"{name}/{m}: {res.status}: {res.reason}"
        assert res.value is not None and res.value > 0 and res.samples >= 1


def test_conduit_epoch_covers_the_rollout_exactly_once() -> None:
    from conduit.bench.peers.conduit_peer import ConduitPeer

    peer = ConduitPeer()
    peer.setup_on_policy(TINY)
    chunk = make_chunk(TINY.epoch_rows, TINY.dim)
    chunk["action"] = np.arange(TINY.epoch_rows, dtype=np.int64)  # row ids
    peer.insert(peer.prepare(chunk))
    buf = peer._buf
    assert buf is not None
    seen: list[int] = []
    sampler = buf.sampler
    sampler.begin_epoch(len(buf), iteration=0, epoch=0)  # type: ignore[attr-defined]
    for _ in range(TINY.minibatches):
        seen += buf.sample(TINY.minibatch)["action"].tolist()
    assert sorted(seen) == list(range(TINY.epoch_rows)) and seen != sorted(seen)


def test_gather_floor_returns_inserted_rows_only() -> None:
    from conduit.bench.peers.floor_peer import GatherFloorPeer

    peer = GatherFloorPeer()
    peer.setup(TINY)
    chunk = make_chunk(TINY.batch + 5, TINY.dim)
    chunk["action"] = np.arange(TINY.batch + 5, dtype=np.int64) + 100
    peer.insert(peer.prepare(chunk))
    obs, action, _, _ = peer.sample_uniform()
    assert action.shape == (TINY.batch,)
    assert set(action.tolist()) <= set(range(100, 100 + TINY.batch + 5))
    assert np.array_equal(obs.numpy(), chunk["obs"][action.numpy() - 100])


def test_gear_row_says_what_it_measures() -> None:
    from conduit.bench.peers.gear_peer import GearPlacementPeer

    notes = " ".join(GearPlacementPeer().notes())
    assert "placement" in notes
    import torch

    if not torch.cuda.is_available():
        assert "pageable" in notes


@pytest.mark.slow
def test_reverb_worker_runs_when_its_venv_exists() -> None:
    from conduit.bench.peers.reverb_peer import ReverbPeer

    peer = ReverbPeer(modes=("inproc",))
    missing = peer.availability()
    if missing is not None:
        pytest.skip(f"reverb {missing[0]}: {missing[1]}")
    w = Workload(dim=8, capacity=2048, batch=32, epoch_rows=256, minibatches=8)
    rows = rows_from_worker(peer.run([w], warmup=0, repeats=2, insert_64_repeats=2,
                                     epoch_repeats=1, progress=quiet), "x")
    by_peer = {r.peer: r for r in rows}
    assert by_peer["reverb-inproc"].status == "ok", by_peer["reverb-inproc"].reason
    assert all(m.status == "ok" for m in by_peer["reverb-inproc"].metrics.values())
    assert by_peer["reverb-inproc-dataset"].metrics["sample_uniform"].status == "ok"


def test_prioritized_side_by_side_times_sample_and_update_of_every_peer_that_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, int] = {}

    class Prioritized(NumpyPeer):
        def setup_prioritized(self, workload: Workload) -> None:
            self.w, self.rows = workload, []
            self.calls.append("setup_prioritized")

        def sample_prioritized_and_update(self) -> Any:
            calls[self.label] = calls.get(self.label, 0) + 1
            return self.sample_uniform()

    class Conduit(Prioritized):
        label = "conduit"

    class Cpprb(Prioritized):
        label = "cpprb"

    made: dict[str, Any] = {"conduit": Conduit, "cpprb": Cpprb}
    monkeypatch.setattr(harness, "_make", lambda name: made[name]())
    got = harness.measure_per_side_by_side(TINY, ["conduit", "cpprb"], TINY_CFG, quiet)
    assert set(got) == {"conduit", "cpprb"} and all(v > 0 for v in got.values())
    rounds = TINY_CFG.warmup + TINY_CFG.repeats * TINY_CFG.rounds
    assert calls == {"conduit": rounds, "cpprb": rounds}
    made["cpprb"] = NumpyPeer  # its setup_prioritized skips: nothing to compare with
    assert harness.measure_per_side_by_side(TINY, ["conduit", "cpprb"], TINY_CFG, quiet) == {}


def test_the_floor_gathers_whole_rows_into_outputs_it_allocated_once() -> None:
    from conduit.bench.peers.floor_peer import GatherFloorPeer

    floor = GatherFloorPeer()
    floor.setup(TINY)
    chunk = make_chunk(TINY.capacity, TINY.dim)
    chunk["action"] = np.arange(TINY.capacity, dtype=np.int64)  # each row names itself
    floor.insert(floor.prepare(chunk))
    ptrs = []
    for _ in range(2):  # each sample checked before the next overwrites it
        got = floor.sample_uniform()
        ptrs.append([t.data_ptr() for t in got])
        obs, action, reward, done = (t.numpy() for t in got)
        assert obs.shape == (TINY.batch, TINY.dim) and action.shape == (TINY.batch,)
        rows = action  # every field of a sampled row is that row's
        assert (obs == chunk["obs"][rows]).all() and (reward == chunk["reward"][rows]).all()
        assert (done == chunk["done"][rows]).all()
    assert ptrs[0] == ptrs[1]  # no new outputs
    floor.close()


def test_a_run_with_cpprb_judges_the_prioritized_target_by_its_side_by_side_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from conduit.bench.peers.conduit_peer import ConduitPeer

    class FakeCpprb(ConduitPeer):
        """cpprb is not installed in the test environment: Conduit's buffer stands in."""

        name = "cpprb"

        def check(self) -> None:
            return None

    monkeypatch.setitem(harness._ADAPTERS, "cpprb", FakeCpprb)
    out = tmp_path / "out"
    argv = ["--peers", "conduit", "cpprb", "--dims", "8", "--capacity", "2048",
            "--batches", "32", "--epoch-rows", "256", "--warmup", "1", "--repeats", "3",
            "--insert-64-repeats", "2", "--epoch-repeats", "1", "--no-plot", "--out", str(out)]
    assert harness.main(argv) == 0
    doc = json.loads((out / "peers.json").read_text())
    side = {r["peer"]: r["side_per_ms"] for r in doc["rows"]}
    assert set(side) == {"conduit", "cpprb"} and all(v > 0 for v in side.values())
    (per,) = [t for t in doc["targets_fast_path"]
              if t["target"] == "PER sample+update speed-up vs cpprb"]
    assert per["value"] == pytest.approx(side["cpprb"] / side["conduit"])


def test_prioritized_updates_cycle_priorities_drawn_before_timing() -> None:
    """Every peer's update takes the next array of one pool drawn per workload (no random
    generator inside the timed call), in its own type, with the same values."""
    import torch

    from conduit.bench.peers.conduit_peer import ConduitPeer

    w = Workload(dim=4, capacity=64, batch=8, seed=3)
    pool = list(itertools.islice(priorities(w), 2 * PRIORITY_POOL))
    assert all(x.shape == (8,) and x.dtype == np.float64 and ((x >= 1e-3) & (x < 1 + 1e-3)).all()
               for x in pool)
    assert not np.array_equal(pool[0], pool[1])
    assert all(pool[k] is pool[k + PRIORITY_POOL] for k in range(PRIORITY_POOL))
    converted = itertools.islice(priorities(w, torch.from_numpy), PRIORITY_POOL)
    assert all(torch.equal(t, torch.from_numpy(x)) for t, x in zip(converted, pool))

    peer = ConduitPeer(alpha=1.0)
    peer.setup_prioritized(w)
    peer.insert(peer.prepare(make_chunk(64, 4)))
    for k in range(2):
        batch = peer.sample_prioritized_and_update()
        idx = batch["_index"].numpy()
        once = [i for i, s in enumerate(idx) if (idx == s).sum() == 1]
        leaves = peer._buf.sampler.priorities(batch["_index"]).numpy()
        np.testing.assert_allclose(leaves[once], pool[k][once] + peer._buf.sampler.eps)


def test_workload_errors_name_real_flags() -> None:
    with pytest.raises(ValueError, match="--batches"):
        Workload(dim=4, capacity=10, batch=20)


def test_check_config_names_the_flags_of_cross_flag_values() -> None:
    from conduit.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        harness.check_config(PeersConfig(capacity=100, batches=(64, 256)))
    assert exc.value.field == "capacity" and "--batches 256" in exc.value.reason
    with pytest.raises(ConfigError) as exc:
        harness.check_config(PeersConfig(epoch_rows=10, minibatches=8))
    assert exc.value.field == "epoch_rows" and "--minibatches 8" in exc.value.reason
    harness.check_config(PeersConfig(capacity=256, batches=(256,), epoch_rows=16,
                                     minibatches=8))
