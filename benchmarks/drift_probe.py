"""Is this machine running at the speed it was calibrated at? Re-times stored operator points.

A profile predicts the machine as it was while `calibrate` ran. A shared or cloud box drifts
(other tenants, frequency, thermal state): on the development box, identical launches minutes
apart differed by 10-30%. This picks a seeded sample of the store's own calibration points
(1-200 ms each, every operator), times them again now with the calibration's benchmark code
and the protocol its run recorded, and prints the ratio now / then per operator and overall (median, IQR). A
validation run's signed error is only meaningful next to this ratio taken at the same time.

    python benchmarks/drift_probe.py --store ~/.cache/neox-perf/stores/local.sqlite [--points 40]

--corun N times every point a second time while N other processes run the same point (one
thread each), as N+1 CPU ranks of a data-parallel run execute the same operator at once, and
prints that time over the point's time alone: the contention for caches and memory bandwidth
that a calibration, timing one process while the other cores idle, does not see.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from collections import defaultdict


PROTOCOL_KEYS = ("warmup", "repeats", "min_seconds", "max_repeats")  # as calibrate records them


def protocols(runs) -> dict:
    """Run id -> the protocol that calibration run timed its points with (its recorded info)."""
    from neox_perf.calibration.bench import Protocol
    return {r["id"]: Protocol(*(r["info"][k] for k in PROTOCOL_KEYS)) for r in runs
            if r["kind"] == "calibrate" and all(k in r["info"] for k in PROTOCOL_KEYS)}


def pick(samples, points: int, seed: int, timed_runs):
    """Up to `points` calibration samples of 1-200 ms, spread over the operators, from runs
    whose protocol is known."""
    from neox_perf.prediction.opspec import OPERATORS

    by_op = defaultdict(list)
    for s in samples:  # operators only: collectives need every rank
        if (s.op in OPERATORS and s.source == "calibrate" and s.run_id in timed_runs
                and 1e-3 <= s.median <= 0.2):
            by_op[s.op].append(s)
    rng = random.Random(seed)
    per_op = max(1, points // max(1, len(by_op)))
    chosen = []
    for op in sorted(by_op):
        rows = sorted(by_op[op], key=lambda s: s.id)
        chosen += rng.sample(rows, min(per_op, len(rows)))
    return chosen[:points]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="the SQLite sample store a profile was fitted from")
    ap.add_argument("--points", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corun", type=int, default=0, metavar="N",
                    help="also time every point while N other processes run it")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from neox_perf.calibration.bench import Timer, aggregate, measure
    from neox_perf.calibration.corun import CoRunners
    from neox_perf.calibration.launch import use_caching_malloc
    from neox_perf.calibration.store import SampleStore, StoreError
    from neox_perf.calibration.sweep import pick_threads, pinned_threads

    try:
        with SampleStore(args.store) as store:
            samples, runs = store.samples(), store.runs()
    except StoreError as exc:
        sys.stderr.write(f"drift_probe: {exc}\n")
        return 2
    protocol_of = protocols(runs)
    chosen = pick(samples, args.points, args.seed, protocol_of)
    if not chosen:
        sys.stderr.write(f"drift_probe: {args.store}: no calibration samples of 1-200 ms "
                         f"with a recorded protocol\n")
        return 2
    use_caching_malloc()  # as calibrate times them: large CPU tensors recycled, no page faults
    timer = Timer()
    ratios, by_op, started = [], defaultdict(list), time.monotonic()
    corun, corun_by_op = [], defaultdict(list)
    with contextlib.ExitStack() as stack, pinned_threads(pick_threads(None, "cpu")):
        runners = stack.enter_context(CoRunners(args.corun)) if args.corun > 0 else None
        for s in chosen:
            def time_it():
                return measure(s.op, s.phase, s.features, timer=timer,
                               protocol=protocol_of[s.run_id], dtype=s.dtype).aggregate.median
            now = time_it()
            ratios.append(now / s.median)
            by_op[s.op].append(now / s.median)
            if runners is not None:
                with runners.running((s.op, s.phase, dict(s.features), s.dtype)):
                    busy = time_it()
                corun.append(busy / now)
                corun_by_op[s.op].append(busy / now)
    spread = aggregate(ratios)
    q1, med, q3 = spread.q1, spread.median, spread.q3
    out = {"store": args.store, "points": len(ratios), "ratio_now_over_calibration":
           {"median": med, "q1": q1, "q3": q3},
           "by_op": {op: statistics.median(r) for op, r in sorted(by_op.items())},
           "calibrated": time.strftime("%Y-%m-%d %H:%M", time.localtime(max(s.created for s in chosen))),
           "seconds": time.monotonic() - started}
    if corun:
        c = aggregate(corun)
        out["corun"] = args.corun
        out["ratio_corun_over_alone"] = {"median": c.median, "q1": c.q1, "q3": c.q3}
        out["corun_by_op"] = {op: statistics.median(r) for op, r in sorted(corun_by_op.items())}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{len(ratios)} stored points re-timed in {out['seconds']:.0f} s; now / at calibration "
          f"({out['calibrated']}): median {med:.3f}, IQR {q1:.3f}-{q3:.3f} "
          f"({'slower' if med > 1 else 'faster'} by {abs(med - 1) * 100:.1f}%)")
    print("  " + ", ".join(f"{op} {r:.2f}" for op, r in out["by_op"].items()))
    if corun:
        c = out["ratio_corun_over_alone"]
        print(f"with {args.corun} other process(es) running the same point / alone: median "
              f"{c['median']:.3f}, IQR {c['q1']:.3f}-{c['q3']:.3f}")
        print("  " + ", ".join(f"{op} {r:.2f}" for op, r in out["corun_by_op"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
