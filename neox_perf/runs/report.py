"""Predicted vs measured, from a run dir: plain data for the JSON envelope and the renderer.

Measured iteration times come from every rank's iterations file: an iteration of the job
is the slowest rank's time at that index; iterations inside profiling windows (slowed by
the profiler on purpose) and the first one (warm-up) are left out of min and median.
Phase components (forward, backward, optimizer, gradient reduction, p2p) come from the wall
time a CPU rank records per phase outside the profiling windows (median over iterations),
else from the windows; operators and collectives by group come from the windows, per
iteration / per call. No rich, no torch.
"""
from __future__ import annotations

import os
import statistics
from typing import Any, Dict, List, Optional, Tuple

from ..profile.disturbance import profile_warnings
from . import RunError, prediction
from .memory import error as _err  # (predicted - measured) / measured, None without both
from . import files as runfiles
from .files import read_iterations


# The hook's ranges (hooks/engine_patch.py) in which DeepSpeed's PipelineEngine all-gathers the
# tensors it partitions for the p2p: ForwardPass and BackwardPass, and RecvGrad where a config
# turns grad_partitioned off (operators._partition_allgathers).
PARTITION_GATHER_PHASES = ("forward", "backward", "recv_grads")


class ReportError(RunError):
    """The run dir holds nothing to report; the message says why and what to do."""


def _pick_job(summaries: List[dict], notes: List[str]) -> List[dict]:
    jobs = {s.get("job") for s in summaries}
    if len(jobs) <= 1:
        return summaries
    latest = max(summaries, key=lambda s: s.get("started") or 0).get("job")
    notes.append(f"the run dir holds ranks of {len(jobs)} jobs; reporting the latest ({latest})")
    return [s for s in summaries if s.get("job") == latest]


def _iterations(run_dir: str, ranks: List[dict], notes: List[str]) -> Dict[str, Any]:
    per_rank, series = [], {}
    for s in ranks:
        its = read_iterations(runfiles.iterations_file(run_dir, s["rank"]))
        plain = [sec for i, sec, prof in its if not prof and i > 0] or \
                [sec for i, sec, prof in its if not prof]
        per_rank.append({"rank": s["rank"], "stage": (s.get("facts") or {}).get("stage"),
                         "iterations": len(its), "profiled": sum(1 for _, _, p in its if p),
                         "min": min(plain) if plain else None,
                         "median": statistics.median(plain) if plain else None,
                         "hook_seconds": (s.get("hook_self") or {}).get("per_iteration_seconds"),
                         "hook_cpu_seconds":
                             (s.get("hook_self") or {}).get("per_iteration_cpu_seconds")})
        for i, sec, prof in its:
            series.setdefault(i, []).append((sec, prof))
    world = max(((s.get("facts") or {}).get("world_size") or 1) for s in ranks)
    complete = {i: v for i, v in series.items() if len(v) == len(ranks)}
    job = [max(sec for sec, _ in v) for i, v in sorted(complete.items())
           if i > 0 and not any(p for _, p in v)]
    if not job:
        job = [max(sec for sec, _ in v) for i, v in sorted(complete.items()) if not any(p for _, p in v)]
    if len(ranks) < world:
        notes.append(f"{len(ranks)} of {world} ranks wrote a summary here (on a multi-node job "
                     f"the run dir must be on a shared file system to see them all)")
    # the hook's own seconds per iteration between windows, on its costliest rank, and that as
    # a share of the median iteration; by the wall clock (what the run paid, a scheduler's
    # preemption included) and as the hook thread's CPU work (what its code costs)
    own = [r["hook_seconds"] for r in per_rank if r["hook_seconds"] is not None]
    cpu = [r["hook_cpu_seconds"] for r in per_rank if r["hook_cpu_seconds"] is not None]
    median = statistics.median(job) if job else None
    hook = {"per_iteration_seconds": max(own) if own else None,
            "share": max(own) / median if own and median else None,
            "per_iteration_cpu_seconds": max(cpu) if cpu else None,
            "cpu_share": max(cpu) / median if cpu and median else None}
    return {"count": len(series), "used": len(job), "min": min(job) if job else None,
            "median": median, "per_rank": per_rank, "hook_overhead": hook,
            "excluded": "the first iteration (warm-up) and iterations inside profiling windows"}


