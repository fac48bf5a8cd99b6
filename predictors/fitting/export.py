"""Turning fitted scikit-learn forests and XGBoost boosters into flat numpy arrays.

Nothing here imports scikit-learn or XGBoost: the fitted objects are read through their
public attributes (`estimators_[i].tree_`, `Booster.save_raw("json")`). The result is a
`Forest` (see forest.py) and `check_export` proves it reproduces the library's `predict`.
"""
from __future__ import annotations

import json
from typing import Dict, List, Tuple

import numpy as np

from ..forest import Forest, round_down_float32

_Tree = Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # left, right, feat, thr32, value


def _preorder(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Node ids in depth-first pre-order (left before right)."""
    order, stack = [], [0]
    while stack:
        node = stack.pop()
        order.append(node)
        if left[node] >= 0:
            stack.append(int(right[node]))
            stack.append(int(left[node]))
    return np.asarray(order, dtype=np.int64)


def _depth(left: np.ndarray, right: np.ndarray) -> int:
    depth = np.zeros(len(left), dtype=np.int64)
    for node in _preorder(left, right):
        if left[node] >= 0:
            depth[left[node]] = depth[right[node]] = depth[node] + 1
    return int(depth.max())


def _pack(trees: List[_Tree]) -> Tuple[Dict[str, np.ndarray], int]:
    feats, thrs, rights, values, roots = [], [], [], [], []
    offset, depth = 0, 0
    for left, right, feat, thr32, value in trees:
        order = _preorder(left, right)
        new_id = np.empty(len(left), dtype=np.int64)
        new_id[order] = np.arange(len(order)) + offset
        leaf = left[order] < 0
        if np.any(~leaf & (new_id[left[order].clip(0)] != new_id[order] + 1)):
            raise AssertionError("pre-order layout broke the left-child rule")
        feats.append(np.where(leaf, 0, feat[order]))
        thrs.append(np.where(leaf, np.float32(-np.inf), thr32[order]).astype(np.float32))
        rights.append(np.where(leaf, new_id[order], new_id[right[order].clip(0)]))
        values.append(np.where(leaf, value[order], 0.0))
        roots.append(offset)
        depth = max(depth, _depth(left, right))
        offset += len(order)
    arrays = {
        "feature": np.concatenate(feats).astype(np.int8),
        "threshold": np.concatenate(thrs).astype(np.float32),
        "right": np.concatenate(rights).astype(np.int32),
        "value": np.concatenate(values).astype(np.float64),
        "roots": np.asarray(roots, dtype=np.int32),
    }
    return arrays, depth


def from_sklearn_forest(model) -> Forest:
    """RandomForestRegressor (or any bagged sklearn tree regressor): mean of the trees."""
    trees = []
    for est in model.estimators_:
        t = est.tree_
        if t.n_outputs != 1:
            raise ValueError("only single-output trees can be exported")
        left = t.children_left.astype(np.int64)
        # sklearn goes left when x32 <= threshold (a float64 midpoint)
        trees.append((left, t.children_right.astype(np.int64), t.feature.astype(np.int64),
                      round_down_float32(t.threshold), t.value[:, 0, 0].astype(np.float64)))
    arrays, depth = _pack(trees)
    return Forest(depth=depth, combine="mean", base=0.0, **arrays)


def _xgb_base_score(learner: dict) -> float:
    raw = str(learner["learner_model_param"]["base_score"]).strip().strip("[]")
    values = [float(v) for v in raw.split(",") if v.strip()]
    if len(values) != 1:
        raise ValueError(f"expected one base_score, got {raw!r}")
    return values[0]


def from_xgboost(model) -> Forest:
    """XGBRegressor / Booster with reg:squarederror: sum of the trees plus base_score."""
    booster = model.get_booster() if hasattr(model, "get_booster") else model
    doc = json.loads(bytes(booster.save_raw("json")))
    learner = doc["learner"]
    objective = learner["objective"]["name"]
    if objective != "reg:squarederror":
        raise ValueError(f"only reg:squarederror boosters can be exported, got {objective}")
    gbm = learner["gradient_booster"]
    if gbm.get("name") != "gbtree":
        raise ValueError(f"only gbtree boosters can be exported, got {gbm.get('name')}")
    trees = []
    for tree in gbm["model"]["trees"]:
        left = np.asarray(tree["left_children"], dtype=np.int64)
        right = np.asarray(tree["right_children"], dtype=np.int64)
        cond = np.asarray(tree["split_conditions"], dtype=np.float32)
        leaf = left < 0
        # XGBoost goes left when x32 < threshold: the same as x32 <= the float32 just below
        thr = np.where(leaf, cond, np.nextafter(cond, np.float32(-np.inf))).astype(np.float32)
        # at leaves split_conditions holds the leaf value (already times the learning rate)
        value = np.where(leaf, cond.astype(np.float64), 0.0)
        trees.append((left, right, np.asarray(tree["split_indices"], dtype=np.int64), thr, value))
    arrays, depth = _pack(trees)
    return Forest(depth=depth, combine="sum", base=_xgb_base_score(learner), **arrays)


def export(model) -> Forest:
    if hasattr(model, "get_booster") or type(model).__name__ == "Booster":
        return from_xgboost(model)
    if hasattr(model, "estimators_"):
        return from_sklearn_forest(model)
    raise TypeError(f"cannot export {type(model).__name__}")


class Blend:
    """The equal-weight mean of fitted models' predictions (what `blend` exports), for check_export."""

    def __init__(self, models):
        self.models = list(models)

    def predict(self, x32: np.ndarray) -> np.ndarray:
        return np.mean([np.asarray(m.predict(x32), dtype=np.float64) for m in self.models], axis=0)


def blend(forests: List[Forest]) -> Forest:
    """One summed forest predicting the equal-weight mean of ``forests``' predictions: each
    forest's leaves scaled by its share (a mean-combined forest's also divided by its tree
    count), the bases averaged, the node arrays laid end to end."""
    share = 1.0 / len(forests)
    feats, thrs, rights, values, roots = [], [], [], [], []
    offset = 0
    for f in forests:
        scale = share / len(f.roots) if f.combine == "mean" else share
        feats.append(f.feature)
        thrs.append(f.threshold)
        rights.append(f.right.astype(np.int64) + offset)
        values.append(f.value * scale)
        roots.append(f.roots.astype(np.int64) + offset)
        offset += f.n_nodes
    return Forest(feature=np.concatenate(feats).astype(np.int8),
                  threshold=np.concatenate(thrs).astype(np.float32),
                  right=np.concatenate(rights).astype(np.int32),
                  value=np.concatenate(values).astype(np.float64),
                  roots=np.concatenate(roots).astype(np.int32),
                  depth=max(f.depth for f in forests), combine="sum",
                  base=float(share * sum(f.base for f in forests)))


def max_relative_error(forest: Forest, model, x32: np.ndarray) -> float:
    """Largest |numpy - library| / max(|library|, 1) over the rows of x32.

    The ensembles predict log residuals, often near 0, so the error is taken relative to
    max(|y|, 1): below 1 it is the absolute error in log space, i.e. the relative error of
    the multiplicative correction exp(y) that is finally applied.
    """
    ours = forest.predict(x32)
    theirs = np.asarray(model.predict(x32), dtype=np.float64)
    return float(np.max(np.abs(ours - theirs) / np.maximum(np.abs(theirs), 1.0)))


def check_export(forest: Forest, model, x32: np.ndarray, tolerance: float = 1e-6) -> float:
    err = max_relative_error(forest, model, x32)
    if not err <= tolerance:
        raise AssertionError(f"exported {type(model).__name__} differs from its predict by {err:.3g}")
    return err
