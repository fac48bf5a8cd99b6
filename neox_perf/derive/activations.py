"""What one micro-batch's forward keeps until its backward, tensor by tensor, and what a block's
backward adds at its worst moment -- GPT-NeoX's modules (megatron/model/*.py at ea7aefd8) as
autograd runs them, on one tensor-parallel rank.

Forward: every tensor a block keeps is named with its bytes (`Saved`). A tensor is counted once,
by the operator that makes it, whoever keeps it: the block's output is its own item (the next
block's norm keeps it), a view keeps its whole base alive (NeoX's v is a view of the QKV output,
so the whole QKV output stays).

Backward: a block's backward is the list of tensors it makes and frees in autograd's order
(`BackwardWalk`); the worst moment is where its temporaries, less the saved tensors it has already
released, are largest. The order and the sizes were read from NeoX's operators and checked
against the hook's operator trace of NeoX on CPU (NEOX_PERF_MEMORY_TRACE, calibration/live_memory.py):
e.g. the MLP's linear2 backward holds the incoming gradient, a contiguous copy of it, the weight
gradient and the [s, b, ffn] input gradient at once; the unfused fp32 softmax, masked in place on
a view of the scores, makes three more score-sized tensors in backward (CopySlices).

Paths measured on CPU (fp32): layernorm/rmsnorm, MHA and GQA, unfused attention, rotary
(TorchScript apply_rotary_pos_emb) and learned positions, gelu, tp 1 and 2. Paths read from the
code only: fp16/bf16 casts, the fused softmax kernels, flash-attn, bias-gelu/bias-dropout fusion,
sequence parallelism; gMLP, Mamba, RWKV and MoE blocks are approximate totals.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..config.specs import ModelSpec
from .errors import DeriveError
from .layers import GMLP, MAMBA, RWKV, TRANSFORMER
from .options import DeriveOptions
from .params import mamba_inner, mlp_widths, moe_expert_width, rwkv_widths

Saved = Tuple[str, float]  # (what, bytes per micro-batch)


@dataclass(frozen=True)
class ActivationContext:
    model: ModelSpec
    micro_batch: int
    tp: int
    seq_div: int  # tp with sequence parallelism (the residual stream is scattered), else 1
    act_bytes: int  # 2 for fp16/bf16, 4 for fp32
    opts: DeriveOptions
    partition_activations: bool
    pipelined: bool
    precision: str = "fp16"  # fp16 | bfloat16 | fp32 (NeoX picks its rotary function by it)
    param_bytes: int = 2  # bytes of a weight gradient (the parameter dtype)
    device: str = "cuda"  # cuda | cpu: what dropout keeps differs

    @property
    def mask_bytes(self) -> int:
        """A dropout mask's bytes per element: CUDA's fused native_dropout keeps a bool mask;
        on a CPU torch draws it into a tensor of the input's dtype (measured)."""
        return 1 if self.device == "cuda" else self.act_bytes

    @property
    def tokens(self) -> int:
        return self.model.seq_length * self.micro_batch

    @property
    def hidden(self) -> float:
        """One [s, b, h] tensor of the residual stream (scattered under sequence parallelism)."""
        return self.act_bytes * self.model.hidden_size * self.tokens / self.seq_div

    @property
    def gathered(self) -> float:
        """One full [s, b, h] tensor (a linear's gathered input, the head's input)."""
        return self.act_bytes * self.model.hidden_size * self.tokens

    @property
    def local(self) -> float:
        """One [s, b, h/tp] tensor (attention heads of this rank)."""
        return self.act_bytes * self.model.hidden_size * self.tokens / self.tp

    def checkpoint_input(self) -> float:
        """What a checkpointed chunk keeps: its input, split over TP with partition_activations."""
        if self.opts.checkpoint_in_cpu:
            return 0.0
        div = self.tp if self.partition_activations and self.tp > 1 else 1
        return self.hidden / div


# ---------------------------------------------------------------------------------------------
# norms (megatron/model/norms.py)


