"""`neox-perf validate`: run the reference workload for real and hold the prediction against it.

For each config (several YAML files merge into one, as for check): predict the iteration with
the cluster profile, launch the NeoX-shaped workload under the real DeepSpeed engine with
torchrun (calibration.validate_worker wraps it and times DeepSpeed's own phases on every rank),
drop the warm-up iterations and compare.

Measured seconds are per optimizer step, the slowest rank's. A prediction is for the typical
iteration, what a run costs: it is compared with the *median* over the measured iterations,
and the fastest is reported beside it (the best step a run had, which a job's wall time does
not get).

Components are compared per pipeline stage in the terms both sides can see (measured: the
split of each rank's typical iteration, at the median of its times):
  forward   forward passes incl. the loss (PipelineEngine ForwardPass; DeepSpeedEngine.forward
            + loss for pp = 0), without their tensor-parallel all-reduces
  backward  backward passes incl. recompute, without all-reduces
  tp_allreduce  the tensor-parallel all-reduces of forward, backward and recompute
  p2p       pipeline send/recv instructions, including the time a stage waits in them
  grad_sync ReduceTiedGrads + the data-parallel gradient all-reduce (allreduce_gradients)
  optimizer the optimizer step (with its grad-norm all-reduce and ZeRO's all-gather, and,
            predicted, the wait for the slowest stage before it)
  other     measured only: the iteration minus all of the above (schedule, data, loss
            reduction); the model has no term for it, so it is the framework overhead.

A profile predicts the machine as it ran while `calibrate` timed it, and a machine's speed
moves (a shared VM here: the calibration's reference loop 0.73-0.92 ms within one hour). Where
the profile's calibration recorded its fixed reference on a CPU (calibration/disturbance.Probe,
timed at its start), the same reference is timed just before and just after the launch: their
mean over the calibration's is the speed the launch found (`reference_seconds_per_loop`,
`machine_speed`, above 1 when faster than calibrated), and `error_at_machine_speed` is the
prediction scaled to it. `error` stays the plain comparison.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from .. import exitcodes
from ..calibration.launch import (CACHING_MALLOC_ENV, CalibrationFailed, cuda_available,
                                  has_module, launch, progress_event)
from ..errors import ConfigError, NeoxPerfError, UsageError
from ..result import coverage_rows

WARMUP_ITERATIONS = 2
COMPONENTS = ("forward", "backward", "tp_allreduce", "p2p", "grad_sync", "optimizer", "other")
LAUNCH_TIMEOUT_S = 3600.0
Progress = Callable[[float, float, str], None]
T = TypeVar("T")


class LaunchFailed(NeoxPerfError):
    """The workload launch failed: one line with the reason and where the log is."""


@dataclass
class ConfigValidation:
    config: List[str]
    layout: Dict[str, object]
    predicted_seconds: float
    measured_seconds: float  # min over the measured iterations of the slowest rank (the fastest)
    measured_median_seconds: float  # their median: the typical iteration, what `error` is against
    iterations: int
    warmup: int
    components: List[Dict[str, object]]  # per component: predicted / measured seconds, error
    stages: List[Dict[str, object]]  # per stage, per component: predicted / measured
    notes: List[str] = field(default_factory=list)
    interval_seconds: Optional[List[float]] = None  # the prediction's 80% interval, if any
    # per operator/phase: sampled, interpolated or extrapolated (and how far), see result.coverage_rows
    coverage: List[Dict[str, object]] = field(default_factory=list)
    extrapolated_share: float = 0.0  # of the predicted iteration, outside the sampled ranges
    # per stage: peak live bytes predicted vs measured, per component (runs/memory.stage_rows)
    memory: List[Dict[str, object]] = field(default_factory=list)
    # the calibration's reference loop timed around the launch (seconds per loop), and the
    # machine's speed that says against the calibration's (>1: faster); None without a reference
    reference_seconds_per_loop: Optional[float] = None
    machine_speed: Optional[float] = None

    @property
    def error(self) -> float:
        """Against the typical (median) iteration, which the prediction is for."""
        return self.predicted_seconds / self.measured_median_seconds - 1.0

    @property
    def error_fastest(self) -> float:
        return self.predicted_seconds / self.measured_seconds - 1.0

    @property
    def error_at_machine_speed(self) -> Optional[float]:
        """The prediction scaled to the machine's speed during the launch, against the median."""
        if not self.machine_speed:
            return None
        return self.predicted_seconds / self.machine_speed / self.measured_median_seconds - 1.0

    def to_dict(self) -> dict:
        return {"config": self.config, "layout": self.layout,
                "predicted_seconds": self.predicted_seconds,
                "measured_seconds": self.measured_seconds,
                "measured_median_seconds": self.measured_median_seconds,
                "error": self.error, "error_fastest": self.error_fastest,
                "error_against": "median", "iterations": self.iterations, "warmup": self.warmup,
                "components": self.components, "stages": self.stages, "notes": self.notes,
                "interval_seconds": self.interval_seconds, "coverage": self.coverage,
                "memory": self.memory, "reference_seconds_per_loop": self.reference_seconds_per_loop,
                "machine_speed": self.machine_speed, "error_at_machine_speed": self.error_at_machine_speed}


