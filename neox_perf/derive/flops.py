"""Floating-point operations per iteration, counted per matmul from NeoX's real shapes.

A matmul of [m, k] x [k, n] is 2mkn FLOPs. Element-wise ops, norms, softmax and the embedding
lookup are left out (bandwidth-bound and small), which is the usual "model FLOPs" convention.
Backward is twice the forward (input and weight gradients). Attention scores use the full s x s
product (NeoX's baddbmm computes every score and masks afterwards; the same convention is used
for flash attention so MFU stays comparable), or the window with flash + sliding_window_width.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import AbstractSet, Optional, Sequence

from ..config.specs import ModelSpec, TrainingSpec
from .layers import GMLP, MAMBA, RWKV, TRANSFORMER
from .options import DEFAULT_OPTIONS, DeriveOptions
from .params import (MAMBA_D_CONV, MAMBA_D_STATE, RWKV_TIME_DECAY_EXTRA_DIM,
                     RWKV_TIME_MIX_EXTRA_DIM, mamba_inner, moe_expert_width, mlp_widths, qkv_width,
                     rwkv_widths)


@dataclass(frozen=True)
class FlopsEstimate:
    forward_per_token: int  # all layers + head, one token, forward only
    attention_linear_per_token: int  # QKV + output projection, all layers
    attention_scores_per_token: int  # QK^T and probs x V, all layers
    mlp_per_token: int  # MLP / MoE experts + router, or the block's own projections
    head_per_token: int
    model_per_iteration: int  # 3 x forward x tokens (fwd + bwd), basis of MFU
    hardware_per_iteration: int  # + forward of every recomputed (checkpointed) layer, basis of HFU
    neox_hfu_per_iteration: float  # megatron/logging.py get_actual_flops x iter_time x world
    neox_mfu_per_iteration: float  # get_forward_backward_flops x iter_time x world
    model_total: Optional[int]  # model_per_iteration x train_iters


def _attention_span(model: ModelSpec, layer, opts: DeriveOptions) -> int:
    s = model.seq_length
    if layer.attention_type == "flash" and opts.sliding_window_width:
        return min(s, opts.sliding_window_width)
    return s


def block_forward(model: ModelSpec, layer, opts: DeriveOptions = DEFAULT_OPTIONS):
    """(attention_linear, attention_scores, mlp) forward FLOPs of one block for one token."""
    h, s = model.hidden_size, model.seq_length
    if layer.name == TRANSFORMER:
        lin = 2 * h * qkv_width(model) + 2 * h * h
        # Scores and probs x V run over all query heads (GQA repeats K/V or flash broadcasts).
        scores = 2 * 2 * _attention_span(model, layer, opts) * h
        if layer.moe:
            mlp = 2 * h * model.moe_num_experts + opts.moe_top_k * 2 * 2 * h * moe_expert_width(model)
        else:
            out, inp = mlp_widths(model)
            mlp = 2 * h * out + 2 * inp * h
        return lin, scores, mlp
    if layer.name == GMLP:
        ff = 4 * h
        mlp = 2 * h * 2 * ff + 2 * s * ff + 2 * ff * h  # input_linear, causal s x s mixing, output
        if layer.attention_type == "amlp":
            d = opts.gmlp_attn_dim
            mlp += 2 * 2 * ff * 3 * d + 2 * 2 * s * d + 2 * d * ff
        return 0, 0, mlp
    if layer.name == MAMBA:
        di = mamba_inner(model)
        dt_rank = math.ceil(h / 16)
        mlp = (2 * h * 2 * di + 2 * di * (dt_rank + 2 * MAMBA_D_STATE) + 2 * dt_rank * di
               + 2 * di * MAMBA_D_CONV + 9 * di * MAMBA_D_STATE + 2 * di * h)
        return 0, 0, mlp
    if layer.name == RWKV:
        att, ffn = rwkv_widths(model, opts)
        heads = model.num_attention_heads
        lin = 2 * h * att * 4 + 2 * att * h
        lora = (2 * h * RWKV_TIME_MIX_EXTRA_DIM * 5 * 2
                + 2 * h * RWKV_TIME_DECAY_EXTRA_DIM + 2 * RWKV_TIME_DECAY_EXTRA_DIM * att)
        wkv = 4 * att * (att // heads)  # per-head state update and read-out
        mlp = 2 * h * ffn + 2 * h * h + 2 * ffn * h
        return lin + lora, wkv, mlp
    return 0, 0, 0


def neox_flops_per_iteration(model: ModelSpec, training: TrainingSpec, padded_vocab: int,
                             checkpoint_factor: int) -> float:
    """flops_per_iteration of megatron/logging.py (before / (iter_time * world_size)).

    factor 4 with checkpoint_activations and 3 otherwise is get_actual_flops (HFU); 3 always is
    get_forward_backward_flops (MFU). Branches on "rwkv" / "mamba" in attention_config like NeoX.
    """
    b, s, h, L, V = (training.train_batch_size, model.seq_length, model.hidden_size,
                     model.num_layers, padded_vocab)
    f = checkpoint_factor
    if "rwkv" in model.attention_types:
        # NeoX uses no factor here, whatever checkpointing is set.
        return float(b * s * (78 * h * h * L + 84 * h * L + 16 * h + 12 * h * V
                              + 18 * h * h * L / model.num_attention_heads))
    if "mamba" in model.attention_types:
        if model.expansion_factor:
            d_inner = h * model.expansion_factor
        elif model.intermediate_size:
            d_inner = model.intermediate_size
        else:
            d_inner = h * 2
        dt_rank = math.ceil(h / 16)
        ssm = f * d_inner * s * b * (11 * MAMBA_D_STATE + 4 * dt_rank + 1)
        proj = f * s * b * 6 * d_inner * h
        conv = f * s * b * 2 * d_inner * MAMBA_D_CONV
        return float((ssm + proj + conv) * L + 6 * s * b * h * V)
    return (24 * f * b * s * L * (h ** 2)
            * (1.0 + (s / (6.0 * h)) + (V / (16.0 * L * h))))


def flops(model: ModelSpec, training: TrainingSpec, layers: Sequence, padded_vocab: int,
          recomputed_layers: AbstractSet[int] = frozenset(),
          opts: DeriveOptions = DEFAULT_OPTIONS) -> FlopsEstimate:
    """`recomputed_layers`: indices of specs inside checkpointed chunks (layers.recomputed_layers);
    their forward runs again in backward, which hardware FLOPs (HFU) count and model FLOPs do not."""
    h = model.hidden_size
    lin = scores = mlp = 0
    recomputed = 0
    for layer in layers:
        if not layer.is_block:
            continue
        a, b, c = block_forward(model, layer, opts)
        lin, scores, mlp = lin + a, scores + b, mlp + c
        if layer.index in recomputed_layers:
            recomputed += a + b + c
    head = 2 * h * padded_vocab if opts.train_impl != "rm" else 2 * h
    forward = lin + scores + mlp + head
    tokens = training.train_batch_size * model.seq_length
    model_iter = 3 * forward * tokens
    hardware_iter = model_iter + recomputed * tokens
    ckpt_factor = 4 if training.checkpoint_activations else 3
    return FlopsEstimate(
        forward_per_token=forward, attention_linear_per_token=lin,
        attention_scores_per_token=scores, mlp_per_token=mlp, head_per_token=head,
        model_per_iteration=model_iter, hardware_per_iteration=hardware_iter,
        neox_hfu_per_iteration=neox_flops_per_iteration(model, training, padded_vocab, ckpt_factor),
        neox_mfu_per_iteration=neox_flops_per_iteration(model, training, padded_vocab, 3),
        model_total=None if training.train_iters is None else model_iter * training.train_iters)
