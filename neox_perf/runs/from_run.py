"""Recalibrating a profile from a hooked run (`neox-perf calibrate --from-run`): the use case.

Two methods, chosen by what the profile is (commands/from_run.py decides, from its arguments):

- refit: the profile was fitted by `neox-perf calibrate` from a sample store that still
  exists. The run's operator and collective samples are merged into that store, tagged with
  their job (a second merge of the same run adds nothing: merge.py), and the profile is
  fitted again by the same trainer from everything the store holds
  (predictors/fitting/calibrated.fit_store), then its engine terms from the same engine
  calibration plus the rows the run's pipeline stages give (engine_rows.EngineRows). The new
  version is written beside the old and swapped in (neox_perf/profile/directory.replacing),
  so a crash leaves one or the other whole.
- level: any other profile (bundled, or its store gone). Each operator and collective model
  is scaled by the median measured / predicted ratio over the run's samples
  (recalibrate.recalibrate_from_run) and written to the directory the command chose.

Either way the run is predicted with the profile before and after, as `neox-perf report`
does: the iteration time, and every operator the hook mapped. Bad run data raises
FromRunError (the data-error exit). No torch here.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..profile.directory import replacing, update
from ..profile.manifest import Manifest
from ..profile.protocol import Profile
from ..profile.sections import Calibration, Provenance
from . import FromRunError
from .files import clean
from .recalibrate import recalibrate_from_run, run_errors


def recalibrate(run_dir: str, prof: Profile, *, store: Optional[Path], out: Path,
                notes: List[str]) -> Dict[str, Any]:
    """Refit ``prof`` from ``store`` with the run's samples merged in (store given), else
    correct its level; the result written to ``out``. Returns what was done, the profile
    against the run before and after, and whether that improved; ``notes`` gains the rest."""
    before = run_errors(run_dir, prof)
    if store is not None:
        body = _refit(prof, store, run_dir, out, before, notes)
    else:
        body = _level(prof, run_dir, out, notes)
    after = body["after"]
    body.update(before=before, improved=_improved(before, after))
    if body["improved"]["iteration"] is False:
        notes.append("the iteration error did not drop: the corrected models fit the run's "
                     "operators and stage times, and what is left is time the profile has no "
                     "term for (compare the components in `neox-perf report RUN_DIR --cluster "
                     "NEW`: pipeline bubble, p2p waits, unmapped operators)")
    return body


def _improved(before: dict, after: dict) -> Dict[str, Optional[bool]]:
    def less(a, b):
        return None if a is None or b is None else abs(b) < abs(a)
    return {"iteration": less(before["iteration"]["error"], after["iteration"]["error"]),
            "operators": less(before["operators"]["median_abs_error"],
                              after["operators"]["median_abs_error"])}


def _level(prof: Profile, run_dir: str, out: Path, notes: List[str]) -> Dict[str, Any]:
    from ..predictors.profile import load_profile
    done = recalibrate_from_run(run_dir, prof, str(out))
    new = load_profile(str(out))
    if prof.manifest.engine is not None:
        notes.append("the engine terms are kept as they were: a level correction scales the "
                     "operator and collective models only")
    return {"method": "level",
            "profile": {"name": done["name"], "path": done["profile"], "from": prof.name,
                        "from_path": str(prof.path)},
            "store": None, "merged": None, "engine": None, "fit": [],
            "factors": done["factors"], "skipped": done["skipped"], "step_terms": done["step_terms"],
            "after": run_errors(run_dir, new)}


def _refit(prof: Profile, store: Path, run_dir: str, final: Path, before: dict,
           notes: List[str]) -> Dict[str, Any]:
    from ..predictors.fitting import calibrated
    from ..predictors.profile import load_profile
    from .engine_rows import stage_measurements
    from .merge import merge_run_samples, merged_stage_records

    manifest = prof.manifest
    prov = manifest.provenance or Provenance()
    cal = manifest.calibration or Calibration()
    device, dtype = int(prov.device_id), cal.dtype  # the command checked the device is named
    grid = list(manifest.training.grid) if manifest.training is not None and manifest.training.grid else None

    stages = stage_measurements(run_dir)
    merged = merge_run_samples(run_dir, store, device=device, dtype=dtype, stages=stages)
    notes.extend(merged.pop("notes"))
    if merged["added"] + merged["already"] == 0:
        raise FromRunError(f"{run_dir}: none of its samples fit {prof.name} "
                           f"({'; '.join(f'{n} {why}' for why, n in merged['skipped'].items())}) "
                           f"(fix: recalibrate from a run in {dtype})")
    if merged["added"] == 0:
        notes.append("every sample of this run was already in the store (merged before): "
                     "refitted from the same data")
    records = merged_stage_records(store, device)

    with replacing(final) as tmp:
        try:
            fitted = calibrated.fit_store(
                store, prof.name, tmp, device=device, dtype=dtype, gpus_per_node=cal.processes,
                grid=grid, source=None,
                extra_notes=(f"refitted from calibration and {len(records) or 'no'} "
                             f"merged training run(s) by `neox-perf calibrate --from-run`",))
            table = [row.to_dict() for row in fitted.table]
            engine = _engine(manifest, tmp, records, notes, Path(prov.store or store))
        except ValueError as exc:  # the trainer's word on data it cannot fit
            raise FromRunError(f"{store}: cannot refit {prof.name}: {exc} (fix: recalibrate "
                               f"with `neox-perf calibrate --cluster {prof.name}`)") from None
        if engine is not None:
            table += engine.pop("table")
        after = run_errors(run_dir, load_profile(str(tmp)))
        # The profile's own record of what went into it and what it did to this run.
        history = (*(prov.from_runs or ()), clean({
            "run_dir": run_dir, "origins": merged["origins"], "time": time.time(),
            "added": merged["added"], "statistic": merged["statistic"],
            "iteration_error": {"before": before["iteration"]["error"],
                                "after": after["iteration"]["error"]},
            "operator_median_abs_error": {"before": before["operators"]["median_abs_error"],
                                          "after": after["operators"]["median_abs_error"]}}))
        update(tmp, lambda m: replace(m, provenance=replace(m.provenance or Provenance(), from_runs=history)))
    return {"method": "refit",
            "profile": {"name": prof.name, "path": str(final.resolve()), "from": prof.name,
                        "from_path": str(prof.path)},
            "store": str(store.resolve()), "merged": merged, "engine": engine, "fit": table,
            "step_terms": None, "factors": None, "skipped": None, "after": after}


def _engine(manifest: Manifest, tmp: Path, records, notes: List[str],
            calibrated: Path) -> Optional[Dict[str, Any]]:
    """Refit the engine terms as the calibration did, with the merged runs' rows added; keep
    the old terms where their measurements are gone. ``calibrated``: the store the profile
    was calibrated into, beside which calibrate keeps the tensor-parallel measurements."""
    from ..calibration.tp_allreduce import tp_path
    from ..predictors.fitting.engine_fit import add_engine
    from .engine_rows import EngineRows
    old = manifest.engine
    if old is None:
        return None
    source = Path(str(old.extra.get("source") or ""))
    if not source.is_file():
        update(tmp, lambda m: replace(m, engine=old))
        notes.append(f"engine measurements {source} are gone: the engine terms were kept as they were")
        return {"rows": {}, "notes": [], "table": []}
    tp = tp_path(calibrated)
    rows = EngineRows(records, old.precision, old.linear("grad_accumulate"))
    table = add_engine(tmp, source, tp if tp.is_file() else None, extra_rows=rows)
    if "tp_allreduce" in old.linears and not tp.is_file():
        update(tmp, lambda m: replace(m, engine=m.engine.with_terms_of(old, "tp_allreduce")))
        notes.append("the tensor-parallel all-reduce measurements are gone: that term was kept")
    notes.extend(rows.notes)
    return {"rows": rows.counts, "notes": rows.notes, "table": [row.to_dict() for row in table]}