def _window_per_iter(s: dict, phase: str) -> Optional[float]:
    n = s.get("window_iterations") or 0
    p = (s.get("phases") or {}).get(phase)
    if not n or not p:
        return None
    return p["seconds"] / n


def _op_phase(s: dict, op: str, phases) -> Optional[float]:
    n = s.get("window_iterations") or 0
    if not n:
        return None
    return sum(r["seconds"] for r in s.get("op_phases") or []
               if r["op"] == op and r["phase"] in phases) / n


def _by_stage(ranks: List[dict], plain: Optional[Dict[int, dict]] = None) -> Dict[int, List[dict]]:
    out: Dict[int, List[dict]] = {}
    for s in ranks:
        if s.get("window_iterations") or (plain or {}).get(s["rank"]):
            out.setdefault(int((s.get("facts") or {}).get("stage") or 0), []).append(s)
    return out


def _plain_phases(run_dir: str, ranks: List[dict]) -> Dict[int, dict]:
    """Per rank: the median over its iterations outside profiling windows (the first left
    out) of each phase's wall seconds, and of the iteration's; only ranks that timed their
    phases (CPU ranks: on a GPU a phase's wall time is its launches)."""
    out: Dict[int, dict] = {}
    for s in ranks:
        rows = [(sec, ph) for i, sec, ph in
                runfiles.read_iteration_phases(runfiles.iterations_file(run_dir, s["rank"])) if i > 0]
        if not rows:
            continue
        names = set().union(*(ph for _, ph in rows))
        med = {p: statistics.median(ph.get(p, 0.0) for _, ph in rows) for p in names}
        med["iteration"] = statistics.median(sec for sec, _ in rows)
        out[s["rank"]] = {"phases": med, "iterations": len(rows)}
    return out


def _phase_per_iter(s: dict, phase: str, plain: Dict[int, dict]) -> Optional[float]:
    """A rank's seconds per iteration in `phase`: timed outside the windows where it timed its
    phases (`plain`, from _plain_phases), else from the windows."""
    if s["rank"] in plain:
        return plain[s["rank"]]["phases"].get(phase)
    return _window_per_iter(s, phase)


