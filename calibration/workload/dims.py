"""The workload's shapes, from a NeoX config: NeoX's own width rules, no torch needed.

WorkloadConfig is what every module of the workload is built from; parameter counts here
are formulas over it (full model and per tensor-parallel rank), so tests can hold the
built modules to NeoX's shapes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Tuple

from neox_perf.config.neox_keys import KEYS
from neox_perf.derive.params import gated_width_mismatch, mlp_widths

NORM_PARAMS_PER_H = {"layernorm": 2, "rmsnorm": 1, "non_parametric_layernorm": 0}
ACTIVATIONS = ("gelu", "geglu", "relu", "softsign", "swish", "mish", "silu", "reglu",
               "swiglu", "bilinear", "glu")


class UnsupportedConfig(ValueError):
    """The config uses a NeoX feature this workload does not reproduce."""


@dataclass(frozen=True)
class WorkloadConfig:
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    seq_length: int
    max_pos: int
    ffn: int  # linear1 output width (gate+up fused when gated)
    ffn_in: int  # linear2 input width
    gated: bool
    activation: str
    norm: str
    norm_eps: float
    pos_emb: str  # learned | rotary | sinusoidal | none
    rotary_pct: float
    rotary_base: int
    tied: bool
    gpt_j_residual: bool
    gpt_j_tied: bool
    bias_attn: bool
    bias_mlp: bool
    attention_types: Tuple[str, ...]  # global | flash, per layer
    vocab: int  # padded
    mp: int
    hidden_dropout: float
    attention_dropout: float
    init_std: float
    fp32_allreduce: bool
    seed: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_hidden(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def out_std(self) -> float:
        # NeoX default output_layer_init_method "scaled_normal": sigma / sqrt(2 * num_layers)
        return self.init_std / math.sqrt(2 * self.num_layers)


def padded_vocab(vocab: int, divisible_by: int, mp: int) -> int:
    multiple = divisible_by * mp
    return -(-vocab // multiple) * multiple


def _value(cfg, key):
    v = cfg.values.get(key)
    return KEYS[key][1] if v is None else v


def _unsupported(cfg) -> List[str]:
    m, problems = cfg.model, []
    if m.norm not in ("layernorm", "rmsnorm", "scalenorm", "non_parametric_layernorm"):
        problems.append(f"norm {m.norm!r} (TransformerEngine norms)")
    if m.pos_emb not in ("learned", "rotary", "sinusoidal", "none"):
        problems.append(f"pos_emb {m.pos_emb!r}")
    other = sorted(set(m.attention_types) - {"global", "flash"})
    if other:
        problems.append(f"attention types {other}")
    if m.moe_num_experts > 1:
        problems.append("MoE (moe_num_experts > 1)")
    if m.use_qk_layernorm:
        problems.append("use_qk_layernorm")
    if m.activation not in ACTIVATIONS:
        problems.append(f"activation {m.activation!r}")
    if cfg.parallel.sequence_parallel and cfg.parallel.model_parallel_size > 1:
        problems.append("sequence_parallel")
    if cfg.training.train_impl != "normal":
        problems.append(f"train_impl {cfg.training.train_impl!r}")
    for key in ("sliding_window_width", "opt_pos_emb_offset"):
        if _value(cfg, key):
            problems.append(key)
    for key in ("apply_query_key_layer_scaling", "use_mup"):
        if key in KEYS and _value(cfg, key):
            problems.append(key)
    if _value(cfg, "init_method") != "normal" or \
            _value(cfg, "output_layer_init_method") != "scaled_normal":
        problems.append("init methods other than normal / scaled_normal")
    return problems


def from_neox(cfg, vocab_size: int) -> WorkloadConfig:
    problems = _unsupported(cfg)
    if problems:
        raise UnsupportedConfig("the reference workload does not reproduce: " + ", ".join(problems))
    m, par = cfg.model, cfg.parallel
    mp = max(par.model_parallel_size, 1)
    mismatch = gated_width_mismatch(m)
    if mismatch:  # NeoX fails the same way at its first forward
        out, inp = mismatch
        raise UnsupportedConfig(f"gated MLP: linear1 gives 2 x {out // 2} features but linear2 "
                                f"expects {inp}; NeoX fails at its first forward")
    ffn, ffn_in = mlp_widths(m)
    eps_key = {"rmsnorm": "rms_norm_epsilon", "scalenorm": "scalenorm_epsilon"}.get(
        m.norm, "layernorm_epsilon")
    wc = WorkloadConfig(
        num_layers=m.num_layers, hidden=m.hidden_size, heads=m.num_attention_heads,
        kv_heads=m.num_kv_heads, seq_length=m.seq_length, max_pos=m.max_position_embeddings,
        ffn=ffn, ffn_in=ffn_in, gated=m.is_gated, activation=m.activation, norm=m.norm,
        norm_eps=float(_value(cfg, eps_key)), pos_emb=m.pos_emb, rotary_pct=m.rotary_pct,
        rotary_base=int(_value(cfg, "rotary_emb_base")), tied=not m.no_weight_tying,
        gpt_j_residual=m.gpt_j_residual, gpt_j_tied=bool(_value(cfg, "gpt_j_tied")),
        bias_attn=m.use_bias_in_attn_linear, bias_mlp=m.use_bias_in_mlp,
        attention_types=tuple(m.attention_types),
        vocab=padded_vocab(vocab_size, m.make_vocab_size_divisible_by, mp), mp=mp,
        hidden_dropout=float(_value(cfg, "hidden_dropout")),
        attention_dropout=float(_value(cfg, "attention_dropout")),
        init_std=float(_value(cfg, "init_method_std")),
        fp32_allreduce=cfg.training.fp32_allreduce, seed=int(_value(cfg, "seed")))
    check_divisibility(wc)
    return wc


def check_divisibility(wc: WorkloadConfig) -> None:
    if wc.hidden % wc.heads:
        raise UnsupportedConfig(f"hidden_size {wc.hidden} not divisible by {wc.heads} heads")
    if wc.heads % wc.kv_heads:
        raise UnsupportedConfig(f"{wc.heads} heads not divisible by num_kv_heads {wc.kv_heads}")
    for what, n in (("num_attention_heads", wc.heads), ("num_kv_heads", wc.kv_heads),
                    ("MLP width", wc.ffn), ("MLP input width", wc.ffn_in),
                    ("padded vocab", wc.vocab)):
        if n % wc.mp:
            raise UnsupportedConfig(f"{what} {n} not divisible by model_parallel_size {wc.mp}")
    if wc.gated and (wc.ffn // wc.mp) % 2:
        raise UnsupportedConfig(f"gated MLP width per TP rank {wc.ffn // wc.mp} is odd")


# ---- parameter counts -------------------------------------------------------------------

def _norm_params(wc: WorkloadConfig) -> int:
    if wc.norm == "scalenorm":
        return 1
    return NORM_PARAMS_PER_H[wc.norm] * wc.hidden


def layer_params(wc: WorkloadConfig, local: bool = False) -> int:
    """One ParallelTransformerLayerPipe; local=True: what one TP rank holds."""
    h, d = wc.hidden, (wc.mp if local else 1)
    qkv_out = h + 2 * wc.kv_hidden
    n = (h * qkv_out + (qkv_out if wc.bias_attn else 0)) // d
    n += h * h // d + (h if wc.bias_attn else 0)  # dense: bias replicated
    n += (h * wc.ffn + (wc.ffn if wc.bias_mlp else 0)) // d
    n += wc.ffn_in * h // d + (h if wc.bias_mlp else 0)
    n += 2 * _norm_params(wc)  # post_attention norm exists even with gpt_j_residual
    return n


def embedding_params(wc: WorkloadConfig, local: bool = False) -> int:
    d = wc.mp if local else 1
    return wc.vocab * wc.hidden // d + (wc.max_pos * wc.hidden if wc.pos_emb == "learned" else 0)


def spec_names(wc: WorkloadConfig) -> List[str]:
    """Names of GPT2ModelPipe's N+5 specs, as DeepSpeed prints them."""
    return (["EmbeddingPipe", "_pre_transformer_block"]
            + ["ParallelTransformerLayerPipe"] * wc.num_layers
            + ["_post_transformer_block", "NormPipe",
               "EmbeddingPipe" if wc.tied else "ParallelLinearPipe"])


def spec_params(wc: WorkloadConfig, local: bool = False) -> List[int]:
    """Parameters per spec; the tied head counts 0 (it reuses the embedding's weight)."""
    d = wc.mp if local else 1
    head = 0 if wc.tied else wc.hidden * wc.vocab // d
    return ([embedding_params(wc, local), 0] + [layer_params(wc, local)] * wc.num_layers
            + [0, _norm_params(wc), head])


def total_params(wc: WorkloadConfig) -> int:
    """Unique parameters of the full model (no TP replication, tied embedding once)."""
    return sum(spec_params(wc))
