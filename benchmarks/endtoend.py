"""Predicted against measured end-to-end iterations on the development sets of real GPU runs.

Every measured iteration (predictors/fitting/devset.py) becomes the NeoX config of the same job and is
predicted through a cluster description of the nodes it ran on, exactly as `neox-perf check`
would predict it:
- vTrain's 1,440 single-node Megatron-DeepSpeed iterations (8-GPU A100 nodes) through
  neox_perf/examples/clusters/dgx-a100.yml;
- vTrain's 47 multi-node iterations (a 3.6B model on 64 GPUs, a 175B model on 512 GPUs, 8 GPUs
  per node, 800 Gb/s per node between them) through benchmarks/clusters/vtrain-a100.yml.
Printed:
1. the plain operator sum, and the terms the bundled profile ships now, on both sets;
2. the step terms fitted on both sets together;
3. cross-validation: each single-node (tp, dp, pp) layout predicted with terms fitted without it,
   and each multi-node model predicted with terms fitted without it (by model); then the
   single-node set by pipeline depth and by tensor-parallel width;
4. the 80% interval per regime (inside a node: the single-node residuals; across nodes: the
   multi-node ones), each from cross-validated residuals, with its coverage on held-out folds
   (each fold's runs against the interval made without that fold) and its median width.
Multi-node runs that disagree with their own job at a smaller micro-batch
(devset.inconsistent) are reported apart and left out of the fit.

    python benchmarks/endtoend.py
    python benchmarks/endtoend.py --write-terms neox_perf/profiles/perlmutter-a100-80gb

--write-terms stores the fitted terms and the intervals in that profile's manifest
(atomically), for every description based on it to inherit.
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

from neox_perf.prediction.estimate import estimate  # noqa: E402
from neox_perf.prediction.predict import load_cluster  # noqa: E402
from neox_perf.predictors.fitting import cluster_cv, devset, step_fit  # noqa: E402
from neox_perf.prediction.corrections import ACROSS_NODES, FITTED, INSIDE_NODE, Interval, StepTerms, of_profile  # noqa: E402

DEFAULT_CLUSTER = REPO / "neox_perf" / "examples" / "clusters" / "dgx-a100.yml"
MULTI_CLUSTER = REPO / "benchmarks" / "clusters" / "vtrain-a100.yml"
BLOOM_CLUSTER = REPO / "benchmarks" / "clusters" / "jean-zay-a100.yml"
BLOOM_ALTERNATIVE = REPO / "benchmarks" / "clusters" / "jean-zay-a100-nvswitch.yml"
SINGLE, MULTI, BLOOM = "single", "multi", "bloom"
VTRAIN_NAME, JEAN_ZAY_NAME = "vTrain's A100 cluster", "Jean Zay (BLOOM)"


def _table(title, cases, predicted, key=lambda c: c.key[1:], label="layout (tp,dp,pp)"):
    groups = defaultdict(list)
    for c, p in zip(cases, predicted):
        groups[key(c)].append(p / c.measured - 1.0)
    print(f"\n{title}")
    print(f"{label:>18} {'runs':>5} {'MAPE %':>7} {'signed %':>9} {'worst %':>8}")
    for k in sorted(groups, key=str):
        e = np.array(groups[k])
        print(f"{str(k):>18} {len(e):5d} {np.mean(np.abs(e)) * 100:7.1f} {np.mean(e) * 100:9.1f} "
              f"{e[np.argmax(np.abs(e))] * 100:8.1f}")
    return max(np.mean(np.abs(v)) for v in groups.values()) * 100


def _line(name, cases, predicted):
    measured = np.array([c.measured for c in cases])
    s = step_fit.summary(measured, np.asarray(predicted))
    print(f"{name}: MAPE {s['mape']:.2f}%  mean signed {s['mean_signed']:+.2f}%  "
          f"worst {s['worst']:+.1f}% ({cases[s['worst_index']].label})  over {s['runs']} runs")
    return s


def _by_model(name, cases, predicted):
    """One line per multi-node model; returns {model: summary}."""
    out = {}
    for model in sorted({c.key[1] for c in cases}, key=float):
        idx = [i for i, c in enumerate(cases) if c.key[1] == model]
        out[model] = _line(f"{name}, {model}B", [cases[i] for i in idx], np.asarray(predicted)[idx])
    return out


def _shares(cases, profile, terms):
    est = [estimate(c.decomposition, c.profile or profile, terms) for c in cases]
    return np.array([e.extrapolated_share for e in est])


def _nested_coverage(cases, predicted, shares, fold_of, pool=None, level=0.8):
    """(share of runs inside the 80% interval made without their fold -- from the other folds'
    residuals and the `pool` of (measured, predicted, shares) every fold's interval also stands
    on --, that share per fold, the median relative width of those intervals)."""
    measured = np.array([c.measured for c in cases])
    folds = [fold_of(c) for c in cases]
    pm, pp, ps = pool if pool is not None else (np.array([]), np.array([]), np.array([]))
    inside, widths, per_fold = [], [], {}
    for f in sorted(set(folds), key=str):
        held = np.array([g == f for g in folds])
        iv = Interval.from_dict(step_fit.interval_from_residuals(
            np.concatenate([pm, measured[~held]]), np.concatenate([pp, predicted[~held]]),
            np.concatenate([ps, shares[~held]]), coverage=level))
        mine = []
        for m, p, s in zip(measured[held], predicted[held], shares[held]):
            lo, hi = iv.around(p, s)
            mine.append(lo <= m <= hi)
            widths.append((hi - lo) / p)
        inside += mine
        per_fold[f] = 100.0 * float(np.mean(mine))
    return 100.0 * float(np.mean(inside)), per_fold, 100.0 * float(np.median(widths))


def _held_out_interval(cases, predicted, shares, fold_of, pool=None):
    """The 80% interval, its central share chosen on held-out folds: the smallest level (from
    0.80 up) whose intervals, each made without the fold it is checked on, hold 80% of the
    held-out runs -- residuals pooled across folds promise more than a new layout or model gets.
    Returns (interval over every residual at that level, level, coverage, per fold, median width)."""
    measured = np.array([c.measured for c in cases])
    pm, pp, ps = pool if pool is not None else (np.array([]), np.array([]), np.array([]))
    for level in np.arange(0.80, 0.991, 0.01):
        cover, per_fold, width = _nested_coverage(cases, predicted, shares, fold_of, pool, level)
        if cover >= 80.0:
            break
    interval = step_fit.interval_from_residuals(np.concatenate([pm, measured]), np.concatenate([pp, predicted]),
                                                np.concatenate([ps, shares]), coverage=level)
    return interval, float(level), cover, per_fold, width


def _rank_line(rankings) -> str:
    if len(rankings) > 6:  # vTrain's single-node set: 64 (model, GPUs, batch) groups
        s = _rank_record(rankings)
        worst = min(rankings, key=lambda r: r.spearman)
        return (f"{s['groups']} groups: Spearman median {s['spearman_median']:.2f} (worst "
                f"{s['spearman_min']:.2f}, {_group_name(worst.group)}), >= 0.8 in "
                f"{s['groups_spearman_at_least_0.8']}; regret median {s['regret_median']:.3f}, worst "
                f"{s['regret_max']:.3f}, <= 1.03 in {s['groups_regret_at_most_1.03']}")
    return "; ".join(f"{_group_name(r.group)} ({r.layouts} layouts): Spearman {r.spearman:.2f}, regret "
                     f"{r.regret:.3f}" for r in rankings) or f"no model with {cluster_cv.MIN_LAYOUTS} layouts"


def _rank_record(rankings):
    """What a profile stores of the rankings: each group, or a summary past six (64 groups of
    vTrain's single-node set would fill the manifest)."""
    if len(rankings) > 6:
        rho = [r.spearman for r in rankings]
        reg = [r.regret for r in rankings]
        return {"groups": len(rankings), "spearman_median": float(np.median(rho)), "spearman_min": min(rho),
                "regret_median": float(np.median(reg)), "regret_max": max(reg),
                "groups_spearman_at_least_0.8": sum(x >= 0.8 for x in rho),
                "groups_regret_at_most_1.03": sum(x <= 1.03 for x in reg)}
    return [{"group": _group_name(r.group), "layouts": r.layouts, "spearman": r.spearman, "regret": r.regret}
            for r in rankings]


def _group_name(group) -> str:
    return " ".join(str(g) for g in group) if isinstance(group, tuple) else str(group)


def _leave_one_cluster_out(args, single_runs, single, multi_runs, multi, profile, vtrain_terms,
                           cv_single, cv_multi, cv_shares, vtrain_unseen):
    """Fit on one cluster, predict the other, both ways (vTrain's A100 runs, single- and
    multi-node, against BigScience's BLOOM layout search on Jean Zay): per cluster and model
    MAPE, mean signed error, and within each model and condition Spearman's rank correlation
    and the regret of the predicted-best layout; each fitted term left out in turn on the
    cluster it was not fitted on; and the 80% interval of a cluster nothing was fitted on, its
    coverage checked on each cluster with the width the other one gives. Returns what the
    profiles store, or None without the BLOOM rows."""
    try:
        bloom_runs = devset.load_bloom(Path(args.bloom_csv) if args.bloom_csv else None, timed_only=True)
    except FileNotFoundError as exc:
        print(f"\n(no BLOOM runs: {exc}; no leave-one-cluster-out)")
        return None
    jz = load_cluster(args.bloom_cluster)
    bloom = devset.bloom_cases(bloom_runs, jz)
    print(f"\n== leave one cluster out ==\n{len(bloom_runs)} timed BLOOM layouts (Jean Zay, "
          f"{len({r.model for r in bloom_runs})} candidate models, {len({r.date for r in bloom_runs})} days) "
          f"through {jz.name} ({jz.facts.gpu_name}, {jz.description.inter_node_Gbps:g} Gb/s per node)")
    print(f"assumed: {devset.BLOOM_ASSUMPTIONS}")
    vtrain_cases = list(single) + list(multi)
    # who may be compared with whom: one model (and batch) on one cluster on one day
    vtrain_groups = ([("single-node", f"h{r.hidden}", f"L{r.layers}", f"{r.gpus} GPUs", f"gb{r.global_batch}")
                      for r in single_runs] + [(f"{r.model}B",) for r in multi_runs])
    vtrain_models = ["single-node"] * len(single) + [f"{r.model}B" for r in multi_runs]
    # one job: one model at one global batch, timed on one day (Jean Zay's speed moved from day
    # to day; its batch-size ramp rows are another job). One model is one architecture: the
    # chronicle's size labels cover several (its "182B" rows of 2022-02-26 are 78 x 13824 and
    # 84 x 13312 at 64, 96 and 128 heads), and plan ranks layouts of one architecture, never
    # architectures
    bloom_groups = [(f"{r.model}B", f"h{r.hidden}", f"L{r.layers}", f"a{r.heads}", r.date,
                     f"gb{r.global_batch}") for r in bloom_runs]
    bloom_models = [f"{r.model}B" for r in bloom_runs]
    # the data's own spread: layouts the chronicle timed twice under one condition
    timed = defaultdict(list)
    for r in bloom_runs:
        timed[(r.hidden, r.layers, r.heads, r.tp, r.pp, r.dp, r.micro_batch, r.global_batch,
               r.precision, r.date)].append(r.seconds)
    # (the very same seconds twice is one timing the chronicle quoted in two tables)
    bloom_pairs = [(v[0], v[1]) for v in timed.values() if len(v) == 2 and v[0] != v[1]]
    regimes = [INSIDE_NODE] * len(single) + [ACROSS_NODES] * (len(multi) + 0)
    t0 = time.perf_counter()
    bloom_terms = step_fit.fit(bloom, jz, rounds=args.rounds)
    print(f"step terms fitted on the BLOOM runs alone ({time.perf_counter() - t0:.0f} s); beside those "
          f"fitted on vTrain's:")
    for n in FITTED:
        print(f"  {n:>22} = {getattr(bloom_terms, n):<12.6g} (vTrain: {getattr(vtrain_terms, n):.6g})")
    # what each fit's runs could not see (a share of the fit's knowledge under step_fit.UNSEEN):
    # the interval on the other cluster spans those terms (corrections/unseen.py)
    bloom_unseen = step_fit.unseen_terms(step_fit.linearise(bloom, jz, bloom_terms)[0],
                                         np.array([c.measured for c in bloom]))
    for name, unseen_sd in (("BLOOM runs'", bloom_unseen), ("vTrain runs'", vtrain_unseen)):
        print(f"  terms the {name} fit could not see (posterior sd): "
              + (", ".join(f"{n} {v:.3g}" for n, v in unseen_sd.items()) or "none"))
    sets = {
        VTRAIN_NAME: dict(cases=vtrain_cases, profile=profile, fitted=vtrain_terms, groups=vtrain_groups,
                          models=vtrain_models, regimes=regimes, unseen=vtrain_unseen),
        JEAN_ZAY_NAME: dict(cases=bloom, profile=jz, fitted=bloom_terms, groups=bloom_groups, unseen=bloom_unseen,
                            models=bloom_models, regimes=[ACROSS_NODES] * len(bloom),
                            pairs=bloom_pairs),
    }
    names = list(sets)
    out = {"section": {}, "coverage": {}}
    for held, other in ((names[1], names[0]), (names[0], names[1])):
        h, o = sets[held], sets[other]
        measured = np.array([c.measured for c in h["cases"]])
        own = step_fit.predict_all(h["cases"], h["profile"], h["fitted"])
        pred = step_fit.predict_all(h["cases"], h["profile"], o["fitted"])
        plain = step_fit.predict_all(h["cases"], h["profile"], StepTerms())
        h["loco"], h["measured"] = pred, measured
        h["shares"] = _shares(h["cases"], h["profile"], o["fitted"])
        print(f"\n{held}, predicted with the terms fitted on {other}:")
        per_model = {}
        for model in sorted(set(h["models"]), key=str):
            idx = np.array([m == model for m in h["models"]])
            line, summ = cluster_cv.summary_line(f"  {model}", measured[idx], pred[idx])
            _, mine = cluster_cv.summary_line("", measured[idx], own[idx])
            per_model[model] = summ
            print(f"{line}   (fitted on itself: MAPE {mine['mape']:.2f}%, signed {mine['mean_signed']:+.2f}%)")
        line, whole = cluster_cv.summary_line("  every run", measured, pred)
        print(line + f"   (plain operator sum: MAPE {step_fit.summary(measured, plain)['mape']:.2f}%)")
        # by tensor-parallel width (every key ends in the layout (tp, dp, pp)): a level that
        # holds on average can be two errors of opposite sign, one per term the other cluster
        # could not tell apart (e.g. a per-launch host cost at tp 1 against a per-all-reduce
        # wait at tp 4-8)
        _table(f"  {held} by tensor-parallel width, terms fitted on {other}:", h["cases"], pred,
               key=lambda c: c.key[-3], label="tp")
        ranks = cluster_cv.rankings(h["groups"], pred, measured)
        print("  ranking within a model and condition: " + _rank_line(ranks))
        ceilings = {}
        if h.get("pairs") and ranks:
            sigma = cluster_cv.timing_noise(h["pairs"])
            for r in ranks:
                ceilings[_group_name(r.group)] = c = cluster_cv.rank_ceiling(
                    [m for g, m in zip(h["groups"], measured) if g == r.group], sigma)
                print(f"    {_group_name(r.group)}: a perfect prediction judged against timings "
                      f"{100 * sigma:.1f}% apart each (the {len(h['pairs'])} layouts timed twice) ranks "
                      f"at Spearman {c['median']:.2f} in the median, {c['p10']:.2f} at the 10th "
                      f"percentile ({c['draws']} draws); this one {r.spearman:.2f}")
        print(f"  each term of {other}'s left out (MAPE / mean Spearman on {held}; kept where it helps):")
        base_rho = np.mean([r.spearman for r in ranks]) if ranks else float("nan")
        verdicts = {}
        for n, t in cluster_cv.without_each(o["fitted"]).items():
            p = step_fit.predict_all(h["cases"], h["profile"], t)
            r = cluster_cv.rankings(h["groups"], p, measured)
            rho = np.mean([x.spearman for x in r]) if r else float("nan")
            mape = step_fit.summary(measured, p)["mape"]
            # helps: the other cluster is predicted better with it (MAPE lower by 0.05 points,
            # or its layouts ranked better by 0.01 at no more than half a point of MAPE)
            better_mape = whole["mape"] < mape - 0.05
            better_rank = bool(ranks) and base_rho > rho + 0.01 and whole["mape"] < mape + 0.5
            worse = whole["mape"] > mape + 0.05 and not better_rank
            verdict = "helps" if (better_mape or better_rank) else ("hurts" if worse else "no effect here")
            verdicts[n] = {"mape_without": mape, "spearman_without": rho, "verdict": verdict}
            print(f"    without {n:>22}: MAPE {mape:6.2f}% (with it {whole['mape']:.2f}%), Spearman "
                  f"{rho:.2f} (with it {base_rho:.2f}) -> {verdict}")
        out["section"][held] = {"fitted_on": other, "every_run": whole, "by_model": per_model,
                                "rankings": _rank_record(ranks),
                                **({"ranking_ceiling": ceilings} if ceilings else {}),
                                "terms_left_out": verdicts}
    # the interval of a cluster nothing was fitted on, per regime; checked on each cluster with
    # the width the other cluster's transfer residuals give, then made from both for the profiles
    print("\n80% interval on a cluster nobody fitted on (symmetric: x exp(-q) .. x exp(q), q the 80th "
          "percentile of |log measured/predicted| of runs predicted by terms fitted on the other cluster; "
          "then spanning the terms the other's runs could not see, as a profile's interval does):")
    for held, other in ((names[1], names[0]), (names[0], names[1])):
        h, o = sets[held], sets[other]
        h["spread"] = step_fit.spread_all(h["cases"], h["profile"], o["fitted"], o["unseen"], h["loco"])
        for regime in (INSIDE_NODE, ACROSS_NODES):
            mine = np.array([r == regime for r in h["regimes"]])
            if not mine.any():
                continue
            theirs = np.array([r == regime for r in o["regimes"]])
            if theirs.sum() < cluster_cv.MIN_LAYOUTS:
                theirs = np.ones(len(o["regimes"]), dtype=bool)  # the other has no such runs: all of its
            iv = cluster_cv.symmetric_interval(o["measured"][theirs], o["loco"][theirs], o["shares"][theirs])
            args_ = (h["measured"][mine], h["loco"][mine], h["shares"][mine], iv)
            spread = (h["spread"][0][mine], h["spread"][1][mine])
            cov = cluster_cv.covered(*args_)
            cov_spread = cluster_cv.covered(*args_, spread=spread)
            lo, hi = cluster_cv.median_width(*args_, spread=spread)
            out["coverage"][f"{held}, {regime}"] = {
                "coverage": cov_spread, "coverage_without_unseen_terms": cov, "runs": int(mine.sum()),
                "interval_from": other, **iv, "median_with_unseen_terms": [lo, hi]}
            print(f"  {held}, {regime} ({int(mine.sum())} runs): x{iv['lo_ratio']:.3f} .. x{iv['hi_ratio']:.3f} "
                  f"from {other}'s residuals holds {cov:.1f}%; spanning {other}'s unseen terms "
                  f"{cov_spread:.1f}% (median x{lo:.3f} .. x{hi:.3f})")
            if held == VTRAIN_NAME:
                _coverage_by_tp(h["cases"], mine, args_, spread)
    # What the profiles ship: vTrain's terms. Their residuals on the cluster they were not
    # fitted on (Jean Zay) are the evidence of what a new cluster does to them: across nodes,
    # that interval itself; inside a node (no such runs on Jean Zay), the single-node
    # cross-validated spread with Jean Zay's cluster level on top (every pair of a single-node
    # residual and a Jean Zay one: a slower or faster cluster is so inside a node too).
    # A user's description can be misread as the project's first one of Jean Zay was (an
    # NVSwitch board its sources never state: docs/cross-cluster.md), so each regime takes the
    # wider of the intervals Jean Zay gives under its description and under that other reading.
    jzs = sets[JEAN_ZAY_NAME]
    readings = [(jz.name, jzs["measured"], jzs["loco"], jzs["shares"])]
    if args.bloom_alternative:
        alt = load_cluster(args.bloom_alternative)
        alt_cases = devset.bloom_cases(bloom_runs, alt)
        readings.append((alt.name, jzs["measured"], step_fit.predict_all(alt_cases, alt, vtrain_terms),
                         _shares(alt_cases, alt, vtrain_terms)))
    single_ratio = np.array([c.measured for c in single]) / cv_single
    for name, measured, loco, shares in readings:
        across = cluster_cv.symmetric_interval(measured, loco, shares)
        level = measured / loco
        pairs = (single_ratio[:, None] * level[None, :]).ravel()
        pair_shares = np.repeat(cv_shares[:len(single)], len(level))
        inside = cluster_cv.symmetric_interval(pairs, np.ones_like(pairs), pair_shares)
        print(f"  Jean Zay read as {name}: across nodes x{across['lo_ratio']:.3f} .. x{across['hi_ratio']:.3f}, "
              f"inside a node x{inside['lo_ratio']:.3f} .. x{inside['hi_ratio']:.3f}")
        for key, iv in (("across", across), ("inside", inside)):
            if key not in out or iv["hi_ratio"] > out[key]["hi_ratio"]:
                out[key], out[f"{key}_reading"] = iv, name
    for regime, key, how in ((INSIDE_NODE, "inside", "single-node cross-validated residuals x Jean Zay's "
                              f"level under vTrain's terms, read as {out['inside_reading']}"),
                             (ACROSS_NODES, "across", f"Jean Zay under vTrain's terms, read as {out['across_reading']}")):
        iv = out[key]
        print(f"  for the profiles (vTrain's terms), {regime}: x{iv['lo_ratio']:.3f} .. x{iv['hi_ratio']:.3f} "
              f"({how}), widened by {iv['widen_per_extrapolated']:.2f} per unit share of extrapolated time")
        for name in names:
            h = sets[name]
            mine = np.array([r == regime for r in h["regimes"]])
            if not mine.any():
                continue
            # vTrain's own runs against its own terms: in-cluster cross-validated predictions,
            # with the extrapolated shares of its own terms
            pred, shares = ((h["loco"], h["shares"]) if name == JEAN_ZAY_NAME
                            else (np.concatenate([cv_single, cv_multi]), cv_shares))
            # the profiles' own unseen terms (vTrain's fit's): on Jean Zay as its transfer
            # spread; vTrain's runs are the ones that fit says nothing of them
            spread = (h["spread"][0][mine], h["spread"][1][mine]) if name == JEAN_ZAY_NAME else None
            cov = cluster_cv.covered(h["measured"][mine], pred[mine], shares[mine], iv, spread=spread)
            out["coverage"][f"profiles' {regime} interval on {name}"] = {"coverage": cov, "runs": int(mine.sum())}
            print(f"    holds {cov:.1f}% of {name}'s {int(mine.sum())} runs"
                  + (" (its own width: in-sample)" if name == JEAN_ZAY_NAME else
                     " (predicted cross-validated within vTrain)"))
    return out


def _coverage_by_tp(cases, mine, args_, spread) -> None:
    """Coverage by tensor-parallel width (a key's third from last), without and with the spread:
    a one-signed miss at one width is a missing term, which no spread should be asked to hide."""
    tps = np.array([c.key[-3] for c in cases])[mine]
    parts = []
    for tp in sorted(set(tps.tolist())):
        sel = tps == tp
        sub = tuple(a[sel] for a in args_[:3]) + (args_[3],)
        parts.append(f"tp {tp} {cluster_cv.covered(*sub):.0f}% -> "
                     f"{cluster_cv.covered(*sub, spread=(spread[0][sel], spread[1][sel])):.0f}% ({int(sel.sum())})")
    print("    by tensor-parallel width: " + ", ".join(parts))


def _write_terms(profile_dir: Path, section: dict) -> None:
    from dataclasses import replace

    from neox_perf.profile.directory import manifest_path, update
    from neox_perf.prediction.corrections import StepTermsSection
    terms = StepTermsSection.parse(section, "the fitted step terms")
    update(profile_dir, lambda m: replace(m, step_terms=terms))  # a kill mid-write keeps the old
    print(f"\nwrote step_terms into {manifest_path(profile_dir)}")


def _load(args):
    single = devset.load_vtrain(Path(args.csv) if args.csv else None)
    try:
        multi = devset.load_vtrain_multi(Path(args.multi_csv) if args.multi_csv else None)
    except FileNotFoundError as exc:
        print(f"(no multi-node runs: {exc})")
        multi = []
    return single, multi


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default=str(DEFAULT_CLUSTER),
                    help="cluster profile or description of the single-node set's nodes")
    ap.add_argument("--multi-cluster", default=str(MULTI_CLUSTER),
                    help="cluster description of the multi-node set's nodes")
    ap.add_argument("--csv", help="vTrain single_node_runs.csv (default ../shared/data/...)")
    ap.add_argument("--multi-csv", help="vTrain multi_node_runs.csv (default ../shared/data/...)")
    ap.add_argument("--bloom-csv", help="BLOOM layout_search_runs.csv (default ../shared/data/...)")
    ap.add_argument("--bloom-cluster", default=str(BLOOM_CLUSTER),
                    help="cluster description of Jean Zay's nodes (the BLOOM runs)")
    ap.add_argument("--bloom-alternative", default=str(BLOOM_ALTERNATIVE),
                    help="another reading of Jean Zay's nodes; the profiles' intervals take the wider "
                         "of the two ('' for none)")
    ap.add_argument("--quick", action="store_true",
                    help="skip the in-cluster cross-validation by layout, depth and width (the "
                         "leave-one-cluster-out part and the fits run); never with --write-terms")
    ap.add_argument("--write-terms", metavar="PROFILE_DIR",
                    help="store the fitted terms and intervals in this profile's manifest")
    ap.add_argument("--rounds", type=int, default=12, help="re-linearisation rounds of the fit (at most)")
    ap.add_argument("--other-gpu-widen", type=float, default=0.111,
                    help="relative widening of the interval on another GPU: the median operator "
                         "error of leave-one-GPU-out (benchmarks/transfer_gpu.py, A100 -> GH200, "
                         "additive ratio of the achievable rates)")
    ap.add_argument("--also-write", metavar="PROFILE_DIR", action="append", default=[],
                    help="also store the same terms in this profile (terms fitted on another GPU: "
                         "its interval widens by --other-gpu-widen)")
    ap.add_argument("--scales-from", type=float, metavar="LOW",
                    help="let compute_scale and memory_scale go down to LOW (the shipped fit keeps "
                         "them >= 1, see step_fit.BOUNDS): shows what a dev set whose GPUs are "
                         "faster than the samples' would fit; never with --write-terms")
    args = ap.parse_args(argv)
    if args.quick and (args.write_terms or args.also_write):
        ap.error("--quick skips cross-validation the written section records: it cannot write terms")
    if args.scales_from is not None:
        if args.write_terms or args.also_write:
            ap.error("--scales-from is a comparison: it cannot write terms")
        for n in ("compute_scale", "memory_scale"):
            step_fit.BOUNDS[n] = (args.scales_from, step_fit.BOUNDS[n][1])
    started = time.perf_counter()
    try:
        single_runs, multi_runs = _load(args)
    except FileNotFoundError as exc:
        print(f"endtoend: {exc}; nothing to measure")
        return 0
    profile = load_cluster(args.cluster)
    gpn = profile.facts.gpus_per_node
    print(f"{len(single_runs)} single-node iterations (vTrain, 8-GPU A100 nodes) through "
          f"{profile.name} ({profile.facts.gpu_name}, {gpn} GPUs/node)")
    cases = step_fit.prepare(single_runs, lambda r: devset.build_config(r, gpn),
                             key=lambda r: (SINGLE,) + r.layout, pipe_sends_mask=devset.PIPE_SENDS_MASK)
    multi, apart, multi_runs_kept = [], [], []
    if multi_runs:
        mprof = load_cluster(args.multi_cluster)
        mgpn = mprof.facts.gpus_per_node
        print(f"{len(multi_runs)} multi-node iterations (vTrain: "
              + ", ".join(f"{m}B on {next(r.gpus for r in multi_runs if r.model == m)} GPUs"
                          for m in sorted({r.model for r in multi_runs}, key=float))
              + f") through {mprof.name} ({mprof.facts.gpu_name}, {mgpn} GPUs/node, "
                f"{mprof.description.inter_node_Gbps:g} Gb/s per node)")
        built = step_fit.prepare(multi_runs, lambda r: devset.build_config(r, mgpn),
                                 key=lambda r: (MULTI, r.model) + r.layout, profile=mprof,
                                 pipe_sends_mask=devset.PIPE_SENDS_MASK)
        for run, case, bad in zip(multi_runs, built, devset.inconsistent(multi_runs)):
            (apart if bad else multi).append(case)
            if not bad:
                multi_runs_kept.append(run)
        for c in apart:
            print(f"  set apart (slower than the same job at a smaller micro-batch by over "
                  f"{devset.INCONSISTENT_RATIO}x): {c.label}")
    print(f"assumed: {devset.ASSUMPTIONS}")
    everything = cases + multi

    shipped, _ = of_profile(profile)
    for name, terms in (("operator sum (no step terms)", StepTerms()),
                        (f"terms {profile.name} ships now", shipped)):
        print()
        _line(f"{name}, single-node", cases, step_fit.predict_all(cases, profile, terms))
        if multi:
            _by_model(f"{name}, multi-node", multi + apart,
                      step_fit.predict_all(multi + apart, profile, terms))
    plain = step_fit.predict_all(cases, profile, StepTerms())
    _table("operator sum, by layout (single-node)", cases, plain)

    terms = step_fit.fit(everything, profile, rounds=args.rounds)
    print(f"\nstep terms fitted on all runs ({len(cases)} single-node, {len(multi)} multi-node):")
    for n in FITTED:
        print(f"  {n:>22} = {getattr(terms, n):.6g}")
    fitted = step_fit.predict_all(everything, profile, terms)
    _line("fitted on all runs (in-sample), single-node", cases, fitted[:len(cases)])
    if multi:
        _by_model("fitted on all runs (in-sample), multi-node", multi, fitted[len(cases):])

    lin = step_fit.linearise(everything, profile, terms)
    keys = sorted({c.key for c in everything}, key=str)
    models = sorted({c.key[1] for c in multi}, key=float)
    folds = ([[k] for k in keys if k[0] == SINGLE]
             + [[k for k in keys if k[0] == MULTI and k[1] == m] for m in models])
    cv = step_fit.cross_validate(everything, profile, terms, groups=folds, linearisation=lin)
    cv_single, cv_multi = cv.predicted[:len(cases)], cv.predicted[len(cases):]
    print()
    s_cv = _line("cross-validated by layout (leave one (tp,dp,pp) out), single-node", cases, cv_single)
    worst_class = _table("cross-validated by layout (single-node)", cases, cv_single)
    by_model, apart_cv = {}, {}
    if multi:
        print()
        by_model = _by_model("cross-validated by model (leave one model out), multi-node", multi, cv_multi)
        _table("cross-validated by model, per layout (multi-node)", multi, cv_multi,
               key=lambda c: (c.key[1],) + c.key[2:], label="model,tp,dp,pp")
        if apart:
            for m in models:  # the runs set apart, predicted by the terms fitted without their model
                fold_terms = cv.terms[next(k for k in keys if k[0] == MULTI and k[1] == m)]
                mine = [c for c in apart if c.key[1] == m]
                if mine:
                    apart_cv[m] = step_fit.summary(np.array([c.measured for c in mine]),
                                                   step_fit.predict_all(mine, profile, fold_terms))
                    print(f"  set apart, {m}B, cross-validated: {apart_cv[m]['mean_signed']:+.1f}% "
                          f"over {apart_cv[m]['runs']} run(s)")
            everything_multi = multi + apart
            with_apart = np.concatenate([cv_multi, [step_fit.predict_all(
                [c], profile, cv.terms[next(k for k in keys if k[0] == MULTI and k[1] == c.key[1])])[0]
                for c in apart]])
            _by_model("cross-validated by model, every run included", everything_multi, with_apart)
    spread = {n: (min(getattr(t, n) for t in cv.terms.values()),
                  max(getattr(t, n) for t in cv.terms.values())) for n in FITTED}
    print("\nterms across the folds (min .. max):")
    for n, (lo, hi) in spread.items():
        print(f"  {n:>22} {lo:.6g} .. {hi:.6g}")

    by = {}
    layouts = {c.key for c in cases}
    for name, i in (() if args.quick else (("pipeline depth", 3), ("tensor-parallel width", 1))):
        key = lambda c, i=i: c.key[i]
        # the multi-node runs stay in every fold's training set
        folds_i = [[k for k in layouts if k[i] == v] for v in sorted({k[i] for k in layouts})]
        res = step_fit.cross_validate(everything, profile, terms, groups=folds_i, linearisation=lin)
        print()
        by[name] = _line(f"cross-validated by {name} (fit on the others), single-node", cases,
                         res.predicted[:len(cases)])
        _table(f"cross-validated by {name}", cases, res.predicted[:len(cases)], key=key,
               label=name.split()[0])

    measured_s = np.array([c.measured for c in cases])
    shares_s = _shares(cases, profile, terms)
    coverage = {}
    inside, level, cover, _, width = _held_out_interval(cases, cv_single, shares_s, lambda c: c.key)
    coverage["inside a node"] = {"runs": len(cases), "level": level, "coverage": cover, "median_width": width}
    print(f"\n80% interval, inside a node (single-node cross-validated residuals): "
          f"x{inside['lo_ratio']:.3f} .. x{inside['hi_ratio']:.3f}, widened by "
          f"{inside['widen_per_extrapolated']:.2f} per unit share of extrapolated time; central {level:.0%} of "
          f"the residuals, the level at which each layout is covered {cover:.1f}% by the interval made "
          f"from the others; median width {width:.1f}%")
    across = None
    if multi:
        measured_m = np.array([c.measured for c in multi])
        shares_m = _shares(multi, profile, terms)
        # a job across nodes carries everything a job inside one does (operators, the host, the
        # step terms) and the network besides: its interval stands on the single-node residuals
        # and the multi-node ones together (two models alone cannot place an 80% interval: each
        # one's spread says little of the other's)
        across, level, cover, per_model, width = _held_out_interval(
            multi, cv_multi, shares_m, lambda c: c.key[1], (measured_s, cv_single, shares_s))
        coverage["across nodes"] = {"runs": len(multi), "level": level, "coverage": cover,
                                    "median_width": width, "by_model": per_model}
        print(f"80% interval, across nodes (single- and multi-node cross-validated residuals together): "
              f"x{across['lo_ratio']:.3f} .. x{across['hi_ratio']:.3f}; central {level:.0%}, the level at which "
              f"each model is covered by the interval from the single-node runs and the other model: "
              f"{cover:.1f}% ("
              + ", ".join(f"{m}B {c:.0f}%" for m, c in per_model.items())
              + f"), median width {width:.1f}%")
    print("one NIC per GPU: no measured runs; the across-nodes interval with its high end raised by "
          "the job's inter-node share (corrections.ONE_NIC_UPWARD), coverage not measurable here")

    # the terms the runs could not see, with their posterior sd: the profiles' interval spans them
    unseen_sd = step_fit.unseen_terms(lin[0], np.array([c.measured for c in everything]))
    print("terms the runs could not see (share of the fit's knowledge under "
          f"{step_fit.UNSEEN}; posterior sd): " + (", ".join(f"{n} {v:.3g}" for n, v in unseen_sd.items()) or "none"))
    loco = _leave_one_cluster_out(args, single_runs, cases, multi_runs_kept, multi, profile, terms,
                                  cv_single, cv_multi,
                                  np.concatenate([shares_s, shares_m]) if multi else shares_s, unseen_sd)
    if loco is not None:
        inside, across, coverage["leave one cluster out"] = loco["inside"], loco["across"], loco["coverage"]
    print(f"\nsummary: operator sum MAPE {step_fit.summary(measured_s, plain)['mape']:.2f}% -> "
          f"single-node cross-validated {s_cv['mape']:.2f}% (signed {s_cv['mean_signed']:+.2f}%), worst "
          f"layout class {worst_class:.1f}%; vTrain's own simulator reports 8.37% on this set"
          + "".join(f"; {m}B by model {s['mape']:.2f}% ({s['mean_signed']:+.2f}%)" for m, s in by_model.items()))
    print(f"({time.perf_counter() - started:.0f} s)")
    for target in ([args.write_terms] if args.write_terms else []) + list(args.also_write):
        section = {
            "terms": terms.to_dict(), **({"unseen_terms": unseen_sd} if unseen_sd else {}), "interval": inside,
            "fitted_on": (f"vTrain A100 runs: {len(cases)} single-node iterations through {profile.name}"
                          + (f", {len(multi)} multi-node iterations through {mprof.name}" if multi else "")),
            "fitted_gpu": profile.facts.gpu_name,
            "other_gpu_widen": args.other_gpu_widen,
            "assumptions": devset.ASSUMPTIONS,
            "cross_validation": {"by_layout": s_cv, "worst_layout_class_mape": worst_class,
                                 **{f"by_{k.replace(' ', '_')}": v for k, v in by.items()},
                                 "multi_node_by_model": by_model, "multi_node_set_apart": apart_cv},
            "interval_coverage": coverage,
            **({"leave_one_cluster_out": loco["section"]} if loco is not None else {}),
            "command": "python benchmarks/endtoend.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        if across is not None:
            section["intervals"] = {"across_nodes": across}
        _write_terms(Path(target), section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
