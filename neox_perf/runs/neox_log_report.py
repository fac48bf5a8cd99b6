"""`neox-perf report TRAIN_LOG --config ...`: a plain GPT-NeoX training log (no hook) against the
prediction for its config -- "is my throughput normal?".

NeoX logs, every log_interval iterations, the mean iteration of that interval
(megatron/logging.py:431-496). The first interval holds the warm-up (kernel selection, the data
loader's first batches, NCCL's first rendezvous), so it is left out when there are others; the
run's iteration is the median of the rest. The config is built as `check` builds it, at the
world size the log printed (NeoXArgs.print: global_num_gpus) unless --gpus says otherwise, and
predicted through the one pipeline. No torch, no hook files.
"""
from __future__ import annotations

import os
import statistics
from typing import Any, Dict, List, Optional

from .report import ReportError


def build(log_path: str, configs: List[str], *, cluster: Optional[str], gpus: Optional[int] = None,
          gpus_per_node: Optional[int] = None, vocab_size: Optional[int] = None,
          sets: Optional[List[str]] = None, conf_dir: Optional[str] = None) -> Dict[str, Any]:
    from ..config import WorldRequest, build as build_config, load_files, raw_vocab
    from ..config.loader import apply_sets
    from ..derive import derive
    from ..neox_log import read_log, units
    from ..prediction.predict import load_cluster, predict
    try:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            log = read_log(fh.read())
    except OSError as exc:
        raise ReportError(f"{log_path}: cannot read ({exc.strerror or exc.__class__.__name__})")
    if not log.intervals:
        raise ReportError(f"{log_path}: no \"elapsed time per iteration (ms)\" line (fix: pass GPT-NeoX's "
                          f"training log, the output of deepy.py train.py ...)")
    if not configs:
        raise ReportError(f"{log_path} is a training log: pass its config (fix: --config FILE.yml ...)")
    name = cluster or os.environ.get("NEOX_PERF_CLUSTER")
    if not name:
        raise ReportError("no cluster profile to predict with (fix: --cluster NAME, or NEOX_PERF_CLUSTER)")
    profile = load_cluster(name)
    notes: List[str] = []
    world = gpus or log.world_size
    raw = apply_sets(load_files(configs, conf_dir=conf_dir), sets)
    cfg, verdicts, _ = build_config(raw, WorldRequest(gpus=world, gpus_per_node=gpus_per_node),
                                    cluster_gpus_per_node=profile.facts.gpus_per_node)
    errors = [v for v in verdicts if v.level == "error"]
    if errors:
        raise ReportError(f"the config is one NeoX refuses ({errors[0].line()}): is it this run's?")
    vocab_source = cfg.sources.get("vocab_file")
    vocab = raw_vocab(cfg.model.tokenizer_type, cfg.model.vocab_file, vocab_size,
                      [os.path.dirname(vocab_source)] if vocab_source else [])
    derived = derive(cfg, vocab.size, profile.facts.gpu_memory_bytes)
    est = predict(cfg, derived, profile).estimate

    intervals = log.intervals[1:] if len(log.intervals) > 1 else log.intervals
    measured = [i.elapsed_ms / 1000.0 for i in intervals]
    median = statistics.median(measured)
    logged_batch = statistics.median(i.samples_per_sec * i.elapsed_ms / 1000.0 for i in intervals)
    if abs(logged_batch - cfg.training.train_batch_size) > 0.02 * cfg.training.train_batch_size + 0.5:
        notes.append(f"the log's samples/sec x elapsed time is a batch of {logged_batch:.0f} samples; "
                     f"the config at {cfg.parallel.world_size} GPUs makes {cfg.training.train_batch_size}"
                     f": another config or GPU count (--gpus)?")
    if world is None:
        notes.append(f"the log printed no global_num_gpus and --gpus was not given: "
                     f"{cfg.parallel.world_size} GPUs ({cfg.parallel.world_size_source})")
    if vocab.assumed:
        notes.append(f"vocabulary assumed ({vocab.source}): pass --vocab-size N")
    predicted = est.iteration_seconds
    iv = list(est.interval_seconds) if est.interval_seconds else None
    neox_pred = units(cfg, derived.padded_vocab, predicted)
    flops_logged = [i.approx_flops_per_gpu for i in intervals if i.approx_flops_per_gpu]
    return {
        "log": os.path.abspath(log_path),
        "files": list(cfg.files),
        "cluster": profile.name,
        "world_size": cfg.parallel.world_size,
        "layout": {"pipe": cfg.parallel.pipe_parallel_size, "model": cfg.parallel.model_parallel_size,
                   "data": cfg.parallel.data_parallel_size,
                   "micro_batch": cfg.training.micro_batch_size,
                   "accumulation": cfg.training.gradient_accumulation_steps},
        "logged": {"intervals": len(log.intervals), "used": len(intervals),
                   "excluded": "the first logged interval (warm-up)" if len(log.intervals) > 1 else None,
                   "iterations": [i.iteration for i in intervals], "seconds": measured},
        "measured": {"median_seconds": median, "min_seconds": min(measured),
                     "samples_per_sec": cfg.training.train_batch_size / median,
                     "approx_flops_per_gpu": statistics.median(flops_logged) if flops_logged else None},
        "predicted": {"iteration_seconds": predicted, "interval_seconds": iv,
                      "neox_log": dict(elapsed_time_per_iteration_ms=neox_pred.elapsed_time_per_iteration_ms,
                                       samples_per_sec=neox_pred.samples_per_sec,
                                       approx_flops_per_gpu=neox_pred.approx_flops_per_gpu,
                                       line=neox_pred.line())},
        "error_median": (predicted - median) / median,
        "verdict": _verdict(median, predicted, iv),
        "notes": notes,
    }


def _verdict(measured: float, predicted: float, interval) -> str:
    """How far the run is from the prediction, in words a user acts on."""
    ratio = measured / predicted
    where = ""
    if interval:
        lo, hi = interval
        if measured > hi:
            where = " -- slower than the prediction's 80% interval"
        elif measured < lo:
            where = " -- faster than the prediction's 80% interval"
        else:
            where = " -- within the prediction's 80% interval"
    figures = f"({measured:.3g} s vs {predicted:.3g} s per iteration)"
    if ratio >= 2:
        text = f"the run is {ratio:.1f}x as slow as predicted {figures}{where}"
    elif ratio >= 1:
        text = f"the run is {ratio - 1:.0%} slower than predicted {figures}{where}"
    else:
        text = f"the run is {1 - ratio:.0%} faster than predicted {figures}{where}"
    if interval and measured > interval[1]:
        text += ("; look for what the prediction leaves out: data loading, a slow node or link, "
                 "other jobs on the GPUs, logging or checkpointing inside the interval")
    return text
