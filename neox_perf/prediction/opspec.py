"""The operator vocabulary shared by the decomposition and the predictors.

Every operator is described by *generic per-rank shapes* (a GEMM is {m, k, n}, not
"linear1 at hidden size d"), so any architecture (GQA, SwiGLU, odd FFN widths) can be
queried with the same regressors. For each operator and phase this module gives the
floating-point work and the bytes moved through device memory; the predictors use them
as the physical baseline that their trees correct, and as sanity bounds on samples.

The byte counts are first-order estimates of the tensors a kernel must read and write
(no cache reuse, no framework temporaries). Constant factors do not matter for the fit
(the achieved bandwidth is fitted per operator), but how each term *scales* does.

Only numpy and the standard library are imported: this sits on the fast `check` path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Tuple

import numpy as np

FP16_BYTES = 2
FP32_BYTES = 4  # optimizer state and master weights stay fp32 whatever the activation dtype

PHASES = ("fwd", "bwd")
OPTIMIZER_PHASE = "step"  # the optimizer has one phase; it is neither forward nor backward

# Causal flash attention skips the blocks above the diagonal but computes the ones it enters
# whole, so how much of the l^2 work it does depends on the kernel's blocks (causal_kernel):
# - FLASH2_GPU (the default): FlashAttention-2's 128-row tiles on A100/H100. With
#   n = ceil(l / tile) query tiles it runs n(n+1)/2 of the n^2 tiles, a fraction (n+1)/(2n) --
#   1 when l fits one tile, 3/4 at two, towards 1/2 as l grows. The bundled samples are
#   non-causal, so a causal query is the non-causal prediction scaled through the FLOP term of
#   the baseline (see predictors).
# - TORCH_CPU: PyTorch's CPU kernel (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp, forward
#   and backward alike): query blocks of 256 rows from l >= 768, 64 from l >= 192, else 32; key
#   blocks of 512; a query block at row m runs every key block that starts below
#   min(m + its rows, l), each whole. So 1 up to l = 512 (one key block), 3/4 at 1024, 5/8 at
#   2048, 9/16 at 4096. A CPU profile samples causal=1 itself; with the 128-row tiles in its
#   baseline its trees carried a residual that moved with l (1.33x at 1024, 1.18x at 2048, 1.09x
#   at 4096) and read the lengths between and past the samples wrong by up to 15% (docs/validation.md).
CAUSAL_TILE = 128
FLASH2_GPU = "flash2-gpu"
TORCH_CPU = "torch-cpu"
CAUSAL_KERNELS = (FLASH2_GPU, TORCH_CPU)
TORCH_CPU_KV_BLOCK = 512
TORCH_CPU_Q_BLOCKS = ((768, 256), (192, 64), (0, 32))  # (from l, query block rows)


def _torch_cpu_fraction(l: int) -> float:
    """TORCH_CPU's causal work over the non-causal l^2, by its own block loop."""
    q = next(rows for start, rows in TORCH_CPU_Q_BLOCKS if l >= start)
    kv = min(TORCH_CPU_KV_BLOCK, l)
    work = 0
    for m in range(0, l, q):
        rows = min(q, l - m)
        keys = min(m + rows, l)  # the last key this block needs, exclusive
        work += rows * min(-(-keys // kv) * kv, l)  # every key block it enters, whole
    return work / (l * l)


def causal_work_fraction(l, kernel: str = FLASH2_GPU):
    """Share of the non-causal l^2 work a causal flash attention does with ``kernel`` (see
    CAUSAL_KERNELS)."""
    if kernel == TORCH_CPU:
        ls = np.asarray(l, dtype=float)
        flat = ls.ravel()
        table = {v: _torch_cpu_fraction(max(1, int(round(v)))) for v in np.unique(flat)}
        out = np.array([table[v] for v in flat], dtype=float).reshape(ls.shape)
        return out if out.ndim else float(out)
    if kernel != FLASH2_GPU:
        raise ValueError(f"unknown causal kernel {kernel!r}; known: {', '.join(CAUSAL_KERNELS)}")
    n = np.maximum(np.ceil(np.asarray(l, dtype=float) / CAUSAL_TILE), 1.0)
    return (n + 1.0) / (2.0 * n)

# FlashAttention-2 backward recomputes the scores and runs five l^2 matmuls against the
# forward's two: 2.5x the forward FLOPs.
FLASH_BWD_FLOP_RATIO = 2.5

MASK_BYTES = 1  # torch's native_dropout keeps a bool mask for backward

DEFAULT_VOCAB = 50257  # GPT-NeoX-20B tokenizer, the vocabulary the samples were taken with
VOCAB_MULTIPLE = 128


def vocab_per_rank(vocab: int = DEFAULT_VOCAB, mp: int = 1, multiple: int = VOCAB_MULTIPLE) -> int:
    """Rows of the vocab-parallel embedding / LM head on one tensor-parallel rank.

    GPT-NeoX pads the vocabulary to a multiple of ``multiple * mp`` and splits it evenly.
    """
    if vocab < 1 or mp < 1 or multiple < 1:
        raise ValueError(f"vocab, mp and multiple must be positive, got {vocab}, {mp}, {multiple}")
    return int(math.ceil(vocab / (multiple * mp))) * multiple


def padded_vocab(vocab: int = DEFAULT_VOCAB, mp: int = 1, multiple: int = VOCAB_MULTIPLE) -> int:
    """The whole padded vocabulary (all ranks together)."""
    return vocab_per_rank(vocab, mp, multiple) * mp


def neox_layer_params(d: int, mp: int = 1) -> float:
    """Parameters of one GPT-NeoX transformer layer held by one tensor-parallel rank.

    12d^2 + 13d in total: QKV (3d^2 + 3d) and h->4h (4d^2 + 4d) are ColumnParallel (weight
    and bias split), dense (d^2 + d) and 4h->h (4d^2 + d) are RowParallel (weight split,
    bias replicated), two LayerNorms (2 x 2d) are replicated. Replicated: 6d; split: the rest.
    """
    return (12 * d * d + 7 * d) / mp + 6 * d


def neox_stage_params(d: int, encoders: int, mp: int = 1, stage: str = "middle",
                      vocab: int = DEFAULT_VOCAB) -> float:
    """Parameters one rank updates for a pipeline stage of GPT-NeoX.

    ``stage``: "first" adds the VocabParallel embedding (Vpad/mp x d), "last" adds the final
    LayerNorm (2d) and the untied LM head (d x Vpad/mp), "only" (no pipeline) adds both.
    """
    if stage not in ("first", "middle", "last", "only"):
        raise ValueError(f"stage must be first, middle, last or only, got {stage!r}")
    params = encoders * neox_layer_params(d, mp)
    head = vocab_per_rank(vocab, mp) * d
    if stage in ("first", "only"):
        params += head
    if stage in ("last", "only"):
        params += 2 * d + head
    return float(params)


Features = Mapping[str, "np.ndarray | float"]
CostFn = Callable[[Features, int], "np.ndarray | float"]


@dataclass(frozen=True)
class OpSpec:
    """One operator: its feature names, phases, and FLOP / byte formulas per phase."""

    name: str
    features: Tuple[str, ...]
    phases: Tuple[str, ...]
    flops_fn: Dict[str, CostFn]
    bytes_fn: Dict[str, CostFn]
    doc: str

    def flops(self, phase: str, features: Features, dtype_bytes: int = FP16_BYTES,
              causal_kernel: Optional[str] = None):
        """``causal_kernel``: the kernel whose blocks a causal call's work follows
        (causal_work_fraction), for an operator with a ``causal`` feature; default FLASH2_GPU."""
        flops = self.flops_fn[self._phase(phase)](features, dtype_bytes)
        if causal_kernel is None or causal_kernel == FLASH2_GPU or "causal" not in self.features:
            return flops
        # the formulas price FLASH2_GPU's fraction; the work is linear in it
        causal = np.asarray(features["causal"]) > 0
        ratio = np.where(causal, np.asarray(causal_work_fraction(features["l"], causal_kernel), dtype=float)
                         / np.asarray(causal_work_fraction(features["l"]), dtype=float), 1.0)
        out = np.asarray(flops, dtype=float) * ratio
        return out if out.ndim else float(out)

    def bytes_moved(self, phase: str, features: Features, dtype_bytes: int = FP16_BYTES):
        return self.bytes_fn[self._phase(phase)](features, dtype_bytes)

    def _phase(self, phase: str) -> str:
        if phase not in self.phases:
            raise ValueError(f"operator {self.name!r} has phases {self.phases}, not {phase!r}")
        return phase


def _gemm() -> Tuple[Dict[str, CostFn], Dict[str, CostFn]]:
    # bwd = dgrad (dY W^T) + wgrad (X^T dY): twice the FLOPs, each operand touched twice.
    def io(f):
        return f["m"] * f["k"] + f["k"] * f["n"] + f["m"] * f["n"]

    flops = {"fwd": lambda f, dt: 2.0 * f["m"] * f["k"] * f["n"],
             "bwd": lambda f, dt: 4.0 * f["m"] * f["k"] * f["n"]}
    nbytes = {"fwd": lambda f, dt: dt * io(f),
              "bwd": lambda f, dt: 2.0 * dt * io(f)}
    return flops, nbytes


def _elementwise(size: Callable[[Features], "np.ndarray | float"], fwd_flops: float, bwd_flops: float,
                 fwd_passes: float, bwd_passes: float) -> Tuple[Dict[str, CostFn], Dict[str, CostFn]]:
    """Memory-bound ops: FLOPs and bytes proportional to the element count."""
    flops = {"fwd": lambda f, dt: fwd_flops * size(f), "bwd": lambda f, dt: bwd_flops * size(f)}
    nbytes = {"fwd": lambda f, dt: fwd_passes * dt * size(f),
              "bwd": lambda f, dt: bwd_passes * dt * size(f)}
    return flops, nbytes


def _attention_bmm(scores_reads_fwd: float, scores_io_bwd: float):
    """Q.K^T and scores.V over [batch, l, head_dim]: 2 * batch * l^2 * head_dim FLOPs each."""
    def lsq(f):
        return f["batch"] * f["l"] * f["l"]

    def lhd(f):
        return f["batch"] * f["l"] * f["head_dim"]

    flops = {"fwd": lambda f, dt: 2.0 * lsq(f) * f["head_dim"],
             "bwd": lambda f, dt: 4.0 * lsq(f) * f["head_dim"]}
    nbytes = {"fwd": lambda f, dt: dt * (scores_reads_fwd * lsq(f) + 2.0 * lhd(f)),
              "bwd": lambda f, dt: dt * (scores_io_bwd * lsq(f) + 4.0 * lhd(f))}
    return flops, nbytes


def _flash():
    def work(f):
        causal = np.where(np.asarray(f["causal"]) > 0, causal_work_fraction(f["l"]), 1.0)
        return causal * f["b"] * f["heads"] * f["l"] * f["l"] * f["head_dim"]

    def qkvo(f):
        return f["b"] * f["l"] * f["heads"] * f["head_dim"]

    flops = {"fwd": lambda f, dt: 4.0 * work(f),
             "bwd": lambda f, dt: 4.0 * FLASH_BWD_FLOP_RATIO * work(f)}
    # fwd reads q, k, v and writes o (+ fp32 log-sum-exp); bwd reads q, k, v, o, do and
    # writes dq, dk, dv with an fp32 dq accumulator.
    nbytes = {"fwd": lambda f, dt: 4.0 * dt * qkvo(f) + FP32_BYTES * f["b"] * f["heads"] * f["l"],
              "bwd": lambda f, dt: 8.0 * dt * qkvo(f) + 2.0 * FP32_BYTES * qkvo(f)}
    return flops, nbytes


def _dropout():
    # Dropout in training: forward draws the keep mask, writes the scaled output and keeps the
    # mask (1 byte per element) for backward; backward reads the gradient and the mask.
    def n(f):
        return f["batch"] * f["l"] * f["l"]

    flops = {"fwd": lambda f, dt: 2.0 * n(f), "bwd": lambda f, dt: 1.0 * n(f)}
    nbytes = {"fwd": lambda f, dt: (2.0 * dt + MASK_BYTES) * n(f),
              "bwd": lambda f, dt: (2.0 * dt + MASK_BYTES) * n(f)}
    return flops, nbytes


def _embedding():
    def td(f):
        return f["tokens"] * f["d"]

    flops = {"fwd": lambda f, dt: td(f), "bwd": lambda f, dt: td(f)}
    # bwd materialises a dense [vocab, d] gradient (zero-fill) and scatter-adds the tokens.
    nbytes = {"fwd": lambda f, dt: 2.0 * dt * td(f) + 8.0 * f["tokens"],
              "bwd": lambda f, dt: dt * (f["vocab"] * f["d"] + 2.0 * td(f)) + 8.0 * f["tokens"]}
    return flops, nbytes


def _optimizer():
    # DeepSpeed FP16 optimizer + fused Adam, per parameter: fp16 grad -> fp32 grad
    # (dt + 4), Adam reads master/grad/m/v and writes master/m/v (7 x 4), then copies the
    # fp32 master back into the fp16 weights (4 + dt): 36 + 2*dt bytes.
    flops = {OPTIMIZER_PHASE: lambda f, dt: 12.0 * f["params"]}
    nbytes = {OPTIMIZER_PHASE: lambda f, dt: (9 * FP32_BYTES + 2.0 * dt) * f["params"]}
    return flops, nbytes


def _spec(name, features, costs, doc, phases=PHASES) -> OpSpec:
    flops, nbytes = costs
    return OpSpec(name, tuple(features), tuple(phases), flops, nbytes, doc)


_GEMM_DOC = ("GEMM [m, k] x [k, n] with bias on one rank. GPT-NeoX: m = b*l; linear1 QKV "
             "k=d, n=3d/mp; linear2 attention-out k=d/mp, n=d; linear3 h->4h k=d, n=4d/mp; "
             "linear4 4h->h k=4d/mp, n=d; linear_final LM head k=d, n=vocab_per_rank(V, mp).")

OPS: Dict[str, OpSpec] = {
    spec.name: spec for spec in (
        _spec("embedding", ("tokens", "vocab", "d"), _embedding(),
              "vocab-parallel lookup of `tokens` ids into a [vocab (per rank), d] table"),
        _spec("layernorm", ("tokens", "d"), _elementwise(lambda f: f["tokens"] * f["d"], 8, 12, 2, 3),
              "LayerNorm over [tokens, d] (replicated across tensor-parallel ranks)"),
        _spec("rmsnorm", ("tokens", "d"), _elementwise(lambda f: f["tokens"] * f["d"], 5, 8, 2, 3),
              "RMSNorm over [tokens, d] (replicated across tensor-parallel ranks)"),
        _spec("res_add", ("tokens", "d"), _elementwise(lambda f: f["tokens"] * f["d"], 1, 1, 3, 3),
              "residual add on [tokens, d]; backward passes the gradient through"),
        *(_spec(n, ("m", "k", "n"), _gemm(), _GEMM_DOC)
          for n in ("linear1", "linear2", "linear3", "linear4", "linear_final")),
        _spec("rope", ("tokens", "heads", "rot_dim"),
              _elementwise(lambda f: 2.0 * f["tokens"] * f["heads"] * f["rot_dim"], 3, 3, 2, 2),
              "rotary embedding on q and k: `heads` per rank, `rot_dim` rotated channels per head"),
        _spec("qk", ("batch", "l", "head_dim"), _attention_bmm(1.0, 2.0),
              "baddbmm Q.K^T: batch = b*heads per rank, [l, head_dim] x [head_dim, l]"),
        _spec("av", ("batch", "l", "head_dim"), _attention_bmm(1.0, 2.0),
              "bmm scores.V: batch = b*heads per rank, [l, l] x [l, head_dim]"),
        _spec("fillmask", ("batch", "l"), _elementwise(lambda f: f["batch"] * f["l"] * f["l"], 1, 1, 2, 2),
              "causal masked_fill_ on [batch = b*heads per rank, l, l] scores"),
        _spec("softmax", ("batch", "l"), _elementwise(lambda f: f["batch"] * f["l"] * f["l"], 5, 4, 2, 3),
              "unfused softmax on [batch = b*heads per rank, l, l]"),
        _spec("fused_softmax", ("batch", "l"),
              _elementwise(lambda f: f["batch"] * f["l"] * f["l"], 6, 4, 2, 3),
              "ScaledUpperTriangMaskedSoftmax: fused scale + causal mask + softmax on [batch, l, l]"),
        _spec("attn_dropout", ("batch", "l"), _dropout(),
              "dropout on the [batch = b*heads per rank, l, l] attention probabilities "
              "(attention_dropout > 0 without flash attention, whose kernel applies it inside)"),
        _spec("flash_attention", ("b", "l", "heads", "head_dim", "causal"), _flash(),
              "flash attention on [b, l, heads per rank, head_dim]; causal=1 skips the blocks above "
              "the diagonal (causal_work_fraction: 1 at one block, towards 1/2)"),
        _spec("gelu", ("tokens", "width"), _elementwise(lambda f: f["tokens"] * f["width"], 8, 16, 2, 3),
              "GeLU on [tokens, width] (GPT-NeoX: width = 4d/mp)"),
        _spec("cross_entropy", ("tokens", "vocab"),
              _elementwise(lambda f: f["tokens"] * f["vocab"], 4, 2, 5, 2),
              "vocab-parallel cross-entropy on [tokens, vocab per rank] logits"),
        _spec("optimizer", ("params",), _optimizer(),
              "one fused Adam step over `params` parameters on one rank (fp16 mixed precision)",
              phases=(OPTIMIZER_PHASE,)),
    )
}

OPERATORS: Tuple[str, ...] = tuple(OPS)

# Operators no published sample set measures: a profile without a model of its own predicts
# them from a sampled (operator, phase) over the same tensor, by the ratio of bytes moved.
# Dropout is one elementwise pass over [batch, l, l] each way (forward: draw, scale, write the
# output and its 1-byte mask; backward: gradient times mask). The sampled pass of that kind on
# that tensor is the unfused softmax's forward (a plain PyTorch kernel reading and writing it
# once); its backward is a row reduction before its elementwise pass, and fillmask's backward a
# broadcast masked_fill at a quarter of its forward's bandwidth, so neither stands in for one.
# A profile that samples the operator itself (`neox-perf calibrate`) uses its own model.
STAND_INS: Dict[str, Tuple[str, str]] = {"attn_dropout": ("softmax", "fwd")}


def stand_in_ratio(op: str, phase: str, features: Features, dtype_bytes: int = FP16_BYTES):
    """Seconds of ``op`` ``phase`` per second of its stand-in at the same features."""
    src, src_phase = STAND_INS[op]
    return (np.asarray(op_bytes(op, phase, features, dtype_bytes), dtype=float)
            / np.asarray(op_bytes(src, src_phase, features, dtype_bytes), dtype=float))
COLLECTIVES: Tuple[str, ...] = ("allreduce", "allgather", "p2p")


def op_spec(op: str) -> OpSpec:
    try:
        return OPS[op]
    except KeyError:
        raise ValueError(f"unknown operator {op!r}; known: {', '.join(OPERATORS)}") from None


def op_flops(op: str, phase: str, features: Features, dtype_bytes: int = FP16_BYTES,
             causal_kernel: Optional[str] = None):
    return op_spec(op).flops(phase, features, dtype_bytes, causal_kernel)


def op_bytes(op: str, phase: str, features: Features, dtype_bytes: int = FP16_BYTES):
    return op_spec(op).bytes_moved(phase, features, dtype_bytes)


def collective_wire_bytes(kind: str, elements, ranks, dtype_bytes: int = FP16_BYTES):
    """Bytes each rank sends under NCCL's ring algorithm.

    ``elements`` is the per-rank tensor as in the samples: the reduced tensor for all-reduce,
    each rank's input chunk for all-gather, the tensor sent for p2p. All-reduce is a
    reduce-scatter plus an all-gather, 2(n-1)/n of the tensor; all-gather forwards n-1 chunks.
    """
    size = np.asarray(elements, dtype=float) * dtype_bytes
    n = np.asarray(ranks, dtype=float)
    if kind == "allreduce":
        return 2.0 * (n - 1.0) / n * size
    if kind == "allgather":
        return (n - 1.0) * size
    if kind == "p2p":
        return size * (n > 1)
    raise ValueError(f"unknown collective {kind!r}; known: {', '.join(COLLECTIVES)}")
