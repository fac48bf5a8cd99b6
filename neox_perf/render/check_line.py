"""`check --format line`: the verdict and its figures in one plain line, for a job script or a log.

    64 GPUs (16 nodes x 4) pp1 mp8 dp8 | 297 s/it (80%: 241-360) | run 992 h, 63,466 GPU-h |
    26.4/40 GiB per GPU | WARNING: ... | sbatch --time=49-23:55:00

Fields are separated by " | "; one that does not apply (no cluster, no train_iters, a config
NeoX refuses) is left out. The Slurm time is the run at the interval's high end.
"""
from __future__ import annotations

GIB = 2 ** 30


def _s(x: float) -> str:
    return f"{x:.3g}"


def _cluster_arg(result) -> str:
    """What --cluster took, as the user gave it (the check command records it)."""
    return result.cluster_arg or result.profile_name


def line(result) -> str:
    cfg, d, est = result.config, result.derived, result.estimate
    p = cfg.parallel
    nodes = -(-p.world_size // p.gpus_per_node) if p.gpus_per_node else None
    where = f"{p.world_size} GPU{'' if p.world_size == 1 else 's'}"
    if result.facts and nodes == 1 and p.world_size < p.gpus_per_node:
        where += f" (part of a node of {p.gpus_per_node})"
    elif result.facts:
        where += f" ({nodes} node{'' if nodes == 1 else 's'} x {p.gpus_per_node})"
    fields = [f"{where} pp{p.pipe_parallel_size} mp{p.model_parallel_size} dp{p.data_parallel_size}"]
    pred = result.prediction_dict() if est is not None else None
    if pred is not None:
        iv = pred.get("interval_seconds")
        fields.append(f"{_s(est.iteration_seconds)} s/it" + (f" (80%: {_s(iv[0])}-{_s(iv[1])})" if iv else ""))
        if pred.get("run_seconds"):
            fields.append(f"run {pred['run_seconds'] / 3600:,.0f} h, {pred['run_gpu_hours']:,.0f} GPU-h")
    fit = result.memory_fit
    if d is not None and fit is not None:
        # what nvidia-smi will show of the fullest stage, against what a process can use
        # (derive/fit.py's verdict, the one check judged with)
        fields.append(f"{fit.device_total / GIB:.1f}/{fit.usable / GIB:.1f} GiB per GPU")
    summary = result.summary()
    fields.append(f"{summary['level'].upper()}: {summary['text']}")
    if result.suggestion is not None:
        # labelled: beside the first warning's text, the flags may fix another one
        s = result.suggestion
        label = "fits as" if s.reason == "fits" else (
            f"{s.speedup:.2g}x faster layout" if s.speedup else "faster layout")
        fields.append(f"{label}: {s.fix(cfg.files, _cluster_arg(result), result.request_flags)}")
    if pred is not None and pred.get("slurm_time"):
        fields.append(f"sbatch --time={pred['slurm_time']}")
    return "neox-perf check: " + " | ".join(fields)
