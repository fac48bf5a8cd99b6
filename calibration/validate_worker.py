"""The rank-side half of `neox-perf validate`: the unmodified reference workload, with
DeepSpeed's own phases timed on every rank.

Launched by neox_perf.commands.validate under torchrun:
    python -m neox_perf.calibration.validate_worker --phases-dir DIR -- <workload arguments>
Each rank writes DIR/rank.R.json (per iteration: seconds per phase and in total); rank 0
prints one progress line (launch.progress_line) per iteration for the progress bar.
"""
from __future__ import annotations

import json
import os
from typing import List, Optional

from .launch import progress_line
from .phase_clock import PhaseClock


_PIPE_PHASES = {"ForwardPass": "forward", "BackwardPass": "backward", "SendActivation": "p2p",
                "RecvActivation": "p2p", "SendGrad": "p2p", "RecvGrad": "p2p",
                "ReduceTiedGrads": "grad_sync", "ReduceGrads": "grad_sync",
                "OptimizerStep": "optimizer", "LoadMicroBatch": "other"}


class _Memory:
    """The live-bytes measurement of one iteration (calibration/live_memory.py), as the hook takes it;
    the phases are the clock's. Never raises into the workload."""

    # the second iteration: past the first optimizer step (its state exists), and one of the
    # warm-up iterations validate drops anyway, so the tracker's slowness times nothing
    AT = 1

    def __init__(self, clock: PhaseClock, out_path: str):
        self.clock, self.path, self.at = clock, out_path, self.AT
        self.live = None

    def starting(self, engine, index: int) -> bool:
        if index != self.at:
            return False
        try:
            from neox_perf.calibration.live_memory import LiveMemory
            self.live = LiveMemory(engine)
            self.clock.listener = self.live
            self.live.start()
            self.engine = engine
        except Exception as exc:  # the timing still stands
            self.live = None
            self._write({"error": f"{exc.__class__.__name__}: {exc}"})
            return False
        return True

    def stopped(self, seconds: float) -> None:
        live, self.live = self.live, None
        self.clock.listener = None
        try:
            live.stop()
            result = live.result()
            result.update(iteration=self.at, iteration_seconds=seconds,
                          stage=int(getattr(self.engine, "stage_id", 0) or 0),
                          rank=int(os.environ.get("RANK", "0")))
        except Exception as exc:
            result = {"error": f"{exc.__class__.__name__}: {exc}"}
        self._write(result)

    def _write(self, result: dict) -> None:
        try:
            with open(self.path, "w") as fh:
                json.dump(result, fh)
        except OSError:
            pass


def _instrument(clock: PhaseClock, iterations: List[dict], report: bool, memory: "_Memory") -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe import engine as pipe_engine

    from .workload import train

    table = pipe_engine.PipelineEngine._INSTRUCTION_MAP
    for instr, fn in list(table.items()):
        table[instr] = clock.wrap(_PIPE_PHASES.get(instr.__name__, "other"), fn)
    # pp = 0: the engine's own calls; inside a pipeline these nest under the instructions
    DeepSpeedEngine.forward = clock.wrap("forward", DeepSpeedEngine.forward)
    DeepSpeedEngine.backward = clock.wrap("backward", DeepSpeedEngine.backward)
    DeepSpeedEngine.step = clock.wrap("optimizer", DeepSpeedEngine.step)
    DeepSpeedEngine.allreduce_gradients = clock.wrap("grad_sync", DeepSpeedEngine.allreduce_gradients)
    from .workload import tensor_parallel
    tensor_parallel._all_reduce = clock.wrap("tp_allreduce", tensor_parallel._all_reduce)

    def iteration(fn):
        def run(*args):
            if len(args) == 5:  # _iteration_sequential(engine, data, it, gas, loss_fn)
                args = args[:4] + (clock.wrap("forward", args[4]),)
            tracked = memory.starting(args[0], len(iterations))
            clock.current = {}
            start = clock.now()
            out = fn(*args)
            seconds = clock.now() - start
            if tracked:
                memory.stopped(seconds)
                clock.current["memory_tracked"] = 1.0
            iterations.append({**clock.current, "iteration": seconds})
            if report:
                print(progress_line(iteration=len(iterations)), flush=True)
            return out
        return run

    train._iteration_pipe = iteration(train._iteration_pipe)
    train._iteration_sequential = iteration(train._iteration_sequential)


def main(argv: Optional[List[str]] = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("--phases-dir", required=True)
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    rank = int(os.environ.get("RANK", "0"))
    clock, iterations = PhaseClock(), []
    memory = _Memory(clock, os.path.join(args.phases_dir, f"memory.{rank}.json"))
    _instrument(clock, iterations, report=rank == 0, memory=memory)
    from .workload import train
    code = train.main(rest)
    with open(os.path.join(args.phases_dir, f"rank.{rank}.json"), "w") as fh:
        json.dump(iterations, fh)
    return code


if __name__ == "__main__":
    from .launch import exit_rank
    exit_rank(main())
