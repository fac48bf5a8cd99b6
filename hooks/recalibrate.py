"""Cluster profiles corrected by what a training run measured (for `calibrate --from-run`).

Two ways, chosen by commands/from_run.py:

- refit (a profile `neox-perf calibrate` fitted from a sample store that still exists):
  merge_run_samples copies the run's operator and collective samples into that store, and
  the same trainer fits the profile again from calibration + run samples together. The
  engine terms (what a DeepSpeed step costs beyond its operators) are fitted again from the
  engine calibration plus the rows the run's stages give (stage_measurements, EngineRows):
  the engine calibration measures one-process models at its own shapes, and its linear terms
  can be far off at a user's shapes, which no operator sample can fix;
- level correction (a bundled profile, or one whose store is gone): recalibrate_from_run
  scales each operator/phase and collective model of the profile by the median ratio
  measured / predicted over the run's samples of it (weighted by calls). A profile predicts
  `baseline(features) * exp(trees(features))` and the baseline is linear in its non-negative
  coefficients, so scaling the coefficients scales the prediction exactly and keeps the
  trees' shape. Models without samples in the run are left as they were; a model derived
  from another phase follows that phase. This fixes a level (a different GPU clock, a
  library version, CPU vs GPU), not a shape the original samples never covered.

run_errors measures a profile against the run (the numbers `neox-perf report` shows), so the
command can say how far off the profile was before and after. Profiles are written to a
temporary sibling directory and swapped into place (replace_dir): a crash at any moment
leaves either the old profile or the new one, never a mix of their files.
"""
from __future__ import annotations

import copy
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from . import prediction, summary


class FromRunError(Exception):
    """Input that cannot be used; the message is one line naming the path and the fix."""


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


# -- how far off a profile is on the run --------------------------------------------------

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
    }


# -- writing a profile directory in one step ----------------------------------------------

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc < 2.28, musl
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE) == 0


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_dir(final: Path) -> None:
    """Undo what a killed replace_dir left next to `final`: the previous profile moved aside
    (put back when `final` is missing) and temporary directories of dead processes."""
    final = Path(final)
    parent = final.parent
    if not parent.is_dir():
        return
    for kind in ("old", "tmp"):
        for path in sorted(parent.glob(f".{final.name}.{kind}-*")):
            try:
                pid = int(path.name[len(f".{final.name}.{kind}-"):].split("-")[0])
            except ValueError:
                continue
            if _pid_alive(pid):  # still writing (this process included)
                continue
            if kind == "old" and not final.exists():
                os.rename(path, final)
            else:
                shutil.rmtree(path, ignore_errors=True)


def write_manifest(path: Path, manifest: Dict[str, Any]) -> None:
    """A manifest inside a temporary profile directory: nobody reads it before the swap, so
    a plain write (mode per umask, unlike a mkstemp file's 0600) is enough."""
    import json
    Path(path).write_text(json.dumps(summary.clean(manifest), indent=1, allow_nan=False) + "\n")


def temp_dir_for(final: Path) -> Path:
    """An empty directory beside `final` (same file system, so it can be renamed onto it)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=str(final.parent)))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide the profile from a shared group
    return tmp


def replace_dir(new: Path, final: Path) -> None:
    """Put the finished directory `new` at `final`, replacing what was there in one step."""
    new, final = Path(new), Path(final)
    if not final.exists():
        os.rename(new, final)
    elif _exchange(new, final):  # `new` now holds the previous profile
        shutil.rmtree(new, ignore_errors=True)
    else:
        # Two renames: a kill between them leaves the previous profile at `old`, where
        # recover_dir (run before every write) puts it back.
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.rename(final, old)
        try:
            os.rename(new, final)
        except BaseException:
            os.rename(old, final)
            raise
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(final.parent)


# -- level correction -----------------------------------------------------------------------

def recalibrate_from_run(run_dir: str, profile, out_dir: str, name: Optional[str] = None) -> Dict[str, Any]:
    """Write a corrected copy of `profile` (name, directory or ClusterProfile) to `out_dir`,
    named `name` (default: the directory's name); out_dir is replaced in one step."""
    from neox_perf import opspec
    from neox_perf.predictors.profile import MANIFEST_FILE, load_profile
    prof = load_profile(profile) if not hasattr(profile, "manifest") else profile
    samples, devices = _run_samples(os.path.abspath(run_dir))
    if not samples:
        raise FromRunError(f"{run_dir}: no run samples to recalibrate from (fix: run the job "
                           f"with `neox-perf run` and at least one profiling window)")
    ratios: Dict[Tuple[str, str], List[Tuple[float, int]]] = {}
    skipped: Dict[str, str] = {}
    for s in samples:
        phase = "comm" if s.op in opspec.COLLECTIVES else s.phase
        pred, why = prediction.predict_call(prof, s.op, phase, s.features, s.dtype)
        if not pred or pred <= 0:
            skipped[f"{s.op}/{phase}"] = why or "no prediction"
            continue
        # The median of the calls: what `neox-perf report` compares a prediction with.
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
    final = Path(out_dir)
    name = name or final.resolve().name
    manifest["name"] = name
    manifest.setdefault("provenance", {})["recalibrated"] = {
        "from_profile": prof.name, "run_dir": os.path.abspath(run_dir), "time": time.time(),
        "method": "baseline coefficients x weighted median(measured / predicted) per model",
        "factors": factors, "skipped": skipped, "devices": devices}
    recover_dir(final)
    tmp = temp_dir_for(final)
    try:
        arrays = (manifest.get("arrays") or {}).get("file")
        if arrays:  # the trees, unchanged (the manifest keeps their checksum)
            shutil.copy2(os.path.join(str(prof.path), arrays), tmp / arrays)
        write_manifest(tmp / MANIFEST_FILE, manifest)
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"profile": str(final.resolve()), "name": name, "from_profile": prof.name,
            "factors": factors, "skipped": skipped, "samples": len(samples)}


