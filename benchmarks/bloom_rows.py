"""Jean Zay's BLOOM layouts one by one, as the shipped (vTrain-fitted) step terms predict them.

benchmarks/endtoend.py gives the cluster's error per model; this gives it per row, beside what
sets the rows apart -- head dimension, micro-batch, precision, tensor-parallel degree -- and the
share of the predicted iteration spent in operators priced outside their samples, then the
signed error of the rows that share a property against the rest, and how the error follows the
share of the iteration in tensor-parallel all-reduces (which the description's intra-node link
prices: docs/cross-cluster.md).

    python benchmarks/bloom_rows.py [--cluster benchmarks/clusters/jean-zay-a100.yml] [--rows]
    python benchmarks/bloom_rows.py --cluster benchmarks/clusters/jean-zay-a100-nvswitch.yml
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def predicted_rows(runs, cluster: str):
    """(profile, one dict per row: run, head_dim, predicted, signed error, extrapolated share,
    share of the iteration in tensor-parallel all-reduces) under the description's own terms."""
    from neox_perf.predictors.fitting import devset
    from neox_perf.prediction.estimate import estimate
    from neox_perf.prediction.predict import load_cluster
    from neox_perf.prediction.corrections import of_profile
    jz = load_cluster(cluster)
    terms, _ = of_profile(jz)
    rows = []
    for run, case in zip(runs, devset.bloom_cases(runs, jz)):
        est = estimate(case.decomposition, jz, terms, events=False)
        rows.append(dict(run=run, head_dim=run.hidden / run.heads, predicted=est.iteration_seconds,
                         error=est.iteration_seconds / case.measured - 1.0,
                         extrapolated=est.extrapolated_share,
                         tp_share=est.breakdown["mp_allreduce"] / est.iteration_seconds))
    return jz, rows


def main(argv=None) -> int:
    from neox_perf.predictors.fitting import devset

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default=str(REPO / "benchmarks" / "clusters" / "jean-zay-a100.yml"))
    ap.add_argument("--csv", default=None, help="the layout search's CSV (default: ../shared/data)")
    ap.add_argument("--rows", action="store_true", help="print every row, not only the groups")
    args = ap.parse_args(argv)
    try:
        runs = devset.load_bloom(Path(args.csv) if args.csv else None, timed_only=True)
    except FileNotFoundError as exc:
        print(f"no BLOOM rows: {exc}", file=sys.stderr)
        return 1
    jz, rows = predicted_rows(runs, args.cluster)
    if args.rows:
        for r in sorted(rows, key=lambda r: r["error"]):
            run = r["run"]
            print(f"{run.row_id:>20} {run.model}B hd {r['head_dim']:5.1f} tp{run.tp} dp{run.dp} pp{run.pp} "
                  f"mb{run.micro_batch} gb{run.global_batch} {run.precision}: {run.seconds:6.1f} s, "
                  f"predicted {r['predicted']:6.1f} s ({100 * r['error']:+.1f}%), "
                  f"{100 * r['extrapolated']:.0f}% extrapolated")
    groups = (
        ("every row", lambda r: True),
        ("head dim not a multiple of 8", lambda r: r["head_dim"] % 8 != 0),
        ("head dim a multiple of 8", lambda r: r["head_dim"] % 8 == 0),
        ("micro-batch 1", lambda r: r["run"].micro_batch == 1),
        ("micro-batch 2 or more", lambda r: r["run"].micro_batch > 1),
        ("bf16", lambda r: r["run"].precision == "bf16"),
        ("fp16", lambda r: r["run"].precision == "fp16"),
    ) + tuple((f"tp {tp}, head dim a multiple of 8",
               lambda r, tp=tp: r["run"].tp == tp and r["head_dim"] % 8 == 0)
              for tp in sorted({r["run"].tp for r in rows}))
    print(f"{len(rows)} timed BLOOM layouts through {jz.name}, the profile's own step terms")
    for name, keep in groups:
        errs = [r["error"] for r in rows if keep(r)]
        if errs:
            print(f"  {name:>30}: {len(errs):3d} rows, mean signed {100 * statistics.mean(errs):+6.1f}%, "
                  f"median {100 * statistics.median(errs):+6.1f}%, "
                  f"range {100 * min(errs):+.1f}% .. {100 * max(errs):+.1f}%")
    aligned = [r for r in rows if r["head_dim"] % 8 == 0]
    # A missing cost inside the tensor-parallel all-reduces shows as an error that falls as their
    # share rises (Pearson r well below 0); a level elsewhere leaves it near 0.
    r_tp = statistics.correlation([r["tp_share"] for r in aligned], [r["error"] for r in aligned])
    print(f"  signed error against the share of the iteration in tensor-parallel all-reduces "
          f"({len(aligned)} rows, head dim a multiple of 8): Pearson r {r_tp:+.2f}, share "
          f"{100 * min(r['tp_share'] for r in aligned):.0f}-{100 * max(r['tp_share'] for r in aligned):.0f}%")
    share = statistics.median(r["extrapolated"] for r in rows)
    print(f"  median share of the predicted iteration in operators outside their samples: {100 * share:.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
