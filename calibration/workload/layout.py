"""What the run looked like: per-rank records, gathered to rank 0, and the result dict.

Result keys (schema "neox-perf.workload/1"): seconds_per_iter[i] is the slowest rank's wall
time of optimizer step i (every step is kept, the first includes warm-up); ranks[r].seconds
are each rank's own. layout.parts is PipelineModule.parts as the engine partitioned it
([0, N+5] for pp=0); layout.stages[s].params_per_mp_rank are what the dp-rank-0 processes of
stage s hold (DeepSpeed's STAGE_PARAMS, tied embedding copy included).
"""
from __future__ import annotations

import os
import platform

import torch
import torch.distributed as dist

from . import dims
from .model import count_params


def rank_record(engine, grid, pp: int, seconds) -> dict:
    module = engine.module
    if pp >= 1:
        bounds = [module._local_start, module._local_stop]
    else:
        bounds = [0, len(module.sequential)]
    return {"rank": dist.get_rank(), "host": platform.node(), "stage": grid.get_stage_id(),
            "mp_rank": grid.get_slice_parallel_rank(), "dp_rank": grid.get_data_parallel_rank(),
            "layers": [int(b) for b in bounds], "params": count_params(module),
            "seconds": list(seconds)}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device) -> dict:
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device),
                "count_per_node": torch.cuda.device_count()}
    return {"type": "cpu", "name": _cpu_name(), "count_per_node": os.cpu_count()}


def stages(parts, names, records) -> list:
    out = []
    for s in range(len(parts) - 1):
        mine = sorted((r for r in records if r["stage"] == s and r["dp_rank"] == 0),
                      key=lambda r: r["mp_rank"])
        spec_names = names[parts[s]:parts[s + 1]]
        out.append({"stage": s, "layers": [parts[s], parts[s + 1]], "names": spec_names,
                    "transformer_layers": spec_names.count("ParallelTransformerLayerPipe"),
                    "params_per_mp_rank": [r["params"] for r in mine],
                    "params": sum(r["params"] for r in mine)})
    return out


def result(args, cfg, wc, engine, records, losses, init_seconds, ds_config, notes, precision,
           device, dp) -> dict:
    import deepspeed
    records = sorted(records, key=lambda r: r["rank"])
    pp = cfg.parallel.pipe_parallel_size
    names = dims.spec_names(wc)
    parts = [int(p) for p in engine.module.parts] if pp >= 1 else [0, len(names)]
    t = cfg.training
    per_iter = [max(r["seconds"][i] for r in records) for i in range(len(losses))]
    return {
        "config_files": [os.path.abspath(f) for f in cfg.files],
        "iters": len(losses),
        "seconds_per_iter": per_iter,
        "losses": losses,
        "init_seconds": init_seconds,
        "layout": {
            "world_size": len(records), "pipe_parallel_size": pp, "num_stages": max(pp, 1),
            "model_parallel_size": wc.mp, "data_parallel_size": dp,
            "engine": type(engine).__name__,
            "optimizer": type(engine.optimizer).__name__,
            "partition_method": cfg.parallel.pipe_partition_method if pp >= 1 else None,
            "parts": parts, "stages": stages(parts, names, records),
        },
        "ranks": records,
        "model": {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in wc.__dict__.items()},
                  "vocab_size": args.vocab_size, "padded_vocab": wc.vocab,
                  "total_params": dims.total_params(wc), "spec_params": dims.spec_params(wc)},
        "training": {"micro_batch_size": t.micro_batch_size,
                     "gradient_accumulation_steps": t.gradient_accumulation_steps,
                     "train_batch_size": t.train_batch_size, "zero_stage": t.zero_stage,
                     "precision_config": t.precision, "precision_run": precision,
                     "checkpoint_activations": t.checkpoint_activations,
                     "checkpoint_num_layers": t.checkpoint_num_layers,
                     "partition_activations": t.partition_activations,
                     "tokens_per_iter": t.train_batch_size * wc.seq_length},
        "device": device_info(device),
        "threads": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                    "torch_num_threads": torch.get_num_threads()},
        "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                     "python": platform.python_version()},
        "seed": wc.seed,
        "deterministic": bool(args.deterministic),
        "deepspeed_config": ds_config,
        "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
        "notes": notes,
    }
