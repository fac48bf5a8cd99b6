"""Fit the step terms (neox_perf/prediction/corrections/step.py) on measured end-to-end runs.

An iteration is a max-plus composition (the 1F1B timeline) of stage costs that are linear in
most step terms, so around any point it is nearly linear in them: T(theta) = c0 + F . theta,
exact for the additive terms as long as the critical path does not move; the host queue
(its max, and the p-norm of queue_coupling) bends it. Each run's F and c0 come from the real
prediction path (finite differences of `estimate`), the terms from bounded robust (soft-L1)
least squares on the relative error; each step is checked on the real path (halved while it
raises the real loss) and the linearisation refreshed there until it settles.
Cross-validation is by layout: the terms predicting a (tp, dp, pp) class are fitted on the
other classes only, and the held-out runs are predicted through the real (nonlinear) path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from neox_perf.prediction.estimate import estimate
from neox_perf.prediction.operators import decompose, stage_shapes
from neox_perf.prediction.corrections import FITTED, StepTerms, unseen

from .. import achievable

# Physical bounds: no gap is negative, and no scale is below 1. An operator is at its best in a
# warmed-up isolated benchmark: nothing in a real step makes a kernel faster. A dev set whose
# GPUs run the sampled kernels faster than the samples' GPUs would fit scales below 1 (vTrain's
# does: 0.91 for compute), but that is a property of those machines, not of a real step, and
# carried through the bundled profiles it would predict every cluster they describe faster than
# its own samples -- the direction that under-provisions. The upper bounds keep a degenerate
# fold in check.
BOUNDS = {"compute_scale": (1.0, 2.0), "memory_scale": (1.0, 3.0), "dispatch_s": (0.0, 5e-4),
          "p2p_s": (0.0, 2e-2), "micro_batch_s": (0.0, 0.05),
          "pipeline_micro_batch_s": (0.0, 0.05),
          "step_s": (0.0, 0.5), "queue_coupling": (0.0, 1.0), "dp_fabric_per_doubling": (0.0, 3.0)}
_STEP = {"compute_scale": 0.01, "memory_scale": 0.01, "dispatch_s": 1e-6,
         "p2p_s": 1e-5, "micro_batch_s": 1e-5, "pipeline_micro_batch_s": 1e-5, "step_s": 1e-5,
         "queue_coupling": 0.01, "dp_fabric_per_doubling": 0.01}


@dataclass(frozen=True)
class Case:
    """One measured run ready to predict: its decomposition and measured seconds."""

    key: Hashable  # what cross-validation groups by (e.g. the (tp, dp, pp) layout)
    decomposition: object
    measured: float
    label: str = ""
    # the cluster the run was measured on, when it is not the one the caller passes (one fit
    # over several development sets: single-node runs and multi-node runs on other nodes)
    profile: object = None


def prepare(runs, build: Callable, key: Callable = lambda r: r.layout, profile=None,
            pipe_sends_mask: bool = True) -> List[Case]:
    """Cases from runs; ``build(run) -> (cfg, derived)`` reads each as a NeoX config; runs of
    another framework say what differs (operators.decompose: pipe_sends_mask)."""
    cases = []
    for run in runs:
        cfg, derived = build(run)
        decomp = decompose(cfg, derived.padded_vocab, stage_shapes(derived), pipe_sends_mask=pipe_sends_mask)
        cases.append(Case(key(run), decomp, float(run.seconds), str(run), profile))
    return cases


def predict_all(cases: Sequence[Case], profile, terms: StepTerms) -> np.ndarray:
    """Each case as predict.predict times it, on the cluster it ran on: the same precision
    rescale and achievable-rate cap on the profile's GPU (achievable.limits), with trial step
    terms."""
    out = []
    for c in cases:
        prof = c.profile or profile
        limits = achievable.limits(prof, c.decomposition.precision)
        out.append(estimate(c.decomposition, prof, terms, limits=limits).iteration_seconds)
    return np.array(out)


def linearise(cases: Sequence[Case], profile, terms: StepTerms,
              names: Sequence[str] = FITTED) -> Tuple[np.ndarray, np.ndarray]:
    """(F, c0) with predicted seconds ~= c0 + F @ theta around ``terms``."""
    base = predict_all(cases, profile, terms)
    theta = np.array([getattr(terms, n) for n in names])
    cols = []
    for n in names:
        h = _STEP[n]
        cols.append((predict_all(cases, profile, replace(terms, **{n: getattr(terms, n) + h})) - base) / h)
    F = np.stack(cols, axis=1)
    return F, base - F @ theta


# The fit weighs each run's relative error with a soft-L1 loss: quadratic up to ROBUST_SCALE,
# linear beyond. The benchmark judges by mean absolute percentage error, and a few layouts sit
# 30% off for reasons no term here names (e.g. vTrain's tp 4, hidden 2048 runs at micro-batch 2
# are faster than at micro-batch 1); squared error would let them pull every term.
ROBUST_SCALE = 0.05


# What a term's size is, physically, before any run is seen: the prior each fit stands on. A
# set of runs that cannot tell two terms apart (a hundred layouts of one 180B model class:
# BLOOM's layout search) would otherwise put the whole difference on whichever term bends
# furthest -- a memory-bound scale of 1.9 that then predicts small models 65% slow. Each
# term's deviation from its centre (PRIOR_CENTER, below) by PRIOR_SD costs what one run off by
# ROBUST_SCALE does: little against the 1,486 vTrain runs (no term of their fit moved by more
# than 3.5%: p2p 0.284 -> 0.274 ms), decisive where the runs say nothing. Magnitudes: an
# operator's in-situ slowdown of 10% (compute) or 20% (memory-bound); a framework call's host
# cost within 20 us of its measured value (below); a pipeline handshake or a micro-batch's engine
# work 1-2 ms; a step's bookkeeping 20 ms; a queue coupling of 0.2. Nothing before a run says
# how much a loaded fabric loses against a link model: its prior spans the term's whole bound
# (sd 2 doublings' time; at 0.5 the 175B runs alone, which spend little of their step in the
# data-parallel all-reduce, could not hold it up, and the cross-validation of the 3.6B model
# went from 5.20% to 6.82%).
# Where each prior is centred: every term at its neutral value (StepTerms(): no cost, no
# slowdown) but the host's time per framework call, which is never 0. It is measured, with no
# GPU run, on GPT-NeoX's own train.py at a size where every kernel takes microseconds:
# `python benchmarks/host_cost.py --rounds 6` (2026-12-04, load average 0.9): 57.8 us a call,
# the median of six rounds (51.7 .. 86.9), from 2.5 ms a checkpointed layer of 44 calls. About
# 42 us of it is the host's own path (`--size 16,2,8` and `8,1,4`: 41.3 and 42.6 us), the rest the
# CPU running the tiny kernels, where a GPU host spends 5-20 us a launch instead; and a cluster's
# host is another CPU (docs/cross-cluster.md), so PRIOR_SD's 20 us stays the width.
# A cluster whose runs see the host (vTrain's small models: 78 us) moves it; one that cannot
# (Jean Zay's 180B models) keeps this measurement instead of a host that costs nothing.
HOST_CALL_S = 5.78e-5
PRIOR_CENTER = StepTerms(dispatch_s=HOST_CALL_S)
PRIOR_SD = {"compute_scale": 0.1, "memory_scale": 0.2, "dispatch_s": 2e-5,
            "p2p_s": 1e-3, "micro_batch_s": 2e-3, "pipeline_micro_batch_s": 2e-3, "step_s": 2e-2,
            "queue_coupling": 0.2, "dp_fabric_per_doubling": 2.0}
PRIOR_RUNS = 1.0


def _prior_rows(names: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
    """One row per term: its deviation from its prior's centre (PRIOR_CENTER) in units of
    PRIOR_SD, weighted as PRIOR_RUNS runs."""
    center = PRIOR_CENTER
    scale = np.sqrt(PRIOR_RUNS) * ROBUST_SCALE
    A = np.diag([scale / PRIOR_SD[n] for n in names])
    b = np.array([scale * getattr(center, n) / PRIOR_SD[n] for n in names])
    return A, b


def prior_cost(terms: StepTerms, names: Sequence[str] = FITTED) -> float:
    """The prior's part of the loss at ``terms`` (what solve() adds to the runs' squared part)."""
    A, b = _prior_rows(names)
    r = A @ np.array([getattr(terms, n) for n in names]) - b
    return float(np.sum(r ** 2))


def runs_share(F: np.ndarray, measured: np.ndarray, names: Sequence[str] = FITTED) -> Dict[str, float]:
    """Per term, how much of what the fit knows about it comes from the runs rather than its
    prior: 1 - its variance under runs and prior together / its variance under the prior
    alone, both from the loss solve() minimises near its minimum (the quadratic part of the
    soft-L1 loss, every run at full weight; collinear terms share what the runs say about
    them). Near 1: the runs pin the term. Near 0: the runs cannot see it, and the fit returns
    its prior's centre (PRIOR_CENTER) -- not a measurement of the cluster, which a cluster whose runs
    do see the term will contradict (e.g. a per-launch host cost the BLOOM layout search's
    180B models, never host-bound, cannot show). ``F``: linearise()'s, at the fitted terms."""
    variance, prior_precision = _posterior_variance(F, measured, names)
    share = 1.0 - variance * prior_precision
    return {n: float(min(1.0, max(0.0, v))) for n, v in zip(names, share)}


