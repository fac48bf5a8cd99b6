"""The workload's layers: NeoX's operators and shapes, in the same order, per rank.

Activations inside the transformer stack are [s, b, h] as in NeoX (the pipe blocks
transpose on the way in and out); attention masks are NeoX's [1, 1, s, s] bool tensors
with True = masked.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .dims import WorkloadConfig
from .tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                              copy_to_tp, divide, init_normal_, reduce_from_tp, tp)


# ---- norms -------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.scale * x).to(dtype)


class ScaleNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.g = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x / torch.norm(x, dim=-1, keepdim=True).clamp(min=self.eps) * self.g


def make_norm(wc: WorkloadConfig) -> nn.Module:
    if wc.norm == "rmsnorm":
        return RMSNorm(wc.hidden, wc.norm_eps)
    if wc.norm == "scalenorm":
        return ScaleNorm(wc.hidden, wc.norm_eps)
    affine = wc.norm == "layernorm"
    return nn.LayerNorm(wc.hidden, eps=wc.norm_eps, elementwise_affine=affine, bias=affine)


# ---- activations -------------------------------------------------------------------------

def _swish(x):
    return x * torch.sigmoid(x)


_ACT = {"gelu": F.gelu, "geglu": F.gelu, "relu": F.relu, "reglu": F.relu, "softsign": F.softsign,
        "swish": _swish, "swiglu": _swish, "silu": F.silu, "glu": torch.sigmoid,
        "bilinear": lambda x: x, "mish": lambda x: x * torch.tanh(F.softplus(x))}


def bias_dropout_add(x, bias, residual, p: float, training: bool):
    out = x if bias is None else x + bias
    out = F.dropout(out, p=p, training=training)
    return out if residual is None else residual + out


# ---- embedding ---------------------------------------------------------------------------

class EmbeddingPipe(nn.Module):
    """(input_ids, position_ids, mask) -> ([b, s, h], mask)."""

    def __init__(self, wc: WorkloadConfig):
        super().__init__()
        self.wc = wc
        self.word_embeddings = VocabParallelEmbedding(wc.vocab, wc.hidden, wc.init_std,
                                                      wc.seed, "embed.word")
        if wc.pos_emb == "learned":
            self.position_embeddings = nn.Embedding(wc.max_pos, wc.hidden)
            init_normal_(self.position_embeddings.weight, (wc.max_pos, wc.hidden),
                         wc.init_std, wc.seed, "embed.position")
        elif wc.pos_emb == "sinusoidal":
            inv = 1.0 / (10000 ** (torch.arange(0, wc.hidden, 2).float() / wc.hidden))
            self.register_buffer("inv_freq", inv, persistent=False)

    @property
    def word_embeddings_weight(self):
        return self.word_embeddings.weight

    def _positions(self, position_ids, like):
        if self.wc.pos_emb == "learned":
            return self.position_embeddings(position_ids)
        t = torch.arange(position_ids.shape[1], device=like.device).type_as(self.inv_freq)
        inp = torch.einsum("i,j->ij", t, self.inv_freq)
        return torch.cat((inp.sin(), inp.cos()), dim=-1)[None].to(like.dtype)

    def forward(self, args):
        input_ids, position_ids, mask = args
        x = self.word_embeddings(input_ids)
        if self.wc.pos_emb in ("learned", "sinusoidal"):
            x = x + self._positions(position_ids, x)
        x = F.dropout(x, p=self.wc.hidden_dropout, training=self.training)
        return x, mask


def _logits_helper(embedding: EmbeddingPipe, lm_output):
    """Tied head: [b, s, h] @ E_local^T, vocab-parallel logits (no gather)."""
    return F.linear(copy_to_tp(lm_output), embedding.word_embeddings_weight)


# ---- attention ---------------------------------------------------------------------------

def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=x1.ndim - 1)


def _rope(q, k, cos, sin):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


# NeoX applies rotary through TorchScript (apply_rotary_pos_emb) except in bf16
# (apply_rotary_pos_emb_torch); the scripted graph keeps other tensors for backward (the
# -x2 halves), so memory follows the choice too.
with warnings.catch_warnings():  # torch >= 2.10 deprecates TorchScript; NeoX still uses it
    warnings.simplefilter("ignore", DeprecationWarning)
    _rope_scripted = torch.jit.script(_rope)


class Rotary(nn.Module):
    """NeoX's RotaryEmbedding: cos/sin of [s, 1, 1, dim] precomputed on the host at build time
    as plain attributes (not buffers: moving the model leaves them there), copied to the
    query's device at every forward."""

    def __init__(self, dim: int, seq_len: int, base: int):
        super().__init__()
        inv = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        emb = torch.einsum("i,j->ij", torch.arange(seq_len).float(), inv)
        self.emb = torch.cat((emb, emb), dim=-1)[:, None, None, :]  # [s, 1, 1, dim], fp32
        self.cos_cached, self.sin_cached = self.emb.cos(), self.emb.sin()

    def forward(self, q, k):
        s = q.shape[0]
        cos = self.cos_cached[:s].to(device=q.device, dtype=q.dtype)
        sin = self.sin_cached[:s].to(device=q.device, dtype=q.dtype)
        apply = _rope if q.dtype == torch.bfloat16 else _rope_scripted
        return apply(q, k, cos, sin)