@dataclass
class ValidateResult:
    cluster: str
    gpus: int
    results: List[ConfigValidation] = field(default_factory=list)
    profile_warnings: List[str] = field(default_factory=list)  # a disturbed calibration's
    command: str = "validate"
    render_hint: str = "validate_text"
    exit_code: int = exitcodes.OK

    @property
    def component_names(self) -> Sequence[str]:  # the columns of every result's components
        return COMPONENTS

    @property
    def mape(self) -> Optional[float]:
        if not self.results:
            return None
        return sum(abs(r.error) for r in self.results) / len(self.results)

    @property
    def max_abs_error(self) -> Optional[float]:
        return max((abs(r.error) for r in self.results), default=None)

    @property
    def mean_signed_error(self) -> Optional[float]:  # a bias the absolute mean hides
        if not self.results:
            return None
        return sum(r.error for r in self.results) / len(self.results)

    def to_dict(self) -> dict:
        return {"cluster": self.cluster, "gpus": self.gpus,
                "results": [r.to_dict() for r in self.results],
                "mean_absolute_percentage_error": None if self.mape is None else 100 * self.mape,
                "max_absolute_percentage_error": None if self.max_abs_error is None
                else 100 * self.max_abs_error,
                "mean_signed_percentage_error": None if self.mean_signed_error is None
                else 100 * self.mean_signed_error,
                "profile_warnings": list(self.profile_warnings)}


# -- prediction -----------------------------------------------------------------------------

@dataclass
class Predicted:
    cfg: object
    vocab: int
    estimate: object
    decomposition: object
    precision: str  # what the run really computes in


def run_precision(cfg, device_type: str) -> str:
    # The workload runs fp32 on a CPU whatever the config asks (calibration/workload/ds_config).
    from ..calibration.workload.ds_config import run_precision as workload_precision
    return workload_precision(cfg, device_type)


def predict(configs: Sequence[str], gpus: int, profile, vocab_size: Optional[int],
            device_type: str) -> Predicted:
    from ..prediction import predict as pipeline
    from ..config import WorldRequest, build, load_files, raw_vocab
    from ..derive import derive

    raw = load_files(list(configs))
    cfg, verdicts, _ = build(raw, WorldRequest(gpus=gpus),
                             cluster_gpus_per_node=profile.facts.gpus_per_node)
    errors = [v for v in verdicts if v.level == "error"]
    if errors:
        raise ConfigError(errors[0].line())
    vocab_source = cfg.sources.get("vocab_file")
    search = [os.path.dirname(vocab_source)] if vocab_source else []
    vocab = raw_vocab(cfg.model.tokenizer_type, cfg.model.vocab_file, vocab_size, search).size
    from ..calibration.workload.dims import from_neox
    try:  # before launching: what the reference workload cannot reproduce, in one line
        from_neox(cfg, vocab)
    except ValueError as exc:
        raise ConfigError(str(exc), file=configs[-1]) from None
    precision = run_precision(cfg, device_type)
    p = pipeline.predict(cfg, derive(cfg, vocab, None), profile, precision=precision)
    return Predicted(cfg, vocab, p.estimate, p.decomposition, precision)


