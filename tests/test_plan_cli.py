"""``conduit plan``: placement and schedule printed for a configuration, without training."""

from __future__ import annotations

import json

from conduit.cli import main as cli_main
from conduit.placement import preset
from conduit.plan_cli import PlanArgs, main, plan
from conduit.scheduling import choose


def _chosen(out: str) -> tuple[str, str]:
    lines = out.splitlines()
    place = next(ln for ln in lines if ln.startswith("chosen placement:")).split(":", 1)[1]
    sched = next(ln for ln in lines if ln.startswith("chosen schedule:")).split(":", 1)[1]
    return place.strip(), sched.strip()


def test_plan_on_a_preset_prints_both_explanations(capsys):
    argv = ["--topology", "a100-8", "--dim", "5000", "--capacity", "1000000",
            "--batch-size", "512", "--learner-device", "cuda:0",
            "--t-rollout-ms", "12", "--t-update-ms", "20"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    place, sched = _chosen(out)
    assert place == "device[cuda:0]"  # 40 GB fits one A100 and is next to the learner
    assert "== placement (Alg. 1) ==" in out and "top candidates (ms):" in out
    assert "sharded[cuda:0,cuda:1]" in out  # the candidate table
    expected = plan(PlanArgs(topology="a100-8", dim=5000, capacity=1_000_000, batch_size=512,
                             learner_device="cuda:0", t_rollout_ms=12.0, t_update_ms=20.0))
    assert sched == expected.schedule.schedule.label()
    assert expected.schedule.schedule == choose(expected.schedule.profile, _space()).schedule
    assert "T_rollout=12.000 ms" in out


def _space():
    from conduit.scheduling import feasible_space
    return feasible_space(mode="off_policy", g_max_ing=8, g_max_del=8)


def test_plan_rejects_a_buffer_that_fits_no_device(capsys):
    argv = ["--topology", "a100-8", "--bytes-per-sample", "4000000", "--capacity", "1000000",
            "--t-rollout-ms", "5", "--t-update-ms", "5"]
    assert cli_main(["plan", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("conduit plan: error: CapacityError:")
    assert "fits no candidate placement" in err and out == ""


def test_plan_on_policy_from_a_topology_file(tmp_path, capsys):
    path = tmp_path / "topo.json"
    preset("mi250x-8").save(path)
    out_json = tmp_path / "plan.json"
    argv = ["--mode", "on_policy", "--topology", str(path), "--capacity", "65536",
            "--minibatches", "4", "--dim", "1000", "--json-out", str(out_json)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    place, sched = _chosen(out)
    assert place.startswith("device[") or place.startswith("sharded[")
    assert sched.endswith("g=1/4)")  # on-policy delivery is one mini-batch per invocation
    assert "assumed 10 ms" in out
    data = json.loads(out_json.read_text())
    assert data["schedule"]["mode"] == "on_policy"
    assert data["schedule"]["num_candidates"] == 16


def test_plan_with_a_short_profile_on_this_machine(capsys):
    argv = ["--dim", "32", "--capacity", "2000", "--batch-size", "32", "--g-max", "2",
            "--profile", "--learner-device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    place, sched = _chosen(out)
    assert place in ("pageable", "pinned")
    assert "profiled (synthetic warm-up on this machine)" in out
    assert sched.startswith("ing(")


def _usage_exit(argv, capsys) -> str:
    """Run ``conduit plan argv``: a usage error (exit status 2) before any output; stderr."""
    import pytest

    with pytest.raises(SystemExit) as exc:
        cli_main(["plan", *argv])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "usage: conduit plan" in err
    return err


def test_unknown_topology_is_a_clear_error(capsys):
    err = _usage_exit(["--topology", "no-such-preset"], capsys)
    assert "argument --topology: " in err and "neither a preset" in err


def test_plan_explains_cross_node_decisions(capsys):
    argv = ["--topology", "a100-8x2", "--dim", "5000", "--capacity", "1000000"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "== across nodes" in out and "ingestion stays node-local" in out
    result = plan(PlanArgs(topology="a100-8x2", dim=5000, capacity=1_000_000))
    terms = result.cross_node
    assert {t.endpoint for t in terms} == {"node0/cuda:0", "node1/cuda:0"}
    assert [t.local for t in terms] == [True, False] and sum(t.share for t in terms) == 1.0
    remote = next(t for t in terms if not t.local)
    assert remote.bandwidth == preset("a100-8x2").inter_node_bandwidth  # the network bounds it
    # the terms are the delivery leg the planner scored
    assert abs(sum(t.seconds for t in terms) - result.placement.chosen_evaluation.deliver_s) \
        < 1e-15
    assert "local with probability 0.500" in out
    assert json.loads(json.dumps(result.to_dict()))["cross_node"][1]["local"] is False


def test_single_node_plans_have_no_cross_node_section(capsys):
    assert main(["--topology", "a100-8", "--dim", "1000", "--capacity", "1000"]) == 0
    assert "== across nodes" not in capsys.readouterr().out


def test_plan_refuses_what_the_plane_would_refuse(capsys):
    """Defect: ``conduit plan`` chose a schedule for configurations a plane refuses (more
    mini-batches than rows per iteration; an off-policy batch larger than the buffer)."""
    for argv, flag in ((["--mode", "on_policy", "--capacity", "2", "--minibatches", "8"],
                        "--minibatches"),
                       (["--capacity", "100", "--batch-size", "512"], "--batch-size")):
        err = _usage_exit(["--topology", "a100-8", "--dim", "10", *argv], capsys)
        assert f"argument {flag}: " in err


def test_a_g_max_the_schedule_space_refuses_names_the_flag_field() -> None:
    import pytest

    from conduit.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        plan(PlanArgs(topology="a100-8", g_max=2000))
    assert exc.value.field == "g_max"


def test_a_ray_topology_nothing_listens_on_is_refused_without_starting_ray(monkeypatch) -> None:
    import socket

    import pytest

    from conduit.errors import ConfigError
    from conduit.plan_cli import load_topology

    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init was called"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConfigError) as exc:
        load_topology(f"ray:127.0.0.1:{port}")
    assert exc.value.field == "topology" and str(port) in exc.value.reason
