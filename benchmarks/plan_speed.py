"""Time `neox-perf plan` as a whole process and print candidates per second.

Runs the module entry point with this interpreter on the bundled GPT-20B example (or --config)
and reads the plan's own counts from its --json envelope: `evaluated` (every layout considered,
rejected ones included), `admissible` (accepted by NeoX/DeepSpeed and fitting memory) and
`predicted` (timed through the full 1F1B prediction; the others were either rejected or skipped
by the lower bound). The load average is printed next to the figures: the machine is shared.

    python benchmarks/plan_speed.py [--runs 5] [--cluster vista-gh200] [--gpus 128]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cluster", default="vista-gh200")
    ap.add_argument("--config", default=str(REPO / "neox_perf" / "examples" / "gpt-20b.yml"))
    ap.add_argument("--gpus", default="128")
    ap.add_argument("--top", default="10")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "neox_perf", "plan", args.config, "--gpus", args.gpus,
           "--cluster", args.cluster, "--top", args.top, "--json"]
    first = subprocess.run(cmd, capture_output=True, text=True)
    if first.returncode not in (0, 3):
        print(first.stderr, file=sys.stderr)
        return 1
    data = json.loads(first.stdout)
    times, cpu = [], []
    for _ in range(args.runs):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=False)
        times.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        # CPU seconds of the process: what the figure would be on an idle machine, roughly.
        cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
    med = statistics.median(times)
    load = os.getloadavg()[0]
    print(f"neox-perf plan ({Path(args.config).name}, --gpus {args.gpus}, cluster {args.cluster}): "
          f"{data['evaluated']:,} candidates evaluated ({data['admissible']:,} admissible, "
          f"{data['predicted']:,} fully timed); whole process median {med:.2f} s, "
          f"min {min(times):.2f} s, max {max(times):.2f} s over {args.runs} runs "
          f"(CPU time median {statistics.median(cpu):.2f} s); "
          f"{data['evaluated'] / med:,.0f} candidates/s evaluated, "
          f"{data['predicted'] / med:,.0f} timed/s (target >= 1,000 candidates in <= 5 s); "
          f"load average {load:.2f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