_PREDICTED_KIND = {"forward": "forward", "backward": "backward", "send_act": "p2p",
                   "send_grad": "p2p", "send_wait": "p2p", "recv_wait": "p2p",
                   "tied_wait": "grad_sync", "tied_allreduce": "grad_sync",
                   "dp_wait": "grad_sync", "grad_allreduce": "grad_sync", "sync_wait": "optimizer",
                   "optimizer": "optimizer", "allgather": "optimizer"}


def _tp_seconds(work, profile, engine=None) -> tuple:
    """(forward, backward) tensor-parallel all-reduce seconds of one micro-batch on a stage, as
    the estimate counts them; recomputed forwards reduce again, inside backward."""
    def one(c):
        measured = engine.tp_allreduce(c) if engine is not None else None
        if measured is not None:
            return measured
        return profile.predict_collective(c.kind, c.elements, c.nodes, c.gpus_per_node).seconds

    def comm(calls):
        return sum(one(c) * c.count for c in calls if getattr(c, "purpose", None) == "mp_allreduce")
    n, layer_f = work.transformer_layers, comm(work.layer_forward)
    return (n * layer_f + comm(work.forward),
            n * comm(work.layer_backward) + work.recompute_layers * layer_f + comm(work.backward))


def predicted_stage_components(est, decomp=None, profile=None) -> List[Dict[str, float]]:
    stages = [dict.fromkeys(COMPONENTS, 0.0) for _ in est.stages]
    for ev in est.timeline.events:
        stages[ev.stage][_PREDICTED_KIND[ev.kind]] += ev.end - ev.start
    if decomp is not None and profile is not None:
        from ..prediction.corrections import EngineTerms
        engine = EngineTerms.of(profile, decomp)
        for comp, work in zip(stages, decomp.stages):
            tp_f, tp_b = (decomp.micro_batches * t for t in _tp_seconds(work, profile, engine))
            comp["forward"] -= tp_f
            comp["backward"] -= tp_b
            comp["tp_allreduce"] = tp_f + tp_b
    return stages


# -- measurement ----------------------------------------------------------------------------

def measured_stage_components(phases: Dict[int, List[dict]], ranks: List[dict],
                              warmup: int) -> List[Dict[str, float]]:
    """Per stage, per component: each rank's split of its typical measured iteration, the one
    at the median of its times (the parts add up to it; a wait and the work it waits for come
    from the same iteration), averaged over the stage's ranks (its tensor- and data-parallel
    replicas)."""
    by_stage: Dict[int, List[Dict[str, float]]] = {}
    for rank in ranks:
        iters = phases.get(rank["rank"], [])[warmup:]
        if not iters:
            continue
        typical = sorted(iters, key=lambda it: it["iteration"])[(len(iters) - 1) // 2]
        parts = {c: typical.get(c, 0.0) for c in COMPONENTS if c != "other"}
        parts["other"] = max(typical["iteration"] - sum(parts.values()), 0.0)
        by_stage.setdefault(rank["stage"], []).append(parts)
    return [{c: statistics.fmean(r[c] for r in by_stage[s]) for c in COMPONENTS}
            for s in sorted(by_stage)]


def _component_rows(pred: List[Dict[str, float]], meas: List[Dict[str, float]]) -> List[dict]:
    rows = []
    for c in COMPONENTS:
        p = max((s[c] for s in pred), default=0.0)
        m = max((s[c] for s in meas), default=0.0)
        rows.append({"component": c, "predicted_seconds": p, "measured_seconds": m,
                     "error": (p / m - 1.0) if m > 0 else None})
    return rows


def launch_command(nproc: int, configs: Sequence[str], iters: int, vocab: int, out: Path,
                   phases_dir: Path, port: int) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(port), "-m", "neox_perf.calibration.validate_worker", "--phases-dir", str(phases_dir), "--",
            "--config", *map(str, configs), "--iters", str(iters), "--vocab-size", str(vocab),
            "--out", str(out), "--no-deterministic"]


