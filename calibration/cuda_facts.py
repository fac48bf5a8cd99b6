"""What a CUDA machine is and what its GPU reports, read the same way by every measuring tool.

Small readers, each taking the ``torch`` module (and nvidia-smi's runner) as an argument so
that the CUDA-only branches are tested on a CPU with a stand-in; each returns plain data and
never raises for a missing driver or tool (None, or a reason, instead):

- ``tf32_state``: whether fp32 matmuls run on the tensor cores as TF32. PyTorch leaves
  ``torch.backends.cuda.matmul.allow_tf32`` False by default since 1.12, and the environment
  variable TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 turns TF32 on for cuBLAS whatever that flag says
  (PyTorch docs, notes/cuda.rst, "TensorFloat-32 (TF32) on Ampere (and later) devices").
  PyTorch >= 2.9 also spells it ``torch.backends.cuda.matmul.fp32_precision`` ("ieee"/"tf32").
  TF32 exists from compute capability 8.0 (Ampere) on.
- ``memory_stats``: allocated and reserved bytes now and at their peaks (PyTorch docs, "CUDA
  semantics: memory management": nvidia-smi sees the reserved bytes, not the allocated ones).
- ``EventTimer``: GPU-side seconds between two points of a stream (torch.cuda.Event with
  enable_timing; elapsed_time is in milliseconds), read after one synchronize.
- ``nvidia_smi``/``SmiPoller``: nvidia-smi's query interface (``--query-gpu=... --format=csv``),
  once or sampled in a thread for the peak of a field over a run (memory.used: what the GPU
  holds for every process on it).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

OVERRIDE_ENV = "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"
NVIDIA_OFF_ENV = "NVIDIA_TF32_OVERRIDE"
SMI_FIELDS = ("name", "driver_version", "memory.total", "memory.used", "clocks.sm", "clocks.mem",
              "clocks.max.sm", "temperature.gpu", "power.draw", "pstate")
Runner = Callable[[List[str]], str]


def _torch(module=None):
    if module is not None:
        return module
    import torch
    return torch


def tf32_state(torch_module=None, env=None, device: int = 0, capability=None) -> Dict[str, object]:
    """Whether fp32 matmuls run as TF32 on ``device`` (or on a GPU of ``capability``, a
    (major, minor) pair, where the caller has it), and every setting that decides it: the one
    reader of it (calibration/fingerprint.tf32_state, which the hook records, adapts this).
    NVIDIA_TF32_OVERRIDE=0 turns TF32 off in cuBLAS whatever the framework asks (cuBLAS docs,
    cublasSetMathMode)."""
    torch = _torch(torch_module)
    env = os.environ if env is None else env
    matmul = torch.backends.cuda.matmul
    out: Dict[str, object] = {
        # the hook has recorded runs under these names since it first read them
        "allow_tf32": bool(getattr(matmul, "allow_tf32", False)),
        "cudnn_allow_tf32": bool(getattr(getattr(torch.backends, "cudnn", None), "allow_tf32", False)),
        "fp32_precision": getattr(matmul, "fp32_precision", None),  # torch >= 2.9
        "float32_matmul_precision": (torch.get_float32_matmul_precision()
                                     if hasattr(torch, "get_float32_matmul_precision") else None),
        OVERRIDE_ENV: env.get(OVERRIDE_ENV),
        NVIDIA_OFF_ENV: env.get(NVIDIA_OFF_ENV),
        "capability": None,
    }
    if capability is not None:
        out["capability"] = f"{capability[0]}.{capability[1]}"
    else:
        try:
            if torch.cuda.is_available():
                out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        except Exception:  # a driver that cannot answer: capability unknown
            pass
    asked = (out["allow_tf32"] or out["fp32_precision"] == "tf32"
             or out["float32_matmul_precision"] in ("high", "medium")
             or str(out[OVERRIDE_ENV] or "") == "1")
    vetoed = str(out[NVIDIA_OFF_ENV] or "") == "0"
    capable = out["capability"] is not None and int(str(out["capability"]).split(".")[0]) >= 8
    out["fp32_matmuls_as_tf32"] = bool(asked and capable and not vetoed)
    out["why"] = ("no CUDA device: fp32 matmuls run on the CPU in IEEE fp32" if out["capability"] is None
                  else f"compute capability {out['capability']} < 8.0 has no TF32" if not capable
                  else f"{NVIDIA_OFF_ENV}=0 turns TF32 off in cuBLAS" if asked and vetoed
                  else "asked for (allow_tf32, fp32_precision, float32_matmul_precision or the "
                       "override variable)" if asked else "PyTorch's default: IEEE fp32")
    return out


def memory_stats(torch_module=None, device=None) -> Optional[Dict[str, int]]:
    """Allocated/reserved bytes now and at their peaks since the last reset; None without CUDA."""
    torch = _torch(torch_module)
    if not torch.cuda.is_available():
        return None
    cuda = torch.cuda
    return {"allocated": int(cuda.memory_allocated(device)),
            "max_allocated": int(cuda.max_memory_allocated(device)),
            "reserved": int(cuda.memory_reserved(device)),
            "max_reserved": int(cuda.max_memory_reserved(device))}


class EventTimer:
    """Seconds between ``start()`` and ``stop()`` as the GPU saw them, per interval; on a CPU
    (or ``cuda=False``) the host's perf_counter. ``seconds()`` synchronizes once and reads all."""

    def __init__(self, torch_module=None, cuda: Optional[bool] = None):
        self.torch = _torch(torch_module)
        self.cuda = bool(self.torch.cuda.is_available()) if cuda is None else cuda
        self._pairs: List[tuple] = []
        self._open = None

    def start(self) -> None:
        if self.cuda:
            self._open = self.torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._open = time.perf_counter()

    def stop(self) -> None:
        if self._open is None:
            raise RuntimeError("EventTimer.stop() without start()")
        if self.cuda:
            end = self.torch.cuda.Event(enable_timing=True)
            end.record()
            self._pairs.append((self._open, end))
        else:
            self._pairs.append((self._open, time.perf_counter()))
        self._open = None

    def seconds(self) -> List[float]:
        if self.cuda:
            self.torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in self._pairs]  # elapsed_time: ms
        return [b - a for a, b in self._pairs]

    @property
    def method(self) -> str:
        return "torch.cuda.Event (GPU clock)" if self.cuda else "time.perf_counter (host)"


