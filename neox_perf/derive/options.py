"""NeoX / DeepSpeed settings the derivations need that ModelSpec/TrainingSpec do not carry.

They are read from NeoxConfig.values (merged, normalised keys, no defaults), falling back to the
default NeoX (megatron/neox_arguments/neox_args.py) or DeepSpeed 0.19.8 would use, so a config
that never mentions them derives exactly what NeoX builds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .errors import DeriveError


@dataclass(frozen=True)
class DeriveOptions:
    hidden_dropout: float = 0.0  # >0 stores a 1-byte mask per hidden element
    attention_dropout: float = 0.0  # >0 stores a mask and a copy of the s x s probabilities
    fp16_lm_cross_entropy: bool = False  # False: the loss upcasts the logits to fp32
    attention_softmax_in_fp32: bool = False
    apply_query_key_layer_scaling: bool = False  # forces the softmax to fp32 in NeoX
    scaled_masked_softmax_fusion: bool = False
    rmsnorm_fusion: bool = False  # unfused RMSNorm keeps fp32 copies for backward
    gpt_j_tied: bool = False  # attention and MLP share one input norm output
    gmlp_attn_dim: int = 64
    mamba_use_bias_in_conv: bool = True
    mamba_use_bias_in_linears: bool = False
    dim_att: Optional[int] = None  # RWKV; NeoX documents hidden_size as the default
    moe_top_k: int = 1
    sliding_window_width: Optional[int] = None
    train_impl: str = "normal"
    checkpoint_in_cpu: bool = False
    contiguous_checkpointing: bool = False
    # DeepSpeed sees the user's zero_optimization dict as written (NeoX only substitutes its own
    # ZERO_DEFAULTS when the key is absent), so a missing contiguous_gradients means DS's True.
    contiguous_gradients: bool = False
    cpu_offload: bool = False  # ZeRO offload_optimizer to CPU: fp32 master + states leave the GPU
    grad_accum_dtype: Optional[str] = None  # DS data_types.grad_accum_dtype (None = model dtype)
    optimizer_momentum: Optional[float] = None  # optimizer.params.momentum as written
    use_bnb_optimizer: bool = False  # 8-bit Adam states
    soft_prompt_tuning: bool = False
    stage3_prefetch_bucket_size: int = 50_000_000  # DS default, elements
    te_layernorm_mlp: bool = False
    te_mha: bool = False
    use_mup: bool = False
    rope_fusion: bool = False  # fused rotary kernel: no TorchScript rotate_half halves kept
    use_cpu_initialization: bool = False  # NeoX builds the parameters on the host first

    @classmethod
    def from_values(cls, values: Optional[Mapping[str, Any]]) -> "DeriveOptions":
        try:
            return cls._from_values(values or {})
        except (TypeError, ValueError, AttributeError) as exc:
            raise DeriveError(f"a setting the derivations read has an unusable value: {exc}")

    @classmethod
    def _from_values(cls, values: Mapping[str, Any]) -> "DeriveOptions":

        def get(key, default):
            value = values.get(key)
            return default if value is None else value

        zero = values.get("zero_optimization")
        if isinstance(zero, Mapping):
            contiguous = bool(zero.get("contiguous_gradients", True))
            offload = zero.get("offload_optimizer")
            device = offload.get("device") if isinstance(offload, Mapping) else None
            cpu_offload = bool(zero.get("cpu_offload", False)) or device in ("cpu", "nvme")
            prefetch = int(zero.get("stage3_prefetch_bucket_size", 50_000_000))
        else:
            contiguous, cpu_offload, prefetch = False, False, 50_000_000
        data_types = values.get("data_types")
        grad_accum = data_types.get("grad_accum_dtype") if isinstance(data_types, Mapping) else None
        optimizer = values.get("optimizer")
        opt_params = optimizer.get("params") if isinstance(optimizer, Mapping) else None
        momentum = opt_params.get("momentum") if isinstance(opt_params, Mapping) else None
        soft = values.get("soft_prompt_tuning")
        return cls(
            hidden_dropout=float(get("hidden_dropout", 0.0)),
            attention_dropout=float(get("attention_dropout", 0.0)),
            fp16_lm_cross_entropy=bool(get("fp16_lm_cross_entropy", False)),
            attention_softmax_in_fp32=bool(get("attention_softmax_in_fp32", False)),
            apply_query_key_layer_scaling=bool(get("apply_query_key_layer_scaling", False)),
            scaled_masked_softmax_fusion=bool(get("scaled_masked_softmax_fusion", False)),
            rmsnorm_fusion=bool(get("rmsnorm_fusion", False)),
            gpt_j_tied=bool(get("gpt_j_tied", False)),
            gmlp_attn_dim=int(get("gmlp_attn_dim", 64)),
            mamba_use_bias_in_conv=bool(get("mamba_use_bias_in_conv", True)),
            mamba_use_bias_in_linears=bool(get("mamba_use_bias_in_linears", False)),
            dim_att=values.get("dim_att"),
            moe_top_k=int(get("moe_top_k", 1)),
            sliding_window_width=values.get("sliding_window_width"),
            train_impl=str(get("train_impl", "normal")).lower(),
            checkpoint_in_cpu=bool(get("checkpoint_in_cpu", False)),
            contiguous_checkpointing=bool(get("contiguous_checkpointing", False)),
            contiguous_gradients=contiguous,
            cpu_offload=cpu_offload,
            grad_accum_dtype=str(grad_accum).lower() if grad_accum else None,
            optimizer_momentum=None if momentum is None else float(momentum),
            use_bnb_optimizer=bool(get("use_bnb_optimizer", False)),
            soft_prompt_tuning=bool(isinstance(soft, Mapping) and soft.get("enabled", False)),
            stage3_prefetch_bucket_size=prefetch,
            te_layernorm_mlp=bool(get("te_layernorm_mlp", False)),
            te_mha=bool(get("te_mha", False)) or bool(get("te_fp8_mha", False)),
            use_mup=bool(get("use_mup", False)),
            rope_fusion=bool(get("rope_fusion", False)),
            use_cpu_initialization=bool(get("use_cpu_initialization", False)),
        )


DEFAULT_OPTIONS = DeriveOptions()
