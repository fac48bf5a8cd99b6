"""A cluster profile fitted from this machine's own calibration store (`neox-perf calibrate`).

The same trainer as the bundled profiles: the samples go through cleaning.clean, then
fit.fit_one (robust physical baseline, trees on its log residual, RandomForest vs XGBoost
on one seeded 80/20 split, the winner refitted on all rows), then export and the same
manifest + arrays.npz layout. Only the samples' source and the cluster facts differ.

Facts are what this machine can say about itself, each marked as measured or read:
- device name and memory: the store's device fingerprint; on a CPU the "GPU memory" is the
  total RAM (/proc/meminfo), since a CPU rank allocates from it;
- gpus_per_node: the process count the collectives were launched with;
- peak rate and memory bandwidth: the highest rates the samples themselves reached, not a
  data sheet (nobody publishes an honest peak for one core of a shared VM). The cleaning
  rejects rows faster than these limits times its slack, so with measured limits it rejects
  nothing for being too fast and only the outlier rules apply;
- links: "shared memory (gloo)" on a CPU, at the fastest bus bandwidth measured; nothing
  crosses nodes in a one-node calibration, so the inter-node link is marked unmeasured.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from neox_perf import opspec

from . import cleaning, extrapolate, fit, gpus
from .artifacts import ARRAYS_FILE, MANIFEST_FILE, SCHEMA, SCHEMA_VERSION
from .facts import ClusterFacts, Link
from .samples import COLLECTIVE_PHASE, FileRecord, TrainingSet, sha256_of
from .train import _ArrayPool, _versions, fit_set, write_profile

GEMMS = ("linear1", "linear2", "linear3", "linear4", "linear_final", "qk", "av")
Progress = Callable[[int, int, str], None]


@dataclass
class FitRow:
    """One line of the closing validation table."""

    op: str
    phase: str
    rows: int
    model: str  # random_forest | xgboost | baseline | derived
    validation: Dict[str, Optional[float]] = field(default_factory=dict)  # MAPE, fractions
    note: str = ""

    def to_dict(self) -> dict:
        return {"op": self.op, "phase": self.phase, "rows": self.rows, "model": self.model,
                "validation_mape": dict(self.validation), "note": self.note}


@dataclass
class LocalFit:
    path: Path
    manifest: dict
    table: List[FitRow]
    dropped: Dict[str, Dict[str, int]]
    seconds: float


def _finite(v) -> Optional[float]:
    return float(v) if v is not None and np.isfinite(v) else None


def total_ram_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _max_rate(sets, ops, quantity) -> float:
    best = 0.0
    for (op, phase), ts in sets.items():
        if op in ops and phase != COLLECTIVE_PHASE and len(ts):
            best = max(best, float(np.max(quantity(op, phase, ts.features) / ts.seconds)))
    return best


def _precision(dtype: Optional[str]) -> str:
    """The calibration's dtype as the GPU table names precisions (fp16 where unstated)."""
    try:
        return gpus.precision_key(dtype) if dtype else "fp16"
    except ValueError:
        return "fp16"