def _run(cmd: List[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout


def nvidia_smi(fields: Sequence[str] = SMI_FIELDS, index: int = 0,
               runner: Optional[Runner] = None) -> Dict[str, object]:
    """One nvidia-smi reading of ``fields`` for GPU ``index`` ({field: text}); {"error": why}
    when there is no nvidia-smi or it fails. Units stay as nvidia-smi prints them (nounits)."""
    if runner is None:
        if shutil.which("nvidia-smi") is None:
            return {"error": "nvidia-smi not on PATH"}
        runner = _run
    cmd = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
           f"--id={index}"]
    try:
        line = runner(cmd).strip().splitlines()[0]
    except Exception as exc:  # no driver, timeout, unknown field: a reading, not a failure
        return {"error": f"{' '.join(cmd)}: {exc.__class__.__name__}: {exc}"[:300]}
    values = [v.strip() for v in line.split(",")]
    if len(values) != len(fields):
        return {"error": f"nvidia-smi answered {len(values)} values for {len(fields)} fields: {line[:200]}"}
    return dict(zip(fields, values))


def mib_bytes(text) -> Optional[int]:
    """nvidia-smi's memory figure (MiB, nounits) in bytes; None for '[N/A]' and the like."""
    try:
        return int(float(text) * 2 ** 20)
    except (TypeError, ValueError):
        return None


class SmiPoller:
    """nvidia-smi's ``field`` every ``interval`` seconds in a thread, from ``start()`` to
    ``stop()``; ``peak`` is the largest reading (MiB), ``samples`` how many were read."""

    def __init__(self, field: str = "memory.used", index: int = 0, interval: float = 0.5,
                 runner: Optional[Runner] = None):
        self.field, self.index, self.interval, self.runner = field, index, interval, runner
        self.peak: Optional[float] = None
        self.samples, self.error = 0, None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _loop(self) -> None:
        while True:
            reading = nvidia_smi((self.field,), self.index, self.runner)
            if "error" in reading:
                self.error = reading["error"]
                return
            try:
                value = float(reading[self.field])
            except ValueError:
                value = None
            if value is not None:
                self.samples += 1
                self.peak = value if self.peak is None else max(self.peak, value)
            if self._stop.wait(self.interval):
                return

    def start(self) -> "SmiPoller":
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Dict[str, object]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        return {"field": self.field, "peak": self.peak, "peak_bytes": mib_bytes(self.peak),
                "samples": self.samples, "interval_s": self.interval, "error": self.error}


def versions(torch_module=None) -> Dict[str, object]:
    """torch, its CUDA and NCCL, and the device(s) it sees."""
    torch = _torch(torch_module)
    out: Dict[str, object] = {"torch": torch.__version__,
                              "cuda": getattr(torch.version, "cuda", None),
                              "cuda_available": bool(torch.cuda.is_available())}
    try:
        nccl = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception as exc:  # a CPU build has no NCCL
        out["nccl"] = None
        out["nccl_why"] = f"{exc.__class__.__name__}: {exc}"[:200]
    if out["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        out.update(device_count=int(torch.cuda.device_count()), gpu=str(props.name),
                   gpu_memory_bytes=int(props.total_memory),
                   multiprocessors=int(props.multi_processor_count),
                   capability=f"{props.major}.{props.minor}")
    return out
