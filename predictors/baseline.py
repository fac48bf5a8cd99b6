"""Physical baselines the trees correct: a roofline per operator, alpha-beta per collective.

Operators: t = t0 + FLOPs/P + bytes/B, one (t0, P, B) per op and phase.
The additive form is chosen over the roofline max(FLOPs/P, bytes/B) because it is linear in
(t0, 1/P, 1/B): the fit is a small non-negative least-squares problem with a unique answer
and no starting point, and it stays robust under iterative reweighting. It over-predicts
by at most 2x where the two terms are equal; inside the sampled range the residual trees
remove that, and outside it each term still scales with its own physical quantity, which
is what extrapolation needs.

Collectives (Hockney alpha-beta with NCCL's ring volume): t = alpha + wire_bytes / bandwidth,
wire_bytes from opspec.collective_wire_bytes (2(n-1)/n S, (n-1) chunk, S), alpha and the
bandwidth per topology class. Inside one node the GPUs are fully connected, so a ring over g
GPUs can drive g-1 peer links per GPU (p2p uses one); between nodes each GPU's traffic leaves
through a NIC and g GPUs per node share up to `lanes` NICs. One parameter set per collective
is fitted over all its sampled topologies, so a topology that was never sampled (16 nodes x 4)
still gets a physical answer. alpha is one constant per class, not a per-ring-step latency:
every sample moves >= 4 MB per rank, so a per-step latency is not identifiable from them and,
fitted anyway, absorbs bandwidth misfit that then explodes with the step count (n-1).
For the same reason the fitted alpha is not a latency (85 us for a 2-GPU all-reduce fitted on
>= 42 MB samples, where NCCL's own model says ~15 us): below a profile's smallest sample the
prediction is NCCL's documented latency (collective_latency) plus the wire bytes at the rate
the prediction has at that smallest sample (profile.ClusterProfile._below_samples).

Fitted rates may not beat the hardware: the lower bounds on seconds-per-FLOP / per-byte are
the same limits that reject samples in cleaning.py, so no extrapolation is faster than a
sample we would have refused.

Everything here evaluates with numpy alone; the fits use numpy too (no scipy needed).
"""
from __future__ import annotations

import math
from itertools import combinations
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from neox_perf.prediction import opspec

ROOFLINE_TERMS = ("t0", "sec_per_flop", "sec_per_byte")
COLLECTIVE_TERMS = ("alpha_intra", "alpha_inter", "sec_per_byte_intra", "sec_per_byte_inter")
# With FLOPs proportional to bytes (elementwise ops) the split between the two terms is not
# identifiable; ties go to the bytes term, the physical limit of such kernels.
ROOFLINE_PREFERENCE = (0, 2, 1)


def roofline_design(op: str, phase: str, features, dtype_bytes: int = opspec.FP16_BYTES,
                    causal_kernel: Optional[str] = None) -> np.ndarray:
    """Columns [1, FLOPs, bytes] for each query (a causal operator's FLOPs as ``causal_kernel``
    does the work: opspec.causal_work_fraction)."""
    flops = np.asarray(opspec.op_flops(op, phase, features, dtype_bytes, causal_kernel), dtype=float)
    nbytes = np.asarray(opspec.op_bytes(op, phase, features, dtype_bytes), dtype=float)
    flops, nbytes = np.broadcast_arrays(flops, nbytes)
    return np.column_stack([np.ones(flops.size), flops.ravel(), nbytes.ravel()])


# NCCL's latency, from its own cost model (src/graph/tuning.cc, Ring algorithm, Simple protocol,
# the one it uses for the MB-sized messages of training): a per-launch base latency plus one
# per-hop latency for every step of the critical path. NVLink/NVSwitch hop 3.4 us; a network hop
# a few us (tuning.cc gives 2.7 LL - 14 Simple; we take 5, NVIDIA's typical IB ring step). These
# are the physical floor where a profile's samples cannot identify a fixed cost (all far above
# the latency-bound range); nothing here is fitted.
NCCL_LAUNCH_S = 8.4e-6
NCCL_HOP_INTRA_S = 3.4e-6
NCCL_HOP_INTER_S = 5e-6
LATENCY_SOURCE = ("NCCL src/graph/tuning.cc cost model, Ring/Simple: 8.4 us per launch + 3.4 us per "
                  "NVLink step + 5 us per network step; steps 2(n-1) all-reduce, n-1 all-gather, 1 p2p")


