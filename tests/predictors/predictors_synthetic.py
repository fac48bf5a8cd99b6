"""Synthetic sample folders shaped like the published ones, with known physics and defects.

Times come from a roofline (t0 + FLOPs/P + bytes/B) with mild multiplicative noise, so the
cleaning and fitting code can be checked against a known truth in tmp_path.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Dict, List

import numpy as np

from neox_perf.prediction import opspec
from neox_perf.predictors.fitting.samples import SOURCE_OPS

GPU = "FAKEGPU-80GB"
PEAK = 200e12  # below the fake cluster facts used in the tests
HBM = 1.5e12


def roofline_us(op: str, phase: str, feats: Dict[str, np.ndarray]) -> np.ndarray:
    t = (10e-6 + opspec.op_flops(op, phase, feats) / PEAK + opspec.op_bytes(op, phase, feats) / HBM)
    return np.asarray(t, dtype=float) * 1e6


def write_csv(path: Path, header: List[str], rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        for row in rows:
            w.writerow([f"{v:.6g}" if isinstance(v, float) else v for v in row])
    return path


def _grid(cols, seed):
    rng = np.random.default_rng(seed)
    mp = np.array([1, 2, 4])
    out = {"mp": [], "b": [], "l": [], "h": [], "dim": [], "encoders": []}
    for m in mp:
        for b in (2, 4):
            for l in (1024, 2048, 3072):
                for dim in (2048, 3072, 4096):
                    out["mp"].append(m)
                    out["b"].append(b)
                    out["l"].append(l)
                    out["h"].append(16)
                    out["dim"].append(dim)
                    out["encoders"].append(int(rng.integers(4, 12)))
    return {k: np.array(v, dtype=float) for k, v in out.items() if k in cols}


def operator_rows(source: str, seed: int = 0, noise: float = 0.02):
    """(header, columns, fwd_us, bwd_us or dur_us) for a source operator."""
    spec = SOURCE_OPS[source]
    cols = _grid(spec.columns, seed)
    feats = spec.convert(cols)
    rng = np.random.default_rng(seed + 1)
    phases = (opspec.OPTIMIZER_PHASE,) if spec.stage else ("fwd", "bwd")
    times = [roofline_us(spec.op, p, feats) * np.exp(rng.normal(0, noise, len(cols["dim"]))) for p in phases]
    return list(spec.columns), cols, times


def write_operator(folder: Path, source: str, seed: int = 0, mutate=None) -> Path:
    header, cols, times = operator_rows(source, seed)
    if mutate is not None:
        mutate(cols, times)
    data = [cols[c] for c in header if not c.endswith("(us)")] + times
    rows = list(zip(*[list(col) for col in data]))
    return write_csv(folder / "operator" / f"{GPU}_{source}_fp16.csv", header, rows)


def nccl_rows(kind: str, nodes: int, gpn: int, seed: int = 0):
    """Ring alpha-beta truth: 50 GB/s per peer link inside a node, 5 GB/s per NIC between."""
    rng = np.random.default_rng(seed)
    elements = np.linspace(2e7, 2e8, 40)
    n = nodes * gpn
    wire = opspec.collective_wire_bytes(kind, elements, n)
    if nodes == 1:
        bw = 50e9 * (1 if kind == "p2p" else max(gpn - 1, 1))
    else:
        bw = 5e9 * (1 if kind == "p2p" else min(gpn, 4))
    t = (20e-6 + wire / bw) * np.exp(rng.normal(0, 0.01, len(elements))) * 1e6
    return elements, t


def write_nccl(folder: Path, source: str, kind: str, nodes: int, gpn: int, seed: int = 0, mutate=None) -> Path:
    elements, t = nccl_rows(kind, nodes, gpn, seed)
    if mutate is not None:
        mutate(elements, t)
    rows = [(float(e), float(nodes), float(gpn), float(x)) for e, x in zip(elements, t)]
    return write_csv(folder / "nccl" / f"{GPU}_{source}_fp16_{nodes}_{gpn}.csv",
                     ["shape", "nodes", "GPUsPerNode", "dur(us)"], rows)


def write_cluster(folder: Path, sources=("linear1", "gelu", "flash_atten", "res_add", "firstStage_optimizer"),
                  collectives=(("allreduce", "allreduce", ((1, 2), (1, 4), (2, 1), (2, 4))),
                               ("allgather_large", "allgather", ((2, 1), (4, 1))),
                               ("p2p", "p2p", ((1, 2), (2, 1))))) -> Path:
    for i, source in enumerate(sources):
        write_operator(folder, source, seed=i)
    for source, kind, topologies in collectives:
        for j, (nodes, gpn) in enumerate(topologies):
            write_nccl(folder, source, kind, nodes, gpn, seed=j)
    return folder
