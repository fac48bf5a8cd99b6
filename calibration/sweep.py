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

from .plan import LATER_WARMUP, Plan, load_plan
from .store import SampleStore

Progress = Callable[[int, int, str], None]
MEMORY_FRACTION = 0.5  # leave room for the allocator, the interpreter and the rest of the box
# A plan's `protocol.sweeps` (2 in the bundled plans) times the points in that many passes, every
# other one in reverse order, each taking its share of the protocol's runs; a point's sample is
# the fastest of all of them. A point's runs taken back to back share the machine's state of
# that second: on this project's 2-core VM, of two fresh calibrations 30 minutes apart
# (2026-12-04, docs/validation.md), blocks of neighbouring points -- the head's GEMMs among them
# -- ran 1.2-1.9x slow with every one of their runs on the same side, and moved the second
# profile's predictions 5% on average, all one way, while the reference probe read the machine
# level. A second pass minutes later, in the other order, gives every point another moment;
# the minimum keeps the one the machine was itself in. (The engine step's passes did the same for
# its shapes: calibration/engine.py, ENGINE_SWEEPS.)


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
    remeasured: int = 0  # stored points marked disturbed, measured again
    sweeps: int = 1  # the plan's passes over its points
    pooled: int = 0  # points timed again in a later sweep, their runs pooled with the earlier ones'
    disturbance: Optional[Dict[str, Any]] = None  # the watch's record (disturbance.Watch.record)

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
              device: Optional[str] = None, threads: Optional[int] = None,
              watch: Optional[bool] = None) -> CalibrationSummary:
    """Measure every point of ``plan`` not yet in ``store_path``; return what happened.

    plan: a Plan, a YAML path, a bundled name, or None for the bundled "quick" (quick=True)
    or "full" plan. clock: injectable seconds clock for the benchmarks (default: CUDA events
    on a GPU, perf_counter on a CPU). progress(done, total, label) is called before each
    point and once at the end with done == total. device: "cpu", "cuda", "cuda:1" or None
    (CUDA when available). threads: CPU threads to time with (default: OMP_NUM_THREADS,
    else 1; see pick_threads). watch: time the reference probe and watch the machine, flag
    the points timed while it was disturbed and re-time them (calibration/disturbance.py);
    by default whenever the points are timed by the real clock (an injected clock's readings
    cannot be disturbed).
    """
    import torch

    from . import bench
    from .fingerprint import fingerprint

    if store_path is None:
        raise ValueError("store_path is required")
    started = time.monotonic()
    plan_obj: Plan = load_plan(plan if plan is not None else ("quick" if quick else "full"))
    watch = clock is None if watch is None else watch
    dev = pick_device(device)
    dtype = pick_dtype(plan_obj.dtype, dev)
    timer = bench.Timer(clock, device=dev)
    protocol = bench.Protocol(plan_obj.warmup, plan_obj.repeats, plan_obj.min_seconds,
                              plan_obj.max_repeats)
    sweeps = max(1, int(plan_obj.sweeps))
    with pinned_threads(pick_threads(threads, dev)), SampleStore(store_path) as store:
        device_id = store.register_device(fingerprint(dev))
        run_info = {"plan_digest": plan_obj.digest, "plan_source": plan_obj.source, "dtype": dtype,
                    "threads": torch.get_num_threads(), "timer": timer.method, "quick": bool(quick),
                    "warmup": protocol.warmup, "repeats": protocol.repeats,
                    "min_seconds": protocol.min_seconds, "max_repeats": protocol.max_repeats,
                    "sweeps": sweeps, "pid": os.getpid()}
        run_id = store.register_run("calibrate", device=device_id, plan=plan_obj.name, info=run_info)
        summary = CalibrationSummary(store=str(Path(store_path)), plan=plan_obj.name, device=dev,
                                     device_id=device_id, run_id=run_id, dtype=dtype,
                                     threads=torch.get_num_threads(), timer=timer.method,
                                     total=len(plan_obj.points), sweeps=sweeps)
        flagged = store.disturbed(device=device_id, dtype=dtype)  # measured again, below
        sweep = _Sweep(store, summary, timer, protocol, memory_budget(dev), progress, flagged,
                       _watch(dev, dtype, summary.threads) if watch else None, sweeps)
        sweep.points(plan_obj.points)
        if sweep.watch is not None:
            sweep.retime(started)
            summary.disturbance = sweep.watch.record()
        summary.seconds = time.monotonic() - started
        store.finish_run(run_id, info={**run_info, "measured": summary.measured,
                                       "already_stored": summary.already_stored,
                                       "remeasured": summary.remeasured,
                                       "pooled": summary.pooled,
                                       "failed": len(summary.failed), "seconds": summary.seconds,
                                       **({"disturbance": summary.disturbance}
                                          if summary.disturbance is not None else {})})
    if progress is not None:  # the steps the progress ran over: every point in every sweep
        progress(sweeps * summary.total, sweeps * summary.total, "done")
    return summary