def measured_facts(name: str, fingerprint: dict, sets, gpus_per_node: int) -> Tuple[ClusterFacts, List[str]]:
    """Facts for a profile of this machine, and notes saying where each number came from."""
    cpu = fingerprint.get("kind") != "cuda"
    device = str(fingerprint.get("device_name") or "unknown device")
    memory = fingerprint.get("memory_bytes") if not cpu else total_ram_bytes()
    ops = [op for op in opspec.OPERATORS]
    flops = _max_rate(sets, GEMMS, opspec.op_flops) or _max_rate(sets, ops, opspec.op_flops)
    nbytes = _max_rate(sets, ops, opspec.op_bytes)
    wire = 0.0
    for (kind, phase), ts in sets.items():
        if phase == COLLECTIVE_PHASE and len(ts):
            f = ts.features
            bytes_ = opspec.collective_wire_bytes(kind, f["elements"], f["nodes"] * f["gpus_per_node"])
            wire = max(wire, float(np.max(bytes_ / ts.seconds)))
    # fitting divides by these: a store without GEMMs or collectives still needs a positive limit
    flops, nbytes, wire = flops or 1e9, nbytes or 1e9, wire or 1e8
    peers = max(gpus_per_node - 1, 1)
    link_name = "shared memory (gloo)" if cpu else "intra-node (nccl)"
    facts = ClusterFacts(
        name=name,
        gpu_name=f"{device} (CPU)" if cpu else device,
        gpu_memory_bytes=int(memory or 0),
        gpus_per_node=int(gpus_per_node),
        intra_node_link=Link(link_name, wire * peers / 1e9, 1),
        inter_node_link=Link("not measured (one-node calibration)", wire / 1e9, 1),
        peak_fp16_tflops=flops / 1e12,
        hbm_bandwidth_gbps=nbytes / 1e9,
    )
    what = "CPU stand-in for a GPU" if cpu else "GPU"
    notes = [
        f"{what}: facts measured on this machine by `neox-perf calibrate`, not from a data sheet",
        f"peak_fp16_tflops is the fastest GEMM rate the samples reached ({flops / 1e9:.3g} GFLOP/s"
        f" at {fingerprint.get('torch_threads', '?')} thread(s)), hbm_bandwidth_gbps the fastest "
        f"byte rate of any operator sample ({nbytes / 1e9:.3g} GB/s, caches included)",
        f"gpus_per_node = {gpus_per_node}: the processes the collectives were launched with",
        f"intra_node_link: fastest measured bus bandwidth {wire / 1e9:.3g} GB/s per peer link; "
        f"the inter-node link was not measured and is set to the same value",
    ]
    if cpu:
        notes.insert(1, "gpu_memory_bytes is the machine's total RAM, which CPU ranks share")
    return facts, notes


def _device_of(store, device: Optional[int]) -> Tuple[int, dict]:
    devices = store.devices()
    if not devices:
        raise ValueError(f"{store.path}: no calibration samples yet; run `neox-perf calibrate` first")
    if device is None:
        counts: Dict[int, int] = {}
        for s in store.samples(source="calibrate"):
            counts[s.device_id] = counts.get(s.device_id, 0) + 1
        if not counts:
            raise ValueError(f"{store.path}: no calibration samples yet")
        device = max(counts, key=lambda d: (counts[d], d))  # the device calibrated most
    if device not in devices:
        raise ValueError(f"{store.path}: no device {device}")
    return int(device), devices[device]


def _collective_processes(store, device: int) -> Optional[int]:
    runs = [r for r in store.runs() if r["device_id"] == device and r["plan"] == "collectives"
            and r["info"].get("gpus_per_node")]
    return int(runs[-1]["info"]["gpus_per_node"]) if runs else None


def training_sets(store_path, *, device: Optional[int] = None, dtype: Optional[str] = None,
                  source: Optional[str] = None):
    """The samples as the predictors' TrainingSets, keyed by (op, phase) like load_cluster.

    ``file_index`` is 0 (the store) and ``line`` the sample id, so a row the cleaning drops
    can be traced back. One device and one dtype at a time: mixing two machines (or fp16
    with bf16) in one regressor would fit neither; pass device= / dtype= to choose.
    """
    from neox_perf.calibration.store import SampleStore, feature_names

    with SampleStore(store_path) as store:
        samples = store.samples(device=device, source=source)
    if dtype is not None:
        samples = [s for s in samples if s.dtype == dtype]
    for name, values in (("device", {s.device_id for s in samples}), ("dtype", {s.dtype for s in samples})):
        if len(values) > 1:
            raise ValueError(f"{store_path}: samples of several {name}s ({', '.join(map(str, sorted(values)))}); "
                             f"pass {name}= to choose one")
    groups: Dict[Tuple[str, str], list] = {}
    for s in samples:
        groups.setdefault((s.op, s.phase), []).append(s)
    return {(op, phase): TrainingSet(
                op, phase, {n: np.array([s.features[n] for s in group], dtype=float)
                            for n in feature_names(op)},
                np.array([s.seconds for s in group], dtype=float),
                np.zeros(len(group), dtype=np.int64), np.array([s.id for s in group], dtype=np.int64))
            for (op, phase), group in groups.items()}