def norm_saved(ctx: ActivationContext, name: str) -> List[Saved]:
    """What a norm keeps besides its input (its producer's item) and output (its consumer's)."""
    tok = ctx.tokens / ctx.seq_div
    norm = ctx.model.norm
    if norm == "rmsnorm" and not ctx.opts.rmsnorm_fusion:
        # x.to(fp32) (a copy unless fp32), pow/mean, rsqrt(var + eps) kept for its backward,
        # x * rsqrt kept (x_normed, fp32) by the scale's product
        items = [(f"{name} rsqrt", 4 * tok), (f"{name} x_normed fp32", 4 * ctx.model.hidden_size * tok)]
        if ctx.act_bytes != 4:
            items.append((f"{name} fp32 input copy", 4 * ctx.model.hidden_size * tok))
            # (scale * x_normed) in fp32, cast back: the cast's input is not kept
        return items
    if norm == "scalenorm":
        return [(f"{name} norm", ctx.act_bytes * tok),
                (f"{name} x / norm", ctx.act_bytes * ctx.model.hidden_size * tok)]
    # LayerNorm (torch or apex fused): mean and rstd, fp32
    return [(f"{name} mean, rstd", 8 * tok)]


def norm_output(ctx: ActivationContext) -> float:
    """The norm output a column-parallel linear keeps: gathered under sequence parallelism."""
    return ctx.gathered


# ---------------------------------------------------------------------------------------------
# attention (ParallelSelfAttention)


