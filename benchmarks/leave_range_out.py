"""Leave-range-out: can the regressors extrapolate to bigger models than they were trained on?

Trees alone cannot: beyond the largest training sample a tree returns that sample's time.
neox-perf's operators are a physical baseline (FLOPs / bytes) times a tree-learned
correction, so the trend beyond the samples comes from physics. This benchmark trains on the
lower part of the grid (dim <= --dim-max and l <= --l-max), predicts every held-out row (the
rows outside that box, so each needs extrapolation in dim, l or both) and prints the MAPE of
the baseline alone, pure trees on log(time) and baseline + trees, per op/phase and overall.

Hyper-parameters are chosen on an 80/20 split of the training part only, as in training.

    python benchmarks/leave_range_out.py [--samples DIR] [--cluster NAME] [--quick]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from neox_perf import opspec
from neox_perf.predictors import baseline, cleaning, fit
from neox_perf.predictors.facts import KNOWN_CLUSTERS
from neox_perf.predictors.forest import log_features
from neox_perf.predictors.samples import load_cluster

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SAMPLES = REPO.parent / "shared" / "data" / "paper-2509.22832-samples"
OPS = ("linear1", "linear2", "linear3", "linear4", "linear_final", "qk", "av", "flash_attention", "embedding")


def _select_and_fit(grid, x, y, key):
    """Best config on an 80/20 split of (x, y) by MAPE of exp(prediction) vs exp(y), refitted on all."""
    tr, val = fit.split(len(y), key)
    best = (np.inf, None, None)
    for kind, params in grid:
        model = fit.make_model(kind, params).fit(x[tr], y[tr])
        err = fit.mape(np.exp(model.predict(x[val])), np.exp(y[val]))
        if err < best[0]:
            best = (err, kind, params)
    _, kind, params = best
    return kind, fit.make_model(kind, params).fit(x, y)


def evaluate_op(ts, facts, grid, dim_max: float, l_max: float) -> Dict[str, float]:
    op, phase = ts.op, ts.phase
    raw_dim, raw_l = ts.raw["dim"], ts.raw["l"]
    train = (raw_dim <= dim_max) & (raw_l <= l_max)
    test = ~train
    if train.sum() < fit.MIN_ROWS_FOR_TREES or test.sum() == 0:
        return {}
    names = opspec.op_spec(op).features
    cols = [ts.features[n] for n in names]
    varying = [j for j, c in enumerate(cols) if np.ptp(c[train]) > 0]
    x = log_features([cols[j] for j in varying])
    base = baseline.evaluate(cleaning.baseline_design(ts, facts), cleaning.fit_baseline(ts, facts, train))
    log_t = np.log(ts.seconds)
    key = f"leave-range-out/{op}/{phase}"
    _, pure = _select_and_fit(grid, x[train], log_t[train], key)
    # residual trees: selection on exp(resid) errors equals selection on time errors
    _, resid = _select_and_fit(grid, x[train], log_t[train] - np.log(base[train]), key)
    actual = ts.seconds[test]
    return {
        "train_rows": int(train.sum()), "test_rows": int(test.sum()),
        "baseline": fit.mape(base[test], actual),
        "pure_trees": fit.mape(np.exp(pure.predict(x[test])), actual),
        "baseline_plus_trees": fit.mape(base[test] * np.exp(resid.predict(x[test])), actual),
        "abs_log_errors": {
            "baseline": np.abs(np.log(base[test] / actual)),
            "pure_trees": np.abs(pure.predict(x[test]) - np.log(actual)),
            "baseline_plus_trees": np.abs(np.log(base[test]) + resid.predict(x[test]) - np.log(actual)),
        },
    }


def run(samples: Path, clusters: List[str], grid, dim_max: float, l_max: float) -> Dict[str, list]:
    from rich.console import Console
    from rich.table import Table
    console = Console(width=120)
    results = {}
    for name in clusters:
        known = KNOWN_CLUSTERS[name]
        sets, records = load_cluster(samples / known.sample_dir)
        cleaned = cleaning.clean(sets, records, known.facts)
        table = Table(title=f"{name}: train dim <= {dim_max:g} and l <= {l_max:g}, test on the rest "
                            f"(MAPE %)")
        for col in ("op", "phase", "train", "test", "baseline", "pure trees", "baseline+trees"):
            table.add_column(col, justify="left" if col in ("op", "phase") else "right")
        rows = []
        for op in OPS:
            for phase in opspec.op_spec(op).phases:
                ts = cleaned.sets.get((op, phase))
                if ts is None:
                    continue
                r = evaluate_op(ts, known.facts, grid, dim_max, l_max)
                if not r:
                    continue
                rows.append((op, phase, r))
                table.add_row(op, phase, str(r["train_rows"]), str(r["test_rows"]),
                              *(f"{100 * r[k]:.1f}" for k in ("baseline", "pure_trees", "baseline_plus_trees")))
        if rows:
            means = {k: float(np.mean([r[k] for _, _, r in rows]))
                     for k in ("baseline", "pure_trees", "baseline_plus_trees")}
            table.add_row("mean over op/phase", "", "", str(sum(r["test_rows"] for _, _, r in rows)),
                          *(f"{100 * means[k]:.1f}" for k in ("baseline", "pure_trees", "baseline_plus_trees")),
                          style="bold")
        console.print(table)
        results[name] = rows
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=Path, default=DEFAULT_SAMPLES)
    parser.add_argument("--cluster", action="append", choices=sorted(KNOWN_CLUSTERS))
    parser.add_argument("--dim-max", type=float, default=6144)
    parser.add_argument("--l-max", type=float, default=4096)
    parser.add_argument("--quick", action="store_true", help="tiny tree grid")
    args = parser.parse_args(argv)
    if not args.samples.is_dir():
        print(f"leave_range_out: samples folder {args.samples} not found (fix: pass --samples DIR)",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    run(args.samples, args.cluster or sorted(KNOWN_CLUSTERS), fit.QUICK_GRID if args.quick else fit.candidates(),
        args.dim_max, args.l_max)
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
