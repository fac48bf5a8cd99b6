"""Rules that turn one profiler event into an opspec operator and its features.

A rule reads the event's input shapes (and, for SDPA, its is_causal argument) and returns
(op, features), None when the event is not that operator, or raises `Unmapped` when it is
recognised but cannot be used (a GEMM whose width matches no layer, a collective whose
process group is unknown) -- the report lists those with the reason.
"""
from __future__ import annotations

import re
from typing import Iterable, Optional, Tuple

from .trace_events import Dims, Event, Groups, MapContext

COLLECTIVE_EVENT = re.compile(r"^(gloo|nccl|ucc|mpi|xccl|hccl):(.+)$")
_VOCAB_CE = re.compile(r"VocabParallelC(ross)?E(ntropy)?$")
COLLECTIVE_KIND = {
    "all_reduce": "allreduce", "allreduce": "allreduce",
    "all_gather": "allgather", "allgather": "allgather", "_allgather_base": "allgather",
    "all_gather_into_tensor": "allgather", "allgather_into_tensor_coalesced": "allgather",
    "send": "p2p", "recv": "recv",
}


class Unmapped(Exception):
    """A recognised event that cannot be named or featured here; the message says why."""


def prod(xs: Iterable[int]) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def shape(e: Event, i: int) -> list:
    return list(e.shapes[i]) if i < len(e.shapes) and isinstance(e.shapes[i], list) else []


def linear_name(m: int, k: int, n: int, dims: Dims) -> str:
    d = dims.hidden
    if d is None:
        raise Unmapped(f"GEMM {m}x{k}x{n}: no model widths to tell linear1..4/final apart")
    if k == d:
        for name, width in (("linear_final", dims.vocab), ("linear1", dims.qkv),
                            ("linear3", dims.ffn_out)):
            if width is not None and n == width:
                return name
    if n == d:
        if dims.hidden_local is not None and k == dims.hidden_local:
            return "linear2"
        if dims.ffn_in is not None and k == dims.ffn_in:
            return "linear4"
    raise Unmapped(f"GEMM {m}x{k}x{n}: matches no layer width (hidden {d}, qkv {dims.qkv}, "
                   f"ffn {dims.ffn_out}/{dims.ffn_in}, vocab {dims.vocab})")


def _gemm(m, k, n, ctx):
    return linear_name(m, k, n, ctx.dims), {"m": m, "k": k, "n": n}


def _rule_linear(e, ctx):
    x, w = shape(e, 0), shape(e, 1)
    if len(x) >= 2 and len(w) == 2:
        return _gemm(prod(x[:-1]), x[-1], w[0], ctx)
    return None


def _rule_addmm(e, ctx):
    a, b = shape(e, 1), shape(e, 2)
    if len(a) == 2 and len(b) == 2:
        return _gemm(a[0], a[1], b[1], ctx)
    return None


def _rule_mm(e, ctx):
    a, b = shape(e, 0), shape(e, 1)
    if len(a) >= 2 and len(b) == 2:
        return _gemm(prod(a[:-1]), a[-1], b[1], ctx)
    return None


def _rule_baddbmm(e, ctx):
    a, b = shape(e, 1), shape(e, 2)
    if len(a) == 3 and len(b) == 3 and a[1] == b[2]:
        return "qk", {"batch": a[0], "l": a[1], "head_dim": a[2]}
    return None


def _rule_bmm(e, ctx):
    a, b = shape(e, 0), shape(e, 1)
    if len(a) != 3 or len(b) != 3:
        return None
    if a[1] == a[2]:  # [B, l, l] x [B, l, hd]: probabilities times values
        return "av", {"batch": a[0], "l": a[1], "head_dim": b[2]}
    if a[1] == b[2]:  # [B, l, hd] x [B, hd, l]: queries times keys
        return "qk", {"batch": a[0], "l": a[1], "head_dim": a[2]}
    return None


def _square_tail(e, op):
    x = shape(e, 0)
    if len(x) >= 3 and x[-1] == x[-2]:
        return op, {"batch": prod(x[:-2]), "l": x[-1]}
    return None


def _rule_norm(op):
    def rule(e, ctx):
        x = shape(e, 0)
        if len(x) >= 2:
            return op, {"tokens": prod(x[:-1]), "d": x[-1]}
        return None
    return rule