# -- merging a run into a calibration store -------------------------------------------------

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
    files = summary.store_files(run_dir)
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


# -- engine rows from a run -------------------------------------------------------------------

def stage_measurements(run_dir: str) -> Optional[Dict[str, Any]]:
    """What each pipeline stage of the run's (latest) job took, per micro-batch (forward,
    backward) and per iteration (optimizer step, gradient reduction), the slowest member of
    each stage, with the recorded config and engine facts to rebuild its decomposition.

    The phases come from the profiling windows, which the profiler slows down on purpose;
    they are scaled by (median plain iteration) / (profiled iteration) so that they add up
    to what an iteration takes without the profiler. None without windows or a config."""
    from .report import _per_iter, _pick_job
    from .timing import read_iterations
    ranks = _pick_job(summary.read_rank_summaries(run_dir), [])
    ranks = [s for s in ranks if s.get("window_iterations")]
    if not ranks or not (ranks[0].get("config") or {}).get("values"):
        return None
    series: Dict[int, List[Tuple[float, bool]]] = {}
    for s in ranks:
        for i, sec, prof in read_iterations(summary.iterations_file(run_dir, s["rank"])):
            series.setdefault(i, []).append((sec, prof))
    plain = [max(sec for sec, _ in v) for i, v in series.items()
             if i > 0 and len(v) == len(ranks) and not any(p for _, p in v)]
    profiled = max((_per_iter(s, "iteration") or 0.0) for s in ranks)
    factor = 1.0
    if plain and profiled > 0:
        factor = min(statistics.median(plain) / profiled, 1.0)
    ref = ranks[0]
    facts = ref.get("facts") or {}
    m = int(facts.get("micro_batches") or facts.get("gradient_accumulation_steps") or 1)
    stages: Dict[str, Dict[str, Optional[float]]] = {}
    for s in ranks:
        st = str(int((s.get("facts") or {}).get("stage") or 0))
        row = stages.setdefault(st, {})
        for phase, per in (("forward", m), ("backward", m), ("optimizer_step", 1), ("reduce_grads", 1)):
            v = _per_iter(s, phase)
            if v is not None:
                row[phase] = max(row.get(phase) or 0.0, v * factor / per)
    return {"job": ref.get("job"), "config": ref.get("config"), "facts": facts,
            "profiler_factor": factor, "stages": stages}


