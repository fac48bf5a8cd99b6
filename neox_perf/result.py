"""Result objects of the check command, and their JSON payload (pinned by a contract test)."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import List, Optional

from . import exitcodes
from .config.specs import NeoxConfig
from .config.tokenizer import RawVocab
from .config.verdicts import LEVELS, Verdict
from .profile.disturbance import profile_warnings
from .profile.facts import ClusterFacts
from .profile.protocol import Profile
from .prediction.corrections import StepTermsSection


@dataclass
class CheckResult:
    config: NeoxConfig
    vocab: RawVocab
    warnings: List[str]
    facts: Optional[ClusterFacts] = None  # the profile's, if --cluster
    profile_name: Optional[str] = None
    profile: Optional[Profile] = None  # the profile predicted with, if --cluster
    network: Optional[object] = None  # network.NetworkReading of that profile's nodes
    derived: Optional[object] = None  # DerivedModel, unless a blocking error stopped derivation
    decomposition: Optional[object] = None
    estimate: Optional[object] = None  # IterationEstimate, when a profile was given
    fp32_matmuls: Optional[object] = None  # predictors.achievable.Fp32Matmuls of an fp32 run on a GPU
    verdicts: List[Verdict] = field(default_factory=list)
    suggestion: Optional[object] = None  # advice.Suggestion: a layout that fits, or a faster one
    no_layout: List[str] = field(default_factory=list)  # why no layout fits (out of memory)
    memory_fit: Optional[object] = None  # derive.fit.MemoryFit: the memory verdict, if --cluster
    # the flags of the user's command that shape the model (-d, --set, --vocab-size,
    # --gpus-per-node), shell-quoted: a command a verdict suggests carries them
    request_flags: str = ""
    # --cluster as the user gave it (a bundled name, a profile directory, a description YAML):
    # a command a verdict suggests repeats it
    cluster_arg: Optional[str] = None
    command: str = "check"
    render_hint: str = "check_text"

    @property
    def exit_code(self) -> int:
        levels = {v.level for v in self.verdicts}
        if "error" in levels:
            return exitcodes.INVALID_CONFIG
        if "fail" in levels:
            return exitcodes.VERDICT_FAILED
        return exitcodes.OK

    @property
    def profile_warnings(self) -> List[str]:
        """What the profile says about itself (a disturbed calibration), for every report."""
        return profile_warnings(self.profile) if self.profile is not None else []

    @property
    def run_iterations(self) -> Optional[int]:
        return self.config.training.train_iters

    def summary(self) -> dict:
        """The verdict in one line: the worst level and what it means for the job."""
        worst = max((v.level for v in self.verdicts), key=LEVELS.index, default="ok")
        errors = [v for v in self.verdicts if v.level == "error"]
        fails = [v for v in self.verdicts if v.level == "fail"]
        warnings = [v for v in self.verdicts if v.level == "warning"]
        if errors:
            first = re.sub(r" \([^()]*\.py:[\d,-]+\)$", "", errors[0].message)  # no source line
            text = (f"NeoX would refuse this config: {len(errors)} error{'s' if len(errors) > 1 else ''}"
                    f" ({first})")
        elif fails:
            oom = [v for v in fails if v.code == "out_of_memory"]
            text = f"will not run as configured: {(oom or fails)[0].message}"
            if oom and self.suggestion is not None:
                text += f"; it fits {self.suggestion.where()}as {self.suggestion.describe()}"
            elif oom:
                text += f"; no layout of {self.config.parallel.world_size} GPUs fits"
        else:
            parts = []
            fits = next((v for v in self.verdicts if v.code == "fits_in_memory"), None)
            if fits is not None:
                parts.append(fits.message)
            if self.estimate is not None:
                parts.append(f"{self.estimate.iteration_seconds:.3g} s per iteration")
            if self.estimate is not None and self.fp32_matmuls is not None:
                parts.append(self.fp32_matmuls.text())  # which pricing, and who said so
            if not parts:
                parts.append("NeoX accepts this config (no --cluster: memory and time not judged)")
            if warnings:
                parts.append(f"{len(warnings)} warning{'s' if len(warnings) > 1 else ''}: "
                             f"{warnings[0].message.split(';')[0]}")
            text = "; ".join(parts)
        return {"level": worst, "text": text, "exit_code": self.exit_code}

    def prediction_dict(self) -> Optional[dict]:
        """--json's `prediction` (None without an estimate), for renderers that read only it."""
        return _prediction(self)

    def to_dict(self) -> dict:
        cfg, d = self.config, self.derived
        out = {
            "files": list(cfg.files),
            "cluster": _facts(self.facts, self.profile_name, self.network),
            "config": {"model": _plain(cfg.model), "parallel": _plain(cfg.parallel),
                       "training": _plain(cfg.training)},
            "derived": {
                "raw_vocab_size": self.vocab.size,
                "raw_vocab_source": self.vocab.source,
                "padded_vocab_size": d.padded_vocab if d else None,
                "world_size": cfg.parallel.world_size,
                "world_size_source": cfg.parallel.world_size_source,
                "data_parallel_size": cfg.parallel.data_parallel_size,
                "model_parallel_size": cfg.parallel.model_parallel_size,
                "pipeline_stages": cfg.parallel.num_stages,
                "micro_batches_per_iteration": cfg.training.gradient_accumulation_steps,
            },
            "stages": [_stage(s) for s in d.stages] if d else [],
            "parameters": _params(d),
            "flops": _plain(d.flops) if d else None,
            "tokens": _plain(d.tokens) if d else None,
            "verdict": self.summary(),
            "memory_fit": _memory_fit(self.memory_fit),
            "advice": self.suggestion.to_dict() if self.suggestion is not None else None,
            "no_layout": list(self.no_layout),
            "verdicts": [dataclasses.asdict(v) for v in self.verdicts],
            "warnings": list(self.warnings),
            "profile_warnings": self.profile_warnings,
            "prediction": self.prediction_dict(),
        }
        return out


