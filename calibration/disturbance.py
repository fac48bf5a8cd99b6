"""A calibration that knows it was disturbed: a fixed reference timed at the start, along the
way and at the end, and the machine watched in between (docs/calibration-disturbance.md).

Why: a calibration's samples are the profile. Timed while other work shares the machine they
are slow, and every prediction made from them is slow too (on a 2-core box, a few light
processes beside `calibrate --quick` made every pipelined layout's prediction 14-18% high),
with nothing in the profile to say so.

What is measured:

- The reference (``Probe``): ``loops`` x (an n x n GEMM + an elementwise add of 2^20
  elements) in the calibration's dtype on its device, with its thread count; ``loops`` is set
  once, at the start, so one run takes about RUN_SECONDS of the device's own time (CPU time on
  a CPU, so a busy start does not shrink it), and kept for the whole calibration. A reading is
  RUNS timed runs after one untimed one, each timed by bench.Timer as the points are. On a
  CPU each run also gives the thread's CPU time (time.thread_time) and the share of its wall
  time the thread spent runnable but not running (machine.run_delay), so a reading separates
  "the work got slower" (caches, memory bandwidth, clocks) from "the work waited for the CPU".
  Each of a reading's figures is its least disturbed run's, as a point's sample is its fastest
  run: a blip (one preemption) slows one run, a neighbour sharing the core or the memory slows
  them all. For that a run is longer than a scheduler slice: when the OS splits a core between
  the calibration and another process, a run shorter than a slice often fits whole inside the
  calibration's own slice and the fastest of a few looks undisturbed, while a run of several
  slices waits its share every time (measured here: 10 ms runs beside a spinning process on
  the same CPU wait 44-76% of their wall time, the least of five never under 43%).
- The start: START_READINGS readings. Their work (CPU time per run on a CPU, device time on a
  GPU) is the baseline; their relative range is the probe's own noise; ``threshold`` follows
  from it (``Baseline``).
- Along the way: the points are grouped into windows of about ``interval`` seconds, each
  closed by a reading, so probing costs OVERHEAD of the operator step. A window is disturbed
  when the reading that closes it or the one that opened it is (its waits, as a slowdown,
  beyond the waits' own threshold, whatever the work's noise; its work beyond the baseline by
  more than the threshold while other processes kept more than the threshold's share of a
  core busy: Baseline.findings; another
  process on the GPU), or when the calibration thread waited on a run queue during the window
  for more than Baseline.window_wait_limit of it. Every point of a disturbed window is flagged
  in the store.
- At the end: the flagged points are re-timed once the machine is quiet again (a reading
  within the threshold), within RETIME_SHARE of the operator step's time; a re-timed point
  replaces its sample only when its own window closes quiet. What is still flagged stays
  flagged, and a later `calibrate` on the same store measures it again.

The record of each calibration run (``Watch.record()``) goes into the store's run info; the
profile's `disturbance` section is built from the store's runs and flagged samples when the
profile is fitted (neox_perf/profile/disturbance.py).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from neox_perf.profile.disturbance import describe, worst

from . import machine

START_READINGS = 5
RUNS = 5  # timed runs per reading
RUN_SECONDS = 0.01  # one run: several scheduler slices (CFS/EEVDF slices are ~1-3 ms)
MAX_LOOPS = 1000
GEMM_N = 256
ELEMENTS = 1 << 20
OVERHEAD = 0.05  # share of the operator step spent on readings along the way
RETIME_SHARE = 0.25  # re-timing may add at most this share of the operator step's time
KEPT_READINGS = 40  # readings written to the record besides the start and the flagged ones
# The threshold is this many times the start readings' relative range: a later reading of an
# undisturbed machine lies within the range of the first ones about as often as not, and
# twice it is well outside what five quiet readings leave (docs/calibration-disturbance.md).
RANGE_FACTOR = 2.0
# ...and never under this: a slowdown smaller than two quiet calibrations of one machine may
# differ (3% per layout, the reproducibility bar) cannot make a profile worse than a second
# calibration would, while five very tight start readings (0.3% apart) put a range-only
# threshold under the platform's own blips, and a quiet calibration re-timed hundreds of
# points for nothing.
THRESHOLD_FLOOR = 0.03


@dataclass(frozen=True)
class Reading:
    label: str
    at: float  # seconds since the watch began
    seconds: float  # the fastest run's time, timed as the points are (wall or CUDA events)
    cpu: Optional[float] = None  # the least thread CPU time of a run (CPU device only)
    waited: Optional[float] = None  # the least share of a run's wall time spent waiting for a CPU
    waited_mean: Optional[float] = None  # the share of all its runs' wall time spent waiting
    load: Optional[float] = None  # 1-minute load average
    neighbours: Tuple[Tuple[int, int], ...] = ()  # (pid, bytes) of other processes on the GPU

    @property
    def work(self) -> float:
        """What the reference's own cost is judged by: CPU time on a CPU, else device time."""
        return self.cpu if self.cpu is not None else self.seconds

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"label": self.label, "at": round(self.at, 3), "seconds": self.seconds}
        for key in ("cpu", "waited", "waited_mean", "load"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.neighbours:
            out["gpu_neighbours"] = [{"pid": p, "memory_bytes": b} for p, b in self.neighbours]
        return out


def wait_slowdown(waited: Optional[float]) -> float:
    """How much longer work took than it would have alone, when it waited ``waited`` of the
    time: wall = own / (1 - waited), so wall / own - 1 = waited / (1 - waited)."""
    if waited is None or waited <= 0:
        return 0.0
    return float("inf") if waited >= 1 else waited / (1.0 - waited)


@dataclass(frozen=True)
class Baseline:
    """The start readings: the reference's work at rest and the noise it measured itself."""

    work: float  # median work of the start readings
    noise: float  # their relative range, the slowest left out: (2nd slowest - fastest) / median
    threshold: float  # RANGE_FACTOR x noise, at least THRESHOLD_FLOOR: how far a reading may stray
    wait_noise: float = 0.0  # the start readings' median share of time waited (blips at rest)

    def drift(self, reading: "Reading") -> float:
        """The reading's work beyond the work at rest (0 without a baseline's work)."""
        return reading.work / self.work - 1.0 if self.work > 0 else 0.0

    @classmethod
    def of(cls, start: Sequence[Reading]) -> "Baseline":
        # The slowest start reading is left out of the range: noise from outside is one-sided
        # (a reading is slowed by a neighbour, never sped up), and one slowed reading would
        # otherwise widen the threshold until the disturbance it shows no longer counts.
        works = sorted(r.work for r in start)
        mid = statistics.median(works)
        kept = works[:-1] if len(works) >= 3 else works
        noise = (kept[-1] - kept[0]) / mid if mid > 0 else 0.0
        waits = [r.waited_mean for r in start if r.waited_mean is not None]
        return cls(mid, noise, max(RANGE_FACTOR * noise, THRESHOLD_FLOOR),
                   statistics.median(waits) if waits else 0.0)

    @property
    def wait_threshold(self) -> float:
        """How much slowdown a reading's waits (its least waited run) may stand for before they
        count: THRESHOLD_FLOOR, whatever the work's noise. At rest the least waited of a
        reading's runs waits nothing (every reading of a quiet calibration here: 0.0), so a
        wait is another task on the CPU, not noise; and a reference whose CPU time wanders
        with the platform (17% over five start readings on this project's VM, nothing else
        running) says nothing about how long it queues for a CPU: the work's threshold (34%
        there) had let a neighbour take a quarter of the CPU unseen."""
        return THRESHOLD_FLOOR

    @property
    def window_wait_limit(self) -> float:
        """The share of a window the calibration may wait on the run queue before it counts:
        the wait threshold's worth of slowdown (a share t / (1 + t)), or RANGE_FACTOR x the
        share the start readings waited if more. A window's wait sums every blip (a kernel
        thread, a task woken on this CPU for a millisecond) that a reading's least waited run
        leaves out; the start says how many a quiet moment has. (At 1, never: the start itself
        waited half its time, which its readings' least waited runs say.)"""
        t = self.wait_threshold
        return min(1.0, max(t / (1.0 + t), RANGE_FACTOR * self.wait_noise))

    def findings(self, reading: Reading, others: Optional[float] = None) -> Dict[str, Any]:
        """What in ``reading`` says the machine was disturbed (empty: nothing).

        "waited": the reading waited for a CPU (its least waited run) for longer than the
        wait threshold's worth of slowdown: another task held the CPU; direct evidence, at rest
        it is zero. "drift": its work beyond its time at rest by more than the threshold, counted
        only while other processes kept more than the threshold's share of a core busy
        (``others``, cores, over the window it closes): a slower reference with nothing else
        running is the platform's own noise (clocks, a hypervisor's other guests: on this
        project's VM +-5-10% over seconds with the machine idle), which no quiet moment
        would cure, and is recorded, not flagged. "gpu_neighbours": other processes on the
        GPU."""
        found: Dict[str, Any] = {}
        drift = self.drift(reading)
        if drift > self.threshold and others is not None and others > self.threshold:
            found.update(drift=drift, others_cores=others)
        if wait_slowdown(reading.waited) > self.wait_threshold:
            found["waited"] = reading.waited
        if reading.neighbours:
            found["gpu_neighbours"] = [{"pid": p, "memory_bytes": b} for p, b in reading.neighbours]
        return found

    def judge(self, reading: Reading, others: Optional[float] = None) -> List[str]:
        """Why ``reading`` says the machine was disturbed, in words (empty: it says it was not)."""
        return describe(self.findings(reading, others))


class Probe:
    """The fixed reference on one device and dtype (see the module doc)."""

    def __init__(self, device: str = "cpu", dtype: str = "fp32", loops: Optional[int] = None):
        import torch

        from .bench import DTYPES, Timer
        self.device, self.dtype = str(device), dtype
        self.timer = Timer(None, device=device)  # the real clock even when the points' is injected
        self.cpu = self.timer.device.type == "cpu"
        gen = torch.Generator().manual_seed(0)
        dt = DTYPES[dtype]

        def tensor(*shape):
            return torch.randn(*shape, generator=gen).to(device=self.timer.device, dtype=dt)
        self.a, self.b = tensor(GEMM_N, GEMM_N), tensor(GEMM_N, GEMM_N)
        self.x, self.y = tensor(ELEMENTS), tensor(ELEMENTS)
        self.mm_out, self.add_out = torch.empty_like(self.a), torch.empty_like(self.x)
        self.uuid = None
        if not self.cpu:
            try:
                self.uuid = str(torch.cuda.get_device_properties(self.timer.device).uuid)
            except Exception:  # an older torch without .uuid: fall back to the index
                self.uuid = None
        self.loops = int(loops) if loops else self._size()

    def _unit(self) -> None:
        import torch
        torch.mm(self.a, self.b, out=self.mm_out)
        torch.add(self.x, self.y, out=self.add_out)

    def _run(self, loops: int) -> None:
        for _ in range(loops):
            self._unit()

    def _own_time(self, loops: int) -> float:
        """One run's own cost: thread CPU time on a CPU, device time on a GPU."""
        if self.cpu:
            start = time.thread_time()
            self._run(loops)
            return time.thread_time() - start
        return self.timer.measure(lambda _: self._run(loops))

    def _size(self) -> int:
        self._run(2)  # warm: allocator, oneDNN/cuBLAS heuristics
        unit = min(self._own_time(4) / 4 for _ in range(3))
        return int(min(MAX_LOOPS, max(1, round(RUN_SECONDS / unit)))) if unit > 0 else MAX_LOOPS

    def describe(self) -> str:
        return (f"{self.loops} x ({GEMM_N}x{GEMM_N}x{GEMM_N} GEMM + {ELEMENTS}-element add), "
                f"{self.dtype} on {self.device}")

    def seconds_per_loop(self, readings: int = 3) -> float:
        """The reference's own cost per loop now, the median of ``readings`` readings' work: the
        machine's speed, comparable with a calibration's (profile.disturbance.reference)."""
        return statistics.median(self.read("speed").work for _ in range(readings)) / self.loops

    def read(self, label: str, at: float = 0.0) -> Reading:
        """One untimed run, then RUNS timed ones; each statistic is the least disturbed run's,
        as a point's sample is its fastest run: a blip (one preemption, one interrupt storm)
        slows one run, a neighbour sharing the core or the memory slows them all."""
        fn = lambda _: self._run(self.loops)  # noqa: E731
        self.timer.run_untimed(fn)
        walls, cpus, waits, delays = [], [], [], []
        for _ in range(RUNS):
            d0, c0 = machine.run_delay(), time.thread_time()
            wall = self.timer.measure(fn)
            cpu, d1 = time.thread_time() - c0, machine.run_delay()
            walls.append(wall)
            cpus.append(cpu)
            if wall <= 0 or not self.cpu:
                continue
            if d0 is not None and d1 is not None:
                delays.append(max(0.0, d1 - d0))
            else:  # no schedstat: what the thread did not run of its wall time
                delays.append(max(0.0, wall - cpu))
            waits.append(min(1.0, delays[-1] / wall))
        found = machine.gpu_neighbours(self.uuid) if not self.cpu else None
        return Reading(label, at, min(walls), min(cpus) if self.cpu else None,
                       min(waits) if waits else None,
                       min(1.0, sum(delays) / sum(walls)) if delays else None, machine.load_average(),
                       tuple((p["pid"], p["memory_bytes"]) for p in found or ()))


@dataclass
class Window:
    """The points timed between two readings, and what the machine did meanwhile."""

    index: int
    opened_by: Reading
    started: float  # monotonic
    delay: Optional[float]  # machine.run_delay() when it opened
    cpu_mark: Any
    points: List[Any] = field(default_factory=list)
    waited: Optional[float] = None
    others_cores: Optional[float] = None
    closing: Dict[str, Any] = field(default_factory=dict)  # what the closing reading found
    why: List[str] = field(default_factory=list)

    @property
    def disturbed(self) -> bool:
        return bool(self.why)


class Watch:
    """Readings at the start, every ``interval`` seconds of points, and at the end; windows of
    points judged against the start's noise. ``probe`` is any object with ``read(label, at)``,
    ``describe()`` and ``loops`` (tests give a fake one); ``delay`` reads the thread's run-queue
    wait (machine.run_delay)."""

    def __init__(self, probe, *, delay: Callable[[], Optional[float]] = machine.run_delay,
                 cpu_clock: Optional[machine.CpuClock] = None, threads: Optional[int] = None):
        self.probe = probe
        self.delay = delay
        self.cpu_clock = cpu_clock or machine.CpuClock()
        self.threads = threads
        self.began = time.monotonic()
        self.start: List[Reading] = []
        self.readings: List[Reading] = []
        self.flagged_readings: List[Tuple[Reading, Dict[str, Any]]] = []  # and what they found
        self.base: Optional[Baseline] = None
        self.interval = 0.0
        self.window: Optional[Window] = None
        self.windows = 0
        self.disturbed_windows = 0
        self.load_max: Optional[float] = None
        self.others_max: Optional[float] = None
        self.points = {"flagged": 0, "retimed": 0, "still_flagged": 0, "remeasured": 0}
        self.retime: Dict[str, Any] = {}

    # -- readings ---------------------------------------------------------------------------

    def _read(self, label: str) -> Reading:
        r = self.probe.read(label, time.monotonic() - self.began)
        if r.load is not None:
            self.load_max = r.load if self.load_max is None else max(self.load_max, r.load)
        return r

    def begin(self) -> Baseline:
        """The start readings, the baseline, the first window."""
        self.probe.read("warm-up")  # discarded: the first runs pay page faults, cold caches, clock ramp
        t0 = time.monotonic()
        self.start = [self._read(f"start {i + 1}") for i in range(START_READINGS)]
        self.base = Baseline.of(self.start)
        # readings cost about what the start's did: one per `interval` keeps them at OVERHEAD
        self.interval = (time.monotonic() - t0) / START_READINGS / OVERHEAD
        for r in self.start:  # waits at the start: disturbed from the start
            found = self.base.findings(r)
            if found:
                self.flagged_readings.append((r, found))
        self._open(self.start[-1])
        return self.base

    def _open(self, reading: Reading) -> None:
        self.window = Window(self.windows, reading, time.monotonic(), self.delay(), self.cpu_clock.mark())
        self.windows += 1

    def add(self, point) -> None:
        self.window.points.append(point)

    def due(self) -> bool:
        return time.monotonic() - self.window.started >= self.interval

    def close(self, label: str) -> Window:
        """Close the window with a reading, judge it, open the next one; the closed window."""
        w = self.window
        end_delay, end_mark = self.delay(), self.cpu_clock.mark()
        wall = time.monotonic() - w.started
        if w.delay is not None and end_delay is not None and wall > 0:
            w.waited = min(1.0, max(0.0, (end_delay - w.delay) / wall))
        w.others_cores = self.cpu_clock.others_cores(w.cpu_mark, end_mark)
        if w.others_cores is not None:
            self.others_max = max(self.others_max or 0.0, w.others_cores)
        reading = self._read(label)
        self.readings.append(reading)
        w.closing = self.base.findings(reading, w.others_cores)
        if w.closing:
            self.flagged_readings.append((reading, w.closing))
        why = describe(w.closing) + [f"at the reading before: {x}"
                                     for x in self.base.judge(w.opened_by, w.others_cores)]
        if w.waited is not None and w.waited > self.base.window_wait_limit:
            why.append(f"the calibration waited for a CPU {w.waited:.0%} of the window")
        w.why = why
        self.disturbed_windows += bool(why) and bool(w.points)
        self._open(reading)
        return w

    # -- the record --------------------------------------------------------------------------

    @property
    def flagged(self) -> bool:
        """Samples timed while disturbed are still in the store (readings that caught a
        disturbance no point was timed in, or whose points were re-timed, are only recorded)."""
        return self.points["still_flagged"] > 0

    def reasons(self) -> Dict[str, Any]:
        """The worst of what the readings that caught a disturbance found."""
        return worst([found for _, found in self.flagged_readings])

    def record(self) -> Dict[str, Any]:
        """What this run's watch saw, for the store's run info (plain JSON)."""
        base = self.base
        kept = {id(r) for r in self.readings[-KEPT_READINGS:]}
        kept |= {id(r) for r, _ in self.flagged_readings}
        every = self.start + self.readings
        drifts = [base.drift(r) for r in every] if base and base.work > 0 else []
        slowdowns = [max(d, wait_slowdown(r.waited)) for d, r in zip(drifts, every)]
        return {
            "reference": self.probe.describe(), "loops": self.probe.loops,
            "runs_per_reading": RUNS, "threads": self.threads,
            "baseline": {"work": base.work, "noise": base.noise, "threshold": base.threshold,
                         "wait_noise": base.wait_noise, "wait_threshold": base.wait_threshold,
                         "window_wait_limit": base.window_wait_limit,
                         "range_factor": RANGE_FACTOR} if base else None,
            "start": [r.to_dict() for r in self.start],
            "readings": [r.to_dict() for r in self.readings if id(r) in kept],
            "readings_taken": len(self.start) + len(self.readings),
            "interval_seconds": self.interval,
            "max_slowdown": max(slowdowns, default=0.0),
            "max_waited": max((r.waited for r in every if r.waited is not None), default=None),
            "max_drift": max(max(drifts, default=0.0), 0.0),
            "flagged_readings": [{"label": r.label, "why": describe(found)}
                                 for r, found in self.flagged_readings],
            "windows": self.windows, "disturbed_windows": self.disturbed_windows,
            "points": dict(self.points),
            "retime": dict(self.retime),
            "machine": {"load_max": self.load_max, "others_cores_max": self.others_max,
                        "cpus": sorted(self.cpu_clock.cpus)},
            "flagged": self.flagged, "reasons": self.reasons(),
        }

