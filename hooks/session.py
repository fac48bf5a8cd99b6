"""One rank's hook: attached to the first DeepSpeed engine, detached on the first error.

The engine wrappers (engine_patch) call `begin_iteration`, `end_iteration`, `enter` and
`leave`; each of these catches everything it raises, reports it once and turns the
session off (`live` False, wrappers removed), so training carries on as if never hooked.
Exceptions raised by training itself pass through the wrappers untouched.
"""
from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from neox_perf.runs import files as runfiles

from . import failures
from .sample_writer import InjectedFailure, SampleWriter
from .settings import ALL as SWITCH_VARIABLES
from .settings import Settings
from .trace_map import Dims, Groups, MapContext, WindowResult, infer_dims, map_events

SUMMARY_EVERY_S = 30.0
EXIT_WAIT_S = 10.0  # rank 0 waits this long at exit for the other ranks' final summaries
UNMAPPED_KEPT = 40
REPORT_TIMEOUT_S = 120.0


class Session:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.live = False
        self.engine = None
        self.rank = int(os.environ.get("RANK", "0"))
        self.facts: Dict[str, Any] = {}
        self.config: Dict[str, Any] = {}
        self.ctx = MapContext()
        self.clock = None
        self.windowed = None
        self.writer: Optional[SampleWriter] = None
        self.memory = None  # MemoryProbe: per-component state and the peak, for the report
        self.live_memory = None  # live_memory.LiveMemory while its iteration runs
        self.live_result: Optional[Dict[str, Any]] = None  # what it measured
        self._live_iteration: Optional[int] = None  # which iteration it tracks
        self.total = WindowResult()
        self.window_meta: List[dict] = []
        self.prediction: Optional[dict] = None
        self.notes: List[str] = []
        self.error: Optional[str] = None
        self.started = time.time()
        self._iter_rf = None
        self._after_window = False
        self._phase_clock = False  # CPU ranks time their phases between windows (enter/leave)
        self._phase_seconds: Dict[str, float] = {}  # the current iteration's, by phase
        self._last_summary = 0.0
        self._finished = False
        # the hook's own time at iteration boundaries, outside profiling windows: what it costs
        # a run between windows (the wrappers' other work is a flag test)
        self._self_pending = 0.0
        self._self_cpu_pending = 0.0
        self.self_seconds = 0.0
        # the same time as the hook thread's own CPU work: on a shared or oversubscribed host a
        # wall clock also counts the moments the scheduler gave the core to someone else
        self.self_cpu_seconds = 0.0
        self.self_iterations = 0

    # ---- attaching -------------------------------------------------------------------
    def attach(self, engine, init_args: tuple, init_kwargs: dict) -> None:
        from . import engine_facts, engine_patch, neox_args
        from .timing import IterationClock
        if self.engine is not None:
            self.note("a second deepspeed.initialize was not hooked (only the first engine is)")
            return
        self.engine = engine
        if self.settings.inject == "initialize":
            raise InjectedFailure("injected failure while attaching (PYTHON_NEOX_PERF_INJECT)")
        f = self.facts = engine_facts.facts(engine)
        self.rank = int(f["rank"])
        os.makedirs(self.settings.run_dir, exist_ok=True)
        args = init_kwargs.get("args", init_args[0] if init_args else None)
        self.config = neox_args.discover(args, self.settings)
        dims = self._dims()
        self.ctx = MapContext(
            dims=dims, groups=Groups(dp=f.get("dp") or 1, mp=f.get("mp") or 1,
                                     stages=f.get("stages") or 1, stage=f.get("stage") or 0,
                                     local_world=f.get("local_world_size")),
            device=f["device_type"], dtype=f["dtype"], optimizer_params=f.get("optimizer_params"))
        sync = None
        if f["device_type"] == "cuda":
            import torch
            sync = torch.cuda.synchronize
        self.clock = IterationClock(runfiles.iterations_file(self.settings.run_dir, self.rank), sync)
        self._phase_clock = f["device_type"] != "cuda"
        self.writer = SampleWriter(self.settings.run_dir, f, self.settings.job, self.settings.inject)
        from .memory import MemoryProbe
        self.memory = MemoryProbe(f["device_type"])
        if self.settings.windows.enabled:
            from .profiling import Windowed
            self.windowed = Windowed(self.settings.windows, f["device_type"], self._window)
            self.windowed.notes = self.notes  # one list: the summary sees the profiler's notes
        self._live_iteration = self._memory_iteration()
        if self.rank == 0:
            self._predict_at_start()
        engine_patch.wrap_engine(engine, self)
        self.live = True
        atexit.register(self.finish)
        self.write_summary()

    def _dims(self) -> Dims:
        if not self.config.get("values"):
            return Dims()
        from neox_perf.runs import prediction
        try:
            cfg, derived, notes = prediction.rebuild(self.config, self.facts)
        except Exception as exc:
            self.note(f"config could not be rebuilt ({exc.__class__.__name__}: {exc}); "
                      f"operator widths are inferred from the trace")
            return Dims()
        for n in notes:
            self.note(n)
        return config_dims(cfg, derived) if cfg is not None else Dims()

    def _predict_at_start(self) -> None:
        from neox_perf.runs import prediction
        profile, why = prediction.load(self.settings.cluster)
        if profile is None:
            self.prediction = {"iteration_seconds": None, "notes": [why]}
            _say(why)
            return
        self.prediction = prediction.predict(self.config, self.facts, profile)
        seconds = self.prediction.get("iteration_seconds")
        if seconds is None:
            _say("no iteration prediction: " + "; ".join(self.prediction["notes"][:2]))
        else:
            _say(f"predicted iteration time {seconds:.4g} s on {profile.name} "
                 f"(config: {self.config.get('source')})")

    def _memory_iteration(self) -> Optional[int]:
        """The first iteration from the setting's that no profiling window covers (the two
        instruments would slow each other and the profiler would time the tracker)."""
        at = self.settings.memory_iteration
        if at is None:
            return None
        if self.windowed is not None:
            while self.windowed.schedule.profiled(at):
                at += 1
        return at

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # ---- called by the wrappers (never raise) --------------------------------------------
    def guard(self, where: str, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:
            self.fail(where, exc)
            return None

    def begin_iteration(self) -> None:
        def go():
            if self.clock.count == self._live_iteration and self.live_memory is None:
                self._start_live_memory()
            self.clock.start()
            if self.windowed is not None and self.windowed.active:
                from torch.autograd.profiler import record_function
                self._iter_rf = record_function("neox_perf::iteration")
                self._iter_rf.__enter__()
        # the CPU clock is read inside the wall clock's reads, so that the CPU interval lies
        # within the wall one: read in the same order at both ends, each interval holds the
        # other clock's syscall and the CPU time of a sub-millisecond span read above its wall
        # time in 96% of 20,000 trials here (up to 2x)
        t0 = time.perf_counter()
        c0 = time.thread_time()
        self.guard("starting an iteration", go)
        self._self_cpu_pending = time.thread_time() - c0
        self._self_pending = time.perf_counter() - t0

    def end_iteration(self, ok: bool = True) -> None:
        def go():
            if self._iter_rf is not None:
                rf, self._iter_rf = self._iter_rf, None
                rf.__exit__(None, None, None)
            tracked = self._stop_live_memory()
            if not ok:
                self._phase_seconds = {}
                self.clock.abandon()
                return
            # The iteration after a window waits for every rank to map its events: perturbed too,
            # as is the one whose memory was tracked (every operator went through Python).
            profiled = (self.windowed is not None and self.windowed.active) or self._after_window \
                or tracked
            self._after_window = False
            phases, self._phase_seconds = self._phase_seconds, {}
            seconds = self.clock.stop(profiled, phases if self._phase_clock and not profiled else None)
            if tracked and self.live_result is not None:
                self.live_result["iteration"] = self.clock.count - 1
                self.live_result["iteration_seconds"] = seconds
            if self.settings.inject == "iteration" and self.clock.count == 3:
                raise InjectedFailure("injected failure after iteration 3 (PYTHON_NEOX_PERF_INJECT)")
            if self.windowed is not None:
                self.windowed.iteration_done()
            if time.monotonic() - self._last_summary > SUMMARY_EVERY_S:
                self.write_summary()
            # a window's own iterations, and the step that opens the next one, are its cost
            return not profiled and not (self.windowed is not None and self.windowed.active)
        t0 = time.perf_counter()  # nested as in begin_iteration
        c0 = time.thread_time()
        between_windows = self.guard("ending an iteration", go)
        c1 = time.thread_time()
        t1 = time.perf_counter()
        if between_windows:
            self.self_seconds += self._self_pending + t1 - t0
            self.self_cpu_seconds += self._self_cpu_pending + c1 - c0
            self.self_iterations += 1

    @property
    def in_iteration(self) -> bool:
        return self.clock is not None and self.clock.running

    def enter(self, phase: str):
        if self.live_memory is not None:
            self.live_memory.enter(phase)
        if self.windowed is None or not self.windowed.active:
            # Outside windows a CPU rank's phases are timed by the wall clock: there a phase's
            # wall time is its work (a GPU's would be its launches, so it is not timed).
            return (phase, time.perf_counter()) if self._phase_clock else None

        def go():
            from torch.autograd.profiler import record_function
            rf = record_function("neox_perf::" + phase)
            rf.__enter__()
            return rf
        return self.guard(f"entering {phase}", go)

    def leave(self, rf) -> None:
        if self.live_memory is not None:
            self.live_memory.leave_last()
        if rf.__class__ is tuple:
            phase, t0 = rf
            self._phase_seconds[phase] = self._phase_seconds.get(phase, 0.0) + time.perf_counter() - t0
        elif rf is not None:
            self.guard("leaving a phase", rf.__exit__, None, None, None)

    # ---- live tensor bytes, one iteration ---------------------------------------------------
    def _start_live_memory(self) -> None:
        from neox_perf.calibration.live_memory import LiveMemory
        self.live_memory = LiveMemory(self.engine, vocab_local=self.ctx.dims.vocab)
        self.live_memory.start()
        if not self.live_memory.vocab_local:
            self.note("memory: no vocabulary known (no config, no word_embeddings weight), so "
                      "logits are not told apart from activations")

    def _stop_live_memory(self) -> bool:
        """Ends the tracked iteration's measurement; True if this iteration was tracked."""
        live, self.live_memory = self.live_memory, None
        if live is None:
            return False
        live.stop()
        self.live_result = live.result()
        live.write_trace(self.rank)
        return True

    # ---- profiling windows -------------------------------------------------------------
    def _window(self, events, iterations) -> None:
        self._after_window = True
        if self.ctx.dims.source == "none":
            guessed = infer_dims(events, self.ctx.groups.mp)
            if guessed.hidden is not None:
                self.note(f"no model config: GEMMs named from widths inferred from the trace "
                          f"(hidden {guessed.hidden}, NeoX's 3h/4h rules)")
                from dataclasses import replace
                self.ctx = replace(self.ctx, dims=guessed)
        result = map_events(events, self.ctx)
        if iterations:
            result.iterations = len(iterations)
        index = len(self.window_meta)
        self.total.merge(result)
        self.window_meta.append({
            "index": index, "iterations": list(iterations), "events": result.events,
            "phases": {k: v.seconds / max(result.iterations, 1) for k, v in result.phases.items()}})
        self.writer.write(result.ops, index)
        self.write_summary()

    # ---- artefacts ------------------------------------------------------------------------
    def write_summary(self, finished: bool = False) -> None:
        if self.settings.inject == "summary":
            raise InjectedFailure("injected failure in the summary writer (PYTHON_NEOX_PERF_INJECT)")
        self._last_summary = time.monotonic()
        runfiles.write_json_atomic(runfiles.rank_file(self.settings.run_dir, self.rank),
                                  self.summary(finished))

    def summary(self, finished: bool) -> Dict[str, Any]:
        t = self.total
        config = {k: self.config.get(k)
                  for k in ("source", "files", "vocab", "vocab_padded", "why", "values")}
        unmapped = sorted(t.unmapped.items(), key=lambda kv: -kv[1]["seconds"])
        return {
            "schema": runfiles.SCHEMA, "rank": self.rank, "job": self.settings.job,
            "run_dir": self.settings.run_dir, "pid": os.getpid(), "argv": sys.argv[:20],
            "started": self.started, "updated": time.time(), "finished": finished,
            "disabled": self.error, "cluster": self.settings.cluster,
            "windows_setting": self.settings.windows.text(),
            "facts": self.facts, "config": config, "dims": self.ctx.dims.__dict__,
            "iterations": self.clock.stats() if self.clock else None,
            "hook_self": {"iterations": self.self_iterations, "seconds": self.self_seconds,
                          "cpu_seconds": self.self_cpu_seconds,
                          "per_iteration_seconds": (self.self_seconds / self.self_iterations
                                                    if self.self_iterations else None),
                          "per_iteration_cpu_seconds": (self.self_cpu_seconds / self.self_iterations
                                                        if self.self_iterations else None)},
            "windows": self.window_meta, "window_iterations": t.iterations,
            "phases": {k: {"calls": v.calls, "seconds": v.seconds} for k, v in t.phases.items()},
            "ops": [{"op": op, "phase": ph, "features": dict(feats), "dtype": dt,
                     "calls": a.calls, "seconds": a.seconds, "min": a.min, "median": a.median(),
                     "q1": a.quartiles()[0], "q3": a.quartiles()[1]}
                    for (op, ph, feats, dt), a in sorted(t.ops.items())],
            "op_phases": [{"op": op, "phase": ph, "seconds": s}
                          for (op, ph), s in sorted(t.op_phases.items())],
            "unmapped": [dict(name=k, **v) for k, v in unmapped[:UNMAPPED_KEPT]],
            "unmapped_more": max(len(unmapped) - UNMAPPED_KEPT, 0),
            "glue": [dict(name=k, **v) for k, v in
                     sorted(t.glue.items(), key=lambda kv: -kv[1]["seconds"])[:UNMAPPED_KEPT]],
            "memory": self._memory(),
            "samples_written": self.writer.count if self.writer else 0,
            "prediction": self.prediction,
            "notes": list(dict.fromkeys(self.notes + t.notes)),
        }

    def _memory(self) -> Optional[Dict[str, Any]]:
        if self.memory is None or self.engine is None:
            return None
        try:
            out = self.memory.measure(self.engine)
        except Exception as exc:  # a memory reading never costs the summary
            out = {"error": f"{exc.__class__.__name__}: {exc}"}
        if self.live_result is not None:
            out["live"] = self.live_result
        elif self._live_iteration is not None:
            out["live"] = {"pending_iteration": self._live_iteration}
        return out

    # ---- stepping aside, finishing ---------------------------------------------------------
    def fail(self, where: str, exc: BaseException) -> None:
        self.live = False
        self.error = f"{where}: {exc.__class__.__name__}: {exc}"
        failures.report_failure(where, exc, self.settings.run_dir)
        try:
            from . import engine_patch
            if self.engine is not None:
                engine_patch.unwrap_engine(self.engine)
        except Exception:
            pass
        self._close_profiler()
        try:
            if self.clock is not None:
                self.clock.abandon()
            self.write_summary()
        except Exception:
            pass

    def _close_profiler(self) -> None:
        try:
            self._stop_live_memory()  # its dispatch mode must not outlive the session
        except Exception:
            pass
        w, self.windowed = self.windowed, None
        if self._iter_rf is not None:
            try:
                self._iter_rf.__exit__(None, None, None)
            except Exception:
                pass
            self._iter_rf = None
        if w is not None:
            try:
                w.close()
            except Exception:
                pass

    def finish(self) -> None:
        if self._finished or self.engine is None:
            return
        self._finished = True
        self._close_profiler()
        try:
            self.write_summary(finished=True)
        except Exception as exc:
            if self.live:
                failures.report_failure("writing the final summary", exc, self.settings.run_dir)
        for closer in (lambda: self.writer and self.writer.close(),
                       lambda: self.clock and self.clock.close()):
            try:
                closer()
            except Exception:
                pass
        if self.facts.get("device_type") == "cpu":
            # DeepSpeed's CPU comm op never unlinks its per-rank shared memory: without this,
            # every CPU run would leave ~66 MB per rank in /dev/shm until reboot
            try:
                from neox_perf.calibration.launch import release_rank_buffer
                release_rank_buffer()
            except Exception:
                pass
        if self.rank == 0 and self.settings.report_at_exit and self.error is None:
            self._print_report()

    def _print_report(self) -> None:
        """`neox-perf report` in a child process, onto this rank's stderr: the report is the
        command's own, and a rank never imports the command line or its renderer."""
        try:
            _wait_for_ranks(self.settings.run_dir, int(self.facts.get("world_size") or 1))
            cmd = [sys.executable, "-m", "neox_perf", "report", self.settings.run_dir]
            if self.settings.cluster:
                cmd += ["--cluster", self.settings.cluster]
            sys.stderr.flush()
            # without the switch: the child must not hook itself
            env = {k: v for k, v in os.environ.items() if k not in SWITCH_VARIABLES}
            code = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr,
                                  timeout=REPORT_TIMEOUT_S).returncode
            if code != 0:
                _say(f"report not printed (exit {code}); run `neox-perf report {self.settings.run_dir}`")
        except Exception as exc:
            _say(f"report not printed ({exc.__class__.__name__}: {exc}); "
                 f"run `neox-perf report {self.settings.run_dir}`")


def config_dims(cfg, derived) -> Dims:
    """Operator widths per tensor-parallel rank, as the config builds them (names GEMMs)."""
    from neox_perf.prediction.operators import mlp_widths
    m, mp = cfg.model, max(cfg.parallel.model_parallel_size, 1)
    hd = m.head_dim
    ffn_out, ffn_in = mlp_widths(cfg)
    return Dims(hidden=m.hidden_size, qkv=(m.hidden_size + 2 * m.num_kv_heads * hd) // mp,
                ffn_out=ffn_out // mp, ffn_in=ffn_in // mp, vocab=derived.padded_vocab // mp,
                hidden_local=m.hidden_size // mp, source="config")


def _say(line: str) -> None:
    try:
        sys.stderr.write(f"neox-perf: {line}\n")
        sys.stderr.flush()
    except Exception:
        pass


def _wait_for_ranks(run_dir: str, world: int) -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    while time.monotonic() < deadline:
        done = [s for s in runfiles.read_rank_summaries(run_dir) if s.get("finished")]
        if len(done) >= world:
            return
        time.sleep(0.2)
