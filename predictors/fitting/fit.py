"""Fitting one (op, phase): physical baseline, then trees on its log residual.

As in the paper, RandomForest and XGBoost candidates are compared on one seeded 80/20
split and the best is refitted on all rows. Three numbers are kept per op/phase, all on the
same validation rows with everything fitted on the same 80%: the baseline alone, trees
alone on log(time) (the paper's design, log target) and baseline + trees. If no tree beats
the baseline alone on validation, the baseline alone is chosen.

scikit-learn and XGBoost are imported inside the functions: only training needs them.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from .. import baseline
from ..forest import Forest, log_features
from .export import Blend, blend, check_export, export

# Small grids: the whole training of both clusters must stay at a few minutes on 2 cores,
# and each exported ensemble small (depth and tree count bound the profile size).
RF_GRID: Tuple[dict, ...] = tuple(
    dict(n_estimators=32, max_depth=depth, min_samples_leaf=leaf, max_features=1.0)
    for depth in (8, 12) for leaf in (2, 5))
XGB_GRID: Tuple[dict, ...] = tuple(
    dict(n_estimators=150, learning_rate=0.1, max_depth=depth, min_child_weight=mcw, subsample=0.8)
    for depth in (3, 6) for mcw in (1, 5))
VALIDATION_FRACTION = 0.2
N_JOBS = 2


def make_model(kind: str, params: dict):
    if kind == "random_forest":
        from sklearn.ensemble import RandomForestRegressor
        return RandomForestRegressor(random_state=0, n_jobs=N_JOBS, **params)
    if kind == "xgboost":
        from xgboost import XGBRegressor
        return XGBRegressor(objective="reg:squarederror", random_state=0, n_jobs=N_JOBS,
                            tree_method="hist", **params)
    raise ValueError(kind)


def candidates() -> List[Tuple[str, dict]]:
    return [("random_forest", p) for p in RF_GRID] + [("xgboost", p) for p in XGB_GRID]


# for tests and smoke runs: one tiny model of each kind
QUICK_GRID: List[Tuple[str, dict]] = [
    ("random_forest", dict(n_estimators=8, max_depth=6, min_samples_leaf=2, max_features=1.0)),
    ("xgboost", dict(n_estimators=30, learning_rate=0.2, max_depth=3, min_child_weight=1, subsample=1.0)),
]
MIN_ROWS_FOR_TREES = 20


def mape(pred: np.ndarray, actual: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - actual) / actual))


def split(n: int, key: str) -> Tuple[np.ndarray, np.ndarray]:
    """Seeded 80/20 split; the seed depends on the op/phase name only, so reruns agree."""
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    order = rng.permutation(n)
    n_val = max(1, int(round(VALIDATION_FRACTION * n)))
    return np.sort(order[n_val:]), np.sort(order[:n_val])


@dataclass
class FitResult:
    coef: np.ndarray
    chosen: str  # random_forest | xgboost | blend (of both) | baseline
    hyperparameters: dict
    forest: Optional[Forest]
    tree_columns: List[int]  # indices into the feature list the trees use
    validation: Dict[str, float]
    validation_detail: Dict[str, str] = field(default_factory=dict)
    export_error: float = 0.0


def _best_tree(grid, x_tr, y_tr, x_val, to_seconds_val: Callable[[np.ndarray], np.ndarray], actual_val):
    best = (np.inf, None, None, None)
    for kind, params in grid:
        model = make_model(kind, params).fit(x_tr, y_tr)
        predicted = model.predict(x_val)
        err = mape(to_seconds_val(predicted), actual_val)
        if err < best[0]:
            best = (err, kind, params, predicted)
    return best


BLEND = "blend"  # FitResult.chosen: the mean of the best random forest and the best XGBoost


def _blend_of(grid, x_tr, y_tr, x_val, to_seconds_val, actual_val):
    """(validation error, {kind: params}) of the mean of each tree kind's best candidate,
    or None when the grid holds one kind only."""
    kinds = sorted({k for k, _ in grid})
    if len(kinds) < 2:
        return None
    best = {k: _best_tree([c for c in grid if c[0] == k], x_tr, y_tr, x_val, to_seconds_val, actual_val)
            for k in kinds}
    mean = np.mean([b[3] for b in best.values()], axis=0)
    return mape(to_seconds_val(mean), actual_val), {k: b[2] for k, b in best.items()}


def fit_one(key: str, design: np.ndarray, feature_columns: List[np.ndarray], seconds: np.ndarray,
            grid: Optional[List[Tuple[str, dict]]] = None, limits=(None, None),
            blended: bool = False) -> FitResult:
    """design: baseline columns per row; feature_columns: raw features in opspec order;
    limits: (lower bounds, preference) for the baseline fit, see cleaning.baseline_limits.

    blended: the trees are the mean of the best candidate of each kind (random forest and
    XGBoost), not the single best. Picking one of two models whose validation errors differ
    by less than the samples' noise makes the fit jump between them from one calibration of
    the same machine to the next (6 of 54 operators switched kind between two quiet
    calibrations, moving a layout's prediction by up to 5.5%: docs/validation.md); their
    mean does not jump, and is validated like any candidate.

    Features constant over the samples (flash attention's `causal`, Vista's GPUs per node)
    carry no information for the trees and are left out of their input.
    """
    grid = candidates() if grid is None else grid
    lower, preference = limits

    def fit_base(rows):
        return baseline.fit_nonnegative(design[rows], seconds[rows], lower=lower, preference=preference)[0]

    everything = np.arange(len(seconds))
    varying = [j for j, col in enumerate(feature_columns) if np.ptp(np.asarray(col, dtype=float)) > 0]
    if not varying or len(seconds) < MIN_ROWS_FOR_TREES:
        coef = fit_base(everything)
        err = mape(baseline.evaluate(design, coef), seconds)
        nan = float("nan")
        return FitResult(coef, "baseline", {}, None, [], {
            "baseline": nan, "pure_trees": nan, "baseline_plus_trees": nan, "chosen": nan,
            "baseline_in_sample": err}, {"reason": "too few rows or no varying feature for trees"})
    x_all = log_features([feature_columns[j] for j in varying])
    log_t = np.log(seconds)

    tr, val = split(len(seconds), key)
    coef_tr = fit_base(tr)
    base_tr = baseline.evaluate(design, coef_tr)
    resid_tr = log_t - np.log(base_tr)
    actual = seconds[val]

    validation = {"baseline": mape(base_tr[val], actual)}
    detail = {}
    to_seconds = lambda r: base_tr[val] * np.exp(r)  # noqa: E731
    mixed = _blend_of(grid, x_all[tr], resid_tr[tr], x_all[val], to_seconds, actual) if blended else None
    if mixed is not None:
        err_res, kind_res, params_res = mixed[0], BLEND, mixed[1]
    else:
        err_res, kind_res, params_res, _ = _best_tree(grid, x_all[tr], resid_tr[tr], x_all[val],
                                                      to_seconds, actual)
    validation["baseline_plus_trees"] = err_res
    detail["baseline_plus_trees"] = kind_res
    err_pure, kind_pure, _, _ = _best_tree(grid, x_all[tr], log_t[tr], x_all[val], np.exp, actual)
    validation["pure_trees"] = err_pure
    detail["pure_trees"] = kind_pure

    coef = fit_base(everything)
    if err_res < validation["baseline"]:
        chosen, params = kind_res, params_res
        validation["chosen"] = err_res
    else:
        chosen, params = "baseline", {}
        validation["chosen"] = validation["baseline"]

    forest, export_err = None, 0.0
    if chosen != "baseline":
        resid = log_t - np.log(baseline.evaluate(design, coef))
        if chosen == BLEND:
            models = [make_model(k, p).fit(x_all, resid) for k, p in sorted(params.items())]
            forest, model = blend([export(m) for m in models]), Blend(models)
        else:
            model = make_model(chosen, params).fit(x_all, resid)
            forest = export(model)
        # on every training row and on random points around the sampled box (log space)
        rng = np.random.default_rng(0)
        lo, hi = x_all.min(axis=0) - 1.0, x_all.max(axis=0) + 1.0
        random = (lo + (hi - lo) * rng.random((2000, x_all.shape[1]))).astype(np.float32)
        # a blend sums its trees' scaled leaves in float32, as XGBoost does: 1e-5 in log space
        tolerance = 1e-5 if chosen == BLEND else 1e-6
        export_err = max(check_export(forest, model, x_all, tolerance),
                         check_export(forest, model, random, tolerance))
    return FitResult(coef, chosen, dict(params), forest, varying, validation, detail, export_err)
