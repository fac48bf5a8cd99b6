"""Turn merged YAML values into NeoX's effective configuration (defaults applied).

Follows NeoXArgs.calculate_derived / validate_values: dp = world / max(pp,1) / mp, the
batch triple filled in by NeoX's cases, precision from the fp16/bf16 dicts, attention
config expanded per layer. Things NeoX refuses but that still let us derive a model are
returned as "error" verdicts, so the report can show everything wrong at once; things
that leave nothing to derive raise ConfigError.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..errors import ConfigError, UsageError
from .loader import RawConfig, unknown_keys
from .neox_keys import KEYS, ZERO_DEFAULTS
from .specs import ModelSpec, NeoxConfig, ParallelSpec, TrainingSpec
from .verdicts import Verdict

ATTENTION_TYPES = ("global", "local", "sparse_fixed", "sparse_variable", "bigbird",
                   "bslongformer", "gmlp", "amlp", "flash", "rwkv", "mamba")
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings")


@dataclass(frozen=True)
class WorldRequest:
    gpus: Optional[int] = None  # --gpus
    nodes: Optional[int] = None  # --nodes
    gpus_per_node: Optional[int] = None  # --gpus-per-node (else the cluster's)


class _Values:
    """Effective value lookup: the config's value, else NeoX's default."""

    def __init__(self, raw: RawConfig):
        self.raw = raw

    def __call__(self, key: str):
        if key in self.raw.values and self.raw.values[key] is not None:
            return self.raw.values[key]
        return KEYS[key][1]

    def source(self, key: str) -> Optional[str]:
        return self.raw.sources.get(key)

    def error(self, key: str, problem: str, fix: str) -> ConfigError:
        return ConfigError(problem, file=self.source(key), key=key, fix=fix)


def expand_attention_types(config, num_layers: int, v: _Values) -> Tuple[str, ...]:
    if config is None:
        return ("global",) * num_layers
    if not isinstance(config, list):
        raise v.error("attention_config", "must be a list like [[[\"global\"], N]]",
                      "see NeoX's configs/neox_arguments.md")
    if all(isinstance(i, str) for i in config):
        out = list(config)
    else:
        out = []
        for item in config:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], list)):
                raise v.error("attention_config", f"entry {item!r} is not [[types], count]",
                              "write each entry as [[\"global\"], 12]")
            types, count = item
            if count == "all":
                if num_layers % len(types):
                    raise v.error("attention_config",
                                  f"{num_layers} layers are not divisible by the pattern {types}",
                                  "use a pattern whose length divides num_layers")
                out = list(types) * (num_layers // len(types))
                break
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise v.error("attention_config", f"count {count!r} is not a whole number",
                              "use an integer or \"all\"")
            for _ in range(count):
                out.extend(types)
    if len(out) != num_layers:
        raise v.error("attention_config",
                      f"expands to {len(out)} layers but num_layers is {num_layers}",
                      "make the counts add up to num_layers")
    for t in out:
        if t not in ATTENTION_TYPES:
            raise v.error("attention_config", f"attention type {t!r} not recognized",
                          "use one of " + ", ".join(ATTENTION_TYPES))
    return tuple(out)


# Far beyond any real model; past these a typo would make the derivations crawl.
LIMITS = {"num_layers": 100_000, "hidden_size": 1_000_000, "num_attention_heads": 100_000,
          "seq_length": 100_000_000, "max_position_embeddings": 100_000_000,
          "pipe_parallel_size": 100_000, "model_parallel_size": 100_000}


def _positive_int(v: _Values, key: str, allow_zero: bool = False) -> int:
    val = v(key)
    if not isinstance(val, int) or isinstance(val, bool) or val < (0 if allow_zero else 1):
        raise v.error(key, f"must be a {'non-negative' if allow_zero else 'positive'} integer, "
                           f"got {val!r}", f"set {key} to a whole number")
    if val > LIMITS.get(key, 10**12):
        raise v.error(key, f"{val} is implausibly large", f"check {key} for a typo")
    return val


def resolve_world(v: _Values, pp: int, mp: int, req: WorldRequest,
                  cluster_gpus_per_node: Optional[int], batch_hint: Optional[int]
                  ) -> Tuple[int, str, int, List[str]]:
    warnings: List[str] = []
    if req.gpus_per_node and cluster_gpus_per_node and req.gpus_per_node != cluster_gpus_per_node:
        raise UsageError(f"--gpus-per-node {req.gpus_per_node} contradicts the cluster's "
                         f"{cluster_gpus_per_node} GPUs per node (fix: drop --gpus-per-node, or "
                         f"describe your nodes in a cluster YAML: see `neox-perf clusters --gpus`)")
    if req.nodes is not None and not (req.gpus_per_node or cluster_gpus_per_node):
        raise UsageError(f"--nodes {req.nodes} needs the GPUs of a node (fix: add --gpus-per-node N, "
                         f"or --cluster NAME, or give --gpus {req.nodes}xN instead)")
    gpn = req.gpus_per_node or cluster_gpus_per_node or 1
    if req.gpus is not None and req.nodes is not None and req.gpus != req.nodes * gpn:
        raise UsageError(f"--gpus {req.gpus} disagrees with --nodes {req.nodes} x {gpn} GPUs per node")
    if req.gpus is not None:
        if req.gpus < 1:
            raise UsageError("--gpus must be at least 1")
        return req.gpus, "--gpus", gpn, warnings
    if req.nodes is not None:
        if req.nodes < 1:
            raise UsageError("--nodes must be at least 1")
        return req.nodes * gpn, f"--nodes x {gpn} GPUs per node", gpn, warnings
    g = v("global_num_gpus")
    if g is not None:
        if not isinstance(g, int) or g < 1:
            raise v.error("global_num_gpus", f"must be a positive integer, got {g!r}",
                          "set it to the number of GPUs of the job")
        return g, f"global_num_gpus ({v.source('global_num_gpus')})", gpn, warnings
    if batch_hint is not None:
        world = batch_hint * pp * mp
        warnings.append(f"no world size given: {world} GPUs inferred from the batch sizes "
                        f"(pass --gpus N to be explicit)")
        return world, "inferred from train_batch_size", gpn, warnings
    world = pp * mp
    warnings.append(f"no world size given: assuming the smallest layout, {world} GPUs "
                    f"(data parallel 1); pass --gpus N or --nodes N")
    return world, "assumed pp x mp", gpn, warnings


def _batch(v: _Values, dp: int, verdicts: List[Verdict]) -> Tuple[int, int, int]:
    # NeoX's calculate_batch_parameters, case by case; gradient_accumulation_steps
    # defaults to 1 (not None), so giving train_batch_size and micro leaves nothing to fill.
    tbs = v("train_batch_size")
    micro = v("train_micro_batch_size_per_gpu")
    gas = v("gradient_accumulation_steps")
    if tbs is not None and micro is not None and gas is not None:
        pass
    elif tbs is not None and micro is not None:
        gas = tbs // micro // dp
    elif tbs is not None and gas is not None:
        micro = tbs // dp // gas
    elif micro is not None and gas is not None:
        tbs = micro * gas * dp
    elif tbs is not None:
        gas, micro = 1, tbs // dp
    elif micro is not None:
        tbs, gas = micro * dp, 1
    else:
        raise ConfigError("neither train_batch_size nor train_micro_batch_size_per_gpu is set",
                          key="train_micro_batch_size_per_gpu",
                          fix="set train_micro_batch_size_per_gpu (and gradient_accumulation_steps)")
    if micro <= 0 or gas <= 0 or tbs <= 0:
        raise ConfigError(f"batch sizes must be positive (train_batch_size {tbs}, micro {micro}, "
                          f"gradient_accumulation_steps {gas} at data parallel {dp})",
                          file=v.source("train_batch_size") or v.source("train_micro_batch_size_per_gpu"),
                          key="train_batch_size", fix="make train_batch_size >= micro x gas x dp")
    if tbs != micro * gas * dp:
        verdicts.append(Verdict(
            "batch_triple", "error",
            f"train_batch_size {tbs} != micro {micro} x gradient_accumulation_steps {gas} x "
            f"data parallel {dp}", key="train_batch_size", file=v.source("train_batch_size"),
            fix=f"set train_batch_size to {micro * gas * dp} or drop it"))
    return tbs, micro, gas


def _precision(v: _Values, verdicts: List[Verdict]) -> str:
    fp16, bf16 = v("fp16"), v("bf16")
    fp16_on = isinstance(fp16, dict) and bool(fp16.get("enabled", False))
    bf16_on = isinstance(bf16, dict) and bool(bf16.get("enabled", False))
    precision = v("precision")
    if fp16_on and bf16_on:
        verdicts.append(Verdict("fp16_and_bf16", "error", "fp16 and bf16 are both enabled",
                                key="bf16", file=v.source("bf16"), fix="enable only one"))
    if fp16_on:
        return "fp16" if precision in (None, "fp16") else precision
    if bf16_on:
        return "bfloat16" if precision in (None, "bfloat16", "bf16") else precision
    return (precision or "fp32").lower()


def build(raw: RawConfig, req: WorldRequest = WorldRequest(),
          cluster_gpus_per_node: Optional[int] = None) -> Tuple[NeoxConfig, List[Verdict], List[str]]:
    v = _Values(raw)
    verdicts: List[Verdict] = []
    warnings = list(raw.warnings)
    first = raw.files[0] if raw.files else None
    unknown = unknown_keys(raw)

    def missing(key: str, error: ConfigError) -> ConfigError:
        typo = next((k for k, hint in unknown.items() if hint == key), None)
        if typo is None:
            return error
        # the typo is why the key is missing: say that, not only that the key is absent
        return ConfigError(f"unknown key {typo!r} (did you mean {key!r}?), so {key} is not set",
                           file=raw.sources.get(typo), key=typo, fix=f"rename it to {key}")

    for key in REQUIRED:
        if v(key) is None:
            raise missing(key, ConfigError(f"{key} is required and not set in any file", file=first,
                                           key=key, fix=f"add `{key}: <value>`"))
    for key, hint in unknown.items():
        # NeoXArgs.from_ymls ends in cls(**config) (megatron/neox_arguments/arguments.py:285): a
        # dataclass raises TypeError on a keyword it does not declare, before training starts.
        verdicts.append(Verdict(
            "unknown_key", "error",
            f"unknown key {key!r}: NeoX raises on it (NeoXArgs(**config): unexpected keyword "
            f"argument){f'; did you mean {hint!r}?' if hint else ''}",
            key=key, file=raw.sources.get(key),
            fix=f"rename it to {hint}" if hint else "remove it (NeoX has no such setting)"))
    num_layers = _positive_int(v, "num_layers")
    hidden = _positive_int(v, "hidden_size")
    heads = _positive_int(v, "num_attention_heads")
    max_pos = _positive_int(v, "max_position_embeddings")
    seq = v("seq_length")
    if seq is None:
        raise missing("seq_length", ConfigError("seq_length is not set", file=first, key="seq_length",
                                                fix="add `seq_length: <tokens>` (training needs it)"))
    seq = _positive_int(v, "seq_length")
    kv = _positive_int(v, "num_kv_heads") if v("num_kv_heads") is not None else heads
    pp = _positive_int(v, "pipe_parallel_size", allow_zero=True)
    mp = max(_positive_int(v, "model_parallel_size", allow_zero=True), 1)

    attention = expand_attention_types(v("attention_config"), num_layers, v)

    zero = v("zero_optimization")
    if zero is None:
        zero = dict(ZERO_DEFAULTS)
    if "stage" not in zero:
        raise v.error("zero_optimization", "has no 'stage' (NeoX reads it unconditionally)",
                      "add `stage: 0` (or 1) inside zero_optimization")
    stage = zero["stage"]
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise v.error("zero_optimization", f"stage {stage!r} is not 0, 1, 2 or 3",
                      "set zero_optimization.stage to 0-3")

    micro_hint = v("train_micro_batch_size_per_gpu")
    tbs_hint = v("train_batch_size")
    gas_hint = v("gradient_accumulation_steps")
    batch_hint = None
    if tbs_hint and micro_hint and gas_hint and tbs_hint % (micro_hint * gas_hint) == 0:
        batch_hint = tbs_hint // (micro_hint * gas_hint)
    world, world_source, gpn, world_warnings = resolve_world(
        v, max(pp, 1), mp, req, cluster_gpus_per_node, batch_hint)
    warnings.extend(world_warnings)
    denom = max(pp, 1) * mp
    if world % denom:
        verdicts.append(Verdict(
            "world_divisible", "error",
            f"world size {world} is not divisible by pipe ({max(pp, 1)}) x model parallel ({mp})",
            key="model_parallel_size", file=v.source("model_parallel_size"),
            fix=f"use a multiple of {denom} GPUs"))
        dp = max(world // denom, 1)
    else:
        dp = world // denom
    try:
        tbs, micro, gas = _batch(v, dp, verdicts)
    except ConfigError as exc:
        raise missing("train_micro_batch_size_per_gpu", missing("train_batch_size", exc)) from None
    precision = _precision(v, verdicts)

    opt = v("optimizer") or {"type": "Adam"}
    optimizer_type = str(opt.get("type", "Adam")).lower() if isinstance(opt, dict) else "adam"

    model = ModelSpec(
        num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads, num_kv_heads=kv,
        seq_length=seq, max_position_embeddings=max_pos,
        intermediate_size=v("intermediate_size"), expansion_factor=v("expansion_factor"),
        mlp_multiple_of=_positive_int(v, "mlp_multiple_of"),
        activation=str(v("activation")).lower(), norm=str(v("norm")).lower(),
        pos_emb=str(v("pos_emb")).lower(), rotary_pct=float(v("rotary_pct")),
        no_weight_tying=bool(v("no_weight_tying")), gpt_j_residual=bool(v("gpt_j_residual")),
        use_bias_in_attn_linear=bool(v("use_bias_in_attn_linear")),
        use_bias_in_mlp=bool(v("use_bias_in_mlp")), use_qk_layernorm=bool(v("use_qk_layernorm")),
        attention_types=attention,
        fused_softmax=bool(v("scaled_upper_triang_masked_softmax_fusion")),
        make_vocab_size_divisible_by=_positive_int(v, "make_vocab_size_divisible_by"),
        tokenizer_type=str(v("tokenizer_type")), vocab_file=v("vocab_file"),
        moe_num_experts=_positive_int(v, "moe_num_experts"),
        moe_expert_interval=_positive_int(v, "moe_expert_interval"),
        rpe_num_buckets=_positive_int(v, "rpe_num_buckets"),
    )
    parallel = ParallelSpec(
        world_size=world, world_size_source=world_source, pipe_parallel_size=pp,
        model_parallel_size=mp, data_parallel_size=dp,
        pipe_partition_method=str(v("pipe_partition_method")),
        sequence_parallel=bool(v("sequence_parallel")), gpus_per_node=gpn)
    training = TrainingSpec(
        micro_batch_size=micro, gradient_accumulation_steps=gas, train_batch_size=tbs,
        train_iters=v("train_iters"), precision=precision, zero_stage=stage,
        reduce_bucket_size=int(zero.get("reduce_bucket_size", ZERO_DEFAULTS["reduce_bucket_size"])),
        allgather_bucket_size=int(zero.get("allgather_bucket_size",
                                           ZERO_DEFAULTS["allgather_bucket_size"])),
        overlap_comm=bool(zero.get("overlap_comm", False)), optimizer_type=optimizer_type,
        checkpoint_activations=bool(v("checkpoint_activations")),
        checkpoint_num_layers=_positive_int(v, "checkpoint_num_layers"),
        partition_activations=bool(v("partition_activations")),
        fp32_allreduce=bool(v("fp32_allreduce")), train_impl=str(v("train_impl")))
    config = NeoxConfig(model=model, parallel=parallel, training=training,
                        files=tuple(raw.files), values=dict(raw.values), sources=dict(raw.sources))
    return config, verdicts, warnings
