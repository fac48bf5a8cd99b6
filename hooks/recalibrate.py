"""A cluster profile corrected by what a training run measured (for `calibrate --from-run`).

Each operator/phase and collective model of the profile is scaled by the median ratio
measured / predicted over the run's samples of it (weighted by calls). A profile predicts
`baseline(features) * exp(trees(features))` and the baseline is linear in its non-negative
coefficients, so scaling the coefficients scales the prediction exactly and keeps the
trees' shape. Models without samples in the run are left as they were; a model derived
from another phase follows that phase. The result is a new profile directory (the trees'
arrays copied unchanged) whose manifest records where every factor came from.

This is a correction, not a refit: it fixes a level (a different GPU clock, a library
version, CPU vs GPU), not a shape the original samples never covered.
"""
from __future__ import annotations

import copy
import os
import shutil
import time
from typing import Any, Dict, List, Tuple

from . import prediction, summary


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
    for path in summary.store_files(run_dir):
        with SampleStore(path) as store:
            out += store.samples(source="run")
            devices += list(store.devices().values())
    return out, devices


def recalibrate_from_run(run_dir: str, profile, out_dir: str) -> Dict[str, Any]:
    """Write a corrected copy of `profile` (name, directory or ClusterProfile) to `out_dir`."""
    from neox_perf import opspec
    from neox_perf.predictors.profile import MANIFEST_FILE, load_profile
    prof = load_profile(profile) if not hasattr(profile, "manifest") else profile
    samples, devices = _run_samples(os.path.abspath(run_dir))
    if not samples:
        raise ValueError(f"{run_dir}: no run samples to recalibrate from")
    ratios: Dict[Tuple[str, str], List[Tuple[float, int]]] = {}
    skipped: Dict[str, str] = {}
    for s in samples:
        phase = "comm" if s.op in opspec.COLLECTIVES else s.phase
        pred, why = prediction.predict_call(prof, s.op, phase, s.features, s.dtype)
        if not pred or pred <= 0:
            skipped[f"{s.op}/{phase}"] = why or "no prediction"
            continue
        ratios.setdefault((s.op, phase), []).append((s.median / pred, max(int(s.repeats), 1)))
    manifest = copy.deepcopy(prof.manifest)
    factors: Dict[str, Dict[str, Any]] = {}
    for (op, phase), pairs in sorted(ratios.items()):
        entry = (manifest["collectives"].get(op) if phase == "comm"
                 else manifest["operators"].get(op, {}).get(phase))
        key = f"{op}/{phase}"
        if entry is None or "baseline" not in entry:
            skipped[key] = "derived from another phase or not in the profile"
            continue
        factor = _weighted_median(pairs)
        entry["baseline"]["coef"] = [c * factor for c in entry["baseline"]["coef"]]
        factors[key] = {"factor": factor, "samples": len(pairs),
                        "calls": sum(w for _, w in pairs)}
    name = os.path.basename(os.path.normpath(out_dir))
    manifest["name"] = name
    manifest.setdefault("provenance", {})["recalibrated"] = {
        "from_profile": prof.name, "run_dir": os.path.abspath(run_dir), "time": time.time(),
        "method": "baseline coefficients x weighted median(measured / predicted) per model",
        "factors": factors, "skipped": skipped, "devices": devices}
    os.makedirs(out_dir, exist_ok=True)
    arrays = (manifest.get("arrays") or {}).get("file")
    if arrays:  # the trees, unchanged (the manifest keeps their checksum)
        shutil.copy2(os.path.join(str(prof.path), arrays), os.path.join(out_dir, arrays))
    summary.write_json_atomic(os.path.join(out_dir, MANIFEST_FILE), manifest)
    return {"profile": os.path.abspath(out_dir), "name": name, "from_profile": prof.name,
            "factors": factors, "skipped": skipped, "samples": len(samples)}
