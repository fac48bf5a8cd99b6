"""The steps of `calibrate` beside the operators, each watched whole: the engine runs (before
the operator step), the collectives, the gradient buckets and the tensor-parallel all-reduce
(after it) (docs/calibration-disturbance.md).

Why: those steps run every core this calibration may use (one process per "GPU"), so the
operator step's reference probe cannot run beside them, and one reading after them all sees
only whether the company has left. A few minutes of company during the engine runs made every
pipelined layout's prediction 10-12% high while the profile said it was clean.

What is measured: the CPU time other processes used on this process's CPUs while the step ran
(machine.CpuClock: /proc/stat's user, nice and system time minus this process's and its
reaped children's -- the step's ranks are children, reaped before the step ends; irq and
softirq time are left out, since the steps' own loopback traffic is received there), as a
share of those CPUs' capacity. Every
core is the step's, so another process's core-second is taken from it: a share ``s`` slows
the step by about ``s`` (more where its ranks wait for each other). On a GPU node, also other
processes holding a context on the GPU (NVML). Beside it, the steal: what the hypervisor took
from those CPUs. It is recorded with the step, not judged: like the reference's drift it is
the platform's, a re-run waits for the same hypervisor (on this project's VM a steady steal
had every step re-run into the same share and the profile flagged), and the user cannot act
on it; a neighbour process they can stop.

The verdict: disturbed when the processes' share is over STEP_LIMIT, a slowdown that could move a
prediction by about as much as two calibrations of a quiet machine may differ (3%). A
disturbed step is run again, once the machine has been quiet for QUIET_WINDOW_S (waiting at
most QUIET_WAIT_S), into a scratch target; its result replaces the first only when the re-run
was quiet too. Otherwise the first stays, and the step is recorded as still disturbed: the
profile's disturbance section flags it and every report made with it carries the line.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from . import machine

STEP_LIMIT = 0.02  # other processes' share of this process's CPUs while a step ran
QUIET_WINDOW_S = 3.0  # how long the machine must stay under the limit before a re-run
QUIET_WAIT_S = 180.0  # how long to wait for that before giving up (the step stays flagged)


@dataclass
class StepRecord:
    """One step's watch: what ran, what else ran, what was done about it."""

    step: str
    seconds: float = 0.0
    others_share: Optional[float] = None  # the first run's: other processes' share of the CPUs
    steal_share: Optional[float] = None  # the first run's: the hypervisor's share (recorded only)
    gpu_neighbours: List[Dict[str, int]] = field(default_factory=list)
    retimed: bool = False  # run again and the re-run replaced the first
    retime_share: Optional[float] = None  # the re-run's others_share
    retime_steal_share: Optional[float] = None
    still_disturbed: bool = False
    why: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        out = {"step": self.step, "seconds": round(self.seconds, 3), "others_share": self.others_share,
               "retimed": self.retimed, "still_disturbed": self.still_disturbed, "why": list(self.why)}
        if self.steal_share is not None:
            out["steal_share"] = self.steal_share
        if self.retime_share is not None:
            out["retime_share"] = self.retime_share
        if self.retime_steal_share is not None:
            out["retime_steal_share"] = self.retime_steal_share
        if self.gpu_neighbours:
            out["gpu_neighbours"] = list(self.gpu_neighbours)
        return out