def run_workload(configs: Sequence[str], nproc: int, iters: int, vocab: int, workdir: Path,
                 progress: Optional[Progress] = None, label: str = "") -> dict:
    """Launch the instrumented workload; return its result dict with "phases" added."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun would; a CPU rank must not oversubscribe
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    if not cuda_available():
        env.update(CACHING_MALLOC_ENV)
    workdir = Path(workdir).resolve()  # the ranks run in it: their paths must not be relative
    out, phases_dir = workdir / "result.json", workdir / "phases"
    phases_dir.mkdir(parents=True, exist_ok=True)
    for stale in [out, *phases_dir.glob("rank.*.json"), *phases_dir.glob("memory.*.json")]:
        # a previous validation's, same workdir
        stale.unlink(missing_ok=True)

    def on_line(line: str) -> None:
        event = progress_event(line)
        if event is not None and progress is not None and "iteration" in event:
            progress(int(event["iteration"]), iters, label)

    if progress is not None:
        progress(0, iters, f"{label} (starting)")
    try:
        launch(launch_command(nproc, configs, iters, vocab, out, phases_dir, 0), env,
               workdir / "launch.log", on_line=on_line, cwd=workdir, timeout_s=LAUNCH_TIMEOUT_S,
               what="workload launch")
    except CalibrationFailed as exc:
        raise LaunchFailed(exc.line()) from None
    if not out.is_file():
        raise LaunchFailed(f"workload launch wrote no result {out} (full log: {workdir / 'launch.log'})")
    result = json.loads(out.read_text())
    result["phases"] = {int(p.stem.split(".")[-1]): json.loads(p.read_text())
                        for p in phases_dir.glob("rank.*.json")}
    result["memory"] = {int(p.stem.split(".")[-1]): json.loads(p.read_text())
                        for p in phases_dir.glob("memory.*.json")}
    return result


# -- the command ----------------------------------------------------------------------------

def _layout(cfg) -> Dict[str, object]:
    m, p, t = cfg.model, cfg.parallel, cfg.training
    return {"pp": p.pipe_parallel_size, "mp": p.model_parallel_size, "dp": p.data_parallel_size,
            "micro_batch": t.micro_batch_size, "grad_accum": t.gradient_accumulation_steps,
            "seq": m.seq_length, "hidden": m.hidden_size, "layers": m.num_layers,
            "heads": m.num_attention_heads, "recompute": t.checkpoint_activations,
            "norm": m.norm, "attention": "flash" if m.uses_flash else "unfused",
            "zero": t.zero_stage}


def reference_clock(profile) -> Optional[Callable[[], Optional[float]]]:
    """A function timing the profile's calibration reference now (seconds per loop; None when a
    reading fails: it is information, never a reason for the validation to stop), or None for a
    profile whose calibration recorded none (bundled profiles, descriptions, older stores) or
    recorded it on a GPU: timing it there from this process would hold a CUDA context on the
    device beside the ranks while they train."""
    from ..profile.disturbance import reference

    ref = reference(profile)
    if ref is None or ref.device != "cpu":
        return None
    from ..calibration.disturbance import Probe
    probe = Probe(ref.device, ref.dtype, ref.loops)

    def read() -> Optional[float]:
        try:
            return probe.seconds_per_loop()
        except Exception:  # noqa: BLE001 - see above
            return None
    return read


def machine_speed(profile, seconds_per_loop: Optional[float]) -> Optional[float]:
    """The calibration's reference cost over ``seconds_per_loop`` (its cost now): above 1, the
    machine runs faster than it was calibrated at."""
    from ..profile.disturbance import reference

    ref = reference(profile)
    return ref.speed_at(seconds_per_loop) if ref is not None else None


def around_launch(profile, launch: Callable[[], T]) -> Tuple[T, Optional[float]]:
    """``launch()``'s result, and the profile's calibration reference timed just before and
    just after it (their mean, seconds per loop; None where either was not read)."""
    clock = reference_clock(profile)
    before = clock() if clock else None
    out = launch()
    after = clock() if clock else None
    return out, ((before + after) / 2 if before and after else None)


def validate_one(configs: Sequence[str], gpus: int, profile, iters: int,
                 vocab_size: Optional[int] = None, progress: Optional[Progress] = None,
                 workdir: Optional[Path] = None) -> ConfigValidation:
    device_type = "cuda" if cuda_available() else "cpu"
    pred = predict(configs, gpus, profile, vocab_size, device_type)
    label = Path(configs[-1]).stem
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="neox-perf-validate-")) if own else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    run, now = around_launch(profile, lambda: run_workload(
        [os.path.abspath(c) for c in configs], gpus, WARMUP_ITERATIONS + iters, pred.vocab, work,
        progress, label))
    per_iter = run["seconds_per_iter"][WARMUP_ITERATIONS:]
    pred_stages = predicted_stage_components(pred.estimate, pred.decomposition, profile)
    meas_stages = measured_stage_components(run["phases"], run["ranks"], WARMUP_ITERATIONS)
    stages = [{"stage": s, **{f"{c}_predicted": p[c] for c in COMPONENTS},
               **{f"{c}_measured": m.get(c, 0.0) for c in COMPONENTS}}
              for s, (p, m) in enumerate(zip(pred_stages, meas_stages))]
    notes = list(pred.decomposition.notes) + list(run.get("notes", []))
    notes += [f"{f.what}: {f.reason}" for f in pred.estimate.flags]
    memory = measured_memory(pred, run.get("memory") or {}, device_type, notes)
    if own:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    return ConfigValidation(
        config=[str(c) for c in configs], layout={**_layout(pred.cfg), "precision": pred.precision,
                                                  "vocab": pred.vocab},
        predicted_seconds=pred.estimate.iteration_seconds, measured_seconds=min(per_iter),
        measured_median_seconds=statistics.median(per_iter), iterations=len(per_iter),
        warmup=WARMUP_ITERATIONS, components=_component_rows(pred_stages, meas_stages),
        stages=stages, notes=list(dict.fromkeys(notes)),
        interval_seconds=list(pred.estimate.interval_seconds) if pred.estimate.interval_seconds else None,
        coverage=coverage_rows(pred.estimate), extrapolated_share=pred.estimate.extrapolated_share,
        memory=memory, reference_seconds_per_loop=now, machine_speed=machine_speed(profile, now))


def measured_memory(pred: Predicted, per_rank: Dict[int, dict], device_type: str,
                    notes: List[str]) -> List[dict]:
    """Peak live bytes per stage, predicted for what the workload ran (its precision, this
    device) against each rank's live-bytes window (validate_worker)."""
    import dataclasses

    from ..derive import derive
    from ..runs.memory import stage_rows
    errors = [m["error"] for m in per_rank.values() if m.get("error")]
    if errors:
        notes.append(f"memory not measured: {errors[0]}")
    summaries = [{"rank": r, "facts": {"stage": m.get("stage", 0)}, "memory": {"live": m}}
                 for r, m in per_rank.items() if not m.get("error")]
    if not summaries:
        return []
    cfg = dataclasses.replace(pred.cfg, training=dataclasses.replace(
        pred.cfg.training, precision=pred.precision))
    return stage_rows(summaries, derive(cfg, pred.vocab, device="cpu" if device_type == "cpu" else "cuda"))


