"""`neox-perf check`: read the config as NeoX does, derive the model, judge it, predict it."""
from __future__ import annotations

import os

from ..config import WorldRequest, build, load_files, raw_vocab
from ..errors import UsageError
from ..result import CheckResult


def run_check(args) -> CheckResult:
    from .. import checks
    from ..derive import derive

    from ..predict import load_cluster
    profile = load_cluster(args.cluster)
    facts = profile.facts if profile is not None else None
    raw = load_files(args.configs, conf_dir=args.conf_dir)
    cfg, verdicts, warnings = build(
        raw, WorldRequest(gpus=args.gpus, nodes=args.nodes, gpus_per_node=args.gpus_per_node),
        cluster_gpus_per_node=facts.gpus_per_node if facts else None)
    verdicts = list(verdicts) + checks.config_verdicts(cfg)
    vocab_source = cfg.sources.get("vocab_file")
    search = [os.path.dirname(vocab_source)] if vocab_source else []
    vocab = raw_vocab(cfg.model.tokenizer_type, cfg.model.vocab_file, args.vocab_size, search)
    result = CheckResult(config=cfg, vocab=vocab, warnings=warnings, facts=facts,
                         profile_name=getattr(profile, "name", None), profile=profile)
    if any(v.level == "error" and v.code in _BLOCKING for v in verdicts):
        result.verdicts = verdicts
        return result
    try:
        derived = derive(cfg, vocab.size, facts.gpu_memory_bytes if facts else None)
    except ValueError as exc:  # DeepSpeed would refuse the partition (e.g. more stages than layers)
        verdicts.append(checks.Verdict("partition", "error", str(exc), key="pipe_parallel_size",
                                       file=cfg.sources.get("pipe_parallel_size"),
                                       fix="use fewer pipeline stages or more layers"))
        result.verdicts = verdicts
        return result
    result.derived = derived
    result.warnings = list(result.warnings) + list(derived.warnings)
    verdicts += checks.stage_verdicts(cfg, [s.transformer_layers for s in derived.stages])
    if facts:
        # what the GPU will show (allocated peak + allocator reserve, CUDA context, NCCL)
        # against what CUDA lets a process allocate: derive/memory.py, derive/device_memory.py
        from ..derive.device_memory import usable
        verdicts += checks.memory_verdicts([s.memory.device_total for s in derived.stages],
                                           usable(facts.gpu_memory_bytes), facts.gpu_name)
    if profile is not None and not any(v.level == "error" for v in verdicts):
        from ..predict import predict
        prediction = predict(cfg, derived, profile)
        result.decomposition = prediction.decomposition
        result.estimate = prediction.estimate
        verdicts += checks.time_verdict(result.estimate.iteration_seconds, args.max_iteration_seconds)
    elif args.max_iteration_seconds is not None and profile is None:
        raise UsageError("--max-iteration-seconds needs --cluster to predict the iteration time")
    result.verdicts = verdicts
    return result


# Findings that leave nothing sensible to derive (shapes would not be whole numbers).
_BLOCKING = {"hidden_divisible_by_heads", "heads_divisible_by_mp", "kv_heads_divide_heads",
             "kv_heads_divisible_by_mp", "mlp_divisible_by_mp", "world_divisible"}