def _rule_gelu(e, ctx):
    x = shape(e, 0)
    if len(x) >= 2:
        return "gelu", {"tokens": prod(x[:-1]), "width": x[-1]}
    return None


def _rule_embedding(e, ctx):
    w, ids = shape(e, 0), shape(e, 1)
    if len(w) == 2 and ids:
        return "embedding", {"tokens": prod(ids), "vocab": w[0], "d": w[1]}
    return None


def _rule_cross_entropy(e, ctx):
    x = shape(e, 0)
    if len(x) == 2:
        return "cross_entropy", {"tokens": x[0], "vocab": x[1]}
    if len(x) > 2:  # [N, C, d1, ...]
        return "cross_entropy", {"tokens": x[0] * prod(x[2:]), "vocab": x[1]}
    return None


def _rule_vocab_ce(e, ctx):
    x = shape(e, 0)
    if len(x) >= 2:
        return "cross_entropy", {"tokens": prod(x[:-1]), "vocab": x[-1]}
    return None


def _rule_sdpa(e, ctx):
    q = shape(e, 0)
    if len(q) != 4:
        return None
    causal = e.concrete[5] if len(e.concrete) > 5 and isinstance(e.concrete[5], bool) else None
    if causal is None:
        raise Unmapped("scaled_dot_product_attention without its is_causal argument recorded")
    return "flash_attention", {"b": q[0], "heads": q[1], "l": q[2], "head_dim": q[3],
                               "causal": int(causal)}


def _rule_res_add(e, ctx):
    a, b = shape(e, 0), shape(e, 1)
    d = ctx.dims.hidden
    if d is not None and len(a) == 3 and a == b and a[-1] == d:
        return "res_add", {"tokens": a[0] * a[1], "d": d}
    return None


def _rule_rope(e, ctx):
    # NeoX's apply_rotary_pos_emb(q, k, cos, sin): q [s, b, heads, rot], k [s, b, kv, rot];
    # one call rotates both (the decomposition's rope counts (heads + kv) / 2 per call).
    q, k = shape(e, 0), shape(e, 1)
    if len(q) == 4:
        kv = k[2] if len(k) == 4 else q[2]
        return "rope", {"tokens": q[0] * q[1], "heads": (q[2] + kv) / 2.0, "rot_dim": q[3]}
    return None


def _rule_bias_gelu(e, ctx):
    # NeoX's bias_gelu_fusion: GeLUFunction.apply(input, bias), input [s, b, width].
    x = shape(e, 0)
    if len(x) >= 2:
        return "gelu", {"tokens": prod(x[:-1]), "width": x[-1]}
    return None


def _rule_dropout(e, ctx):
    # nn.Dropout(0) (NeoX's default attention_dropout) and eval mode still record aten::dropout,
    # which hands its input back: no work, so no operator (the decomposition has none either)
    c = e.concrete
    p = c[1] if len(c) > 1 else None
    if (isinstance(p, (int, float)) and not isinstance(p, bool) and p <= 0) or (len(c) > 2 and c[2] is False):
        return None
    return _square_tail(e, "attn_dropout")


def _rule_optimizer(e, ctx):
    if not ctx.optimizer_params:
        raise Unmapped("optimizer step: the number of parameters it updates is unknown")
    return "optimizer", {"params": ctx.optimizer_params}


