"""The ranking figures of leave-one-cluster-out (predictors/fitting/cluster_cv.py): Spearman,
regret, and what a group's own timing noise lets a perfect prediction show."""
import math

import pytest

pytest.importorskip("scipy")

from neox_perf.predictors.fitting import cluster_cv  # noqa: E402


def test_regret_is_the_measured_time_of_the_predicted_best_over_the_best():
    measured = [10.0, 12.0, 11.0]
    assert cluster_cv.regret([3.0, 1.0, 2.0], measured) == pytest.approx(1.2)
    assert cluster_cv.regret(measured, measured) == 1.0
    assert cluster_cv.spearman(measured, measured) == pytest.approx(1.0)


def test_timing_noise_counts_two_timings_per_pair_and_skips_one_quoted_twice():
    a = math.exp(0.02)
    sigma = cluster_cv.timing_noise([(100.0 * a, 100.0), (50.0, 50.0 * a), (121.28, 121.28)])
    assert sigma == pytest.approx(0.02 / math.sqrt(2))
    with pytest.raises(ValueError):
        cluster_cv.timing_noise([(7.0, 7.0)])


def test_a_perfect_prediction_ranks_lower_the_closer_the_layouts_and_the_noisier_the_timing():
    spread = [100.0 + 1.0 * i for i in range(12)]  # 1% apart: within one timing's noise
    wide = [100.0 * 1.2 ** i for i in range(12)]  # 20% apart: noise cannot reorder them
    close = cluster_cv.rank_ceiling(spread, 0.02)
    assert set(close) == {"median", "p10", "sigma", "draws"}
    assert close["p10"] < close["median"] < 0.95
    assert cluster_cv.rank_ceiling(wide, 0.02)["p10"] == pytest.approx(1.0)
    assert cluster_cv.rank_ceiling(spread, 0.005)["median"] > close["median"]
    assert cluster_cv.rank_ceiling(spread, 0.0)["median"] == pytest.approx(1.0)
    # one seed, one answer (the benchmark prints it)
    assert cluster_cv.rank_ceiling(spread, 0.02) == close


def test_rankings_judge_only_groups_with_enough_layouts():
    groups = ["a"] * cluster_cv.MIN_LAYOUTS + ["b"] * (cluster_cv.MIN_LAYOUTS - 1)
    measured = [float(i + 1) for i in range(len(groups))]
    predicted = [m if g == "a" else -m for g, m in zip(groups, measured)]
    (r,) = cluster_cv.rankings(groups, predicted, measured)
    assert r.group == "a" and r.layouts == cluster_cv.MIN_LAYOUTS and r.spearman == pytest.approx(1.0)