class ParallelSelfAttention(nn.Module):
    def __init__(self, wc: WorkloadConfig, layer_number: int, parallel_output: bool):
        super().__init__()
        self.wc = wc
        world = tp().world_size
        self.hd = wc.head_dim
        self.np = divide(wc.heads, world)
        self.kvp = divide(wc.kv_heads, world)
        self.gqa = wc.kv_heads != wc.heads
        self.h_local = divide(wc.hidden, world)
        self.flash = wc.attention_types[layer_number] == "flash"
        self.norm_factor = math.sqrt(self.hd)
        name = f"layers.{layer_number}.attention"
        self.query_key_value = ColumnParallelLinear(
            wc.hidden, wc.hidden + 2 * wc.kv_hidden, wc.bias_attn, wc.init_std, wc.seed,
            name + ".query_key_value", skip_bias_add=False)
        self.rotary_ndims = None
        self.rotary = None
        if wc.pos_emb == "rotary":
            if wc.rotary_pct < 1:
                self.rotary_ndims = int(self.hd * wc.rotary_pct)
            self.rotary = Rotary(self.rotary_ndims or self.hd, wc.seq_length, wc.rotary_base)
        self.dense = RowParallelLinear(wc.hidden, wc.hidden, wc.bias_attn, wc.out_std, wc.seed,
                                       name + ".dense", parallel_output=parallel_output)

    def _qkv(self, x):
        mixed, _ = self.query_key_value(x)
        s, b = mixed.shape[:2]
        if not self.gqa:
            mixed = mixed.view(s, b, self.np, 3 * self.hd)
            return torch.split(mixed, self.hd, dim=-1)
        q, k, v = (t.contiguous() for t in torch.split(
            mixed, (self.np * self.hd, self.kvp * self.hd, self.kvp * self.hd), dim=-1))
        q = q.view(s, b, self.np, self.hd)
        k = k.view(s, b, self.kvp, self.hd)
        v = v.view(s, b, self.kvp, self.hd)
        if not self.flash:
            rep = self.np // self.kvp
            k = torch.repeat_interleave(k, repeats=rep, dim=2)
            v = torch.repeat_interleave(v, repeats=rep, dim=2)
        return q, k, v

    def _rope(self, q, k):
        if self.rotary is None:
            return q, k
        if self.rotary_ndims is None:
            return self.rotary(q, k)
        n = self.rotary_ndims
        qr, kr = self.rotary(q[..., :n], k[..., :n])
        return torch.cat((qr, q[..., n:]), dim=-1), torch.cat((kr, k[..., n:]), dim=-1)

    def _unfused(self, q, k, v, mask):
        # [s, b, np, hn] -> scores [b*np, sq, sk] = alpha * q k^T (baddbmm, beta 0)
        sq, b, np_, hn = q.shape
        sk = k.shape[0]
        q2 = q.reshape(sq, b * np_, hn).transpose(0, 1)
        k2 = k.reshape(sk, b * np_, hn).transpose(0, 1).transpose(1, 2)
        scores = torch.empty(b * np_, sq, sk, dtype=q.dtype, device=q.device)
        scores = torch.baddbmm(scores, q2, k2, beta=0.0, alpha=1.0 / self.norm_factor)
        scores = scores.view(b, np_, sq, sk)
        scores.masked_fill_(mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        probs = F.dropout(probs, p=self.wc.attention_dropout, training=self.training)
        ctx = torch.bmm(probs.view(b * np_, sq, sk), v.reshape(sk, b * np_, hn).transpose(0, 1))
        return ctx.view(b, np_, sq, hn)

    def _flash(self, q, k, v):
        # NeoX's flash-attn path: q, k, v go in as transpose(0, 1).reshape copies, [b, s, heads,
        # hn] (the kernel keeps them for backward); SDPA with is_causal picks flash/efficient
        # kernels on GPU (and a flash kernel on CPU), on [b, heads, s, hn] views of them.
        q, k, v = (t.transpose(0, 1).contiguous().transpose(1, 2) for t in (q, k, v))
        p = self.wc.attention_dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                              enable_gqa=self.gqa)

    def forward(self, x, mask):
        q, k, v = self._qkv(x)
        q, k = self._rope(q, k)
        ctx = self._flash(q, k, v) if self.flash else self._unfused(q, k, v, mask)
        ctx = ctx.permute(2, 0, 1, 3).contiguous()  # [sq, b, np, hn]
        ctx = ctx.view(*ctx.shape[:2], self.h_local)
        return self.dense(ctx)


