"""Leave-range-out: can the regressors extrapolate to bigger models than they were trained on?

Trees alone cannot: beyond the largest training sample a tree returns that sample's time.
neox-perf's operators are a physical baseline (FLOPs / bytes) times a tree-learned
correction, so the trend beyond the samples comes from physics. This benchmark trains on the
lower part of the grid (dim <= --dim-max and l <= --l-max), predicts every held-out row (the
rows outside that box, so each needs extrapolation in dim, l or both) and prints the MAPE of
the baseline alone, pure trees on log(time) and baseline + trees, per op/phase and overall.

Hyper-parameters are chosen on an 80/20 split of the training part only, as in training.

    python benchmarks/leave_range_out.py [--samples DIR] [--cluster NAME] [--quick]
    python benchmarks/leave_range_out.py --store STORE.sqlite | --profile DIR [--quick]

With --store / --profile (a local calibration) each op/phase is fitted on the lower half of
one size feature's sampled values (m, tokens, l, parameters, or the vocabulary) and predicts
the upper half, by the old path (baseline x trees, the trees constant past the range) and by
the efficiency-curve path local profiles use (predictors/extrapolate.py).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from neox_perf.prediction import opspec
from neox_perf.errors import ProfileError
from neox_perf.predictors import baseline
from neox_perf.predictors.fitting import cleaning, fit
from neox_perf.predictors.fitting.known_clusters import KNOWN_CLUSTERS
from neox_perf.predictors.forest import log_features
from neox_perf.predictors.fitting.samples import load_cluster

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
    from neox_perf.predictors import extrapolate
    curve = extrapolate.fit_curve({n: c[train] for n, c in zip(names, cols)},
                                  log_t[train] - np.log(base[train]), names)
    curved = base[test] * np.exp(extrapolate.extrapolated_log_ratio(
        curve, names, [c[test] for c in cols], resid.predict(x[test]),
        [float(c[train].min()) for c in cols], [float(c[train].max()) for c in cols]))
    return {
        "train_rows": int(train.sum()), "test_rows": int(test.sum()),
        "baseline": fit.mape(base[test], actual),
        "pure_trees": fit.mape(np.exp(pure.predict(x[test])), actual),
        "baseline_plus_trees": fit.mape(base[test] * np.exp(resid.predict(x[test])), actual),
        "efficiency_curve": fit.mape(curved, actual),
        "abs_log_errors": {
            "baseline": np.abs(np.log(base[test] / actual)),
            "pure_trees": np.abs(pure.predict(x[test]) - np.log(actual)),
            "baseline_plus_trees": np.abs(np.log(base[test]) + resid.predict(x[test]) - np.log(actual)),
        },
    }


COLUMNS = ("baseline", "pure_trees", "baseline_plus_trees", "efficiency_curve")


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
        for col in ("op", "phase", "train", "test", "baseline", "pure trees", "baseline+trees",
                    "efficiency curve"):
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
                              *(f"{100 * r[k]:.1f}" for k in COLUMNS))
        if rows:
            means = {k: float(np.mean([r[k] for _, _, r in rows])) for k in COLUMNS}
            table.add_row("mean over op/phase", "", "", str(sum(r["test_rows"] for _, _, r in rows)),
                          *(f"{100 * means[k]:.1f}" for k in COLUMNS),
                          style="bold")
        console.print(table)
        results[name] = rows
    return results


# -- local profiles: fit on the lower half of one size feature, predict the upper half ----------

# (op, split feature): the job's leading size (m = b*s for GEMMs, tokens, l, parameters) and,
# where an op has one, its vocabulary
LOCAL_SPLITS = [(op, "m") for op in ("linear1", "linear2", "linear3", "linear4", "linear_final")] + [
    ("linear_final", "n"), ("cross_entropy", "tokens"), ("cross_entropy", "vocab"),
    ("embedding", "vocab"), ("layernorm", "tokens"), ("gelu", "tokens"), ("qk", "l"), ("av", "l"),
    ("flash_attention", "l"), ("softmax", "l"), ("optimizer", "params")]


def evaluate_local(ts, facts, grid, feature: str) -> Dict[str, float]:
    """Old path (baseline x trees, trees constant past the range) against the new one
    (predictors.extrapolate: efficiency curve, trees faded out past the range)."""
    from neox_perf.predictors import extrapolate
    op, phase = ts.op, ts.phase
    values = ts.features[feature]
    uniq = np.unique(values)
    if len(uniq) < 4:
        return {}
    train = values <= uniq[len(uniq) // 2 - 1]
    test = ~train
    if train.sum() < fit.MIN_ROWS_FOR_TREES or test.sum() == 0:
        return {}
    names = opspec.op_spec(op).features
    cols = [np.asarray(ts.features[n], dtype=float) for n in names]
    varying = [j for j, c in enumerate(cols) if np.ptp(c[train]) > 0]
    x = log_features([cols[j] for j in varying])
    base = baseline.evaluate(cleaning.baseline_design(ts, facts), cleaning.fit_baseline(ts, facts, train))
    ratio = np.log(ts.seconds) - np.log(base)
    _, resid = _select_and_fit(grid, x[train], ratio[train], f"leave-range-out/{op}/{phase}/{feature}")
    trees = resid.predict(x)
    curve = extrapolate.fit_curve({n: c[train] for n, c in zip(names, cols)}, ratio[train], names)
    lo = [float(c[train].min()) for c in cols]
    hi = [float(c[train].max()) for c in cols]
    new = extrapolate.extrapolated_log_ratio(curve, names, [c[test] for c in cols], trees[test], lo, hi)
    actual = ts.seconds[test]
    old_pred, new_pred = base[test] * np.exp(trees[test]), base[test] * np.exp(new)
    return {"train_rows": int(train.sum()), "test_rows": int(test.sum()),
            "cut": float(uniq[len(uniq) // 2 - 1]), "top": float(uniq[-1]),
            "baseline": fit.mape(base[test], actual),
            "old": fit.mape(old_pred, actual), "new": fit.mape(new_pred, actual),
            "old_signed": float(np.mean(old_pred / actual - 1)),
            "new_signed": float(np.mean(new_pred / actual - 1))}


def local_sets(store: Path):
    """The store's cleaned sets and facts, as `calibrate`'s fit sees them."""
    from neox_perf.calibration.store import SampleStore
    from neox_perf.predictors.fitting.store_samples import _device_of, measured_facts, training_sets
    from neox_perf.predictors.fitting.samples import FileRecord
    with SampleStore(store) as s:
        device, fingerprint = _device_of(s, None)
    sets = training_sets(store, device=device, source="calibrate")
    facts, _ = measured_facts("leave-range-out", fingerprint, sets, 1)
    record = FileRecord(store, "store", "calibration", used_for="all", sha256="", rows=0)
    return cleaning.clean(sets, [record], facts).sets, facts


def run_local(store: Path, grid) -> list:
    from rich.console import Console
    from rich.table import Table
    sets, facts = local_sets(store)
    table = Table(title=f"{store.name}: fit on the lower half of one feature's sampled values, "
                        f"predict the upper half (MAPE %, mean signed error %)")
    for col in ("op", "phase", "split", "train <=", "test to", "rows", "baseline", "old MAPE",
                "old signed", "new MAPE", "new signed"):
        table.add_column(col, justify="left" if col in ("op", "phase", "split") else "right")
    rows = []
    for op, feature in LOCAL_SPLITS:
        for phase in opspec.op_spec(op).phases:
            ts = sets.get((op, phase))
            if ts is None or not len(ts):
                continue
            r = evaluate_local(ts, facts, grid, feature)
            if not r:
                continue
            rows.append((op, phase, feature, r))
            table.add_row(op, phase, feature, f"{r['cut']:g}", f"{r['top']:g}", str(r["test_rows"]),
                          *(f"{100 * r[k]:+.1f}" if k.endswith("signed") else f"{100 * r[k]:.1f}"
                            for k in ("baseline", "old", "old_signed", "new", "new_signed")))
    if rows:
        mean = {k: float(np.mean([r[k] for *_, r in rows]))
                for k in ("baseline", "old", "old_signed", "new", "new_signed")}
        table.add_row("mean over splits", "", "", "", "", str(sum(r["test_rows"] for *_, r in rows)),
                      *(f"{100 * mean[k]:+.1f}" if k.endswith("signed") else f"{100 * mean[k]:.1f}"
                        for k in ("baseline", "old", "old_signed", "new", "new_signed")), style="bold")
    Console(width=160).print(table)
    return rows


def _store_of(profile: Path) -> Path:
    from neox_perf.profile.directory import read
    return Path(read(profile).provenance.store)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=Path, default=DEFAULT_SAMPLES)
    parser.add_argument("--cluster", action="append", choices=sorted(KNOWN_CLUSTERS))
    parser.add_argument("--dim-max", type=float, default=6144)
    parser.add_argument("--l-max", type=float, default=4096)
    parser.add_argument("--quick", action="store_true", help="tiny tree grid")
    parser.add_argument("--store", type=Path, help="a local calibration store (neox-perf calibrate): "
                                                   "old vs efficiency-curve extrapolation on its samples")
    parser.add_argument("--profile", type=Path, help="a local profile directory: its store, as --store")
    args = parser.parse_args(argv)
    grid = fit.QUICK_GRID if args.quick else fit.candidates()
    if args.store or args.profile:
        try:
            store = args.store or _store_of(args.profile)
        except (ProfileError, AttributeError, TypeError) as exc:
            print(f"leave_range_out: {args.profile}: no provenance.store ({exc}) "
                  f"(fix: pass --store PATH)", file=sys.stderr)
            return 2
        if not store.is_file():
            print(f"leave_range_out: store {store} not found (fix: pass --store PATH)", file=sys.stderr)
            return 2
        started = time.perf_counter()
        run_local(store, grid)
        print(f"done in {time.perf_counter() - started:.0f} s")
        return 0
    if not args.samples.is_dir():
        print(f"leave_range_out: samples folder {args.samples} not found (fix: pass --samples DIR)",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    run(args.samples, args.cluster or sorted(KNOWN_CLUSTERS), grid, args.dim_max, args.l_max)
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
