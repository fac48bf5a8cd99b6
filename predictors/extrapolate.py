"""Past the sampled range: the roofline baseline times an efficiency curve fitted on size.

Inside the sampled box an operator is baseline x exp(tree residual). A tree is constant past
its last split, so outside the box it would carry the edge sample's efficiency forever; the
local profiles (a few hundred small CPU samples) are used far outside their box (LM heads at
m in the thousands, 50k-256k vocabularies), where that over-predicts. Here the residual
log(t / baseline) is instead fitted, per op and phase, as

    rho(x) = c + sum_j a_j * log(1 + h_j / x_j)

over the size features x_j: each term is a power law x_j^-a_j well below h_j and fades to 0
well above it, so the efficiency relative to the baseline rises (a_j > 0, GEMMs filling the
core) or falls (a_j < 0, a working set leaving the cache) with size and then saturates,
instead of holding the largest or the smallest sample's value forever. h_j is chosen
among sampled sizes (never above the largest), so the curve is already flattening where the
samples end; |a_j| <= 1 keeps the time monotone in a size the baseline is linear in.

Beyond the box the prediction is baseline(x) x exp(rho(x) + w * delta), delta being what
the trees add to the curve at the nearest sampled point: continuous at the box's face, and
faded to the pure curve by w = 1 - distance / log(4) (a factor of 4 past the range), the
trees correcting only where they saw data. Evaluation is numpy only (the `check` path).
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

MARKER = "efficiency-curve"  # manifest["extrapolation"] of profiles that use this
FADE = math.log(4.0)
MAX_SLOPE = 1.0
_CANDIDATES = 8
KNEE_MAX = 1.0  # knees h_j up to this fraction of the sampled log-span


class Curve:
    """One op/phase's fitted efficiency curve (the manifest entry's "efficiency")."""

    def __init__(self, features: Sequence[str], intercept: float, terms: Mapping[str, Sequence[float]]):
        self.features = tuple(features)
        self.intercept = float(intercept)
        # feature -> (a, h)
        self.terms = {str(k): (float(v[0]), float(v[1])) for k, v in terms.items()}

    @classmethod
    def from_entry(cls, features: Sequence[str], entry: Mapping) -> "Curve":
        return cls(features, entry["intercept"], entry["terms"])

    def to_entry(self) -> dict:
        return {"form": "c + sum a*log(1 + h/x)", "intercept": self.intercept,
                "terms": {k: [a, h] for k, (a, h) in self.terms.items()}}

    def log_ratio(self, columns: Mapping[str, np.ndarray]) -> np.ndarray:
        out = np.full(len(next(iter(columns.values()))), self.intercept)
        for name, (a, h) in self.terms.items():
            out = out + a * np.log1p(h / np.maximum(np.asarray(columns[name], dtype=float), 1e-300))
        return out


def _design(columns: Mapping[str, np.ndarray], chosen: Mapping[str, float]) -> np.ndarray:
    n = len(next(iter(columns.values())))
    cols = [np.ones(n)] + [np.log1p(h / columns[name]) for name, h in chosen.items()]
    return np.column_stack(cols)


def _solve(x: np.ndarray, y: np.ndarray, w: np.ndarray):
    sw = np.sqrt(w)
    coef, *_ = np.linalg.lstsq(x * sw[:, None], y * sw, rcond=None)
    if len(coef) > 1 and np.any(np.abs(coef[1:]) > MAX_SLOPE):
        # clip the slopes and refit the intercept alone: a bounded, still least-squares answer
        coef = coef.copy()
        coef[1:] = np.clip(coef[1:], -MAX_SLOPE, MAX_SLOPE)
        coef[0] = float(np.average(y - x[:, 1:] @ coef[1:], weights=w))
    err = float(np.average((x @ coef - y) ** 2, weights=w))
    return coef, err


def _huber_weights(resid: np.ndarray) -> np.ndarray:
    """A sample timed while the machine was busy is slow, never fast: down-weight the
    outliers (beyond 1.5 x the median absolute residual, at least 5%) rather than let them
    bend the curve that every extrapolation follows."""
    scale = max(1.5 * float(np.median(np.abs(resid))), 0.05)
    a = np.abs(resid)
    return np.where(a <= scale, 1.0, scale / np.maximum(a, 1e-300))


def fit_curve(columns: Mapping[str, np.ndarray], log_ratio: np.ndarray,
              size_features: Optional[Sequence[str]] = None) -> Curve:
    """Robust least squares on log(t / baseline): (a_j, h_j) chosen feature by feature (two
    passes), then Huber weights from the residuals and the choice made again."""
    y = np.asarray(log_ratio, dtype=float)
    w = np.ones(len(y))
    curve = None
    for _ in range(3):
        curve = _fit_weighted(columns, y, size_features, w)
        w = _huber_weights(curve.log_ratio({n: np.asarray(columns[n], dtype=float)
                                            for n in curve.features}) - y)
    return curve


def _fit_weighted(columns, y, size_features, w) -> Curve:
    names = [n for n in (size_features or columns) if n != "causal"]
    cols = {n: np.asarray(columns[n], dtype=float) for n in names}
    varying = [n for n in names if len(np.unique(cols[n])) > 1 and np.all(cols[n] > 0)]
    grids: Dict[str, np.ndarray] = {}
    for n in varying:
        values = np.unique(cols[n])
        # sampled sizes from the smallest to the largest, log-spaced: h never past the samples
        top = values[0] * (values[-1] / values[0]) ** KNEE_MAX
        grids[n] = np.unique(np.exp(np.linspace(np.log(values[0]), np.log(top), _CANDIDATES)))
    chosen: Dict[str, float] = {}
    best = _solve(_design(cols, chosen) if cols else np.ones((len(y), 1)), y, w)[1]
    for _ in range(2):
        for n in varying:
            trial_best = (best, chosen.get(n))
            for h in grids[n]:
                trial = {**chosen, n: float(h)}
                _, err = _solve(_design(cols, trial), y, w)
                if err < trial_best[0] * (1 - 1e-6):
                    trial_best = (err, float(h))
            best = trial_best[0]
            if trial_best[1] is not None:
                chosen[n] = trial_best[1]
    x = _design(cols, chosen) if cols else np.ones((len(y), 1))
    coef, _ = _solve(x, y, w)
    terms = {n: (float(a), h) for (n, h), a in zip(chosen.items(), coef[1:]) if a != 0.0}
    return Curve(names, float(coef[0]), terms)


def outside_distance(columns: List[np.ndarray], lo: Sequence[float], hi: Sequence[float]) -> np.ndarray:
    """Per query: the largest |log(x / nearest sampled bound)| over the features (0 inside)."""
    dist = np.zeros(len(columns[0]))
    for c, a, b in zip(columns, lo, hi):
        c = np.asarray(c, dtype=float)
        if a <= 0 or b <= 0:
            continue
        clipped = np.clip(c, a, b)
        with np.errstate(divide="ignore", invalid="ignore"):
            d = np.where(c > 0, np.abs(np.log(np.maximum(c, 1e-300) / clipped)), 0.0)
        dist = np.maximum(dist, d)
    return dist


def clamp(columns: List[np.ndarray], lo: Sequence[float], hi: Sequence[float]) -> List[np.ndarray]:
    return [np.clip(np.asarray(c, dtype=float), a, b) for c, a, b in zip(columns, lo, hi)]


def extrapolated_log_ratio(curve: Curve, names: Sequence[str], columns: List[np.ndarray],
                           clamped_tree: np.ndarray, lo: Sequence[float], hi: Sequence[float]
                           ) -> np.ndarray:
    """log(t / baseline) for queries outside the box: the curve at x, plus the trees' offset
    from the curve at the nearest sampled point, faded out over a factor of 4."""
    at_x = curve.log_ratio(dict(zip(names, columns)))
    at_edge = curve.log_ratio(dict(zip(names, clamp(columns, lo, hi))))
    w = np.clip(1.0 - outside_distance(columns, lo, hi) / FADE, 0.0, 1.0)
    return at_x + w * (clamped_tree - at_edge)
