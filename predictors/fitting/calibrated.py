"""A cluster profile fitted from this machine's own calibration store (`neox-perf calibrate`).

The same trainer as the bundled profiles: the samples (store_samples.training_sets) go through
cleaning.clean, then fit.fit_one (robust physical baseline, trees on its log residual,
RandomForest vs XGBoost on one seeded 80/20 split, the winner refitted on all rows), then
export and the same manifest + arrays.npz layout, written by the one writer
(neox_perf/profile/directory.py). Only the samples' source and the cluster facts differ: the
facts are what this machine measured about itself (store_samples.measured_facts). Past the
sampled range, each operator follows an efficiency curve fitted on the same rows
(predictors/extrapolate.py). The engine terms are fitted afterwards (engine_fit.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from neox_perf.prediction import opspec
from neox_perf.profile.manifest import SCHEMA, SCHEMA_VERSION, Manifest
from neox_perf.profile.sections import ArraysRef

from .. import extrapolate, gpus
from . import cleaning, fit
from .samples import FileRecord, sha256_of
from .store_samples import _collective_processes, _device_of, measured_facts, training_sets
from .train import _ArrayPool, _versions, fit_set, write_profile

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
    manifest: Manifest  # as written
    table: List[FitRow]
    dropped: Dict[str, Dict[str, int]]
    seconds: float


def _finite(v) -> Optional[float]:
    return float(v) if v is not None and np.isfinite(v) else None


def fit_store(store_path, name: str, out_dir, *, device: Optional[int] = None,
              dtype: Optional[str] = None, gpus_per_node: Optional[int] = None,
              grid=None, progress: Optional[Progress] = None,
              extra_notes: Tuple[str, ...] = (), source: Optional[str] = "calibrate",
              blended: bool = True, one_speed: Optional[str] = "default") -> LocalFit:
    """Fit every (op, phase) and collective of one device in the store; write the profile
    to ``out_dir`` (a new version swapped in whole); return it with the
    per-operator validation table. ``grid``: fit.candidates() by default. ``source``: the
    samples to fit, "calibrate" by default; None adds the training-run samples that
    `calibrate --from-run` merged into the store. ``blended``: each operator's trees are the
    mean of its best random forest and its best XGBoost (fit.fit_one): a profile fitted again
    from another calibration of the same machine then moves with the samples, not with which
    of two near-equal models won (docs/validation.md, "Two calibrations of one machine").
    ``one_speed``: the samples brought to the operator step's median reference reading by the
    readings they were timed beside, in that mode of profile/one_speed.MODES ("default": its
    MODE; None: as timed)."""
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
    disturbance = _disturbance(store_path, name, device, dtype, runs)
    at = _at_one_speed(store_path, device, disturbance, dtype, one_speed)
    # a CPU calibration's causal attention ran PyTorch's CPU kernel, whose blocks skip less than
    # FlashAttention-2's (opspec.TORCH_CPU)
    kernel = opspec.TORCH_CPU if fingerprint.get("kind") == "cpu" else None
    sets = training_sets(store_path, device=device, dtype=dtype, source=source, at=at,
                         causal_kernel=kernel)
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
                         collectives, notes, blended=blended)
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
            "measured": _measured(runs),
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
            "validation": ("one seeded 80/20 split per op/phase; MAPE on seconds; chosen model refitted on all rows"
                           + ("; trees: the mean of the best random forest and the best XGBoost"
                              if blended else "")),
            "tree_input": "natural log of each varying feature, cast to float32; target log(seconds / baseline)",
            "grid": [[k, p] for k, p in (grid if grid is not None else fit.candidates())],
            "seconds": None,
        },
        "arrays": ArraysRef(models=pool.models, nodes=pool.nodes, trees=pool.trees).to_dict(),
        "operators": operators,
        "collectives": collectives,
        "extrapolation": extrapolate.MARKER,
    }
    if at is not None:  # the speed every sample was brought to, the engine terms' too
        manifest["training"]["one_speed"] = at.to_dict()
    if disturbance is not None:
        manifest["disturbance"] = disturbance.to_dict()
    out_dir = Path(out_dir)
    seconds = time.perf_counter() - started
    manifest["training"]["seconds"] = round(seconds, 1)
    written = write_profile(out_dir, manifest, pool.members)
    dropped = {p: dict(r) for p, r in record.dropped.items() if r}
    return LocalFit(out_dir, written, table, dropped, seconds)


def _at_one_speed(store_path: Path, device: int, disturbance, dtype: Optional[str], mode: Optional[str]):
    """The speed the samples are fitted at (profile/one_speed.OneSpeed): the median of the
    reference readings the operator samples were timed beside -- the speed the operators, the
    bulk of every prediction, were timed at -- and the mode; or None: fitted as timed (no mode,
    no watched CPU run, another dtype, no readings stored)."""
    from neox_perf.calibration.store import SampleStore
    from neox_perf.profile import one_speed
    from neox_perf.profile.disturbance import reference_of
    mode = one_speed.MODE if mode == "default" else mode
    if mode is None:
        return None
    ref = reference_of(disturbance)
    if ref is None or ref.device != "cpu" or (dtype is not None and ref.dtype != dtype):
        return None
    with SampleStore(store_path) as store:
        infos = [s.info for s in store.samples(device=device, source="calibrate")
                 if dtype is None or s.dtype == dtype]
    nominal = one_speed.step_speed(infos)
    return one_speed.OneSpeed(nominal, mode, ref.seconds_per_loop) if nominal else None


def _disturbance(store_path: Path, name: str, device: int, dtype: Optional[str], runs):
    """The profile's `disturbance` section from the store: the calibration runs' records and
    the operator samples still flagged as timed while the machine was disturbed."""
    from neox_perf.calibration.store import SampleStore
    from neox_perf.profile.disturbance import from_calibration
    with SampleStore(store_path) as store:
        flagged = store.disturbed(device=device, dtype=dtype)
        samples = sum(1 for s in store.samples(device=device, source="calibrate")
                      if s.op in opspec.OPERATORS and (dtype is None or s.dtype == dtype))
    return from_calibration(name, [r for r in runs if r["kind"] == "calibrate"], len(flagged), samples)


def add_efficiency_curves(operators: Dict[str, Dict[str, dict]], sets) -> None:
    """Each fitted operator entry gains the efficiency curve predictions follow past its
    sampled range (predictors/extrapolate.py), fitted on the same cleaned rows against the
    roofline baseline the profile evaluates."""
    from .. import baseline
    for (op, phase), ts in sets:
        entry = operators.get(op, {}).get(phase)
        if not entry or "baseline" not in entry or "features" not in entry:
            continue
        names = entry["features"]
        feats = {n: np.asarray(ts.features[n], dtype=float) for n in names}
        base = baseline.evaluate(baseline.roofline_design(op, phase, feats,
                                                          causal_kernel=entry["baseline"].get("causal_kernel")),
                                 np.asarray(entry["baseline"]["coef"], dtype=float))
        ok = (base > 0) & (ts.seconds > 0)
        if ok.sum() < 3:
            continue
        curve = extrapolate.fit_curve({n: c[ok] for n, c in feats.items()},
                                      np.log(ts.seconds[ok] / base[ok]), names)
        entry["efficiency"] = curve.to_entry()


def _measured(runs) -> Optional[str]:
    """The span of dates (UTC) the store's calibration runs were timed on, for the profile's
    provenance (neox_perf/prediction/network.py shows it beside the network it measured)."""
    import datetime
    stamps = sorted(float(t) for r in runs for t in (r.get("started"), r.get("finished")) if t)
    if not stamps:
        return None
    days = [datetime.datetime.fromtimestamp(t, datetime.timezone.utc).date().isoformat()
            for t in (stamps[0], stamps[-1])]
    return days[0] if days[0] == days[1] else f"{days[0]} .. {days[1]}"


def _precision(dtype: Optional[str]) -> str:
    """The calibration's dtype as the GPU table names precisions (fp16 where unstated), for the
    cleaning rule that raises rows faster than the GPU's achievable rate (a CPU has no row)."""
    try:
        return gpus.precision_key(dtype) if dtype else "fp16"
    except ValueError:
        return "fp16"
