"""Run a calibration plan against this machine, one committed sample per point.

Resumable by construction: every point already in the store for this device and dtype is
skipped, and each new sample is committed the moment it is measured, so a calibration
killed at any instant resumes where it stopped. Fitting is not done here: the predictors'
trainer reads ``SampleStore.rows()``.

Collectives need a multi-process launch and are run by ``collectives.py`` under torchrun
or the deepspeed launcher; ``calibrate`` measures the operators.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from .plan import Plan, load_plan
from .store import SampleStore

Progress = Callable[[int, int, str], None]
MEMORY_FRACTION = 0.5  # leave room for the allocator, the interpreter and the rest of the box


@dataclass
class CalibrationSummary:
    store: str
    plan: str
    device: str
    device_id: int
    run_id: int
    dtype: str
    threads: int
    timer: str
    total: int = 0
    measured: int = 0
    already_stored: int = 0
    failed: List[Tuple[str, str]] = field(default_factory=list)  # (point label, reason)
    seconds: float = 0.0

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["failed"] = [{"point": p, "reason": r} for p, r in self.failed]
        return out


def pick_device(device: Optional[str] = None) -> str:
    import torch
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device)


def pick_dtype(plan_dtype: str, device: str) -> str:
    if plan_dtype != "auto":
        return plan_dtype
    # fp16 as the published samples and NeoX's default; a CPU has no fast half GEMMs.
    return "fp16" if device.startswith("cuda") else "fp32"


def pick_threads(threads: Optional[int], device: str) -> Optional[int]:
    """CPU threads to time with: the argument, else OMP_NUM_THREADS, else 1.

    One, because torchrun and the deepspeed launcher start CPU ranks with OMP_NUM_THREADS=1,
    so that is what a rank's operators see in training; and because a multi-threaded region
    waits for its slowest thread, on a shared box that turns every preemption of a sibling
    into a stall (measured here: 2-thread timings of the same point 100-1000x apart under
    load, 1-thread within tens of percent).
    """
    if threads is not None:
        if int(threads) < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        return int(threads)
    if device.startswith("cuda"):
        return None  # leave torch's default: the CPU only launches kernels
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(env) if env.isdigit() and int(env) > 0 else 1


def memory_budget(device: str, fraction: float = MEMORY_FRACTION) -> Optional[float]:
    """Bytes one benchmark may use, or None when unknown."""
    import torch
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return fraction * free
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return fraction * int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@contextmanager
def pinned_threads(threads: Optional[int]):
    """torch's and OpenMP's thread count fixed for the measurement, restored afterwards."""
    import torch
    if threads is None:
        yield
        return
    saved = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # recorded in the fingerprint, as launchers set it
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        if saved[1] is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved[1]


def calibrate(plan=None, store_path=None, *, clock: Optional[Callable[[], float]] = None,
              progress: Optional[Progress] = None, quick: bool = False,
              device: Optional[str] = None, threads: Optional[int] = None) -> CalibrationSummary:
    """Measure every point of ``plan`` not yet in ``store_path``; return what happened.

    plan: a Plan, a YAML path, a bundled name, or None for the bundled "quick" (quick=True)
    or "full" plan. clock: injectable seconds clock for the benchmarks (default: CUDA events
    on a GPU, perf_counter on a CPU). progress(done, total, label) is called before each
    point and once at the end with done == total. device: "cpu", "cuda", "cuda:1" or None
    (CUDA when available). threads: CPU threads to time with (default: OMP_NUM_THREADS,
    else 1; see pick_threads).
    """
    import torch

    from . import bench
    from .fingerprint import fingerprint

    if store_path is None:
        raise ValueError("store_path is required")
    started = time.monotonic()
    plan_obj: Plan = load_plan(plan if plan is not None else ("quick" if quick else "full"))
    dev = pick_device(device)
    dtype = pick_dtype(plan_obj.dtype, dev)
    timer = bench.Timer(clock, device=dev)
    protocol = bench.Protocol(plan_obj.warmup, plan_obj.repeats, plan_obj.min_seconds,
                              plan_obj.max_repeats)
    with pinned_threads(pick_threads(threads, dev)), SampleStore(store_path) as store:
        device_id = store.register_device(fingerprint(dev))
        run_info = {"plan_digest": plan_obj.digest, "plan_source": plan_obj.source, "dtype": dtype,
                    "threads": torch.get_num_threads(), "timer": timer.method, "quick": bool(quick),
                    "warmup": protocol.warmup, "repeats": protocol.repeats,
                    "min_seconds": protocol.min_seconds, "max_repeats": protocol.max_repeats,
                    "pid": os.getpid()}
        run_id = store.register_run("calibrate", device=device_id, plan=plan_obj.name, info=run_info)
        summary = CalibrationSummary(store=str(Path(store_path)), plan=plan_obj.name, device=dev,
                                     device_id=device_id, run_id=run_id, dtype=dtype,
                                     threads=torch.get_num_threads(), timer=timer.method,
                                     total=len(plan_obj.points))
        _measure_points(plan_obj.points, store, summary, timer, protocol, memory_budget(dev), progress)
        summary.seconds = time.monotonic() - started
        store.finish_run(run_id, info={**run_info, "measured": summary.measured,
                                       "already_stored": summary.already_stored,
                                       "failed": len(summary.failed), "seconds": summary.seconds})
    if progress is not None:
        progress(summary.total, summary.total, "done")
    return summary


def _measure_points(points, store, summary, timer, protocol, budget, progress) -> None:
    import torch

    from . import bench

    dev, dtype, device_id = summary.device, summary.dtype, summary.device_id
    for i, point in enumerate(points):
        if progress is not None:
            progress(i, len(points), point.label)
        feats = point.feature_dict()
        if store.has_sample(point.op, point.phase, feats, device=device_id, dtype=dtype):
            summary.already_stored += 1
            continue
        need = bench.estimate_bytes(point.op, feats, dtype)
        if budget is not None and need > budget:
            summary.failed.append((point.label, f"needs about {need / 2**30:.1f} GiB, "
                                                f"{budget / 2**30:.1f} GiB available"))
            continue
        try:
            m = bench.measure(point.op, point.phase, feats, timer=timer, protocol=protocol, dtype=dtype)
        except (RuntimeError, ValueError) as exc:  # OOM, a dtype the device lacks
            summary.failed.append((point.label, f"{exc.__class__.__name__}: "
                                                f"{(str(exc).splitlines() or [''])[0]}"))
            if dev.startswith("cuda"):
                torch.cuda.empty_cache()
            continue
        agg = m.aggregate
        if agg.seconds <= 0:  # a clock too coarse for this op: not a measurement
            summary.failed.append((point.label, "measured 0 s (clock resolution)"))
            continue
        store.add_sample(point.op, point.phase, feats, agg.seconds, device=device_id,
                         run=summary.run_id, dtype=dtype, repeats=agg.repeats, median=agg.median,
                         iqr=agg.iqr, min_seconds=agg.min,
                         info={"impl": m.impl, "timer": m.timer, "q1": agg.q1, "q3": agg.q3,
                               "times": list(agg.times)})
        summary.measured += 1


def training_rows(store_path, *, device: Optional[int] = None, source: Optional[str] = None
                  ) -> List[Dict[str, Any]]:
    """The stored samples as the trainer's rows: op, phase, features..., seconds, dtype, ..."""
    with SampleStore(store_path) as store:
        return store.rows(device=device, source=source)
