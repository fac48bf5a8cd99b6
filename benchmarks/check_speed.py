"""Time `neox-perf check` as a whole process, as a user runs it: median of N runs.

Runs the installed console script's module entry point with this interpreter (a pyenv or
venv shim in front of the console script would add its own start-up to the figure), on the
bundled GPT-20B example with a prediction from a bundled cluster profile.

    python benchmarks/check_speed.py [--runs 15] [--cluster perlmutter-a100]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--cluster", default="perlmutter-a100")
    ap.add_argument("--config", default=str(REPO / "neox_perf" / "examples" / "gpt-20b.yml"))
    ap.add_argument("--gpus", default="128")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "neox_perf", "check", args.config, "--gpus", args.gpus, "--json"]
    if args.cluster:
        cmd += ["--cluster", args.cluster]
    first = subprocess.run(cmd, capture_output=True, text=True)
    if first.returncode not in (0, 3):
        print(first.stderr, file=sys.stderr)
        return 1
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=False)
        times.append(time.perf_counter() - t0)
    q = statistics.quantiles(times, n=4)
    print(f"neox-perf check ({Path(args.config).name}, cluster {args.cluster or 'none'}): "
          f"median {statistics.median(times):.3f} s, IQR {q[0]:.3f}-{q[2]:.3f} s, "
          f"min {min(times):.3f} s over {args.runs} runs (target <= 0.5 s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
