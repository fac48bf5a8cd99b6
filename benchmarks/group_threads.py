"""What a rank's idle CPU costs after it has made a layout's parallel groups again and again.

    python benchmarks/group_threads.py [--grids 20] [--idle 5]

Runs two processes under torchrun (gloo, as the engine calibration's tensor-parallel pass runs
them), twice: once building DeepSpeed's PipelineParallelGrid for mp 2 anew at every call, as
that pass did for each of its 20 engines (10 shapes x 2 sweeps) before stop 60, and once keeping
it (calibration/workload/tensor_parallel.parallel_groups, ``built``). After every few grids both
ranks sleep for ``--idle`` seconds and rank 0 prints its thread count and the CPU time its
process spent while asleep (time.process_time: user + system CPU of all its threads). A
training run makes its groups once; CPU that a rank burns while idle is taken from the work
beside it on a machine with as many cores as ranks. Linux only (the thread count is /proc's).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def _worker(grids: int, idle: float, keep: bool) -> int:
    import deepspeed
    import torch
    import torch.distributed as dist

    from neox_perf.calibration.workload.tensor_parallel import parallel_groups
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    built = {} if keep else None
    marks = sorted({0, *range(4, grids + 1, 4), grids})
    made = 0
    for mark in marks:
        while made < mark:
            parallel_groups(1, 2, dist.get_world_size() // 2, False, "cpu", built)
            made += 1
        dist.barrier()
        before = time.process_time()  # the whole process's CPU, every thread
        time.sleep(idle)
        spent = time.process_time() - before
        if dist.get_rank() == 0:
            threads = len(os.listdir("/proc/self/task"))
            print(f"  {'kept' if keep else 'anew'}  after {mark:>2} calls: {threads:>4} threads, "
                  f"idle CPU {100 * spent / idle:5.1f}% of a core", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grids", type=int, default=20, help="calls of parallel_groups (default 20)")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds asleep per reading (default 5)")
    ap.add_argument("--worker", choices=("anew", "kept"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args.grids, args.idle, args.worker == "kept")
    if not os.path.isdir("/proc/self/task"):
        print("group_threads: needs Linux's /proc", file=sys.stderr)
        return 2
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for mode in ("anew", "kept"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.abspath(__file__), "--worker", mode, "--grids", str(args.grids),
               "--idle", str(args.idle)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("  ")]
        print("\n".join(lines))
        if proc.returncode != 0:
            print(proc.stderr[-2000:], file=sys.stderr)
            return proc.returncode
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
