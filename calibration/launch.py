"""Launching calibration and validation processes on this node: environment, ports, retries.

Shared by `neox-perf calibrate` (collectives, engine, tensor-parallel steps) and
`neox-perf validate` (the reference workload under torchrun).
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import socket
import subprocess
from pathlib import Path
from typing import List

from neox_perf.errors import NeoxPerfError


# glibc serves every allocation over its mmap threshold (at most 32 MiB) with fresh pages and
# returns them on free, so a CPU tensor that size pays first-touch page faults each time it is
# made (~0.3 ms/MiB here, 8x a memory pass). GPUs recycle memory through torch's caching
# allocator and never see this. A fixed 1 GiB threshold and no trimming make a CPU process
# recycle large tensors from its heap the same way; CPU calibration and validation both use it.
CACHING_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30),
                      "MALLOC_TRIM_THRESHOLD_": str((1 << 31) - 1)}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


class CalibrationFailed(NeoxPerfError):
    """A launched calibration process failed: one line with the reason and where the log is."""


def use_caching_malloc() -> bool:
    """Apply CACHING_MALLOC_ENV to this (already running) process; False where not glibc."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
                    and libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1))
    except (OSError, AttributeError):
        return False


def has_module(name: str) -> bool:
    """Whether ``name`` is importable, without importing it (torch and deepspeed take seconds)."""
    return importlib.util.find_spec(name) is not None


def cuda_available() -> bool:
    if not has_module("torch"):
        return False
    import torch
    return bool(torch.cuda.is_available())


def default_processes() -> int:
    try:
        import torch
        if torch.cuda.is_available():
            return max(torch.cuda.device_count(), 1)
    except ImportError:
        pass
    return max(1, min(2, os.cpu_count() or 1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(device: str) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    if device == "cpu":
        env.update(CACHING_MALLOC_ENV)
    return env


def launch(cmd: List[str], env: dict, log: Path) -> None:
    for _ in range(3):  # a free port can be taken before the rendezvous binds it
        cmd[cmd.index("--master_port") + 1] = str(free_port())
        with open(log, "w") as fh:
            proc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        remove_shm_buffers(cmd[cmd.index("--master_port") + 1])
        text = log.read_text(errors="replace")
        if proc.returncode == 0 or "EADDRINUSE" not in text:
            break
    if proc.returncode != 0:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        raise CalibrationFailed(f"launch failed (exit {proc.returncode}): {(lines or ['no output'])[-1][-300:]} "
                                f"(log: {log}; command: {' '.join(cmd)})")



def remove_shm_buffers(port, addr: str = "127.0.0.1") -> int:
    """Unlink the shared-memory buffers DeepSpeed's CPU communication op left for the job at
    ``addr:port``; returns how many. deepspeed.ops.comm (CPU accelerator) creates one
    /dev/shm/deepspeed_allreduce_buffer_*_<addr>_<port>_<rank> of ~66 MB per rank and never
    unlinks it, so every CPU launch would leak that much RAM until reboot (seen: 13 GB after a
    day of runs, then the OOM killer)."""
    removed = 0
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{addr}_{int(port)}_*"):
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed
