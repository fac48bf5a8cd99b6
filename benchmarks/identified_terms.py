"""Which step terms each cluster's runs identify, and what is left of the other cluster's error
once the terms a cluster could not see are set apart.

Leave-one-cluster-out (benchmarks/endtoend.py) predicts vTrain's single-node runs with the
terms fitted on Jean Zay's BLOOM layout search at about 12% MAPE, -10% signed (stop 54; 17%
before the host's cost per call had its measured prior and the tensor-parallel wait was
retired). This asks why, term by term:
1. per term, the runs' share of what each fit knows about it (step_fit.runs_share: 1 - its
   variance under runs and prior / under the prior alone, at the fitted terms); a term with a
   share near 0 came back at its prior's centre (step_fit.PRIOR_CENTER), not from the cluster;
2. vTrain's single-node runs, by tensor-parallel width, under Jean Zay's terms: as fitted; with
   the terms Jean Zay's runs cannot see (share under 0.5) taken from vTrain's shipped fit -- a
   diagnosis, not a transfer: those values are vTrain's own -- together and each alone; and
   with each remaining Jean Zay term set back to neutral on top;
3. what each term Jean Zay's runs do identify buys Jean Zay itself (in-sample, set to neutral);
4. per cluster and tensor-parallel width, what a rank does between two all-reduces of a layer's
   forward (its operators' issued time over the all-reduces) and how large they are: why a
   fixed wait per all-reduce fitted on 180B layers (tp_sync_s, retired at stop 54) did not
   carry to small ones.

    python benchmarks/identified_terms.py      # 2-8 minutes on a quiet 2-core machine
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from neox_perf.prediction.estimate import _Cache  # noqa: E402
from neox_perf.prediction.predict import load_cluster  # noqa: E402
from neox_perf.prediction.corrections import FITTED, StepTerms, of_profile  # noqa: E402
from neox_perf.predictors.fitting import devset, step_fit  # noqa: E402

SINGLE_CLUSTER = REPO / "neox_perf" / "examples" / "clusters" / "dgx-a100.yml"
BLOOM_CLUSTER = REPO / "benchmarks" / "clusters" / "jean-zay-a100.yml"
UNSEEN = step_fit.UNSEEN  # a term whose share of the fit's knowledge from the runs is below this


def _by_tp(name, cases, predicted):
    measured = np.array([c.measured for c in cases])
    tp = np.array([c.key[-3] for c in cases])
    err = np.asarray(predicted) / measured - 1.0
    whole = step_fit.summary(measured, np.asarray(predicted))
    widths = " ".join(f"tp {k} {100 * np.mean(err[tp == k]):+6.1f}%" for k in sorted(set(tp)))
    print(f"  {name:<58} MAPE {whole['mape']:5.1f}%  signed {whole['mean_signed']:+5.1f}%  {widths}",
          flush=True)


def _between(cases, profile) -> None:
    """Per tensor-parallel width: a layer forward's operator time per all-reduce, and the
    all-reduce's priced seconds and size, over the stage-0 layers of ``cases``."""
    rows = {}
    for c in cases:
        cache = _Cache(profile)
        lf = c.decomposition.stages[0].layer_forward
        mp = [x for x in lf if getattr(x, "purpose", "") == "mp_allreduce"]
        if not mp:
            continue
        n = sum(x.count for x in mp)
        rows.setdefault(c.key[-3], []).append((cache.operators(lf) / n, cache.comm(lf, "mp_allreduce") / n,
                                              2.0 * sum(x.elements * x.count for x in mp) / n))
    for tp in sorted(rows):
        w, a, b = (np.array(v) for v in zip(*rows[tp]))
        print(f"  tp {tp}: {len(w):4d} runs, work between two all-reduces {1e3 * np.percentile(w, 10):.2f}-"
              f"{1e3 * np.percentile(w, 90):.2f} ms (10th-90th percentile, median {1e3 * np.median(w):.2f}); "
              f"an all-reduce {1e3 * np.median(a):.3f} ms of {np.median(b) / 1e6:.1f} MB (median)")


