"""`neox-perf check`: read the config as NeoX does, derive the model, judge it, predict it."""
from __future__ import annotations

import os
import shlex
from typing import Optional

from ..config import WorldRequest, build, load_files, raw_vocab
from ..config.loader import apply_sets
from ..errors import UsageError
from ..prediction.network import reading as network_reading
from ..result import CheckResult


def run_check(args) -> CheckResult:
    from .. import advice, checks
    from ..derive import derive
    from ..derive.fit import memory_fit

    from ..prediction.predict import load_cluster
    profile = load_cluster(args.cluster)
    facts = profile.facts if profile is not None else None
    raw = apply_sets(load_files(args.configs, conf_dir=args.conf_dir), getattr(args, "sets", None))
    cfg, verdicts, warnings = build(
        raw, WorldRequest(gpus=args.gpus, nodes=args.nodes, gpus_per_node=args.gpus_per_node),
        cluster_gpus_per_node=facts.gpus_per_node if facts else None)
    verdicts = list(verdicts) + checks.config_verdicts(cfg)
    vocab_source = cfg.sources.get("vocab_file")
    search = [os.path.dirname(vocab_source)] if vocab_source else []
    vocab = raw_vocab(cfg.model.tokenizer_type, cfg.model.vocab_file, args.vocab_size, search)
    result = CheckResult(config=cfg, vocab=vocab, warnings=warnings, facts=facts,
                         profile_name=profile.name if profile is not None else None, profile=profile,
                         network=network_reading(profile) if profile is not None else None,
                         request_flags=request_flags(args), cluster_arg=cluster_arg(args.cluster))
    if args.max_iteration_seconds is not None and profile is None:
        raise UsageError("--max-iteration-seconds needs --cluster to predict the iteration time")
    if any(v.level == "error" and v.code in _BLOCKING for v in verdicts):
        result.verdicts = verdicts + advice.vocab_verdicts(cfg, vocab)
        return result
    try:
        derived = derive(cfg, vocab.size, facts.gpu_memory_bytes if facts else None)
    except ValueError as exc:  # DeepSpeed would refuse the partition (e.g. more stages than layers)
        verdicts.append(checks.Verdict("partition", "error", str(exc), key="pipe_parallel_size",
                                       file=cfg.sources.get("pipe_parallel_size"),
                                       fix="use fewer pipeline stages or more layers"))
        result.verdicts = verdicts + advice.vocab_verdicts(cfg, vocab)
        return result
    result.derived = derived
    result.warnings = list(result.warnings) + list(derived.warnings)
    verdicts += checks.derived_verdicts(cfg, derived) + advice.vocab_verdicts(cfg, vocab, derived)
    refused = any(v.level == "error" for v in verdicts)
    verdicts += advice.tensor_parallel_verdicts(cfg)  # its share of the step comes with a prediction
    if facts:
        # what the GPU will show (allocated peak + allocator reserve, CUDA context, NCCL)
        # against what CUDA lets a process allocate: derive/memory.py, derive/device_memory.py
        fit = result.memory_fit = memory_fit([s.memory for s in derived.stages],
                                             facts.gpu_memory_bytes)
        key, fix = advice.memory_fix(cfg, derived.stages[fit.stage].memory)
        verdicts += checks.memory_verdicts(fit, [s.memory.device_total for s in derived.stages],
                                           facts.gpu_name, fix=fix, key=key,
                                           quiet_when_fits=refused)
    out_of_memory = any(v.code == "out_of_memory" for v in verdicts)
    gpn = args.gpus_per_node
    if profile is not None and not refused and out_of_memory:
        # It cannot run: no time of its own; what it would take instead, from the planner.
        result.suggestion, result.no_layout = advice.fitting_layout(
            raw, cfg, profile, vocab.size, gpn, params=derived.params.unique)
    elif profile is not None and not refused:
        from ..prediction.predict import predict
        prediction = predict(cfg, derived, profile)
        result.decomposition = prediction.decomposition
        result.fp32_matmuls = prediction.fp32_matmuls
        est = result.estimate = prediction.estimate
        verdicts = [v for v in verdicts if v.code != "tensor_parallel_across_nodes"]
        hardware = (advice.tensor_parallel_verdicts(cfg, est)
                    + advice.imbalance_verdicts(cfg, derived, est))
        verdicts += hardware + checks.time_verdict(est.iteration_seconds, args.max_iteration_seconds)
        if hardware or advice.lost_share(est) >= advice.SEARCH_WHEN_LOST:
            found = advice.faster_layout(raw, cfg, profile, vocab.size, est.iteration_seconds, gpn)
            slower = advice.faster_verdicts(found, cfg.files, result.cluster_arg, result.request_flags)
            if slower:
                result.suggestion, verdicts = found, verdicts + slower
    result.verdicts = verdicts
    return result


def cluster_arg(given: Optional[str]) -> Optional[str]:
    """--cluster for a command a verdict suggests: a name as given (bundled, or under
    $NEOX_PERF_HOME), a path made absolute so the command works from any directory."""
    if given is None or not os.path.exists(given):
        return given
    return os.path.abspath(given)


def request_flags(args) -> str:
    """The flags of this command that shape the model besides its files, GPUs and cluster, as a
    shell takes them back: a `plan` a verdict suggests must search the same model."""
    out = [f"-d {shlex.quote(args.conf_dir)}"] if getattr(args, "conf_dir", None) else []
    out += [f"--set {shlex.quote(s)}" for s in getattr(args, "sets", None) or []]
    for flag, value in (("--vocab-size", getattr(args, "vocab_size", None)),
                        ("--gpus-per-node", getattr(args, "gpus_per_node", None))):
        if value is not None:
            out.append(f"{flag} {value}")
    return " ".join(out)


# Findings that leave nothing sensible to derive (shapes would not be whole numbers).
_BLOCKING = {"hidden_divisible_by_heads", "heads_divisible_by_mp", "kv_heads_divide_heads",
             "kv_heads_divisible_by_mp", "mlp_divisible_by_mp", "world_divisible"}