def _memory_fit(fit) -> Optional[dict]:
    """The memory verdict on the fullest stage (derive/fit.py), in bytes."""
    if fit is None:
        return None
    return {"level": fit.level, "stage": fit.stage, "device_memory_bytes": fit.device_total,
            "usable_capacity_bytes": fit.usable, "headroom_bytes": fit.headroom,
            "warning_from_bytes": fit.band[0], "fail_above_bytes": fit.band[1],
            "dominant": fit.dominant, "stages_over": list(fit.over)}


def _plain(obj):
    if obj is None:
        return None
    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if f.repr}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    return obj


def _facts(facts, name, network=None):
    if facts is None:
        return None
    data = facts.to_dict()  # tf32 only where the profile knows it
    data["profile"] = name
    data["network"] = network.to_dict() if network is not None else None
    return data


def _stage(s) -> dict:
    from .derive.device_memory import SOURCES as DEVICE_SOURCES
    from .derive.memory import columns
    return {
        "index": s.index,
        "layers": [s.start, s.stop],
        "layer_names": list(s.layer_names),
        "transformer_layers": s.transformer_layers,
        "parameters": s.params_per_rank,
        "unique_parameters": s.unique_params,
        "memory_bytes": s.memory.total,
        "memory": _plain(s.memory),
        "capacity_bytes": s.memory.capacity,
        # what the GPU will show: the allocated peak plus the terms above it, by name
        "device_memory_bytes": s.memory.device_total,
        "device_memory_terms": dict(s.memory.device_terms),
        "device_memory_term_sources": {k: DEVICE_SOURCES[k] for k in s.memory.device_terms},
        "usable_capacity_bytes": s.memory.usable_capacity,
        "memory_columns": columns(s.memory),
    }


def _params(d) -> Optional[dict]:
    if d is None:
        return None
    return {"total": d.params.unique, "per_rank_max": d.params.per_rank_max,
            "neox_logged": d.params.neox_logged, "embedding": d.params.embedding,
            "non_embedding": d.params.non_embedding}


