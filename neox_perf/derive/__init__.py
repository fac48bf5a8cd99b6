"""What NeoX + DeepSpeed build from a config: layer specs, pipeline partition, parameters,
memory per GPU and FLOPs. Pure Python (no torch, deepspeed or numpy) so `check` stays fast."""
from .errors import DeriveError, PartitionError
from .flops import FlopsEstimate, flops, neox_flops_per_iteration
from .layers import PipeLayer, build_layers, checkpoint_chunks, recomputed_layers
from .memory import StageMemory, stage_memory
from .optimizer_memory import optimizer_layout, optimizer_state_bytes
from .model import DerivedModel, Stage, Tokens, derive
from .options import DEFAULT_OPTIONS, DeriveOptions
from .params import Count, ParamTotals, StageParams, mlp_widths, param_totals, stage_params
from .partition import find_layer_type, partition, partition_balanced, partition_uniform
from .vocab import padded_vocab_size

__all__ = [
    "DeriveError", "PartitionError", "FlopsEstimate", "flops", "neox_flops_per_iteration",
    "PipeLayer", "build_layers", "checkpoint_chunks", "recomputed_layers", "StageMemory",
    "optimizer_layout", "optimizer_state_bytes", "stage_memory", "DerivedModel", "Stage", "Tokens",
    "derive", "DEFAULT_OPTIONS", "DeriveOptions", "Count", "ParamTotals", "StageParams",
    "mlp_widths", "param_totals", "stage_params", "find_layer_type", "partition",
    "partition_balanced", "partition_uniform", "padded_vocab_size",
]