def fit_store(store_path, name: str, out_dir, *, device: Optional[int] = None,
              dtype: Optional[str] = None, gpus_per_node: Optional[int] = None,
              grid=None, progress: Optional[Progress] = None,
              extra_notes: Tuple[str, ...] = (), source: Optional[str] = "calibrate") -> LocalFit:
    """Fit every (op, phase) and collective of one device in the store; write the profile
    to ``out_dir`` (manifest.json + arrays.npz, replaced atomically); return it with the
    per-operator validation table. ``grid``: fit.candidates() by default. ``source``: the
    samples to fit, "calibrate" by default; None adds the training-run samples that
    `calibrate --from-run` merged into the store."""
    from neox_perf.calibration.store import SampleStore

    started = time.perf_counter()
    store_path = Path(store_path)
    with SampleStore(store_path) as store:
        device, fingerprint = _device_of(store, device)
        runs = [r for r in store.runs() if r["device_id"] == device]
        procs = gpus_per_node or _collective_processes(store, device) or 1
    dtypes = {r["info"].get("dtype") for r in runs if r["info"].get("dtype")}
    if dtype is None and len(dtypes) == 1:
        dtype = dtypes.pop()
    sets = training_sets(store_path, device=device, dtype=dtype, source=source)
    facts, fact_notes = measured_facts(name, fingerprint, sets, procs)
    record = FileRecord(store_path, "store", "calibration", used_for="all", sha256=sha256_of(store_path),
                        rows=int(sum(len(ts) for ts in sets.values())))
    cleaned = cleaning.clean(sets, [record], facts, precision=_precision(dtype))
    pool = _ArrayPool()
    operators: Dict[str, Dict[str, dict]] = {}
    collectives: Dict[str, dict] = {}
    table: List[FitRow] = []
    notes: List[str] = list(extra_notes) + fact_notes + list(cleaned.notes)
    for (op, phase), derived in sorted(cleaned.derived.items()):
        operators.setdefault(op, {})[phase] = {"derived": derived.to_dict()}
        table.append(FitRow(op, phase, 0, "derived", {}, f"{derived.source_phase} model ({derived.scale})"))
    todo = [(k, ts) for k, ts in sorted(cleaned.sets.items()) if len(ts)]
    for i, ((op, phase), ts) in enumerate(todo):
        if progress is not None:
            progress(i, len(todo), f"{op} {phase}")
        result = fit_set(f"{name}/{op}/{phase}", op, phase, ts, facts, grid, pool, operators,
                         collectives, notes)
        v = {k: _finite(x) for k, x in result.validation.items()}
        table.append(FitRow(op, phase, len(ts), result.chosen, v,
                            result.validation_detail.get("reason", "")))
    if progress is not None:
        progress(len(todo), len(todo), "done")
    add_efficiency_curves(operators, todo)
    if not collectives:
        notes.append("no collective samples: predictions of multi-process layouts will fail; "
                     "run the collectives calibration (see `neox-perf calibrate --help`)")
    manifest = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "facts": facts.to_dict(),
        "notes": notes,
        "provenance": {
            "source": f"neox-perf calibrate on {facts.gpu_name}",
            "license": "n/a (own measurements)",
            "store": str(store_path.resolve()),
            "samples": source or "all",
            "device_id": device,
            "fingerprint": fingerprint,
            "runs": [{"id": r["id"], "plan": r["plan"], "started": r["started"],
                      "finished": r["finished"]} for r in runs],
            "files": [record.to_dict()],
        },
        "calibration": {"dtype": dtype, "device": fingerprint.get("kind"),
                        "threads": fingerprint.get("torch_threads"),
                        "processes": procs},
        "training": {
            "library_versions": _versions(),
            "validation": "one seeded 80/20 split per op/phase; MAPE on seconds; chosen model refitted on all rows",
            "tree_input": "natural log of each varying feature, cast to float32; target log(seconds / baseline)",
            "grid": [[k, p] for k, p in (grid if grid is not None else fit.candidates())],
            "seconds": None,
        },
        "arrays": {"file": ARRAYS_FILE, "sha256": None, "models": pool.models, "nodes": pool.nodes,
                   "trees": pool.trees},
        "operators": operators,
        "collectives": collectives,
        "extrapolation": extrapolate.MARKER,
    }
    out_dir = Path(out_dir)
    seconds = time.perf_counter() - started
    manifest["training"]["seconds"] = round(seconds, 1)
    write_profile(out_dir, manifest, pool.members)
    dropped = {p: dict(r) for p, r in record.dropped.items() if r}
    return LocalFit(out_dir, manifest, table, dropped, seconds)


