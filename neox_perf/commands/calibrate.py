"""`neox-perf calibrate`: measure this machine and write a cluster profile of it.

Four steps, each resumable, each reporting progress:
1. engine: the reference workload's model under a one-process DeepSpeed engine at fixed
   calibration shapes (never a validation config), for what the operator benchmarks cannot
   see (calibration/engine.py); resumed per shape from STORE.engine.json. It runs first: after
   the operator step its tensor-parallel pass ran slower than training launches do, and the
   mp 2 layouts carried that (docs/validation.md, stop 50);
2. operators: the plan's micro-benchmarks in this process (calibration.sweep.calibrate), one
   committed sample per point: a re-run skips what is stored, a kill loses at most the point
   in flight;
3. collectives: `torchrun --nproc_per_node N -m neox_perf.calibration.collectives` on this
   node (rank 0 writes the same store, skipping stored points), then all-reduce/all-gather at
   gradient-bucket sizes and the tensor-parallel all-reduce as training sees it. Across
   nodes, run `python -m neox_perf.calibration.collectives --store S --plan P` under your own
   launcher first (srun, mpirun or the deepspeed launcher, same store file); this step then
   finds those points stored;
4. fit: the predictors' trainer on the store's samples of this device
   (predictors/fitting/calibrated.fit_store) plus the engine terms (fitting/engine_fit.add_engine), written
   to $NEOX_PERF_HOME/profiles/NAME (or --out), where `--cluster NAME` finds it.

On a CPU the profile is a stand-in for a GPU cluster: every "GPU" is one single-threaded
process, the "GPU memory" is the machine's RAM, the links are gloo over shared memory.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .. import exitcodes
from ..calibration.engine import engine_path, run_engine, sweep_findings
from ..calibration.launch import (ENGINE_LIBRARIES, FIT_LIBRARIES, MEASURE_LIBRARIES,
                                  CalibrationFailed, default_processes, launch, progress_event,
                                  rank_env, require_libraries, use_caching_malloc)
from ..calibration.tp_allreduce import run_tp_benchmark, tp_path
from ..errors import UsageError

Progress = Callable[[str, float, float, str], None]  # (step, done, total, label)
STEPS = ("engine", "operators", "collectives", "fit")


@dataclass
class CalibrateResult:
    cluster: str
    profile_path: str
    store: str
    plan: str
    device: str
    operators: Dict[str, object] = field(default_factory=dict)
    collectives: Dict[str, object] = field(default_factory=dict)
    engine: Dict[str, object] = field(default_factory=dict)
    fit: List[Dict[str, object]] = field(default_factory=list)
    facts: Dict[str, object] = field(default_factory=dict)
    seconds: Dict[str, float] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    disturbance: Optional[Dict[str, object]] = None  # the profile's section: was it disturbed
    profile_warnings: List[str] = field(default_factory=list)
    steps_watched: Optional[Dict[str, object]] = None  # calibration/step_watch.StepWatch.record()
    command: str = "calibrate"
    render_hint: str = "calibrate_text"
    exit_code: int = exitcodes.OK

    def to_dict(self) -> dict:
        return {"cluster": self.cluster, "profile": self.profile_path, "store": self.store,
                "plan": self.plan, "device": self.device, "operators": self.operators,
                "collectives": self.collectives, "engine": self.engine, "fit": self.fit,
                "facts": self.facts,
                "seconds": self.seconds, "notes": self.notes, "disturbance": self.disturbance,
                "profile_warnings": self.profile_warnings, "steps_watched": self.steps_watched}


def default_home() -> Path:
    from ..profile.directory import user_profiles_dir
    return user_profiles_dir().parent


def _paths(args):
    from ..profile.directory import bundled_dir, user_profiles_dir
    name = str(args.cluster)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise UsageError(f"--cluster {name!r}: use letters, digits, '.', '_' and '-' (it names a folder)")
    out = Path(args.out).expanduser() if getattr(args, "out", None) else user_profiles_dir() / name
    if not getattr(args, "out", None) and (bundled_dir() / name).is_dir():
        raise UsageError(f"--cluster {name}: a bundled profile has that name and would hide yours; "
                         f"choose another name or pass --out DIR")
    store = (Path(args.store).expanduser() if getattr(args, "store", None)
             else default_home() / "stores" / f"{name}.sqlite")
    return name, out, store


def _plan(args):
    from ..calibration.plan import load_plan
    if getattr(args, "plan", None) and getattr(args, "quick", False):
        raise UsageError("--quick and --plan exclude each other: --quick is the bundled quick plan")
    source = args.plan if getattr(args, "plan", None) else ("quick" if args.quick else "full")
    plan = load_plan(source)  # a Plan object (one sized by a caller) is used as it is
    return (plan.name if source is plan else source), plan


def run_calibrate(args, progress: Optional[Progress] = None,
                  clock: Optional[Callable[[], float]] = None, grid=None) -> CalibrateResult:
    """args: cluster, quick, plan, store, out, nproc. ``clock`` and ``grid`` are for tests
    (an injected benchmark clock; a smaller tree grid)."""
    engine = getattr(args, "engine", True)
    require_libraries("calibrate", {**MEASURE_LIBRARIES, **(ENGINE_LIBRARIES if engine else {}),
                                    **FIT_LIBRARIES})
    from ..calibration.sweep import calibrate, pick_device
    from ..predictors.fitting.calibrated import fit_store
    from ..predictors.fitting.engine_fit import add_engine

    name, out, store = _paths(args)
    source, plan = _plan(args)
    nproc = int(getattr(args, "nproc", None) or default_processes())
    targets = config_targets(args.for_configs, getattr(args, "gpus", None) or nproc) \
        if getattr(args, "for_configs", None) else None
    if targets is not None:
        from ..calibration.plan import with_targets
        before = len(plan.points)
        plan = with_targets(plan, targets[0], {})  # collectives: run_target_collectives
    device = pick_device(None)
    result = CalibrateResult(cluster=name, profile_path=str(out), store=str(store), plan=plan.name,
                             device=device)
    store.parent.mkdir(parents=True, exist_ok=True)
    notes = result.notes
    if device == "cpu":
        if use_caching_malloc():
            notes.append("CPU: large tensors recycled from the heap (glibc mmap threshold 1 GiB, "
                         "no trimming), as a GPU's caching allocator recycles device memory")
        notes.append(f"CPU stand-in: each of the {nproc} processes plays one GPU with one thread")
    if targets is not None:
        notes.append(f"--for {' '.join(map(str, args.for_configs))}: {len(targets[0])} operator shapes "
                     f"(the configs' calls and x0.5/x2 on each one's leading size), "
                     f"{len(plan.points) - before} not in the {source} plan")

    from ..calibration.machine import CpuClock
    from ..calibration.step_watch import StepWatch
    # the steps beside the operators are watched whole when the real clock times them (an
    # injected clock's readings cannot be disturbed: the operator step watches itself alike)
    watch = StepWatch.for_device(device) if clock is None else None
    steps = _Steps(store, nproc, device, watch)

    started = time.monotonic()
    if getattr(args, "engine", True):
        shapes = getattr(args, "engine_shapes", None)  # a caller's smaller set (gpu_check --dry-run)
        result.engine = steps.engine(_stepper(progress, "engine"),
                                     **({"shapes": tuple(shapes)} if shapes else {}))
    result.seconds["engine"] = time.monotonic() - started

    started = time.monotonic()
    step = _stepper(progress, "operators")
    summary = calibrate(plan, store, clock=clock, progress=step, device=device,
                        quick=source == "quick")
    result.operators = {"points": summary.total, "measured": summary.measured,
                        "already_stored": summary.already_stored,
                        # stored but marked disturbed by an earlier run: measured again
                        "remeasured": summary.remeasured,
                        # timed again in the plan's later sweeps, their runs pooled (sweep.py)
                        "sweeps": summary.sweeps, "pooled": summary.pooled,
                        "failed": [{"point": p, "reason": r} for p, r in summary.failed],
                        "dtype": summary.dtype, "threads": summary.threads, "timer": summary.timer}
    result.seconds["operators"] = time.monotonic() - started
    since = CpuClock().mark()  # other processes' CPU time during the collectives

    started = time.monotonic()
    step = _stepper(progress, "collectives")
    result.collectives = steps.plan_collectives(plan, source, step)
    if targets is not None and nproc >= 2:
        result.collectives["for_configs"] = steps.target_collectives(targets[1])
    if nproc >= 2 and getattr(args, "engine", True):
        if step is not None:
            step(0, 1, "gradient-bucket sizes, tensor-parallel all-reduce in training")
        result.collectives["buckets"] = steps.buckets()
        result.collectives["tensor_parallel"] = steps.tensor_parallel()
        if step is not None:
            step(1, 1, "done")
    result.seconds["collectives"] = time.monotonic() - started
    if watch is not None:
        result.steps_watched = watch.record()
    if summary.disturbance is not None and (result.engine or result.collectives.get("measured")
                                            or result.collectives.get("buckets")):
        from ..calibration.sweep import recheck
        recheck(store, summary.run_id, device, "after the collectives", since,
                steps=result.steps_watched)

    started = time.monotonic()
    try:
        fitted = fit_store(store, name, out, dtype=summary.dtype, gpus_per_node=nproc, grid=grid,
                           progress=_stepper(progress, "fit"), extra_notes=tuple(notes))
        table = list(fitted.table)
        if getattr(args, "engine", True):
            table += add_engine(out, engine_path(store), tp_path(store))
    except ValueError as exc:
        raise CalibrationFailed(f"{store}: cannot fit a profile: {exc}") from None
    result.seconds["fit"] = time.monotonic() - started
    result.fit = [row.to_dict() for row in table]
    result.facts = fitted.manifest.facts.to_dict()
    if fitted.manifest.disturbance is not None:
        from ..profile.disturbance import profile_warnings
        result.disturbance = fitted.manifest.disturbance.to_dict()
        result.profile_warnings = profile_warnings(fitted)
    if summary.failed:
        notes.append(f"{len(summary.failed)} plan points could not be measured (see operators.failed)")
    return result


class _Steps:
    """The steps after the operators, each run under ``watch`` (None: unwatched, as with an
    injected clock) with a way to run it again into a scratch target whose result replaces
    the first only when the re-run was quiet (calibration/step_watch.py)."""

    def __init__(self, store: Path, nproc: int, device: str, watch):
        self.store, self.nproc, self.device, self.watch = store, nproc, device, watch

    def _run(self, name: str, fn, retime):
        if self.watch is None:
            return fn()
        again, scratch = retime
        try:
            return self.watch.run(name, fn, again)
        finally:
            # a re-run judged disturbed too is not committed: its scratch goes (a committed one
            # was moved or merged away already)
            _remove(scratch)

    def _scratch(self, step: str, suffix: str) -> Path:
        """Where ``step`` is run again: one name per step (the engine's and the tensor-parallel
        results are both .json: one scratch name had let one step's leftover stand as the
        other's)."""
        return self.store.with_name(f"{self.store.stem}.retime-{step}{suffix}")

    def _collectives_again(self, step: str, run_into):
        scratch = self._scratch(step, ".sqlite")

        def retime():
            _remove(scratch)
            run_into(scratch)
            return lambda: _merge_collectives(scratch, self.store)
        return retime, scratch

    def plan_collectives(self, plan, source: str, progress):
        return self._run("collectives",
                         lambda: launch_plan_collectives(self.store, plan, source, self.nproc,
                                                         self.device, progress),
                         self._collectives_again("collectives", lambda s: launch_plan_collectives(
                             s, plan, source, self.nproc, self.device)))

    def target_collectives(self, sizes):
        return self._run("collectives at the --for sizes",
                         lambda: run_target_collectives(self.store, sizes, self.nproc, self.device),
                         self._collectives_again("target-collectives", lambda s: run_target_collectives(
                             s, sizes, self.nproc, self.device)))

    def buckets(self):
        return self._run("gradient-bucket collectives",
                         lambda: run_bucket_collectives(self.store, self.nproc, self.device),
                         self._collectives_again("buckets", lambda s: run_bucket_collectives(
                             s, self.nproc, self.device)))

    def _file_again(self, step: str, final: Path, run_into):
        scratch = self._scratch(step, final.suffix)

        def retime():
            _remove(scratch)
            run_into(scratch)
            return lambda: scratch.replace(final)
        return retime, scratch

    def tensor_parallel(self):
        final = tp_path(self.store)
        return self._run("tensor-parallel all-reduce",
                         lambda: run_tp_benchmark(final, self.nproc, self.device),
                         self._file_again("tp", final, lambda s: run_tp_benchmark(s, self.nproc, self.device)))

    def engine(self, progress, **kwargs):
        final = engine_path(self.store)
        out = self._run("engine",
                        lambda: run_engine(final, self.device, progress, nproc=self.nproc, **kwargs),
                        self._file_again("engine", final, lambda s: run_engine(s, self.device, None,
                                                                                nproc=self.nproc, **kwargs)))
        if self.watch is not None:
            # a pass whose two sweeps disagree: the machine slowed for a whole sweep
            self.watch.flag("engine", sweep_findings(final))
        return out


def _merge_collectives(scratch: Path, store: Path) -> None:
    """The re-run's collective samples over the first run's (same points, replaced)."""
    from ..calibration.store import COLLECTIVE_PHASE, SampleStore
    with SampleStore(scratch) as src, SampleStore(store) as dst:
        runs = {}
        for x in src.samples(source="calibrate"):
            if x.phase != COLLECTIVE_PHASE:
                continue
            device = dst.register_device(src.device(x.device_id))
            if x.run_id not in runs:
                runs[x.run_id] = dst.register_run("calibrate", device=device, plan="collectives",
                                                  info={**src.run(x.run_id)["info"], "retimed": True})
            dst.add_sample(x.op, x.phase, x.features, x.seconds, device=device, run=runs[x.run_id],
                           dtype=x.dtype, repeats=x.repeats, median=x.median, iqr=x.iqr,
                           min_seconds=x.min, info={**x.info, "retimed": True}, replace=True)
    _remove(scratch)


def _remove(path: Path) -> None:
    """A scratch file, with the WAL and shared-memory files SQLite keeps beside a store."""
    for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        p.unlink(missing_ok=True)


def _stepper(progress: Optional[Progress], step: str):
    if progress is None:
        return None
    return lambda done, total, label: progress(step, done, total, label)


def _stored_collectives(store: Path, jobs) -> int:
    from ..calibration.store import COLLECTIVE_PHASE, SampleStore
    with SampleStore(store) as s:
        have = {(x.op, int(x.features["elements"]), int(x.features["nodes"]),
                 int(x.features["gpus_per_node"]))
                for x in s.samples(source="calibrate") if x.phase == COLLECTIVE_PHASE}
    return sum((j.kind, j.elements, *j.shape) in have for j in jobs)


def launch_plan_collectives(store: Path, plan, source: str, nproc: int, device: str,
                            progress=None) -> Dict[str, object]:
    """The plan's collectives on this node under torchrun; rank 0 writes the store."""
    from ..calibration.collectives import plan_jobs, torchrun_command
    jobs = plan_jobs(dict(plan.collectives), 1, nproc)
    info: Dict[str, object] = {"processes": nproc, "jobs": len(jobs)}
    if nproc < 2 or not jobs:
        info["skipped"] = ("one process: nothing to communicate with" if nproc < 2
                           else "the plan has no collectives section")
        if progress is not None:
            progress(1, 1, "skipped")
        return info
    before = _stored_collectives(store, jobs)
    info["already_stored"] = before
    done = [before]

    def on_line(line: str) -> None:
        event = progress_event(line)
        if event is not None and "measured" in event:
            done[0] += 1
            if progress is not None:
                progress(done[0], len(jobs), str(event["measured"]))

    cmd = torchrun_command(nproc, store, plan=source, master_port=0)
    launch(cmd, rank_env(device), store.with_suffix(".collectives.log"), on_line=on_line,
           what="collectives launch")
    info["measured"] = _stored_collectives(store, jobs) - before
    if progress is not None:
        progress(len(jobs), len(jobs), "done")
    return info


def run_bucket_collectives(store: Path, nproc: int, device: str) -> Dict[str, object]:
    """All-reduce and all-gather at gradient-bucket sizes: DeepSpeed reduces a whole stage's
    gradients at once (buckets up to 5e8 elements), far beyond the plan's message sizes, and
    gloo/nccl bandwidth changes there (caches, chunking), so extrapolating would under-predict."""
    from ..calibration.collectives import plan_jobs, torchrun_command
    sizes = {k: BUCKET_ELEMENTS for k in ("allreduce", "allgather")}
    jobs = plan_jobs(sizes, 1, nproc)
    before = _stored_collectives(store, jobs)
    if nproc < 2 or before == len(jobs):
        return {"jobs": len(jobs), "already_stored": before, "measured": 0}
    cmd = torchrun_command(nproc, store, sizes=BUCKET_ELEMENTS, master_port=0)
    cmd += ["--ops", "allreduce", "allgather", "--quiet"]
    launch(cmd, rank_env(device), store.with_suffix(".buckets.log"))
    return {"jobs": len(jobs), "already_stored": before,
            "measured": _stored_collectives(store, jobs) - before}


def run_target_collectives(store: Path, sizes: Dict[str, tuple], nproc: int, device: str
                           ) -> Dict[str, object]:
    """The collective sizes `--for` configs send, one launch per kind still missing some
    (the plan's launch is driven by the plan file, which does not hold them)."""
    from ..calibration.collectives import plan_jobs, torchrun_command
    info: Dict[str, object] = {"jobs": 0, "already_stored": 0, "measured": 0}
    for kind, elements in sorted(sizes.items()):
        jobs = plan_jobs({kind: elements}, 1, nproc)
        before = _stored_collectives(store, jobs)
        info["jobs"] += len(jobs)
        info["already_stored"] += before
        if before == len(jobs):
            continue
        cmd = torchrun_command(nproc, store, sizes=elements, master_port=0) + ["--ops", kind, "--quiet"]
        launch(cmd, rank_env(device), store.with_suffix(f".for-{kind}.log"), what=f"{kind} launch")
        info["measured"] += _stored_collectives(store, jobs) - before
    return info


def config_targets(configs, gpus: int):
    """(plan points, {collective kind: elements}) of what ``configs`` run on ``gpus`` GPUs:
    the decomposition check and validate predict from, so the samples are the job's shapes."""
    import os

    from ..calibration.plan import decomposition_targets
    from ..config import WorldRequest, build, load_files, raw_vocab
    from ..derive import derive
    from ..prediction.operators import decompose
    from ..prediction.predict import stage_shapes

    points: list = []
    sizes: Dict[str, set] = {}
    for config in configs:
        raw = load_files([config])
        cfg, verdicts, _ = build(raw, WorldRequest(gpus=int(gpus)))
        errors = [v for v in verdicts if v.level == "error"]
        if errors:
            raise UsageError(f"--for {config}: {errors[0].line()}")
        source = cfg.sources.get("vocab_file")
        vocab = raw_vocab(cfg.model.tokenizer_type, cfg.model.vocab_file, None,
                          [os.path.dirname(source)] if source else []).size
        try:
            derived = derive(cfg, vocab, None)
        except ValueError as exc:
            raise UsageError(f"--for {config}: {exc}") from None
        decomp = decompose(cfg, derived.padded_vocab, stage_shapes(derived))
        more, colls = decomposition_targets(decomp)
        points += more
        for kind, elements in colls.items():
            sizes.setdefault(kind, set()).update(elements)
    return list(dict.fromkeys(points)), {k: tuple(sorted(v)) for k, v in sizes.items()}


# All-reduce and all-gather at gradient-bucket sizes (see run_bucket_collectives).
BUCKET_ELEMENTS = (16777216, 67108864)
