"""Deciding which sample rows to trust, and saying why for every row dropped.

In order, per (op, phase):
1. invalid values: non-finite / non-positive shapes or durations;
2. whole-set defects, decided from the data, not from file names:
   - a backward column identical to the forward column is a copy, not a measurement
     (res_add): backward is predicted by the forward model;
   - a backward set far faster than its forward set although it does more work (Vista
     flash attention, bwd/fwd ~ 0.11 where the FLOPs say 2.5) is rejected: backward is
     predicted by the forward model times the FLOP ratio;
3. physical bounds: a row faster than the hardware allows cannot be a measurement of that
   work (Vista all-gather 4_1 / 8_1 "117 us" rows move hundreds of MB);
3b. achievable rate: a kept operator row whose FLOP rate beats the GPU's achievable dense rate
   for the samples' precision (gpus.Rate: measured GEMM maxima, not the data sheet) measured a
   burst a long job cannot sustain: its duration is raised to FLOPs / achievable rate and the
   row counted (`capped_to_achievable` per file). The samples are the mean of the 3rd-7th
   fastest of 10 warm runs: 6-35% of the forward and 23-81% of the backward GEMM rows (linear*)
   beat the achievable rate (Perlmutter A100 up to x1.11 of 271.2 TFLOP/s, Vista GH200 up to
   x1.18 of 828.6). Prediction applies the same floor (achievable.py), so a profile trained
   before this rule is held to it as well;
4. robust outliers, two rules on r = log(measured / robust baseline):
   - gross: r more than 10x (and MAD_K MADs) from the median of its group (Vista
     firstStage_optimizer's 2-54 s rows among millisecond neighbours);
   - local: r far (MAD_K MADs and x1.5) from nearly all its nearest neighbours in
     log-feature space. A single row far from its neighbours is an outlier; a whole region
     that departs from the baseline (a kernel switch) is structure the trees must learn,
     and a global rule would wrongly delete it.
   Groups are one topology for collectives (they differ in efficiency), the whole set for
   operators.
Finally, a set where many kept rows still beat the data-sheet limits (inside the slack) gets
a note in the manifest: its samples may not measure the stated work (Vista's stage
optimizer times barely grow with the parameter count: 41% of its rows move their 40 bytes per
parameter faster than the 4 TB/s HBM, on working sets of tens of GB no cache holds). Bytes are
flagged, not capped: the byte counts are first-order (fillmask's masked_fill_ is counted as a
full read and write), so a byte rate beyond HBM can be the count's error, not the row's.
docs/achievable-rates.md states these rules for users.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import numpy as np

from neox_perf.prediction import opspec
from neox_perf.profile.facts import ClusterFacts

from .. import achievable, baseline, gpus
from .samples import COLLECTIVE_PHASE, FileRecord, TrainingSet

# FLOP counts of matmuls are exact and tensor-core peak is not exceeded in practice.
FLOP_SLACK = 1.25
# Byte counts are first-order estimates (fused kernels, caches, L2-resident inputs between
# benchmark repetitions): only rows far beyond the HBM peak are provably not measurements.
BYTE_SLACK = 4.0
# NCCL bus bandwidth cannot beat the link's line rate; 10% for rounding of nominal figures.
LINK_SLACK = 1.1
# A backward that does at least as much work as its forward but runs this much faster.
IMPLAUSIBLE_BWD_FRACTION = 0.25
# Outlier rule on log residuals: both a MAD multiple and an absolute floor (x1.5) so that
# a tight set (MAD of a few percent) does not lose its ordinary scatter.
MAD_K = 6.0
MIN_OUTLIER_LOG = float(np.log(1.5))
GROSS_OUTLIER_LOG = float(np.log(10.0))
NEIGHBOURS = 8


@dataclass
class DerivedPhase:
    """A phase predicted from another phase's model instead of its own samples."""

    op: str
    phase: str
    source_phase: str
    scale: str  # "same" or "flop_ratio"
    reason: str

    def to_dict(self) -> dict:
        return {"from_phase": self.source_phase, "scale": self.scale, "reason": self.reason}


@dataclass
class CleanResult:
    sets: Dict[Tuple[str, str], TrainingSet]
    derived: Dict[Tuple[str, str], DerivedPhase] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)


def _drop(records: List[FileRecord], ts: TrainingSet, mask: np.ndarray, reason: str) -> None:
    for idx, count in zip(*np.unique(ts.file_index[mask], return_counts=True)):
        records[idx].drop(ts.phase, reason, int(count))