class EngineRows:
    """``extra_rows`` for predictors.local.fit_engine: engine-term rows from merged runs.

    The engine terms model what a step costs beyond its operators, and the engine
    calibration measures that on one-process models at its own shapes; a run measures it at
    the shapes the user trains. Per run, against the profile being fitted:
    - a pipeline stage without the head holds only layers (and the embedding, an operator):
      per layer, measured = (stage time - its other operators - gradient accumulation) / layers,
      a row of layer_forward / layer_backward at x = the layer's operators;
    - the head stage then gives other_forward / other_backward: its time minus its layers at
      that measured per-layer time, at x = its logits;
    - every stage gives optimizer_step (tensors, parameters, step) on DeepSpeed's non-ZeRO
      path, and grad_flatten (parameters, gradient reduction) when nothing is all-reduced
      across data-parallel ranks (dp 1).
    A run that cannot be split this way (one stage, tensor parallel, another precision)
    gives only the rows it can, and says so in ``notes``."""

    TERMS = ("layer_forward", "layer_backward", "other_forward", "other_backward",
             "optimizer_step", "grad_flatten", "grad_accumulate")

    def __init__(self, records: List[Dict[str, Any]], precision: Optional[str], accumulate: dict):
        self.records, self.precision, self.accumulate = records, precision, accumulate or {}
        self.notes: List[str] = []
        self.counts: Dict[str, int] = {}

    def _acc(self, tensors: float, params: float, m: int) -> float:
        c = self.accumulate
        return (c.get("per_tensor", 0.0) * tensors + c.get("per_param", 0.0) * params) * (m - 1) / m

    def __call__(self, profile) -> Dict[str, list]:
        from neox_perf.operators import OpCall, decompose
        out: Dict[str, list] = {t: [] for t in self.TERMS}
        self.notes = []

        def ops(calls) -> float:
            return sum(profile.predict(c.op, c.phase, c.feature_dict()).seconds * c.count
                       for c in calls if isinstance(c, OpCall))

        for rec in self.records:
            job, facts = rec.get("job") or "?", rec.get("facts") or {}
            try:
                cfg, derived, _ = prediction.rebuild(rec.get("config") or {}, facts,
                                                     profile.facts.gpus_per_node)
                if cfg is None:
                    self.notes.append(f"run {job}: its config could not be rebuilt; no engine rows")
                    continue
                dec = decompose(cfg, derived.padded_vocab, prediction.stage_shapes(derived, facts))
                if dec.precision != self.precision:
                    self.notes.append(f"run {job}: {dec.precision}, the engine terms are "
                                      f"{self.precision}; no engine rows")
                    continue
                m = dec.micro_batches
                measured = {int(k): v for k, v in (rec.get("stages") or {}).items()}
                works = {w.index: w for w in dec.stages}
                split = len(works) > 1 and (facts.get("mp") or 1) == 1
                if not split:
                    self.notes.append(f"run {job}: one stage or tensor parallel: its layers and "
                                      f"head cannot be told apart, so no layer/head rows")
                per_layer: Dict[str, List[float]] = {"forward": [], "backward": []}
                for st, w in sorted(works.items()):
                    got = measured.get(st) or {}
                    if not split or w.logits_elements > 0 or not w.transformer_layers:
                        continue
                    for phase, term, calls, other in (
                            ("forward", "layer_forward", w.layer_forward, w.forward),
                            ("backward", "layer_backward", w.layer_backward, w.backward)):
                        if not got.get(phase):
                            continue
                        extra = self._acc(w.param_tensors, w.params_per_rank, m) if phase == "backward" else 0.0
                        x = ops(calls)
                        meas = (got[phase] - ops(other) - extra) / w.transformer_layers
                        if meas > 0:
                            out[term].append((x, meas - x, meas))
                            per_layer[phase].append(meas)
                for st, w in sorted(works.items()):
                    got = measured.get(st) or {}
                    if split and w.logits_elements > 0:
                        for phase, term, other in (("forward", "other_forward", w.forward),
                                                   ("backward", "other_backward", w.backward)):
                            if not got.get(phase) or not per_layer[phase]:
                                continue
                            extra = self._acc(w.param_tensors, w.params_per_rank, m) if phase == "backward" else 0.0
                            meas = (got[phase] - extra
                                    - w.transformer_layers * statistics.median(per_layer[phase]))
                            if meas > 0:
                                out[term].append((w.logits_elements, meas - ops(other), meas))
                            else:
                                self.notes.append(f"run {job}: stage {st}'s {phase} took no longer "
                                                  f"than its layers at the other stages' pace: no "
                                                  f"{term} row")
                    if dec.zero_stage == 0 and got.get("optimizer_step"):
                        out["optimizer_step"].append((w.param_tensors, w.params_per_rank,
                                                      got["optimizer_step"]))
                    if (facts.get("pipeline") and (facts.get("dp") or 1) == 1
                            and got.get("reduce_grads")):
                        out["grad_flatten"].append((w.params_per_rank, got["reduce_grads"]))
            except Exception as exc:  # a profile without an operator this run needs
                line = getattr(exc, "line", None)
                self.notes.append(f"run {job}: no engine rows ({line() if callable(line) else exc})")
        self.counts = {k: len(v) for k, v in out.items() if v}
        return out
