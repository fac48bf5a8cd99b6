"""Evaluating exported tree ensembles with numpy alone.

Layout of one ensemble (all arrays are slices of the profile's .npz, indices local to it):
  feature[i]   int8    feature tested at node i (0 at leaves)
  threshold[i] float32 go to the left child i+1 when x <= threshold[i]; -inf at leaves
  right[i]     int32   right child of node i; a leaf points to itself
  value[i]     float64 leaf value (0 at internal nodes; exact float32 values for XGBoost)
  roots[t]     int32   root node of tree t
Trees are stored in depth-first pre-order, so a left child always follows its parent.
Inputs are cast to float32 first, as scikit-learn and XGBoost do; thresholds were rounded at
export so that `x32 <= threshold` takes exactly the branch the library takes (sklearn tests
x <= t64, XGBoost x < t32). A leaf's -inf threshold with right = self makes further steps
stay on the leaf, so every tree runs the same number of steps (the ensemble's depth).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


# Every size feature is >= 1; a flag (flash attention's `causal`) may be 0, whose log would be
# -inf. It enters at this floor instead: below every size, apart from 1, and the same in
# training and prediction.
FLAG_FLOOR = 0.5


def log_features(columns) -> np.ndarray:
    """The trees' input: natural log of each feature (a 0 flag at FLAG_FLOOR), float64 then
    float32 (training does the same)."""
    x = np.column_stack([np.asarray(c, dtype=np.float64).ravel() for c in columns])
    return np.log(np.maximum(x, FLAG_FLOOR)).astype(np.float32)


@dataclass(frozen=True)
class Forest:
    feature: np.ndarray
    threshold: np.ndarray
    right: np.ndarray
    value: np.ndarray
    roots: np.ndarray
    depth: int
    combine: str  # "mean" (random forest) or "sum" (boosting)
    base: float  # added after combining (XGBoost base_score; 0 for forests)

    def __post_init__(self):
        if self.combine not in ("mean", "sum"):
            raise ValueError(f"unknown combine {self.combine!r}")
        # native-width indices make take() several times faster than int8/int32 ones
        object.__setattr__(self, "_index", (self.feature.astype(np.intp), self.right.astype(np.intp),
                                            self.roots.astype(np.intp)))

    @property
    def n_nodes(self) -> int:
        return int(self.feature.shape[0])

    def leaves(self, x32: np.ndarray) -> np.ndarray:
        """Leaf node per (tree, sample) for float32 inputs of shape (samples, features)."""
        n = x32.shape[0]
        nodes = np.repeat(self.roots[:, None], n, axis=1)
        cols = np.arange(n)[None, :]
        xt = x32.T
        for _ in range(self.depth):
            go_left = xt[self.feature[nodes], cols] <= self.threshold[nodes]
            nodes = np.where(go_left, nodes + 1, self.right[nodes])
        return nodes

    def predict_one(self, row32: np.ndarray) -> float:
        """predict() for a single float32 feature vector, with less numpy overhead."""
        feature, right, nodes = self._index
        threshold = self.threshold
        for _ in range(self.depth):
            nodes = np.where(row32.take(feature.take(nodes)) <= threshold.take(nodes), nodes + 1,
                             right.take(nodes))
        values = self.value.take(nodes)
        if self.combine == "mean":
            return float(values.sum()) / len(values) + self.base
        acc = np.empty(len(values) + 1, dtype=np.float32)
        acc[0] = self.base
        acc[1:] = values
        return float(np.add.accumulate(acc)[-1])

    def predict(self, x32: np.ndarray) -> np.ndarray:
        x32 = np.asarray(x32, dtype=np.float32)
        if x32.ndim == 1:
            x32 = x32[None, :]
        values = self.value[self.leaves(x32)]
        if self.combine == "mean":
            # sklearn adds the trees' float64 predictions one by one, then divides
            return values.sum(axis=0) / len(self.roots) + self.base
        # XGBoost accumulates float32 leaf values tree by tree onto base_score; a float32
        # cumulative sum in the same order reproduces it bit for bit
        start = np.full((1, values.shape[1]), self.base, dtype=np.float32)
        acc = np.cumsum(np.vstack([start, values.astype(np.float32)]), axis=0, dtype=np.float32)
        return acc[-1].astype(np.float64)


def round_down_float32(t: np.ndarray) -> np.ndarray:
    """Largest float32 <= t, elementwise (so x32 <= result  <=>  x32 <= t)."""
    t = np.asarray(t, dtype=np.float64)
    t32 = t.astype(np.float32)
    too_big = t32.astype(np.float64) > t
    t32[too_big] = np.nextafter(t32[too_big], np.float32(-np.inf))
    return t32
