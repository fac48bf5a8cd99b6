"""Megatron-style tensor parallelism: the same collectives, at the same points, as NeoX's mpu.

Column-parallel linear: identity forward / all-reduce backward on its input, weight split
on the output dim. Row-parallel linear: all-reduce forward on its output (unless the caller
defers it, as gpt_j_residual does), weight split on the input dim, bias replicated and added
after the reduction. Vocab-parallel embedding and cross-entropy split the vocabulary.

The TP group lives in a module-level state because DeepSpeed's LayerSpec builds modules
later, inside PipelineModule, with only the arguments we stored; the default state (size 1,
no group) lets every module build and run without torch.distributed.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TPState:
    rank: int = 0
    world_size: int = 1
    group: Any = None
    fp32_allreduce: bool = False
    init_device: str = "cpu"  # weights are created and initialised here (the GPU on clusters)


_STATE = TPState()


def set_tp_state(state: TPState) -> None:
    global _STATE
    _STATE = state


def tp() -> TPState:
    return _STATE


def parallel_groups(num_pp: int, mp: int, dp: int, fp32_allreduce: bool, init_device: str,
                    built: Optional[dict] = None):
    """(topology, grid, mpu) of a pp x mp x dp layout as DeepSpeed builds them, with this
    rank's tensor-parallel state set from the grid (the reference workload and the engine
    calibration's tensor-parallel pass both start here).

    ``built``: a dict the caller keeps for as long as its process group lives, in which a
    layout's grid is made once and found again. DeepSpeed's grid makes its groups with
    new_group, and a gloo group's threads live until the process group ends: the engine
    calibration's tensor-parallel pass, one engine per shape and sweep, made 20 grids and ran
    its last shapes beside 244 threads per rank that burned 11% of a core each while idle
    (0.8% with the grid kept; `python benchmarks/group_threads.py`), on a machine with a core
    per rank. A training run makes its groups once."""
    key = (num_pp, mp, dp)
    if built is not None and key in built:
        topo, grid = built[key]
    else:
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid
        topo = PipeModelDataParallelTopology(num_pp=num_pp, num_mp=mp, num_dp=dp)
        grid = PipelineParallelGrid(topology=topo)
        if built is not None:
            built[key] = (topo, grid)
    set_tp_state(TPState(rank=grid.get_slice_parallel_rank(), world_size=mp,
                         group=grid.get_slice_parallel_group(), fp32_allreduce=fp32_allreduce,
                         init_device=init_device))
    return topo, grid, ModelParallelUnit(grid)


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    st = _STATE
    if st.world_size == 1:
        return x
    if st.fp32_allreduce and x.dtype != torch.float32:
        y = x.float()
        dist.all_reduce(y, group=st.group)
        return y.to(x.dtype)
    dist.all_reduce(x, group=st.group)  # in place, as NeoX's _reduce
    return x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g.contiguous())


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x)

    @staticmethod
    def backward(ctx, g):
        return g


def copy_to_tp(x: torch.Tensor) -> torch.Tensor:
    return x if _STATE.world_size == 1 else _CopyToTP.apply(x)


def reduce_from_tp(x: torch.Tensor) -> torch.Tensor:
    return x if _STATE.world_size == 1 else _ReduceFromTP.apply(x)


def divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by model_parallel_size {d}")
    return n // d


# Initialisation: each full ("master") weight is drawn from a generator seeded by the run
# seed and the parameter's global name, then split. So the model's initial function does
# not depend on pp, mp or the stage boundaries, and mp=2 can be checked against mp=1.
def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return g


def init_normal_(param: torch.Tensor, full_shape, std: float, seed: int, name: str,
                 split_dim: Optional[int] = None) -> None:
    device = param.device
    master = torch.empty(full_shape, dtype=torch.float32, device=device)
    master.normal_(0.0, std, generator=_generator(seed, name, device))
    if split_dim is not None and _STATE.world_size > 1:
        master = master.chunk(_STATE.world_size, dim=split_dim)[_STATE.rank]
    with torch.no_grad():
        param.copy_(master)


def _mark_split(p: nn.Parameter, dim: int) -> None:
    # DeepSpeed's grad-norm and checkpointing read these to skip double counting.
    p.model_parallel = True
    p.tensor_model_parallel = True
    p.partition_dim = dim
    p.partition_stride = 1


class ColumnParallelLinear(nn.Module):
    """y_i = x A_i (+ b_i); returns (output, bias) like NeoX with skip_bias_add."""

    def __init__(self, in_features: int, out_features: int, bias: bool, std: float,
                 seed: int, name: str, skip_bias_add: bool = True):
        super().__init__()
        self.out_full = out_features
        self.skip_bias_add = skip_bias_add
        out_local = divide(out_features, _STATE.world_size)
        self.weight = nn.Parameter(torch.empty(out_local, in_features, device=_STATE.init_device))
        init_normal_(self.weight, (out_features, in_features), std, seed, name + ".weight", 0)
        _mark_split(self.weight, 0)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_local, device=_STATE.init_device))
            _mark_split(self.bias, 0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        x = copy_to_tp(x)
        if self.skip_bias_add:
            return F.linear(x, self.weight), self.bias
        return F.linear(x, self.weight, self.bias), None


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_i A_i) then + b (b replicated); parallel_output defers the reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, std: float,
                 seed: int, name: str, parallel_output: bool = False):
        super().__init__()
        self.parallel_output = parallel_output
        in_local = divide(in_features, _STATE.world_size)
        self.weight = nn.Parameter(torch.empty(out_features, in_local, device=_STATE.init_device))
        init_normal_(self.weight, (out_features, in_features), std, seed, name + ".weight", 1)
        _mark_split(self.weight, 1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=_STATE.init_device))
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        out = F.linear(x, self.weight)
        if not self.parallel_output:
            out = reduce_from_tp(out)
        return out, self.bias  # bias added by the caller, after the reduction


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, std: float, seed: int, name: str):
        super().__init__()
        local = divide(vocab, _STATE.world_size)
        self.start = _STATE.rank * local
        self.end = self.start + local
        self.weight = nn.Parameter(torch.empty(local, hidden, device=_STATE.init_device))
        init_normal_(self.weight, (vocab, hidden), std, seed, name + ".weight", 0)
        _mark_split(self.weight, 0)

    def forward(self, ids):
        if _STATE.world_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local_ids = ids.clone() - self.start
        local_ids[outside] = 0
        out = F.embedding(local_ids, self.weight)
        out[outside, :] = 0.0
        return reduce_from_tp(out)


class _VocabParallelCE(torch.autograd.Function):
    """Softmax cross-entropy over logits split on the vocab dim: three TP all-reduces
    (max, target logit, sum of exp), computed in place like Megatron's."""

    @staticmethod
    def forward(ctx, logits, target):
        st = _STATE
        group = st.group

        def reduce(t, op=dist.ReduceOp.SUM):
            if st.world_size > 1:
                dist.all_reduce(t, op=op, group=group)

        logits_max = torch.max(logits, dim=-1)[0]
        reduce(logits_max, dist.ReduceOp.MAX)
        logits.sub_(logits_max.unsqueeze(-1))
        part = logits.size(-1)
        start = st.rank * part
        mask = (target < start) | (target >= start + part)
        masked = target.clone() - start
        masked[mask] = 0
        logits_2d = logits.view(-1, part)
        masked_1d = masked.view(-1)
        rows = torch.arange(logits_2d.size(0), device=logits.device)
        predicted = logits_2d[rows, masked_1d].clone().contiguous().view_as(target)
        predicted[mask] = 0.0
        reduce(predicted)
        exp = logits
        torch.exp(logits, out=exp)
        sum_exp = exp.sum(dim=-1)
        reduce(sum_exp)
        loss = torch.log(sum_exp) - predicted
        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp, mask, masked_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        softmax, mask, masked_1d = ctx.saved_tensors
        grad = softmax
        part = softmax.size(-1)
        grad_2d = grad.view(-1, part)
        rows = torch.arange(grad_2d.size(0), device=grad.device)
        grad_2d[rows, masked_1d] -= 1.0 - mask.view(-1).float()
        grad.mul_(grad_out.unsqueeze(-1))
        return grad, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return _VocabParallelCE.apply(logits, target)


class ModelParallelUnit:
    """The mpu DeepSpeed expects (engine with pp=0, activation checkpointing): "model
    parallel" here means tensor parallel, as in NeoX's mpu; the PipelineParallelGrid's own
    get_model_parallel_* means pipe x model instead, so it cannot be passed as is."""

    def __init__(self, grid):
        self.grid = grid

    def get_model_parallel_rank(self):
        return self.grid.get_slice_parallel_rank()

    def get_model_parallel_world_size(self):
        return self.grid.get_slice_parallel_world_size()

    def get_model_parallel_group(self):
        return self.grid.get_slice_parallel_group()

    def get_data_parallel_rank(self):
        return self.grid.get_data_parallel_rank()

    def get_data_parallel_world_size(self):
        return self.grid.get_data_parallel_world_size()

    def get_data_parallel_group(self):
        return self.grid.get_data_parallel_group()

    def get_data_parallel_group_ranks(self):
        return self.grid.get_data_parallel_group_ranks()

    def get_pipe_parallel_rank(self):
        return self.grid.get_pipe_parallel_rank()

    def get_pipe_parallel_world_size(self):
        return self.grid.get_pipe_parallel_world_size()

    def get_pipe_parallel_group(self):
        return self.grid.get_pipe_parallel_group()
