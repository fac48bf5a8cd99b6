"""What the rest of the machine is doing while a calibration times: read from /proc and NVML.

Three readings, each cheap (a few small file reads or one NVML call) and None where the
platform does not offer it:

- ``run_delay()``: how long this thread has been runnable but not running, in seconds
  (/proc/thread-self/schedstat, field 2: ``sched_info.run_delay``, kernel
  Documentation/scheduler/sched-stats.rst). It grows only when another task holds the CPU this
  thread wants: exactly the share of a timing that belongs to someone else. Sleeping on I/O
  (a SQLite commit's fsync) does not count.
- ``CpuClock``: the CPU time other processes used on the CPUs this process may run on
  (/proc/stat per-CPU lines, busy = user+nice+system+irq+softirq+steal, USER_HZ ticks, see
  proc(5)) minus this process's own and its reaped children's (os.times()), as cores on
  average; steal counts, since a hypervisor running another guest on our core disturbs us too.
  The steps' watch reads processes' time alone (PROCESS_COLUMNS) and the steal beside it
  (``steal_cores``).
- ``gpu_neighbours(index)``: the other processes with a context on a GPU (NVML's
  nvmlDeviceGetComputeRunningProcesses via pynvml, when installed).

No torch here: the module is read by tests and by the calibration alike.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Tuple

SCHEDSTAT = "/proc/thread-self/schedstat"
PROC_STAT = "/proc/stat"
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# /proc/stat columns after the cpu name: user nice system idle iowait irq softirq steal ...
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)
# Without irq and softirq: a step whose own processes talk over the loopback (gloo's TCP)
# has the receive path run in softirq, charged to the CPU and to no process (about 1% of both
# CPUs during the tensor-parallel benchmark here), which is the step's own work, not a
# neighbour's. Another process's own work is user and system time.
PROCESS_COLUMNS = (0, 1, 2)
# Steal apart: the time the hypervisor ran something else on our virtual CPUs. It slows a step
# as a neighbour does, but it is the platform's, as the reference's drift is: on this
# project's VM it came and went between 0 and 5% of both CPUs with nothing else running
# (docs/calibration-disturbance.md), and a step watched with it among the neighbours was re-run
# for it, re-run into the same steal, and flagged.
STEAL_COLUMN = 7
MIN_TICKS = 100  # a shorter span is within a few ticks' rounding of any value: not reported


def run_delay() -> Optional[float]:
    """Seconds this thread has waited on a run queue since it started; None without schedstat."""
    try:
        with open(SCHEDSTAT, encoding="ascii") as fh:
            return int(fh.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def load_average() -> Optional[float]:
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return None


def allowed_cpus() -> FrozenSet[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def _ticks(cpus: FrozenSet[int], columns=_BUSY_COLUMNS) -> Tuple[Optional[int], Optional[int]]:
    """(the columns' ticks, steal ticks) summed over ``cpus``, from one read of /proc/stat."""
    try:
        with open(PROC_STAT, encoding="ascii") as fh:
            lines = fh.readlines()
    except OSError:
        return None, None
    total, steal, seen = 0, 0, 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            index = int(name[3:])
        except ValueError:
            continue
        if index in cpus:
            values = rest.split()
            total += sum(int(values[i]) for i in columns if i < len(values))
            steal += int(values[STEAL_COLUMN]) if STEAL_COLUMN < len(values) else 0
            seen += 1
    return (total, steal) if seen else (None, None)


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass(frozen=True)
class CpuMark:
    wall: float
    busy: Optional[int]  # ticks, on the allowed CPUs
    own: float  # seconds, this process and its reaped children
    steal: Optional[int] = None  # ticks the hypervisor took from the allowed CPUs


class CpuClock:
    """Other processes' CPU time on the CPUs this process may use, between two marks."""

    def __init__(self, cpus: Optional[FrozenSet[int]] = None, columns=_BUSY_COLUMNS):
        self.cpus = cpus if cpus is not None else allowed_cpus()
        self.columns = tuple(columns)

    def mark(self) -> CpuMark:
        busy, steal = _ticks(self.cpus, self.columns)
        return CpuMark(time.monotonic(), busy, _own_seconds(), steal)

    def steal_cores(self, start: CpuMark, end: CpuMark) -> Optional[float]:
        """Cores the hypervisor took on average between the marks (None: unknown, or too
        short to tell, as others_cores)."""
        wall = end.wall - start.wall
        if start.steal is None or end.steal is None or wall * TICKS < MIN_TICKS:
            return None
        return max(0.0, (end.steal - start.steal) / TICKS) / wall

    def others_cores(self, start: CpuMark, end: CpuMark) -> Optional[float]:
        """Cores other processes kept busy on average between the marks (None: unknown, or
        marks less than MIN_TICKS apart: the counters move in whole ticks of 1/USER_HZ s per
        CPU and per process)."""
        wall = end.wall - start.wall
        if start.busy is None or end.busy is None or wall * TICKS < MIN_TICKS:
            return None
        busy = (end.busy - start.busy) / TICKS
        return max(0.0, busy - (end.own - start.own)) / wall


def gpu_neighbours(uuid: Optional[str], index: int = 0) -> Optional[List[Dict[str, int]]]:
    """Other processes with a compute context on the GPU: [{"pid", "memory_bytes"}]; None when
    NVML cannot be asked (no pynvml, no driver). Found by ``uuid`` when given (CUDA's indices
    follow CUDA_VISIBLE_DEVICES, NVML's do not), else by NVML index."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            if uuid:
                name = str(uuid) if str(uuid).startswith("GPU-") else f"GPU-{uuid}"
                handle = pynvml.nvmlDeviceGetHandleByUUID(name)
            else:
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(index))
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # pynvml.NVMLError and its many subclasses: no answer, not a failure
        return None
    mine = {os.getpid()}
    return [{"pid": int(p.pid), "memory_bytes": int(getattr(p, "usedGpuMemory", 0) or 0)}
            for p in procs if int(p.pid) not in mine]