def per_sweep(protocol, sweeps: int, n: int = 1):
    """Sweep ``n``'s share of ``protocol`` (of ``sweeps``): the runs, the most runs and the
    timed-work target split so that the sweeps add up to the protocol (5 runs: 3 + 2), at least
    one run each. The first sweep warms up as the protocol says; a later one builds the point
    afresh but finds the process's kernel choices and allocator pools for it already made, so
    one untimed run warms its new tensors (the full plan's 10 would cost a GPU calibration half
    its operator step again)."""
    from .bench import Protocol
    if sweeps <= 1:
        return protocol

    def share(total: int) -> int:
        return max(1, total // sweeps + (1 if n <= total % sweeps else 0))
    repeats = share(protocol.repeats)
    return Protocol(protocol.warmup if n == 1 else min(protocol.warmup, LATER_WARMUP), repeats,
                    protocol.min_seconds / sweeps,
                    max(repeats, share(max(protocol.max_repeats, protocol.repeats))))


def sweeps_due(info: Dict[str, Any]) -> int:
    """How many more sweeps a stored sample's info says it wants (0: complete; a sample
    stored before sweeps, or re-timed whole, is complete)."""
    done = info.get("sweeps")
    if not isinstance(done, dict):
        return 0
    return max(0, int(done.get("of", 1)) - int(done.get("done", 1)))


def _watch(device: str, dtype: str, threads: Optional[int]):
    from .disturbance import Probe, Watch
    w = Watch(Probe(device, dtype), threads=threads)
    w.begin()
    return w


@dataclass
class _Measured:
    """One point measured, kept until its window is judged."""

    point: Any
    measurement: Any
    speeds: Dict[str, Any] = field(default_factory=dict)  # a re-timed point's, as _Sweep._speeds


class _Sweep:
    """The points of a plan, measured and stored one by one; the watch's windows judged as
    they close, their points flagged in the store when disturbed, and re-timed at the end."""

    def __init__(self, store, summary, timer, protocol, budget, progress, flagged, watch, sweeps=1):
        self.store, self.summary, self.timer, self.protocol = store, summary, timer, protocol
        self.budget, self.progress, self.flagged, self.watch = budget, progress, flagged, watch
        self.sweeps = sweeps  # the plan's, validated by its parser (plan._sweeps)
        self.suspects: List[Any] = []  # points of disturbed windows, in measurement order

    def _key(self, point) -> tuple:
        from .store import canonical_features
        return (point.op, point.phase, canonical_features(point.op, point.phase, point.feature_dict()))

    def measure(self, point, sweep: Optional[int] = None):
        """The point's Measurement under sweep ``sweep``'s share of the protocol (None: the
        whole protocol, as a re-timing takes it), or None (recorded in summary.failed)."""
        import torch

        from . import bench
        summary = self.summary
        feats = point.feature_dict()
        need = bench.estimate_bytes(point.op, feats, summary.dtype)
        if self.budget is not None and need > self.budget:
            summary.failed.append((point.label, f"needs about {need / 2**30:.1f} GiB, "
                                                f"{self.budget / 2**30:.1f} GiB available"))
            return None
        try:
            protocol = self.protocol if sweep is None else per_sweep(self.protocol, self.sweeps, sweep)
            m = bench.measure(point.op, point.phase, feats, timer=self.timer, protocol=protocol,
                              dtype=summary.dtype)
        except (RuntimeError, ValueError) as exc:  # OOM, a dtype the device lacks
            summary.failed.append((point.label, f"{exc.__class__.__name__}: "
                                                f"{(str(exc).splitlines() or [''])[0]}"))
            if summary.device.startswith("cuda"):
                torch.cuda.empty_cache()
            return None
        if m.aggregate.seconds <= 0:  # a clock too coarse for this op: not a measurement
            summary.failed.append((point.label, "measured 0 s (clock resolution)"))
            return None
        return m

    def store_point(self, point, m, *, replace: bool = False, info: Optional[Dict[str, Any]] = None) -> None:
        agg, s = m.aggregate, self.summary
        self.store.add_sample(point.op, point.phase, point.feature_dict(), agg.seconds, device=s.device_id,
                              run=s.run_id, dtype=s.dtype, repeats=agg.repeats, median=agg.median,
                              iqr=agg.iqr, min_seconds=agg.min, replace=replace,
                              info={"impl": m.impl, "timer": m.timer, "q1": agg.q1, "q3": agg.q3,
                                    "times": list(agg.times), **(info or {})})

    def _speeds(self, m, earlier: Any = ()) -> Dict[str, Any]:
        """The sample info's "speeds": the reference's cost per loop beside its runs, run-length
        pairs [seconds per loop, runs] in the order of its times (``earlier``: the pairs of the
        runs it already holds), from the reading that opened the current window (profile/
        one_speed.py fits the times at one speed with them). Empty where there is no reading
        to give: an unwatched run, a GPU, or earlier runs stored without one."""
        w = self.watch
        if w is None or w.window is None or not getattr(w.probe, "cpu", False) or earlier is None:
            return {}
        reading = w.window.opened_by
        if reading.work is None or reading.work <= 0 or not w.probe.loops:
            return {}
        return {"speeds": [list(p) for p in earlier] + [[reading.work / w.probe.loops,
                                                         len(m.aggregate.times)]]}

    def points(self, points) -> None:
        """Every sweep over ``points``: the first stores each point not yet stored, the later
        ones (every other in reverse order) time each point that still wants a sweep again and
        store the pooled runs."""
        summary, total = self.summary, self.sweeps * len(points)
        sweep_info = {"sweeps": {"done": 1, "of": self.sweeps}} if self.sweeps > 1 else None
        for i, point in enumerate(points):
            if self.progress is not None:
                self.progress(i, total, point.label)
            stored = self.store.has_sample(point.op, point.phase, point.feature_dict(),
                                           device=summary.device_id, dtype=summary.dtype)
            again = stored and self._key(point) in self.flagged  # timed while disturbed before
            if stored and not again:
                summary.already_stored += 1
                continue
            m = self.measure(point, 1)
            if m is None:
                continue
            self.store_point(point, m, replace=again, info={**(sweep_info or {}), **self._speeds(m)})
            if again:
                summary.remeasured += 1
            else:
                summary.measured += 1
            self._watched(point, m)
        for n in range(2, self.sweeps + 1):
            order = list(reversed(points)) if n % 2 == 0 else list(points)
            for i, point in enumerate(order):
                if self.progress is not None:
                    self.progress((n - 1) * len(points) + i, total, f"{point.label} (sweep {n})")
                self._pool(point, n)
        if self.watch is not None:
            self._judge("end of the operators")

    def _watched(self, point, m) -> None:
        if self.watch is not None:
            self.watch.add(_Measured(point, m))
            if self.watch.due():
                self._judge(f"after {point.label}")

    def _pool(self, point, n: int) -> None:
        """Sweep ``n`` of a stored point that still wants it: time it again and store the
        fastest of all its runs (a point it could not time keeps what it has)."""
        from .bench import Measurement, aggregate
        s = self.summary
        sample = self.store.calibration_sample(point.op, point.phase, point.feature_dict(),
                                               device=s.device_id, dtype=s.dtype)
        if sample is None or sweeps_due(sample.info) == 0 or sample.info["sweeps"].get("done", 1) >= n:
            return
        m = self.measure(point, n)
        if m is None:
            return
        earlier = [float(t) for t in sample.info.get("times") or ()]
        pooled = Measurement(m.op, m.phase, m.features, m.dtype,
                             aggregate(earlier + list(m.aggregate.times)), m.impl, m.timer)
        self.store_point(point, pooled, replace=True,
                         info={"sweeps": {"done": n, "of": self.sweeps},
                               **self._speeds(m, sample.info.get("speeds"))})
        s.pooled += 1
        self._watched(point, pooled)

    def _judge(self, label: str):
        window = self.watch.close(label)
        if window.disturbed and window.points:
            flag = {"window": window.index, "why": window.why, "run": self.summary.run_id}
            self.store.flag_disturbed([(p.point.op, p.point.phase, p.point.feature_dict())
                                       for p in window.points], flag,
                                      device=self.summary.device_id, dtype=self.summary.dtype)
            self.suspects += [p.point for p in window.points]
            self.watch.points["flagged"] += len(window.points)  # still_flagged: retime says
        return window

    def retime(self, started: float) -> None:
        """Measure the points of disturbed windows again once a reading says the machine is
        quiet, within RETIME_SHARE of the time the operators took; a point's new sample
        replaces the flagged one when its own window closes quiet too."""
        from .disturbance import RETIME_SHARE
        watch, todo = self.watch, list(dict.fromkeys(self.suspects))
        budget = RETIME_SHARE * (time.monotonic() - started)
        deadline = time.monotonic() + budget
        tries = done = lost = 0
        while todo and time.monotonic() < deadline:
            tries += 1
            if watch.close("before re-timing").closing:  # not quiet yet
                time.sleep(max(0.0, min(watch.interval, deadline - time.monotonic())))
                continue
            batch: List[_Measured] = []
            while todo and time.monotonic() < deadline and not watch.due():
                point = todo.pop(0)
                m = self.measure(point)
                if m is None:  # it failed this time (summary.failed says why): stays flagged
                    lost += 1
                else:
                    batch.append(_Measured(point, m, self._speeds(m)))
            window = watch.close(f"after re-timing {len(batch)} points")
            if window.disturbed:
                todo = [b.point for b in batch] + todo
                continue
            for b in batch:
                self.store_point(b.point, b.measurement, replace=True, info={"retimed": True, **b.speeds})
            done += len(batch)
        still = len(todo) + lost
        watch.points.update(retimed=done, still_flagged=still)
        watch.retime = {"budget_seconds": budget, "attempts": tries, "retimed": done,
                        "still_flagged": still}


def recheck(store_path, run_id: int, device: str, label: str, since=None,
            steps: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """One more reading with the run's own reference and baseline, at the end of everything
    `calibrate` times (after the collectives, the last step; the engine ran before the
    operators); written into the run's record
    with ``steps``, the watch of each of those steps (calibration/step_watch.StepWatch.record:
    a step still disturbed after its re-run flags the run). ``since``: a machine.CpuClock mark
    taken when those steps began (other processes' CPU time since then corroborates a drift).
    None when the run has no record to compare with."""
    from .disturbance import Baseline, Probe, describe, wait_slowdown
    from .machine import CpuClock
    with SampleStore(store_path) as store:
        info = store.run(run_id)["info"]
    rec = dict(info.get("disturbance") or {})
    base = rec.get("baseline")
    if not base or not rec.get("loops"):
        return None
    with pinned_threads(rec.get("threads")):
        reading = Probe(device, info["dtype"], loops=rec["loops"]).read(label)
    baseline = Baseline(base["work"], base["noise"], base["threshold"], base.get("wait_noise", 0.0))
    others = CpuClock().others_cores(since, CpuClock().mark()) if since is not None else None
    found = baseline.findings(reading, others)
    why = describe(found)
    rec["after"] = {"what": label, "reading": reading.to_dict(), "others_cores": others, "why": why,
                    "found": found}
    drift = baseline.drift(reading)
    rec["max_drift"] = max(float(rec.get("max_drift") or 0.0), drift)
    if reading.waited is not None:
        rec["max_waited"] = max(float(rec.get("max_waited") or 0.0), reading.waited)
    rec["max_slowdown"] = max(float(rec.get("max_slowdown") or 0.0), drift, wait_slowdown(reading.waited))
    if why:
        rec["flagged"] = True
    if steps is not None:
        rec["steps"] = steps
        if steps.get("still_disturbed"):
            rec["flagged"] = True
    with SampleStore(store_path) as store:
        store.update_run(run_id, {**info, "disturbance": rec})
    return rec


def training_rows(store_path, *, device: Optional[int] = None, source: Optional[str] = None
                  ) -> List[Dict[str, Any]]:
    """The stored samples as the trainer's rows: op, phase, features..., seconds, dtype, ..."""
    with SampleStore(store_path) as store:
        return store.rows(device=device, source=source)