def check_inputs(args) -> None:
    """What every validation needs before it launches anything (`--neox` too)."""
    for path in args.configs:
        if not os.path.isfile(path):
            raise UsageError(f"{path}: no such config file")
    if not has_module("deepspeed"):  # fail here, in one line, not in N ranks
        raise UsageError("validate runs the workload under DeepSpeed, not installed here (fix: "
                         "pip install '.[runtime]' in the neox-perf checkout, your torch first)") from None


def run_validate(args, progress: Optional[Progress] = None) -> ValidateResult:
    """args: configs, gpus, cluster, iters, vocab_size (optional), workdir (optional). The
    reference workload; `--neox` (GPT-NeoX's own train.py) is validate_neox's, which the
    command line calls instead."""
    check_inputs(args)
    from ..prediction.predict import load_cluster
    profile = load_cluster(args.cluster)
    iters = int(getattr(args, "iters", None) or 10)
    from ..profile.disturbance import profile_warnings
    result = ValidateResult(cluster=profile.name, gpus=args.gpus,
                            profile_warnings=profile_warnings(profile))
    workdir = getattr(args, "workdir", None)
    one = validate_one(args.configs, args.gpus, profile, iters, getattr(args, "vocab_size", None),
                       progress, Path(workdir) if workdir else None)
    result.results.append(one)
    # a calibrated profile learns its interval from its own validations (the measured median,
    # what the prediction is compared with); bundled profiles are not written
    from ..profile_validation import record
    try:
        note = record(profile, list(args.configs), one.measured_median_seconds, one.predicted_seconds,
                      one.extrapolated_share)
    except (OSError, ValueError) as exc:  # the validation stands; only the record is lost
        note = f"not recorded in the profile ({exc.__class__.__name__}: {exc})"
    if note:
        one.notes.append(note)
    return result