def _valid(ts: TrainingSet) -> np.ndarray:
    ok = np.isfinite(ts.seconds) & (ts.seconds > 0)
    for name, col in ts.features.items():
        ok &= np.isfinite(col) & ((col >= 0) if name == "causal" else (col > 0))
    return ok


def _aligned(a: TrainingSet, b: TrainingSet) -> bool:
    return (len(a) == len(b) and np.array_equal(a.file_index, b.file_index)
            and np.array_equal(a.line, b.line))


def implied_fractions(ts: TrainingSet, facts: ClusterFacts) -> Tuple[np.ndarray, float]:
    """Per row, the rate a sample implies as a fraction of the hardware limit, and the slack
    allowed over that limit: FLOP rate vs peak (and bytes vs HBM) for operators, NCCL bus
    bandwidth vs the link for collectives. For operators the larger of FLOP/peak / FLOP_SLACK
    and bytes/HBM / BYTE_SLACK decides, so the returned fraction is scaled to a slack of 1."""
    if ts.phase == COLLECTIVE_PHASE:
        f = ts.features
        ranks = f["nodes"] * f["gpus_per_node"]
        wire = opspec.collective_wire_bytes(ts.op, f["elements"], ranks)
        link = np.where(f["nodes"] <= 1, facts.intra_node_link.bandwidth_gbps,
                        facts.inter_node_link.bandwidth_gbps) * 1e9
        return wire / ts.seconds / link, LINK_SLACK
    flops = opspec.op_flops(ts.op, ts.phase, ts.features, causal_kernel=ts.causal_kernel) / ts.seconds
    nbytes = opspec.op_bytes(ts.op, ts.phase, ts.features) / ts.seconds
    return np.maximum(flops / (FLOP_SLACK * facts.peak_fp16_tflops * 1e12),
                      nbytes / (BYTE_SLACK * facts.hbm_bandwidth_gbps * 1e9)), 1.0


def physical_violation(ts: TrainingSet, facts: ClusterFacts) -> Tuple[np.ndarray, str]:
    """(rows faster than the hardware allows, what was compared)."""
    fraction, slack = implied_fractions(ts, facts)
    if ts.phase == COLLECTIVE_PHASE:
        return fraction > slack, f"bus bandwidth above {LINK_SLACK}x the link"
    return fraction > slack, (f"faster than physically possible (> {FLOP_SLACK}x peak FLOP rate "
                              f"or > {BYTE_SLACK}x HBM bandwidth)")


def beyond_nominal(ts: TrainingSet, facts: ClusterFacts) -> np.ndarray:
    """Rows that are within the slack but beyond the plain data-sheet limit."""
    if ts.phase == COLLECTIVE_PHASE:
        return implied_fractions(ts, facts)[0] > 1.0
    nbytes = opspec.op_bytes(ts.op, ts.phase, ts.features) / ts.seconds
    flops = opspec.op_flops(ts.op, ts.phase, ts.features, causal_kernel=ts.causal_kernel) / ts.seconds
    return (nbytes > facts.hbm_bandwidth_gbps * 1e9) | (flops > facts.peak_fp16_tflops * 1e12)


def achievable_tflops(facts: ClusterFacts, precision: Optional[str] = "fp16") -> Optional[gpus.Rate]:
    """The achievable dense rate of the facts' GPU for the samples' precision, or None (a CPU
    calibration, a device the GPU table does not know, no figure for it, or precision None)."""
    gpu = achievable.gpu_of_facts(facts) if precision is not None else None
    return gpu.achievable(precision) if gpu is not None else None


def cap_to_achievable(ts: TrainingSet, facts: ClusterFacts,
                      precision: Optional[str] = "fp16") -> Tuple[TrainingSet, np.ndarray]:
    """(the set with rows beating the achievable rate raised to it, which rows were raised)."""
    rate = achievable_tflops(facts, precision)
    if rate is None or ts.phase == COLLECTIVE_PHASE or len(ts) == 0:
        return ts, np.zeros(len(ts), dtype=bool)
    floor = np.asarray(opspec.op_flops(ts.op, ts.phase, ts.features, causal_kernel=ts.causal_kernel),
                       dtype=float) / (rate.tflops * 1e12)
    over = ts.seconds < floor
    if not over.any():
        return ts, over
    return replace(ts, seconds=np.maximum(ts.seconds, floor)), over


def baseline_design(ts: TrainingSet, facts: ClusterFacts) -> np.ndarray:
    if ts.phase == COLLECTIVE_PHASE:
        f = ts.features
        return baseline.collective_design(ts.op, f["elements"], f["nodes"], f["gpus_per_node"],
                                          facts.inter_node_link.lanes)
    return baseline.roofline_design(ts.op, ts.phase, ts.features, causal_kernel=ts.causal_kernel)


