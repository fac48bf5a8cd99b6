"""What a GPT-NeoX config says, as frozen dataclasses: model, parallel layout, training.

Every field holds the value NeoX would use after applying its defaults, so later layers
never consult the raw YAML again. Units: counts, tokens, bytes; no timing here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

GATED_ACTIVATIONS = ("geglu", "reglu", "swiglu", "bilinear", "glu")


@dataclass(frozen=True)
class ModelSpec:
    num_layers: int  # transformer layers (N)
    hidden_size: int  # d
    num_attention_heads: int  # query heads
    num_kv_heads: int  # key/value heads; equals num_attention_heads unless GQA/MQA
    seq_length: int  # tokens per sample
    max_position_embeddings: int  # rows of the learned position table
    intermediate_size: Optional[int]  # explicit MLP width before NeoX's gating/multiple rules
    expansion_factor: Optional[float]  # MLP width as a multiple of d, when intermediate_size is unset
    mlp_multiple_of: int  # NeoX rounds MLP widths up to multiples of this
    activation: str  # gelu, swiglu, ...; gated ones fuse gate+up into linear1
    norm: str  # layernorm | rmsnorm | scalenorm | non_parametric_layernorm | te_*
    pos_emb: str  # learned | rotary | sinusoidal | rpe | alibi | none
    rotary_pct: float  # fraction of each head's dims that rotary touches
    no_weight_tying: bool  # True: separate output head; False: head reuses the embedding
    gpt_j_residual: bool  # parallel attention+MLP with a single TP reduction
    use_bias_in_attn_linear: bool  # biases on QKV and attention dense
    use_bias_in_mlp: bool  # biases on both MLP linears
    use_qk_layernorm: bool  # norm on q and k per head (adds parameters)
    attention_types: Tuple[str, ...]  # one entry per layer after NeoX's expansion of attention_config
    fused_softmax: bool  # scaled_upper_triang_masked_softmax_fusion requested
    make_vocab_size_divisible_by: int  # NeoX pads vocab to a multiple of this x mp
    tokenizer_type: str  # GPT2BPETokenizer, HFTokenizer, SPMTokenizer, ...
    vocab_file: Optional[str]  # as written in the config
    moe_num_experts: int  # 1 = dense
    moe_expert_interval: int  # every k-th layer is MoE
    rpe_num_buckets: int  # T5-style relative position buckets (pos_emb == rpe)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def is_gated(self) -> bool:
        return self.activation in GATED_ACTIVATIONS

    @property
    def uses_flash(self) -> bool:
        return "flash" in self.attention_types


@dataclass(frozen=True)
class ParallelSpec:
    world_size: int  # total GPUs (ranks)
    world_size_source: str  # where world_size came from: --gpus, --nodes, global_num_gpus
    pipe_parallel_size: int  # as configured: 0 means no PipelineModule (sequential)
    model_parallel_size: int  # tensor parallel degree (mp)
    data_parallel_size: int  # world / (max(pp,1) * mp)
    pipe_partition_method: str  # type:<regex> | parameters | uniform
    sequence_parallel: bool  # Megatron SP (only meaningful with mp > 1)
    gpus_per_node: int  # from the cluster profile or --gpus-per-node

    @property
    def num_stages(self) -> int:
        return max(self.pipe_parallel_size, 1)


@dataclass(frozen=True)
class TrainingSpec:
    micro_batch_size: int  # train_micro_batch_size_per_gpu
    gradient_accumulation_steps: int  # micro-batches per optimizer step
    train_batch_size: int  # global samples per step = micro x gas x dp
    train_iters: Optional[int]  # optimizer steps of the run, if set
    precision: str  # fp16 | bfloat16 | fp32
    zero_stage: int  # DeepSpeed ZeRO stage
    reduce_bucket_size: int  # ZeRO gradient bucket (elements)
    allgather_bucket_size: int  # ZeRO-1 parameter all-gather bucket (elements)
    overlap_comm: bool  # ZeRO overlaps reduction with backward
    optimizer_type: str  # adam, cpu_adam, sgd, lion, ...
    checkpoint_activations: bool  # recompute each chunk's forward in backward
    checkpoint_num_layers: int  # layers per checkpointed chunk
    partition_activations: bool  # checkpoints split across TP ranks
    fp32_allreduce: bool  # gradients reduced in fp32
    train_impl: str  # normal | dpo | kto | rm | reinforce


@dataclass(frozen=True)
class NeoxConfig:
    model: ModelSpec
    parallel: ParallelSpec
    training: TrainingSpec
    files: Tuple[str, ...]  # config files, in merge order
    values: dict = field(repr=False, compare=False)  # merged, normalised top-level keys (no defaults)
    sources: dict = field(repr=False, compare=False)  # key -> file that set it
