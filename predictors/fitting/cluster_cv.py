"""Leave one cluster out: terms fitted on one cluster's measured runs, judged on another's.

A term fitted on the runs of one cluster corrects what that cluster's prediction lacked; it is
worth shipping only if it helps on a cluster it never saw (benchmarks/endtoend.py prints both
ways). What a user acts on is the ranking of layouts (`plan`) and the time with its interval
(`check`): the figures here are those, per cluster and model.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Hashable, List, Sequence, Tuple

import numpy as np

from neox_perf.prediction.corrections import FITTED, Interval, StepTerms, unseen

from . import step_fit

MIN_LAYOUTS = 10  # a ranking is judged where one model has this many layouts under one condition


def spearman(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Spearman's rank correlation of predicted against measured time (ties averaged)."""
    from scipy.stats import spearmanr
    return float(spearmanr(predicted, measured)[0])


def regret(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Measured time of the layout predicted fastest over the fastest measured: what following
    the prediction costs (1.0: it picked the best)."""
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    return float(m[int(np.argmin(p))] / np.min(m))


@dataclass(frozen=True)
class Ranking:
    group: Hashable  # (model, condition): runs that may be compared with each other
    layouts: int
    spearman: float
    regret: float


def rankings(groups: Sequence[Hashable], predicted: Sequence[float], measured: Sequence[float],
             min_layouts: int = MIN_LAYOUTS) -> List[Ranking]:
    """Per group with at least ``min_layouts`` runs: how well the prediction ranks them."""
    by: Dict[Hashable, List[int]] = {}
    for i, g in enumerate(groups):
        by.setdefault(g, []).append(i)
    out = []
    for g in sorted(by, key=str):
        idx = by[g]
        if len(idx) < min_layouts:
            continue
        p = [predicted[i] for i in idx]
        m = [measured[i] for i in idx]
        out.append(Ranking(g, len(idx), spearman(p, m), regret(p, m)))
    return out


def timing_noise(pairs: Sequence[Tuple[float, float]]) -> float:
    """One timing's spread (sigma of log seconds) from layouts timed twice under one condition:
    the root mean square of log(a / b) over the pairs, over sqrt 2 (each holds two timings). A
    pair with the very same seconds is one timing quoted twice, not two, and is left out."""
    logs = [np.log(a / b) for a, b in pairs if a > 0 and b > 0 and a != b]
    if not logs:
        raise ValueError("no layout timed twice: the timing noise is unknown")
    return float(np.sqrt(np.mean(np.square(logs))) / np.sqrt(2.0))


def rank_ceiling(measured: Sequence[float], sigma: float, draws: int = 4000,
                 seed: int = 0) -> Dict[str, float]:
    """What a perfect prediction's Spearman is when judged against timings with a spread of
    ``sigma`` each: the measured times stand for the truth, each drawn again x exp(sigma z),
    and ranked against the draw. Median and 10th percentile over ``draws``: a group whose data
    cannot show 0.8 says so here."""
    from scipy.stats import rankdata
    m = np.asarray(measured, dtype=float)
    rng = np.random.default_rng(seed)
    noisy = m[None, :] * np.exp(sigma * rng.standard_normal((draws, m.size)))
    ra = rankdata(m)
    rb = rankdata(noisy, axis=1)
    ra, rb = ra - ra.mean(), rb - rb.mean(axis=1, keepdims=True)
    rho = (rb @ ra) / (np.sqrt((rb ** 2).sum(axis=1)) * np.sqrt((ra ** 2).sum()))
    return {"median": float(np.median(rho)), "p10": float(np.percentile(rho, 10)),
            "sigma": float(sigma), "draws": int(draws)}


def without_each(terms: StepTerms, names: Sequence[str] = FITTED) -> Dict[str, StepTerms]:
    """The terms with each fitted one set back to its neutral value (StepTerms()), by name,
    for those that are not neutral already: a term is kept only if the cluster it was not
    fitted on is predicted better with it."""
    neutral = StepTerms()
    return {n: replace(terms, **{n: getattr(neutral, n)}) for n in names
            if getattr(terms, n) != getattr(neutral, n)}


def symmetric_interval(measured: np.ndarray, predicted: np.ndarray, shares: np.ndarray,
                       coverage: float = 0.8) -> Dict[str, float]:
    """The 80% interval of a cluster nothing was fitted on: x exp(-q) .. x exp(q), q the 80th
    percentile of |log measured / predicted| over the runs of clusters predicted by terms
    fitted elsewhere (step_fit.interval_from_residuals, symmetric)."""
    return step_fit.interval_from_residuals(measured, predicted, shares, coverage, symmetric=True)


def covered(measured: np.ndarray, predicted: np.ndarray, shares: np.ndarray,
            interval: Dict[str, float], spread=None) -> float:
    """Share (%) of runs inside ``interval`` (corrections.Interval's dict) around each prediction;
    ``spread``: per run, the (down, up) arrays of the unseen terms (step_fit.spread_all) that
    widen it as a profile's does (corrections.unseen.widened)."""
    return 100.0 * float(np.mean(_inside(measured, predicted, shares, interval, spread)[0])) \
        if len(measured) else float("nan")


def median_width(measured: np.ndarray, predicted: np.ndarray, shares: np.ndarray,
                 interval: Dict[str, float], spread=None) -> Tuple[float, float]:
    """The median of each run's interval ends, as ratios to its prediction (lo, hi)."""
    _, lo, hi = _inside(measured, predicted, shares, interval, spread)
    return float(np.median(lo)), float(np.median(hi))


def _inside(measured, predicted, shares, interval, spread):
    iv = Interval.from_dict(interval)
    inside, los, his = [], [], []
    for i, (m, p, s) in enumerate(zip(measured, predicted, shares)):
        lo, hi = iv.around(p, s)
        if spread is not None:
            lo, hi = unseen.widened((lo, hi), (spread[0][i], spread[1][i]))
        inside.append(lo <= m <= hi)
        los.append(lo / p)
        his.append(hi / p)
    return np.array(inside), np.array(los), np.array(his)


def summary_line(name: str, measured: np.ndarray, predicted: np.ndarray) -> Tuple[str, Dict[str, float]]:
    s = step_fit.summary(np.asarray(measured), np.asarray(predicted))
    return (f"{name}: MAPE {s['mape']:.2f}%  mean signed {s['mean_signed']:+.2f}%  over {s['runs']} runs", s)
