"""Re-planning: sustained drift triggers, noise does not (hysteresis), migration does."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conduit.errors import ConfigError, ScheduleError
from conduit.scheduling import (
    MIGRATION,
    DriftDetector,
    Profile,
    ReplanDecision,
    ReplanPolicy,
)

ms = 1e-3
REF = Profile(t_rollout=10 * ms, t_update=20 * ms, t_ing={1: 4 * ms, 4: 8 * ms},
              t_del={1: 3 * ms}, t_sync_ing=0.0, t_sync_del=1 * ms)


def feed(det, values, key="t_rollout", **extra):
    for v in values:
        det = det.observe(**{key: v}, **extra)
    return det


def test_noise_inside_the_band_never_triggers():
    det = DriftDetector(reference=REF, threshold=0.25, patience=3)
    # deterministic "noise" within +-24 % of the 10 ms reference, many observations
    noise = [10 * ms * (1 + 0.24 * ((i * 7919) % 97 - 48) / 48) for i in range(500)]
    det = feed(det, noise)
    assert not det.triggered
    assert det.streak("rollout") == 0


def test_sustained_drift_triggers_after_k_consecutive_observations():
    det = DriftDetector(reference=REF, threshold=0.25, patience=3)
    det = det.observe(t_rollout=14 * ms)  # +40 %
    assert det.streak("rollout") == 1 and not det.triggered
    det = det.observe(t_rollout=14 * ms)
    assert det.streak("rollout") == 2 and not det.triggered
    det = det.observe(t_rollout=14 * ms)
    assert det.triggered
    assert det.drifted == ("rollout",)


def test_drift_downwards_triggers_too():
    det = feed(DriftDetector(reference=REF, patience=2), [5 * ms, 5 * ms], key="t_update")
    assert det.drifted == ("update",)
    assert det.streak("update") == -2


def test_interrupted_excursions_do_not_trigger():
    det = DriftDetector(reference=REF, threshold=0.25, patience=3)
    # out, out, back in the band, out, out: never 3 in a row
    det = feed(det, [14 * ms, 14 * ms, 10.5 * ms, 14 * ms, 14 * ms])
    assert not det.triggered
    assert det.streak("rollout") == 2


def test_alternating_large_noise_does_not_trigger():
    det = DriftDetector(reference=REF, threshold=0.25, patience=3)
    det = feed(det, [14 * ms, 6 * ms] * 20)
    assert not det.triggered


def test_exactly_at_threshold_is_inside_the_band():
    det = feed(DriftDetector(reference=REF, threshold=0.25, patience=1), [12.5 * ms])
    assert not det.triggered


def test_operator_drift_is_measured_at_its_granularity():
    det = DriftDetector(reference=REF, threshold=0.25, patience=3)
    # 9 ms at g=4 is within 25 % of T_ing(4) = 8 ms (it would be +125 % at g=1)
    det = feed(det, [9 * ms] * 5, key="t_ing", g_ing=4)
    assert not det.triggered
    det = feed(det, [12 * ms] * 3, key="t_ing", g_ing=4)
    assert det.drifted == ("ingestion",)
    det2 = feed(DriftDetector(reference=REF), [6 * ms] * 3, key="t_del", g_del=1)
    assert det2.drifted == ("delivery",)
    with pytest.raises(ScheduleError):
        DriftDetector(reference=REF).observe(t_ing=1.0, g_ing=2)


def test_metrics_are_tracked_independently():
    det = DriftDetector(reference=REF, patience=2)
    det = det.observe(t_rollout=20 * ms, t_update=20 * ms)
    det = det.observe(t_rollout=20 * ms, t_update=40 * ms)
    assert det.drifted == ("rollout",)
    det = det.observe(t_update=40 * ms)
    assert det.drifted == ("rollout", "update")


def test_trigger_latches_until_rebase():
    det = feed(DriftDetector(reference=REF, patience=2), [20 * ms] * 2)
    assert det.triggered
    det = feed(det, [10 * ms] * 5)  # back to normal: still flagged until re-planned
    assert det.triggered
    new_ref = Profile(t_rollout=20 * ms, t_update=20 * ms, t_ing={1: 4 * ms},
                      t_del={1: 3 * ms})
    det = det.rebase(new_ref)
    assert not det.triggered and det.streaks == ()
    det = feed(det, [21 * ms] * 10)  # within the new band
    assert not det.triggered


def test_zero_reference_with_absolute_tolerance():
    det = feed(DriftDetector(reference=REF, patience=2, abs_tol=0.5 * ms), [0.1 * ms] * 5,
               key="t_sync_ing")
    assert not det.triggered
    det = feed(DriftDetector(reference=REF, patience=2), [0.1 * ms] * 2, key="t_sync_ing")
    assert det.drifted == ("sync_ing",)


def test_detector_is_immutable_and_deterministic():
    d0 = DriftDetector(reference=REF, patience=2)
    d1 = d0.observe(t_rollout=20 * ms)
    assert d0.streak("rollout") == 0 and d1.streak("rollout") == 1
    seq = [11 * ms, 20 * ms, 20 * ms, 9 * ms, 3 * ms]
    assert feed(d0, seq) == feed(d0, seq)
    with pytest.raises(AttributeError):
        d0.threshold = 0.5  # type: ignore[misc]


def test_deviation_is_relative():
    det = DriftDetector(reference=REF)
    assert det.deviation("rollout", 15 * ms) == pytest.approx(0.5)
    assert det.deviation("ingestion", 6 * ms, g=4) == pytest.approx(-0.25)
    assert det.deviation("sync_ing", 0.0) == 0.0
    assert det.deviation("sync_ing", 1 * ms) == float("inf")
    with pytest.raises(ConfigError):
        det.deviation("bogus", 1.0)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"threshold": 0}, "threshold"), ({"threshold": -0.1}, "threshold"),
    ({"threshold": float("nan")}, "threshold"), ({"patience": 0}, "patience"),
    ({"patience": 1.5}, "patience"), ({"abs_tol": -1.0}, "abs_tol"),
])
def test_invalid_detector_settings(kwargs, field):
    with pytest.raises(ConfigError) as info:
        DriftDetector(reference=REF, **kwargs)
    assert info.value.field == field


def test_invalid_observation_is_rejected():
    with pytest.raises(ConfigError) as info:
        DriftDetector(reference=REF).observe(t_update=-1.0)
    assert info.value.field == "t_update"


def test_policy_replans_on_migration_notice():
    policy = ReplanPolicy(reference=REF)
    assert not policy.decision()
    d = policy.notify_migration()
    assert isinstance(d, ReplanDecision)
    assert d.replan and d.reasons == (MIGRATION,)
    policy.replanned(REF)
    assert policy.decision() == ReplanDecision(replan=False, reasons=())


def test_policy_replans_on_sustained_drift_only():
    policy = ReplanPolicy(reference=REF, threshold=0.25, patience=3)
    for v in (11 * ms, 9 * ms, 12 * ms, 8 * ms):
        assert not policy.observe(t_rollout=v, t_update=20 * ms)
    assert not policy.observe(t_update=30 * ms)
    assert not policy.observe(t_update=30 * ms)
    d = policy.observe(t_update=30 * ms)
    assert d.replan and d.reasons == ("update",)
    policy.notify_migration()
    assert policy.decision().reasons == ("update", MIGRATION)
    policy.replanned(REF)
    assert not policy.decision()
    assert policy.detector.streaks == ()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=-0.25, max_value=0.25), min_size=1, max_size=60),
       st.integers(min_value=1, max_value=5))
def test_property_in_band_sequences_never_trigger(rel, patience):
    det = DriftDetector(reference=REF, threshold=0.25, patience=patience)
    for r in rel:
        det = det.observe(t_rollout=10 * ms * (1 + r) * (1 - 1e-12),
                          t_ing=8 * ms * (1 + r) * (1 - 1e-12), g_ing=4)
    assert not det.triggered
