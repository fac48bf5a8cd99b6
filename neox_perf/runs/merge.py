"""A hooked run's samples merged into the calibration store a profile was fitted from.

The refit of `calibrate --from-run`: merge_run_samples copies the run's operator and
collective samples into that store (once per job), and the same trainer then fits the
profile again from calibration + run samples together (predictors/fitting/calibrated.fit_store); the
stage times of every merged run are kept in the store for the engine terms (engine_rows).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from . import FromRunError
from . import files as runfiles


# Calibration samples keep the fastest of their repetitions as `seconds` (calibration/bench.py:
# a kernel alone, nothing interfering); the hook keeps the median of a run's calls there
# (sample_writer.py). The trainer fits `seconds`, so a merged run sample takes the run's
# fastest call as its `seconds` -- one statistic for every row of a regressor. The run's
# median stays in the row's `median` column, and what a real step adds beyond best-case
# operators remains the engine terms' job. Even the fastest call of a run was timed under the
# profiler inside a full step (operands out of cache, other ranks' traffic), so it is often
# slower than the calibration's point; both stay, and the trainer's cleaning drops a row only
# when it is far from all its neighbours.
MERGED_STATISTIC = "min"


def merge_run_samples(run_dir: str, store_path, *, device: int, dtype: Optional[str],
                      statistic: str = MERGED_STATISTIC,
                      stages: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Copy the run dir's samples into the calibration store at `store_path` as samples of
    its calibrated `device`, tagged with their origin ("run:<job>"). A second merge of the
    same job adds nothing: each job gets one run id in the store and the store keeps one row
    per (point, run id, rank). Samples of another dtype than the calibration's are skipped.
    ``stages`` (stage_measurements) is kept in the info of its job's run in the store, so
    every later refit finds the engine rows of every merged run."""
    from neox_perf.calibration.fingerprint import fingerprint_id
    from neox_perf.calibration.store import SampleStore
    run_dir = os.path.abspath(run_dir)
    files = runfiles.store_files(run_dir)
    out: Dict[str, Any] = {"run_dir": run_dir, "stores": files, "statistic": statistic,
                           "read": 0, "added": 0, "already": 0, "skipped": {}, "origins": [],
                           "notes": []}
    with SampleStore(store_path) as target:
        devices = target.devices()
        if device not in devices:
            raise FromRunError(f"{store_path}: no device {device} in this store (fix: pass the "
                               f"--store the profile was calibrated into)")
        want = devices[device]
        runs = {r["info"].get("origin"): r["id"] for r in target.runs()
                if r["kind"] == "run" and r["info"].get("origin")}
        for path in files:
            with SampleStore(path) as source:
                src_devices = source.devices()
                src_runs = {r["id"]: r for r in source.runs()}
                samples = source.samples(source="run")
            for dev_id, fp in src_devices.items():
                if not any(s.device_id == dev_id for s in samples):
                    continue
                for key in ("kind", "device_name"):
                    if fp.get(key) != want.get(key):
                        raise FromRunError(
                            f"{run_dir}: the run ran on {fp.get('device_name')} ({fp.get('kind')}), "
                            f"the profile was calibrated on {want.get('device_name')} ({want.get('kind')}) "
                            f"(fix: recalibrate from a run on the calibrated machine, or calibrate this "
                            f"one: neox-perf calibrate --cluster NEW_NAME)")
                differ = sorted(k for k in set(fp) | set(want) if fp.get(k) != want.get(k))
                if differ:
                    out["notes"].append(
                        f"the run's device differs from the calibrated one in {', '.join(differ)} "
                        f"({fingerprint_id(fp)} vs {fingerprint_id(want)}); merged as the calibrated device")
            for s in samples:
                out["read"] += 1
                if dtype is not None and s.dtype != dtype:
                    reason = f"dtype {s.dtype}, the calibration's is {dtype}"
                    out["skipped"][reason] = out["skipped"].get(reason, 0) + 1
                    continue
                src = src_runs.get(s.run_id) or {}
                job = (src.get("info") or {}).get("job")
                origin = f"run:{job}" if job else f"run:{run_dir}"
                if origin not in runs:
                    runs[origin] = target.register_run("run", device=device, plan="from-run", info={
                        "origin": origin, "run_dir": run_dir, "job": job,
                        "statistic": statistic})
                    target.finish_run(runs[origin])
                if origin not in out["origins"]:
                    out["origins"].append(origin)
                seconds = s.min if statistic == "min" else s.median
                added = target.add_sample(
                    s.op, s.phase, s.features, seconds, device=device, run=runs[origin],
                    dtype=s.dtype, source="run", repeats=s.repeats, median=s.median, iqr=s.iqr,
                    min_seconds=s.min, rank=s.rank, stage=s.stage,
                    info={"origin": origin, "store": path, "sample": s.id, "seconds": statistic,
                          **{k: v for k, v in s.info.items() if k in ("window", "mean")}})
                out["added" if added else "already"] += 1
        if stages is not None:
            job = stages.get("job")
            origin = f"run:{job}" if job else f"run:{run_dir}"
            info = {"origin": origin, "run_dir": run_dir, "job": job, "statistic": statistic,
                    "stages": stages}
            if origin not in runs:
                runs[origin] = target.register_run("run", device=device, plan="from-run", info=info)
            target.finish_run(runs[origin], info=info)  # a re-merge replaces, never adds
            if origin not in out["origins"]:
                out["origins"].append(origin)
    return out


def merged_stage_records(store_path, device: int) -> List[Dict[str, Any]]:
    """The stage_measurements of every run merged into the store for `device`."""
    from neox_perf.calibration.store import SampleStore
    with SampleStore(store_path) as store:
        return [r["info"]["stages"] for r in store.runs()
                if r["kind"] == "run" and r["device_id"] == device and r["info"].get("stages")]
