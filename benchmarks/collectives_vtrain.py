"""Held-out check of collective predictions: vTrain's nccl-tests all-reduce on one 8-GPU A100
NVSwitch node (DGX A100), predicted by the example description dgx-a100.yml.

    python benchmarks/collectives_vtrain.py [--lut DIR] [--cluster FILE] [--rows] [--json]

Nothing is fitted on these files: the description's collectives are the perlmutter-a100-80gb
samples (4 GPUs on point-to-point NVLink, all-reduce samples >= 42 MB) scaled by the link
model, with NCCL's documented latency below the samples. Each LUT row (fp32, 1 MiB - 1 GiB,
out-of-place time) is asked as the same bytes of fp16 elements. Prints MAPE and the median
predicted/measured per GPU count and per size band; --rows prints every row.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from neox_perf.predictors.profile import load_profile  # noqa: E402

DEFAULT_LUT = REPO.parent / "shared" / "data" / "vtrain-a100" / "nccl-allreduce"
DEFAULT_CLUSTER = REPO / "neox_perf" / "examples" / "clusters" / "dgx-a100.yml"
MB = 1 << 20
BANDS = (("1-8 MB", 0, 8 * MB), ("8-64 MB", 8 * MB, 64 * MB), (">64 MB", 64 * MB, float("inf")))


def read_lut(path: Path):
    """(bytes, seconds) of one nccl-tests LUT: the first (out-of-place) time column."""
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        next(reader)
        rows = [(float(r[0]), float(r[3]) * 1e-9) for r in reader if r]
    return np.array([r[0] for r in rows]), np.array([r[1] for r in rows])


def table(lut_dir: Path, cluster: Path):
    prof = load_profile(str(cluster))
    rows = []
    for n in range(2, prof.facts.gpus_per_node + 1):
        path = lut_dir / f"AR_GPU{n}_1M_1024M_LUT"
        if not path.is_file():
            continue
        size, meas = read_lut(path)
        for b, t in zip(size, meas):
            p = prof.predict_collective("allreduce", b / 2, 1, n)
            rows.append({"gpus": n, "bytes": b, "measured_s": t, "predicted_s": p.seconds,
                         "extrapolated": p.extrapolated})
    return rows


def summary(rows):
    def stats(sel):
        r = np.array([x["predicted_s"] / x["measured_s"] for x in sel])
        return {"rows": len(sel), "mape": float(np.mean(np.abs(r - 1))), "median_ratio": float(np.median(r))}
    out = {"by_gpus": {}, "by_band": {}, "by_gpus_band": {}}
    for n in sorted({x["gpus"] for x in rows}):
        out["by_gpus"][n] = stats([x for x in rows if x["gpus"] == n])
        for label, lo, hi in BANDS:
            sel = [x for x in rows if x["gpus"] == n and lo <= x["bytes"] < hi]
            if sel:
                out["by_gpus_band"][f"{n} {label}"] = stats(sel)
    for label, lo, hi in BANDS:
        sel = [x for x in rows if lo <= x["bytes"] < hi]
        if sel:
            out["by_band"][label] = stats(sel)
    out["all"] = stats(rows)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lut", type=Path, default=DEFAULT_LUT)
    ap.add_argument("--cluster", type=Path, default=DEFAULT_CLUSTER)
    ap.add_argument("--rows", action="store_true", help="print every LUT row")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.lut.is_dir():
        print(f"collectives_vtrain: LUT folder {args.lut} not found (fix: pass --lut DIR)", file=sys.stderr)
        return 2
    rows = table(args.lut, args.cluster)
    if not rows:
        print(f"collectives_vtrain: no AR_GPU<N>_1M_1024M_LUT files in {args.lut}", file=sys.stderr)
        return 2
    s = summary(rows)
    if args.json:
        print(json.dumps({"rows": rows, "summary": s}, indent=1))
        return 0
    if args.rows:
        print(f"{'GPUs':>4s}{'MiB':>10s}{'measured us':>13s}{'predicted us':>14s}{'pred/meas':>11s}")
        for x in rows:
            print(f"{x['gpus']:4d}{x['bytes'] / MB:10.1f}{x['measured_s'] * 1e6:13.1f}{x['predicted_s'] * 1e6:14.1f}"
                  f"{x['predicted_s'] / x['measured_s']:11.3f}")
    print(f"vTrain nccl-tests all-reduce on one DGX A100 node, predicted by {args.cluster.name}")
    print(f"{'GPUs':>4s}{'rows':>6s}{'MAPE':>8s}" + "".join(f"{label:>18s}" for label, _, _ in BANDS)
          + f"{'pred/meas':>11s}")
    for n, st in s["by_gpus"].items():
        cells = []
        for label, _, _ in BANDS:
            b = s["by_gpus_band"].get(f"{n} {label}")
            cells.append(f"{b['mape']:8.1%} ({b['median_ratio']:.2f})" if b else "")
        print(f"{n:4d}{st['rows']:6d}{st['mape']:8.1%}" + "".join(f"{c:>18s}" for c in cells)
              + f"{st['median_ratio']:11.3f}")
    print(f"{'all':>4s}{s['all']['rows']:6d}{s['all']['mape']:8.1%}"
          + "".join(f"{s['by_band'][label]['mape']:8.1%} ({s['by_band'][label]['median_ratio']:.2f})"
                    .rjust(18) for label, _, _ in BANDS) + f"{s['all']['median_ratio']:11.3f}")
    print("cells: MAPE (median predicted/measured)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
