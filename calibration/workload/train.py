"""Train the reference NeoX-shaped workload under the real DeepSpeed engine and time it.

    torchrun --nproc_per_node N -m neox_perf.calibration.workload.train \
        --config a.yml [b.yml ...] --iters 10 --vocab-size 50257 --out result.json
    deepspeed --num_gpus N --module neox_perf.calibration.workload.train ...   (same args)

pipe_parallel_size >= 1: GPT2ModelPipe + PipelineEngine.train_batch (1F1B);
pipe_parallel_size == 0: the sequential model + DeepSpeedEngine forward/backward/step per
micro-batch, as NeoX's train_step. Every rank times every iteration; rank 0 writes JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings

SCHEMA = "neox-perf.workload/1"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m neox_perf.calibration.workload.train",
                                description=__doc__.split("\n")[0])
    p.add_argument("--config", nargs="+", required=True, help="NeoX YAML files, merged in order")
    p.add_argument("--iters", type=int, default=10, help="optimizer steps to run and time")
    p.add_argument("--vocab-size", type=int, required=True,
                   help="tokenizer vocab; padded as NeoX does (make_vocab_size_divisible_by x mp)")
    p.add_argument("--out", required=True, help="result JSON, written by rank 0")
    p.add_argument("--seed", type=int, default=None, help="default: the config's seed (1234)")
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false",
                   help="allow nondeterministic kernels (GPU: faster SDPA backward)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help=argparse.SUPPRESS)  # appended by the deepspeed launcher
    return p.parse_args(argv)


def _setup_device():
    import torch
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))  # PipelineModule reads it
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    if "OMP_NUM_THREADS" not in os.environ:
        warnings.warn("OMP_NUM_THREADS is unset: every rank will use all cores and CPU "
                      "timings will be dominated by oversubscription; set it (e.g. 1)")
    return torch.device("cpu"), "gloo"


def _deterministic(device, on: bool):
    import torch
    if not on:
        return
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    # warn_only: a kernel without a deterministic variant (flash SDPA backward) still runs.
    torch.use_deterministic_algorithms(True, warn_only=True)


def _load_config(files, world):
    from neox_perf.config import WorldRequest, build, load_files
    cfg, verdicts, _warnings = build(load_files(list(files)), WorldRequest(gpus=world))
    errors = [v for v in verdicts if v.level == "error"]
    if errors:
        raise SystemExit("config error: " + "; ".join(v.line() for v in errors))
    return cfg


def _check_layout(cfg):
    pp, mp, zero = cfg.parallel.pipe_parallel_size, cfg.parallel.model_parallel_size, \
        cfg.training.zero_stage
    if zero >= 2 and (pp >= 1 or mp > 1):
        raise SystemExit(f"ZeRO stage {zero} needs pipe_parallel_size 0 and model_parallel_size 1 "
                         "(NeoX refuses it otherwise)")


def _iteration_pipe(engine, data, it, gas):
    return float(engine.train_batch(data_iter=data.iterator(it, gas)))


def _iteration_sequential(engine, data, it, gas, loss_fn):
    import torch
    import torch.distributed as dist
    losses = []
    for i in range(gas):
        inputs, labels = data.micro_batch(it, i)
        loss = loss_fn(engine(inputs), labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    # NeoX's reduce_losses: mean over the whole world, inside the timed step.
    reduced = torch.stack(losses)
    dist.all_reduce(reduced)
    return float((reduced / dist.get_world_size()).mean())


def run(args) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist

    from . import dims, layout
    from .data import SyntheticTokens
    from .ds_config import build_ds_config, run_precision
    from .model import GPT2ModelPipe, SequentialModel, cross_entropy
    from .tensor_parallel import parallel_groups

    device, backend = _setup_device()
    deepspeed.init_distributed(dist_backend=backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    _deterministic(device, args.deterministic)

    cfg = _load_config(args.config, world)
    _check_layout(cfg)
    wc = dims.from_neox(cfg, args.vocab_size)
    if args.seed is not None:
        wc = dataclasses.replace(wc, seed=args.seed)
    pp, mp = cfg.parallel.pipe_parallel_size, wc.mp
    num_pp = max(pp, 1)
    if world % (num_pp * mp):
        raise SystemExit(f"world size {world} is not divisible by pp {num_pp} x mp {mp}")
    dp = world // (num_pp * mp)

    topo, grid, mpu = parallel_groups(num_pp, mp, dp, wc.fp32_allreduce, str(device))
    t = cfg.training
    ckpt_interval = t.checkpoint_num_layers if t.checkpoint_activations else 0
    n_ckpt = -(-wc.num_layers // t.checkpoint_num_layers)
    deepspeed.checkpointing.configure(mpu, partition_activations=t.partition_activations,
                                      num_checkpoints=n_ckpt)
    stage = grid.get_stage_id()
    # NeoX offsets the seed of middle pipeline stages; it only drives dropout here.
    torch.manual_seed(wc.seed + (1138 + stage * mp if 0 < stage < num_pp - 1 else 0))

    t0 = time.perf_counter()
    if pp >= 1:
        model = GPT2ModelPipe(wc, topo, cfg.parallel.pipe_partition_method, ckpt_interval)
    else:
        model = SequentialModel(wc, ckpt_interval).to(device)
    build_seconds = time.perf_counter() - t0
    ds_config, notes = build_ds_config(cfg, device.type)
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config, mpu=None if pp >= 1 else mpu)
    init_seconds = time.perf_counter() - t0

    data = SyntheticTokens(wc.seed, args.vocab_size, wc.seq_length, t.micro_batch_size,
                           grid.get_data_parallel_rank(), device)
    gas = t.gradient_accumulation_steps
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds, losses = [], []
    for it in range(args.iters):
        sync()
        start = time.perf_counter()
        if pp >= 1:
            loss = _iteration_pipe(engine, data, it, gas)
        else:
            loss = _iteration_sequential(engine, data, it, gas, cross_entropy)
        sync()
        seconds.append(time.perf_counter() - start)
        losses.append(loss)

    me = layout.rank_record(engine, grid, pp, seconds)
    everyone = [None] * world
    dist.all_gather_object(everyone, me)
    result = None
    if rank == 0:
        notes += _device_notes(cfg, wc, device)
        result = layout.result(args, cfg, wc, engine, everyone, losses, init_seconds, ds_config,
                               notes, run_precision(cfg, device.type), device, dp)
        result.update(schema=SCHEMA, build_seconds=build_seconds)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    dist.barrier()
    return result


def _device_notes(cfg, wc, device):
    notes = []
    if cfg.model.fused_softmax and device.type == "cuda" and cfg.training.precision != "fp32":
        notes.append("scaled_upper_triang_masked_softmax_fusion: ran the unfused softmax "
                     "(NeoX's fused kernel is not available here)")
    if "flash" in wc.attention_types:
        notes.append("flash attention layers ran torch scaled_dot_product_attention"
                     "(is_causal=True)")
    return notes


def main(argv=None):
    args = parse_args(argv)
    import torch.distributed as dist
    from neox_perf.errors import NeoxPerfError

    from .dims import UnsupportedConfig
    code = 0
    try:
        run(args)
    except (NeoxPerfError, UnsupportedConfig) as exc:
        # Every rank hits the same error; a message beats N identical tracebacks.
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    from ..launch import exit_rank
    exit_rank(main())
