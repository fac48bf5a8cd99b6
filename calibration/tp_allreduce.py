"""The tensor-parallel all-reduce as training sees it, for the profile's engine terms.

Runs under torchrun on every rank: python -m neox_perf.calibration.tp_allreduce PATH.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from .launch import launch, rank_env


# A tensor-parallel all-reduce follows a block of compute on every rank, with no barrier: its
# cost in training includes waiting for the slowest member (scheduling jitter, gloo's helper
# threads sharing the cores), which the collective benchmark's barrier-aligned repetitions
# leave out. This times it that way: a GEMM of a few milliseconds, then the all-reduce of a
# fresh tensor, mean over repetitions and ranks.
TP_ELEMENTS = (16384, 65536, 262144, 1048576, 4194304)
TP_REPEATS, TP_WARMUP = 30, 5


def tp_path(store: Path) -> Path:
    return store.with_suffix(".tp.json")


def run_tp_benchmark(path: Path, nproc: int, device: str) -> Dict[str, object]:
    """Tensor-parallel all-reduces as training sees them (see _tp_worker); JSON at ``path``."""
    if nproc < 2:
        return {"skipped": "one process"}
    if not path.is_file():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", "0", "-m", __name__, str(path), "--device", device]
        launch(cmd, rank_env(device), path.with_suffix(".log"))
    return {"sizes": len(json.loads(path.read_text())["elements"])}


def _tp_worker(path: Path, device: str) -> int:

    import torch
    import torch.distributed as dist

    from .sweep import pick_threads
    torch.set_num_threads(pick_threads(None, device) or torch.get_num_threads())
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dev = torch.device("cuda" if cuda else "cpu", int(os.environ.get("LOCAL_RANK", "0")) if cuda else None)
    dist.init_process_group("nccl" if cuda else "gloo")
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    a, w = torch.randn(512, 768, device=dev), torch.randn(768, 768, device=dev)
    src = torch.randn(max(TP_ELEMENTS), device=dev)
    means, medians = [], []
    try:
        for elements in TP_ELEMENTS:
            times = []
            for r in range(TP_WARMUP + TP_REPEATS):
                a @ w
                x = src[:elements].clone()
                sync()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                sync()
                if r >= TP_WARMUP:
                    times.append(time.perf_counter() - t0)
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, times)
            pooled = sorted(t for ts in everyone for t in ts)
            means.append(sum(pooled) / len(pooled))
            medians.append(pooled[len(pooled) // 2])
        if dist.get_rank() == 0:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"elements": list(TP_ELEMENTS), "mean": means, "median": medians,
                                       "processes": dist.get_world_size(), "device": device}))
            os.replace(tmp, path)
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("path", help="where rank 0 writes the measurements (JSON)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    return _tp_worker(Path(args.path), args.device)


if __name__ == "__main__":
    raise SystemExit(main())