class StepWatch:
    """Runs steps and judges each. ``cpu_clock`` and ``neighbours`` are injectable (tests);
    ``sleep`` too."""

    def __init__(self, *, cpu_clock: Optional[machine.CpuClock] = None,
                 neighbours: Callable[[], Optional[List[Dict[str, int]]]] = lambda: None,
                 limit: float = STEP_LIMIT, quiet_window: float = QUIET_WINDOW_S,
                 quiet_wait: float = QUIET_WAIT_S, sleep: Callable[[float], None] = time.sleep):
        # processes' time only: the steps' own loopback traffic is softirq time (machine.py)
        self.clock = cpu_clock or machine.CpuClock(columns=machine.PROCESS_COLUMNS)
        self.cores = max(1, len(self.clock.cpus))
        self.neighbours = neighbours
        self.limit, self.quiet_window, self.quiet_wait, self.sleep = limit, quiet_window, quiet_wait, sleep
        self.records: List[StepRecord] = []

    @classmethod
    def for_device(cls, device: str) -> "StepWatch":
        """On a GPU, also watch for other processes on it (this calibration's own ranks have
        exited by the time a step is judged)."""
        if not device.startswith("cuda"):
            return cls()
        uuid = None
        try:
            import torch
            uuid = str(torch.cuda.get_device_properties(torch.device(device)).uuid)
        except Exception:  # an older torch without .uuid: NVML's index 0
            uuid = None
        return cls(neighbours=lambda: machine.gpu_neighbours(uuid))

    def _judge(self, fn: Callable[[], Any]):
        start = self.clock.mark()
        out = fn()
        end = self.clock.mark()
        others = self.clock.others_cores(start, end)
        share = None if others is None else others / self.cores
        steal = self.clock.steal_cores(start, end)
        return out, share, None if steal is None else steal / self.cores, list(self.neighbours() or [])

    def _why(self, share: Optional[float], neighbours) -> List[str]:
        why = []
        if share is not None and share > self.limit:
            why.append(f"other processes took {share:.0%} of this machine's CPUs while it ran "
                       f"(limit {self.limit:.0%})")
        if neighbours:
            why.append("other processes on the GPU: " + ", ".join(f"pid {n['pid']}" for n in neighbours))
        return why

    def wait_quiet(self) -> bool:
        """Whether the machine stayed under the limit for one quiet window, within quiet_wait."""
        deadline = time.monotonic() + self.quiet_wait
        while time.monotonic() < deadline:
            start = self.clock.mark()
            self.sleep(self.quiet_window)
            others = self.clock.others_cores(start, self.clock.mark())
            if others is not None and others / self.cores <= self.limit and not self.neighbours():
                return True
        return False

    def run(self, step: str, fn: Callable[[], Any],
            retime: Optional[Callable[[], Callable[[], None]]] = None) -> Any:
        """Run ``fn`` (the step, writing where calibrate keeps it) and judge it. When disturbed
        and ``retime`` is given: wait for quiet, call ``retime()`` -- the step again into a
        scratch target, returning the function that moves that result over the first -- judge
        that run and commit it if it was quiet. Returns ``fn``'s result."""
        started = time.monotonic()
        out, share, steal, neighbours = self._judge(fn)
        rec = StepRecord(step, others_share=share, steal_share=steal,
                         gpu_neighbours=neighbours, why=self._why(share, neighbours))
        if rec.why and retime is not None:
            if self.wait_quiet():
                commit, share2, steal2, neighbours2 = self._judge(retime)
                rec.retime_share, rec.retime_steal_share = share2, steal2
                again = self._why(share2, neighbours2)
                if not again:
                    commit()
                    rec.retimed = True
                else:
                    rec.why += [f"re-run: {w}" for w in again]
            else:
                rec.why.append(f"not quiet again within {self.quiet_wait:.0f} s: not re-run")
        rec.still_disturbed = bool(rec.why) and not rec.retimed
        rec.seconds = time.monotonic() - started
        self.records.append(rec)
        return out

    def flag(self, step: str, reasons: List[str]) -> None:
        """Mark the last run of ``step`` disturbed for ``reasons`` found in its result (a
        disturbance the CPU shares cannot see: engine.sweep_findings). Not re-run: the reasons
        say what a quiet calibration would have to measure again."""
        rec = next((r for r in reversed(self.records) if r.step == step), None)
        if rec is None or not reasons:
            return
        rec.why += list(reasons)
        rec.still_disturbed = True

    @property
    def disturbed(self) -> List[StepRecord]:
        return [r for r in self.records if r.still_disturbed]

    def record(self) -> Dict[str, Any]:
        return {"limit": self.limit, "cores": self.cores,
                "steps": [r.to_dict() for r in self.records],
                "still_disturbed": [r.step for r in self.disturbed]}
