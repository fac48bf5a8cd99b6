"""How the prediction follows a doubled micro-batch, on both clusters, under the shipped terms.

For every two runs that differ only in micro-batch size (mb and 2 mb: same model, layout, global
batch and, on Jean Zay, day), the change of the signed error from the one to the other, in points.
A prediction that prices the bubble and the per-token work right moves by the timing noise
around 0; one that lacks a cost paid per micro-batch moves up (the larger micro-batch predicted
too slow against the smaller). Jean Zay's 181B job misranks this way (docs/cross-cluster.md);
whether vTrain's runs, the other cluster, show it too is what a term for it would need.

    python benchmarks/micro_batch_pairs.py
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bloom_rows  # noqa: E402
import endtoend  # noqa: E402

from neox_perf.prediction.predict import load_cluster  # noqa: E402
from neox_perf.prediction.corrections import of_profile  # noqa: E402
from neox_perf.predictors.fitting import devset, step_fit  # noqa: E402


def pairs(rows, key):
    """(run, error) rows -> (label, points moved from mb to 2 mb) for each pair."""
    by = defaultdict(dict)
    for run, err in rows:
        by[key(run)].setdefault(run.micro_batch, []).append(err)
    out = []
    for k, mbs in by.items():
        for mb, errs in mbs.items():
            if 2 * mb in mbs:
                out.append((k, mb, 100.0 * (np.mean(mbs[2 * mb]) - np.mean(errs))))
    return out


def _print(name, found, detail=False):
    if not found:
        print(f"{name}: no pairs")
        return
    moved = np.array([p for _, _, p in found])
    print(f"{name}: {len(found)} pairs, mean {moved.mean():+.1f} points, median {np.median(moved):+.1f}, "
          f"up in {int((moved > 0).sum())}")
    if detail:
        for k, mb, p in sorted(found, key=str):
            print(f"    {k} mb {mb} -> {2 * mb}: {p:+.1f}")


def _vtrain(runs, cluster, key):
    prof = load_cluster(str(cluster))
    terms, _ = of_profile(load_cluster(str(endtoend.DEFAULT_CLUSTER)))  # the shipped (vTrain) terms
    gpn = prof.facts.gpus_per_node
    cases = step_fit.prepare(runs, lambda r: devset.build_config(r, gpn), key=key, profile=prof,
                             pipe_sends_mask=devset.PIPE_SENDS_MASK)
    pred = step_fit.predict_all(cases, prof, terms)
    return [(r, p / c.measured - 1.0) for r, c, p in zip(runs, cases, pred)]


def main() -> int:
    try:
        bloom = devset.load_bloom(timed_only=True)
        single, multi = devset.load_vtrain(), devset.load_vtrain_multi()
    except FileNotFoundError as exc:
        print(f"micro_batch_pairs: {exc}; nothing to measure")
        return 0
    _, rows = bloom_rows.predicted_rows(bloom, str(bloom_rows.REPO / "benchmarks" / "clusters" / "jean-zay-a100.yml"))
    jz = pairs([(r["run"], r["error"]) for r in rows],
               lambda r: (f"{r.model}B h{r.hidden} L{r.layers} a{r.heads}", f"tp{r.tp} dp{r.dp} pp{r.pp}",
                          f"gb{r.global_batch}", r.date))
    _print("Jean Zay (BLOOM), through its description", jz, detail=True)
    layout = lambda r: (f"h{r.hidden} L{r.layers}", f"tp{r.tp} dp{r.dp} pp{r.pp}", f"gb{r.global_batch}")  # noqa: E731
    one = pairs(_vtrain(single, endtoend.DEFAULT_CLUSTER, lambda r: ("s",) + r.layout), layout)
    _print("vTrain single node, pp 1", [p for p in one if p[0][1].endswith("pp1")])
    _print("vTrain single node, pp > 1", [p for p in one if not p[0][1].endswith("pp1")])
    many = pairs(_vtrain(multi, endtoend.MULTI_CLUSTER, lambda r: ("m", r.model) + r.layout),
                 lambda r: (f"{r.model}B",) + layout(r)[1:])
    _print("vTrain across nodes", many, detail=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
