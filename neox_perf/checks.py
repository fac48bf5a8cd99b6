"""Verdicts on a config: what NeoX/DeepSpeed would refuse, and what will not fit or is odd.

"error" mirrors a refusal in NeoX (arguments.py, gpt2_model.py, training.py:get_model) or
DeepSpeed (PipelineModule); "fail" is a valid config that will not work as wanted.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from .config.specs import NeoxConfig
from .config.verdicts import Verdict


def _src(cfg: NeoxConfig, key: str) -> Optional[str]:
    return cfg.sources.get(key)


def config_verdicts(cfg: NeoxConfig) -> List[Verdict]:
    m, p, t = cfg.model, cfg.parallel, cfg.training
    mp, out = p.model_parallel_size, []

    def add(code, level, message, key, fix):
        out.append(Verdict(code, level, message, key=key, file=_src(cfg, key), fix=fix))

    if m.hidden_size % m.num_attention_heads:
        add("hidden_divisible_by_heads", "error",
            f"hidden_size {m.hidden_size} is not divisible by num_attention_heads {m.num_attention_heads}",
            "hidden_size", "choose heads that divide hidden_size")
    if m.num_attention_heads % mp:
        add("heads_divisible_by_mp", "error",
            f"num_attention_heads {m.num_attention_heads} is not divisible by model_parallel_size {mp}",
            "model_parallel_size", "use a model_parallel_size that divides the head count")
    from .derive.params import mlp_widths
    widths = mlp_widths(m)
    if any(w % mp for w in widths):  # mpu.divide asserts in ColumnParallelLinear/RowParallelLinear
        add("mlp_divisible_by_mp", "error",
            f"the MLP widths {'/'.join(map(str, widths))} are not divisible by model_parallel_size {mp}",
            "model_parallel_size", "use a model_parallel_size that divides the MLP width "
                                   "(or set intermediate_size to a multiple of it)")
    if m.num_kv_heads != m.num_attention_heads:
        if m.num_attention_heads % m.num_kv_heads:
            add("kv_heads_divide_heads", "error",
                f"num_kv_heads {m.num_kv_heads} does not divide num_attention_heads "
                f"{m.num_attention_heads}", "num_kv_heads", "use a divisor of the head count")
        if m.num_kv_heads % mp:
            add("kv_heads_divisible_by_mp", "error",
                f"num_kv_heads {m.num_kv_heads} is not divisible by model_parallel_size {mp}",
                "num_kv_heads", "NeoX needs at least one KV head per tensor-parallel rank")
        if set(m.attention_types) - {"global", "flash"}:
            add("gqa_attention_type", "error", "GQA/MQA works only with flash or global attention",
                "attention_config", "use global or flash attention with num_kv_heads")
    if m.pos_emb == "learned" and m.seq_length > m.max_position_embeddings:
        add("seq_within_positions", "error",
            f"seq_length {m.seq_length} exceeds max_position_embeddings {m.max_position_embeddings}",
            "seq_length", "raise max_position_embeddings or shorten seq_length")
    elif m.seq_length > m.max_position_embeddings:
        # NeoX's validate_values refuses this whatever the position embedding.
        add("seq_within_positions", "error",
            f"seq_length {m.seq_length} exceeds max_position_embeddings {m.max_position_embeddings}",
            "max_position_embeddings", "set max_position_embeddings >= seq_length")
    if t.zero_stage >= 2 and (p.pipe_parallel_size >= 1 or mp > 1):
        add("zero_with_model_parallel", "error",
            f"ZeRO stage {t.zero_stage} with pipe_parallel_size {p.pipe_parallel_size} / "
            f"model_parallel_size {mp}: NeoX's get_model exits", "zero_optimization",
            "use ZeRO stage 0 or 1, or pipe_parallel_size 0 and model_parallel_size 1")
    if m.intermediate_size and m.expansion_factor:
        add("mlp_size_twice", "error", "intermediate_size and expansion_factor are both set",
            "expansion_factor", "set only one of them")
    if m.moe_num_experts > 1 and t.zero_stage >= 2:
        add("moe_zero", "error", "MoE is not compatible with ZeRO stage 2 and 3",
            "zero_optimization", "use ZeRO stage 0 or 1")
    if p.sequence_parallel and mp == 1:
        add("sequence_parallel_noop", "warning", "sequence_parallel has no effect with model_parallel_size 1",
            "sequence_parallel", "drop it or raise model_parallel_size")
    aligned = _aligned_head_counts(m, mp, t.precision)
    if aligned is not None:
        others = " or ".join(str(a) for a in aligned) or "a head count"
        add("head_dim_unaligned", "warning",
            f"head dimension {m.head_dim} (hidden_size {m.hidden_size} / {m.num_attention_heads} "
            f"heads) is not a multiple of 8: 16-bit tensor cores read 16-byte rows, so the "
            f"attention matmuls run off their aligned kernels, which no operator sample shows "
            f"(BigScience measured such BLOOM layouts 40% slower than 64 or 96 heads); the "
            f"predicted time is likely short", "num_attention_heads",
            f"use {others} heads (head dimension a multiple of 8)")
    if t.precision == "fp32":
        add("fp32_training", "warning", "neither fp16 nor bf16 is enabled: training runs in fp32",
            "fp16", "enable fp16 or bf16 unless fp32 is intended")
    from .refusals import config_refusals
    return out + config_refusals(cfg)


def _aligned_head_counts(m, mp: int, precision: str) -> Optional[List[int]]:
    """None when the head dimension is fine; else the two head counts nearest the config's whose
    head dimension is a multiple of 8 (and that divide hidden_size and model parallelism).

    Why 8: tensor cores take 16-bit operands in rows of 16 bytes (cuBLAS documentation, "Tensor
    Core Usage"); the attention matmuls' inner dimension is the head dimension. BLOOM's layout
    search on Jean Zay timed 13824 / 128 = 108 at 147.4 s where 64 and 96 heads ran 103.5 and
    107.1 s (docs/cross-cluster.md). Flash attention pads the head dimension itself; fp32 runs no
    16-bit kernel. A GQA config keeps its own head structure: no count is offered."""
    if (m.hidden_size % m.num_attention_heads or m.head_dim % 8 == 0 or precision == "fp32"
            or all(a == "flash" for a in m.attention_types)):
        return None
    if m.num_kv_heads != m.num_attention_heads:
        return []
    fits = [a for a in range(mp, m.hidden_size // 8 + 1, mp)
            if m.hidden_size % a == 0 and (m.hidden_size // a) % 8 == 0]
    return sorted(sorted(fits, key=lambda a: (abs(a - m.num_attention_heads), a))[:2])


def derived_verdicts(cfg: NeoxConfig, derived) -> List[Verdict]:
    """What only the derived pipeline shows: stages DeepSpeed cannot build, stages without blocks."""
    from .refusals import derived_refusals
    return derived_refusals(cfg, derived) + stage_verdicts(
        cfg, [s.transformer_layers for s in derived.stages])


def stage_verdicts(cfg: NeoxConfig, transformer_layers: Sequence[int]) -> List[Verdict]:
    out = []
    for i, n in enumerate(transformer_layers):
        if n == 0:
            out.append(Verdict(
                "stage_without_layers", "warning",
                f"pipeline stage {i} holds no transformer layer", key="pipe_parallel_size",
                file=_src(cfg, "pipe_parallel_size"),
                fix="use fewer pipeline stages or another pipe_partition_method"))
    return out


def memory_verdicts(fit, stage_bytes: Sequence[int], gpu: str, fix: Optional[str] = None,
                    key: str = "train_micro_batch_size_per_gpu",
                    quiet_when_fits: bool = False) -> List[Verdict]:
    """`fit`: derive.fit.memory_fit's verdict on the stages (None: no GPU to judge against);
    `stage_bytes`: each stage's predicted device total (what nvidia-smi will show). `fix`,
    `key`: what to change (advice.memory_fix follows the dominant term). quiet_when_fits: no
    "fits" line (a config NeoX refuses never ends on OK)."""
    if fit is None:
        return []
    gib = 2 ** 30
    cap, (low, high) = fit.usable, fit.band
    fix = fix or "enable checkpoint_activations, lower the micro-batch, or add pipeline/model parallelism"
    out = []
    for i in fit.over:
        used = stage_bytes[i]
        out.append(Verdict(
            "out_of_memory", "fail",
            f"stage {i} needs {used / gib:.1f} GiB per GPU, {(used - cap) / gib:.1f} GiB more than "
            f"the {cap / gib:.1f} GiB the {gpu} lets a process use (beyond what predictions have "
            f"run over, {high / gib:.1f} GiB)", key=key, fix=fix))
    if fit.level == "warning":
        used = fit.device_total
        side = (f"{(used - cap) / gib:.1f} GiB above" if used > cap
                else f"{(cap - used) / gib:.1f} GiB below")
        out.append(Verdict(
            "may_run_out_of_memory", "warning",
            f"stage {fit.stage} may run out of memory: it needs {used / gib:.1f} GiB per GPU, {side} "
            f"the {cap / gib:.1f} GiB the {gpu} lets a process use, in the band "
            f"({low / gib:.1f}-{high / gib:.1f} GiB) where measured runs went both ways; the largest "
            f"term is {fit.dominant}", key=key, fix=fix))
    if fit.level == "ok" and not quiet_when_fits:
        worst = fit.device_total
        out.append(Verdict("fits_in_memory", "ok",
                           f"every stage fits: at most {worst / gib:.1f} of {cap / gib:.1f} GiB "
                           f"usable ({fit.headroom / gib:.1f} GiB to spare, "
                           f"{worst / cap:.0%} used)"))
    return out


def time_verdict(iteration_seconds: float, limit: Optional[float]) -> List[Verdict]:
    if limit is None:
        return []
    if iteration_seconds > limit:
        return [Verdict("iteration_too_slow", "fail",
                        f"predicted iteration {iteration_seconds:.3f} s exceeds --max-iteration-seconds {limit:g}",
                        fix="change the layout or raise the limit")]
    return [Verdict("iteration_within_limit", "ok",
                    f"predicted iteration {iteration_seconds:.3f} s is within {limit:g} s")]