def baseline_limits(ts: TrainingSet, facts: ClusterFacts):
    """(lower bounds, preference order) for baseline.fit_nonnegative: the fitted rates may not
    beat the limits that reject samples here."""
    if ts.phase == COLLECTIVE_PHASE:
        per_peer = facts.intra_node_link.bandwidth_gbps / max(facts.gpus_per_node - 1, 1)
        per_nic = facts.inter_node_link.bandwidth_gbps / max(facts.inter_node_link.lanes, 1)
        return [0.0, 0.0, 1.0 / (LINK_SLACK * per_peer * 1e9), 1.0 / (LINK_SLACK * per_nic * 1e9)], None
    return ([0.0, 1.0 / (FLOP_SLACK * facts.peak_fp16_tflops * 1e12),
             1.0 / (BYTE_SLACK * facts.hbm_bandwidth_gbps * 1e9)], baseline.ROOFLINE_PREFERENCE)


def fit_baseline(ts: TrainingSet, facts: ClusterFacts, rows=None):
    """Robust baseline coefficients for a training set (optionally only `rows` of it)."""
    design = baseline_design(ts, facts)
    lower, preference = baseline_limits(ts, facts)
    seconds = ts.seconds
    if rows is not None:
        design, seconds = design[rows], seconds[rows]
    coef, _ = baseline.fit_nonnegative(design, seconds, lower=lower, preference=preference)
    return coef


def _groups(ts: TrainingSet) -> np.ndarray:
    if ts.phase == COLLECTIVE_PHASE:
        return ts.features["nodes"] * 1000 + ts.features["gpus_per_node"]
    return np.zeros(len(ts))


def _mad_rule(values: np.ndarray, floor: float) -> np.ndarray:
    med = np.median(values)
    mad = 1.4826 * np.median(np.abs(values - med))
    return np.abs(values - med) > max(MAD_K * mad, floor)


def nearest(points: np.ndarray, k: int = NEIGHBOURS, chunk: int = 512) -> np.ndarray:
    """Indices of each point's k nearest other points (euclidean), shape (n, k)."""
    n = len(points)
    k = min(k, n - 1)
    out = np.empty((n, k), dtype=np.int64)
    for start in range(0, n, chunk):
        block = points[start:start + chunk]
        dist = ((block[:, None, :] - points[None, :, :]) ** 2).sum(-1)
        dist[np.arange(len(block)), np.arange(start, start + len(block))] = np.inf
        out[start:start + chunk] = np.argpartition(dist, k - 1, axis=1)[:, :k]
    return out


