"""Launching calibration and validation processes on this node: environment, ports, retries.

Shared by `neox-perf calibrate` (collectives, engine, tensor-parallel steps) and
`neox-perf validate` (the reference workload under torchrun).
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Dict, List, Optional

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


def exit_rank(code: int) -> None:
    """End a launched rank whose results are on disk, without the interpreter's teardown.

    After DeepSpeed and gloo have run, teardown can abort in a C++ destructor (a thread still
    joinable: "terminate called without an active exception", SIGABRT) after the rank has
    finished and written everything; the launch would then fail a run that succeeded. The
    exit handlers still run: the runtime hook writes its summary from one."""
    import atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def has_module(name: str) -> bool:
    """Whether ``name`` is importable, without importing it (torch and deepspeed take seconds)."""
    return importlib.util.find_spec(name) is not None


# What `neox-perf calibrate` imports beyond the core, module -> the distribution setup.cfg's
# [calibrate] extra installs (tests/test_extras.py holds the two together): torch measures,
# DeepSpeed runs the engine step, the rest fits the profile.
MEASURE_LIBRARIES = {"torch": "torch"}
ENGINE_LIBRARIES = {"deepspeed": "deepspeed"}
FIT_LIBRARIES = {"sklearn": "scikit-learn", "scipy": "scipy", "xgboost": "xgboost-cpu"}


def require_libraries(what: str, libraries: Dict[str, str]) -> None:
    """One line naming every missing library, before anything is measured: a missing fitting
    library must not surface at the fit, after minutes of sampling."""
    from neox_perf.errors import UsageError
    missing = [dist for module, dist in libraries.items() if not has_module(module)]
    if missing:
        raise UsageError(f"{what} needs {', '.join(missing)}, not installed here (fix: "
                         f"pip install '.[calibrate]' in the neox-perf checkout, your torch first)")


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


# Workers report progress as one JSON object per line on stdout, under this key, so the
# launcher reads events, not wording; anything else on the line stream is log text.
PROGRESS_KEY = "neox_perf_progress"


def progress_line(**event) -> str:
    """The line a worker prints (flushed) for one progress event."""
    return json.dumps({PROGRESS_KEY: event})


def progress_event(line: str) -> Optional[dict]:
    """The event of a worker's progress line, or None for any other line."""
    text = line.strip()
    if not text.startswith("{") or PROGRESS_KEY not in text:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    event = data.get(PROGRESS_KEY) if isinstance(data, dict) else None
    return event if isinstance(event, dict) else None


def launch(cmd: List[str], env: dict, log: Path, *, on_line: Optional[Callable[[str], None]] = None,
           cwd: Optional[Path] = None, timeout_s: Optional[float] = None, what: str = "launch") -> None:
    """Run ``cmd`` (a torchrun command line with ``--master_port``) to the end, its output
    merged into ``log`` and each line passed to ``on_line`` as it arrives.

    The port is chosen free just before each attempt, but another process can take it
    before the rendezvous binds it: then (and only then) the launch is retried on a new
    port. DeepSpeed's leftover shared memory is removed after every attempt. Raises
    CalibrationFailed (one line: ``what``, the exit code, the log's last line) on failure or
    after ``timeout_s``."""
    for _ in range(3):
        port = str(free_port())
        cmd[cmd.index("--master_port") + 1] = port
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace", cwd=cwd)
            timer = threading.Timer(timeout_s, proc.kill) if timeout_s else None
            if timer is not None:
                timer.start()
            try:
                for line in proc.stdout:
                    fh.write(line)
                    if on_line is not None:
                        on_line(line)
                proc.wait()
            finally:
                if timer is not None:
                    timer.cancel()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                remove_shm_buffers(port)
        text = log.read_text(errors="replace")
        if proc.returncode == 0 or not port_taken(text):
            break
    if proc.returncode != 0:
        raise CalibrationFailed(f"{what} failed (exit {proc.returncode}): {failure_line(text)} "
                                f"(log: {log}; command: {' '.join(cmd)})")


def port_taken(text: str) -> bool:
    """Does a failed launch's log say its rendezvous port was taken (the one failure a launch
    on new ports cures)?"""
    return "EADDRINUSE" in text or "address already in use" in text


def failure_line(text: str) -> str:
    """The line of a failed launch's log that says why: our workers' own one-line error
    (it names neox-perf), else the last exception, else the last line. torchrun adds its own
    report of the failed child after it, which says only that a child failed."""
    lines = [line.strip() for line in text.splitlines()
             if line.strip() and progress_event(line) is None and "ChildFailedError" not in line]
    for marker in ("neox-perf", "Error"):
        named = [line for line in lines if marker in line]
        if named:
            return named[-1][-300:]
    return (lines or ["no output"])[-1][-300:]


SHM_BUFFER_DIR = "/dev/shm"
SHM_BUFFER_PREFIX = "deepspeed_allreduce_buffer"  # deepspeed/ops/csrc/cpu/comm/shm.cpp


def shm_buffer_path(port, addr: str = "127.0.0.1", rank="*", uid="*") -> str:
    """The buffer shm.cpp names for ``rank`` of the job at ``addr:port`` (a glob pattern over
    what is left as ``*``)."""
    return os.path.join(SHM_BUFFER_DIR, f"{SHM_BUFFER_PREFIX}_{uid}_{addr}_{port}_{rank}")


def release_rank_buffer(env=None) -> bool:
    """Unlink the shared-memory buffer DeepSpeed's CPU communication op made for this rank
    (named after MASTER_ADDR, MASTER_PORT and RANK, as shm.cpp names it); True if one was.

    Called by a rank as it ends, so a CPU run launched by anything (deepy, torchrun, a user's
    script) gives back its ~66 MB per rank. Safe then: every peer mapped this buffer at its
    first collective, and a mapping outlives the name."""
    env = os.environ if env is None else env
    addr, port, rank = env.get("MASTER_ADDR"), env.get("MASTER_PORT"), env.get("RANK")
    if not (addr and port and rank):
        return False
    path = shm_buffer_path(port, addr, rank=rank, uid=os.getuid())
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def remove_shm_buffers(port, addr: str = "127.0.0.1") -> int:
    """Unlink the shared-memory buffers DeepSpeed's CPU communication op left for the job at
    ``addr:port``; returns how many. deepspeed.ops.comm (CPU accelerator) creates one
    /dev/shm/deepspeed_allreduce_buffer_*_<addr>_<port>_<rank> of ~66 MB per rank and never
    unlinks it, so every CPU launch would leak that much RAM until reboot (seen: 13 GB after a
    day of runs, then the OOM killer)."""
    removed = 0
    for path in glob.glob(shm_buffer_path(int(port), addr)):
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed
