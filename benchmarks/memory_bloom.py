"""The device's own memory terms against nvidia-smi: BigScience's BLOOM layout search on 80 GB
A100s (../shared/data/bloom-jean-zay/: 60 peaks, 6 out-of-memory layouts; DeepSpeed's pipeline
engine, ZeRO-1, BF16_Optimizer for bf16).

    python benchmarks/memory_bloom.py [--gb]

What is compared: a row's peak_mem_gb is nvidia-smi's used memory on the FIRST node, the max
over its 8 GPUs, at iteration 2. Megatron-DeepSpeed orders ranks tensor-parallel fastest, then
data, then pipeline, so node 0 holds stages 0 .. ceil(8 / (tp x dp)) - 1 (stage 0 alone
whenever tp x dp >= 8); the prediction is the largest device total (derive/memory.py's allocated
peak + derive/device_memory.py's terms) over those stages. GB is read as GiB (nvidia-smi prints
MiB; the table's "GB" is MiB / 1024); --gb reads it as 1e9 bytes instead.

Two device numbers are fitted (derive/device_memory.DeviceFit: bytes per NCCL communicator,
the allocator's share of the iteration's churn), by least squares on what the facts leave
(measured - allocated - CUDA context - cuBLAS - rounding - largest transient), and held to
their physical bounds. Cross-validated by model: each candidate model's rows are predicted by
the fit on the others. Then the verdict of every row (derive/fit.memory_fit, the one rule check
and plan call) with the band sized by the cross-validated spread: the 6 layouts that ran out of
memory must be FAIL or WARNING, none that ran may be FAIL.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from neox_perf.derive import device_memory as dm  # noqa: E402
from neox_perf.derive import fit as verdict  # noqa: E402
from neox_perf.predictors.fitting import devset  # noqa: E402
from neox_perf.predictors.gpus import gpu  # noqa: E402

GIB = 2 ** 30
GPU = "A100-SXM4-80GB"
TARGET_MAPE, TARGET_SIGNED = 0.08, 0.04


class Row:
    """One BLOOM row: what the fitted terms multiply, and what is fixed by the facts."""

    def __init__(self, run, unit: float):
        cfg, derived = devset.build_bloom_config(run, 8)
        self.run, self.derived = run, derived
        self.measured = None if run.peak_mem_gb is None else run.peak_mem_gb * unit
        n0 = max(1, -(-8 // (run.tp * run.dp)))  # stages on node 0
        self.node0 = [self._features(cfg, derived, s) for s in derived.stages[:n0]]
        self.every = [self._features(cfg, derived, s) for s in derived.stages]

    @staticmethod
    def _features(cfg, derived, stage):
        m = stage.memory
        comms = sum(dm.communicators(cfg.parallel, stage.index, len(derived.stages),
                                     not cfg.model.no_weight_tying).values())
        churn = sum(m.peak[c] for c in dm.CHURN)
        fitted_now = comms * dm.FITTED.nccl_per_communicator + dm.FITTED.reserve_fraction * churn
        fixed = m.device_total - fitted_now  # allocated + the terms the facts fix
        return fixed, comms, churn, m

    @staticmethod
    def total(feat, fit) -> float:
        fixed, comms, churn, _ = feat
        return fixed + comms * fit.nccl_per_communicator + fit.reserve_fraction * churn

    def peak(self, fit) -> float:
        """nvidia-smi's max over node 0 under `fit`."""
        return max(self.total(f, fit) for f in self.node0)


