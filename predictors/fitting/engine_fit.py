"""The engine terms of a calibrated profile: what a real DeepSpeed step costs beyond the
operator predictions, fitted on the engine calibration's measurements (calibration/engine.py,
calibration/tp_allreduce.py) and, for `calibrate --from-run`, a training run's stage times
(neox_perf/runs/engine_rows.py). The section they make is typed in neox_perf/prediction/corrections/engine.py
and applied by neox_perf/prediction/estimate.py.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from neox_perf.errors import ProfileError
from neox_perf.prediction.corrections import EngineSection
from neox_perf.prediction.corrections.engine import operator_seconds
from neox_perf.profile.directory import update as update_profile

from .calibrated import FitRow


def _engine_prediction(profile, keys: dict, vocab: int, precision: str) -> dict:
    """Operator-level predictions for one engine-calibration model (one rank, one stage; a
    tensor-parallel model's rank holds its share, and its layers' collectives come with it)."""
    import tempfile

    from neox_perf.config import WorldRequest, build, load_files
    from neox_perf.derive import derive
    from neox_perf.prediction.operators import OpCall, StageShape, decompose

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "engine.yml"
        path.write_text(json.dumps(keys))
        gpus = int(keys.get("model_parallel_size", 1))
        cfg, _, _ = build(load_files([str(path)]), WorldRequest(gpus=gpus, gpus_per_node=gpus))
    d = derive(cfg, vocab)
    st = d.stages[0]
    work = decompose(cfg, d.padded_vocab, [StageShape(0, st.transformer_layers, True, True,
                                                      st.params_per_rank)], precision=precision).stages[0]

    def total(calls, memory_only=False):
        return operator_seconds(profile, calls, memory_only)
    return {"layer_forward": total(work.layer_forward), "layer_backward": total(work.layer_backward),
            # their memory-bound operators' share (Residual.per_memory)
            "layer_forward_memory": total(work.layer_forward, True),
            "layer_backward_memory": total(work.layer_backward, True),
            "other_forward": total(work.forward), "other_backward": total(work.backward),
            "activation_elements": work.activation_elements, "logits_elements": work.logits_elements,
            "param_tensors": work.param_tensors,
            # the tensor-parallel all-reduces of each part (none at mp 1)
            **{f"{where}_{phase}_comm": [c for c in calls if not isinstance(c, OpCall)
                                         and c.purpose == "mp_allreduce"]
               for where, phase, calls in (("layer", "forward", work.layer_forward),
                                           ("layer", "backward", work.layer_backward),
                                           ("other", "forward", work.forward),
                                           ("other", "backward", work.backward))}}


def _residual_fit(x: np.ndarray, r: np.ndarray, m: np.ndarray,
                  memory: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """[c0, c1] minimising sum(((c0 + c1 x - r) / m)^2): the residual r of a measured time m as a
    fixed part plus a part growing with x; and the leave-one-out relative error of
    (operators + c0 + c1 x) against m, per row. With ``memory`` (the memory-bound operators'
    seconds of each row): [c0, c1, c2], c2 per second of those on top (SPLIT_PHASES)."""
    columns = [np.ones_like(x), x] + ([] if memory is None else [memory])
    design = np.column_stack(columns) / m[:, None]
    target = r / m

    def solve(rows):
        return np.linalg.lstsq(design[rows], target[rows], rcond=None)[0]
    coef = solve(np.arange(len(x)))
    errs = [abs((m[i] - r[i] + (design[i] * m[i]) @ solve(np.arange(len(x)) != i)) / m[i] - 1.0)
            for i in range(len(x))]
    return coef, np.array(errs)


def _ratio_curve(x: np.ndarray, m: np.ndarray, line_errors: np.ndarray) -> Optional[dict]:
    """A layer's in-situ time over its operators' (m / x) interpolated over log x between the
    measured shapes, when that predicts the interior shapes, each left out in turn, better than
    the straight residual does (``line_errors``: its leave-one-out errors, _residual_fit's).
    The ratio is not linear in the operators: on this project's CPU it fell from ~1.5 at 3 ms
    of operators per layer to ~1.15 at 20 ms and ~1.01 at 300 ms, and a line through all of
    them under-predicted the shapes between."""
    order = np.argsort(x)
    x, m, line_errors = x[order], m[order], line_errors[order]
    if len(x) < 4 or len(np.unique(x)) != len(x) or np.any(x <= 0):
        return None
    lx, ratio = np.log(x), m / x
    inter = [abs(np.interp(lx[i], np.delete(lx, i), np.delete(ratio, i)) * x[i] / m[i] - 1.0)
             for i in range(1, len(x) - 1)]
    line = line_errors[1:-1]
    if np.mean(inter) >= np.mean(line):
        return None
    return {"ratios": [[float(a), float(b)] for a, b in zip(x, ratio)],
            "loo_mape_interior": float(np.mean(inter)),
            "loo_mape_interior_linear": float(np.mean(line))}


def _ratio_range(r: np.ndarray, m: np.ndarray) -> dict:
    """{"ratio_range": [lowest, highest]} of the measured times over their operators' (m - r)
    among the rows: how far below (or above) its operators' sum a real phase was seen to run.
    A line fitted through these rows can leave that range outside them -- with a negative fixed
    part it crosses zero below the smallest shape -- so the terms keep a phase at no lower
    ratio than the lowest here (corrections.engine.Residual.floor). Empty when no row has both times
    positive (nothing measured to bound it by)."""
    operators = m - r
    ok = (operators > 0) & (m > 0)
    if not ok.any():
        return {}
    ratio = m[ok] / operators[ok]
    return {"ratio_range": [float(ratio.min()), float(ratio.max())]}


# Per term, what the residual grows with (estimate.EngineTerms reads the same names). Inside a
# layer the operators run slower than alone by a fraction of their own time (operands no longer
# in cache) plus a fixed cost (the glue ops' dispatch); outside the layers the residual is the
# loss's extra passes over the logits plus a fixed cost.
ENGINE_FEATURES = {"layer_forward": "operators", "layer_backward": "operators",
                   "other_forward": "logits", "other_backward": "logits"}
# The phases whose residual also grows with the memory-bound operators' own seconds
# (Residual.per_memory). A layer's backward reads what its forward saved, evicted from the
# caches since, and its memory-bound operators (norm, softmax, mask, activation backward) are
# little arithmetic per byte: the operator benchmark times each warm, so in training they run
# slower than alone far more than its GEMMs do. Chosen for that reason, then checked on the 16
# calibrations stored at stops 48-55 (`python benchmarks/layer_residuals.py DIR ...`): one line
# fitted every unfused-attention shape set (mask and softmax over s x s) under its measured time
# in 16 of 16 (-0.1% to -3.4% on average) and the flash ones over in 15; with the memory-bound
# operators beside it the backward's leave-one-out error over the shapes fell from 4.98% to
# 4.11% (lower in 11 of 16), their coefficient positive in all 16 (+0.26 to +3.20, median +1.60).
# Not the forward: there each memory-bound operator reads what the one before it just wrote, and
# the same split fitted worse (5.31% -> 6.09%, lower in 3 of 16; docs/engine-terms.md).
SPLIT_PHASES = ("layer_backward",)


# DeepSpeed's ZeRO stage-1/2 optimizer (runtime/zero/stage_1_and_2.py), as the engine
# calibration's ZeRO pass times it (calibration.engine._measure_zero), split where its cost
# scales differently:
# - zero_reduce: the gradient reduction at the accumulation boundary without its all-reduce.
#   Every gradient is copied into the reduce bucket, averaged, flattened again for the
#   all-reduce (which is of the whole gradient: reduce_scatter with the default
#   use_multi_rank_bucket_allreduce all-reduces and keeps the rank's slices), and the rank's
#   own slices are copied out: per parameter of the stage, whatever the partition.
# - zero_step: the step without its all-gather: gradient norm (and its one-element all-reduce,
#   where ranks wait for each other), flattening and clipping the partition's gradients, the
#   optimizer on one flat fp32 partition, the copy back into the model's parameters: per
#   parameter of the rank's partition. It replaces the operator-level optimizer prediction.
# - dp_allreduce / dp_allgather: those two collectives as training runs them, the whole model
#   at once (the collective benchmark's linear fit under-predicts such sizes), for groups of
#   the processes the pass ran. The plain optimizer's all-reduce is the same collective.
def _fit_zero(rows: dict) -> Tuple[dict, List[FitRow]]:
    from ..baseline import fit_nonnegative

    rows = [r for r in rows.values() if r.get("params")]
    if not rows:
        return {}, []
    terms: dict = {}
    table: List[FitRow] = []
    stage, processes = int(rows[0]["zero_stage"]), int(rows[0]["processes"])

    def linear(name, x, y, unit, what, **extra):
        x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
        design = np.column_stack([np.ones_like(x), x])
        coef, _ = fit_nonnegative(design, y)
        err = float(np.mean(np.abs(design @ coef / y - 1.0)))
        terms[name] = {"coef": {"t0": float(coef[0]), unit: float(coef[1])}, "rows": len(x),
                       "in_sample_mape": err, "sampled": [float(x.min()), float(x.max())], **extra}
        table.append(FitRow(f"engine {name}", "-", len(x), "engine term", {"chosen": err},
                            f"{what}; in-sample; t0 {coef[0] * 1e3:.2f} ms, "
                            f"{coef[1] * 1e9:.3g} ns per {unit[len('per_'):]}"))

    linear("zero_reduce", [r["params"] for r in rows], [r["reduce"] for r in rows], "per_param",
           f"ZeRO-{stage} gradient reduction beside its all-reduce", stage=stage, processes=processes)
    linear("zero_step", [r["partition"] for r in rows], [r["step"] for r in rows], "per_param",
           f"ZeRO-{stage} step beside its all-gather, per partition parameter", stage=stage,
           processes=processes)
    if processes > 1:
        for name, key in (("dp_allreduce", "allreduce"), ("dp_allgather", "allgather")):
            pts = [(r[f"{key}_elements"], r[key]) for r in rows if r.get(f"{key}_elements")]
            if not pts:
                continue
            pooled = [(r[f"{key}_elements"], [float(x[key]) for x in r["repeats"]])
                      for r in rows if r.get(f"{key}_elements") and r.get("repeats")]
            # Kept as measured and interpolated, not fitted: on a CPU the cost per element
            # jumps with size (gloo's all-gather on a 2-core VM: twice the time per element
            # above ~8e6 elements per rank), which one straight line spreads over every size.
            curve = _pooled_size_curve(pooled) if len(pooled) == len(pts) else _size_curve(pts)
            x, y = (np.array(c, dtype=float) for c in zip(*curve))
            errs = [abs(np.interp(x[i], np.delete(x, i), np.delete(y, i)) / y[i] - 1.0)
                    for i in range(1, len(x) - 1)]
            loo = float(np.mean(errs)) if errs else None
            # calibration.engine keeps the collective's median repeat, its fastest beside it
            spread = [r[key] / r[f"{key}_best"] for r in rows if r.get(f"{key}_best", 0) > 0]
            extra = {"median_over_fastest": float(np.median(spread))} if spread else {}
            terms[name] = {"points": [[float(a), float(b)] for a, b in curve], "rows": len(pts),
                           "processes": processes, "sampled": [float(x[0]), float(x[-1])],
                           "loo_mape": loo, **extra}
            table.append(FitRow(f"engine {name}", "-", len(pts), "engine term", {"chosen": loo},
                                f"data-parallel {key} in a ZeRO step, {processes} processes: "
                                f"{len(curve)} sizes interpolated, {y[0] / x[0] * 1e9:.3g} to "
                                f"{y[-1] / x[-1] * 1e9:.3g} ns per element"
                                + (f"; median repeat, {extra['median_over_fastest']:.2f}x the "
                                   f"fastest" if extra else "")))
    return terms, table


def _merged_curve(groups, width: float, combine) -> List[List[float]]:
    """[[elements, seconds]] by size from (elements, [seconds...]) groups: groups whose sizes
    are within ``width`` of the first of them are one size, its seconds ``combine`` of all
    their values, and no larger size faster than a smaller one."""
    curve: List[List[float]] = []
    values: List[float] = []
    for e, times in sorted((float(e), [float(t) for t in ts]) for e, ts in groups):
        if curve and e <= curve[-1][0] * width:
            values += times
        else:
            values = times
            curve.append([e, 0.0])
        curve[-1][1] = float(combine(values))
    for i in range(1, len(curve)):
        curve[i][1] = max(curve[i][1], curve[i - 1][1])
    return curve


def _size_curve(pts) -> List[List[float]]:
    """From one value per shape (rows stored before the repeats were kept): sizes within 2% of
    each other are one size, its fastest measurement kept (interference only ever adds time)."""
    return _merged_curve([(e, [sec]) for e, sec in pts], 1.02, min)


POOL_WIDTH = 1.10  # sizes within 10% of the smallest of them: one size, their repeats pooled


def _pooled_size_curve(groups) -> List[List[float]]:
    """From every timed repeat: the repeats of shapes whose sizes are within POOL_WIDTH of each
    other pooled, the median of the pool kept. A data-parallel collective in a step waits for
    the other rank and shares the cores with gloo's threads: its repeats spread 2-4x (87-338
    ms for one size here), so five repeats of one shape give a median that moves by 2x between
    two calibrations; the pool of every shape near a size (up to 25 repeats) holds still."""
    return _merged_curve(groups, POOL_WIDTH, np.median)


# Which of an engine shape's timed repeats a term is fitted on (calibration/engine.py stores
# them all beside the fastest): see typical_row. The median: a prediction is for the typical
# iteration, what a run costs, and validate and report compare it with the median iteration.
# Refitting two quiet calibrations of this 2-core machine both ways and predicting the same 21
# launches (benchmarks/calibrate_twice.py, validate_local.py): against the median iteration,
# MAPE 5.4% / 6.0% with the fastest repeats (mean signed -4.3% / -5.1%: too fast), 4.4% / 4.7%
# with the medians (-2.6% / -3.6%); the two calibrations' disagreement 2.06% either way.
STATISTIC = "median"


def typical_row(row: dict, statistic: str = STATISTIC) -> dict:
    """An engine measurement's row with each phase at ``statistic`` over its timed repeats:
    "fastest" as measured (the row's own values), "median" the middle repeat of each phase.
    A row written before repeats were stored keeps its values."""
    if statistic not in ("fastest", "median"):
        raise ValueError(f"statistic must be fastest or median, got {statistic!r}")
    repeats = row.get("repeats")
    if statistic == "fastest" or not repeats:
        return row
    out = dict(row)
    for key in repeats[0]:
        values = [float(r[key]) for r in repeats if key in r]
        if values:
            out[key] = float(np.median(values))
    return out


def fit_engine(profile, engine_path, tp_path=None, extra_rows=None,
               statistic: str = STATISTIC) -> Tuple[dict, List[FitRow]]:
    """The profile's "engine" section from the engine calibration (calibrate.run_engine) and,
    when given, the in-training tensor-parallel all-reduce benchmark (calibrate.run_tp_benchmark).
    ``extra_rows(profile)``: more rows per term, in the row forms built below, from training
    runs (neox_perf.runs.engine_rows.EngineRows, for `calibrate --from-run`)."""
    from ..baseline import fit_nonnegative

    from neox_perf.profile import one_speed

    # the engine's repeats at the speed the profile's operator samples were fitted at (none
    # such: as timed), so that a residual is the engine's own cost, not the machine's speed
    # between the two steps (profile/one_speed.py)
    at = one_speed.of_profile(profile)
    data = one_speed.engine_data(json.loads(Path(engine_path).read_text()), at,
                                 getattr(getattr(profile.manifest, "calibration", None), "dtype", None))
    shapes = data.get("shapes", {})
    precision = None
    layer_f, layer_b, other_f, other_b, steps, flat, acc = ([] for _ in range(7))
    for row in shapes.values():
        row = typical_row(row, statistic)
        n, precision = int(row["layers"]), row["precision"]
        pred = _engine_prediction(profile, row["keys"], row["vocab"], precision)
        v = pred["logits_elements"]
        for rows, x, measured, predicted, memory in (
                (layer_f, pred["layer_forward"], row["layer_forward"] / n, pred["layer_forward"],
                 pred["layer_forward_memory"]),
                (layer_b, pred["layer_backward"], row["layer_backward"] / n, pred["layer_backward"],
                 pred["layer_backward_memory"]),
                (other_f, v, row["forward"] - row["layer_forward"], pred["other_forward"], 0.0),
                (other_b, v, row["backward"] - row["layer_backward"], pred["other_backward"], 0.0)):
            rows.append((x, measured - predicted, measured, memory))
        steps.append((row["tensors"], row["params"], row["step"]))
        flat.append((row["params"], row["flatten"]))
        acc.append((row["tensors"], row["params"], row["accumulate"]))
    if not layer_f:
        raise ValueError(f"{engine_path}: no engine calibration measurements")
    more = extra_rows(profile) if extra_rows is not None else {}
    for name, rows in (("layer_forward", layer_f), ("layer_backward", layer_b),
                       ("other_forward", other_f), ("other_backward", other_b),
                       ("optimizer_step", steps), ("grad_flatten", flat), ("grad_accumulate", acc)):
        rows.extend(more.get(name, ()))
    terms: dict = {"precision": precision, "shapes": sorted(shapes), "source": str(engine_path),
                   "statistic": statistic}
    if at is not None:
        terms["one_speed"] = at.to_dict()
    if any(more.values()):
        terms["extra_rows"] = {k: len(v) for k, v in more.items() if v}
    table: List[FitRow] = []
    for name, rows in (("layer_forward", layer_f), ("layer_backward", layer_b),
                       ("other_forward", other_f), ("other_backward", other_b)):
        x, r, m, memory = (np.array(col, dtype=float) for col in zip(*rows))
        coef, loo = _residual_fit(x, r, m, memory if name in SPLIT_PHASES else None)
        loo_mean, loo_max = float(np.mean(loo)), float(np.max(loo))
        raw = float(np.mean(np.abs((m - r) / m - 1.0)))
        feature = ENGINE_FEATURES[name]
        terms[name] = {"seconds": float(coef[0]), "per_unit": float(coef[1]), "feature": feature,
                       "rows": len(rows), "operators_only_mape": raw, "loo_mape": loo_mean,
                       "loo_max": loo_max, "sampled": [float(x.min()), float(x.max())]}
        terms[name].update(_ratio_range(r, m))
        what = (f"+{coef[1]:.1%} of the operators + {coef[0] * 1e3:.2f} ms" if feature == "operators"
                else f"{coef[1] * 1e9:+.3g} ns per logit + {coef[0] * 1e3:.2f} ms")
        if len(coef) > 2:
            terms[name]["per_memory"] = float(coef[2])
            what += f" + {coef[2]:.1%} of the memory-bound ones"
        chosen = loo_mean
        if feature == "operators":
            interp = _ratio_curve(x, m, loo)
            if interp is not None:
                terms[name].update(interp)
                chosen = interp["loo_mape_interior"]
                what = (f"interpolated between the {len(interp['ratios'])} measured shapes, "
                        f"outside them {what}")
        table.append(FitRow(f"engine {name}", "-", len(rows), "engine term",
                            {"baseline": raw, "chosen": chosen},
                            f"{what}; leave-one-out max {100 * loo_max:.1f}%"))
    for name, rows, cols in (("optimizer_step", steps, ("t0", "per_tensor", "per_param")),
                             ("grad_flatten", flat, ("t0", "per_param")),
                             ("grad_accumulate", acc, ("per_tensor", "per_param"))):
        arr = np.array(rows, dtype=float)
        y = arr[:, -1]
        design = arr[:, :-1] if name == "grad_accumulate" else np.column_stack([np.ones(len(arr)), arr[:, :-1]])
        coef, info = fit_nonnegative(design, y)
        err = float(np.mean(np.abs(design @ coef / y - 1.0)))
        terms[name] = {"coef": dict(zip(cols, (float(v) for v in coef))), "rows": len(rows),
                       "in_sample_mape": err}
        table.append(FitRow(f"engine {name}", "-", len(rows), "engine term", {"chosen": err},
                            "in-sample; " + ", ".join(f"{k} {v:.3g}" for k, v in terms[name]["coef"].items())))
    zero_terms, zero_table = _fit_zero({k: typical_row(r, statistic)
                                        for k, r in (data.get("zero") or {}).items()})
    terms.update(zero_terms)
    table += zero_table
    if tp_path is not None and Path(tp_path).is_file():
        tp = json.loads(Path(tp_path).read_text())
        elements, mean = np.array(tp["elements"], dtype=float), np.array(tp["mean"], dtype=float)
        coef, _ = fit_nonnegative(np.column_stack([np.ones_like(elements), elements]), mean)
        err = float(np.mean(np.abs((coef[0] + coef[1] * elements) / mean - 1.0)))
        terms["tp_allreduce"] = {"coef": {"t0": float(coef[0]), "per_element": float(coef[1])},
                                 "processes": int(tp["processes"]), "rows": len(elements),
                                 "in_sample_mape": err, "sampled": [float(elements.min()), float(elements.max())]}
        table.append(FitRow("engine tp_allreduce", "-", len(elements), "engine term", {"chosen": err},
                            f"in training (after compute, no barrier); t0 {coef[0] * 1e3:.2f} ms, "
                            f"{coef[1] * 1e9:.3g} ns per element"))
    tp_terms, tp_table = _fit_tensor_parallel(profile, data.get("tp") or {}, terms, statistic)
    terms.update(tp_terms)
    table += tp_table
    arrival = fit_arrival(shapes, data.get("processes"))
    if arrival is not None:
        terms["dp_arrival"] = arrival
        lo, hi = arrival["quartiles"]
        table.append(FitRow("engine dp_arrival", "-", arrival["repeats"], "engine term", {},
                            f"replicas wait {arrival['fraction']:.1%} of the work since they met "
                            f"(quartiles {lo:.1%}-{hi:.1%}; {arrival['processes']} processes)"))
    return terms, table


# Data-parallel replicas run the same work between two gradient all-reduces, but not at the same
# speed: each waits at the all-reduce for the slowest. The engine's plain pass runs its peers in
# lockstep and stores, per repeat, each peer's forward + backward (calibration/engine.py,
# PEER_KEYS); the collective benchmarks and the ZeRO pass time their all-reduces after a
# barrier, so nothing else holds that wait. On this project's 2-core CPU the dp 2 launches spent
# 20-120 ms more in their gradient sync than priced, and the dp 2 class sat under its sitting's
# level in 31 of 32 cells (docs/validation.md, stop 50). One number: the mean wait per second
# of work, over every repeat of every shape (their slowest-peer leads summed over their work
# summed), so a small shape's scheduler hiccup (12 ms of 80 ms in one repeat) weighs as little
# as its work; the per-repeat shares' median and quartiles stay beside it. Applied in
# proportion to the work since the replicas last met (a scratch run of 1, 2 and 4 micro-batches
# between all-reduces, twice: 3.9/1.7/2.8% and 2.2/2.1/1.6% of it; not shrinking as 1/sqrt(k),
# as independent per-micro-batch jitter would), held at the measured group's size beyond it.
ARRIVAL_MIN_REPEATS = 6


def fit_arrival(shapes: dict, processes) -> Optional[dict]:
    """The manifest's dp_arrival term from the plain pass's rows; None when its peers' times
    were not stored (one process, or an engine file from before) or too few."""
    pairs = [(float(r["arrival"]), float(r["busy"])) for row in shapes.values()
             for r in row.get("repeats") or () if "arrival" in r and float(r["busy"]) > 0]
    if not processes or int(processes) < 2 or len(pairs) < ARRIVAL_MIN_REPEATS:
        return None
    waited, work = (sum(col) for col in zip(*pairs))
    q1, med, q3 = (float(v) for v in np.percentile([a / b for a, b in pairs], [25, 50, 75]))
    return {"fraction": min(waited / work, 0.5), "processes": int(processes), "repeats": len(pairs),
            "median": med, "quartiles": [q1, q3]}


# A tensor-parallel model in training against the same model priced from its parts. Per
# layer: its operators (each rank's share), the layer residual above, and its all-reduces at
# the tp_allreduce term (the collective benchmark where there is none); outside the layers
# (embedding, head, NeoX's vocab-parallel loss): their operators, the other_ residual and
# their all-reduces. On this project's 2-core CPU the mp 2 layouts of three sittings ran their
# forward 7-28% and their all-reduces 8-55% slower than that sum (docs/validation.md): the
# ranks meet at every all-reduce, each waits for the other and for gloo's threads on the
# shared cores, and the benchmark's GEMM before each all-reduce is not a layer. The engine's
# tensor-parallel pass times the real thing (calibration/engine.py). Each term is one ratio,
# measured over parts, the median over the pass's shapes: the ratios are noisy (a
# tensor-parallel phase's repeats spread 1.1-2x here), and on the same two stores a line in
# the parts' seconds (as the layer terms) made the two calibrations' mp 2 predictions up to
# 4.3 points apart where the ratio kept them within 2.5 (docs/validation.md). A ratio also
# stays bounded past the measured shapes. It applies only where the phase's all-reduces are
# one node's group of the pass's size.
TP_TERMS = ("tp_layer_forward", "tp_layer_backward", "tp_other_forward", "tp_other_backward")


def _priced_comm(profile, base, calls) -> float:
    """Seconds of these all-reduce calls as estimate prices them (the engine's tp_allreduce
    term for its group, else the profile's collective samples)."""
    total = 0.0
    for call in calls:
        seconds = base.tp_allreduce(call)
        if seconds is None:
            seconds = float(profile.predict_collective(call.kind, call.elements, call.nodes,
                                                       call.gpus_per_node).seconds)
        total += seconds * call.count
    return total


def _fit_tensor_parallel(profile, rows: dict, terms: dict, statistic: str
                         ) -> Tuple[dict, List[FitRow]]:
    from neox_perf.prediction.corrections import EngineSection, EngineTerms

    rows = [typical_row(r, statistic) for r in rows.values() if r.get("params")]
    if not rows:
        return {}, []
    base = EngineTerms(EngineSection.parse(terms, "engine terms being fitted"), 1, 0)
    processes = int(rows[0]["model_parallel_size"])
    preds = [_engine_prediction(profile, row["keys"], row["vocab"], row["precision"]) for row in rows]
    try:
        return _fit_tensor_parallel_rows(profile, rows, base, preds, processes)
    except ProfileError as exc:  # e.g. no all-reduce samples: the parts cannot be priced
        return {}, [FitRow("engine tp_layer_forward", "-", len(rows), "engine term", {},
                           f"not fitted: the mp {processes} parts cannot be priced ({exc.line()})")]


def _fit_tensor_parallel_rows(profile, rows, base, preds, processes) -> Tuple[dict, List[FitRow]]:
    fitted: dict = {}
    table: List[FitRow] = []
    for name in TP_TERMS:
        where, phase = name.split("_")[1:]
        x, m = [], []
        for row, pred in zip(rows, preds):
            ops = pred[f"{where}_{phase}"]
            comm = _priced_comm(profile, base, pred[f"{where}_{phase}_comm"])
            if where == "layer":
                n = int(row["layers"])
                parts = ops + base.layer(phase, ops, pred[f"layer_{phase}_memory"]) + comm
                measured = row[f"layer_{phase}"] / n
            else:
                parts = ops + base.other(phase, ops, pred["logits_elements"]) + comm
                measured = row[phase] - row[f"layer_{phase}"]
            x.append(parts)
            m.append(measured)
        x, m = np.array(x, dtype=float), np.array(m, dtype=float)
        ratios = m / x
        per_unit = float(np.median(ratios)) - 1.0
        loo = np.array([abs(np.median(np.delete(ratios, i)) / ratios[i] - 1.0)
                        for i in range(len(x))]) if len(x) > 1 else None
        fitted[name] = {"seconds": 0.0, "per_unit": per_unit, "feature": "parts",
                        "processes": processes, "rows": len(x),
                        "parts_only_mape": float(np.mean(np.abs(x / m - 1.0))),
                        "loo_mape": None if loo is None else float(np.mean(loo)),
                        "loo_max": None if loo is None else float(np.max(loo)),
                        "sampled": [float(x.min()), float(x.max())],
                        "ratio_range": [float(ratios.min()), float(ratios.max())]}
        table.append(FitRow(f"engine {name}", "-", len(x), "engine term",
                            {"baseline": fitted[name]["parts_only_mape"],
                             "chosen": fitted[name]["loo_mape"]},
                            f"mp {processes} {where} {phase} in training over its parts: x{1 + per_unit:.3f} "
                            f"(median; measured / parts {ratios.min():.2f} to {ratios.max():.2f})"
                            + ("" if loo is None else f"; leave-one-out max {100 * np.max(loo):.1f}%")))
    return fitted, table


ENGINE_NOTE = ("engine terms (manifest 'engine'): measured by running the reference workload's model "
               "under one-process DeepSpeed engines, one per device in lockstep, at the calibration "
               "shapes; they add what the operator benchmarks miss (layer glue, cold operands, NeoX's "
               "loss, DeepSpeed's optimizer step, gradient flattening and accumulation, devices sharing "
               "memory bandwidth, tensor-parallel all-reduces waiting for each other); a second pass "
               "runs ZeRO-1 with the processes as one data-parallel group (the ZeRO optimizer's own "
               "work, and its whole-model all-reduce and all-gather as training runs them)")
TP_NOTE = ("engine tp_ terms: a third pass runs the calibration models tensor parallel (the "
           "processes groups of two, as NeoX's mpu splits them) and fits what a tensor-parallel layer, "
           "and the embedding, head and loss, cost in training beyond their operators, residuals and "
           "all-reduces; applied to tensor-parallel groups of that size on one node only")


def add_engine(profile_dir, engine_path, tp_path=None, extra_rows=None,
               statistic: str = STATISTIC) -> List[FitRow]:
    """Fit the engine terms against the profile in ``profile_dir`` and add them to its manifest
    (a new version of the profile, swapped in whole)."""
    from ..profile import load_profile
    terms, table = fit_engine(load_profile(profile_dir), engine_path, tp_path, extra_rows, statistic)
    section = EngineSection.parse(terms, f"{engine_path}: fitted engine terms")

    wanted = (ENGINE_NOTE, TP_NOTE) if any(n in section.residuals for n in TP_TERMS) \
        else (ENGINE_NOTE,)

    def with_engine(manifest):  # a refit without the tensor-parallel pass drops its note
        notes = tuple(n for n in manifest.notes if n != TP_NOTE)
        return replace(manifest, engine=section, notes=notes + tuple(n for n in wanted if n not in notes))
    update_profile(profile_dir, with_engine)
    return table