def _prediction(result: CheckResult) -> Optional[dict]:
    est = result.estimate
    if est is None:
        return None
    d, cfg = result.derived, result.config
    tokens = cfg.training.train_batch_size * cfg.model.seq_length
    world = cfg.parallel.world_size
    out = {
        "profile": result.profile_name,
        "iteration_seconds": est.iteration_seconds,
        "eq7_seconds": est.eq7_seconds,
        "breakdown": dict(est.breakdown),
        # per breakdown collective: sampled on this cluster, a description's link model, or
        # measured in the engine's calibration runs (estimate.IterationEstimate)
        "collective_sources": dict(est.collective_sources),
        "tokens_per_second": tokens / est.iteration_seconds,
        "stages": [_plain(s) for s in est.stages],
        "operators": dict(sorted(est.operators.items(), key=lambda kv: -kv[1])),
        "interval_seconds": list(est.interval_seconds) if est.interval_seconds else None,
        "regime": est.regime,
        "inter_node_share": est.inter_node_share,
        # per step term the profile's runs could not see: the iteration at its low and high end
        # (the interval reaches them: corrections/unseen.py)
        "unseen_terms": {name: list(ends) for name, ends in est.unseen_terms.items()},
        "extrapolated_share": est.extrapolated_share,
        "step_terms": _step_terms(result.profile),
        "extrapolated": [{"what": f.what, "reason": f.reason, "kind": f.kind} for f in est.flags],
        "coverage": coverage_rows(est),
        "notes": list(result.decomposition.notes) if result.decomposition else [],
    }
    if result.fp32_matmuls is not None:  # fp32 runs on a GPU only: 16-bit payloads stay as they were
        out["fp32_matmuls"] = result.fp32_matmuls.to_dict()
    if d is not None:  # what NeoX's own log line would print for this iteration time
        from .neox_log import units
        neox = units(cfg, d.padded_vocab, est.iteration_seconds)
        out["neox_log"] = dict(dataclasses.asdict(neox),
                               approx_flops_per_gpu_text=neox.approx_flops_per_gpu_text,
                               line=neox.line())
    flops = d.flops.model_per_iteration if d else None
    if flops:
        out["tflops_per_gpu"] = flops / est.iteration_seconds / world / 1e12
        peak = mfu_peak(result.profile, result.facts, result.decomposition)
        out["mfu"] = out["tflops_per_gpu"] / peak if peak else None
    iters = cfg.training.train_iters
    if iters:
        out["run_seconds"] = est.iteration_seconds * iters
        out["run_gpu_hours"] = est.iteration_seconds * iters * world / 3600.0
        if est.interval_seconds:
            out["run_hours_interval"] = [s * iters / 3600.0 for s in est.interval_seconds]
            out["run_gpu_hours_interval"] = [s * iters * world / 3600.0 for s in est.interval_seconds]
        high = est.interval_seconds[1] if est.interval_seconds else est.iteration_seconds
        out["slurm_time"] = slurm_time(high * iters)
    return out


def slurm_time(seconds: float) -> str:
    """sbatch --time for a run of `seconds`, rounded up to the minute: D-HH:MM:SS (Slurm's
    "days-hours:minutes:seconds" form)."""
    import math
    minutes = max(1, math.ceil(seconds / 60.0))
    days, minutes = divmod(minutes, 24 * 60)
    hours, minutes = divmod(minutes, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:00"


def mfu_peak(profile, facts, decomposition) -> Optional[float]:
    """The data-sheet TFLOP/s MFU is quoted against: the run's precision on the profile's GPU
    (an fp32 run against the fp32 rate, not the fp16 tensor-core one), else the facts' fp16."""
    precision = decomposition.precision if decomposition is not None else ""
    if profile is not None:
        from .predictors.achievable import mfu_peak_tflops
        return mfu_peak_tflops(profile, precision)
    return facts.peak_fp16_tflops if facts is not None else None


def coverage_rows(est) -> List[dict]:
    """Per operator and phase, how its least-covered shape lies against the samples."""
    return [{"what": what, "state": c.state, "factor": c.factor, "detail": c.detail}
            for what, c in est.coverage.items()]


def _step_terms(profile: Optional[Profile]) -> Optional[dict]:
    """What the profile adds to the operator sum, and where it was measured."""
    if profile is None:
        return None
    section = profile.manifest.step_terms or StepTermsSection()
    return {"applied": section.terms is not None,
            "terms": section.terms.to_dict() if section.terms is not None else None,
            "source": section.fitted_on if section.fitted_on is not None
            else "none: the plain sum of operator predictions",
            "cross_validation": section.cross_validation}
