"""Parameter counts from the shapes NeoX's modules allocate on one tensor-parallel (TP) rank.

Each count follows megatron/model/*.py and megatron/mpu/layers.py, not a paper formula:
ColumnParallelLinear splits weight and bias over TP; RowParallelLinear splits the weight but keeps
the full bias on every rank; norms, learned position tables and plain nn.Linear/nn.Embedding
modules are whole on every rank. `Count.replicated` is the part that is the same tensor on every
TP rank, so unique totals count it once while NeoX's own logged total counts it mp times.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import Optional, Sequence, Tuple

from ..config.specs import ModelSpec
from .errors import DeriveError
from .options import DEFAULT_OPTIONS, DeriveOptions

MAMBA_D_STATE = 16  # hard-coded in megatron/model/mamba/mamba.py
MAMBA_D_CONV = 4
RWKV_TIME_MIX_EXTRA_DIM = 32  # hard-coded in megatron/model/rwkv/v6/rwkv.py
RWKV_TIME_DECAY_EXTRA_DIM = 64
MOE_MULTIPLE_OF = 256  # ParallelGroupedMLP's signature default; NeoX does not pass mlp_multiple_of


@dataclass(frozen=True)
class Count:
    per_rank: int  # elements on one TP rank
    replicated: int = 0  # of per_rank, elements that are the same tensor on every TP rank

    def __add__(self, other: "Count") -> "Count":
        return Count(self.per_rank + other.per_rank, self.replicated + other.replicated)

    def unique(self, mp: int) -> int:
        """Distinct elements over all TP ranks."""
        return (self.per_rank - self.replicated) * mp + self.replicated


ZERO = Count(0, 0)


def split(n: int, mp: int, what: str) -> int:
    """n / mp, refusing what megatron.mpu.divide asserts on."""
    if n % mp:
        raise DeriveError(f"{what} ({n}) is not divisible by model_parallel_size ({mp}); "
                          f"NeoX asserts in mpu.divide")
    return n // mp


def norm_params(norm: str, dim: int) -> int:
    """Parameters of one norm module over `dim` features (megatron/model/norms.py)."""
    if norm in ("layernorm", "te_layernorm"):
        return 2 * dim  # torch/TE LayerNorm: weight + bias (use_bias_in_norms is never read)
    if norm in ("rmsnorm", "te_rmsnorm"):
        return dim  # scale only; NeoX never passes bias=True to RMSNorm
    if norm == "scalenorm":
        return 1  # a single gain g
    if norm == "non_parametric_layernorm":
        return 0
    raise DeriveError(f"norm {norm!r} is not one NeoX knows (get_norm raises)")


def mlp_widths(model: ModelSpec) -> Tuple[int, int]:
    """(linear1 output, linear2 input) of ParallelMLP, before TP splitting.

    Reproduces ParallelMLP.__init__ line by line, including the float `* 2 / 3` and the
    rounding of linear1 to a multiple of 2*mlp_multiple_of (even with mlp_multiple_of = 1).
    """
    if model.intermediate_size is not None and model.expansion_factor is not None:
        raise DeriveError("intermediate_size and expansion_factor are both set; "
                          "ParallelMLP asserts only one may be given")
    h = model.hidden_size
    if model.intermediate_size:
        ffn = model.intermediate_size
    elif model.expansion_factor:
        ffn = int(model.expansion_factor * h)
    else:
        ffn = 4 * h
    ffn_in = ffn
    if model.is_gated:
        ffn = int(ffn * 2 / 3)
        ffn_in = ffn // 2
    m = model.mlp_multiple_of
    ffn = int((2 * m) * ((ffn + (2 * m) - 1) // (2 * m)))
    ffn_in = int(m * ((ffn_in + m - 1) // m))
    return ffn, ffn_in


def gated_width_mismatch(model: ModelSpec) -> Optional[Tuple[int, int]]:
    """Gated_Activation chunks linear1's output in two; linear2 expects ffn_in. When they differ,
    (linear1 output, linear2 input); else None."""
    if not model.is_gated:
        return None
    out, inp = mlp_widths(model)
    return (out, inp) if out != 2 * inp else None


def _column(in_f: int, out_f: int, mp: int, bias: bool, what: str) -> Count:
    out_r = split(out_f, mp, what)
    return Count(out_r * in_f + (out_r if bias else 0), 0)


def _row(in_f: int, out_f: int, mp: int, bias: bool, what: str) -> Count:
    # The bias is added after the all-reduce, so every rank holds all of it.
    in_r = split(in_f, mp, what)
    return Count(in_r * out_f + (out_f if bias else 0), out_f if bias else 0)


def qkv_width(model: ModelSpec) -> int:
    """query_key_value output width: 3h, or h + 2*kv*head_dim when num_kv_heads != heads."""
    h = model.hidden_size
    if model.num_kv_heads and model.num_kv_heads != model.num_attention_heads:
        return h + 2 * model.num_kv_heads * model.head_dim
    return 3 * h


def attention_params(model: ModelSpec, mp: int) -> Count:
    h = model.hidden_size
    split(model.num_attention_heads, mp, "num_attention_heads")
    if qkv_width(model) != 3 * h:
        split(model.num_kv_heads, mp, "num_kv_heads")
    c = _column(h, qkv_width(model), mp, model.use_bias_in_attn_linear, "query_key_value width")
    c += _row(h, h, mp, model.use_bias_in_attn_linear, "hidden_size")
    if model.use_qk_layernorm:
        # norm([heads/mp, head_dim]): a per-partition shape, so each rank's tensor is its own.
        c += Count(norm_params(model.norm, 1) * (h // mp) if model.norm != "scalenorm" else 1, 0)
    # rotary / alibi / sinusoidal keep buffers only; sparse attention configs hold no weights.
    return c


def mlp_params(model: ModelSpec, mp: int) -> Count:
    h = model.hidden_size
    out, inp = mlp_widths(model)
    return (_column(h, out, mp, model.use_bias_in_mlp, "MLP linear1 width")
            + _row(inp, h, mp, model.use_bias_in_mlp, "MLP linear2 input width"))


def moe_expert_width(model: ModelSpec) -> int:
    if model.intermediate_size is not None:
        return model.intermediate_size
    return MOE_MULTIPLE_OF * ceil(4 * model.hidden_size / MOE_MULTIPLE_OF)


def moe_params(model: ModelSpec, mp: int) -> Count:
    """ParallelDroplessMoE: router Linear(h, E) on every rank + w1, w2 of E/mp experts each."""
    h, experts = model.hidden_size, model.moe_num_experts
    per_rank_experts = split(experts, mp, "moe_num_experts")
    router = h * experts
    return Count(router + 2 * per_rank_experts * moe_expert_width(model) * h, router)


def is_moe_layer(model: ModelSpec, layer_number: int) -> bool:
    return model.moe_num_experts > 1 and layer_number % model.moe_expert_interval == 0


def transformer_layer_params(model: ModelSpec, mp: int, layer_number: int) -> Count:
    """ParallelTransformerLayer without the shared RPE table (see rpe_params)."""
    n = norm_params(model.norm, model.hidden_size)
    norm = Count(n, n)
    # post_attention_layernorm is built even with gpt_j_residual / gpt_j_tied (unused but allocated).
    # TransformerEngine variants (te_layernorm_mlp moves this norm inside the MLP) are assumed to
    # allocate the same shapes; they are not modelled separately.
    norms = norm + norm
    mlp = moe_params(model, mp) if is_moe_layer(model, layer_number) else mlp_params(model, mp)
    return norms + attention_params(model, mp) + mlp


def rpe_params(model: ModelSpec, mp: int) -> Count:
    """ParallelRelativePositionBias: one module shared by every transformer layer of a stage."""
    if model.pos_emb != "rpe":
        return ZERO
    heads_r = split(model.num_attention_heads, mp, "num_attention_heads")
    return Count(model.rpe_num_buckets * heads_r, 0)


def gmlp_params(model: ModelSpec, mp: int, amlp: bool, opts: DeriveOptions = DEFAULT_OPTIONS) -> Count:
    """GMLPBlock (megatron/model/gmlp.py), ff_mult = 4, linears with their default bias=True."""
    h, s = model.hidden_size, model.seq_length
    ff = 4 * h
    ff_r = split(ff, mp, "gMLP ff dim")
    c = Count(norm_params(model.norm, h), norm_params(model.norm, h))
    c += _column(h, 2 * ff, mp, True, "gMLP input_linear width")
    # SpatialGatingUnit works on this rank's channels only, so its tensors differ per rank.
    c += Count(norm_params(model.norm, ff_r) + s * s + s, 0)
    if amlp:
        d_attn = opts.gmlp_attn_dim
        c += Count((2 * ff_r) * 3 * d_attn + 3 * d_attn + d_attn * ff_r + ff_r, 0)
    c += _row(ff, h, mp, True, "gMLP ff dim")
    return c


def mamba_inner(model: ModelSpec) -> int:
    if model.intermediate_size:
        return model.intermediate_size
    expand = model.expansion_factor if model.expansion_factor else 2
    return int(expand * model.hidden_size)


def mamba_params(model: ModelSpec, mp: int, opts: DeriveOptions = DEFAULT_OPTIONS) -> Count:
    """ParallelMambaResidualLayer: norm + ParallelMambaBlock (megatron/model/mamba/mamba.py)."""
    h = model.hidden_size
    d_inner = mamba_inner(model)
    di_r = split(d_inner, mp, "Mamba d_inner")
    dt_rank = ceil(h / 16)
    lin_bias = opts.mamba_use_bias_in_linears
    c = Count(norm_params(model.norm, h), norm_params(model.norm, h))
    c += _column(h, 2 * d_inner, mp, lin_bias, "Mamba in_proj width")
    c += Count(di_r * MAMBA_D_CONV + (di_r if opts.mamba_use_bias_in_conv else 0), 0)
    c += _row(d_inner, dt_rank + 2 * MAMBA_D_STATE, mp, lin_bias, "Mamba d_inner")
    c += Count(dt_rank * di_r + di_r, 0)  # dt_proj, always with bias
    c += Count(di_r * MAMBA_D_STATE + di_r, 0)  # A_log, D
    c += _row(d_inner, h, mp, lin_bias, "Mamba d_inner")
    return c


def rwkv_widths(model: ModelSpec, opts: DeriveOptions = DEFAULT_OPTIONS) -> Tuple[int, int]:
    """(dim_att, ffn_dim) as RWKVResidualLayer sets them."""
    h = model.hidden_size
    dim_att = opts.dim_att or h
    if model.intermediate_size:
        ffn = model.intermediate_size
    else:
        ffn = int((model.expansion_factor if model.expansion_factor else 3.5) * h)
    return dim_att, int(ffn // 32 * 32)


def rwkv_params(model: ModelSpec, opts: DeriveOptions = DEFAULT_OPTIONS) -> Count:
    """RWKVResidualLayer v6: plain torch modules, so every TP rank holds all of it."""
    h = model.hidden_size
    att, ffn = rwkv_widths(model, opts)
    time_mix = (6 * h  # time_maa_x, w, k, v, r, g
                + h * RWKV_TIME_MIX_EXTRA_DIM * 5 + 5 * RWKV_TIME_MIX_EXTRA_DIM * h
                + att + h * RWKV_TIME_DECAY_EXTRA_DIM + RWKV_TIME_DECAY_EXTRA_DIM * att
                + att  # time_faaaa (heads x head_size)
                + 4 * h * att + att * h  # receptance, key, value, gate; output
                + 2 * att)  # ln_x GroupNorm(affine)
    channel_mix = 2 * h + h * ffn + h * h + ffn * h
    total = 4 * h + time_mix + channel_mix  # ln1, ln2 are torch LayerNorms
    return Count(total, total)


def embedding_params(model: ModelSpec, mp: int, padded_vocab: int) -> Count:
    """EmbeddingPipe: VocabParallelEmbedding split over TP + learned position table on every rank."""
    h = model.hidden_size
    words = Count(split(padded_vocab, mp, "padded vocab") * h, 0)
    if model.pos_emb == "learned":
        return words + Count(model.max_position_embeddings * h, model.max_position_embeddings * h)
    return words


def final_norm_params(model: ModelSpec) -> Count:
    n = norm_params(model.norm, model.hidden_size)
    return Count(n, n)


def head_params(model: ModelSpec, mp: int, padded_vocab: int,
                opts: DeriveOptions = DEFAULT_OPTIONS) -> Count:
    """Untied ParallelLinearPipe: column-parallel h -> V_pad without bias (rm: row-parallel h -> 1)."""
    if opts.train_impl == "rm":
        return Count(split(model.hidden_size, mp, "hidden_size"), 0)
    return Count(split(padded_vocab, mp, "padded vocab") * model.hidden_size, 0)


# ---------------------------------------------------------------------------------------------
# Aggregation over the pipeline layer list (duck-typed: any objects with the PipeLayer fields).

@dataclass(frozen=True)
class StageParams:
    per_rank: int  # DeepSpeed's STAGE_PARAMS: what one GPU of this stage holds (tied copy included)
    unique: int  # distinct elements over the stage's TP ranks, tied copies excluded
    tied_copy: int  # per-rank elements of tied modules whose owner is an earlier stage


@dataclass(frozen=True)
class ParamTotals:
    unique: int  # every trained tensor once: TP-replicated once, tied embedding once
    per_rank_max: int  # largest per-GPU parameter count over stages
    neox_logged: int  # megatron/utils.py:get_total_params (`> total params:` in NeoX's log)
    embedding: int  # unique elements of the word/position embeddings and an untied output head
    non_embedding: int  # unique - embedding


def stage_params(layers: Sequence, parts: Sequence[int], mp: int) -> Tuple[StageParams, ...]:
    """Per-stage counts the way PipelineModule._build instantiates a stage.

    A TiedLayerSpec builds its module once per stage (the first spec with that key in the stage);
    the stage holding the key's first spec overall owns it, later stages hold copies that are
    all-reduced. The shared RPE module is one nn.Module per stage, so parameters() counts it once.
    """
    owners = {}
    for layer in layers:
        if layer.tied_key is not None and layer.tied_key not in owners:
            owners[layer.tied_key] = layer.index
    out = []
    for s in range(len(parts) - 1):
        per_rank = unique = tied_copy = 0
        seen_tied = set()
        shared = None
        for layer in layers[parts[s]:parts[s + 1]]:
            count = Count(layer.params - layer.shared, layer.replicated)
            if layer.tied_key is not None:
                if layer.tied_key in seen_tied:
                    continue
                seen_tied.add(layer.tied_key)
                if owners[layer.tied_key] < parts[s]:
                    tied_copy += count.per_rank
                    per_rank += count.per_rank
                    continue
            if layer.shared:
                shared = layer.shared
            per_rank += count.per_rank
            unique += count.unique(mp)
        if shared:
            per_rank += shared
            unique += shared * mp  # the RPE table is split over heads
        out.append(StageParams(per_rank, unique, tied_copy))
    return tuple(out)


def param_totals(layers: Sequence, stages: Sequence[StageParams], mp: int) -> ParamTotals:
    unique = sum(s.unique for s in stages)
    embedding = 0
    seen = set()
    for layer in layers:
        if layer.kind in ("embedding", "head") and layer.tied_key not in seen:
            if layer.tied_key is not None:
                seen.add(layer.tied_key)
            embedding += Count(layer.params, layer.replicated).unique(mp)
    return ParamTotals(
        unique=unique,
        per_rank_max=max(s.per_rank for s in stages),
        # get_total_params all-reduces every dp-rank-0 process's sum(p.numel()): all TP ranks of
        # all stages, so replicated tensors count mp times and a tied copy counts again.
        neox_logged=mp * sum(s.per_rank for s in stages),
        embedding=embedding,
        non_embedding=unique - embedding,
    )