# ---- MLP ---------------------------------------------------------------------------------

class ParallelMLP(nn.Module):
    def __init__(self, wc: WorkloadConfig, layer_number: int, parallel_output: bool):
        super().__init__()
        self.gated = wc.gated
        self.act = _ACT[wc.activation]
        name = f"layers.{layer_number}.mlp"
        self.linear1 = ColumnParallelLinear(wc.hidden, wc.ffn, wc.bias_mlp, wc.init_std, wc.seed,
                                            name + ".linear1")
        self.linear2 = RowParallelLinear(wc.ffn_in, wc.hidden, wc.bias_mlp, wc.out_std, wc.seed,
                                         name + ".linear2", parallel_output=parallel_output)

    def forward(self, x):
        y, bias = self.linear1(x)
        if self.gated:
            y, gate = y.chunk(2, dim=-1)
            if bias is not None:
                b1, b2 = bias.chunk(2, dim=-1)
                y, gate = y + b1, gate + b2
            y = self.act(gate) * y
        else:
            y = self.act(y if bias is None else y + bias)
        return self.linear2(y)


# ---- transformer layer -------------------------------------------------------------------

class ParallelTransformerLayer(nn.Module):
    def __init__(self, wc: WorkloadConfig, layer_number: int):
        super().__init__()
        self.wc = wc
        self.layer_number = layer_number
        self.input_layernorm = make_norm(wc)
        self.attention = ParallelSelfAttention(wc, layer_number, wc.gpt_j_residual)
        self.post_attention_layernorm = make_norm(wc)
        self.mlp = ParallelMLP(wc, layer_number, wc.gpt_j_residual)

    def forward(self, x, mask):
        p, train = self.wc.hidden_dropout, self.training
        if self.wc.gpt_j_residual:
            # x + reduce(attn(ln1 x) + mlp(ln2 x)): one TP all-reduce per layer. Row biases
            # are added before that reduction, as NeoX does.
            if self.wc.gpt_j_tied:
                x1 = x2 = self.input_layernorm(x)
            else:
                x1, x2 = self.input_layernorm(x), self.post_attention_layernorm(x)
            attn, attn_bias = self.attention(x1, mask)
            if attn_bias is not None:
                attn = bias_dropout_add(attn, attn_bias, None, p, train)
            mlp, mlp_bias = self.mlp(x2)
            # Without an MLP bias NeoX returns mlp alone and drops the attention branch (a
            # bug: attention then gets no gradient); we keep attention in the sum.
            if mlp_bias is None:
                out = mlp + attn
            else:
                out = bias_dropout_add(mlp, mlp_bias, attn, p, train)
            return x + reduce_from_tp(out)
        attn, attn_bias = self.attention(self.input_layernorm(x), mask)
        x = bias_dropout_add(attn, attn_bias, x, p, train)
        mlp, mlp_bias = self.mlp(self.post_attention_layernorm(x))
        if mlp_bias is None:
            return mlp + x  # NeoX skips the dropout when there is no MLP bias
        return bias_dropout_add(mlp, mlp_bias, x, p, train)


class ParallelTransformerLayerPipe(ParallelTransformerLayer):
    """(hidden [s, b, h], mask) -> (hidden, mask). DeepSpeed partitions on this name."""

    def forward(self, args):
        x, mask = args
        return super().forward(x, mask), mask


class NormPipe(nn.Module):
    def __init__(self, wc: WorkloadConfig):
        super().__init__()
        self.norm = make_norm(wc)

    def forward(self, x):
        return self.norm(x)


class ParallelLinearPipe(nn.Module):
    """Untied head: column-parallel h -> vocab, no bias, vocab-parallel logits."""

    def __init__(self, wc: WorkloadConfig):
        super().__init__()
        self.final_linear = ColumnParallelLinear(wc.hidden, wc.vocab, False, wc.init_std, wc.seed,
                                                 "head.final_linear", skip_bias_add=False)

    def forward(self, x):
        return self.final_linear(x)[0]
