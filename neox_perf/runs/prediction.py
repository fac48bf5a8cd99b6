"""What the project's predictor says about a hooked job: recorded config -> neox_perf.prediction.predict.

Rebuilds a NeoxConfig from the values the hook recorded (hooks/neox_args.discover), with the
world size the job really has and the precision the engine really runs, derives the model,
and predicts it with the one pipeline (neox_perf.prediction.predict) at the layer counts the engine
really partitioned. Pure functions of recorded data, so `neox-perf report` recomputes them
offline with any profile; rank 0 calls them once at start. No torch.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

_PRECISION = {"fp16": "fp16", "bf16": "bfloat16", "fp32": "fp32"}


def rebuild(record: Dict[str, Any], facts: Dict[str, Any], cluster_gpn: Optional[int] = None):
    """(NeoxConfig, DerivedModel, notes) or (None, None, notes) when it cannot be rebuilt."""
    notes: List[str] = []
    if not record or not record.get("values"):
        return None, None, notes
    from neox_perf.config import WorldRequest, build
    from neox_perf.config.loader import RawConfig
    from neox_perf.derive import derive
    values = dict(record["values"])
    files = list(record.get("files") or []) or ["<recorded config>"]
    raw = RawConfig(values=values, sources={k: files[-1] for k in values}, files=files)
    world = int(facts.get("world_size") or 1)
    local = facts.get("local_world_size")
    gpn = min(local, cluster_gpn) if (local and cluster_gpn) else (local or cluster_gpn)
    cfg, verdicts, _ = build(raw, WorldRequest(gpus=world, gpus_per_node=gpn))
    errors = [v for v in verdicts if v.level == "error"]
    if errors:
        notes.append("config rebuilt with errors: " + "; ".join(v.message for v in errors[:3]))
        return None, None, notes
    run_precision = _PRECISION.get(facts.get("dtype") or "", None)
    if run_precision and run_precision != cfg.training.precision:
        notes.append(f"the config asks for {cfg.training.precision}; the engine ran "
                     f"{run_precision}, which is what is predicted")
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training,
                                                                    precision=run_precision))
    vocab = record.get("vocab")
    if not vocab:
        from neox_perf.config import raw_vocab
        rv = raw_vocab(cfg.model.tokenizer_type, cfg.model.vocab_file, None, [])
        vocab = rv.size
        notes.append(f"raw vocabulary {vocab} ({rv.source})")
    # a CPU run's memory is predicted as on that device (NeoX's rotary caches live there)
    derived = derive(cfg, int(vocab), device="cpu" if facts.get("device_type") == "cpu" else "cuda")
    engine_parts = facts.get("parts")
    if engine_parts and list(derived.parts) != list(engine_parts):
        notes.append(f"DeepSpeed partitioned the layers as {engine_parts}; the config derives "
                     f"{list(derived.parts)}; the engine's partition is used")
    return cfg, derived, notes


# The blocks DeepSpeed's partition counts as layers (PipelineModule layer class names).
BLOCKS = ("ParallelTransformerLayerPipe", "GMLPBlock", "RWKVResidualLayerPipe",
          "ParallelMambaResidualLayerPipe")


def engine_layer_counts(derived, facts) -> Optional[List[int]]:
    """Blocks per stage as the engine partitioned them (its `parts` and layer names), or None
    when the engine did not say."""
    parts, names = facts.get("parts"), facts.get("layer_names")
    if not (parts and names and len(parts) == len(derived.stages) + 1):
        return None
    return [sum(1 for n in names[a:b] if n in BLOCKS) for a, b in zip(parts, parts[1:])]


def stage_shapes(derived, facts) -> list:
    from neox_perf.prediction.predict import stage_shapes as shapes
    return shapes(derived, engine_layer_counts(derived, facts))


def load(cluster: Optional[str]):
    """(profile, note): a ClusterProfile, or None and why not."""
    if not cluster:
        return None, ("no cluster profile (neox-perf run --cluster NAME, or NEOX_PERF_CLUSTER): "
                      "prediction skipped")
    from neox_perf.errors import NeoxPerfError
    from neox_perf.prediction.predict import load_cluster
    try:
        return load_cluster(cluster), ""
    except Exception as exc:  # noqa: BLE001 - the run goes on; its prediction is what is lost
        why = exc.line() if isinstance(exc, NeoxPerfError) else f"{exc.__class__.__name__}: {exc}"
        return None, f"cluster profile {cluster!r} not usable ({why}): prediction skipped"


def predict(record, facts, profile) -> Dict[str, Any]:
    """The iteration estimate as plain data, or {"iteration_seconds": None, "notes": [...]}."""
    out: Dict[str, Any] = {"iteration_seconds": None, "notes": []}
    if profile is None:
        return out
    try:
        cfg, derived, notes = rebuild(record, facts, profile.facts.gpus_per_node)
    except Exception as exc:
        out["notes"].append(f"config could not be rebuilt: {exc.__class__.__name__}: {exc}")
        return out
    out["notes"].extend(notes)
    if cfg is None:
        if record and record.get("why"):
            out["notes"].append(f"no NeoX config: {record['why']}")
        return out
    from neox_perf.prediction.predict import predict as pipeline
    try:
        p = pipeline(cfg, derived, profile, transformer_layers=engine_layer_counts(derived, facts),
                     tf32=facts.get("tf32"), tf32_source=tf32_source(facts))
        decomp, est = p.decomposition, p.estimate
    except Exception as exc:  # a profile without some operator, a layout it cannot place
        line = getattr(exc, "line", None)
        out["notes"].append(f"no prediction: {line() if callable(line) else exc}")
        return out
    out.update({
        "profile": profile.name,
        "iteration_seconds": est.iteration_seconds,
        "interval_seconds": list(est.interval_seconds) if est.interval_seconds else None,
        "breakdown": dict(est.breakdown),
        "stages": [dataclasses.asdict(s) for s in est.stages],
        "stage_ready": list(est.timeline.stage_ready),
        "critical_stage": est.timeline.critical_stage,
        "micro_batches": decomp.micro_batches,
        "extrapolated": [f"{f.what}: {f.reason}" for f in est.flags],
    })
    out["notes"].extend(decomp.notes)
    if p.fp32_matmuls is not None:
        out["fp32_matmuls"] = p.fp32_matmuls.to_dict()
        differs = tf32_differs(profile, facts)
        if differs:
            out["notes"].append(differs)
    allocator = cpu_allocator_note(facts)
    if allocator:
        out["notes"].append(allocator)
    return out


def cpu_allocator_note(facts: Dict[str, Any]) -> str:
    """One line where a hooked CPU run's ranks allocated with glibc's defaults (hooks/
    engine_facts.cpu_allocator): every prediction assumes memory recycled as a GPU's caching
    allocator (and a CPU calibration) recycles it; "" otherwise."""
    if facts.get("cpu_allocator") != "glibc default":
        return ""
    from neox_perf.calibration.launch import CACHING_MALLOC_ENV
    settings = " ".join(f"{k}={v}" for k, v in CACHING_MALLOC_ENV.items())
    return ("CPU allocator: this run's ranks used glibc's defaults, so every tensor over its mmap "
            "threshold (at most 32 MiB) was fresh pages and paid their page faults each time; the "
            "prediction assumes memory recycled as a GPU's caching allocator and `neox-perf "
            f"calibrate` recycle it. To compare like with like, launch with {settings}")


def tf32_source(facts: Dict[str, Any]) -> str:
    """Where a hooked run's TF32 fact came from, in a few words (hooks/engine_facts.tf32)."""
    if facts.get("tf32") is None:
        return ""
    flags = facts.get("tf32_flags") if isinstance(facts.get("tf32_flags"), dict) else {}
    env = flags.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")
    said = [f"torch.backends.cuda.matmul.allow_tf32 {flags.get('allow_tf32')}",
            f"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE={env}" if env is not None else "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE unset"]
    if flags.get("NVIDIA_TF32_OVERRIDE") is not None:
        said.append(f"NVIDIA_TF32_OVERRIDE={flags['NVIDIA_TF32_OVERRIDE']}")
    return "the run: " + ", ".join(said)


