"""Result objects of the check command, and their JSON payload (pinned by a contract test)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional

from . import exitcodes
from .config.specs import NeoxConfig
from .config.tokenizer import RawVocab
from .config.verdicts import Verdict
from .profile.disturbance import profile_warnings
from .profile.facts import ClusterFacts
from .profile.protocol import Profile
from .step_terms import StepTermsSection


@dataclass
class CheckResult:
    config: NeoxConfig
    vocab: RawVocab
    warnings: List[str]
    facts: Optional[ClusterFacts] = None  # the profile's, if --cluster
    profile_name: Optional[str] = None
    profile: Optional[Profile] = None  # the profile predicted with, if --cluster
    derived: Optional[object] = None  # DerivedModel, unless a blocking error stopped derivation
    decomposition: Optional[object] = None
    estimate: Optional[object] = None  # IterationEstimate, when a profile was given
    verdicts: List[Verdict] = field(default_factory=list)
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

    def to_dict(self) -> dict:
        cfg, d = self.config, self.derived
        out = {
            "files": list(cfg.files),
            "cluster": _facts(self.facts, self.profile_name),
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
            "verdicts": [dataclasses.asdict(v) for v in self.verdicts],
            "warnings": list(self.warnings),
            "profile_warnings": self.profile_warnings,
            "prediction": _prediction(self),
        }
        return out


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


def _facts(facts, name):
    if facts is None:
        return None
    data = _plain(facts)
    data["profile"] = name
    return data


def _stage(s) -> dict:
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
        "tokens_per_second": tokens / est.iteration_seconds,
        "stages": [_plain(s) for s in est.stages],
        "operators": dict(sorted(est.operators.items(), key=lambda kv: -kv[1])),
        "interval_seconds": list(est.interval_seconds) if est.interval_seconds else None,
        "extrapolated_share": est.extrapolated_share,
        "step_terms": _step_terms(result.profile),
        "extrapolated": [{"what": f.what, "reason": f.reason} for f in est.flags],
        "coverage": coverage_rows(est),
        "notes": list(result.decomposition.notes) if result.decomposition else [],
    }
    flops = d.flops.model_per_iteration if d else None
    if flops:
        out["tflops_per_gpu"] = flops / est.iteration_seconds / world / 1e12
        peak = result.facts.peak_fp16_tflops if result.facts is not None else None
        out["mfu"] = out["tflops_per_gpu"] / peak if peak else None
    iters = cfg.training.train_iters
    if iters:
        out["run_seconds"] = est.iteration_seconds * iters
        out["run_gpu_hours"] = est.iteration_seconds * iters * world / 3600.0
        if est.interval_seconds:
            out["run_hours_interval"] = [s * iters / 3600.0 for s in est.interval_seconds]
            out["run_gpu_hours_interval"] = [s * iters * world / 3600.0 for s in est.interval_seconds]
    return out


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
