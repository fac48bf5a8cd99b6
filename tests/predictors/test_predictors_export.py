"""Exported trees evaluated with numpy must equal the libraries' own predict (1e-6)."""
import json
from pathlib import Path

import numpy as np
import pytest

from neox_perf.predictors.fitting import export, fit
from neox_perf.predictors.forest import log_features, round_down_float32

TOL = 1e-6


def _data(seed=0, n=600):
    rng = np.random.default_rng(seed)
    raw = np.exp(rng.uniform(np.log(512), np.log(40960), size=(n, 3)))
    raw[:, 2] = np.round(raw[:, 2] / 512) * 512  # repeated values: ties at thresholds
    x = log_features(raw.T)
    y = 0.3 * np.sin(x[:, 0]) + 0.1 * x[:, 1] - 0.05 * x[:, 2] + rng.normal(0, 0.02, n)
    return x, y


def _inputs(x, seed=1):
    rng = np.random.default_rng(seed)
    random = (rng.normal(size=(2000, x.shape[1])) * x.std(0) * 2 + x.mean(0)).astype(np.float32)
    return random


@pytest.mark.parametrize("kind, params", fit.candidates())
def test_every_production_config_exports_exactly(kind, params):
    x, y = _data()
    params = dict(params, n_estimators=min(params["n_estimators"], 40))
    model = fit.make_model(kind, params).fit(x, y)
    forest = export.export(model)
    assert export.max_relative_error(forest, model, x) <= TOL
    assert export.max_relative_error(forest, model, _inputs(x)) <= TOL
    # inputs sitting exactly on every threshold take the library's branch
    thresholds = forest.threshold[np.isfinite(forest.threshold)]
    on = np.repeat(x[:1], len(thresholds), axis=0)
    on[:, forest.feature[np.isfinite(forest.threshold)]] = thresholds[:, None]
    assert export.max_relative_error(forest, model, on) <= TOL
    # the single-row fast path agrees with the batch path
    for row in x[:20]:
        assert forest.predict_one(row) == pytest.approx(forest.predict(row[None, :])[0], rel=1e-12, abs=1e-12)


def test_xgboost_sum_is_bit_exact():
    x, y = _data(3)
    y = y + 5.0  # a base_score far from zero makes float32 accumulation order matter
    model = fit.make_model("xgboost", dict(n_estimators=300, learning_rate=0.1, max_depth=6,
                                           min_child_weight=1, subsample=0.8)).fit(x, y)
    forest = export.export(model)
    np.testing.assert_array_equal(forest.predict(x), model.predict(x).astype(np.float64))


def test_round_down_float32():
    t = np.array([0.1, 1.0, 1e-8, -3.3, 7.0 + 1e-12])
    r = round_down_float32(t)
    assert r.dtype == np.float32
    assert np.all(r.astype(np.float64) <= t)
    assert np.all(np.nextafter(r, np.float32(np.inf)).astype(np.float64) > t)


def test_export_rejects_unknown_objects():
    with pytest.raises(TypeError):
        export.export(object())


def test_check_export_raises_on_mismatch():
    x, y = _data()
    model = fit.make_model("random_forest", dict(n_estimators=4, max_depth=4, min_samples_leaf=2,
                                                 max_features=1.0)).fit(x, y)
    forest = export.export(model)
    broken = type(forest)(forest.feature, forest.threshold, forest.right, forest.value + 0.1,
                          forest.roots, forest.depth, forest.combine, forest.base)
    with pytest.raises(AssertionError):
        export.check_export(broken, model, x)


def test_bundled_profiles_record_exact_exports():
    """train.py checks every exported model against its library on all training rows."""
    root = Path(__file__).resolve().parents[2] / "neox_perf" / "profiles"
    manifests = sorted(root.glob("*/manifest.json"))
    if not manifests:
        pytest.skip("no bundled profiles")
    for path in manifests:
        m = json.loads(path.read_text())
        entries = [e for phases in m["operators"].values() for e in phases.values()]
        entries += list(m["collectives"].values())
        forests = [e for e in entries if "forest" in e]
        assert forests, path
        for e in forests:
            assert e["export_max_error"] <= TOL, (path, e["forest"])