def tf32_differs(profile, facts: Dict[str, Any]) -> str:
    """One line where a hooked fp32 run's matmuls (TF32 or IEEE) differ from what `check`
    assumes on its cluster; "" where they agree or the run did not say."""
    if facts.get("tf32") is None or (facts.get("dtype") or "fp32") != "fp32":
        return ""
    from neox_perf.predictors import achievable
    if achievable.gpu_of(profile) is None:
        return ""
    assumed = achievable.fp32_matmuls(profile)
    if assumed.tf32 == bool(facts["tf32"]):
        return ""
    had = "TF32" if facts["tf32"] else "IEEE fp32"
    return (f"TF32: the run had fp32 matmuls as {had} ({tf32_source(facts)}); `check` on {profile.name} "
            f"assumes {assumed.name} ({assumed.source}); priced here as the run had them")


def decomposition(record, facts, profile):
    """The job's decomposition as predict() builds it (engine partition, real precision), or
    None when the recorded config cannot be rebuilt."""
    cfg, derived, _ = rebuild(record, facts, profile.facts.gpus_per_node)
    if cfg is None:
        return None
    from neox_perf.prediction.predict import predict as pipeline
    return pipeline(cfg, derived, profile,
                    transformer_layers=engine_layer_counts(derived, facts)).decomposition


def predict_call(profile, op: str, phase: str, features: Dict[str, float],
                 dtype: str) -> Tuple[Optional[float], str]:
    """Seconds the profile gives one measured call, or (None, why not)."""
    from neox_perf.prediction import opspec
    try:
        if op in opspec.COLLECTIVES:
            # A profile counts elements of the dtype its collectives were measured in; another
            # dtype moves proportionally more or fewer bytes.
            width = {"fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}
            scale = width.get(dtype, 2) / width.get(profile.collective_dtype, 2)
            gpn = int(features["gpus_per_node"])
            if gpn > profile.facts.gpus_per_node:
                return None, f"{gpn} ranks per node > the profile's {profile.facts.gpus_per_node}"
            p = profile.predict_collective(op, features["elements"] * scale, int(features["nodes"]), gpn)
        else:
            p = profile.predict(op, phase, features)
        return float(p.seconds), (p.reason if p.extrapolated else "")
    except Exception as exc:
        return None, f"{exc.__class__.__name__}: {' '.join(str(exc).split())[:120]}"
