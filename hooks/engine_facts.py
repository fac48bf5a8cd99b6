"""What the DeepSpeed engine itself says about the run: layout, batch, parameters, dtype.

This is all a plain DeepSpeed script gives us; every fact is read defensively (engines
differ across DeepSpeed versions and forks) and a fact that cannot be read is None plus a
line in `missing`, so the report can say what it could not know.
"""
from __future__ import annotations

import os
import platform
from typing import Any, Dict, List

from neox_perf.calibration.engine_state import base_optimizer  # noqa: F401 (re-exported)


def _try(missing: List[str], what: str, fn, default=None):
    try:
        return fn()
    except Exception as exc:
        missing.append(f"{what}: {exc.__class__.__name__}")
        return default


def is_pipeline(engine) -> bool:
    try:
        from deepspeed.runtime.pipe.engine import PipelineEngine
        return isinstance(engine, PipelineEngine)
    except Exception:
        return hasattr(engine, "train_batch") and hasattr(engine, "num_stages")


def _optimizer_params(engine) -> int:
    opt = base_optimizer(engine)
    return int(sum(p.numel() for g in opt.param_groups for p in g["params"]))


def _dtype(engine) -> str:
    if engine.fp16_enabled():
        return "fp16"
    if engine.bfloat16_enabled():
        return "bf16"
    return "fp32"


def stage_label(stage: int, stages: int) -> str:
    if stages <= 1:
        return "only"
    return "first" if stage == 0 else "last" if stage == stages - 1 else "middle"


def facts(engine) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    missing: List[str] = []
    pipe = is_pipeline(engine)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    device = _try(missing, "device", lambda: str(engine.device), "cpu")
    out: Dict[str, Any] = {
        "engine": type(engine).__name__,
        "pipeline": pipe,
        "rank": rank,
        "world_size": world,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "0")) or 0) or None,
        "host": platform.node(),
        "device": device,
        "device_type": "cuda" if str(device).startswith("cuda") else str(device).split(":")[0],
        "dtype": _try(missing, "dtype", lambda: _dtype(engine), "fp32"),
        "zero_stage": _try(missing, "ZeRO stage", lambda: int(engine.zero_optimization_stage())),
        "micro_batch_size": _try(missing, "micro batch size",
                                 lambda: int(engine.train_micro_batch_size_per_gpu())),
        "gradient_accumulation_steps": _try(missing, "gradient accumulation steps",
                                            lambda: int(engine.gradient_accumulation_steps())),
        "train_batch_size": _try(missing, "train batch size", lambda: int(engine.train_batch_size())),
        "dp": _try(missing, "data-parallel size", lambda: int(engine.dp_world_size)),
        "mp": _try(missing, "model-parallel size", lambda: int(getattr(engine, "mp_world_size", 1) or 1)),
        "params": _try(missing, "parameters", lambda: int(sum(
            getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters() if p.requires_grad))),
        "optimizer": _try(missing, "optimizer", lambda: type(base_optimizer(engine)).__name__),
        "optimizer_params": _try(missing, "optimizer parameters", lambda: _optimizer_params(engine)),
        "torch_threads": torch.get_num_threads(),
    }
    if pipe:
        out["stages"] = _try(missing, "stages", lambda: int(engine.num_stages), 1)
        out["stage"] = _try(missing, "stage", lambda: int(engine.stage_id), 0)
        out["micro_batches"] = _try(missing, "micro-batches", lambda: int(engine.micro_batches))
        out["parts"] = _try(missing, "partition", lambda: [int(x) for x in engine.module.parts])
        out["layer_names"] = _try(missing, "layer names", lambda: [_spec_name(s) for s in
                                                                   engine.module._layer_specs])
        grid = getattr(engine, "grid", None)
        if grid is not None:
            out["mp"] = _try(missing, "model-parallel size",
                             lambda: int(grid.get_slice_parallel_world_size()), out["mp"])
    else:
        out["stages"], out["stage"] = 1, 0
        out["micro_batches"] = out["gradient_accumulation_steps"]
        out["parts"] = None
        out["layer_names"] = None
    out["stage_label"] = stage_label(out["stage"] or 0, out["stages"] or 1)
    out.update(tf32(out["device_type"], missing))  # what `report` prices an fp32 run's matmuls as
    out.update(cpu_allocator(out["device_type"]))
    out["missing"] = missing
    return out


def tf32(device_type: str, missing: List[str]) -> Dict[str, Any]:
    """{"tf32": whether this rank's fp32 matmuls run as TF32 (None: not on CUDA), "tf32_flags":
    what was read (torch.backends.cuda.matmul.allow_tf32, TORCH_ALLOW_TF32_CUBLAS_OVERRIDE, ...)}."""
    from neox_perf.calibration.fingerprint import tf32_state

    def read():
        import torch
        cap = torch.cuda.get_device_capability() if device_type == "cuda" else None
        return tf32_state(device_type, cap)
    return _try(missing, "TF32 flags", read, {"tf32": None, "tf32_flags": "not read"})


def cpu_allocator(device_type: str) -> Dict[str, Any]:
    """{"cpu_allocator": "caching" | "glibc default" | None (not a CPU run), "cpu_allocator_env":
    the glibc variables read}. A CPU rank under glibc's defaults gets fresh pages for every
    tensor over the mmap threshold (at most 32 MiB) and pays their page faults each time; a
    calibration recycles them, as a GPU's caching allocator does (calibration.launch.
    CACHING_MALLOC_ENV), so `report` says when a CPU run did not."""
    if device_type != "cpu":
        return {"cpu_allocator": None}
    from neox_perf.calibration.launch import CACHING_MALLOC_ENV
    env = {k: os.environ.get(k) for k in CACHING_MALLOC_ENV}
    caching = all(v is not None and v.isdigit() and int(v) >= int(CACHING_MALLOC_ENV[k])
                  for k, v in env.items())
    return {"cpu_allocator": "caching" if caching else "glibc default", "cpu_allocator_env": env}


def _spec_name(spec) -> str:
    typename = getattr(spec, "typename", None)
    if typename is not None:
        return getattr(typename, "__name__", str(typename))
    return getattr(spec, "__name__", type(spec).__name__)
