"""Cost-model fidelity metrics (App. F / Tab. 4)."""

import math

import numpy as np
import pytest
from scipy import stats

from conduit.errors import ConfigError
from conduit.scheduling import fidelity, top_k_order


def test_perfectly_correlated_predictions():
    measured = [10.0, 12.0, 15.0, 11.0, 30.0, 20.0, 18.0, 25.0, 40.0, 13.0]
    predicted = [1.2 * m for m in measured]
    out = fidelity(predicted, measured, k=8)
    assert out["pearson_r"] == pytest.approx(1.0)
    assert out["mape"] == pytest.approx(20.0)
    assert out["top_k_match"] is True and out["best_match"] is True
    assert out["k"] == 8 and out["n"] == 10
    assert out["measured_top_k"] == [0, 3, 1, 9, 2, 6, 5, 7]


def test_swapped_order_inside_top_k_is_a_mismatch():
    measured = [1.0, 2.0, 3.0, 4.0, 5.0]
    predicted = [1.0, 3.0, 2.0, 4.0, 5.0]
    out = fidelity(predicted, measured, k=3)
    assert out["top_k_match"] is False
    assert out["best_match"] is True
    # outside the top-k the order does not matter
    assert fidelity([1.0, 2.0, 3.0, 5.0, 4.0], measured, k=3)["top_k_match"] is True


def test_matches_scipy_pearson_and_hand_mape():
    rng = np.random.default_rng(0)
    measured = rng.uniform(10, 50, size=32)
    predicted = measured * rng.uniform(0.8, 1.4, size=32)
    out = fidelity(predicted.tolist(), measured.tolist())
    assert out["pearson_r"] == pytest.approx(stats.pearsonr(predicted, measured)[0])
    assert out["mape"] == pytest.approx(100 * np.mean(np.abs(predicted - measured) / measured))


def test_degenerate_inputs():
    out = fidelity([1.0], [2.0], k=8)
    assert out["k"] == 1 and math.isnan(out["pearson_r"]) and out["mape"] == pytest.approx(50)
    assert math.isnan(fidelity([1.0, 1.0], [1.0, 2.0])["pearson_r"])


@pytest.mark.parametrize(("pred", "meas", "k", "field"), [
    ([1.0, 2.0], [1.0], 8, "measured"),
    ([], [], 8, "measured"),
    ([1.0], [0.0], 8, "measured"),
    ([float("nan")], [1.0], 8, "predicted"),
    ([1.0], [1.0], 0, "k"),
])
def test_bad_inputs(pred, meas, k, field):
    with pytest.raises(ConfigError) as info:
        fidelity(pred, meas, k=k)
    assert info.value.field == field


def test_top_k_order_is_stable():
    assert top_k_order([3.0, 1.0, 1.0, 2.0], 3) == [1, 2, 3]