RULES = {
    "aten::linear": _rule_linear,
    "aten::addmm": _rule_addmm,
    "aten::mm": _rule_mm,
    "aten::matmul": _rule_mm,
    "aten::baddbmm": _rule_baddbmm,
    "aten::bmm": _rule_bmm,
    "aten::masked_fill": lambda e, ctx: _square_tail(e, "fillmask"),
    "aten::masked_fill_": lambda e, ctx: _square_tail(e, "fillmask"),
    "aten::softmax": lambda e, ctx: _square_tail(e, "softmax"),
    "aten::_softmax": lambda e, ctx: _square_tail(e, "softmax"),
    # nn.Dropout: aten::dropout, which runs native_dropout on a GPU and bernoulli_/div_/mul on
    # a CPU; only the [.., l, l] probabilities are attention dropout (hidden dropout runs
    # inside bias_dropout_add, glue of the residual add).
    "aten::dropout": _rule_dropout,
    "aten::native_dropout": lambda e, ctx: _square_tail(e, "attn_dropout"),
    "aten::layer_norm": _rule_norm("layernorm"),
    "aten::native_layer_norm": _rule_norm("layernorm"),
    "aten::rms_norm": _rule_norm("rmsnorm"),
    "aten::_fused_rms_norm": _rule_norm("rmsnorm"),
    "aten::gelu": _rule_gelu,
    "aten::embedding": _rule_embedding,
    "aten::cross_entropy_loss": _rule_cross_entropy,
    "aten::scaled_dot_product_attention": _rule_sdpa,
}
FORWARD_ONLY_RULES = {"aten::add": _rule_res_add, "aten::add_": _rule_res_add}
_FUSED = {
    "ScaledUpperTriangMaskedSoftmax": lambda e, ctx: _square_tail(e, "fused_softmax"),
    "ScaledMaskedSoftmax": lambda e, ctx: _square_tail(e, "fused_softmax"),
    "FusedLayerNormAffineFunction": _rule_norm("layernorm"),
    "FusedLayerNormFunction": _rule_norm("layernorm"),
    "FusedRMSNormAffineFunction": _rule_norm("rmsnorm"),
    "FusedRMSNormFunction": _rule_norm("rmsnorm"),
    # TorchScript functions NeoX calls: the profiler records them under their own name.
    "apply_rotary_pos_emb": _rule_rope,
    "GeLUFunction": _rule_bias_gelu,
    "bias_gelu": _rule_bias_gelu,
}


def match(e: Event, ctx: MapContext, phase: str, recompute: bool = False):
    """(op, features) | None; raises Unmapped for a recognised event that cannot be used."""
    rule = RULES.get(e.name)
    if rule is None and e.name in FORWARD_ONLY_RULES and (phase == "forward" or recompute):
        rule = FORWARD_ONLY_RULES[e.name]
    if rule is not None:
        return rule(e, ctx)
    if e.name.startswith("Optimizer.step#"):
        return _rule_optimizer(e, ctx)
    if _VOCAB_CE.search(e.name):
        return _rule_vocab_ce(e, ctx)
    fused = _FUSED.get(e.name)
    if fused is not None:  # NeoX's / apex's fused kernels, called through autograd Functions
        return fused(e, ctx)
    if "flash_attn" in e.name and ("fwd" in e.name or "forward" in e.name) and "bwd" not in e.name:
        q = shape(e, 0)
        if len(q) == 4:  # flash-attn layout [b, l, heads, head_dim]; causal not recorded
            return "flash_attention", {"b": q[0], "l": q[1], "heads": q[2], "head_dim": q[3],
                                       "causal": 1}
    return None


# ---- collectives ---------------------------------------------------------------------------


def placement(size: int, stride: int, local_world: Optional[int]) -> Tuple[int, int]:
    """(nodes, members per node) of `size` ranks `stride` apart, nodes of `local_world`."""
    from neox_perf.prediction.operators import group_placement
    return group_placement(size, stride, local_world or size * stride)


def collective_group(kind: str, phase: str, g: Groups) -> Optional[Tuple[int, int]]:
    """(nodes, gpus_per_node) of the group a collective in `phase` runs over, if known."""
    if kind == "p2p":
        if g.local_world and g.dp * g.mp * 2 > g.local_world:
            return 2, 1
        return 1, 2
    if phase in ("reduce_grads", "dp_allreduce") or (phase in ("optimizer_step", "step")
                                                     and kind == "allgather"):
        return placement(g.dp, g.mp, g.local_world) if g.dp > 1 else None
    if kind == "allgather" and phase == "recv_grads" and g.stages > 1 and g.mp > 1:
        # DeepSpeed's pipeline rebuilds its partitioned output there when grad_partitioned is
        # off; in forward/backward (the default) the branch below places it the same way
        return placement(g.mp, 1, g.local_world)
    if phase in ("forward", "backward"):
        # tensor-parallel all-reduces; in a pipeline also the all-gathers that rebuild the
        # activations and gradients DeepSpeed partitions over the tensor-parallel group for the
        # p2p (the decomposition's pp_allgather)
        if g.mp > 1:
            return placement(g.mp, 1, g.local_world)
        if g.dp > 1 and g.stages == 1:  # ZeRO / DDP-style reduction hooks during backward
            return placement(g.dp, 1, g.local_world)
    if phase == "reduce_tied_grads" and g.stages > 1:
        stride = g.dp * g.mp * (g.stages - 1)
        return placement(2, stride, g.local_world)
    return None


# ---- the walk ------------------------------------------------------------------------------