def fit_terms(rows) -> dm.DeviceFit:
    """Least squares of (measured - fixed) on (communicators, churn), no intercept, bounded."""
    a, b = [], []
    for r in rows:
        fixed, comms, churn, _ = max(r.node0, key=lambda f: Row.total(f, dm.FITTED))
        a.append([comms, churn])
        b.append(r.measured - fixed)
    coef, *_ = np.linalg.lstsq(np.array(a, float), np.array(b, float), rcond=None)
    return dm.DeviceFit(float(coef[0]), float(coef[1])).bounded()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", action="store_true", help="read peak_mem_gb as 1e9 bytes (default GiB)")
    args = ap.parse_args(argv)
    unit = 1e9 if args.gb else GIB
    try:
        runs = devset.load_bloom()
    except FileNotFoundError as exc:
        print(f"skipped: {exc}")
        return 0
    rows = [Row(r, unit) for r in runs if r.peak_mem_gb is not None or r.oom]
    measured = [r for r in rows if r.measured is not None]
    oom = [r for r in rows if r.run.oom]
    whole = fit_terms(measured)
    lo, hi = dm.NCCL_BOUNDS
    print(f"BLOOM layout search, {GPU}: {len(measured)} nvidia-smi peaks, {len(oom)} out of memory; "
          f"GB read as {'1e9 bytes' if args.gb else 'GiB'}")
    print(f"fit on all rows: NCCL {whole.nccl_per_communicator / GIB:.3f} GiB per communicator "
          f"(bounds {lo / GIB:.3f}-{hi / GIB:.3f}), allocator reserve {whole.reserve_fraction:.3f} of "
          f"the iteration's churn (bounds 0-{dm.RESERVE_BOUND:g}); bundled: {dm.FITTED.nccl_per_communicator / GIB:.3f} GiB, "
          f"{dm.FITTED.reserve_fraction:.3f}")

    # leave one model out
    fold_fit, errors, by_model = {}, {}, defaultdict(list)
    for model in sorted({r.run.model for r in rows}):
        train = [r for r in measured if r.run.model != model]
        fold_fit[model] = fit_terms(train)
    print(f"\n{'row':22s} {'model':>5s} {'layout':26s} {'prec':4s} {'meas':>6s} {'pred':>6s} "
          f"{'alloc':>6s} {'signed':>7s}   (GiB; pred = cross-validated by model)")
    for r in sorted(measured, key=lambda r: (r.run.model, r.run.row_id)):
        f = fold_fit[r.run.model]
        pred = r.peak(f)
        err = (pred - r.measured) / r.measured
        errors[r.run.row_id] = err
        by_model[r.run.model].append(err)
        m = max(r.node0, key=lambda x: Row.total(x, f))[3]
        run = r.run
        print(f"{run.row_id:22s} {run.model:>5s} tp{run.tp} pp{run.pp} dp{run.dp} mb{run.micro_batch} "
              f"ga{run.accumulation}".ljust(55) + f" {run.precision:4s} {r.measured / GIB:6.1f} "
              f"{pred / GIB:6.1f} {m.total / GIB:6.1f} {100 * err:+6.1f}%")
    e = np.array(list(errors.values()))
    print("\nby held-out model (mean signed, n): " + ", ".join(
        f"{k}B {100 * np.mean(v):+.1f}% ({len(v)})" for k, v in sorted(by_model.items())))
    mape, signed = float(np.mean(np.abs(e))), float(np.mean(e))
    under = np.sort(-e[e < 0])
    print(f"cross-validated by model: MAPE {100 * mape:.2f}% (target <= {100 * TARGET_MAPE:.0f}%), "
          f"mean signed {100 * signed:+.2f}% (target within +-{100 * TARGET_SIGNED:.0f}%), "
          f"median |err| {100 * float(np.median(np.abs(e))):.2f}%, worst under {100 * under[-1]:.1f}%, "
          f"worst over {100 * max(e):.1f}%")
    q_under, q_over = float(np.percentile(-e, 95)), float(np.percentile(e, 95))
    print(f"95th percentiles: under-prediction {100 * q_under:.1f}%, over-prediction "
          f"{100 * q_over:.1f}% (the band, derive/fit.py: UNDER_FRACTION "
          f"{100 * verdict.UNDER_FRACTION:.1f}%, OVER_FRACTION {100 * verdict.OVER_FRACTION:.1f}%)")

    # the band: where the measured runs went both ways (the lowest prediction of a layout that
    # ran out of memory, the highest of one that ran, every stage), and at least the spread
    capacity = gpu(GPU).memory_bytes
    cap = dm.usable(capacity)
    fullest = {r.run.row_id: max(Row.total(x, fold_fit[r.run.model]) for x in r.every) for r in rows}
    lowest_oom = min(fullest[r.run.row_id] for r in oom) / cap
    highest_ran = max(fullest[r.run.row_id] for r in rows if not r.run.oom) / cap
    under_edge, over_edge = max(q_under, 1 - lowest_oom), max(q_over, highest_ran - 1)
    print(f"runs went both ways between {100 * lowest_oom:.1f}% (lowest out-of-memory prediction) "
          f"and {100 * highest_ran:.1f}% (highest that ran) of usable: band -{100 * under_edge:.1f}% "
          f"/ +{100 * over_edge:.1f}% (bundled -{100 * verdict.UNDER_FRACTION:.1f}% / "
          f"+{100 * verdict.OVER_FRACTION:.1f}%)")

    # verdicts, every row, every stage, under its fold's fit
    counts = defaultdict(int)
    low, high = verdict.band(cap)
    print(f"\nverdicts ({GPU}, {cap / GIB:.1f} GiB usable, WARNING from "
          f"{low / GIB:.1f}, FAIL above {high / GIB:.1f} GiB; fold fit per model):")
    bad = []
    for r in rows:
        f = fold_fit[r.run.model]
        totals = [Row.total(x, f) for x in r.every]
        stages = [replace(x[3], device_total=int(t)) for x, t in zip(r.every, totals)]
        v = verdict.memory_fit(stages, capacity)
        counts[(r.run.oom, v.level)] += 1
        if r.run.oom:
            print(f"  OOM {r.run.row_id:22s} {r.run.model}B tp{r.run.tp} pp{r.run.pp} dp{r.run.dp} "
                  f"mb{r.run.micro_batch} {r.run.precision}: {v.level.upper():7s} stage {v.stage} "
                  f"{v.device_total / GIB:.1f} GiB ({v.dominant})")
            if v.level == "ok":
                bad.append(r.run.row_id)
        elif v.level == "fail":
            bad.append(r.run.row_id)
            print(f"  RAN {r.run.row_id} is FAIL: stage {v.stage} {v.device_total / GIB:.1f} GiB")
    ran = {lvl: counts[(False, lvl)] for lvl in ("ok", "warning", "fail")}
    ooms = {lvl: counts[(True, lvl)] for lvl in ("ok", "warning", "fail")}
    print(f"  layouts that ran: {ran}; out of memory: {ooms}")
    ok = mape <= TARGET_MAPE and abs(signed) <= TARGET_SIGNED and not bad
    print(f"\n{'PASS' if ok else 'MISS'}: MAPE {100 * mape:.2f}%, signed {100 * signed:+.2f}%, "
          f"OOM caught {ooms['fail'] + ooms['warning']}/{len(oom)}, ran-but-FAIL {ran['fail']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