def softmax_saved(ctx: ActivationContext) -> List[Saved]:
    """FusedScaleMaskSoftmax: the fused kernel keeps its half output; the torch path keeps the
    softmax output (fp32 when the input is upcast) and, upcast, the half copy the bmm reads."""
    m, e = ctx.model, ctx.act_bytes
    scores = (m.num_attention_heads // ctx.tp) * m.seq_length * m.seq_length * ctx.micro_batch
    if softmax_path(ctx) == "fp32 copy":
        items = [("attention probabilities fp32", 4 * scores), ("attention probabilities half", e * scores)]
    else:  # the fused kernel's output, or the torch softmax's in the input's dtype
        items = [("attention probabilities", e * scores)]
    if ctx.opts.attention_dropout > 0:
        items += [("attention dropout mask", ctx.mask_bytes * scores),
                  ("attention dropout output", e * scores)]
    return items


def softmax_path(ctx: ActivationContext) -> str:
    """fused | fp32 copy | in place (torch softmax on the scores, masked in place)."""
    m = ctx.model
    if ctx.act_bytes == 4:
        return "in place"
    s = m.seq_length
    heads = m.num_attention_heads // ctx.tp
    fused = ((m.fused_softmax or ctx.opts.scaled_masked_softmax_fusion) and 16 < s <= 2048
             and s % 4 == 0 and (ctx.micro_batch * heads) % 4 == 0)
    # The CUDA kernel's batch_per_block divisibility check is not modelled.
    if fused:
        return "fused"
    if ctx.opts.attention_softmax_in_fp32 or ctx.opts.apply_query_key_layer_scaling:
        return "fp32 copy"
    return "in place"


def _rotary(ctx: ActivationContext) -> Tuple[float, bool]:
    """(rotary fraction of a head, whether NeoX's TorchScript apply_rotary_pos_emb runs: it keeps
    the two -x2 halves of rotate_half for q and for k; bf16 and rope_fusion do not)."""
    m = ctx.model
    if m.pos_emb != "rotary":
        return 0.0, False
    jit = ctx.precision != "bfloat16" and not ctx.opts.rope_fusion
    return m.rotary_pct, jit


def attention_saved(ctx: ActivationContext, layer) -> List[Saved]:
    m, e, tok, t = ctx.model, ctx.act_bytes, ctx.tokens, ctx.tp
    hd, heads, kv = m.head_dim, m.num_attention_heads // t, max(m.num_kv_heads // t, 1)
    q_bytes, kv_bytes = e * tok * heads * hd, e * tok * kv * hd
    rot, jit = _rotary(ctx)
    items: List[Saved] = []
    gqa = m.num_kv_heads != m.num_attention_heads
    if layer.attention_type == "flash":
        # flash-attn keeps its inputs (transpose(0, 1).reshape copies of q, k, v), its output
        # and the fp32 log-sum-exp; the rotary outputs are not kept, but the TorchScript
        # rotary keeps its own inputs: q and k (views of the QKV output with MHA)
        items += [("flash q, k, v", q_bytes + 2 * kv_bytes), ("flash output", q_bytes),
                  ("flash logsumexp fp32", 4 * ctx.micro_batch * heads * m.seq_length)]
        if jit and rot > 0:
            items.append(("q, k (TorchScript rotary inputs)",
                          q_bytes + kv_bytes if gqa else q_bytes + 2 * kv_bytes))
    else:
        if gqa:
            # gqa_project: contiguous q, k, v, then k and v repeated to every query head; the
            # scores bmm keeps q and k (or the TorchScript rotary keeps them as its inputs)
            items.append(("v repeated", q_bytes))
            if rot == 0 or jit:
                items += [("q", q_bytes), ("k repeated", q_bytes)]
        else:
            items.append(("qkv output (v is a view)", q_bytes + 2 * kv_bytes))
        if 0 < rot:
            items.append(("q, k rotated", 2 * q_bytes))
        items += softmax_saved(ctx)
    if jit and rot > 0:
        items.append(("rotate_half -x2 (TorchScript)", rot * q_bytes))
    items.append(("context (contiguous)", ctx.local))
    return items


# ---------------------------------------------------------------------------------------------
# MLP (ParallelMLP)


def mlp_saved(ctx: ActivationContext) -> List[Saved]:
    m, e, tok, t = ctx.model, ctx.act_bytes, ctx.tokens, ctx.tp
    out, inp = mlp_widths(m)
    y, g = e * tok * out / t, e * tok * inp / t
    if m.is_gated:
        # chunk(2) views of linear1's output (x, gate): with biases each gets its own sum;
        # act(gate) and its product with x are kept, swish keeps sigmoid(gate) too
        items = [("linear1 output (x, gate)", y), ("activation(gate)", g), ("linear2 input", g)]
        if m.activation in ("swiglu", "swish"):
            items.append(("sigmoid(gate)", g))
        return items
    if m.activation == "relu":
        return [("linear2 input (relu keeps its output)", g)]
    # gelu keeps its input (linear1 output + bias, or y with bias_gelu_fusion), linear2 its output
    return [("activation input", y), ("linear2 input", g)]


def transformer_saved(ctx: ActivationContext, layer) -> List[Saved]:
    """ParallelTransformerLayer, one micro-batch, its output included."""
    m, o = ctx.model, ctx.opts
    mask = ctx.mask_bytes * m.hidden_size * ctx.tokens / ctx.seq_div if o.hidden_dropout > 0 else 0.0
    items: List[Saved] = []
    tied_norms = m.gpt_j_residual and o.gpt_j_tied
    items += norm_saved(ctx, "input norm") + [("input norm output", norm_output(ctx))]
    if m.gpt_j_residual and not tied_norms:
        items += norm_saved(ctx, "post-attention norm") + [("post-attention norm output",
                                                            norm_output(ctx))]
    items += attention_saved(ctx, layer)
    if mask:
        items.append(("attention dropout mask", mask))
    if not m.gpt_j_residual:
        items.append(("attention output + residual", ctx.hidden))
        items += norm_saved(ctx, "post-attention norm") + [("post-attention norm output",
                                                            norm_output(ctx))]
    if layer.moe:
        # Approximate: router input, then each token's copies to top_k experts with their
        # activation input and linear2 input; megablocks' permutation buffers are not modelled.
        e, tok = ctx.act_bytes, ctx.tokens
        items.append(("MoE routing (approximate)", e * m.hidden_size * tok + o.moe_top_k * e * (
            m.hidden_size + 2 * moe_expert_width(m)) / ctx.tp * tok))
    else:
        items += mlp_saved(ctx)
    if mask:
        items.append(("MLP dropout mask", mask))
    items.append(("layer output", ctx.hidden))
    return items


def block_saved(ctx: ActivationContext, layer) -> List[Saved]:
    m, e, t, tok = ctx.model, ctx.act_bytes, ctx.tp, ctx.tokens
    h = m.hidden_size
    if layer.name == TRANSFORMER:
        return transformer_saved(ctx, layer)
    norm_in = e * h * tok / ctx.seq_div
    if layer.name == GMLP:
        # Approximate: norm, input_linear, 2ff activation, SGU norm/projection/product, output.
        ff = 4 * h
        tiny_attention = layer.attention_type == "amlp"
        extra = e * m.seq_length * m.seq_length * ctx.micro_batch if tiny_attention else 0
        return [("gMLP block (approximate)", norm_in + e * h * tok + e * 7 * ff / t * tok + extra)]
    if layer.name == MAMBA:
        return [("Mamba block (approximate)", norm_in + e * h * tok + e * 10 * mamba_inner(m) / t * tok)]
    if layer.name == RWKV:
        att, ffn = rwkv_widths(m, ctx.opts)
        return [("RWKV block (approximate)", 2 * norm_in + e * (12 * h + 8 * att + 2 * ffn) * tok)]
    raise DeriveError(f"unknown block {layer.name}")


# ---------------------------------------------------------------------------------------------
# backward


@dataclass(frozen=True)
class BackwardPeak:
    """The worst moment of one block's backward, relative to the moment it starts."""
    where: str
    temporaries: float  # made by this backward and alive then (the incoming gradient included)
    released: float  # of the block's saved tensors, freed by then
    gradients: float  # weight gradients made as param.grad (first micro-batch) by then


class BackwardWalk:
    """Autograd's allocations in order; remembers the largest (temporaries - released)."""

    def __init__(self, accumulate: bool, start: float, param_bytes: int):
        self.temp, self.released, self.grads = start, 0.0, 0.0
        self.accumulate, self.param_bytes = accumulate, param_bytes
        self.pending_wgrad = 0.0
        self.best: Optional[BackwardPeak] = None

    def _mark(self, where: str) -> None:
        level = self.temp - self.released + self.grads
        if self.best is None or level > self.best.temporaries - self.best.released + self.best.gradients:
            self.best = BackwardPeak(where, self.temp, self.released, self.grads)

    def make(self, where: str, nbytes: float) -> None:
        self.temp += nbytes
        self._mark(where)

    def free(self, nbytes: float) -> None:
        self.temp -= nbytes

    def release(self, nbytes: float) -> None:
        self.released += nbytes

    def weight_grad(self, where: str, elements: float) -> None:
        """A linear's weight gradient: a temporary until AccumulateGrad runs (`settle`)."""
        nbytes = self.param_bytes * elements
        self.make(where, nbytes)
        self.pending_wgrad += nbytes

    def settle(self) -> None:
        """AccumulateGrad ran: accumulating micro-batches add the pending weight gradients into
        param.grad and free them; the first micro-batch's become param.grad."""
        self.temp -= self.pending_wgrad
        if not self.accumulate:
            self.grads += self.pending_wgrad
        self.pending_wgrad = 0.0


def norm_backward(w: "BackwardWalk", ctx: ActivationContext, where: str, grad_in: float) -> None:
    """A norm's backward inside a walk: from the gradient of its output (`grad_in` bytes,
    freed here) to the gradient of its input (made here, left alive).

    LayerNorm's is one kernel. NeoX's Python RMSNorm runs autograd through its fp32 ops:
    d(x_normed) = g * scale and the scale's product; then d(x) * rsqrt and the rsqrt's
    product; then the mean/pow chain of the variance (div, pow, two muls) alive at once
    before their sum (measured on CPU)."""
    H = ctx.hidden
    if ctx.model.norm != "rmsnorm" or ctx.opts.rmsnorm_fusion:
        w.make(where, H)
        w.free(grad_in)
        w.release(sum(b for _, b in norm_saved(ctx, "norm")))
        return
    H4 = 4 * ctx.model.hidden_size * ctx.tokens / ctx.seq_div  # fp32
    w.make(where, 2 * H4)  # g * scale, g * x_normed
    w.free(H4)  # the scale's product, summed
    w.free(grad_in)
    w.make(where, 2 * H4)  # d(x_normed) * rsqrt, d(x_normed) * x
    w.free(2 * H4)  # d(x_normed), the rsqrt's product (summed)
    w.release(sum(b for n, b in norm_saved(ctx, "norm") if "x_normed" in n))
    w.make(where, 4 * H4)  # the variance's backward: div, pow, mul, mul
    w.free(3 * H4)
    w.make(where, H4)  # the last one's sum with the first part: d(x)
    w.free(2 * H4)
    w.release(sum(b for n, b in norm_saved(ctx, "norm") if "x_normed" not in n))
    if ctx.act_bytes != 4:
        w.make(where, H)  # cast back from the fp32 copy
        w.free(H4)


def _output_linear_backward(w: "BackwardWalk", name: str, drop: float, mask: float, copy: float,
                            weight_elements: float, input_bytes: float) -> None:
    """A row-parallel output linear after NeoX's bias-dropout-add (linear2, attention dense),
    from the gradient of the block's output: the dropout's gradient (g * mask, in g's layout),
    a contiguous copy when g is transposed, the weight and input gradients; then the linear's
    input (the activation output, the contiguous context: `input_bytes`) is released."""
    w.make(f"{name} dropout backward", drop)
    w.release(mask)
    w.make(f"{name} backward", copy)
    w.free(drop if copy else 0.0)
    w.weight_grad(f"{name} backward", weight_elements)
    w.make(f"{name} backward", input_bytes)
    w.free(copy or drop)
    w.release(input_bytes)
    w.settle()


def transformer_backward(ctx: ActivationContext, layer, accumulate: bool,
                         incoming: float, transposed: bool = False) -> BackwardPeak:
    """ParallelTransformerLayer's backward (the non-GPT-J residual path), from the gradient of
    its output (`incoming` bytes, alive) to the gradient of its input. Each autograd node makes
    its outputs while its inputs are alive, then frees its input gradient and saved tensors.

    `transposed`: the residual stream's gradient is a transposed view (on the last stage it
    starts as _post_transformer_block's transpose of the final norm's input gradient, and
    autograd keeps accumulating into that first tensor), so the linear2 and dense backwards
    each read it through a contiguous copy."""
    m, e, tok, t = ctx.model, ctx.act_bytes, ctx.tokens, ctx.tp
    h, H, Hl, G = m.hidden_size, ctx.hidden, ctx.local, ctx.gathered
    out, inp = mlp_widths(m)
    y, g = e * tok * out / t, e * tok * inp / t
    heads, kv, hd = m.num_attention_heads // t, max(m.num_kv_heads // t, 1), m.head_dim
    qkv = e * tok * (heads + 2 * kv) * hd
    copy = H if transposed else 0.0
    drop = H if ctx.opts.hidden_dropout > 0 else 0.0
    mask = ctx.mask_bytes * m.hidden_size * tok / ctx.seq_div if drop else 0.0
    w = BackwardWalk(accumulate, incoming, ctx.param_bytes)
    _output_linear_backward(w, "MLP linear2", drop, mask, copy, h * inp / t, g)
    mlp = sum(b for _, b in mlp_saved(ctx))
    if m.is_gated:
        # act(gate) * x: d(x) and d(act); then act's own backward (swish: its sigmoid
        # products, three alive at once, measured on CPU); then cat(d(x), d(gate))
        w.make("MLP gate product backward", 2 * g)
        w.free(g)
        w.release(2 * g)  # x (linear1's first half) and act(gate)
        swish = m.activation in ("swiglu", "swish")
        w.make("MLP activation backward", (3 if swish else 1) * g)
        w.free((3 if swish else 1) * g)
        w.release(mlp - 3 * g)  # the gate half (and sigmoid(gate))
        w.make("MLP gate cat backward", y)
        w.free(2 * g)
    else:
        w.make("MLP activation backward", y)
        w.free(g)
        w.release(mlp - g)
    w.weight_grad("MLP linear1 backward", out * h / t)
    w.make("MLP linear1 backward", G)
    w.free(y)
    w.release(norm_output(ctx))
    w.settle()
    norm_backward(w, ctx, "post-attention norm backward", G)
    w.release(H)  # the attention output + residual (the norm's input)
    w.make("residual gradient sum", H)
    w.free(H + incoming)
    _output_linear_backward(w, "attention dense", drop, mask, copy, h * h / t, Hl)
    attention = sum(b for _, b in attention_saved(ctx, layer)) - ctx.local
    if layer.attention_type == "flash":
        # flash-attn's backward: dq, dk, dv, its fp32 dq accumulator and softmax row sums
        qb, kvb = e * tok * heads * hd, e * tok * kv * hd
        extra = 4 * tok * heads * hd + 4 * ctx.micro_batch * heads * m.seq_length
        w.make("flash attention backward", qb + 2 * kvb + extra)
        w.free(Hl + extra)
        w.release(attention)
        w.make("QKV gradient", qkv)
        w.free(qb + 2 * kvb)
    else:
        scores = heads * m.seq_length * m.seq_length * ctx.micro_batch
        S = e * scores
        softmax = softmax_saved(ctx)
        probs = sum(b for n, b in softmax if "dropout" not in n)
        w.make("attention context bmm backward", Hl)  # d(v)
        w.make("attention context bmm backward", S)  # d(probs)
        w.free(Hl)
        if ctx.opts.attention_dropout > 0:
            w.release(sum(b for n, b in softmax if "dropout output" in n))
            w.make("attention dropout backward", S)  # d(probs) * mask
            w.free(S)
            w.release(sum(b for n, b in softmax if "dropout mask" in n))
        path = softmax_path(ctx)
        if path == "in place":
            # softmax backward, then masked_fill_ on a view of the baddbmm output: CopySlices
            # makes a base-sized zero buffer, a strided gradient, a clone and a masked copy
            w.make("softmax backward", S)
            w.free(S)
            w.release(probs)
            w.make("masked_fill_ backward (CopySlices)", S)  # zeros of the base
            w.free(S)  # the softmax gradient, copied into ...
            w.make("masked_fill_ backward (CopySlices)", S)  # ... a strided gradient
            w.make("masked_fill_ backward (CopySlices)", 2 * S)  # a clone, masked
            w.free(3 * S)
        elif path == "fp32 copy":
            w.make("probabilities cast backward", 4 * scores)
            w.free(S)
            w.make("softmax backward (fp32)", 4 * scores)
            w.free(4 * scores)
            w.release(probs)
            w.make("masked_fill backward (fp32)", 4 * scores)
            w.free(4 * scores)
            w.make("scores upcast backward", S)
            w.free(4 * scores)
        else:  # the fused kernel writes the input gradient over the output gradient
            w.release(probs)
        # scores = alpha * q k^T: d(q) and d(k), each scaled
        w.make("attention scores bmm backward", 2 * Hl)
        w.free(Hl)
        w.make("attention scores bmm backward", 2 * Hl)
        w.free(Hl + S)
        w.release(attention - sum(b for _, b in softmax))
        w.make("QKV gradient (cat)", qkv)
        w.free(3 * Hl)
    w.make("QKV linear backward", G)
    w.weight_grad("QKV linear backward", h * (heads + 2 * kv) * hd)
    w.free(qkv)
    w.release(norm_output(ctx))
    w.settle()
    norm_backward(w, ctx, "input norm backward", G)
    w.make("residual gradient sum", H)
    w.free(2 * H)
    return w.best


def final_norm_backward(ctx: ActivationContext, accumulate: bool) -> BackwardPeak:
    """The final norm's backward on the last stage: the head's input gradient arrives, the
    norm's own output (the head's input) is released first."""
    w = BackwardWalk(accumulate, ctx.gathered, ctx.param_bytes)
    w.release(ctx.gathered)
    norm_backward(w, ctx, "final norm backward", ctx.gathered)
    return w.best


def block_backward(ctx: ActivationContext, layer, accumulate: bool,
                   incoming: float, transposed: bool = False) -> BackwardPeak:
    if layer.name == TRANSFORMER and not ctx.model.gpt_j_residual:
        return transformer_backward(ctx, layer, accumulate, incoming, transposed)
    # Other blocks (GPT-J residual, gMLP, Mamba, RWKV): approximate, the largest saved tensor's
    # gradient and the incoming gradient alive together, nothing released yet.
    largest = max(b for _, b in block_saved(ctx, layer))
    return BackwardPeak("block backward (approximate)", incoming + 2 * largest, 0.0, 0.0)


# ---------------------------------------------------------------------------------------------
# embedding, final norm, head and loss


def embedding_saved(ctx: ActivationContext) -> List[Saved]:
    """EmbeddingPipe: what it makes and keeps (its ids are the loaded batch, not counted here).

    Its output is not kept: _pre_transformer_block's transposed copy of it is the first block's
    input, counted by stage_memory as the stage input."""
    tok = ctx.tokens
    items: List[Saved] = []
    if ctx.tp > 1:
        items.append(("masked ids (int64) + mask (bool)", 9 * tok))
    if ctx.opts.hidden_dropout > 0:
        items.append(("embedding dropout mask", ctx.mask_bytes * ctx.model.hidden_size * tok))
    return items


def final_norm_saved(ctx: ActivationContext) -> List[Saved]:
    """NormPipe on [b, s, h] (after _post_transformer_block's transposed copy): its input is
    that copy, its output the head's input."""
    return [("final norm input (transposed copy)", ctx.gathered)] + norm_saved(ctx, "final norm") \
        + [("final norm output (head input)", ctx.gathered)]


def logits_bytes(ctx: ActivationContext, padded_vocab: int) -> float:
    """The head's output, [b, s, V/tp] in the activation dtype."""
    return ctx.act_bytes * ctx.tokens * padded_vocab / ctx.tp


def loss_copy_bytes(ctx: ActivationContext, padded_vocab: int) -> float:
    """cross_entropy's output.float() copy (not with fp16_lm_cross_entropy or fp32 logits);
    vocab_parallel_cross_entropy then works in place on it and keeps it as its softmax."""
    if ctx.opts.fp16_lm_cross_entropy or ctx.act_bytes == 4:
        return 0.0
    return 4 * ctx.tokens * padded_vocab / ctx.tp
