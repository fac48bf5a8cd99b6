"""First contact with a GPU: calibrate, predict, train and measure on one CUDA GPU, in one command.

    python benchmarks/gpu_check.py --out DIR [--budget-s 480] [--iters 30] [CONFIG ...]
    python benchmarks/gpu_check.py --out DIR --dry-run     # the same steps on the CPU, tiny shapes

Steps (each timed; one that fails is reported and the rest go on where they can):
  requirements  every library the steps import, checked first: one line naming what is missing
  machine       GPU, driver, torch, CUDA, NCCL, DeepSpeed, TF32 state of fp32 matmuls, nvidia-smi's
                clocks/temperature/power (before the work; read again at the end)
  calibrate     `neox-perf calibrate --quick --for CONFIG...` through its command function on
                this GPU, the quick plan thinned (calibration/plan.sized_to) until the roofline
                estimate of its sweep on this GPU's data-sheet rates fits --operators-s, plus
                the configs' own shapes whole; then the engine step and the fit
  runs          each config trained for real under DeepSpeed (`validate`'s validate_one: the
                reference workload, WARMUP + --iters iterations, one process), nvidia-smi's
                memory.used sampled meanwhile; predicted with the fresh profile, with the bundled
                A100 samples transferred to a one-GPU description of this GPU, with the bundled
                A100 profile as it is, and (on an H100) with examples/clusters/dgx-h100.yml;
                each prediction's error against the measured minimum and its 80% interval
  memory        per config: the live-bytes tracker's peak and components, max_memory_allocated,
                max_memory_reserved, nvidia-smi's used memory, against check's per-component
                prediction and its device terms (derive/device_memory.py)
  host          benchmarks/host_path.py in this process: the host's time per framework call
                under CUDA and on this host's CPU (the workload's layers alone, tiny, 2 against
                10 layers): what the CUDA launch path adds to dispatch_s's CPU-measured prior
  overhead      benchmarks/hook_overhead.py under CUDA (nccl, CUDA events): plain and hooked
                iterations alternated, the hook's own machinery, losses plain vs hooked
Writes DIR/gpu_check.json (everything) and DIR/gpu_check.md (the summary); the working files
(sample store, profile, launch logs) go to --work (default: a temporary folder, removed).

--dry-run walks every step on the CPU accelerator (gloo) with tiny shapes: a tiny plan, one
tiny engine shape, the configs shrunk (2 layers, hidden 64, seq 32, CharLevelTokenizer),
3 iterations, 2 overhead rounds. Its numbers say nothing about a GPU; it proves the steps run.
The recipe to carry what a GPU machine lacks (DeepSpeed, its pure-python needs, xgboost) is in
docs/gpu-check.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONFIGS = sorted((HERE / "gpu_check").glob("*.yml"))
CLUSTER = "gpu-check"
BUDGET_S = 480.0  # the issue's 8 minutes, whole
# A config's launch (torchrun, DeepSpeed's import, the model, the tracker's iteration, 30
# iterations) is given this much at least before it is started; the overhead benchmark likewise.
RUN_FLOOR_S, OVERHEAD_FLOOR_S, REPORT_S = 40.0, 40.0, 10.0
# the host step (host_path.py): the layers at host_cost.py's size on each device, and on the CPU
# also so small that its own kernels leave the call and the host's path remains
HOST_SIZES = {"cuda": [(64, 4, 32)], "cpu": [(64, 4, 32), (8, 1, 4)]}
HOST_FLOOR_S = 20.0
# What the GPU check imports (module -> what to install); torch is the machine's own build.
NEEDS = {"torch": "torch", "deepspeed": "deepspeed", "pydantic": "pydantic (DeepSpeed's)",
         "hjson": "hjson (DeepSpeed's)", "sklearn": "scikit-learn", "scipy": "scipy",
         "xgboost": "xgboost-cpu", "yaml": "PyYAML", "numpy": "numpy", "rich": "rich",
         "neox_perf.calibration": "neox-perf installed from this checkout (pip install --no-deps .)"}

# --dry-run: shapes that run in seconds on a CPU core
def tiny_plan() -> dict:
    """--dry-run: every operator of the quick plan (the engine fit needs each one the engine's
    model runs), each on a 2 x 2 grid of tiny shapes."""
    from neox_perf.calibration.plan import load_plan
    ops = sorted({p.op for p in load_plan("quick").points})
    return {"name": "gpu-check-dry-run", "protocol": {"warmup": 0, "repeats": 2},
            "defaults": {"mp": 1, "b": 1, "l": [16, 32], "d": [32, 64], "h": 2, "vocab": 256},
            "ops": {op: ({"params": [1000, 4000, 16000]} if op == "optimizer" else {}) for op in ops}}


TINY_ENGINE_SHAPE = (64, 32, 1, "layernorm", "global", 256)
TINY_CONFIG = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
               "max_position_embeddings": 32, "train_micro_batch_size_per_gpu": 2,
               "gradient_accumulation_steps": 2, "tokenizer_type": "CharLevelTokenizer"}


class Budget:
    def __init__(self, seconds: float, clock=time.monotonic):
        self.clock, self.start, self.seconds = clock, clock(), seconds

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()


def say(text: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _why(exc: BaseException) -> str:
    line = exc.line() if hasattr(exc, "line") else f"{exc.__class__.__name__}: {exc}"
    return " ".join(str(line).split())[:600]


# -- requirements ---------------------------------------------------------------------------

def missing(needs: Optional[Dict[str, str]] = None) -> List[str]:
    """What is not importable (default: NEEDS), by what to install."""
    import importlib.util
    out = []
    for module, dist in (NEEDS if needs is None else needs).items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing
            found = False
        if not found:
            out.append(dist)
    return out


def requirements(dry_run: bool) -> Optional[str]:
    """None when every step can run here, else the one line saying what is missing."""
    lacking = missing()
    if lacking:
        return (f"gpu_check needs {', '.join(lacking)}, not installed here (fix: the wheels recipe "
                f"in docs/gpu-check.md; on a GPU machine without network carry them as .whl)")
    if not dry_run:
        import torch
        if not torch.cuda.is_available():
            return (f"gpu_check needs a CUDA GPU: torch {torch.__version__} sees none (fix: run it "
                    f"on a GPU node, or --dry-run to walk the steps on the CPU)")
    return None


# -- machine --------------------------------------------------------------------------------

def machine_facts(cuda: bool) -> Dict[str, object]:
    from neox_perf.calibration import cuda_facts
    out: Dict[str, object] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                              "platform": platform.platform()}
    out.update(cuda_facts.versions())
    from importlib import metadata
    for dist in ("deepspeed", "neox-perf"):  # read, not imported: DeepSpeed's import takes seconds
        try:
            out[dist.replace("-", "_")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist.replace("-", "_")] = None
    out["tf32"] = cuda_facts.tf32_state()
    out["nvidia_smi"] = cuda_facts.nvidia_smi() if cuda else {"error": "--dry-run: no GPU asked for"}
    return out


def clocks(cuda: bool) -> Dict[str, object]:
    from neox_perf.calibration import cuda_facts
    if not cuda:
        return {"error": "--dry-run: no GPU asked for"}
    return cuda_facts.nvidia_smi(("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw",
                                  "memory.used", "pstate"))


def gpu_row(facts: Dict[str, object], dry_run: bool):
    """The GPU table row (predictors/gpus.py) of the device, or None; in --dry-run a stand-in
    (H100-SXM5-80GB) so that the transfer step is walked."""
    from neox_perf.predictors import gpus
    name = facts.get("gpu")
    if name:
        return gpus.find_gpu(str(name))
    return gpus.gpu("H100-SXM5-80GB") if dry_run else None


# -- calibrate ------------------------------------------------------------------------------

def sized_quick_plan(row, operators_s: float, per_point_s: float):
    """The quick plan thinned to fit ``operators_s`` on ``row``'s rates (half its achievable
    fp16 rate and half its HBM bandwidth: a pessimistic roofline, as the plan tests use)."""
    from dataclasses import replace

    from neox_perf.calibration.plan import load_plan, roofline_seconds, sized_to
    # one sweep: the check has a lent GPU's fixed minutes, and a second sweep's set-up per point
    # (calibration/sweep.py) would push even the trainer's floor of points past the operators'
    # budget (79 s against 60 s on an H100's rates); a dedicated GPU does not share the slow
    # stretches of a VM's other guests that the second sweep is for
    plan = replace(load_plan("quick"), sweeps=1)
    if row is None:  # a GPU the table does not know: no rates to size by
        return plan, {"plan": "quick", "points_in_quick": len(plan.points), "stride": 1,
                      "points_kept": len(plan.points), "estimated_seconds": float("nan"),
                      "why": "GPU not in predictors/gpus.py: the quick plan whole"}
    rate = row.achievable("fp16")
    flops = (rate.tflops if rate is not None else row.peak_tflops("fp16")) * 1e12
    seconds_of = roofline_seconds(0.5 * flops, 0.5 * row.hbm_gbps * 1e9)
    sized, stride, estimate = sized_to(plan, operators_s, seconds_of, per_point=per_point_s)
    return sized, {"plan": "quick", "points_in_quick": len(plan.points), "stride": stride,
                   "points_kept": len(sized.points), "estimated_seconds": estimate,
                   "per_point_s_assumed": per_point_s,
                   "rates_assumed": {"flops": 0.5 * flops, "bytes_per_s": 0.5 * row.hbm_gbps * 1e9,
                                     "gpu_row": row.name}}


def calibrate_step(configs: List[str], work: Path, dry_run: bool, row, operators_s: float,
                   per_point_s: float) -> Dict[str, object]:
    from neox_perf.commands.calibrate import run_calibrate
    if dry_run:
        plan_path = work / "tiny-plan.yml"
        plan_path.write_text(json.dumps(tiny_plan(), indent=1))  # JSON is YAML
        plan, sizing = str(plan_path), {"plan": "tiny (--dry-run)", "points_kept": None}
        from neox_perf.predictors.fitting import fit
        grid, shapes = fit.QUICK_GRID, [TINY_ENGINE_SHAPE]
    else:
        plan, sizing = sized_quick_plan(row, operators_s, per_point_s)
        grid, shapes = None, None
    args = argparse.Namespace(cluster=CLUSTER, quick=False, plan=plan, store=str(work / "calib.sqlite"),
                              out=str(work / "profile"), nproc=1, engine=True, for_configs=configs,
                              gpus=1, engine_shapes=shapes)
    last = {}

    def progress(step, done, total, label):
        if last.get("step") != step or done >= total:
            say(f"calibrate {step}: {int(done)}/{int(total)} {label}")
        last["step"] = step

    result = run_calibrate(args, progress=progress, grid=grid)
    data = result.to_dict()
    fit_rows = data.pop("fit")
    from neox_perf.calibration.plan import load_plan
    return {"sizing": sizing, "points_measured": data["operators"].get("measured"),
            "points_total": data["operators"].get("points"), "seconds": data["seconds"],
            "operators": data["operators"], "collectives": data["collectives"],
            "engine": data["engine"], "notes": data["notes"], "device": data["device"],
            "disturbance": data["disturbance"], "profile_warnings": data["profile_warnings"],
            "fit_rows": len(fit_rows), "fit": fit_rows, "profile": data["profile"],
            "plan_ops": sorted({p.op for p in load_plan(plan).points}) if dry_run else None}


# -- predictions ----------------------------------------------------------------------------

def describe_gpu(row, work: Path) -> Path:
    """A one-GPU cluster description of this GPU on the bundled A100 samples
    (docs/cluster-descriptions.md); the network keys are required but no collective runs."""
    path = work / "this-gpu.yml"
    path.write_text("\n".join([
        f"# written by benchmarks/gpu_check.py: one {row.name}, the bundled A100 samples moved to it",
        f"name: a100-as-{row.name}", "base: perlmutter-a100-80gb", f"gpu: {row.name}",
        "gpus_per_node: 1", "inter_node_Gbps: 200", ""]))
    return path


def prediction_ways(row, work: Path) -> Dict[str, str]:
    """name -> --cluster value: the fresh profile first."""
    ways = {"fresh": str(work / "profile")}
    if row is not None:
        ways["a100-transferred"] = str(describe_gpu(row, work))
    ways["a100-as-is"] = "perlmutter-a100-80gb"
    if row is not None and row.name == "H100-SXM5-80GB":
        ways["dgx-h100"] = str(REPO / "neox_perf" / "examples" / "clusters" / "dgx-h100.yml")
    return ways


def predict_ways(config: str, ways: Dict[str, str], device_type: str, measured: float):
    from neox_perf.commands.validate import predict
    from neox_perf.prediction.predict import load_cluster
    out = {}
    for name, cluster in ways.items():
        try:
            profile = load_cluster(cluster)
            p = predict([config], 1, profile, None, device_type)
            est = p.estimate
            lo_hi = list(est.interval_seconds) if est.interval_seconds else None
            out[name] = {"cluster": cluster, "seconds": est.iteration_seconds,
                         "error": est.iteration_seconds / measured - 1.0,
                         "interval_seconds": lo_hi,
                         "measured_inside": (lo_hi[0] <= measured <= lo_hi[1]) if lo_hi else None,
                         "precision": p.precision}
        except Exception as exc:  # one way failing leaves the others
            out[name] = {"cluster": cluster, "error_line": _why(exc)}
    return out


# -- runs -----------------------------------------------------------------------------------

def memory_summary(validation, smi: Optional[dict], smi_before: Optional[int]) -> List[dict]:
    """Per stage: every reading of the GPU's memory beside check's prediction of it."""
    rows = []
    for m in validation.memory:
        cuda = m.get("cuda") or {}
        used = smi.get("peak_bytes") if smi else None
        rows.append({
            "stage": m["stage"],
            "predicted_allocated": m["predicted"], "live_tracker_peak": m["measured"],
            "live_tracker_error": m["error"], "peak_moment": m.get("moment"),
            "predicted_moment": m.get("predicted_moment"),
            "components": m["components"],
            "max_memory_allocated": cuda.get("max_allocated"),
            "max_memory_reserved": cuda.get("max_reserved"),
            "predicted_device_total": m.get("device_total"),
            "predicted_device_terms": m.get("device_terms"),
            "nvidia_smi_used_peak": used,
            "nvidia_smi_used_before": smi_before,
            "nvidia_smi_workload": (used - smi_before) if used is not None and smi_before is not None else None,
            "tracker": m.get("tracker"),
        })
    return rows


def run_config(config: str, label: str, ways: Dict[str, str], iters: int, work: Path,
               cuda: bool) -> Dict[str, object]:
    from neox_perf.calibration import cuda_facts
    from neox_perf.commands.validate import validate_one
    from neox_perf.prediction.predict import load_cluster

    poller, before = None, None
    if cuda:
        import torch
        torch.cuda.empty_cache()  # this process's cached blocks are not the workload's
        before = cuda_facts.mib_bytes(cuda_facts.nvidia_smi(("memory.used",)).get("memory.used"))
        poller = cuda_facts.SmiPoller("memory.used", interval=0.25).start()
    started = time.monotonic()
    try:
        v = validate_one([config], 1, load_cluster(ways["fresh"]), iters,
                         workdir=work / "runs" / label,
                         progress=lambda done, total, _l: (say(f"{label}: iteration {int(done)}/{int(total)}")
                                                           if int(done) in (1, total) else None))
    finally:
        smi = poller.stop() if poller is not None else None
    seconds = time.monotonic() - started
    measured = v.measured_seconds
    return {"config": config, "label": label, "layout": v.layout, "iterations": v.iterations,
            "warmup": v.warmup, "measured_seconds": measured,
            "measured_median_seconds": v.measured_median_seconds, "wall_seconds": seconds,
            "predicted": predict_ways(config, ways, "cuda" if cuda else "cpu", measured),
            "components": v.components, "notes": v.notes,
            "extrapolated_share": v.extrapolated_share,
            "memory": memory_summary(v, smi, before), "nvidia_smi_poll": smi}


def tiny_configs(configs: List[str], work: Path) -> List[str]:
    """--dry-run: each config with its sizes replaced by TINY_CONFIG (the rest kept)."""
    import yaml
    out = []
    for config in configs:
        values = yaml.safe_load(Path(config).read_text())
        values.update(TINY_CONFIG)
        values.pop("vocab_file", None)
        if "attention_config" in values:
            values["attention_config"] = [[values["attention_config"][0][0], TINY_CONFIG["num_layers"]]]
        path = work / f"tiny-{Path(config).name}"
        path.write_text(json.dumps(values, indent=1))
        out.append(str(path))
    return out


# -- host -----------------------------------------------------------------------------------

def host_step(cuda: bool, dry_run: bool) -> Dict[str, object]:
    """The host's time per framework call under CUDA and on the CPU of this same host
    (benchmarks/host_path.py, in this process: the workload's layers alone, seconds): what the
    CUDA launch path adds to a call, against the CPU-measured prior of dispatch_s."""
    sys.path.insert(0, str(HERE))  # the sibling script, as calibrate_twice.py imports validate_local
    import host_path
    rounds, iters = (1, 3) if dry_run else (3, 30)
    out = {}
    for device in (["cuda"] if cuda else []) + ["cpu"]:
        for size in HOST_SIZES[device]:
            r = host_path.measure_device(device, size, rounds, iters)
            out[f"{device} {','.join(map(str, size))}"] = r
            say(host_path.line(r))
    return out


# -- overhead -------------------------------------------------------------------------------

def overhead_step(cuda: bool, rounds: int, iters: int, work: Path) -> Dict[str, object]:
    cmd = [sys.executable, str(HERE / "hook_overhead.py"), "--device", "cuda" if cuda else "cpu",
           "--rounds", str(rounds), "--iters", str(iters), "--json"]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(work), timeout=600)
    (work / "hook_overhead.log").write_text(proc.stdout + proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"hook_overhead.py exit {proc.returncode}: {tail[0][-300:]}")
    data = json.loads(lines[-1])
    loss = data.get("loss") or {}
    data["loss"] = {k: loss.get(k) for k in ("micro_batches", "identical", "max_abs_difference")}
    return data


# -- report ---------------------------------------------------------------------------------

def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def _mib(x) -> str:
    return "n/a" if x is None else f"{x / 2 ** 20:,.1f}"


def markdown(report: dict) -> str:
    m = report.get("machine") or {}
    tf = m.get("tf32") or {}
    smi = m.get("nvidia_smi") or {}
    lines = [f"# gpu_check {'(--dry-run: CPU, tiny shapes; no GPU number here)' if report['dry_run'] else ''}",
             "", f"{report['finished']}, {report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget; "
             f"exit {report['exit_code']}", "",
             "## Machine", "",
             f"- GPU: {m.get('gpu', 'none')} (capability {m.get('capability', 'n/a')}, "
             f"{_mib(m.get('gpu_memory_bytes'))} MiB); driver {smi.get('driver_version', 'n/a')}",
             f"- torch {m.get('torch')}, CUDA {m.get('cuda')}, NCCL {m.get('nccl')}, "
             f"DeepSpeed {m.get('deepspeed')}, neox-perf {m.get('neox_perf')}, Python {m.get('python')}",
             f"- fp32 matmuls as TF32: {tf.get('fp32_matmuls_as_tf32')} ({tf.get('why')}; "
             f"allow_tf32={tf.get('allow_tf32')}, "
             f"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE={tf.get('TORCH_ALLOW_TF32_CUBLAS_OVERRIDE')})",
             f"- clocks before: {json.dumps(report.get('clocks_before'))}",
             f"- clocks after: {json.dumps(report.get('clocks_after'))}", "",
             "## Steps", "", "| step | status | seconds | why |", "|---|---|---:|---|"]
    for s in report["steps"]:
        lines.append(f"| {s['step']} | {s['status']} | {s['seconds']:.1f} | {s.get('why') or ''} |")
    cal = report.get("calibrate")
    if cal:
        sz = cal.get("sizing") or {}
        sized = (f"1 point in {sz['stride']} kept per operator and phase ({sz['points_kept']} of "
                 f"{sz['points_in_quick']}), sweep estimated at {sz['estimated_seconds']:.0f} s"
                 if "stride" in sz else "")
        lines += ["", "## Calibration", "",
                  f"- plan: {sz.get('plan')}{', ' + sized if sized else ''}; with the configs' "
                  f"shapes {cal.get('points_total')} points, {cal.get('points_measured')} measured",
                  "- seconds per part: " + ", ".join(f"{k} {v:.1f}" for k, v in cal["seconds"].items()),
                  f"- engine shapes: {(cal.get('engine') or {}).get('shapes')}; fitted rows: {cal.get('fit_rows')}"]
    runs = report.get("runs") or []
    if runs:
        ways = list(runs[0]["predicted"])
        lines += ["", "## Iteration time: measured (minimum) vs predicted", "",
                  "| config | iters | measured s | " + " | ".join(f"{w} s (error, 80% interval)" for w in ways) + " |",
                  "|---|---:|---:|" + "---|" * len(ways)]
        for r in runs:
            cells = []
            for w in ways:
                p = r["predicted"].get(w, {})
                if "seconds" not in p:
                    cells.append(f"failed: {p.get('error_line', '')[:80]}")
                    continue
                iv = p.get("interval_seconds")
                ivs = (f"[{iv[0]:.4f}, {iv[1]:.4f}] {'holds' if p.get('measured_inside') else 'misses'} it"
                       if iv else "no interval")
                cells.append(f"{p['seconds']:.4f} ({_pct(p['error'])}, {ivs})")
            lines.append(f"| {r['label']} | {r['iterations']} | {r['measured_seconds']:.4f} | " + " | ".join(cells) + " |")
        lines += ["", "## Memory (MiB), per stage", "",
                  "| config | predicted alloc | live tracker | max_allocated | max_reserved | "
                  "nvidia-smi (workload) | predicted device total |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in runs:
            for mrow in r["memory"]:
                lines.append(f"| {r['label']} s{mrow['stage']} | {_mib(mrow['predicted_allocated'])} | "
                             f"{_mib(mrow['live_tracker_peak'])} ({_pct(mrow['live_tracker_error'])}) | "
                             f"{_mib(mrow['max_memory_allocated'])} | {_mib(mrow['max_memory_reserved'])} | "
                             f"{_mib(mrow['nvidia_smi_workload'])} | {_mib(mrow['predicted_device_total'])} |")
    host = report.get("host")
    if host:
        lines += ["", "## Host time per framework call (host_path.py)", "",
                  "| device, size | us a call, median (rounds) |", "|---|---|"]
        for key, r in host.items():
            lines.append(f"| {key} | {r['median_per_call_s'] * 1e6:.1f} ({r['min_per_call_s'] * 1e6:.1f} .. "
                         f"{r['max_per_call_s'] * 1e6:.1f}) |")
    ov = report.get("overhead")
    if ov:
        loss = ov.get("loss") or {}
        lines += ["", "## Hook overhead", "",
                  f"- {ov['device']}, {ov['timer']}: plain median {ov['plain_median_s'] * 1e3:.3f} ms, "
                  f"hooked {ov['hooked_median_s'] * 1e3:.3f} ms ({_pct(ov['overhead'])}, plain IQR "
                  f"{100 * ov['plain_iqr']:.1f}%); machinery {ov['machinery_s'] * 1e6:.1f} us "
                  f"({100 * ov['machinery_share']:.3f}%)",
                  f"- losses over {loss.get('micro_batches')} micro-batches identical: "
                  f"{loss.get('identical')} (max |diff| {loss.get('max_abs_difference')})"]
    return "\n".join(lines) + "\n"


# -- main -----------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", help="default: benchmarks/gpu_check/*.yml")
    ap.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--dry-run", action="store_true", help="the CPU accelerator, tiny shapes")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help="whole-run budget: later steps are skipped, named, when it runs out")
    ap.add_argument("--operators-s", type=float, default=120.0,
                    help="what the quick plan is thinned to, by its roofline estimate on this GPU")
    ap.add_argument("--per-point-s", type=float, default=0.05,
                    help="set-up seconds per plan point assumed by the estimate (store, tensors)")
    ap.add_argument("--iters", type=int, default=None, help="measured iterations per config "
                    "(default 30; 3 with --dry-run)")
    ap.add_argument("--overhead-rounds", type=int, default=None, help="default 6; 2 with --dry-run")
    ap.add_argument("--work", help="keep the working files (store, profile, logs) here")
    args = ap.parse_args(argv)
    env, cwd = dict(os.environ), os.getcwd()
    try:
        return _check(args)
    finally:  # a caller's process (the test suite) gets its environment and folder back
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)


def _check(args) -> int:
    dry = bool(args.dry_run)
    iters = args.iters or (3 if dry else 30)
    rounds = args.overhead_rounds or (2 if dry else 6)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    if dry:  # the CPU accelerator even where a GPU is present (for the launched processes, and
        # for this one when torch has not touched CUDA yet)
        os.environ.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    lacking = requirements(dry)
    if lacking:
        print(lacking, file=sys.stderr)
        return 2

    budget = Budget(args.budget_s)
    own_work = args.work is None
    work = Path(tempfile.mkdtemp(prefix="gpu-check-")) if own_work else Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    home = work / "home"  # the fresh profile and store never land in the user's NEOX_PERF_HOME
    os.environ["NEOX_PERF_HOME"] = str(home)
    # The launched processes (`python -m neox_perf.calibration...`) put their working folder
    # first on sys.path: run from the checkout, its neox_perf/ (which holds no calibration/:
    # setup.cfg maps it in at install) would hide the installed package.
    configs_given = [str(Path(c).resolve()) for c in (args.configs or CONFIGS)]
    os.chdir(work)
    configs = configs_given
    labels = [Path(c).stem for c in configs]
    cuda = not dry
    report: Dict[str, object] = {"dry_run": dry, "budget_s": args.budget_s, "configs": configs,
                                 "iters": iters, "steps": []}
    steps: List[dict] = report["steps"]

    def step(name: str, fn, floor: float = 0.0, needs: Optional[str] = None):
        t0 = time.monotonic()
        row = {"step": name, "status": "ok", "seconds": 0.0, "why": None}
        failed = {s["step"] for s in steps if s["status"] != "ok"}
        try:
            if needs is not None and needs in failed:
                row.update(status="skipped", why=f"{needs} did not complete")
                return None
            if budget.left() < floor + REPORT_S:
                row.update(status="skipped", why=f"{budget.left():.0f} s of the budget left, "
                                                 f"{floor + REPORT_S:.0f} s needed")
                return None
            say(f"{name} ({budget.elapsed():.0f} s in)")
            return fn()
        except Exception as exc:
            row.update(status="failed", why=_why(exc))
            (work / f"{name.replace(' ', '_')}.traceback").write_text(traceback.format_exc())
            say(f"{name} failed: {row['why']}")
            return None
        finally:
            row["seconds"] = time.monotonic() - t0
            steps.append(row)

    report["machine"] = step("machine", lambda: machine_facts(cuda))
    report["clocks_before"] = clocks(cuda)
    row = gpu_row(report["machine"] or {}, dry)
    if dry:
        configs = tiny_configs(configs, work)
    report["calibrate"] = step("calibrate", lambda: calibrate_step(
        configs, work, dry, row, args.operators_s, args.per_point_s), floor=60.0)
    ways = prediction_ways(row, work)
    runs = []
    for config, label in zip(configs, labels):
        r = step(f"run {label}", lambda c=config, lb=label: run_config(c, lb, ways, iters, work, cuda),
                 floor=RUN_FLOOR_S, needs="calibrate")
        if r is not None:
            runs.append(r)
    report["runs"] = runs
    report["host"] = step("host", lambda: host_step(cuda, dry), floor=HOST_FLOOR_S)
    report["overhead"] = step("overhead", lambda: overhead_step(cuda, rounds, 5 if dry else 20, work),
                              floor=OVERHEAD_FLOOR_S)
    report["clocks_after"] = clocks(cuda)
    report["prediction_ways"] = ways
    report["seconds"] = budget.elapsed()
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    report["exit_code"] = 0 if all(s["status"] == "ok" for s in steps) else 1
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))
    os.chdir(out)
    if own_work:
        shutil.rmtree(work, ignore_errors=True)
    bad = [f"{s['step']}: {s['status']} ({s['why']})" for s in steps if s["status"] != "ok"]
    say(f"wrote {out / 'gpu_check.json'} and gpu_check.md in {report['seconds']:.0f} s"
        + (f"; not ok: {'; '.join(bad)}" if bad else ""))
    return int(report["exit_code"])


if __name__ == "__main__":
    sys.exit(main())
