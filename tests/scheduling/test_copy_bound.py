"""The copy-time bound: per-unit data movement, the interpreter-bound rule, the bounded profile."""

from __future__ import annotations

import pytest

from conduit.errors import ConfigError
from conduit.scheduling import (
    CopyTimes,
    Profile,
    Schedule,
    copy_bound,
    copy_times,
    feasible_space,
    predict,
)


def test_off_policy_units_are_a_rollout_unit_and_a_batch():
    c = copy_times(mode="off_policy", ingest_s=1e-6, deliver_s=2e-6, capacity=1000,
                   batch_size=32, rows_per_unit=8)
    assert c.t_copy_ing == pytest.approx(8e-6) and c.t_copy_del == pytest.approx(64e-6)
    # Before the first push the rows per unit are unknown: ingestion's time is too.
    c = copy_times(mode="off_policy", ingest_s=1e-6, deliver_s=2e-6, capacity=1000,
                   batch_size=32, rows_per_unit=None)
    assert c.t_copy_ing is None and set(c.to_dict()) == {"t_copy_del"}


@pytest.mark.parametrize("mode", ["off_policy", "on_policy"])
def test_a_learner_on_an_accelerator_leaves_delivery_unbounded(mode):
    # Its update waits for kernels outside the interpreter lock: Eq. 5 as it is.
    c = copy_times(mode=mode, ingest_s=1e-6, deliver_s=2e-6, capacity=1000, batch_size=32,
                   rows_per_unit=8, learner="cuda")
    assert c.t_copy_del is None and c.t_copy_ing == pytest.approx(
        8e-6 if mode == "off_policy" else 1e-3)
    prof = Profile(t_rollout=0.01, t_update=0.01, t_ing={1: 0.004}, t_del={1: 0.004})
    assert copy_bound(prof, c, min_copy=1e-4).t_copy_del is None


def test_on_policy_unit_is_the_iteration():
    c = copy_times(mode="on_policy", ingest_s=1e-6, deliver_s=2e-6, capacity=1000,
                   batch_size=250, rows_per_unit=None)
    assert c.to_dict() == pytest.approx({"t_copy_ing": 1e-3, "t_copy_del": 2e-3})


def test_only_interpreter_bound_operators_are_bounded():
    c = CopyTimes(t_copy_ing=5e-5, t_copy_del=5e-3)
    assert c.interpreter_bound(1e-4) == CopyTimes(t_copy_ing=5e-5)
    prof = Profile(t_rollout=0.01, t_update=0.01, t_ing={1: 0.004}, t_del={1: 0.004})
    bounded = copy_bound(prof, c, min_copy=1e-4)
    assert bounded.t_copy_ing == 5e-5 and bounded.t_copy_del is None
    assert copy_bound(prof, CopyTimes()) == prof
    # Overlap now hides only the copy of ingestion, all of delivery.
    s = Schedule(1, 1, 1, 1)
    space = feasible_space(mode="off_policy", g_max_ing=1, g_max_del=1)
    assert predict(bounded, s, mode=space.mode).hide_ing == pytest.approx(5e-5)
    assert predict(bounded, s, mode=space.mode).hide_del == pytest.approx(0.004)


def test_negative_or_non_finite_times_are_rejected():
    with pytest.raises(ConfigError, match="t_copy_del"):
        CopyTimes(t_copy_del=-1.0)
    with pytest.raises(ConfigError, match="t_copy_ing"):
        CopyTimes(t_copy_ing=float("nan"))