def collective_hops(kind: str, nodes: int, gpn: int) -> Tuple[float, float]:
    """(intra-node, inter-node) steps on the critical path of NCCL's fastest algorithm: a ring
    (2(n-1) steps for all-reduce, n-1 for all-gather, split by where each hop lands), or for an
    all-reduce over > 2 nodes the tree when its latency is lower; a p2p is one step."""
    ranks = nodes * gpn
    if kind == "p2p":
        return (0.0, 1.0) if nodes > 1 else (1.0, 0.0)
    steps = 2.0 * (ranks - 1) if kind == "allreduce" else float(ranks - 1)
    if nodes <= 1:
        return steps, 0.0
    ring = (steps * (gpn - 1) / ranks, steps * nodes / ranks)
    if kind == "allreduce" and nodes > 2:
        tree = (2.0 * (gpn - 1), 2.0 * math.ceil(math.log2(nodes)))
        if tree[0] * NCCL_HOP_INTRA_S + tree[1] * NCCL_HOP_INTER_S < ring[0] * NCCL_HOP_INTRA_S + ring[1] * NCCL_HOP_INTER_S:
            return tree
    return ring


def collective_latency(kind: str, nodes: int, gpn: int) -> float:
    """Seconds of NCCL latency (launch + steps x hop) of one collective; 0 for one rank."""
    if nodes * gpn <= 1:
        return 0.0
    hi, he = collective_hops(kind, nodes, gpn)
    return NCCL_LAUNCH_S + hi * NCCL_HOP_INTRA_S + he * NCCL_HOP_INTER_S


def collective_design(kind: str, elements, nodes, gpus_per_node, nic_lanes: int,
                      dtype_bytes: int = opspec.FP16_BYTES) -> np.ndarray:
    """Columns matching COLLECTIVE_TERMS for each query."""
    elements, nodes, gpn = (np.asarray(a, dtype=float).ravel()
                            for a in np.broadcast_arrays(elements, nodes, gpus_per_node))
    ranks = nodes * gpn
    wire = np.asarray(opspec.collective_wire_bytes(kind, elements, ranks, dtype_bytes), dtype=float)
    intra = nodes <= 1
    if kind == "p2p":
        intra_links = np.ones_like(gpn)
        inter_links = np.ones_like(gpn)
    else:
        intra_links = np.maximum(gpn - 1.0, 1.0)
        inter_links = np.minimum(gpn, float(max(nic_lanes, 1)))
    active = ranks > 1
    return np.column_stack([
        (active & intra).astype(float),
        (active & ~intra).astype(float),
        np.where(intra, wire / intra_links, 0.0),
        np.where(intra, 0.0, wire / inter_links),
    ])


def evaluate(design: np.ndarray, coef: Sequence[float]) -> np.ndarray:
    return design @ np.asarray(coef, dtype=float)


def _nnls_small(a: np.ndarray, b: np.ndarray, preference: Optional[Sequence[int]] = None) -> np.ndarray:
    """Exact non-negative least squares by trying every support (few columns only).

    Among supports of equal cost the first in `preference` order wins.
    """
    n = a.shape[1]
    order = list(preference) if preference is not None else list(range(n))
    usable = [j for j in order if np.any(a[:, j] != 0)]
    best, best_cost = np.zeros(n), float(b @ b)
    for size in range(1, len(usable) + 1):
        for support in combinations(usable, size):
            sub = a[:, support]
            sol, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(sol < 0):
                continue
            cost = float(np.sum((sub @ sol - b) ** 2))
            if cost < best_cost * (1 - 1e-9):
                best = np.zeros(n)
                best[list(support)] = sol
                best_cost = cost
    return best


def fit_nonnegative(design: np.ndarray, seconds: np.ndarray, lower: Optional[Sequence[float]] = None,
                    preference: Optional[Sequence[int]] = None, iterations: int = 30,
                    huber: float = 1.345) -> Tuple[np.ndarray, Dict[str, float]]:
    """Coefficients >= lower (default 0) minimising robust *relative* error of design @ coef.

    Relative error because the durations span four decades; Huber reweighting (scale from
    the MAD of the relative residuals) so a handful of bad rows cannot drag the fit.
    """
    seconds = np.asarray(seconds, dtype=float)
    lower = np.zeros(design.shape[1]) if lower is None else np.asarray(lower, dtype=float)
    rows = design / seconds[:, None]
    target = 1.0 - rows @ lower  # coef = lower + x, x >= 0
    scale = np.array([np.median(np.abs(col[col != 0])) if np.any(col != 0) else 1.0 for col in rows.T])
    rows = rows / scale
    weights = np.ones(len(seconds))
    coef = np.zeros(design.shape[1])
    for _ in range(iterations):
        w = np.sqrt(weights)
        new = _nnls_small(rows * w[:, None], target * w, preference)
        resid = rows @ new - target
        mad = 1.4826 * np.median(np.abs(resid - np.median(resid)))
        c = huber * max(mad, 1e-3)
        weights = np.minimum(1.0, c / np.maximum(np.abs(resid), 1e-12))
        if np.allclose(new, coef, rtol=1e-9, atol=0):
            coef = new
            break
        coef = new
    coef = lower + coef / scale
    pred = design @ coef
    info = {"median_abs_rel_error": float(np.median(np.abs(pred / seconds - 1.0)))}
    return coef, info