def add_efficiency_curves(operators: Dict[str, Dict[str, dict]], sets) -> None:
    """Each fitted operator entry gains the efficiency curve predictions follow past its
    sampled range (predictors/extrapolate.py), fitted on the same cleaned rows against the
    roofline baseline the profile evaluates."""
    from . import baseline
    for (op, phase), ts in sets:
        entry = operators.get(op, {}).get(phase)
        if not entry or "baseline" not in entry or "features" not in entry:
            continue
        names = entry["features"]
        feats = {n: np.asarray(ts.features[n], dtype=float) for n in names}
        base = baseline.evaluate(baseline.roofline_design(op, phase, feats),
                                 np.asarray(entry["baseline"]["coef"], dtype=float))
        ok = (base > 0) & (ts.seconds > 0)
        if ok.sum() < 3:
            continue
        curve = extrapolate.fit_curve({n: c[ok] for n, c in feats.items()},
                                      np.log(ts.seconds[ok] / base[ok]), names)
        entry["efficiency"] = curve.to_entry()


# -- engine terms: what a real step costs beyond the operator predictions ---------------------

def _engine_prediction(profile, keys: dict, vocab: int, precision: str) -> dict:
    """Operator-level predictions for one engine-calibration model (one rank, one stage)."""
    import tempfile

    from neox_perf.config import WorldRequest, build, load_files
    from neox_perf.derive import derive
    from neox_perf.operators import OpCall, StageShape, decompose

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "engine.yml"
        path.write_text(json.dumps(keys))
        cfg, _, _ = build(load_files([str(path)]), WorldRequest(gpus=1))
    d = derive(cfg, vocab)
    st = d.stages[0]
    work = decompose(cfg, d.padded_vocab, [StageShape(0, st.transformer_layers, True, True,
                                                      st.params_per_rank)], precision=precision).stages[0]

    def total(calls):
        return sum(profile.predict(c.op, c.phase, c.feature_dict()).seconds * c.count
                   for c in calls if isinstance(c, OpCall))
    return {"layer_forward": total(work.layer_forward), "layer_backward": total(work.layer_backward),
            "other_forward": total(work.forward), "other_backward": total(work.backward),
            "activation_elements": work.activation_elements, "logits_elements": work.logits_elements,
            "param_tensors": work.param_tensors}


