"""What a GPU holds for one training process above the bytes its tensors take: the terms between
`torch.cuda.max_memory_allocated` (what StageMemory.total predicts) and what nvidia-smi shows.

Each term is named with its source; two numbers are fitted, on the only device measurements the
project has -- the 60 nvidia-smi peaks of BigScience's BLOOM layout search on 80 GB A100s
(../shared/data/bloom-jean-zay/, `python benchmarks/memory_bloom.py`: cross-validated by model,
the fit and its signed errors; docs/memory.md) -- and bounded by the facts outside it. On a CPU
run there is no device and no term (the live-bytes tracker measures the allocated part exactly).

  allocator reserve  PyTorch's caching allocator keeps freed blocks for reuse and never returns
                     them during training, so nvidia-smi sees max_memory_reserved(), not
                     max_memory_allocated() (PyTorch docs, "CUDA semantics: memory management").
                     Blocks above 10 MiB come from segments rounded up to 2 MiB, those of
                     1-10 MiB from 20 MiB segments (c10/cuda/CUDACachingAllocator.cpp:
                     kMinLargeAlloc, kRoundLarge, kLargeBuffer): on average half a rounding
                     step (1 MiB) per tensor alive at the peak. A freed block is reused only by
                     a request no larger than it, so the largest transient of the backward (a
                     score- or MLP-sized gradient) leaves one block of its size that later,
                     larger requests cannot use. And the bytes an iteration makes and frees
                     (activations, recompute, logits, pipeline buffers, temporaries at the
                     peak: the churn) come back to the pool cut to sizes the next requests
                     only partly reuse: FITTED.reserve_fraction of them stay reserved and
                     unused (fitted; at most all of them).
  CUDA context       the driver's context and the kernels loaded into it: 287 MB for a bare
                     context with lazy module loading, 667 MB without (pytorch/pytorch#86509);
                     "around 400MB" with CUDA >= 11.7 (pytorch/pytorch#109888); a training step
                     also loads cuBLAS, NCCL and attention kernels: 512 MiB.
  cuBLAS workspaces  allocated by PyTorch's allocator outside any tensor: CUBLAS_WORKSPACE_CONFIG
                     defaults to ":4096:2:16:8" (2 x 4 MiB + 8 x 16 KiB) per handle and stream
                     (PyTorch docs, "Reproducibility"/torch.backends.cuda); two streams (compute,
                     and DeepSpeed's reduction stream).
  NCCL buffers       per communicator the rank uses (communicators() counts those NeoX and
                     DeepSpeed create): for each channel and each connection it receives on,
                     the FIFO buffers of the three protocols -- SIMPLE NCCL_BUFFSIZE 4 MiB,
                     LL128 4.7 MB, LL 0.5 MiB (NCCL docs, "Environment variables":
                     NCCL_BUFFSIZE; src/include/collectives.h DEFAULT_LL128_BUFFSIZE,
                     DEFAULT_LL_BUFFSIZE); memory is linear in channels (NVIDIA/nccl#864, #986).
                     The bytes per communicator are fitted (FITTED.nccl_per_communicator) and
                     bounded by the facts: at least 2 channels x 2 connections of the three
                     protocols, at most NCCL's 32 channels (MAXCHANNELS) x (ring 2 + tree 3)
                     connections of them.
The usable capacity is what CUDA reports as total memory: 42,298,834,944 of an A100-40GB's
40 GiB (98.5%, deviceQuery in bottlerocket-os/bottlerocket#3873); the rest is the driver's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

MIB = 2 ** 20
CUDA_CONTEXT = 512 * MIB
CUBLAS_WORKSPACE = 2 * (2 * 4096 * 1024 + 8 * 16 * 1024)
ROUNDING_PER_TENSOR = 1 * MIB  # half of the 2 MiB large-segment rounding step
NCCL_SIMPLE, NCCL_LL128, NCCL_LL = 4 * MIB, 120 * 640 * 8 * 8, 8 * 512 * 8 * 16
NCCL_CONNECTION = NCCL_SIMPLE + NCCL_LL128 + NCCL_LL  # one channel's receive side, 3 protocols
NCCL_BOUNDS = (2 * 2 * NCCL_CONNECTION, 32 * 5 * NCCL_CONNECTION)  # bytes per communicator
RESERVE_BOUND = 1.0  # of the churn: the pool cannot keep unused more than was freed into it
USABLE_FRACTION = 42_298_834_944 / (40 * 2 ** 30)

TERMS = ("allocator reserve", "CUDA context", "cuBLAS workspaces", "NCCL buffers")
# the allocated peak's components an iteration makes and frees (derive/memory.py COMPONENTS)
CHURN = ("activations", "recompute", "logits", "buffers", "temporaries")


@dataclass(frozen=True)
class DeviceFit:
    """The two fitted device numbers (benchmarks/memory_bloom.py fits and prints them)."""
    nccl_per_communicator: float  # bytes one NCCL communicator holds on a rank
    reserve_fraction: float  # of the iteration's churn, kept unused by the caching pool

    def bounded(self) -> "DeviceFit":
        """Held to what the facts allow, whatever a fit on one data set gave."""
        lo, hi = NCCL_BOUNDS
        return DeviceFit(min(max(self.nccl_per_communicator, lo), hi),
                         min(max(self.reserve_fraction, 0.0), RESERVE_BOUND))


# python benchmarks/memory_bloom.py (all 60 nvidia-smi peaks, GB read as GiB)
FITTED = DeviceFit(nccl_per_communicator=1_476_000_000, reserve_fraction=0.079).bounded()

SOURCES = {
    "allocator reserve": "PyTorch caching allocator: 1 MiB rounding per live tensor "
                         "(CUDACachingAllocator.cpp kRoundLarge) + the largest transient block + "
                         "a fitted share of the iteration's churn (benchmarks/memory_bloom.py, "
                         "BLOOM nvidia-smi peaks)",
    "CUDA context": "CUDA context and loaded kernels: 287 MB lazy / 667 MB eager "
                    "(pytorch/pytorch#86509); 512 MiB",
    "cuBLAS workspaces": "CUBLAS_WORKSPACE_CONFIG :4096:2:16:8 per handle, 2 streams "
                         "(PyTorch docs, Reproducibility)",
    "NCCL buffers": "NCCL_BUFFSIZE 4 MiB + LL128 + LL per channel per connection (NCCL docs) "
                    "x communicators NeoX/DeepSpeed create; bytes per communicator fitted "
                    "(benchmarks/memory_bloom.py, BLOOM nvidia-smi peaks), bounded by 2-32 channels",
}


def communicators(parallel, stage: int, num_stages: int, tied: bool) -> Dict[str, int]:
    """The NCCL communicators a rank of `stage` uses, by group (torch creates one per process
    group at its first collective, and one per peer pair at the first send/recv):
      world   the default group: NeoX's and DeepSpeed's barriers and world-wide reductions;
      data    the data-parallel gradient reduction (ZeRO / all-reduce);
      model   the tensor-parallel all-reduces and the batch broadcast (mpu.broadcast_data);
      slice   DeepSpeed's slice_parallel_group (PipelineParallelGrid): the same ranks as model,
              another process group -- PartitionedTensor all-gathers the pipe-partitioned
              activations and gradients on it (pipe/engine.py);
      pipe    the pipeline group: _aggregate_total_loss broadcasts the loss from the last stage
              (pipe/engine.py) every iteration;
      tied    the tied embedding's first/last-stage group (PipelineModule's tied_comms);
      p2p     a pair communicator for each neighbouring stage (pipe/p2p.py send/recv)."""
    dp, tp = parallel.data_parallel_size, max(parallel.model_parallel_size, 1)
    pipelined = parallel.pipe_parallel_size >= 1 and num_stages > 1
    out = {
        "world": int(parallel.world_size > 1),
        "data": int(1 < dp < parallel.world_size),
        "model": int(1 < tp < parallel.world_size),
        "slice": int(tp > 1 and pipelined),
        "pipe": int(pipelined),
        "tied": int(pipelined and tied and stage in (0, num_stages - 1)),
        "p2p": (int(stage > 0) + int(stage < num_stages - 1)) if pipelined else 0,
    }
    return out


def device_terms(*, largest_transient: float, live_tensors: int, churn: float, parallel,
                 stage: int, num_stages: int, tied: bool, device: str,
                 fit: DeviceFit = FITTED) -> Dict[str, int]:
    """Bytes per term above the allocated peak (empty on a CPU run: there is no device to hold
    them). `churn`: of the allocated peak, the bytes the iteration makes and frees (CHURN)."""
    if device != "cuda":
        return {}
    comms = sum(communicators(parallel, stage, num_stages, tied).values())
    return {
        "allocator reserve": int(live_tensors * ROUNDING_PER_TENSOR + largest_transient
                                 + fit.reserve_fraction * churn),
        "CUDA context": CUDA_CONTEXT,
        "cuBLAS workspaces": CUBLAS_WORKSPACE,
        "NCCL buffers": int(comms * fit.nccl_per_communicator),
    }


def usable(capacity: int) -> int:
    """Of a GPU's data-sheet capacity, what CUDA lets a process allocate."""
    return int(capacity * USABLE_FRACTION)
