"""Speed of the pieces `check` is made of, in-process: derive, the 1F1B timeline, profile
prediction. Prints one line per piece with the figure and the budget it is held to (the
budgets the unit tests used to assert; a shared machine's load moves these figures, so they
live here, not in the test suite).

    python benchmarks/unit_speed.py [--repeat 10]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def derive_seconds(repeat: int) -> float:
    from neox_perf.config import WorldRequest, build, load_files
    from neox_perf.derive import derive
    cfg, _, _ = build(load_files([str(REPO / "neox_perf" / "examples" / "gpt-20b.yml")]),
                      WorldRequest(gpus=128))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        derive(cfg, 50277, 40 * 2 ** 30)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timeline_seconds(repeat: int, stages_n: int = 16, micro_batches: int = 128,
                     events: bool = True) -> float:
    """Best of ``repeat`` fresh simulations (the stream cache cleared before each: a repeat
    would otherwise be a lookup). events=False is the planner's and the quick search's path
    (timeline._lockstep_streams)."""
    from neox_perf.prediction import timeline as T
    stages = [T.StageCost(0.05 + 0.001 * s, 0.1, 0.002, 0.002, 0.3, optimizer=0.01, param_allgather=0.02)
              for s in range(stages_n)]
    stages[0] = T.StageCost(0.06, 0.12, 0.002, 0.0, 0.3, tied_allreduce=0.05, optimizer=0.01)
    best = math.inf
    for _ in range(repeat):
        T._STREAMS.clear()
        t0 = time.perf_counter()
        T.simulate_1f1b(stages, micro_batches, events=events)
        best = min(best, time.perf_counter() - t0)
    return best


def profile_seconds() -> float:
    from neox_perf.predictors import list_profiles, load_profile
    from neox_perf.predictors import profile as profile_module
    names = [p.name for p in list_profiles() if not getattr(p, "description", False)]
    profile_module._LOADED.clear()
    t0 = time.perf_counter()
    for p in [load_profile(n) for n in names]:
        for i in range(150):
            p.predict("linear1", "fwd", {"m": 1024 + 64 * i, "k": 4096, "n": 12288})
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    print(f"derive GPT-20B on 128 GPUs: median {derive_seconds(args.repeat) * 1e3:.1f} ms per call "
          f"over {args.repeat} (budget 50 ms)")
    print(f"1F1B timeline, 16 stages x 128 micro-batches: best {timeline_seconds(5) * 1e3:.1f} ms "
          f"of 5 with events (budget 20 ms), {timeline_seconds(5, events=False) * 1e3:.1f} ms without")
    # the quick search's longest: llama2/70B on 128 A100-40GB fits as pp 32, dp 1, 1,024 micro-batches
    print(f"1F1B timeline, 32 stages x 1,024 micro-batches: best "
          f"{timeline_seconds(3, 32, 1024) * 1e3:.1f} ms of 3 with events, "
          f"{timeline_seconds(3, 32, 1024, events=False) * 1e3:.1f} ms without")
    print(f"load every sampled profile + 150 operator predictions each: "
          f"{profile_seconds() * 1e3:.0f} ms (budget 1000 ms)")
    print(f"(1-minute load average {load:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
