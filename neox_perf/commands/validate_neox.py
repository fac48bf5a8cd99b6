"""`neox-perf validate --neox NEOX_SRC CONFIG... --gpus N --cluster NAME`.

The measured side is GPT-NeoX's own training program: the configs are merged as deepy.py
merges them, the keys a CPU run needs are set (world size, gloo, iterations, no evaluation,
and the tiny offline dataset when the config's data is not readable here), and NeoX's
unmodified deepy.py + train.py trains it under `neox-perf run` (neox_perf.testing.neox_cpu).
Predicted and measured come from that run's report: the prediction the hook made from the
NeoX args every rank received, against the iterations the hook timed outside its
profiling windows. Same result object as `validate`, so the same table prints.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from ..errors import UsageError
from .validate import (COMPONENTS, ConfigValidation, LaunchFailed, Progress, ValidateResult,
                       around_launch, machine_speed)

WARMUP = 2  # iterations before the profiling window (JIT, allocator warm-up)
WINDOW = "skip=2,warmup=1,active=2,every=100000,repeat=1"
WINDOW_ITERATIONS = 4  # warm-up + active + the iteration after the window (waits on mapping)


def _cpu_values(values: dict, gpus: int, iters: int, data_prefix: Optional[str],
                on_cpu: bool) -> dict:
    out = dict(values)
    out.update({"global_num_gpus": gpus, "num_gpus": gpus,
                "train_iters": WARMUP + WINDOW_ITERATIONS + iters, "eval_iters": 0,
                "eval_interval": 100000, "log_interval": 1, "no_save_rng": True,
                "no_load_rng": True})
    out.pop("save", None)
    out.pop("load", None)
    out["lr_decay_iters"] = out["train_iters"]
    if on_cpu:
        out["distributed_backend"] = "gloo"
    if data_prefix is not None:
        for key in ("train_data_paths", "valid_data_paths", "test_data_paths", "vocab_file",
                    "merge_file", "label_data_paths"):
            out.pop(key, None)
        out.update({"data_path": data_prefix, "data_impl": "mmap", "split": "1000,0,0",
                    "tokenizer_type": "CharLevelTokenizer"})
    return out


def _data_readable(values: dict) -> bool:
    path = values.get("data_path")
    if not path and values.get("train_data_paths"):
        path = values["train_data_paths"][0]
    return bool(path) and os.path.exists(str(path) + ".idx")


def write_neox_config(configs, gpus: int, iters: int, work: Path, src: str) -> tuple:
    """(merged config path, notes): the user's files merged, CPU keys set, one YAML."""
    import yaml

    from ..config import load_files
    from ..testing import neox_cpu
    raw = load_files(list(configs))
    values = dict(raw.values)
    notes = []
    data = None
    if not _data_readable(values):
        data = neox_cpu.build_dataset(str(work), src)
        notes.append("the config's training data is not readable here: trained on the tiny "
                     "offline dataset (NeoX's CharLevelTokenizer, vocabulary 512)")
    values = _cpu_values(values, gpus, iters, data, on_cpu=not _cuda())
    values["master_port"] = neox_cpu.free_port()
    path = work / (Path(configs[-1]).stem + "-neox-perf.yml")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(f"# {', '.join(map(str, configs))} merged by neox-perf validate --neox\n")
        yaml.safe_dump(values, fh, sort_keys=False)
    return path, notes


def _cuda() -> bool:
    from ..calibration.launch import cuda_available
    return cuda_available()


def _rows(report: dict, m: int) -> tuple:
    """(predicted, measured) seconds per validate component, per iteration, slowest stage."""
    comp = {r["name"]: r for r in report.get("components") or []}

    def get(name, side, scale=1.0):
        v = (comp.get(name) or {}).get(side)
        return None if v is None else v * scale

    pred, meas = {}, {}
    for side, out in (("predicted", pred), ("measured", meas)):
        out["forward"] = get("stage_forward_max", side, m)
        out["backward"] = get("stage_backward_max", side, m)
        out["tp_allreduce"] = get("mp_allreduce", side)
        out["p2p"] = get("pp_p2p", side)
        out["grad_sync"] = sum(v for v in (get("dp_allreduce", side), get("dp_allgather", side),
                                           get("tied_allreduce", side)) if v is not None)
        out["optimizer"] = get("optimizer", side)
    it = report["iteration"]
    for out, total in ((pred, it.get("predicted")), (meas, (it.get("measured") or {}).get("min"))):
        known = sum(v for c, v in out.items() if v is not None)
        out["other"] = max(total - known, 0.0) if total is not None else None
    return pred, meas


def _component_rows(pred: dict, meas: dict) -> List[dict]:
    rows = []
    for c in COMPONENTS:
        p, m = pred.get(c) or 0.0, meas.get(c) or 0.0
        rows.append({"component": c, "predicted_seconds": p, "measured_seconds": m,
                     "error": (p / m - 1.0) if m > 0 else None})
    return rows