def _posterior_variance(F: np.ndarray, measured: np.ndarray,
                        names: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
    """Per term, its variance under runs and prior together (the quadratic part of solve()'s
    loss near its minimum, in the loss's units) and its prior's precision in the same units:
    what runs_share and posterior_sd both read."""
    A = F / measured[:, None]
    PA, _ = _prior_rows(names)
    prior_precision = np.diag(PA) ** 2
    return np.diag(np.linalg.inv(A.T @ A + np.diag(prior_precision))), prior_precision


# a term whose runs' share of what the fit knows about it (runs_share) is below this is one the
# runs could not see: its value is the prior's, and the interval spans its prior (unseen_terms)
UNSEEN = 0.5


def posterior_sd(F: np.ndarray, measured: np.ndarray, names: Sequence[str] = FITTED) -> Dict[str, float]:
    """Per term, its standard deviation after the fit, in the term's own units: the posterior of
    the quadratic part of the loss near its minimum, the runs' relative error at ROBUST_SCALE
    (the scale the prior is stated in: a term the runs cannot see keeps its PRIOR_SD).
    ``F``: linearise()'s, at the fitted terms."""
    variance, _ = _posterior_variance(F, measured, names)
    return {n: float(ROBUST_SCALE * math.sqrt(max(0.0, v))) for n, v in zip(names, variance)}


def unseen_terms(F: np.ndarray, measured: np.ndarray, names: Sequence[str] = FITTED) -> Dict[str, float]:
    """The terms the runs could not see (runs_share under UNSEEN), with their posterior_sd: what
    the manifest's step_terms.unseen_terms carries, and the interval spans
    (corrections.unseen, estimate.span_unseen)."""
    share, sd = runs_share(F, measured, names), posterior_sd(F, measured, names)
    return {n: sd[n] for n in names if share[n] < UNSEEN}


def spread_all(cases: Sequence[Case], profile, terms: StepTerms, unseen_sd: Dict[str, float],
               predicted: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Per case, the (down, up) relative spread of its prediction under ``terms`` that the
    unseen terms (unseen_terms()) give at either end of their range: what
    estimate.span_unseen widens a profile's interval by, for a whole set of runs."""
    priced = [(predict_all(cases, profile, lo), predict_all(cases, profile, hi))
              for _, lo, hi in unseen.ends(terms, unseen_sd)]
    down, up = np.zeros(len(cases)), np.zeros(len(cases))
    for i, p in enumerate(predicted):
        down[i], up[i] = unseen.spread(float(p), [(a[i], b[i]) for a, b in priced])
    return down, up


def solve(F: np.ndarray, c0: np.ndarray, measured: np.ndarray,
          names: Sequence[str] = FITTED, rounds: int = 50, prior: bool = True) -> np.ndarray:
    """Bounded robust least squares on the relative error (c0 + F theta) / measured - 1, by
    iteratively reweighted bounded least squares: each run weighs 1 / sqrt(1 + (r / scale)^2),
    the soft-L1 weight at its current residual r; the prior (PRIOR_SD) adds one row per term.
    The loss is convex, so the reweighting converges to its one minimum from any start."""
    from scipy.optimize import lsq_linear
    A = F / measured[:, None]
    b = 1.0 - c0 / measured
    PA, Pb = _prior_rows(names) if prior else (np.zeros((0, len(names))), np.zeros(0))
    lo = np.array([BOUNDS[n][0] for n in names])
    hi = np.array([BOUNDS[n][1] for n in names])
    w = np.ones(len(b))
    theta = None
    for _ in range(rounds):
        sw = np.sqrt(w)[:, None]
        # bvls can land a hair outside its bounds
        new = np.clip(lsq_linear(np.vstack([A * sw, PA]), np.concatenate([b * sw[:, 0], Pb]),
                                 bounds=(lo, hi), method="bvls").x, lo, hi)
        if theta is not None and np.allclose(new, theta, rtol=1e-6, atol=1e-12):
            return new
        theta = new
        r = A @ theta - b
        w = 1.0 / np.sqrt(1.0 + (r / ROBUST_SCALE) ** 2)
    return theta


# The host's issue time has no slope at dispatch_s = 0 (no run of calls is host-bound there),
# nor in queue_coupling at 0 (the plain max), so a fit started there would never move them.
START = StepTerms(dispatch_s=3e-5, queue_coupling=0.1)


def loss(measured: np.ndarray, predicted: np.ndarray) -> float:
    """The soft-L1 loss solve() minimises, on the real (nonlinear) predictions."""
    r = predicted / measured - 1.0
    return float(np.sum(2 * ROBUST_SCALE ** 2 * (np.sqrt(1 + (r / ROBUST_SCALE) ** 2) - 1)))


def fit(cases: Sequence[Case], profile, rounds: int = 12, start: StepTerms = START) -> StepTerms:
    """Gauss-Newton on the linearised path, each step checked on the real one: a step that
    raises the real loss (the max-plus timeline or the host queue bent away from the
    linearisation) is halved until it does not."""
    terms = start
    measured = np.array([c.measured for c in cases])
    current = loss(measured, predict_all(cases, profile, terms)) + prior_cost(terms)
    for _ in range(rounds):
        F, c0 = linearise(cases, profile, terms)
        target = solve(F, c0, measured)
        here = np.array([getattr(terms, n) for n in FITTED])
        for _halving in range(6):
            new = StepTerms(**dict(zip(FITTED, map(float, target))))
            got = loss(measured, predict_all(cases, profile, new)) + prior_cost(new)
            if got <= current:
                break
            target = here + 0.5 * (target - here)
        else:
            return terms  # no step along the linearised direction helps: a minimum
        done = all(math.isclose(getattr(new, n), getattr(terms, n), rel_tol=1e-3, abs_tol=1e-9)
                   for n in FITTED)
        terms, current = new, got
        if done:
            break
    return terms


def refit(cases: Sequence[Case], profile, base: StepTerms, names: Sequence[str],
          rounds: int = 3) -> StepTerms:
    """Refit only ``names`` on a user's own runs (a hooked run gives one or a few cases), the
    other terms held at ``base``: a handful of runs cannot pin every term, but they can pin
    what their own machine adds per micro-batch or per operator."""
    unknown = set(names) - set(FITTED)
    if unknown:
        raise ValueError(f"unknown step terms {', '.join(sorted(unknown))}")
    measured = np.array([c.measured for c in cases])
    terms = base
    for _ in range(rounds):
        F, c0 = linearise(cases, profile, terms)
        idx = [FITTED.index(n) for n in names]
        fixed = np.array([getattr(terms, n) for n in FITTED])
        rest = c0 + F @ fixed - F[:, idx] @ fixed[idx]
        # a refit names the few terms its runs identify (what the user's machine adds per
        # micro-batch or per operator): no prior pulls them toward a neutral machine
        theta = solve(F[:, idx], rest, measured, names, prior=False)
        new = replace(terms, **{n: float(v) for n, v in zip(names, theta)})
        if new == terms:
            break
        terms = new
    return terms


@dataclass(frozen=True)
class CrossValidation:
    predicted: np.ndarray  # each case predicted with terms fitted without its group
    terms: Dict[Hashable, StepTerms]  # per held-out group


def cross_validate(cases: Sequence[Case], profile, at: StepTerms,
                   groups: Optional[Sequence[Sequence[Hashable]]] = None,
                   linearisation: Optional[Tuple[np.ndarray, np.ndarray]] = None) -> CrossValidation:
    """Leave-one-group-out (or the given folds of group keys): every case is predicted with
    terms fitted on the other groups' cases only. The linearisation around ``at`` (usually the
    terms fitted on everything) is shared by the folds -- it describes the prediction path, not
    the data; the held-out predictions go through the real prediction path."""
    keys = sorted({c.key for c in cases}, key=str)
    folds = [list(g) for g in groups] if groups is not None else [[k] for k in keys]
    measured = np.array([c.measured for c in cases])
    F, c0 = linearisation if linearisation is not None else linearise(cases, profile, at)
    predicted = np.full(len(cases), np.nan)
    per_group: Dict[Hashable, StepTerms] = {}
    for fold in folds:
        held = np.array([c.key in fold for c in cases])
        if held.all() or not held.any():
            continue
        theta = solve(F[~held], c0[~held], measured[~held])
        fold_terms = StepTerms(**dict(zip(FITTED, map(float, theta))))
        held_cases = [c for c, h in zip(cases, held) if h]
        predicted[held] = predict_all(held_cases, profile, fold_terms)
        for k in fold:
            per_group[k] = fold_terms
    return CrossValidation(predicted, per_group)


def interval_from_residuals(measured: np.ndarray, predicted: np.ndarray,
                            extrapolated_share: Optional[np.ndarray] = None,
                            coverage: float = 0.8, symmetric: bool = False) -> Dict[str, float]:
    """The central ``coverage`` interval of measured/predicted, as ratios (lo <= 1 <= hi), and
    how much wider predictions that extrapolate need to be to keep that coverage.

    symmetric: the interval x exp(-q) .. x exp(q), q the ``coverage`` quantile of |log ratio|.
    For residuals of a cluster no term was fitted on, whose sign says which cluster was slower,
    not which way the next one will be: the next cluster may sit on either side."""
    ratio = measured / predicted
    tail = (1.0 - coverage) / 2
    if symmetric:
        q = float(np.quantile(np.abs(np.log(ratio)), coverage))
        lo, hi = float(np.exp(-q)), float(np.exp(q))
    else:
        lo = float(min(1.0, np.quantile(ratio, tail)))
        hi = float(max(1.0, np.quantile(ratio, 1.0 - tail)))
    widen = 0.0
    if extrapolated_share is not None and np.any(extrapolated_share > 0):
        # the smallest widening per unit share under which the runs that extrapolate most are
        # covered as often as the interval promises
        heavy = extrapolated_share >= np.quantile(extrapolated_share, 0.75)
        for w in np.linspace(0.0, 2.0, 201):
            span = 1.0 + w * extrapolated_share[heavy]
            inside = (ratio[heavy] >= lo / span) & (ratio[heavy] <= hi * span)
            if inside.mean() >= coverage:
                widen = float(w)
                break
        else:
            widen = 2.0
    return {"lo_ratio": lo, "hi_ratio": hi, "widen_per_extrapolated": widen}


def summary(measured: np.ndarray, predicted: np.ndarray) -> Dict[str, float]:
    err = predicted / measured - 1.0
    i = int(np.argmax(np.abs(err)))
    return {"mape": float(np.mean(np.abs(err))) * 100, "mean_signed": float(np.mean(err)) * 100,
            "worst": float(err[i]) * 100, "worst_index": i, "runs": int(len(err))}
