"""`neox-perf calibrate --cluster NAME --from-run RUN_DIR`: correct a profile by a hooked run.

The command checks its arguments and chooses the method and where the result goes; the use
case (merge, refit, level, swap) is neox_perf/runs/from_run.py:

- refit: NAME was fitted by `neox-perf calibrate` from a sample store that still exists (its
  manifest names it; --store overrides): refitted in place (or into --out);
- level: any other profile (bundled, or its store gone): a level-corrected copy under a new
  name, NAME-run in the user profiles (or --out): a bundled name would hide a user profile of
  the same name. A copy corrected before is corrected again in place.

A run dir or store that is not there is a usage error; run data that cannot be used is a
data error (runs.FromRunError). No torch here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..calibration.launch import FIT_LIBRARIES, require_libraries
from ..errors import UsageError
from ..profile.directory import bundled_dir, is_bundled, user_profiles_dir
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
    from ..prediction.predict import load_cluster
    try:
        return load_cluster(cluster)
    except UsageError as exc:
        raise UsageError(f"--cluster {exc.line()}") from None


def _store_of(args, prof, notes) -> Optional[Path]:
    """The sample store to merge into and refit from, or None for a level correction."""
    given = getattr(args, "store", None)
    bundled = is_bundled(prof.path)
    if given:
        store = Path(given).expanduser()
        if bundled:
            raise UsageError(f"--store {store}: {prof.name} is a bundled profile, not one fitted "
                             f"from a store (fix: drop --store, or name your own profile in --cluster)")
        if not store.is_file():
            raise UsageError(f"--store {store}: no such sample store (fix: pass the --store "
                             f"`neox-perf calibrate --cluster {prof.name}` wrote)")
    else:
        recorded = prof.manifest.provenance.store if prof.manifest.provenance else None
        if bundled or not recorded:
            return None
        if not Path(recorded).is_file():
            notes.append(f"the store {prof.name} was fitted from ({recorded}) is gone: a level "
                         f"correction instead of a refit (pass --store to refit)")
            return None
        store = Path(recorded)
    if prof.manifest.provenance is None or prof.manifest.provenance.device_id is None:
        raise UsageError(f"{prof.path}: the manifest names no calibrated device (fix: "
                         f"recalibrate it with `neox-perf calibrate --cluster {prof.name}`)")
    return store


def _level_out(args, prof, notes) -> Path:
    """Where a level correction goes: --out, the profile itself when it is a corrected copy
    already (corrected again, not NAME-run-run), else NAME-run among the user profiles."""
    if getattr(args, "out", None):
        return Path(args.out).expanduser()
    prov = prof.manifest.provenance
    if not is_bundled(prof.path) and prov is not None and prov.recalibrated is not None:
        return Path(prof.path)
    name = f"{prof.name}-run"
    if (bundled_dir() / name).is_dir():
        raise UsageError(f"--cluster {prof.name}: the corrected profile would be named {name}, "
                         f"which a bundled profile has (fix: pass --out DIR)")
    why = "a bundled profile" if is_bundled(prof.path) else "a profile without a sample store"
    notes.append(f"{prof.name} is {why}: the corrected copy is a new profile, {name}")
    return user_profiles_dir() / name


def run_from_run(args) -> FromRunResult:
    from ..runs.from_run import recalibrate
    run_dir = _check_run_dir(args.from_run)
    prof = _load(str(args.cluster))
    notes: list = []
    store = _store_of(args, prof, notes)
    # a refit runs the trainer (all the fitting libraries); a level correction refits its step
    # terms with SciPy's bounded least squares only
    require_libraries("calibrate --from-run", FIT_LIBRARIES if store is not None
                      else {m: d for m, d in FIT_LIBRARIES.items() if m == "scipy"})
    if store is not None:
        out = Path(args.out).expanduser() if getattr(args, "out", None) else Path(prof.path)
    else:
        out = _level_out(args, prof, notes)
    body = recalibrate(run_dir, prof, store=store, out=out, notes=notes)
    before, after, improved = body.pop("before"), body.pop("after"), body.pop("improved")
    where = Path(body["profile"]["path"])
    use = body["profile"]["name"] if where.parent == user_profiles_dir().resolve() else str(where)
    payload = {"cluster": str(args.cluster), "run_dir": run_dir, **body, "use": use,
               "before": before, "after": after, "improved": improved,
               "profile_warnings": list(after["profile_warnings"]),
               "notes": list(dict.fromkeys(notes + [f"before: {n}" for n in before["notes"]]
                                           + [f"after: {n}" for n in after["notes"]]))}
    return FromRunResult(payload)
