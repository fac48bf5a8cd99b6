"""What makes two calibrations comparable: the device and the software that drives it.

The fingerprint holds only what changes operator timings (device model, library versions,
thread count); no hostname, no time, so every node of a homogeneous cluster -- and a re-run
on the same machine -- maps to the same device id and resumes the same samples.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from importlib import metadata
from typing import Any, Dict, Mapping, Optional


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def fingerprint(device: str = "cpu") -> Dict[str, Any]:
    """The fingerprint of ``device`` ("cpu", "cuda", "cuda:1") as a flat JSON-able dict.

    Call it after fixing the thread count (run.pinned_threads): CPU timings scale with it.
    """
    import torch

    dev = torch.device(device)
    fp: Dict[str, Any] = {
        "kind": dev.type,
        "machine": platform.machine(),
        "torch": torch.__version__,
        # Read from the installed metadata: importing deepspeed costs seconds and logs.
        "deepspeed": _version("deepspeed"),
    }
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        fp.update(device_name=props.name,
                  capability=f"{props.major}.{props.minor}",
                  memory_bytes=int(props.total_memory),
                  cuda=torch.version.cuda,
                  nccl=".".join(map(str, torch.cuda.nccl.version())) if _has_nccl() else None,
                  # fp32 matmuls as TF32 run several times faster: a timing fact of the device
                  tf32=tf32_state("cuda", (props.major, props.minor))["tf32"])
    else:
        # On a GPU the host threads only launch kernels; there they would just split one
        # device into several ids (torchrun sets OMP_NUM_THREADS=1, a plain shell does not).
        fp.update(device_name=cpu_model(), cpu_count=os.cpu_count(),
                  torch_threads=torch.get_num_threads(),
                  omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
    return fp


def tf32_state(kind: str, capability=None) -> Dict[str, Any]:
    """Whether fp32 matmuls run as TF32 in this process: {"tf32": True | False | None, "tf32_flags":
    what it was read from}. None on a CPU (no TF32 there). On CUDA, calibration/cuda_facts.
    tf32_state decides (allow_tf32, fp32_precision, torch.set_float32_matmul_precision,
    TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 -- pytorch/pytorch PR #77114, set by NVIDIA's PyTorch
    containers --, NVIDIA_TF32_OVERRIDE=0, and a GPU of capability 8.0 or later)."""
    if kind != "cuda":
        return {"tf32": None, "tf32_flags": f"TF32 does not apply on {kind}"}
    from .cuda_facts import tf32_state as read
    flags = read(capability=capability)
    return {"tf32": flags["fp32_matmuls_as_tf32"], "tf32_flags": flags}


def _has_nccl() -> bool:
    try:
        import torch.cuda.nccl as nccl
        nccl.version()
        return True
    except Exception:  # a CUDA build without NCCL (Windows, ROCm variants)
        return False


def fingerprint_id(fp: Mapping[str, Any]) -> str:
    """A short stable id: the same dict (whatever its key order) gives the same id."""
    text = json.dumps(dict(fp), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
