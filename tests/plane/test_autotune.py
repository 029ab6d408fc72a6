"""The runtime auto-optimizer: profiling the plane, applying the argmin, re-planning on drift."""

from __future__ import annotations

import pytest
import torch

from conduit.errors import ConfigError
from conduit.placement import plan_placement
from conduit.placement.presets import preset
from conduit.plane import ExperienceDataPlane
from conduit.plane.autotune import (
    AutoScheduler,
    plane_copy_times,
    profile_plane,
    profiling_schedules,
)
from conduit.scheduling import Profile, Schedule, choose, feasible_space
from conduit.spec import ExperienceSpec

SPEC = ExperienceSpec.of(obs=((4,), torch.float32), reward=((), torch.float32))


def _rows(n: int, start: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.arange(start, start + n, dtype=torch.float32)
    return {"obs": ids[:, None].expand(n, 4).clone(), "reward": ids}


def _off_policy_plane(g_max: int = 3) -> ExperienceDataPlane:
    plane = ExperienceDataPlane(spec=SPEC, capacity=512, batch_size=8, g_max=g_max, timeout=10)
    for i in range(4):
        plane.push(_rows(8, 8 * i))
    plane.flush()
    return plane


def _off_policy_step(plane: ExperienceDataPlane) -> None:
    with plane.timed("rollout"):
        r = _rows(8)
    plane.push(r)
    b = plane.pull()
    with plane.timed("update"):
        (b["obs"] * 2).sum()


def _on_policy_step(plane: ExperienceDataPlane) -> None:
    v = plane.policy_version
    with plane.timed("rollout"):
        units = [_rows(4, 4 * k) for k in range(4)]
    for u in units:
        plane.push(u, policy_version=v)
    with plane.timed("update"):
        for mb in plane.minibatches():
            mb["obs"].sum()


def _profile(**over: float) -> Profile:
    base = dict(t_rollout=0.010, t_update=0.020, t_ing={1: 0.004, 2: 0.005, 3: 0.006},
                t_del={1: 0.003, 2: 0.004, 3: 0.005}, t_sync_ing=0.0005, t_sync_del=0.0005)
    base.update(over)
    return Profile(**base)


def test_profile_covers_every_granularity_off_policy():
    with _off_policy_plane(g_max=3) as plane:
        before = plane.schedule
        prof = profile_plane(plane, _off_policy_step, iterations_per_g=2)
        assert plane.schedule == before  # restored
    space = feasible_space(mode="off_policy", g_max_ing=3, g_max_del=3)
    for g in space.g_ing:
        assert prof.ing_time(g) >= 0 and g in prof.t_ing
    for g in space.g_del:
        assert prof.del_time(g) >= 0 and g in prof.t_del
    assert prof.t_rollout > 0 and prof.t_update > 0
    assert prof.t_sync_ing > 0 and prof.t_sync_del > 0  # overlap was exercised


def test_profile_covers_every_granularity_on_policy():
    plane = ExperienceDataPlane(spec=SPEC, capacity=16, mode="on_policy", num_minibatches=4,
                                timeout=10)
    with plane:
        prof = profile_plane(plane, _on_policy_step, iterations_per_g=1)
        space = plane.space
    assert space.mode == "on_policy"
    for g in space.g_ing:
        assert g in prof.t_ing
    for g in space.g_del:
        assert g in prof.t_del


def test_restricted_granularities_are_filled_by_the_fit():
    space = feasible_space(mode="off_policy", g_max_ing=4, g_max_del=4)
    scheds = profiling_schedules(space, granularities=[1, 4])
    assert {s.g_ing for s in scheds} == {1, 4}
    assert {(s.overlap_ing, s.overlap_del) for s in scheds} == {(0, 0), (1, 1)}
    with _off_policy_plane(g_max=4) as plane:
        prof = profile_plane(plane, _off_policy_step, iterations_per_g=1, granularities=[1, 4])
    for g in space.g_ing:
        assert prof.ing_time(g) >= 0
    for g in space.g_del:
        assert prof.del_time(g) >= 0


def test_plan_applies_the_argmin_of_a_measured_profile():
    with _off_policy_plane(g_max=2) as plane:
        auto = AutoScheduler(plane=plane, step=_off_policy_step, iterations_per_g=1)
        plan = auto.plan()
        assert plan.schedule == choose(auto.profile, plane.space).schedule
        assert plane.schedule == plan.schedule
        assert "top candidates" in auto.explain()
        for _ in range(4):  # the chosen schedule runs
            _off_policy_step(plane)


def test_plan_applies_the_argmin_of_a_given_profile():
    # Overlap hides everything and g = 3 amortizes best: a known answer.
    prof = _profile(t_ing={1: 0.004, 2: 0.005, 3: 0.0055}, t_del={1: 0.003, 2: 0.0035,
                                                                 3: 0.0038})
    with _off_policy_plane(g_max=3) as plane:
        auto = AutoScheduler(plane=plane, profile=prof)
        plan = auto.plan()
        assert plane.schedule == plan.schedule == choose(prof, plane.space).schedule
        assert plan.schedule.overlap_ing == 1 and plan.schedule.overlap_del == 1


@pytest.mark.parametrize("lag,told,on_learner", [
    (0, None, True), (1, None, False), (0, False, False), (1, True, True)])
def test_a_plane_whose_batches_go_stale_at_each_update_delivers_on_the_learner(
        lag, told, on_learner):
    """On a prioritized plane without priority lag every update discards the batches drawn
    before it, which the profile does not price: the pick delivers one batch per invocation
    on the learner's thread, though prefetching is the argmin (as it stays with a lag, or
    when told otherwise)."""
    prof = _profile(t_ing={1: 0.004, 2: 0.005, 3: 0.0055}, t_del={1: 0.003, 2: 0.0035,
                                                                 3: 0.0038})
    plane = ExperienceDataPlane(spec=SPEC, capacity=512, batch_size=8, g_max=3, timeout=10,
                                sampler="prioritized", max_priority_lag=lag)
    with plane:
        argmin = choose(prof, plane.space).schedule
        assert argmin.overlap_del == 1
        auto = AutoScheduler(plane=plane, profile=prof, deliver_on_learner=told)
        plan = auto.plan()
        assert plane.schedule == plan.schedule
        assert plan.schedule.overlap_del == (0 if on_learner else 1)
        # without a lag one batch per invocation is drawn: an update discards the rest
        if lag == 0:
            assert {c.schedule.g_del for c in plan.ranked} == {1}
        else:
            assert auto.space == plane.space and max(auto.space.g_del) == 3
        if on_learner:  # chosen from every candidate: the best five may all prefetch
            assert len(plan.ranked) == len(auto.space)


def test_deliver_on_learner_must_be_a_bool_or_none():
    with _off_policy_plane(g_max=2) as plane, pytest.raises(ConfigError,
                                                            match="deliver_on_learner"):
        AutoScheduler(plane=plane, profile=_profile(), deliver_on_learner="yes")


def test_replans_on_injected_drift_not_on_noise():
    prof = _profile()
    with _off_policy_plane(g_max=3) as plane:
        auto = AutoScheduler(plane=plane, profile=prof, threshold=0.25, patience=3)
        first = auto.plan()
        # Noise: within the band, and isolated excursions on alternating sides.
        for v in (0.011, 0.009, 0.0105, 0.02, 0.0095, 0.002, 0.0102, 0.02, 0.004):
            plane.timings.record("rollout", v)
            assert not auto.observe().replan
        assert auto.replans == 0 and plane.schedule == first.schedule
        # Drift: the rollout becomes ten times slower, for several iterations in a row.
        decisions = []
        for _ in range(3):
            plane.timings.record("rollout", 0.100)
            decisions.append(auto.observe())
        assert [d.replan for d in decisions] == [False, False, True]
        assert decisions[-1].reasons == ("rollout",)
        assert auto.replans == 1
        assert auto.profile.t_rollout == pytest.approx(0.100)
        assert plane.schedule == choose(auto.profile, plane.space).schedule
        assert "re-plans: 1" in auto.explain()
        # The new reference is in force: the same slow rollouts are no longer drift.
        for _ in range(5):
            plane.timings.record("rollout", 0.100)
            assert not auto.observe().replan


def test_replan_changes_the_schedule_when_the_answer_changes():
    # Fast compute: overlap cannot hide much and its sync cost dominates -> inline wins.
    prof = _profile(t_rollout=0.0001, t_update=0.0001, t_sync_ing=0.001, t_sync_del=0.001)
    with _off_policy_plane(g_max=3) as plane:
        auto = AutoScheduler(plane=plane, profile=prof, patience=2)
        assert auto.plan().schedule.overlap_ing == 0
        for _ in range(2):  # compute becomes slow enough to hide the operators behind
            plane.timings.record("rollout", 0.050)
            plane.timings.record("update", 0.050)
            auto.observe()
        assert auto.replans == 1
        assert plane.schedule == choose(auto.profile, plane.space).schedule
        assert plane.schedule.overlap_ing == 1


def test_operator_drift_is_observed_per_granularity():
    prof = _profile()
    with _off_policy_plane(g_max=3) as plane:
        auto = AutoScheduler(plane=plane, profile=prof, patience=2)
        auto.plan()
        plane.timings.record("ingestion", 0.006, units=3)  # equals the reference at g=3
        plane.timings.record("ingestion", 0.006, units=3)
        assert not auto.observe().replan
        plane.timings.record("delivery", 0.050, units=2)
        plane.timings.record("delivery", 0.050, units=2)
        d = auto.observe()
        assert d.replan and d.reasons == ("delivery",)
        assert auto.profile.t_del[2] == pytest.approx(0.050)


def test_migration_triggers_a_replan():
    with _off_policy_plane(g_max=2) as plane:
        auto = AutoScheduler(plane=plane, profile=_profile(t_ing={1: 0.004, 2: 0.005},
                                                           t_del={1: 0.003, 2: 0.004}))
        auto.plan()
        assert auto.notify_migration().replan
        d = auto.observe()
        assert d.replan and "migration" in d.reasons
        assert auto.replans == 1
        assert not auto.observe().replan


def test_plane_migration_is_noticed_by_observe():
    from conduit.storage import Placement
    with _off_policy_plane(g_max=2) as plane:
        auto = AutoScheduler(plane=plane, profile=_profile(t_ing={1: 0.004, 2: 0.005},
                                                           t_del={1: 0.003, 2: 0.004}))
        auto.plan()
        assert not auto.observe().replan
        plane.migrate(Placement.sharded(["cpu", "cpu"]))
        d = auto.observe()
        assert d.replan and "migration" in d.reasons
        assert not auto.observe().replan


def test_replan_with_a_step_measures_again():
    with _off_policy_plane(g_max=2) as plane:
        auto = AutoScheduler(plane=plane, step=_off_policy_step, iterations_per_g=1)
        auto.plan()
        first = auto.profile
        auto.notify_migration()
        assert auto.observe().replan
        assert auto.profile is not first
        assert plane.schedule == choose(auto.profile, plane.space).schedule


def test_bad_arguments():
    with _off_policy_plane(g_max=2) as plane:
        with pytest.raises(ConfigError):
            AutoScheduler(plane=plane)
        with pytest.raises(ConfigError):
            AutoScheduler(plane=plane, profile=_profile(), watch=("bogus",))
        auto = AutoScheduler(plane=plane, profile=_profile())
        with pytest.raises(ConfigError):
            auto.observe()  # before plan()
        assert "no plan yet" in auto.explain()
        with pytest.raises(ConfigError):
            profile_plane(plane, _off_policy_step, iterations_per_g=0)
        with pytest.raises(ConfigError):
            profile_plane(plane, _off_policy_step, granularities=[])
        plane.set_schedule(Schedule(1, 2, 1, 2))
        assert plane.schedule == Schedule(1, 2, 1, 2)


@pytest.mark.parametrize("bytes_per_sample,overlap", [(20, False), (2_000_000, True)])
def test_plan_applies_the_copy_time_bound_of_the_placement(bytes_per_sample, overlap):
    """The profile of ``test_plan_applies_the_argmin_of_a_given_profile``, where overlap hides
    everything, under two placement decisions. At 20 bytes per sample an 8-row unit moves its
    data in nanoseconds: the operators are interpreter-bound, overlap hides only their copies,
    and the plan starts no thread. At 2 MB per sample they move data, and overlap is picked."""
    prof = _profile(t_ing={1: 0.004, 2: 0.005, 3: 0.0055}, t_del={1: 0.003, 2: 0.0035,
                                                                 3: 0.0038})
    with _off_policy_plane(g_max=3) as plane:
        plane.placement_decision = plan_placement(
            capacity=512, actor_device="cpu", learner_device="cpu", topology=preset("a100-8"),
            spec_bytes=bytes_per_sample, allowed_kinds=("pageable",))
        plan = AutoScheduler(plane=plane, profile=prof).plan()
        assert plane.schedule == plan.schedule
        assert bool(plan.schedule.overlap_ing or plan.schedule.overlap_del) == overlap
        assert (plan.profile.t_copy_ing is None) == overlap
        assert ("T_copy,ing" in plan.explain()) != overlap


def test_plane_copy_times_price_a_batch_and_a_pushed_unit_with_the_placement_legs():
    with ExperienceDataPlane(spec=SPEC, capacity=512, batch_size=8, placement="auto",
                             timeout=10) as plane:
        legs = plane.placement_decision.chosen_evaluation
        before = plane_copy_times(plane)
        assert before.t_copy_ing is None  # nothing pushed: a unit's rows are unknown
        plane.push(_rows(16))
        c = plane_copy_times(plane)
        # A CPU learner: delivery is priced too (a CUDA learner's is left unbounded).
        assert c.t_copy_del == pytest.approx(8 * legs.deliver_s)
        assert c.t_copy_ing == pytest.approx(16 * legs.ingest_s)
    with ExperienceDataPlane(spec=SPEC, capacity=512, batch_size=8, timeout=10) as plane:
        assert plane_copy_times(plane).to_dict() == {}  # placed by hand: no transfer model
