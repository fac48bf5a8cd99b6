"""Time `neox-perf check` as a whole process, as a user runs it: median of N runs.

Runs the installed console script's module entry point with this interpreter (a pyenv or
venv shim in front of the console script would add its own start-up to the figure), on the
bundled GPT-20B example with a prediction from a bundled cluster profile.

    python benchmarks/check_speed.py [--runs 15] [--cluster perlmutter-a100]
    python benchmarks/check_speed.py --sweep [--runs 15] [--slowest 8]

--sweep: every GPT-NeoX config (../shared/data/gpt-neox-configs, as benchmarks/verdicts.py
merges them) at 8, 16 and 128 GPUs on each bundled cluster and without one, timed once each;
the 3 x --slowest slowest three more times each, and the --slowest slowest by the median of
those four are then timed --runs times and their medians printed. The worst median is the
figure the 0.5 s target is held to. Measure on a quiet machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SWEEP_GPUS = ("8", "16", "128")
SWEEP_CLUSTERS = (None, "perlmutter-a100", "perlmutter-a100-80gb", "vista-gh200")


# A user's install has its bytecode: pip compiles it at install, and an editable install writes
# it at the first import. An environment with PYTHONDONTWRITEBYTECODE set (some shells and
# coding tools set it) would have every timed run compile neox_perf's ~80 modules again (0.2-0.4
# s here), which is the environment's cost, not check's: the runs are timed without it, after
# the untimed first run has written the bytecode.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _measure(cmd):
    """(wall seconds, CPU seconds) of one run: the wall clock is what the user waits; on a
    loaded machine it also measures the queue for a core, and the CPU time (user + system)
    is what the process itself costs."""
    import resource
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=False, env=ENV)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _time(cmd) -> float:
    return _measure(cmd)[0]


def _command(files, gpus, cluster):
    cmd = [sys.executable, "-m", "neox_perf", "check", *files, "--gpus", gpus, "--json"]
    return cmd + (["--cluster", cluster] if cluster else [])


def _summary(times) -> str:
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return (f"median {statistics.median(times):.3f} s, IQR {q[0]:.3f}-{q[2]:.3f} s, "
            f"min {min(times):.3f} s over {len(times)} runs")


def sweep(runs: int, slowest: int) -> int:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import verdicts
    root = verdicts.default_configs()
    if root is None:
        print("no GPT-NeoX configs (../shared/data/gpt-neox-configs)", file=sys.stderr)
        return 1
    with verdicts.configs_as_run(root) as (_, configs):
        cases = []
        for path, files in configs:
            for gpus in SWEEP_GPUS:
                for cluster in SWEEP_CLUSTERS:
                    cmd = _command(files, gpus, cluster)
                    cases.append((_time(cmd), path.relative_to(root), gpus, cluster, cmd))
        cases.sort(key=lambda c: c[0], reverse=True)
        print(f"{len(cases)} checks timed once: median {statistics.median(c[0] for c in cases):.3f} s, "
              f"slowest {cases[0][0]:.3f} s")
        # One timing each is a noisy ranking on a shared VM (llama2/70B at 128 GPUs, the
        # slowest at 0.71 s in one sweep, ranked below eighth in the next): the slowest three
        # times --slowest are timed three more times and ranked by the median of their four.
        shortlist = []
        for first, name, gpus, cluster, cmd in cases[:3 * slowest]:
            shortlist.append((statistics.median([first] + [_time(cmd) for _ in range(3)]),
                              name, gpus, cluster, cmd))
        shortlist.sort(key=lambda c: c[0], reverse=True)
        worst = 0.0
        for _, name, gpus, cluster, cmd in shortlist[:slowest]:
            times = [_time(cmd) for _ in range(runs)]
            worst = max(worst, statistics.median(times))
            print(f"  {name} --gpus {gpus} --cluster {cluster or '-'}: {_summary(times)}")
        print(f"worst median {worst:.3f} s (target <= 0.5 s); load average {os.getloadavg()[0]:.2f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--cluster", default="perlmutter-a100")
    ap.add_argument("--config", default=str(REPO / "neox_perf" / "examples" / "gpt-20b.yml"))
    ap.add_argument("--gpus", default="128")
    ap.add_argument("--sweep", action="store_true", help="every GPT-NeoX config, GPU count and cluster")
    ap.add_argument("--slowest", type=int, default=8, help="--sweep: how many to time --runs times")
    args = ap.parse_args()
    if args.sweep:
        return sweep(args.runs, args.slowest)
    cmd = _command([args.config], args.gpus, args.cluster)
    first = subprocess.run(cmd, capture_output=True, text=True, env=ENV)  # writes the bytecode
    if first.returncode not in (0, 3):
        print(first.stderr, file=sys.stderr)
        return 1
    times, cpu = zip(*(_measure(cmd) for _ in range(args.runs)))  # both of the same runs
    print(f"neox-perf check ({Path(args.config).name}, cluster {args.cluster or 'none'}): "
          f"{_summary(times)} (target <= 0.5 s); CPU time {_summary(cpu)}; load average "
          f"{os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