def main(argv=None) -> int:
    try:
        single_runs = devset.load_vtrain(None)
        bloom_runs = devset.load_bloom(None, timed_only=True)
    except FileNotFoundError as exc:
        print(f"identified_terms: {exc}; nothing to measure")
        return 0
    started = time.perf_counter()
    dgx, jz = load_cluster(SINGLE_CLUSTER), load_cluster(BLOOM_CLUSTER)
    single = step_fit.prepare(single_runs, lambda r: devset.build_config(r, dgx.facts.gpus_per_node),
                              key=lambda r: ("single",) + r.layout, pipe_sends_mask=devset.PIPE_SENDS_MASK)
    bloom = devset.bloom_cases(bloom_runs, jz)
    vtrain, _ = of_profile(dgx)  # what every bundled profile ships: fitted on vTrain's runs
    jz_terms = step_fit.fit(bloom, jz)
    shares = {}
    for name, cases, prof, terms in (("vTrain single-node", single, dgx, vtrain),
                                     ("Jean Zay", bloom, jz, jz_terms)):
        F, _ = step_fit.linearise(cases, prof, terms)
        shares[name] = step_fit.runs_share(F, np.array([c.measured for c in cases]))
    print(f"{len(single)} vTrain single-node runs through {dgx.name}, {len(bloom)} BLOOM layouts through "
          f"{jz.name}\n\nper term: value fitted / the runs' share of what the fit knows about it (vTrain's: "
          f"over its single-node runs, which no data-parallel group across nodes is in)")
    print(f"  {'term':>22}  {'vTrain (shipped)':>24}  {'Jean Zay':>24}")
    for n in FITTED:
        print(f"  {n:>22}  {getattr(vtrain, n):>12.4g} / {shares['vTrain single-node'][n]:>5.2f}     "
              f"{getattr(jz_terms, n):>12.4g} / {shares['Jean Zay'][n]:>5.2f}")
    unseen = [n for n in FITTED if shares["Jean Zay"][n] < UNSEEN]
    print(f"\nJean Zay's runs cannot see (share under {UNSEEN}): {', '.join(unseen) or 'none'}")
    print("\nvTrain's single-node runs under Jean Zay's terms:")
    _by_tp("as fitted on Jean Zay", single, step_fit.predict_all(single, dgx, jz_terms))
    patched = replace(jz_terms, **{n: getattr(vtrain, n) for n in unseen})
    _by_tp("unseen terms from vTrain's fit (diagnosis, not transfer)", single,
           step_fit.predict_all(single, dgx, patched))
    neutral = StepTerms()
    for n in FITTED:
        if n in unseen or getattr(patched, n) == getattr(neutral, n):
            continue
        _by_tp(f"  and Jean Zay's {n} set to neutral", single,
               step_fit.predict_all(single, dgx, replace(patched, **{n: getattr(neutral, n)})))
    # which of them carries it: each alone from vTrain's fit, the rest as Jean Zay's
    for n in unseen:
        if getattr(vtrain, n) != getattr(jz_terms, n):
            _by_tp(f"only {n} from vTrain's", single,
                   step_fit.predict_all(single, dgx, replace(jz_terms, **{n: getattr(vtrain, n)})))
    _by_tp("vTrain's own shipped terms (in-sample)", single, step_fit.predict_all(single, dgx, vtrain))
    print("\nJean Zay's own runs (in-sample) under its terms:")
    _by_tp("as fitted", bloom, step_fit.predict_all(bloom, jz, jz_terms))
    for n in FITTED:
        if n not in unseen and getattr(jz_terms, n) != getattr(neutral, n):
            _by_tp(f"  its {n} set to neutral", bloom,
                   step_fit.predict_all(bloom, jz, replace(jz_terms, **{n: getattr(neutral, n)})))
    print("\nbetween two tensor-parallel all-reduces of a layer's forward (bare operators and links):")
    for name, cases, prof in (("vTrain single-node", single, dgx), ("Jean Zay", bloom, jz)):
        print(f" {name}")
        _between(cases, prof)
    print(f"\n({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
