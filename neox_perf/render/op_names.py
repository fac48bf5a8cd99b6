"""The names a NeoX user knows for the paper's operators (arXiv 2509.22832, Table I).

The decomposition keeps the paper's names (linear1..4, linear_final, ...): they key the sampled
regressors. What they are in GPT-NeoX (megatron/model/transformer.py: ParallelSelfAttention's
query_key_value and dense, ParallelMLP's linear1 and linear2, the final ParallelLinear) is what a
user reads in their model and their profiler, so the tables show both.
"""
from __future__ import annotations

NEOX_NAMES = {
    "linear1": "QKV",  # attention.query_key_value
    "linear2": "attention dense",  # attention.dense
    "linear3": "MLP h->4h",  # mlp.linear1 (h -> 4h, or 2 x the gated width)
    "linear4": "MLP 4h->h",  # mlp.linear2
    "linear_final": "LM head",  # final_linear (or the tied embedding)
    "embedding": "word embedding",
    "qk": "attention QK^T",
    "av": "attention x V",
    "fillmask": "attention mask",
    "softmax": "attention softmax",
    "fused_softmax": "fused softmax",
    "flash_attention": "flash attention",
    "attn_dropout": "attention dropout",
    "gelu": "MLP activation",
    "rope": "rotary embedding",
    "res_add": "residual add",
    "layernorm": "LayerNorm",
    "rmsnorm": "RMSNorm",
    "cross_entropy": "cross-entropy loss",
    "optimizer": "optimizer step",
    "mp_allreduce": "tensor-parallel all-reduce",
    "dp_allreduce": "gradient all-reduce",
    "dp_allgather": "ZeRO all-gather",
    "pp_p2p": "pipeline send",
    "tied_allreduce": "tied-embedding all-reduce",
    "host dispatch": "host launch overhead",
}

PHASES = {"fwd": "forward", "bwd": "backward", "recompute": "recompute", "step": "step"}


def split(label: str):
    """("linear1", "fwd") from the estimate's "linear1 fwd" (an operator's name may hold spaces)."""
    op, _, phase = label.rpartition(" ")
    return op, phase


def neox_name(op: str) -> str:
    return NEOX_NAMES.get(op, op.replace("_", " "))
