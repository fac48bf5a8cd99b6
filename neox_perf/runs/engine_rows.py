"""Engine-term rows from a hooked run's stage times, for the refit of `calibrate --from-run`.

The engine terms (what a DeepSpeed step costs beyond its operators) are fitted from the
engine calibration; its one-process models at its own shapes can be far off at a user's
shapes, which no operator sample can fix. stage_measurements reads what each pipeline stage
of the run took, and EngineRows turns that into rows of the same terms at the user's shapes.
"""
from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Tuple

from . import files as runfiles
from . import prediction


def stage_measurements(run_dir: str) -> Optional[Dict[str, Any]]:
    """What each pipeline stage of the run's (latest) job took, per micro-batch (forward,
    backward) and per iteration (optimizer step, gradient reduction), the slowest member of
    each stage, with the recorded config and engine facts to rebuild its decomposition.

    CPU ranks time their phases outside the profiling windows: those medians are used as
    they are. Otherwise the phases come from the windows, which the profiler slows down on
    purpose; they are scaled by (median plain iteration) / (profiled iteration) so that they
    add up to what an iteration takes without the profiler. None without either, or without
    a config."""
    from .report import _phase_per_iter, _pick_job, _plain_phases, _window_per_iter
    ranks = _pick_job(runfiles.read_rank_summaries(run_dir), [])
    plain_phases = _plain_phases(run_dir, ranks)
    unprofiled = bool(ranks) and all(s["rank"] in plain_phases for s in ranks)
    if not unprofiled:
        ranks = [s for s in ranks if s.get("window_iterations")]
    if not ranks or not (ranks[0].get("config") or {}).get("values"):
        return None
    factor = 1.0
    if not unprofiled:
        series: Dict[int, List[Tuple[float, bool]]] = {}
        for s in ranks:
            for i, sec, prof in runfiles.read_iterations(runfiles.iterations_file(run_dir, s["rank"])):
                series.setdefault(i, []).append((sec, prof))
        plain = [max(sec for sec, _ in v) for i, v in series.items()
                 if i > 0 and len(v) == len(ranks) and not any(p for _, p in v)]
        profiled = max((_window_per_iter(s, "iteration") or 0.0) for s in ranks)
        if plain and profiled > 0:
            factor = min(statistics.median(plain) / profiled, 1.0)
    ref = ranks[0]
    facts = ref.get("facts") or {}
    m = int(facts.get("micro_batches") or facts.get("gradient_accumulation_steps") or 1)
    stages: Dict[str, Dict[str, Optional[float]]] = {}
    for s in ranks:
        st = str(int((s.get("facts") or {}).get("stage") or 0))
        row = stages.setdefault(st, {})
        for phase, per in (("forward", m), ("backward", m), ("optimizer_step", 1), ("reduce_grads", 1)):
            v = _phase_per_iter(s, phase, plain_phases if unprofiled else {})
            if v is not None:
                row[phase] = max(row.get(phase) or 0.0, v * factor / per)
    return {"job": ref.get("job"), "config": ref.get("config"), "facts": facts,
            "profiler_factor": factor, "phases_from": "outside windows" if unprofiled else "windows",
            "stages": stages}