def _memory_notes(rows: List[dict]) -> List[str]:
    """One line per stage: the peak of live tensor bytes (the hook's window) against check's
    prediction for the stage (the table per component prints beside the timings)."""
    out = []
    for r in rows:
        out.append(f"memory stage {r['stage']} (rank {r['rank']}): peak live bytes predicted "
                   f"{r['predicted'] / 2**20:.1f} MiB, measured {r['measured'] / 2**20:.1f} MiB "
                   f"({100 * r['error']:+.2f}%)")
    return out


def validate_neox_one(configs, gpus: int, cluster: str, iters: int, src: str,
                      work: Path, progress: Optional[Progress] = None) -> ConfigValidation:
    from ..runs import prediction
    from ..runs import report as run_report
    from ..testing import neox_cpu
    label = Path(configs[-1]).stem
    if progress is not None:
        progress(0, 1, f"{label} (GPT-NeoX deepy.py starting)")
    merged, notes = write_neox_config(configs, gpus, iters, work, src)
    run_dir = work / "run"
    run = neox_cpu.launch(str(merged), str(work / "logs"), src=src, hook_dir=str(run_dir),
                          cluster=cluster, windows=WINDOW)
    if run.returncode != 0:
        raise LaunchFailed(f"GPT-NeoX training exited with code {run.returncode}: "
                           f"{_last_error(run.log)} (full log: {work / 'logs'})")
    if progress is not None:
        progress(1, 1, label)
    rep = run_report.build(str(run_dir), cluster=cluster)
    it = rep["iteration"]
    measured = it.get("measured") or {}
    if it.get("predicted") is None or not measured.get("min"):
        raise LaunchFailed(f"no prediction or no measured iteration in {run_dir}: "
                           + "; ".join(rep.get("notes", [])[:3]))
    layout = dict(rep.get("layout") or {})
    m = int(layout.get("micro_batches") or 1)
    pred, meas = _rows(rep, m)
    for c in rep.get("coverage") or []:
        if c.get("fraction") is not None:
            notes.append(f"rank {c['rank']} (stage {c['stage']}): {100 * c['fraction']:.1f}% of "
                         f"forward+backward time mapped to the decomposition's operators")
    try:
        summaries = _rank0_summary(run_dir)
        cfg, derived, _ = prediction.rebuild(summaries["config"], summaries["facts"])
        if cfg is not None and run.logged_params is not None \
                and derived.params.neox_logged != run.logged_params:
            notes.append(f"parameters: NeoX logged {run.logged_params:,}, the prediction's "
                         f"model has {derived.params.neox_logged:,}")
    except Exception as exc:  # the table still stands without the parameter check
        notes.append(f"config not rebuilt for the parameter check ({exc.__class__.__name__})")
    notes += _memory_notes(rep.get("memory") or [])
    notes += [n for n in rep.get("notes", []) if "ran on CPU; profile" not in n]
    return ConfigValidation(
        config=[str(c) for c in configs],
        layout={**layout, "source": "GPT-NeoX deepy.py + train.py", "neox": src,
                "logged_params": run.logged_params},
        predicted_seconds=float(it["predicted"]), measured_seconds=float(measured["min"]),
        measured_median_seconds=float(measured.get("median") or measured["min"]),
        iterations=int(measured.get("used") or 0), warmup=WARMUP,
        components=_component_rows(pred, meas), stages=[],
        notes=list(dict.fromkeys(notes)), memory=list(rep.get("memory") or []))


def _rank0_summary(run_dir: Path) -> Dict:
    import json
    with open(run_dir / "rank-00000.json", encoding="utf-8") as fh:
        return json.load(fh)


def _last_error(log: str) -> str:
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln[-200:]
    return lines[-1][-200:] if lines else "no output"


def run_validate_neox(args, progress: Optional[Progress] = None) -> ValidateResult:
    from ..prediction.predict import load_cluster
    from ..testing.neox_cpu import NeoxUnavailable, neox_src
    try:
        src = neox_src(args.neox)
    except NeoxUnavailable as exc:
        raise UsageError(f"--neox: {exc}") from None
    profile = load_cluster(args.cluster)  # fail before a long launch on a bad profile
    iters = int(getattr(args, "iters", None) or 10)
    from ..profile.disturbance import profile_warnings
    result = ValidateResult(cluster=profile.name, gpus=args.gpus,
                            profile_warnings=profile_warnings(profile))
    workdir = getattr(args, "workdir", None)
    own = not workdir
    work = Path(tempfile.mkdtemp(prefix="neox-perf-validate-neox-")) if own else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    try:
        one, now = around_launch(profile, lambda: validate_neox_one(
            args.configs, args.gpus, args.cluster, iters, src, work, progress))
        one.reference_seconds_per_loop, one.machine_speed = now, machine_speed(profile, now)
        result.results.append(one)
    finally:
        if own:
            import shutil
            shutil.rmtree(work, ignore_errors=True)
    return result
