"""Predicted against measured end-to-end iterations on the development set of real GPU runs.

Every row of vTrain's 1,440 Megatron-DeepSpeed iterations on 8-GPU A100 nodes becomes the
NeoX config of the same job (predictors/devset.py) and is predicted through a cluster
description of those nodes, exactly as `neox-perf check` would predict it. Printed:
1. the plain operator sum (no step terms): MAPE, mean signed error, worst run, by layout;
2. the step terms fitted on all runs (what the bundled profile ships);
3. cross-validation: each (tp, dp, pp) layout predicted with terms fitted on the other
   layouts only, then the same by pipeline depth and by tensor-parallel width (fit on the
   others, predict the held-out depth/width), with the 80% interval's coverage.

    python benchmarks/endtoend.py [--cluster neox_perf/examples/clusters/dgx-a100.yml]
    python benchmarks/endtoend.py --write-terms neox_perf/profiles/perlmutter-a100-80gb

--write-terms stores the fitted terms and the cross-validated interval in that profile's
manifest (atomically), for every description based on it to inherit.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from neox_perf.estimate import estimate  # noqa: E402
from neox_perf.predict import load_cluster  # noqa: E402
from neox_perf.predictors.fitting import devset, step_fit  # noqa: E402
from neox_perf.step_terms import FITTED, StepTerms  # noqa: E402

DEFAULT_CLUSTER = REPO / "neox_perf" / "examples" / "clusters" / "dgx-a100.yml"


def _table(title, cases, predicted, key=lambda c: c.key, label="layout (tp,dp,pp)"):
    groups = defaultdict(list)
    for c, p in zip(cases, predicted):
        groups[key(c)].append(p / c.measured - 1.0)
    print(f"\n{title}")
    print(f"{label:>18} {'runs':>5} {'MAPE %':>7} {'signed %':>9} {'worst %':>8}")
    for k in sorted(groups):
        e = np.array(groups[k])
        print(f"{str(k):>18} {len(e):5d} {np.mean(np.abs(e)) * 100:7.1f} {np.mean(e) * 100:9.1f} "
              f"{e[np.argmax(np.abs(e))] * 100:8.1f}")
    worst_class = max(np.mean(np.abs(v)) for v in groups.values()) * 100
    return worst_class


def _line(name, measured, predicted, cases):
    s = step_fit.summary(measured, predicted)
    worst = cases[s["worst_index"]].label
    print(f"{name}: MAPE {s['mape']:.2f}%  mean signed {s['mean_signed']:+.2f}%  "
          f"worst {s['worst']:+.1f}% ({worst})  over {s['runs']} runs")
    return s


def _coverage(measured, predicted, shares, interval):
    from neox_perf.step_terms import Interval
    iv = Interval.from_dict(interval)
    inside = [lo <= m <= hi for m, (lo, hi) in
              ((m, iv.around(p, s)) for m, p, s in zip(measured, predicted, shares))]
    return 100.0 * float(np.mean(inside))


def _write_terms(profile_dir: Path, section: dict) -> None:
    from dataclasses import replace

    from neox_perf.profile.directory import manifest_path, update
    from neox_perf.step_terms import StepTermsSection
    terms = StepTermsSection.parse(section, "the fitted step terms")
    update(profile_dir, lambda m: replace(m, step_terms=terms))  # a kill mid-write keeps the old
    print(f"\nwrote step_terms into {manifest_path(profile_dir)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default=str(DEFAULT_CLUSTER),
                    help="cluster profile or description of the dev set's nodes")
    ap.add_argument("--csv", help="vTrain single_node_runs.csv (default ../shared/data/...)")
    ap.add_argument("--write-terms", metavar="PROFILE_DIR",
                    help="store the fitted terms and interval in this profile's manifest")
    ap.add_argument("--rounds", type=int, default=12, help="re-linearisation rounds of the fit (at most)")
    ap.add_argument("--other-gpu-widen", type=float, default=0.109,
                    help="relative widening of the interval on another GPU: the median operator "
                         "error of leave-one-GPU-out (benchmarks/transfer_gpu.py, A100 -> GH200)")
    ap.add_argument("--also-write", metavar="PROFILE_DIR", action="append", default=[],
                    help="also store the same terms in this profile (terms fitted on another GPU: "
                         "its interval widens by --other-gpu-widen)")
    ap.add_argument("--scales-from", type=float, metavar="LOW",
                    help="let compute_scale and memory_scale go down to LOW (the shipped fit keeps "
                         "them >= 1, see predictors/step_fit.BOUNDS): shows what a dev set whose "
                         "GPUs are faster than the samples' would fit; never with --write-terms")
    args = ap.parse_args(argv)
    if args.scales_from is not None:
        if args.write_terms or args.also_write:
            ap.error("--scales-from is a comparison: it cannot write terms")
        for n in ("compute_scale", "memory_scale"):
            step_fit.BOUNDS[n] = (args.scales_from, step_fit.BOUNDS[n][1])
    started = time.perf_counter()
    try:
        runs = devset.load_vtrain(Path(args.csv) if args.csv else None)
    except FileNotFoundError as exc:
        print(f"endtoend: {exc}; nothing to measure")
        return 0
    profile = load_cluster(args.cluster)
    gpn = profile.facts.gpus_per_node
    print(f"{len(runs)} measured iterations (vTrain, 8-GPU A100 nodes) predicted through "
          f"{profile.name} ({profile.facts.gpu_name}, {gpn} GPUs/node)")
    print(f"assumed: {devset.ASSUMPTIONS}")
    cases = step_fit.prepare(runs, lambda r: devset.build_config(r, gpn))
    measured = np.array([c.measured for c in cases])

    plain = step_fit.predict_all(cases, profile, StepTerms())
    print()
    _line("operator sum (no step terms)", measured, plain, cases)
    _table("operator sum, by layout", cases, plain)

    terms = step_fit.fit(cases, profile, rounds=args.rounds)
    fitted = step_fit.predict_all(cases, profile, terms)
    print("\nstep terms fitted on all runs:")
    for n in FITTED:
        print(f"  {n:>17} = {getattr(terms, n):.6g}")
    _line("fitted on all runs (in-sample)", measured, fitted, cases)

    lin = step_fit.linearise(cases, profile, terms)
    cv = step_fit.cross_validate(cases, profile, terms, linearisation=lin)
    print()
    s_cv = _line("cross-validated by layout (leave one (tp,dp,pp) out)", measured, cv.predicted, cases)
    worst_class = _table("cross-validated by layout", cases, cv.predicted)
    spread = {n: (min(getattr(t, n) for t in cv.terms.values()),
                  max(getattr(t, n) for t in cv.terms.values())) for n in FITTED}
    print("\nterms across the layout folds (min .. max):")
    for n, (lo, hi) in spread.items():
        print(f"  {n:>17} {lo:.6g} .. {hi:.6g}")

    by = {}
    layouts = {c.key for c in cases}
    for name, i in (("pipeline depth", 2), ("tensor-parallel width", 0)):
        key = lambda c, i=i: c.key[i]
        folds = [[k for k in layouts if k[i] == v] for v in sorted({k[i] for k in layouts})]
        res = step_fit.cross_validate(cases, profile, terms, groups=folds, linearisation=lin)
        print()
        by[name] = _line(f"cross-validated by {name} (fit on the others)", measured, res.predicted, cases)
        _table(f"cross-validated by {name}", cases, res.predicted, key=key, label=name.split()[0])

    shares = np.array([estimate(c.decomposition, profile, terms).extrapolated_share
                       for c in cases])
    interval = step_fit.interval_from_residuals(measured, cv.predicted, shares)
    cover = _coverage(measured, cv.predicted, shares, interval)
    print(f"\n80% interval from the layout-cross-validated residuals: x{interval['lo_ratio']:.3f} .. "
          f"x{interval['hi_ratio']:.3f}, widened by {interval['widen_per_extrapolated']:.2f} per unit "
          f"share of extrapolated time; coverage {cover:.1f}% of runs")
    print(f"\nsummary: operator sum MAPE {step_fit.summary(measured, plain)['mape']:.2f}% -> "
          f"cross-validated {s_cv['mape']:.2f}% (signed {s_cv['mean_signed']:+.2f}%), worst layout "
          f"class {worst_class:.1f}%; vTrain's own simulator reports 8.37% on this set")
    print(f"({time.perf_counter() - started:.0f} s)")
    for target in ([args.write_terms] if args.write_terms else []) + list(args.also_write):
        _write_terms(Path(target), {
            "terms": terms.to_dict(), "interval": interval,
            "fitted_on": f"vTrain single-node A100 runs ({len(runs)} iterations) through {profile.name}",
            "fitted_gpu": profile.facts.gpu_name,
            "other_gpu_widen": args.other_gpu_widen,
            "assumptions": devset.ASSUMPTIONS,
            "cross_validation": {"by_layout": s_cv, "worst_layout_class_mape": worst_class,
                                 **{f"by_{k.replace(' ', '_')}": v for k, v in by.items()}},
            "command": "python benchmarks/endtoend.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
