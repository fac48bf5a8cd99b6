"""What a GPU holds for one training process above the bytes its tensors take: the terms between
`torch.cuda.max_memory_allocated` (what StageMemory.total predicts) and what nvidia-smi shows.

Each term is named with its source. None of them can be measured on this machine (no GPU); the
live-bytes tracker measures only the allocated part, exactly. The verdict compares their sum
with the capacity CUDA reports, not the data sheet's.

  allocator reserve  PyTorch's caching allocator keeps freed blocks for reuse and never returns
                     them during training, so nvidia-smi sees max_memory_reserved(), not
                     max_memory_allocated() (PyTorch docs, "CUDA semantics: memory management").
                     Blocks above 10 MiB come from segments rounded up to 2 MiB, those of
                     1-10 MiB from 20 MiB segments (c10/cuda/CUDACachingAllocator.cpp:
                     kMinLargeAlloc, kRoundLarge, kLargeBuffer): on average half a rounding
                     step (1 MiB) per tensor alive at the peak. And a freed block is reused
                     only by a request no larger than it, so the largest transient of the
                     backward (a score- or MLP-sized gradient) leaves one block of its size that
                     later, larger requests cannot use.
  CUDA context       the driver's context and the kernels loaded into it: 287 MB for a bare
                     context with lazy module loading, 667 MB without (pytorch/pytorch#86509);
                     "around 400MB" with CUDA >= 11.7 (pytorch/pytorch#109888); a training step
                     also loads cuBLAS, NCCL and attention kernels: 512 MiB.
  cuBLAS workspaces  allocated by PyTorch's allocator outside any tensor: CUBLAS_WORKSPACE_CONFIG
                     defaults to ":4096:2:16:8" (2 x 4 MiB + 8 x 16 KiB) per handle and stream
                     (PyTorch docs, "Reproducibility"/torch.backends.cuda); two streams (compute,
                     and DeepSpeed's reduction stream).
  NCCL buffers       per communicator a rank communicates through: for each channel and each
                     connection it receives on, the FIFO buffers of the three protocols --
                     SIMPLE NCCL_BUFFSIZE 4 MiB, LL128 4.7 MB, LL 0.5 MiB (NCCL docs,
                     "Environment variables": NCCL_BUFFSIZE; src/include/collectives.h
                     DEFAULT_LL128_BUFFSIZE, DEFAULT_LL_BUFFSIZE); memory is linear in channels
                     and a ring keeps 2 connections whatever the scale (NVIDIA/nccl#864, #986).
                     Collective communicators: 16 channels, ring + tree receive connections (2);
                     point-to-point (pipeline send/recv): 8 channels x SIMPLE 4 MiB each way.
The usable capacity is what CUDA reports as total memory: 42,298,834,944 of an A100-40GB's
40 GiB (98.5%, deviceQuery in bottlerocket-os/bottlerocket#3873); the rest is the driver's.
"""
from __future__ import annotations

from typing import Dict

MIB = 2 ** 20
CUDA_CONTEXT = 512 * MIB
CUBLAS_WORKSPACE = 2 * (2 * 4096 * 1024 + 8 * 16 * 1024)
ROUNDING_PER_TENSOR = 1 * MIB  # half of the 2 MiB large-segment rounding step
NCCL_SIMPLE, NCCL_LL128, NCCL_LL = 4 * MIB, 120 * 640 * 8 * 8, 8 * 512 * 8 * 16
NCCL_CHANNELS, NCCL_CONNECTIONS = 16, 2
NCCL_COLLECTIVE = NCCL_CHANNELS * NCCL_CONNECTIONS * (NCCL_SIMPLE + NCCL_LL128 + NCCL_LL)
NCCL_P2P = 8 * 2 * NCCL_SIMPLE
USABLE_FRACTION = 42_298_834_944 / (40 * 2 ** 30)

TERMS = ("allocator reserve", "CUDA context", "cuBLAS workspaces", "NCCL buffers")


def communicators(parallel, stage: int, num_stages: int, tied: bool) -> Dict[str, int]:
    """The NCCL communicators a rank of `stage` uses (torch creates them at first use): the
    data-parallel all-reduce, the tensor-parallel all-reduces, NeoX's world-wide loss and
    barrier, the tied embedding's first/last-stage group, and pipeline send/recv per peer."""
    dp, tp = parallel.data_parallel_size, max(parallel.model_parallel_size, 1)
    pipelined = parallel.pipe_parallel_size >= 1 and num_stages > 1
    collective = 1 if parallel.world_size > 1 else 0  # the default (world) group
    collective += int(dp > 1 and dp < parallel.world_size) + int(tp > 1)
    if pipelined and tied and stage in (0, num_stages - 1):
        collective += 1
    p2p = (int(stage > 0) + int(stage < num_stages - 1)) if pipelined else 0
    return {"collective": collective, "p2p": p2p}


def device_terms(*, largest_transient: float, live_tensors: int, parallel,
                 stage: int, num_stages: int, tied: bool, device: str) -> Dict[str, int]:
    """Bytes per term above the allocated peak (empty on a CPU run: there is no device to hold
    them)."""
    if device != "cuda":
        return {}
    comms = communicators(parallel, stage, num_stages, tied)
    return {
        "allocator reserve": int(live_tensors * ROUNDING_PER_TENSOR + largest_transient),
        "CUDA context": CUDA_CONTEXT,
        "cuBLAS workspaces": CUBLAS_WORKSPACE,
        "NCCL buffers": comms["collective"] * NCCL_COLLECTIVE + comms["p2p"] * NCCL_P2P,
    }


def usable(capacity: int) -> int:
    """Of a GPU's data-sheet capacity, what CUDA lets a process allocate."""
    return int(capacity * USABLE_FRACTION)