def test_a_zero_flag_among_the_tree_features_fits_and_predicts():
    """`calibrate --for` on a causal-attention config samples flash attention with causal 1
    beside the plan's causal 0: the flag varies, so it enters the trees, and its 0 must not
    become log(0) = -inf (which stopped the fit)."""
    from neox_perf.predictors.fitting import fit
    from neox_perf.predictors.forest import FLAG_FLOOR, log_features
    rng = np.random.default_rng(0)
    n = 120
    size = rng.choice([64.0, 128.0, 256.0, 512.0], n)
    causal = rng.choice([0.0, 1.0], n)
    seconds = 1e-6 * size * (1.0 - 0.4 * causal) * rng.uniform(0.97, 1.03, n)
    design = np.column_stack([np.ones(n), size])
    result = fit.fit_one("flag/fwd", design, [size, causal], seconds, grid=fit.QUICK_GRID)
    assert result.tree_columns == [0, 1] and np.isfinite(list(result.validation.values())).all()
    assert np.isfinite(log_features([[0.0, 1.0]])).all()
    assert log_features([[0.0]])[0, 0] == np.float32(np.log(FLAG_FLOOR))
    if result.forest is not None:
        off, on = (result.forest.predict(log_features([[256.0], [c]]))[0] for c in (0.0, 1.0))
        assert on < off  # causal halves the work: the trees see the flag


def test_a_blend_predicts_the_mean_of_its_models():
    """export.blend lays a random forest and a booster end to end as one summed forest: it
    predicts their mean (batch and single-row paths), trees of different depths included."""
    x, y = _data(5)
    rf = fit.make_model("random_forest", dict(n_estimators=16, max_depth=8, min_samples_leaf=2,
                                              max_features=1.0)).fit(x, y)
    xgb = fit.make_model("xgboost", dict(n_estimators=60, learning_rate=0.1, max_depth=3,
                                         min_child_weight=1, subsample=0.8)).fit(x, y + 0.5)
    forest = export.blend([export.export(rf), export.export(xgb)])
    both = export.Blend([rf, xgb])
    assert len(forest.roots) == 16 + 60 and forest.depth == 8
    for rows in (x, _inputs(x)):
        assert export.max_relative_error(forest, both, rows) <= 1e-5
    # the mean, not either model: each is well away from it somewhere
    for model in (rf, xgb):
        assert np.max(np.abs(forest.predict(x) - model.predict(x))) > 0.1
    for row in x[:10]:
        assert forest.predict_one(row) == pytest.approx(forest.predict(row[None, :])[0], rel=1e-9, abs=1e-9)


def test_a_blended_fit_is_the_mean_of_each_kinds_best():
    """fit_one(blended=True): the trees are the mean of the best random forest and the best
    XGBoost on the validation split, refitted on every row, validated as one candidate."""
    rng = np.random.default_rng(2)
    n = 200
    size = rng.choice([64.0, 128.0, 256.0, 512.0, 1024.0], n)
    other = rng.choice([1.0, 2.0, 4.0, 8.0], n)
    seconds = 1e-6 * size * other * (1 + 0.3 * np.sin(np.log(size))) * rng.uniform(0.98, 1.02, n)
    design = np.column_stack([np.ones(n), size * other])
    result = fit.fit_one("blend/fwd", design, [size, other], seconds, grid=fit.QUICK_GRID, blended=True)
    assert result.chosen == fit.BLEND
    assert set(result.hyperparameters) == {"random_forest", "xgboost"}
    assert result.validation_detail["baseline_plus_trees"] == fit.BLEND
    assert result.validation["chosen"] == result.validation["baseline_plus_trees"] < result.validation["baseline"]
    single = fit.fit_one("blend/fwd", design, [size, other], seconds, grid=fit.QUICK_GRID)
    assert single.chosen in ("random_forest", "xgboost")
    x = log_features([size[:50], other[:50]])
    resid = np.log(seconds) - np.log(fit.baseline.evaluate(design, result.coef))
    models = [fit.make_model(k, result.hyperparameters[k]).fit(log_features([size, other]), resid)
              for k in ("random_forest", "xgboost")]
    np.testing.assert_allclose(result.forest.predict(x), np.mean([m.predict(x) for m in models], axis=0),
                               atol=1e-5)
    # one kind in the grid: nothing to blend, the single best as before
    rf_only = fit.fit_one("blend/fwd", design, [size, other], seconds, grid=fit.QUICK_GRID[:1], blended=True)
    assert rf_only.chosen in ("random_forest", "baseline")
