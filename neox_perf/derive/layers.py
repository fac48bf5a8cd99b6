"""The layer-spec list GPT2ModelPipe.init_specs hands to DeepSpeed's PipelineModule.

Order (megatron/model/gpt2_model.py): EmbeddingPipe, the `_pre_transformer_block` function, one
block per layer (chosen by attention_config), the `_post_transformer_block` function, NormPipe,
then the head (tied: the "embed" TiedLayerSpec again, with _logits_helper; untied:
ParallelLinearPipe) -- N + 5 specs. Names are what DeepSpeed's `_find_layer_type` matches:
LayerSpec.typename.__name__ for classes, __name__ for plain functions.

Not inserted: the SoftEmbedding of soft_prompt_tuning (get_model would insert it at index 1, but
SoftEmbedding.__init__ at NeoX HEAD calls initialize_embedding(wte) on a method that takes no
argument, so the run dies with a TypeError before the pipeline exists; derive() warns instead).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Sequence, Tuple

from ..config.specs import ModelSpec
from .options import DEFAULT_OPTIONS, DeriveOptions
from .params import (Count, embedding_params, final_norm_params, gmlp_params, head_params,
                     is_moe_layer, mamba_params, rpe_params, rwkv_params, transformer_layer_params)

EMBEDDING = "EmbeddingPipe"
PRE_BLOCK = "_pre_transformer_block"
POST_BLOCK = "_post_transformer_block"
TRANSFORMER = "ParallelTransformerLayerPipe"
GMLP = "GMLPBlock"
RWKV = "RWKVResidualLayerPipe"
MAMBA = "ParallelMambaResidualLayerPipe"
NORM = "NormPipe"
LINEAR_HEAD = "ParallelLinearPipe"
BLOCK_NAMES = (TRANSFORMER, GMLP, RWKV, MAMBA)

# GPT2ModelPipe passes checkpointable_layers to PipelineModule; DeepSpeed's _is_checkpointable for a
# "GPT2ModelPipe" accepts a chunk only if every function in it is one of these (or contains
# "ParallelTransformerLayerPipe"). RWKV is only added by insert_layers (soft prompts).
PIPE_CHECKPOINTABLE = (TRANSFORMER, GMLP, MAMBA)
# pp = 0 runs SequentialWrapper, whose _is_checkpointable only accepts transformer layers.
SEQUENTIAL_CHECKPOINTABLE = (TRANSFORMER,)


@dataclass(frozen=True)
class PipeLayer:
    index: int  # position in PipelineModule's layer list
    name: str  # class or function name as DeepSpeed's _find_layer_type sees it
    kind: str  # embedding | function | block | norm | head
    params: int  # per TP rank when DeepSpeed builds this spec alone (_count_layer_params)
    replicated: int = 0  # of params, the part that is identical on every TP rank
    shared: int = 0  # of params, the RPE table shared by all transformer layers of a stage
    tied_key: Optional[str] = None  # "embed" for the tied embedding and the tied head
    layer_number: Optional[int] = None  # transformer layer number (0-based) for blocks
    attention_type: Optional[str] = None  # attention_config entry for blocks
    moe: bool = False

    @property
    def is_function(self) -> bool:
        return self.kind == "function"

    @property
    def is_block(self) -> bool:
        return self.kind == "block"


def block_name(attention_type: str) -> str:
    if attention_type in ("gmlp", "amlp"):
        return GMLP
    if attention_type == "rwkv":
        return RWKV
    if attention_type == "mamba":
        return MAMBA
    return TRANSFORMER


def _layer(index: int, name: str, kind: str, count: Count, **kw) -> PipeLayer:
    return PipeLayer(index=index, name=name, kind=kind, params=count.per_rank,
                     replicated=count.replicated, **kw)


def build_layers(model: ModelSpec, mp: int, padded_vocab: int,
                 opts: DeriveOptions = DEFAULT_OPTIONS) -> Tuple[PipeLayer, ...]:
    mp = max(mp, 1)
    tied = not model.no_weight_tying
    key = "embed" if tied else None
    embed = embedding_params(model, mp, padded_vocab)
    layers = [_layer(0, EMBEDDING, "embedding", embed, tied_key=key),
              PipeLayer(1, PRE_BLOCK, "function", 0)]
    rpe = rpe_params(model, mp)
    dense_or_moe = {}  # a transformer layer's count depends on its number only through MoE
    for i, attention_type in enumerate(model.attention_types):
        name = block_name(attention_type)
        index = len(layers)
        common = dict(layer_number=i, attention_type=attention_type)
        if name == GMLP:
            count = gmlp_params(model, mp, attention_type == "amlp", opts)
            layers.append(_layer(index, name, "block", count, **common))
        elif name == RWKV:
            layers.append(_layer(index, name, "block", rwkv_params(model, opts), **common))
        elif name == MAMBA:
            layers.append(_layer(index, name, "block", mamba_params(model, mp, opts), **common))
        else:
            # Every layer's ParallelSelfAttention registers the one rpe module as a submodule, so a
            # layer built alone (DeepSpeed's parameter weighting) includes the whole table.
            moe = is_moe_layer(model, i)
            count = dense_or_moe.get(moe)
            if count is None:
                count = dense_or_moe[moe] = transformer_layer_params(model, mp, i) + rpe
            layers.append(PipeLayer(index, name, "block", count.per_rank, count.replicated,
                                    shared=rpe.per_rank, moe=moe, **common))
    n = len(layers)
    layers.append(PipeLayer(n, POST_BLOCK, "function", 0))
    layers.append(_layer(n + 1, NORM, "norm", final_norm_params(model)))
    if tied:
        # TiedLayerSpec builds a whole EmbeddingPipe (position table included) on the last stage.
        layers.append(_layer(n + 2, EMBEDDING, "head", embed, tied_key=key))
    else:
        layers.append(_layer(n + 2, LINEAR_HEAD, "head", head_params(model, mp, padded_vocab, opts)))
    return tuple(layers)


def checkpointable(name: str, pipelined: bool) -> bool:
    if pipelined:
        return TRANSFORMER in name or name in PIPE_CHECKPOINTABLE
    return TRANSFORMER in name


def checkpoint_chunks(names: Sequence[str], interval: int,
                      pipelined: bool) -> List[Tuple[int, int, bool]]:
    """(start, stop, checkpointed) chunks of one stage's specs, cut like PipelineModule.forward
    (pp >= 1) or SequentialWrapper.forward (pp = 0): consecutive groups of `interval` specs from
    the stage's first spec; a group is recomputed only if every spec in it is checkpointable.
    interval 0 (checkpoint_activations off) gives one un-checkpointed chunk."""
    if interval <= 0:
        return [(0, len(names), False)]
    out = []
    for start in range(0, len(names), interval):
        stop = min(start + interval, len(names))
        out.append((start, stop, all(checkpointable(n, pipelined) for n in names[start:stop])))
    return out


def recomputed_layers(layers: Sequence[PipeLayer], parts: Sequence[int], interval: int,
                      pipelined: bool) -> FrozenSet[int]:
    """Indices of the specs whose forward runs twice (inside a checkpointed chunk)."""
    out = set()
    for s in range(len(parts) - 1):
        stage = layers[parts[s]:parts[s + 1]]
        for start, stop, ckpt in checkpoint_chunks([l.name for l in stage], interval, pipelined):
            if ckpt:
                out.update(l.index for l in stage[start:stop])
    return frozenset(out)
