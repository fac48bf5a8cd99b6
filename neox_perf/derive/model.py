"""derive(): everything GPT-NeoX + DeepSpeed will build from one config, without torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ..config.specs import NeoxConfig
from .flops import FlopsEstimate, flops
from .layers import BLOCK_NAMES, PipeLayer, build_layers, recomputed_layers
from .memory import StageMemory, stage_memory
from .options import DeriveOptions
from .params import ParamTotals, param_totals, stage_params
from .partition import partition
from .vocab import padded_vocab_size


@dataclass(frozen=True)
class Stage:
    index: int
    start: int  # first PipeLayer index (inclusive)
    stop: int  # last PipeLayer index (exclusive)
    layer_names: Tuple[str, ...]
    transformer_layers: int  # blocks (transformer / gMLP / Mamba / RWKV) in the stage
    params_per_rank: int  # DeepSpeed's STAGE_PARAMS on one TP rank, tied copy included
    unique_params: int  # over the stage's TP ranks, TP-replicated and tied copies once
    tied_copy_params: int  # per-rank elements of a tied module owned by an earlier stage
    memory: StageMemory


@dataclass(frozen=True)
class Tokens:
    per_iteration: int  # train_batch_size x seq_length
    total: Optional[int]  # x train_iters


@dataclass(frozen=True)
class DerivedModel:
    padded_vocab: int
    layers: Tuple[PipeLayer, ...]
    parts: Tuple[int, ...]  # DeepSpeed's PipelineModule.parts
    stages: Tuple[Stage, ...]
    params: ParamTotals
    flops: FlopsEstimate
    tokens: Tokens
    options: DeriveOptions
    warnings: Tuple[str, ...]  # things NeoX/DeepSpeed will do that the user may not expect


def derive(config: NeoxConfig, raw_vocab: int, gpu_memory_bytes: Optional[int] = None,
           options: Optional[DeriveOptions] = None) -> DerivedModel:
    model, parallel, training = config.model, config.parallel, config.training
    opts = options if options is not None else DeriveOptions.from_values(config.values)
    mp = max(parallel.model_parallel_size, 1)
    pipelined = parallel.pipe_parallel_size >= 1
    # NeoX builds a PipelineModule even for pp = 0 (one stage, then to_sequential), so the
    # partition method is parsed -- and can fail -- whatever pp is.
    num_stages = parallel.num_stages

    vocab = padded_vocab_size(raw_vocab, model.make_vocab_size_divisible_by, mp)
    layers = build_layers(model, mp, vocab, opts)
    parts = tuple(partition(layers, num_stages, parallel.pipe_partition_method))
    counts = stage_params(layers, parts, mp)
    totals = param_totals(layers, counts, mp)
    interval = training.checkpoint_num_layers if training.checkpoint_activations else 0
    largest = max(l.params for l in layers)

    stages = []
    for s in range(num_stages):
        chunk = layers[parts[s]:parts[s + 1]]
        mem = stage_memory(stage=s, num_stages=num_stages, layers=chunk, model=model,
                           parallel=parallel, training=training, padded_vocab=vocab,
                           stage_params=counts[s].per_rank, largest_layer_params=largest,
                           gpu_memory_bytes=gpu_memory_bytes, opts=opts)
        stages.append(Stage(
            index=s, start=parts[s], stop=parts[s + 1],
            layer_names=tuple(l.name for l in chunk),
            transformer_layers=sum(1 for l in chunk if l.is_block),
            params_per_rank=counts[s].per_rank, unique_params=counts[s].unique,
            tied_copy_params=counts[s].tied_copy, memory=mem))

    estimate = flops(model, training, layers, vocab,
                     recomputed_layers(layers, parts, interval, pipelined), opts)
    return assemble(config, opts, vocab, layers, parts, stages, totals, estimate, pipelined)


def assemble(config: NeoxConfig, opts: DeriveOptions, vocab: int, layers, parts, stages, totals,
             estimate, pipelined: bool) -> DerivedModel:
    """The derived model from its parts; `plan` builds the parts once per layout family and
    assembles each candidate here, so tokens and warnings come from one place."""
    training = config.training
    per_iter = training.train_batch_size * config.model.seq_length
    iters = training.train_iters
    tokens = Tokens(per_iter, None if iters is None else per_iter * iters)
    return DerivedModel(
        padded_vocab=vocab, layers=layers, parts=parts, stages=tuple(stages), params=totals,
        flops=estimate, tokens=tokens, options=opts,
        warnings=tuple(_warnings(config, opts, layers, stages, pipelined)))


def _warnings(config: NeoxConfig, opts: DeriveOptions, layers, stages, pipelined):
    model, parallel, training = config.model, config.parallel, config.training
    # What NeoX or DeepSpeed refuse (a gated MLP whose widths disagree, a stage without
    # parameters, soft prompts, bf16 with fp32 accumulation at ZeRO 0) are error verdicts of
    # neox_perf.refusals; these are what the run does that the user may not expect.
    out = []
    method = parallel.pipe_partition_method.lower()
    if method.startswith("type:") and parallel.num_stages > 1:
        odd = {l.name for l in layers if l.is_block} - {"ParallelTransformerLayerPipe", "GMLPBlock"}
        if odd and "transformer" in method:
            out.append(f"{', '.join(sorted(odd))} do not match '{method[5:]}': they weigh 0 in the "
                       f"partition, so stages are balanced on the other specs only")
    # ZeRO >= 2 with model parallelism is refused once, as an error: checks.config_verdicts
    if opts.train_impl in ("dpo", "kto", "reinforce"):
        out.append(f"train_impl {opts.train_impl}: NeoX builds a second (reference) model; its "
                   f"weights and forward passes are not included in memory or FLOPs")
    if opts.te_mha or opts.te_layernorm_mlp:
        out.append("TransformerEngine modules (te_mha / te_layernorm_mlp) are counted as NeoX's own "
                   "modules; their fp8 buffers and workspaces are not modelled")
    if any(l.moe for l in layers):
        out.append("MoE layers: parameters are exact, activation memory and FLOPs assume perfectly "
                   "balanced top-k routing (approximate)")
    if any(l.name in BLOCK_NAMES[1:] for l in layers if l.is_block):
        out.append("gMLP / Mamba / RWKV blocks: parameters are exact, activation memory is "
                   "approximate")
    return out