class EngineRows:
    """``extra_rows`` for predictors/fitting/engine_fit.fit_engine: engine-term rows from merged runs.

    The engine terms model what a step costs beyond its operators, and the engine
    calibration measures that on one-process models at its own shapes; a run measures it at
    the shapes the user trains. Per run, against the profile being fitted:
    - a pipeline stage without the head holds only layers (and the embedding, an operator):
      per layer, measured = (stage time - its other operators - gradient accumulation) / layers,
      a row of layer_forward / layer_backward at x = the layer's operators (with the
      memory-bound operators' seconds beside it: engine_fit.SPLIT_PHASES);
    - the head stage then gives other_forward / other_backward: its time minus its layers at
      that measured per-layer time, at x = its logits;
    - every stage gives optimizer_step (tensors, parameters, step) on DeepSpeed's non-ZeRO
      path, and grad_flatten (parameters, gradient reduction) when nothing is all-reduced
      across data-parallel ranks (dp 1).
    A run that cannot be split this way (one stage, tensor parallel, another precision)
    gives only the rows it can, and says so in ``notes``."""

    TERMS = ("layer_forward", "layer_backward", "other_forward", "other_backward",
             "optimizer_step", "grad_flatten", "grad_accumulate")

    def __init__(self, records: List[Dict[str, Any]], precision: Optional[str], accumulate=None):
        """``accumulate``: the profile's grad_accumulate term (corrections.engine.Linear), if any."""
        self.records, self.precision, self.accumulate = records, precision, accumulate
        self.notes: List[str] = []
        self.counts: Dict[str, int] = {}

    def _acc(self, tensors: float, params: float, m: int) -> float:
        if self.accumulate is None:
            return 0.0
        return self.accumulate.at(params, tensors) * (m - 1) / m

    def __call__(self, profile) -> Dict[str, list]:
        from neox_perf.prediction.corrections.engine import operator_seconds
        from neox_perf.prediction.operators import decompose
        out: Dict[str, list] = {t: [] for t in self.TERMS}
        self.notes = []

        def ops(calls, memory_only: bool = False) -> float:
            return operator_seconds(profile, calls, memory_only)

        for rec in self.records:
            job, facts = rec.get("job") or "?", rec.get("facts") or {}
            try:
                cfg, derived, _ = prediction.rebuild(rec.get("config") or {}, facts,
                                                     profile.facts.gpus_per_node)
                if cfg is None:
                    self.notes.append(f"run {job}: its config could not be rebuilt; no engine rows")
                    continue
                dec = decompose(cfg, derived.padded_vocab, prediction.stage_shapes(derived, facts))
                if dec.precision != self.precision:
                    self.notes.append(f"run {job}: {dec.precision}, the engine terms are "
                                      f"{self.precision}; no engine rows")
                    continue
                m = dec.micro_batches
                measured = {int(k): v for k, v in (rec.get("stages") or {}).items()}
                works = {w.index: w for w in dec.stages}
                split = len(works) > 1 and (facts.get("mp") or 1) == 1
                if not split:
                    self.notes.append(f"run {job}: one stage or tensor parallel: its layers and "
                                      f"head cannot be told apart, so no layer/head rows")
                per_layer: Dict[str, List[float]] = {"forward": [], "backward": []}
                for st, w in sorted(works.items()):
                    got = measured.get(st) or {}
                    if not split or w.logits_elements > 0 or not w.transformer_layers:
                        continue
                    for phase, term, calls, other in (
                            ("forward", "layer_forward", w.layer_forward, w.forward),
                            ("backward", "layer_backward", w.layer_backward, w.backward)):
                        if not got.get(phase):
                            continue
                        extra = self._acc(w.param_tensors, w.params_per_rank, m) if phase == "backward" else 0.0
                        x = ops(calls)
                        meas = (got[phase] - ops(other) - extra) / w.transformer_layers
                        if meas > 0:
                            out[term].append((x, meas - x, meas, ops(calls, True)))
                            per_layer[phase].append(meas)
                for st, w in sorted(works.items()):
                    got = measured.get(st) or {}
                    if split and w.logits_elements > 0:
                        for phase, term, other in (("forward", "other_forward", w.forward),
                                                   ("backward", "other_backward", w.backward)):
                            if not got.get(phase) or not per_layer[phase]:
                                continue
                            extra = self._acc(w.param_tensors, w.params_per_rank, m) if phase == "backward" else 0.0
                            meas = (got[phase] - extra
                                    - w.transformer_layers * statistics.median(per_layer[phase]))
                            if meas > 0:
                                out[term].append((w.logits_elements, meas - ops(other), meas, 0.0))
                            else:
                                self.notes.append(f"run {job}: stage {st}'s {phase} took no longer "
                                                  f"than its layers at the other stages' pace: no "
                                                  f"{term} row")
                    if dec.zero_stage == 0 and got.get("optimizer_step"):
                        out["optimizer_step"].append((w.param_tensors, w.params_per_rank,
                                                      got["optimizer_step"]))
                    if (facts.get("pipeline") and (facts.get("dp") or 1) == 1
                            and got.get("reduce_grads")):
                        out["grad_flatten"].append((w.params_per_rank, got["reduce_grads"]))
            except Exception as exc:  # a profile without an operator this run needs
                line = getattr(exc, "line", None)
                self.notes.append(f"run {job}: no engine rows ({line() if callable(line) else exc})")
        self.counts = {k: len(v) for k, v in out.items() if v}
        return out
