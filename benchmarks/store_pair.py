"""Two calibrations' stores point by point: how far apart are the same operator points, where,
and did the reference probe see it?

    python benchmarks/store_pair.py A.sqlite B.sqlite [--ops 12]

benchmarks/calibrate_twice.py says how far two profiles' predictions differ and which part of
the profile moves them; this looks under the operator part. For every calibration point both
stores hold (same op, phase, features and dtype) it prints B/A of the stored sample (median,
IQR, mean |log B/A|), then per (op, phase) the same, heaviest by A's stored time first. Then
the reference probe (calibration/disturbance.py): each run's readings over its baseline, and
the correlation of a point's log B/A with the log ratio of the readings stored nearest it in
time in each store (a run stores a subset of its readings; a point is placed by its commit
time against the readings' times since the run began), and the mean |log B/A| once divided by
those readings: near-zero correlation says the probe did not see what moved the points.
Reads the stores only (SQLite read-only).
"""
from __future__ import annotations

import argparse
import json
import sqlite3
from collections import defaultdict

import numpy as np


def load(path: str):
    """({(op, phase, features, dtype): (seconds, created)}, readings' (seconds since the first
    sample, cpu over the baseline))."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        samples = {(o, ph, f, d): (s, c) for o, ph, f, d, s, c in conn.execute(
            "SELECT op, phase, features, dtype, seconds, created FROM samples WHERE source='calibrate'")}
        info = conn.execute("SELECT info FROM runs WHERE kind='calibrate' ORDER BY id LIMIT 1").fetchone()
    finally:
        conn.close()
    dist = json.loads(info[0]).get("disturbance") if info else None
    readings = []
    if dist and dist.get("readings") and samples:
        base = dist["baseline"]["work"]
        rs = sorted(dist["readings"], key=lambda r: r["at"])
        # the watch began just before the first sample: align the first reading with it
        t0, at0 = min(c for _, c in samples.values()), rs[0]["at"]
        readings = [(r["at"] - at0, r["cpu"] / base) for r in rs if r.get("cpu")]
        samples = {k: (s, c - t0) for k, (s, c) in samples.items()}
    return samples, readings


def nearest(readings, t: float) -> float:
    ats = np.array([a for a, _ in readings])
    return readings[int(np.argmin(np.abs(ats - t)))][1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--ops", type=int, default=12, help="(op, phase) rows to print")
    args = ap.parse_args(argv)
    (sa, ra), (sb, rb) = load(args.a), load(args.b)
    common = [k for k in sa if k in sb and sa[k][0] > 0 and sb[k][0] > 0]
    if not common:
        print("no calibration point in both stores")
        return 1
    lr = np.log([sb[k][0] / sa[k][0] for k in common])
    r = np.exp(lr)
    print(f"{len(common)} points in both: B/A median {np.median(r):.3f}, IQR {np.percentile(r, 25):.3f}-"
          f"{np.percentile(r, 75):.3f}, mean |log B/A| {np.mean(np.abs(lr)):.4f}")
    groups, weight = defaultdict(list), defaultdict(float)
    for k, x in zip(common, lr):
        groups[k[:2]].append(x)
        weight[k[:2]] += sa[k][0]
    total = sum(weight.values())
    print(f"{'op':>16} {'phase':>5} {'points':>6} {'A time':>7} {'B/A median':>10} {'mean':>6}")
    for g in sorted(groups, key=lambda g: -weight[g])[:args.ops]:
        v = np.array(groups[g])
        print(f"{g[0]:>16} {g[1]:>5} {len(v):6d} {100 * weight[g] / total:6.1f}% {np.exp(np.median(v)):10.3f} "
              f"{np.exp(np.mean(v)):6.3f}")
    if not (ra and rb):
        print("reference probe: a store without readings (calibrated without the watch)")
        return 0
    for name, rs in (("A", ra), ("B", rb)):
        w = np.array([x for _, x in rs])
        print(f"reference probe {name}: {len(w)} stored readings, over its baseline median {np.median(w):.3f}, "
              f"p10 {np.percentile(w, 10):.3f}, p90 {np.percentile(w, 90):.3f}")
    lq = np.log([nearest(rb, sb[k][1]) / nearest(ra, sa[k][1]) for k in common])
    corr = float(np.corrcoef(lr, lq)[0, 1]) if np.std(lq) > 0 else float("nan")
    print(f"log B/A against the log ratio of the nearest readings: correlation {corr:.2f}; mean |log B/A| "
          f"{np.mean(np.abs(lr)):.4f}, divided by the readings {np.mean(np.abs(lr - lq)):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
