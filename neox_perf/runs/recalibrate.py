"""How far off a cluster profile is on a hooked run, and a profile corrected by the run's level.

run_errors measures a profile against the run (the numbers `neox-perf report` shows), so
`calibrate --from-run` can say how far off the profile was before and after.

recalibrate_from_run is the level correction (a bundled profile, or one whose store is
gone): each operator/phase and collective model of the profile is scaled by the median ratio
measured / predicted over the run's samples of it (weighted by calls). A profile predicts
`baseline(features) * exp(trees(features))` and the baseline is linear in its non-negative
coefficients, so scaling the coefficients scales the prediction exactly and keeps the
trees' shape. Models without samples in the run are left as they were; a model derived
from another phase follows that phase. This fixes a level (a different GPU clock, a library
version, CPU vs GPU), not a shape the original samples never covered. The refit (a profile
`neox-perf calibrate` fitted from a store that still exists) is runs.merge + runs.engine_rows.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..profile.directory import replacing, write
from ..profile.manifest import Manifest
from ..profile.protocol import Profile
from ..profile.sections import Provenance
from ..prediction.corrections import StepTerms, StepTermsSection
from . import FromRunError, prediction
from . import files as runfiles
from .files import clean


def _weighted_median(pairs: List[Tuple[float, int]]) -> float:
    pairs = sorted(pairs)
    total = sum(w for _, w in pairs)
    acc = 0.0
    for value, weight in pairs:
        acc += weight
        if acc >= total / 2.0:
            return value
    return pairs[-1][0]


def _run_samples(run_dir: str):
    from neox_perf.calibration.store import SampleStore
    out, devices = [], []
    for path in runfiles.store_files(run_dir):
        with SampleStore(path) as store:
            out += store.samples(source="run")
            devices += list(store.devices().values())
    return out, devices


def run_errors(run_dir: str, profile) -> Dict[str, Any]:
    """The profile against the run: the iteration (predicted vs the job's measured min and
    median) and every mapped operator (predicted vs the median of its calls), as the report
    computes them. Errors are signed (predicted - measured) / measured; the operator summary
    is the median of their absolute values, and the per-iteration time they are off by
    relative to the time they take (calls weighted)."""
    from .report import build
    r = build(run_dir, profile=profile, top=0)
    it = r["iteration"]
    rows = [o for o in r["operators"] if o["error"] is not None]
    off = sum(abs(o["predicted"] - o["measured"]) * o["calls_per_iteration"] for o in rows)
    took = sum(o["measured"] * o["calls_per_iteration"] for o in rows)
    return {
        "profile": r["cluster"],
        "iteration": {"predicted": it["predicted"], "measured_median": it["measured"]["median"],
                      "measured_min": it["measured"]["min"], "error": it["error_median"],
                      "error_min": it["error_min"]},
        "operators": {"compared": len(rows), "of": len(r["operators"]),
                      "median_abs_error": statistics.median(abs(o["error"]) for o in rows) if rows else None,
                      "time_weighted_abs_error": off / took if took else None},
        "notes": [n for n in r["notes"] if "no prediction" in n or "not usable" in n],
        "profile_warnings": r["profile_warnings"],
    }


def recalibrate_from_run(run_dir: str, profile, out_dir: str, name: Optional[str] = None) -> Dict[str, Any]:
    """Write a corrected copy of `profile` (a name, a directory or a loaded Profile) to
    `out_dir`, named `name` (default: the directory's name); out_dir is replaced in one step."""
    from neox_perf.prediction import opspec
    from neox_perf.predictors.profile import load_profile
    prof: Profile = load_profile(profile) if isinstance(profile, (str, os.PathLike)) else profile
    # A cluster description predicts through the sampled profile it is based on: the models
    # scaled (and the trees copied) are that base's, the name and facts the description's.
    models = prof.base or prof
    samples, devices = _run_samples(os.path.abspath(run_dir))
    if not samples:
        raise FromRunError(f"{run_dir}: no run samples to recalibrate from (fix: run the job "
                           f"with `neox-perf run` and at least one profiling window)")
    ratios: Dict[Tuple[str, str], List[Tuple[float, int]]] = {}
    skipped: Dict[str, str] = {}
    for s in samples:
        phase = "comm" if s.op in opspec.COLLECTIVES else s.phase
        pred, why = prediction.predict_call(models, s.op, phase, s.features, s.dtype)
        if not pred or pred <= 0:
            skipped[f"{s.op}/{phase}"] = why or "no prediction"
            continue
        # The median of the calls: what `neox-perf report` compares a prediction with.
        ratios.setdefault((s.op, phase), []).append((s.median / pred, max(int(s.repeats), 1)))
    manifest = prof.manifest
    operators = {op: dict(phases) for op, phases in manifest.operators.items()}
    collectives = dict(manifest.collectives)
    factors: Dict[str, Dict[str, Any]] = {}
    for (op, phase), pairs in sorted(ratios.items()):
        entry = manifest.model(op, phase)
        key = f"{op}/{phase}"
        if entry is None or entry.baseline is None:
            skipped[key] = "derived from another phase or not in the profile"
            continue
        factor = _weighted_median(pairs)
        scaled = replace(entry, baseline=replace(entry.baseline, coef=tuple(c * factor for c in entry.baseline.coef)))
        if phase == "comm":
            collectives[op] = scaled
        else:
            operators[op][phase] = scaled
        factors[key] = {"factor": factor, "samples": len(pairs),
                        "calls": sum(w for _, w in pairs)}
    final = Path(out_dir)
    name = name or final.resolve().name
    from .report import measured_job
    job = measured_job(run_dir)  # (reference rank's summary, measured iterations), read once
    section, steps = _level_step_terms(manifest.step_terms, job[0])
    dtypes = {s.dtype for s in samples if s.dtype}
    recalibrated = clean({
        "from_profile": prof.name, "run_dir": os.path.abspath(run_dir), "time": time.time(),
        "method": "baseline coefficients x weighted median(measured / predicted) per model",
        "factors": factors, "skipped": skipped, "devices": devices,
        # the corrected operator models now predict the run's calls in the run's element type:
        # an fp32 run's level is not priced again from 16-bit samples (predictors/achievable.py)
        "dtype": dtypes.pop() if len(dtypes) == 1 else None})
    tf32 = (job[0].get("facts") or {}).get("tf32")
    if tf32 is not None:  # and the matmuls the run had, TF32 or IEEE (hooks/engine_facts.tf32)
        recalibrated["tf32"] = bool(tf32)
    # the corrected models stand on their own: no transfer section
    manifest = replace(manifest, name=name, operators=operators, collectives=collectives, transfer=None,
                       step_terms=section,
                       provenance=replace(manifest.provenance or Provenance(), recalibrated=recalibrated))
    with replacing(final) as tmp:
        write(tmp, manifest, arrays_from=models.path)  # the trees as they were, checksum and all
        section, refitted = _refit_fixed_cost(manifest, tmp, run_dir, *job)
        steps.update(refitted)
        if section is not None:
            write(tmp, replace(manifest, step_terms=section))
    return {"profile": str(final.resolve()), "name": name, "from_profile": prof.name,
            "factors": factors, "skipped": skipped, "samples": len(samples), "step_terms": steps}


# What a run adds per micro-batch beyond its operators (data, loss scaling, engine calls, the
# host between them): the one step term a single measured iteration can pin.
REFIT = "micro_batch_s"


def _level_step_terms(section: Optional[StepTermsSection], ref: dict) -> Tuple[StepTermsSection, Dict[str, Any]]:
    """The step terms a level-corrected profile starts from. The factors came from the run's own
    calls, measured inside real steps, so the in-situ slowdown the development-set scales stand
    for is in the operators now: both scales become 1. On a CPU a call's host time already
    holds its dispatch, so the host dispatch term goes too. The rest stay as the profile had them
    until _refit_fixed_cost pins the per-micro-batch cost on the run."""
    section = section or StepTermsSection()
    base = section.terms or StepTerms()
    cpu = (ref.get("facts") or {}).get("device_type") == "cpu"
    start = replace(base, compute_scale=1.0, memory_scale=1.0,
                    dispatch_s=0.0 if cpu else base.dispatch_s)
    # what was fitted on the development set no longer describes these terms
    section = replace(section, terms=start, cross_validation=None,
                      extra={k: v for k, v in section.extra.items() if k != "command"})
    return section, {"from": base.to_dict(), "start": start.to_dict()}


def _refit_fixed_cost(manifest: Manifest, profile_dir: Path, run_dir: str, ref: dict,
                      iters: Dict[str, Any]) -> Tuple[Optional[StepTermsSection], Dict[str, Any]]:
    """Refit REFIT on the run's median iteration with the corrected operators (written to
    profile_dir already): the step-terms section refitted (None: nothing to refit), and what
    happened."""
    from neox_perf.predictors.fitting.step_fit import Case, refit
    from neox_perf.predictors.profile import load_profile
    if not iters.get("median"):
        return None, {"refitted": None, "why": "no measured iteration outside warm-up and profiling"}
    profile = load_profile(str(profile_dir))
    try:
        decomp = prediction.decomposition(ref.get("config") or {}, ref.get("facts") or {}, profile)
    except Exception as exc:  # a layout the profile cannot place: keep the level's terms
        decomp, why = None, f"{exc.__class__.__name__}: {exc}"
    else:
        why = "the recorded config could not be rebuilt"
    if decomp is None:
        return None, {"refitted": None, "why": why}
    section = manifest.step_terms
    terms = refit([Case("run", decomp, float(iters["median"]))], profile, section.terms, (REFIT,))
    section = replace(section, terms=terms,
                      fitted_on=f"level-corrected from {manifest.provenance.recalibrated['from_profile']}; "
                                f"{REFIT} refitted on the median iteration of {os.path.abspath(run_dir)}")
    return section, {"refitted": REFIT, "value": getattr(terms, REFIT), "measured_median": iters["median"]}
