"""The calibration's reference probe at rest and beside a busy process: its own noise, the
threshold that follows, and what it reads when another process shares its CPU.

    python benchmarks/disturbance_probe.py [--readings 30] [--cpu N] [--json]

Pins itself to one CPU (default: the highest this process may use) and does what a calibration
does at its start (calibration/disturbance.Watch.begin: a warm-up reading, five start readings,
the baseline and threshold), then takes --readings more alone, then --readings with a process
spinning on the same CPU. For each phase it prints the readings' work against the baseline
(drift), their waited share and the slowdown those waits mean (waited / (1 - waited)), the wall
time of a run against the start's, how many readings the threshold calls disturbed, and the CPU
time other processes took on that CPU meanwhile (/proc/stat): numbers taken while that is not
near zero describe a busy machine, not the probe at rest. Beside it, what the watch of
calibrate's later steps (calibration/step_watch.py) reads over every CPU this process may use:
other processes' share and, apart, the hypervisor's steal.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SPIN = "import os\nos.sched_setaffinity(0, {%d})\nprint('spinning', flush=True)\nwhile True:\n    pass\n"


def _phase(probe, base, clock, n: int, label: str, steps=None) -> dict:
    from neox_perf.calibration.disturbance import wait_slowdown
    start, whole = clock.mark(), steps.mark() if steps else None
    readings = [probe.read(f"{label} {i}") for i in range(n)]
    end = clock.mark()
    others = clock.others_cores(start, end)
    view = None
    if steps:
        last = steps.mark()
        cores = max(1, len(steps.cpus))
        o, st = steps.others_cores(whole, last), steps.steal_cores(whole, last)
        view = {"cpus": len(steps.cpus), "processes_share": None if o is None else o / cores,
                "steal_share": None if st is None else st / cores}
    drift = [base.baseline.drift(r) for r in readings]
    waited = [r.waited or 0.0 for r in readings]
    return {"readings": n, "others_cores": others,
            "drift": {"median": statistics.median(drift), "max": max(drift)},
            "waited": {"median": statistics.median(waited), "max": max(waited)},
            "wait_slowdown": {"median": statistics.median(wait_slowdown(w) for w in waited),
                              "max": max(wait_slowdown(w) for w in waited)},
            "wall_over_start": statistics.median(r.seconds for r in readings) / base.wall,
            "disturbed": sum(bool(base.baseline.judge(r, others)) for r in readings),
            "steal_cores": clock.steal_cores(start, end), "steps_view": view}


class _Base:
    def __init__(self, baseline, wall):
        self.baseline, self.work, self.wall = baseline, baseline.work, wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readings", type=int, default=30, help="readings per phase (default 30)")
    ap.add_argument("--cpu", type=int, default=max(os.sched_getaffinity(0)),
                    help="the CPU to pin to (default: the highest allowed)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from neox_perf.calibration import machine
    from neox_perf.calibration.disturbance import START_READINGS, Baseline, Probe

    saved = torch.get_num_threads(), os.sched_getaffinity(0)
    args.allowed = sorted(saved[1])
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {args.cpu})
    try:
        out = _measure(args, machine, START_READINGS, Baseline, Probe)
    finally:
        torch.set_num_threads(saved[0])
        os.sched_setaffinity(0, saved[1])
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    b = out["baseline"]
    print(f"reference {out['reference']}, pinned to CPU {args.cpu}")
    print(f"baseline: {b['work'] * 1e3:.3f} ms of CPU per run, noise {b['noise']:.2%}, threshold "
          f"{b['threshold']:.2%}, waits' threshold {b['wait_threshold']:.2%} (start readings waited "
          f"at most {b['start_waited_max']:.2%})")
    for name in ("alone", "busy"):
        p = out[name]
        others = "?" if p["others_cores"] is None else f"{p['others_cores']:.2f}"
        print(f"{name:5}: drift median {p['drift']['median']:+.2%} max {p['drift']['max']:+.2%}; "
              f"waited median {p['waited']['median']:.1%} max {p['waited']['max']:.1%} (slowdown "
              f"median {p['wait_slowdown']['median']:.1%}); wall per run x{p['wall_over_start']:.2f} "
              f"of the start's; {p['disturbed']}/{p['readings']} readings disturbed; other "
              f"processes on the CPU {others} cores")
        v = p["steps_view"]
        if v and v["processes_share"] is not None and v["steal_share"] is not None:
            print(f"       the steps' watch over {v['cpus']} CPUs: other processes "
                  f"{v['processes_share']:.2%} of them, the hypervisor's steal {v['steal_share']:.2%}")
    return 0


def _measure(args, machine, start_readings, Baseline, Probe) -> dict:
    clock = machine.CpuClock(frozenset({args.cpu}))
    steps = machine.CpuClock(frozenset(args.allowed), columns=machine.PROCESS_COLUMNS)
    probe = Probe("cpu", "fp32")
    probe.read("warm-up")
    mark = clock.mark()
    start = [probe.read(f"start {i + 1}") for i in range(start_readings)]
    base = Baseline.of(start)
    ref = _Base(base, statistics.median(r.seconds for r in start))
    out = {"reference": probe.describe(), "cpu": args.cpu,
           "baseline": {"work": base.work, "noise": base.noise, "threshold": base.threshold,
                        "wait_threshold": base.wait_threshold,
                        "start_waited_max": max(r.waited or 0.0 for r in start),
                        "others_cores": clock.others_cores(mark, clock.mark())}}
    out["alone"] = _phase(probe, ref, clock, args.readings, "alone", steps)
    spinner = subprocess.Popen([sys.executable, "-c", SPIN % args.cpu], stdout=subprocess.PIPE, text=True)
    try:
        spinner.stdout.readline()
        out["busy"] = _phase(probe, ref, clock, args.readings, "busy", steps)
    finally:
        spinner.kill()
        spinner.wait()
    return out


if __name__ == "__main__":
    sys.exit(main())