def _max(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _components(ranks: List[dict], pred: Dict[str, Any], m: int,
                plain: Optional[Dict[int, dict]] = None) -> List[dict]:
    """Predicted against measured per component. A rank's phases are measured outside the
    profiling windows where it timed them (``plain``), else inside them (slowed by the
    profiler); what only the trace can tell (collectives by group) comes from the windows."""
    plain = plain or {}
    stages = _by_stage(ranks, plain)

    def _per_iter(s: dict, phase: str) -> Optional[float]:
        return _phase_per_iter(s, phase, plain)
    pstages = pred.get("stages") or []
    bd = pred.get("breakdown") or {}
    rows: List[dict] = []

    def row(name, p, meas, note=""):
        rows.append({"name": name, "predicted": p, "measured": meas, "error": _err(p, meas),
                     "note": note})

    fwd, bwd = {}, {}
    for st, members in sorted(stages.items()):
        fwd[st] = _max(_per_iter(s, "forward") for s in members)
        bwd[st] = _max(_per_iter(s, "backward") for s in members)
        fwd[st] = fwd[st] / m if fwd[st] is not None else None
        bwd[st] = bwd[st] / m if bwd[st] is not None else None
        ps = pstages[st] if st < len(pstages) else {}
        row(f"stage {st} forward (per micro-batch)", ps.get("forward"), fwd[st])
        row(f"stage {st} backward (per micro-batch)", ps.get("backward"), bwd[st],
            "includes the gradient all-reduce" if not members[0]["facts"].get("pipeline") else "")
    row("stage_forward_max", bd.get("stage_forward_max"), _max(fwd.values()))
    row("stage_backward_max", bd.get("stage_backward_max"), _max(bwd.values()))
    row("encoder_forward", bd.get("encoder_forward"), None, "not measured: no per-layer timing")
    row("encoder_backward", bd.get("encoder_backward"), None, "not measured: no per-layer timing")
    allr = [s for v in stages.values() for s in v]
    opt = _max(_per_iter(s, "optimizer_step") or _per_iter(s, "step") for s in allr)
    # a ZeRO optimizer's step ends with its parameter all-gather, inside the timed step: the
    # prediction compared with it holds that too (the all-gather also has its own row below)
    gather = bd.get("dp_allgather") or 0.0
    row("optimizer", None if bd.get("optimizer") is None else bd["optimizer"] + gather, opt,
        "whole optimizer step (unscale, clip, update" + (", ZeRO's all-gather)" if gather else ")"))
    # ReduceGrads as a rank times it: the wait for the slowest replica, then the all-reduce
    dp = bd.get("dp_allreduce")
    row("dp_allreduce", None if dp is None else dp + bd.get("dp_wait", 0.0),
        _max(_per_iter(s, "reduce_grads") for s in allr),
        "incl. waiting for the slowest replica" if bd.get("dp_wait") else "")
    row("dp_allgather", bd.get("dp_allgather"),
        _max(_op_phase(s, "allgather", ("optimizer_step", "step")) for s in allr))
    row("mp_allreduce", bd.get("mp_allreduce"),
        _max(_op_phase(s, "allreduce", ("forward", "backward")) for s in allr))
    row("tied_allreduce", bd.get("tied_allreduce"),
        _max(_per_iter(s, "reduce_tied_grads") for s in allr))
    sends = _max(((_per_iter(s, "send_activations") or 0) + (_per_iter(s, "send_grads") or 0))
                 if s["facts"].get("pipeline") and (s["facts"].get("stages") or 1) > 1 else None
                 for s in allr)
    row("pp_p2p", bd.get("pp_p2p"), sends, "sends incl. waiting for the receiver")
    # the engine's all-gathers of its partitioned activations and gradients (trace_rules maps
    # an all-gather inside a pipeline's forward/backward to the tensor-parallel group)
    gathers = _max(_op_phase(s, "allgather", PARTITION_GATHER_PHASES)
                   if s["facts"].get("pipeline") and (s["facts"].get("stages") or 1) > 1
                   and (s["facts"].get("mp") or 1) > 1 else None
                   for s in allr)
    row("pp_allgather", bd.get("pp_allgather"), gathers,
        "rebuilding the partitioned activations and gradients over the tensor-parallel group")
    idle = []
    for s in allr:
        it = _per_iter(s, "iteration")
        if it is None or not s["facts"].get("pipeline"):
            continue
        busy = sum(_per_iter(s, p) or 0 for p in (
            "forward", "backward", "optimizer_step", "reduce_grads", "reduce_tied_grads",
            "send_activations", "send_grads", "load_micro_batch"))
        idle.append(max(it - busy, 0.0))
    row("bubble", bd.get("bubble"), _max(idle),
        "measured: iteration minus the stage's own work (waits in recv, bubbles)")
    return rows


def _operators(ranks: List[dict], profile, top: int) -> List[dict]:
    rows = []
    seen_stage = set()
    for s in ranks:
        f = s.get("facts") or {}
        stage = f.get("stage") or 0
        n = s.get("window_iterations") or 0
        if stage in seen_stage or not n:
            continue
        seen_stage.add(stage)
        for o in s.get("ops") or []:
            meas = o.get("median")
            pred, why = (prediction.predict_call(profile, o["op"], o["phase"], o["features"], o["dtype"])
                         if profile is not None else (None, ""))
            per_iter = o["calls"] / n
            rows.append({"stage": stage, "op": o["op"], "phase": o["phase"],
                         "features": o["features"], "dtype": o["dtype"],
                         "calls_per_iteration": per_iter, "measured": meas, "predicted": pred,
                         "error": _err(pred, meas), "why": why,
                         "impact_seconds": (pred - meas) * per_iter if pred is not None and meas else None,
                         "measured_per_iteration": o["seconds"] / n})
    if any(r["impact_seconds"] is not None for r in rows):
        rows.sort(key=lambda r: -abs(r["impact_seconds"] or 0.0))
    else:
        rows.sort(key=lambda r: -r["measured_per_iteration"])
    return rows[:top] if top else rows


def _unmapped(ranks: List[dict], top: int) -> List[dict]:
    merged: Dict[str, dict] = {}
    total = 0.0
    for s in ranks:
        n = s.get("window_iterations") or 1
        for u in s.get("unmapped") or []:
            m = merged.setdefault(u["name"], {"name": u["name"], "calls_per_iteration": 0.0,
                                              "seconds_per_iteration": 0.0, "reason": u["reason"],
                                              "example": u.get("example")})
            m["calls_per_iteration"] += u["calls"] / n / len(ranks)
            m["seconds_per_iteration"] += u["seconds"] / n / len(ranks)
            total += u["seconds"] / n / len(ranks)
    rows = sorted(merged.values(), key=lambda r: -r["seconds_per_iteration"])
    return rows[:top]


def _coverage(ranks: List[dict]) -> List[dict]:
    out = []
    for s in ranks:
        n = s.get("window_iterations") or 0
        if not n:
            continue
        # A plain engine reduces gradients inside backward; a pipeline in its own instruction.
        phases = ("forward", "backward") + (("reduce_grads",) if s["facts"].get("pipeline") else ())
        phase = sum(_window_per_iter(s, p) or 0 for p in phases)
        mapped = sum(r["seconds"] for r in s.get("op_phases") or []
                     if r["phase"] in ("forward", "backward", "reduce_grads")) / n
        out.append({"rank": s["rank"], "stage": s["facts"].get("stage"),
                    "forward_backward_seconds": phase, "mapped_seconds": mapped,
                    "fraction": mapped / phase if phase else None})
    return out


def _samples(run_dir: str) -> Dict[str, Any]:
    files = runfiles.store_files(run_dir)
    out: Dict[str, Any] = {"stores": files, "count": 0, "ranks": [], "stages": []}
    ranks, stages = set(), set()
    for path in files:
        try:
            from neox_perf.calibration.store import SampleStore
            with SampleStore(path) as store:
                rows = store.samples(source="run")
        except Exception as exc:
            out.setdefault("errors", []).append(f"{path}: {exc.__class__.__name__}: {exc}")
            continue
        out["count"] += len(rows)
        ranks |= {r.rank for r in rows}
        stages |= {r.stage for r in rows if r.stage}
    out["ranks"], out["stages"] = sorted(ranks), sorted(stages)
    return out


def _launch_record(run_dir: str) -> Dict[str, Any]:
    import json
    try:
        with open(os.path.join(run_dir, runfiles.RUN_FILE), encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # launched with the environment switch, not `neox-perf run`


def measured_job(run_dir: str) -> Tuple[dict, Dict[str, Any]]:
    """(the reference rank's summary, the job's measured iterations) of the latest job in a
    run dir, as the report reads them; raises ReportError when no rank wrote a summary."""
    summaries = runfiles.read_rank_summaries(os.path.abspath(run_dir))
    if not summaries:
        raise ReportError(f"{run_dir}: no rank summaries (fix: run the job with `neox-perf run`)")
    ranks = _pick_job(summaries, [])
    return ranks[0], _iterations(os.path.abspath(run_dir), ranks, [])


def build(run_dir: str, cluster: Optional[str] = None, profile=None, top: int = 10) -> Dict[str, Any]:
    run_dir = os.path.abspath(run_dir)
    if not os.path.isdir(run_dir):
        raise ReportError(f"{run_dir}: no such run dir (fix: pass the directory `neox-perf run` printed, "
                          f"neox-perf-runs/<timestamp>, or GPT-NeoX's training log with --config)")
    notes: List[str] = []
    summaries = runfiles.read_rank_summaries(run_dir)
    if not summaries:
        errors = os.path.join(run_dir, "errors.log")
        raise ReportError(f"{run_dir}: no rank summaries: the hook never attached to a DeepSpeed "
                          f"engine (did the command call deepspeed.initialize?"
                          + (f" see {errors})" if os.path.isfile(errors) else
                             " fix: run the job with `neox-perf run -- ...`)"))
    ranks = _pick_job(summaries, notes)
    ref = ranks[0]
    facts = ref.get("facts") or {}
    if profile is None:
        profile, why = prediction.load(cluster or ref.get("cluster") or os.environ.get("NEOX_PERF_CLUSTER"))
        if profile is None:
            notes.append(why)
    pred = prediction.predict(ref.get("config") or {}, facts, profile) if profile is not None \
        else {"iteration_seconds": None, "notes": []}
    if profile is not None and pred.get("iteration_seconds") is None and not (ref.get("config") or {}).get("values"):
        pred["notes"].append("no NeoX config, so no iteration prediction: "
                             + str((ref.get("config") or {}).get("why")))
    iters = _iterations(run_dir, ranks, notes)
    plain = _plain_phases(run_dir, ranks)
    if plain:
        n = min(p["iterations"] for p in plain.values())
        notes.append(f"components: each phase's wall time outside the profiling windows, median "
                     f"of {n}+ iterations per rank; operators and collectives by group: from the "
                     f"profiling windows (slowed by the profiler)")
    m = int(facts.get("micro_batches") or facts.get("gradient_accumulation_steps") or 1)
    p_it = pred.get("iteration_seconds")
    for s in ranks:
        if s.get("disabled"):
            notes.append(f"rank {s['rank']}: hook disabled ({s['disabled']})")
        if not s.get("finished"):
            notes.append(f"rank {s['rank']}: no final summary (still running, or killed)")
    for n in ref.get("notes") or []:
        notes.append(n)
    if facts.get("missing"):
        notes.append("could not read from the engine: " + ", ".join(facts["missing"]))
    from ..prediction.predict import calibration
    calibrated_on = calibration(profile).device if profile is not None else None
    if profile is not None and facts.get("device_type") == "cpu" and calibrated_on != "cpu":
        notes.append(f"this run ran on CPU; profile {profile.name} models "
                     f"{profile.facts.gpu_name}: expect large errors")
    launched = _launch_record(run_dir)
    predicted = {k: pred.get(k) for k in ("profile", "breakdown", "extrapolated", "critical_stage")}
    if pred.get("fp32_matmuls"):  # an fp32 run on a GPU: priced with the matmuls the run had
        predicted["fp32_matmuls"] = pred["fp32_matmuls"]
    return {
        "run_dir": run_dir, "job": ref.get("job"),
        # not "command"/"exit_code": the JSON envelope's own keys
        "launch_command": launched.get("command") or ref.get("argv"),
        "launch_exit_code": launched.get("exit_code"),
        "ranks": [s["rank"] for s in ranks],
        "layout": {k: facts.get(k) for k in ("engine", "world_size", "stages", "dp", "mp",
                                             "micro_batches", "micro_batch_size", "dtype",
                                             "device_type", "zero_stage", "parts")},
        "config": {k: (ref.get("config") or {}).get(k) for k in ("source", "files", "why")},
        "cluster": profile.name if profile is not None else None,
        "iteration": {"measured": iters, "predicted": p_it, "error_min": _err(p_it, iters["min"]),
                      "error_median": _err(p_it, iters["median"]),
                      "interval_seconds": pred.get("interval_seconds")},
        "components": _components(ranks, pred, m, plain),
        "operators": _operators(ranks, profile, top),
        "unmapped": _unmapped(ranks, top),
        "coverage": _coverage(ranks),
        "windows": {"setting": ref.get("windows_setting"),
                    "iterations_profiled": {s["rank"]: s.get("window_iterations") for s in ranks}},
        "prediction": predicted,
        "memory": _memory(ranks, ref, notes, iters.get("median")),
        "samples": _samples(run_dir),
        "notes": list(dict.fromkeys(notes + (pred.get("notes") or []))),
        "profile_warnings": profile_warnings(profile) if profile is not None else [],
    }


def _memory(ranks: List[dict], ref: dict, notes: List[str],
            median: Optional[float]) -> List[dict]:
    """Predicted vs measured peak live bytes per stage (runs/memory.py), with what measuring
    cost: the window's iteration against the median of the others."""
    from . import memory
    if not any(memory.live_of(s) for s in ranks):
        pending = [(s.get("memory") or {}).get("live") for s in ranks]
        errors = [p.get("error") for p in pending if p and p.get("error")]
        if errors:
            notes.append(f"memory not measured: {errors[0]}")
        return []
    try:
        _, derived, _ = prediction.rebuild(ref.get("config") or {}, ref.get("facts") or {})
    except Exception as exc:  # the time report stands without it
        notes.append(f"memory not predicted ({exc.__class__.__name__}: {exc})")
        return []
    rows = memory.stage_rows(ranks, derived)
    for r in rows:
        sec = r["tracker"].get("iteration_seconds")
        r["tracker"]["slowdown"] = sec / median if sec and median else None
    return rows
