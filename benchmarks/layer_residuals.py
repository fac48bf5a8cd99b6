"""A layer's in-training residual, one line or with its memory-bound operators beside it, over
stored calibrations: which predicts the engine shapes it was not fitted on better.

    python benchmarks/layer_residuals.py DIR [DIR ...] [--refit OUT]

Each DIR is a `benchmarks/calibrate_twice.py --run` directory: per calibration (first,
second) its profile (profile-NAME) and the engine step's measurements (NAME.engine.json). For
each, and each layer phase, the residual over the operators is fitted both ways as
predictors/fitting/engine_fit.py fits it -- seconds + per_unit x operators, and the same plus
per_memory x the memory-bound operators (engine_fit.SPLIT_PHASES) -- and each engine shape is
predicted with the fit of the others (leave-one-out). Printed per calibration: each way's
mean / worst leave-one-out error, the memory-bound coefficient, and the one line's in-sample
error on the unfused-attention shapes against the flash ones (a sign the line cannot follow).

--refit OUT: a copy of every profile with its engine terms fitted again from its stored
measurements by this checkout (engine_fit.add_engine; every other part as it was), as
OUT/DIRNAME-NAME, to predict stored launches with (validate_local.py --measured, neox-perf
report --cluster).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

import numpy as np

from neox_perf.predictors.fitting import engine_fit
from neox_perf.predictors.profile import load_profile
from neox_perf.profile.directory import has_manifest, read

CALIBRATIONS = ("first", "second")


def _rows(profile, engine_path: Path, phase: str):
    """(label, operators, memory-bound operators, measured) per engine shape, one layer."""
    shapes = json.loads(engine_path.read_text()).get("shapes", {})
    out = []
    for label, row in sorted(shapes.items()):
        row = engine_fit.typical_row(row)
        pred = engine_fit._engine_prediction(profile, row["keys"], row["vocab"], row["precision"])
        out.append((label, pred[f"layer_{phase}"], pred[f"layer_{phase}_memory"],
                    row[f"layer_{phase}"] / int(row["layers"])))
    return out


def compare(profile, engine_path: Path, phase: str) -> dict:
    rows = _rows(profile, engine_path, phase)
    x, mem, m = (np.array([r[i] for r in rows], dtype=float) for i in (1, 2, 3))
    line_coef, line = engine_fit._residual_fit(x, m - x, m)
    split_coef, split = engine_fit._residual_fit(x, m - x, m, mem)
    fitted = (x + line_coef[0] + line_coef[1] * x) / m - 1.0
    kinds = {k: [e for (label, *_), e in zip(rows, fitted) if f" {k} " in label] for k in ("global", "flash")}
    return {"line": line, "split": split, "per_memory": float(split_coef[2]),
            "unfused": statistics.mean(kinds["global"]) if kinds["global"] else float("nan"),
            "flash": statistics.mean(kinds["flash"]) if kinds["flash"] else float("nan")}


def calibrations(dirs):
    for d in dirs:
        for name in CALIBRATIONS:
            profile_dir, engine = Path(d) / f"profile-{name}", Path(d) / f"{name}.engine.json"
            if has_manifest(profile_dir) and engine.is_file():
                yield Path(d), name, profile_dir, engine


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="calibrate_twice.py --run directories")
    ap.add_argument("--refit", metavar="OUT", help="write each profile refitted by this checkout here")
    args = ap.parse_args(argv)
    found = list(calibrations(args.dirs))
    if not found:
        print(f"layer_residuals: no calibration (profile-first/ and first.engine.json) in "
              f"{', '.join(args.dirs)}; fix: give calibrate_twice.py --run directories")
        return 2
    summary = {p: {"line": [], "split": [], "per_memory": []} for p in ("forward", "backward")}
    print("leave-one-out error over the engine shapes, mean / worst: one line | with the memory-bound "
          "operators (their coefficient); the line's in-sample error, unfused-attention shapes / flash")
    for d, name, profile_dir, engine in found:
        profile = load_profile(profile_dir)
        cells = []
        for phase in ("forward", "backward"):
            r = compare(profile, engine, phase)
            for k in ("line", "split"):
                summary[phase][k].append(float(np.mean(r[k])))
            summary[phase]["per_memory"].append(r["per_memory"])
            cells.append(f"{phase} {100 * np.mean(r['line']):.2f}/{100 * np.max(r['line']):.1f} | "
                         f"{100 * np.mean(r['split']):.2f}/{100 * np.max(r['split']):.1f} "
                         f"({r['per_memory']:+.2f}); {100 * r['unfused']:+.1f} / {100 * r['flash']:+.1f}%")
        print(f"  {d.name}-{name}: " + "   ".join(cells))
        if args.refit:
            out = Path(args.refit) / f"{d.name}-{name}"
            if out.exists():
                shutil.rmtree(out)
            shutil.copytree(profile_dir, out)
            tp = d / f"{name}.tp.json"
            section = read(out).engine
            statistic = section.extra.get("statistic", engine_fit.STATISTIC) if section else engine_fit.STATISTIC
            engine_fit.add_engine(out, engine, tp if tp.is_file() else None, statistic=statistic)
    print(f"over {len(found)} calibrations:")
    for phase, s in summary.items():
        better = sum(b < a for a, b in zip(s["line"], s["split"]))
        pm = s["per_memory"]
        print(f"  {phase}: one line {100 * np.mean(s['line']):.2f}%, with the memory-bound operators "
              f"{100 * np.mean(s['split']):.2f}% (lower in {better} of {len(pm)}); their coefficient "
              f"{min(pm):+.2f} .. {max(pm):+.2f}, median {statistics.median(pm):+.2f}, positive in "
              f"{sum(v > 0 for v in pm)}; fitted with it: {', '.join(engine_fit.SPLIT_PHASES)}")
    if args.refit:
        print(f"refitted profiles in {args.refit}: predict stored launches with `python "
              f"benchmarks/validate_local.py --measured SITTING.json --cluster A --compare B ...`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