def outliers(log_resid: np.ndarray, log_features: np.ndarray, groups: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(gross, local) outlier masks; see the module docstring.

    Local: a row is an outlier when its residual is beyond the threshold from all but at
    most one of its nearest neighbours. One close neighbour agreeing is enough to keep it,
    so rows at the edge of a genuine step (a kernel switch) survive even on a coarse grid,
    while an isolated spike (or a pair of them) does not. The threshold is MAD_K MADs of
    the residual-minus-neighbourhood-median, and at least x1.5.
    """
    gross = np.zeros(len(log_resid), dtype=bool)
    local = np.zeros(len(log_resid), dtype=bool)
    for g in np.unique(groups):
        m = np.flatnonzero(groups == g)
        gross[m] = _mad_rule(log_resid[m], GROSS_OUTLIER_LOG)
        keep = m[~gross[m]]
        if len(keep) <= NEIGHBOURS:
            continue
        pts = log_features[keep]
        spread = pts.std(axis=0)
        r = log_resid[keep]
        if not np.any(spread > 0):
            local[keep] = _mad_rule(r, MIN_OUTLIER_LOG)
            continue
        nbrs = nearest(pts[:, spread > 0] / spread[spread > 0])
        e = r - np.median(r[nbrs], axis=1)
        mad = 1.4826 * np.median(np.abs(e - np.median(e)))
        threshold = max(MAD_K * mad, MIN_OUTLIER_LOG)
        gaps = np.sort(np.abs(r[:, None] - r[nbrs]), axis=1)
        local[keep] = gaps[:, 1] > threshold
    return gross, local


def clean(sets: Dict[Tuple[str, str], TrainingSet], records: List[FileRecord],
          facts: ClusterFacts, precision: Optional[str] = "fp16") -> CleanResult:
    """precision: what the operator samples were timed in (the published ones: fp16); None
    keeps every kept row's duration as measured (a benchmark's held-out truth)."""
    result = CleanResult({})
    work: Dict[Tuple[str, str], TrainingSet] = {}
    valid: Dict[Tuple[str, str], np.ndarray] = {}
    for key, ts in sets.items():
        valid[key] = _valid(ts)
        _drop(records, ts, ~valid[key], "non-finite or non-positive shape or duration")

    for key, ts in sets.items():
        op, phase = key
        if phase != "bwd" or (op, "fwd") not in sets or not _aligned(sets[(op, "fwd")], ts):
            continue
        fwd = sets[(op, "fwd")]
        both = valid[key] & valid[(op, "fwd")]
        if not np.any(both):
            continue
        if np.array_equal(fwd.seconds[both], ts.seconds[both]):
            reason = ("backward column is a copy of the forward column in the samples; "
                      "backward is predicted by the forward model")
            result.derived[key] = DerivedPhase(op, "bwd", "fwd", "same", reason)
            continue
        sub = {k: v[both] for k, v in fwd.features.items()}
        work_ratio = np.median(np.maximum(
            opspec.op_flops(op, "bwd", sub) / opspec.op_flops(op, "fwd", sub),
            opspec.op_bytes(op, "bwd", sub) / opspec.op_bytes(op, "fwd", sub)))
        measured = float(np.median(ts.seconds[both] / fwd.seconds[both]))
        if work_ratio >= 1 and measured < IMPLAUSIBLE_BWD_FRACTION * work_ratio:
            flop_ratio = float(np.median(opspec.op_flops(op, "bwd", sub) / opspec.op_flops(op, "fwd", sub)))
            reason = (f"backward/forward median time ratio {measured:.3g} although backward does "
                      f"{work_ratio:.3g}x the work: set rejected; backward = forward model x FLOP "
                      f"ratio ({flop_ratio:.3g})")
            result.derived[key] = DerivedPhase(op, "bwd", "fwd", "flop_ratio", reason)

    for key, ts in sets.items():
        if key in result.derived:
            _drop(records, ts, valid[key], "whole set not used: " + result.derived[key].reason)
            continue
        ts = ts.subset(valid[key])
        over, what = physical_violation(ts, facts)
        _drop(records, ts, over, what)
        ts = ts.subset(~over)
        ts, capped = cap_to_achievable(ts, facts, precision)
        if capped.any():
            for idx, count in zip(*np.unique(ts.file_index[capped], return_counts=True)):
                rec = records[idx]
                rec.capped[ts.phase] = rec.capped.get(ts.phase, 0) + int(count)
            rate = achievable_tflops(facts, precision)
            result.notes.append(
                f"{ts.op}/{ts.phase}: {int(capped.sum())} of {len(ts)} rows ran faster than the GPU's "
                f"achievable {precision} rate ({rate.tflops:g} TFLOP/s, docs/achievable-rates.md): "
                f"their durations were raised to it (a burst a long job cannot sustain)")
        if len(ts) < 8:
            work[key] = ts
            continue
        pred = baseline.evaluate(baseline_design(ts, facts), fit_baseline(ts, facts))
        resid = np.log(ts.seconds / np.maximum(pred, 1e-30))
        logf = np.log(np.column_stack([np.maximum(v, 1e-30) for v in ts.features.values()]))
        gross, local = outliers(resid, logf, _groups(ts))
        _drop(records, ts, gross, f"gross outlier: over 10x and {MAD_K:g} MADs from the robust "
                                  f"physical baseline")
        _drop(records, ts, local, f"outlier: over 1.5x and {MAD_K:g} MADs from all but one of its "
                                  f"{NEIGHBOURS} nearest samples (relative to the baseline)")
        work[key] = ts.subset(~(gross | local))

    for key, ts in sorted(work.items()):
        if len(ts) == 0:
            continue
        share = float(np.mean(beyond_nominal(ts, facts)))
        if share > 0.1:
            result.notes.append(
                f"{ts.op}/{ts.phase}: {share:.0%} of the kept samples run faster than the data-sheet "
                f"{'link bandwidth' if ts.phase == COLLECTIVE_PHASE else 'peak FLOP rate or HBM bandwidth'}"
                f" (kept: within the slack for estimated byte counts and caches); they may not "
                f"measure the stated work, treat this model with caution")
    for key, ts in work.items():
        for idx, count in zip(*np.unique(ts.file_index, return_counts=True)):
            rec = records[idx]
            rec.kept[ts.phase] = rec.kept.get(ts.phase, 0) + int(count)
    result.sets = work
    return result