def _residual_fit(x: np.ndarray, r: np.ndarray, m: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """[c0, c1] minimising sum(((c0 + c1 x - r) / m)^2): the residual r of a measured time m as a
    fixed part plus a part growing with x; and the leave-one-out relative error of
    (operators + c0 + c1 x) against m, per row."""
    design = np.column_stack([np.ones_like(x), x]) / m[:, None]
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


# Per term, what the residual grows with (estimate.EngineTerms reads the same names). Inside a
# layer the operators run slower than alone by a fraction of their own time (operands no longer
# in cache) plus a fixed cost (the glue ops' dispatch); outside the layers the residual is the
# loss's extra passes over the logits plus a fixed cost.
ENGINE_FEATURES = {"layer_forward": "operators", "layer_backward": "operators",
                   "other_forward": "logits", "other_backward": "logits"}


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
    from .baseline import fit_nonnegative

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
            # Kept as measured and interpolated, not fitted: on a CPU the cost per element
            # jumps with size (gloo's all-gather on a 2-core VM: twice the time per element
            # above ~8e6 elements per rank), which one straight line spreads over every size.
            curve = _size_curve(pts)
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


def _size_curve(pts) -> List[List[float]]:
    """[[elements, seconds]] by size: sizes within 2% of each other are one size, its fastest
    measurement kept (interference only ever adds time), and no larger size faster than a
    smaller one."""
    curve: List[List[float]] = []
    for e, sec in sorted((float(e), float(sec)) for e, sec in pts):
        if curve and e <= curve[-1][0] * 1.02:
            curve[-1][1] = min(curve[-1][1], sec)
        else:
            curve.append([e, sec])
    for i in range(1, len(curve)):
        curve[i][1] = max(curve[i][1], curve[i - 1][1])
    return curve


def fit_engine(profile, engine_path, tp_path=None, extra_rows=None) -> Tuple[dict, List[FitRow]]:
    """The profile's "engine" section from the engine calibration (calibrate.run_engine) and,
    when given, the in-training tensor-parallel all-reduce benchmark (calibrate.run_tp_benchmark).
    ``extra_rows(profile)``: more rows per term, in the row forms built below, from training
    runs (neox_perf.runs.engine_rows.EngineRows, for `calibrate --from-run`)."""
    from .baseline import fit_nonnegative

    data = json.loads(Path(engine_path).read_text())
    shapes = data.get("shapes", {})
    precision = None
    layer_f, layer_b, other_f, other_b, steps, flat, acc = ([] for _ in range(7))
    for row in shapes.values():
        n, precision = int(row["layers"]), row["precision"]
        pred = _engine_prediction(profile, row["keys"], row["vocab"], precision)
        v = pred["logits_elements"]
        for rows, x, measured, predicted in (
                (layer_f, pred["layer_forward"], row["layer_forward"] / n, pred["layer_forward"]),
                (layer_b, pred["layer_backward"], row["layer_backward"] / n, pred["layer_backward"]),
                (other_f, v, row["forward"] - row["layer_forward"], pred["other_forward"]),
                (other_b, v, row["backward"] - row["layer_backward"], pred["other_backward"])):
            rows.append((x, measured - predicted, measured))
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
    terms: dict = {"precision": precision, "shapes": sorted(shapes), "source": str(engine_path)}
    if any(more.values()):
        terms["extra_rows"] = {k: len(v) for k, v in more.items() if v}
    table: List[FitRow] = []
    for name, rows in (("layer_forward", layer_f), ("layer_backward", layer_b),
                       ("other_forward", other_f), ("other_backward", other_b)):
        x, r, m = (np.array(col, dtype=float) for col in zip(*rows))
        coef, loo = _residual_fit(x, r, m)
        loo_mean, loo_max = float(np.mean(loo)), float(np.max(loo))
        raw = float(np.mean(np.abs((m - r) / m - 1.0)))
        feature = ENGINE_FEATURES[name]
        terms[name] = {"seconds": float(coef[0]), "per_unit": float(coef[1]), "feature": feature,
                       "rows": len(rows), "operators_only_mape": raw, "loo_mape": loo_mean,
                       "loo_max": loo_max, "sampled": [float(x.min()), float(x.max())]}
        what = (f"+{coef[1]:.1%} of the operators + {coef[0] * 1e3:.2f} ms" if feature == "operators"
                else f"{coef[1] * 1e9:+.3g} ns per logit + {coef[0] * 1e3:.2f} ms")
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
    zero_terms, zero_table = _fit_zero(data.get("zero") or {})
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
    return terms, table


def add_engine(profile_dir, engine_path, tp_path=None, extra_rows=None) -> List[FitRow]:
    """Fit the engine terms against the profile in ``profile_dir`` and add them to its manifest."""
    from .profile import load_profile
    profile_dir = Path(profile_dir)
    terms, table = fit_engine(load_profile(profile_dir), engine_path, tp_path, extra_rows)
    manifest = json.loads((profile_dir / MANIFEST_FILE).read_text())
    manifest["engine"] = terms
    note = ("engine terms (manifest 'engine'): measured by running the reference workload's model "
            "under one-process DeepSpeed engines, one per device in lockstep, at the calibration "
            "shapes; they add what the operator benchmarks miss (layer glue, cold operands, NeoX's "
            "loss, DeepSpeed's optimizer step, gradient flattening and accumulation, devices sharing "
            "memory bandwidth, tensor-parallel all-reduces waiting for each other); a second pass "
            "runs ZeRO-1 with the processes as one data-parallel group (the ZeRO optimizer's own "
            "work, and its whole-model all-reduce and all-gather as training runs them)")
    notes = manifest.setdefault("notes", [])
    if note not in notes:
        notes.append(note)
    tmp = profile_dir / (MANIFEST_FILE + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=1, allow_nan=False)
        fh.write("\n")
    os.replace(tmp, profile_dir / MANIFEST_FILE)
    return table
