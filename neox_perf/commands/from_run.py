"""`neox-perf calibrate --cluster NAME --from-run RUN_DIR`: correct a profile by a hooked run.

Two methods, chosen by what the profile is:

- refit: NAME was fitted by `neox-perf calibrate` from a sample store that still exists (its
  manifest names it; --store overrides). The run's operator and collective samples are
  merged into that store, tagged with their job (a second merge of the same run adds
  nothing), and the profile is fitted again by the same trainer from everything the store
  holds: predictors.local.fit_store, then the engine terms from the same engine calibration
  plus the rows the run's pipeline stages give (runs.engine_rows.EngineRows). The profile
  is written beside the old one and swapped in, so a crash leaves one or the other whole.
- level: any other profile (bundled, or its store gone). Each operator and collective model
  is scaled by the median measured / predicted ratio over the run's samples
  (runs.recalibrate.recalibrate_from_run) and written under a new name, NAME-run in the
  user profiles (or --out): a bundled name would hide a user profile of the same name.

Either way the run is predicted with the profile before and after, as `neox-perf report`
does: the iteration time, and every operator the hook mapped. No torch here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from ..errors import UsageError
from .report import PayloadResult


@dataclass
class FromRunResult(PayloadResult):
    command: str = "calibrate"
    schema: str = "calibrate-from-run"  # a payload of its own, not calibrate's
    render_hint: str = "from_run_text"


def _check_run_dir(run_dir: str) -> str:
    from ..runs import files as runfiles
    path = os.path.abspath(os.path.expanduser(run_dir))
    if not os.path.isdir(path):
        raise UsageError(f"{path}: no such run dir (fix: pass the --run-dir of a "
                         f"`neox-perf run --run-dir DIR -- <launch command>`)")
    if not runfiles.read_rank_summaries(path):
        raise UsageError(f"{path}: no rank summaries, so not a run dir the hook wrote (fix: run "
                         f"the job with `neox-perf run --run-dir {path} -- <launch command>`)")
    from ..calibration.store import SampleStore
    count = 0
    for store in runfiles.store_files(path):
        with SampleStore(store) as s:
            count += len(s.samples(source="run"))
    if not count:
        raise UsageError(f"{path}: no operator samples (samples-*.sqlite) to calibrate from (fix: "
                         f"let the job run through a profiling window, e.g. `neox-perf run "
                         f"--windows skip=3,warmup=1,active=2` with more iterations)")
    return path


def _load(cluster: str):
    from ..predict import load_cluster
    try:
        return load_cluster(cluster)
    except UsageError as exc:
        raise UsageError(f"--cluster {exc.line()}") from None


def _is_bundled(prof) -> bool:
    from ..predictors.profile import is_bundled
    return is_bundled(prof.path)


def _store_of(args, prof, notes) -> Optional[Path]:
    """The sample store to merge into and refit from, or None for a level correction."""
    given = getattr(args, "store", None)
    if given:
        store = Path(given).expanduser()
        if _is_bundled(prof):
            raise UsageError(f"--store {store}: {prof.name} is a bundled profile, not one fitted "
                             f"from a store (fix: drop --store, or name your own profile in --cluster)")
        if not store.is_file():
            raise UsageError(f"--store {store}: no such sample store (fix: pass the --store "
                             f"`neox-perf calibrate --cluster {prof.name}` wrote)")
        return store
    recorded = (prof.manifest.get("provenance") or {}).get("store")
    if _is_bundled(prof) or not recorded:
        return None
    if not Path(recorded).is_file():
        notes.append(f"the store {prof.name} was fitted from ({recorded}) is gone: a level "
                     f"correction instead of a refit (pass --store to refit)")
        return None
    return Path(recorded)


def _improved(before: dict, after: dict) -> Dict[str, Optional[bool]]:
    def less(a, b):
        return None if a is None or b is None else abs(b) < abs(a)
    return {"iteration": less(before["iteration"]["error"], after["iteration"]["error"]),
            "operators": less(before["operators"]["median_abs_error"],
                              after["operators"]["median_abs_error"])}


def run_from_run(args) -> FromRunResult:
    from ..runs import FromRunError
    from ..runs.recalibrate import run_errors
    from ..runs.report import ReportError
    run_dir = _check_run_dir(args.from_run)
    prof = _load(str(args.cluster))
    notes: list = []
    store = _store_of(args, prof, notes)
    try:
        before = run_errors(run_dir, prof)
        if store is not None:
            body = _refit(args, prof, store, run_dir, before, notes)
        else:
            body = _level(args, prof, run_dir, notes)
    except (FromRunError, ReportError) as exc:
        raise UsageError(" ".join(str(exc).split())) from None
    after = body.pop("after")
    improved = _improved(before, after)
    if improved["iteration"] is False:
        notes.append("the iteration error did not drop: the corrected models fit the run's "
                     "operators and stage times, and what is left is time the profile has no "
                     "term for (compare the components in `neox-perf report RUN_DIR --cluster "
                     "NEW`: pipeline bubble, p2p waits, unmapped operators)")
    from ..predictors.profile import user_profiles_dir
    where = Path(body["profile"]["path"])
    use = body["profile"]["name"] if where.parent == user_profiles_dir().resolve() else str(where)
    payload = {"cluster": str(args.cluster), "run_dir": run_dir, **body, "use": use,
               "before": before, "after": after, "improved": improved,
               "notes": list(dict.fromkeys(notes + [f"before: {n}" for n in before["notes"]]
                                           + [f"after: {n}" for n in after["notes"]]))}
    return FromRunResult(payload)


def _level(args, prof, run_dir: str, notes: list) -> Dict[str, Any]:
    from ..runs.recalibrate import recalibrate_from_run, run_errors
    from ..predictors.profile import _bundled_dir, load_profile, user_profiles_dir
    if getattr(args, "out", None):
        out = Path(args.out).expanduser()
    elif not _is_bundled(prof) and "recalibrated" in (prof.manifest.get("provenance") or {}):
        out = Path(prof.path)  # already a corrected copy: corrected again, not NAME-run-run
    else:
        name = f"{prof.name}-run"
        if (_bundled_dir() / name).is_dir():
            raise UsageError(f"--cluster {prof.name}: the corrected profile would be named {name}, "
                             f"which a bundled profile has (fix: pass --out DIR)")
        out = user_profiles_dir() / name
        why = "a bundled profile" if _is_bundled(prof) else "a profile without a sample store"
        notes.append(f"{prof.name} is {why}: the corrected copy is a new profile, {name}")
    done = recalibrate_from_run(run_dir, prof, str(out))
    new = load_profile(str(out))
    if (prof.manifest.get("engine") or {}):
        notes.append("the engine terms are kept as they were: a level correction scales the "
                     "operator and collective models only")
    return {"method": "level",
            "profile": {"name": done["name"], "path": done["profile"], "from": prof.name,
                        "from_path": str(prof.path)},
            "store": None, "merged": None, "engine": None, "fit": [],
            "factors": done["factors"], "skipped": done["skipped"], "step_terms": done["step_terms"],
            "after": run_errors(run_dir, new)}


def _refit(args, prof, store: Path, run_dir: str, before: dict, notes: list) -> Dict[str, Any]:
    import json
    import shutil
    import time

    from ..runs import FromRunError
    from ..runs.engine_rows import stage_measurements
    from ..runs.merge import merge_run_samples, merged_stage_records
    from ..profile.directory import recover_dir, replace_dir, temp_dir_for, write_manifest
    from ..runs.files import clean
    from ..runs.recalibrate import run_errors
    from ..predictors.artifacts import MANIFEST_FILE
    from ..predictors.fitting.calibrated import fit_store
    from ..predictors.profile import load_profile

    manifest = prof.manifest
    prov, cal = manifest.get("provenance") or {}, manifest.get("calibration") or {}
    device, dtype = prov.get("device_id"), cal.get("dtype")
    if device is None:
        raise UsageError(f"{prof.path}: the manifest names no calibrated device (fix: "
                         f"recalibrate it with `neox-perf calibrate --cluster {prof.name}`)")
    grid = [(kind, params) for kind, params in (manifest.get("training") or {}).get("grid") or []] or None
    final = Path(args.out).expanduser() if getattr(args, "out", None) else Path(prof.path)

    stages = stage_measurements(run_dir)
    merged = merge_run_samples(run_dir, store, device=int(device), dtype=dtype, stages=stages)
    notes.extend(merged.pop("notes"))
    if merged["added"] + merged["already"] == 0:
        raise UsageError(f"{run_dir}: none of its samples fit {prof.name} "
                         f"({'; '.join(f'{n} {why}' for why, n in merged['skipped'].items())}) "
                         f"(fix: recalibrate from a run in {dtype})")
    if merged["added"] == 0:
        notes.append("every sample of this run was already in the store (merged before): "
                     "refitted from the same data")
    records = merged_stage_records(store, int(device))

    recover_dir(final)
    tmp = temp_dir_for(final)
    try:
        try:
            fitted = fit_store(store, prof.name, tmp, device=int(device), dtype=dtype,
                               gpus_per_node=cal.get("processes"), grid=grid, source=None,
                               extra_notes=(f"refitted from calibration and {len(records) or 'no'} "
                                            f"merged training run(s) by `neox-perf calibrate --from-run`",))
            table = [row.to_dict() for row in fitted.table]
            engine = _engine(manifest, tmp, records, notes, Path(prov.get("store") or store))
        except ValueError as exc:  # the trainer's word on data it cannot fit
            raise FromRunError(f"{store}: cannot refit {prof.name}: {exc} (fix: recalibrate "
                                  f"with `neox-perf calibrate --cluster {prof.name}`)") from None
        if engine is not None:
            table += engine.pop("table")
        new = load_profile(str(tmp))
        after = run_errors(run_dir, new)
        # The profile's own record of what went into it and what it did to this run.
        path = tmp / MANIFEST_FILE
        data = json.loads(path.read_text())
        history = list(prov.get("from_runs") or [])
        history.append({"run_dir": run_dir, "origins": merged["origins"], "time": time.time(),
                        "added": merged["added"], "statistic": merged["statistic"],
                        "iteration_error": {"before": before["iteration"]["error"],
                                            "after": after["iteration"]["error"]},
                        "operator_median_abs_error": {
                            "before": before["operators"]["median_abs_error"],
                            "after": after["operators"]["median_abs_error"]}})
        data["provenance"]["from_runs"] = history
        write_manifest(path, clean(data))
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"method": "refit",
            "profile": {"name": prof.name, "path": str(final.resolve()), "from": prof.name,
                        "from_path": str(prof.path)},
            "store": str(store.resolve()), "merged": merged, "engine": engine, "fit": table,
            "step_terms": None,
            "factors": None, "skipped": None, "after": after}


def _engine(manifest: dict, tmp: Path, records, notes: list, calibrated: Path) -> Optional[Dict[str, Any]]:
    """Refit the engine terms as the calibration did, with the merged runs' rows added; keep
    the old terms where their measurements are gone. ``calibrated``: the store the profile
    was calibrated into, beside which calibrate keeps the tensor-parallel measurements."""
    import json

    from ..calibration.tp_allreduce import tp_path
    from ..engine_terms import EngineSection
    from ..runs.engine_rows import EngineRows
    from ..predictors.artifacts import MANIFEST_FILE
    from ..predictors.fitting.calibrated import add_engine
    if not manifest.get("engine"):
        return None
    old = EngineSection.parse(manifest["engine"], f"{tmp.name}: manifest engine")
    source = Path(str(old.extra.get("source") or ""))
    path = tmp / MANIFEST_FILE
    if not source.is_file():
        _write_engine(path, old)
        notes.append(f"engine measurements {source} are gone: the engine terms were kept as they were")
        return {"rows": {}, "notes": [], "table": []}
    tp = tp_path(calibrated)
    rows = EngineRows(records, old.precision, old.linear("grad_accumulate"))
    table = add_engine(tmp, source, tp if tp.is_file() else None, extra_rows=rows)
    if "tp_allreduce" in old.linears and not tp.is_file():
        fitted = EngineSection.parse(json.loads(path.read_text())["engine"])
        _write_engine(path, fitted.with_terms_of(old, "tp_allreduce"))
        notes.append("the tensor-parallel all-reduce measurements are gone: that term was kept")
    notes.extend(rows.notes)
    return {"rows": rows.counts, "notes": rows.notes, "table": [row.to_dict() for row in table]}


def _write_engine(path: Path, section) -> None:
    """The manifest at ``path`` with its engine section replaced by ``section``."""
    import json

    from ..profile.directory import write_manifest
    from ..runs.files import clean
    data = json.loads(path.read_text())
    data["engine"] = section.to_dict()
    write_manifest(path, clean(data))
