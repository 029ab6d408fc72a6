"""Decisions checked against the paper's text: ``conduit plan`` searches the schedule space a
plane of the same configuration searches, Alg. 1 keeps the first of tied candidates, and
out-of-range inputs to Eq. 2 and Eq. 3 give typed errors, never a NaN plan or a crash. Each
test fails on the code before its mend."""

from __future__ import annotations

import pytest

from conduit.cli import main as cli_main
from conduit.errors import ConfigError, PlacementError
from conduit.placement import plan_placement, preset
from conduit.placement.migration import solve_transfer_plan
from conduit.plan_cli import PlanArgs, main, plan
from conduit.plane.config import PlaneConfig
from conduit.plane.synthetic import synthetic_spec
from conduit.scheduling import Profile, choose, feasible_space


def test_on_policy_plans_search_the_planes_space_with_the_rollout_units_share():
    """On-policy, --rollout-rows adds its unit's share of the iteration to the ingestion
    granularities a plane searches (design.md §6); conduit plan left it out, so it could
    choose another schedule than the plane for the same costs."""
    args = PlanArgs(mode="on_policy", topology="a100-8", dim=100, capacity=4096,
                    minibatches=4, rollout_rows=256, op_overhead_us=0.0)
    result = plan(args)
    plane_space = PlaneConfig(spec=synthetic_spec(100), capacity=4096, mode="on_policy",
                              num_minibatches=4, batch_size=1,
                              rollout_rows=256).schedule_space()
    assert result.schedule.num_candidates == len(plane_space.candidates())
    assert result.schedule.schedule == choose(result.schedule.profile, plane_space).schedule
    assert result.schedule.schedule.g_ing == pytest.approx(1 / 16)


@pytest.mark.parametrize("argv", [
    ["--rollout-rows", "0"],
    ["--capacity", "1000", "--batch-size", "10", "--rollout-rows", "5000000"],
])
def test_an_off_policy_rollout_unit_outside_the_buffer_is_a_usage_error(argv, capsys):
    """--rollout-rows 0 was taken as --batch-size, and a unit larger than the buffer was
    planned for."""
    with pytest.raises(SystemExit) as exc:
        cli_main(["plan", "--topology", "a100-8", *argv])
    assert exc.value.code == 2
    assert "argument --rollout-rows: must be an integer in [1, capacity=" in \
        capsys.readouterr().err


def test_the_printed_placement_names_its_nodes(capsys):
    """The summary line printed sharded[...] for a two-node decision (the JSON said
    '2 nodes x ...')."""
    assert main(["--topology", "a100-8x2", "--dim", "5000", "--capacity", "1000000"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("chosen placement:"))
    assert line == f"chosen placement: {plan(PlanArgs(topology='a100-8x2', dim=5000, capacity=1_000_000)).placement.chosen.label()}"  # noqa: E501
    assert "2 nodes x " in line


def test_alg1_keeps_the_first_of_candidates_tied_up_to_rounding():
    """With the learner on the CPU every candidate of the a100-8 preset costs the same in exact
    arithmetic; summing three 1/3 shares rounded lower, so Alg. 1 put a CPU learner's buffer on
    three GPUs. The first candidate scanned (pageable memory) is kept."""
    d = plan_placement(capacity=10, actor_device="cpu", learner_device="cpu",
                       topology=preset("a100-8"), spec_bytes=100)
    assert d.chosen.label() == "pageable"


def test_a_plan_of_a_profile_that_predicts_no_time_explains_itself():
    space = feasible_space(mode="off_policy", g_max_ing=2, g_max_del=2)
    text = str(choose(Profile(t_rollout=0, t_update=0, t_ing={1: 0, 2: 0},
                              t_del={1: 0, 2: 0}), space))
    assert "(both predict no time)" in text


def test_a_profile_whose_iteration_overflows_is_refused():
    space = feasible_space(mode="off_policy", g_max_ing=2, g_max_del=2)
    huge = {1: 1e308, 2: 1e308}
    with pytest.raises(ConfigError) as info:
        choose(Profile(t_rollout=1e308, t_update=1e308, t_ing=huge, t_del=huge), space)
    assert info.value.field == "profile"


def test_eq3_refuses_volumes_whose_sum_overflows():
    """Each volume was finite, their sum was not: the plan came back with NaN flows and a
    makespan of 0."""
    with pytest.raises(PlacementError, match="volumes"):
        solve_transfer_plan([1e308, 1e308], [1e308, 1e308], [[1e9, 1e9], [1e9, 1e9]])
