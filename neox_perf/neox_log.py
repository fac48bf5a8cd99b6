"""GPT-NeoX's own training-log units, computed as NeoX computes them, and its log read back.

NeoX prints, every log_interval iterations (megatron/logging.py:431-496 at ea7aefd8):
    samples/sec: {train_batch_size / iteration_time:.3f} | iteration {i:8d}/{train_iters:8d} |
    elapsed time per iteration (ms): {elapsed * 1000 / log_interval:.1f} | ... |
    approx flops per GPU: {human_readable_flops(get_actual_flops(...))} | ...
`get_actual_flops` (logging.py:80-160) is the Megatron formula with a checkpointing factor of 4
(else 3) and its own variants for RWKV and Mamba blocks (derive.flops.neox_flops_per_iteration
reproduces it); it divides by the world size. So a prediction can be held against a training log
in the units the log uses, and a log (no hook) can be compared with the prediction.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional

from .config.specs import NeoxConfig


def approx_flops_per_iteration(cfg: NeoxConfig, padded_vocab: int) -> float:
    """get_actual_flops' numerator: FLOPs per iteration, checkpointing counted as NeoX counts it
    (factor 4, else 3; derive.flops holds the formula, its RWKV and Mamba branches included)."""
    from .derive.flops import neox_flops_per_iteration
    return neox_flops_per_iteration(cfg.model, cfg.training, padded_vocab,
                                    4 if cfg.training.checkpoint_activations else 3)


def human_readable_flops(num: float) -> str:
    """megatron/logging.py:66-77, as NeoX prints it."""
    for unit in ("", "KFLOPS", "MFLOPS", "GFLOPS", "TFLOPS", "PFLOPS", "EFLOPS", "ZFLOPS"):
        if abs(num) < 1000.0:
            return "%3.1f%s" % (num, unit)
        num /= 1000.0
    return "%.1f%s" % (num, "Yi")


@dataclass(frozen=True)
class NeoxLogUnits:
    """What NeoX's log line would show for an iteration of `iteration_seconds`."""
    elapsed_time_per_iteration_ms: float
    samples_per_sec: float
    approx_flops_per_gpu: float  # FLOP/s per GPU, NeoX's formula

    @property
    def approx_flops_per_gpu_text(self) -> str:
        return human_readable_flops(self.approx_flops_per_gpu)

    def line(self) -> str:
        """The three fields as NeoX formats them (logging.py:436, 472, 495)."""
        return (f"samples/sec: {self.samples_per_sec:.3f} | elapsed time per iteration (ms): "
                f"{self.elapsed_time_per_iteration_ms:.1f} | approx flops per GPU: "
                f"{self.approx_flops_per_gpu_text}")


def units(cfg: NeoxConfig, padded_vocab: int, iteration_seconds: float) -> NeoxLogUnits:
    world = cfg.parallel.world_size
    return NeoxLogUnits(
        elapsed_time_per_iteration_ms=iteration_seconds * 1000.0,
        samples_per_sec=cfg.training.train_batch_size / iteration_seconds,
        approx_flops_per_gpu=approx_flops_per_iteration(cfg, padded_vocab) / (iteration_seconds * world))


# -- a NeoX training log, read back ------------------------------------------------------------

_ITERATION = re.compile(
    r"samples/sec:\s*([\d.]+)\s*\|\s*iteration\s+(\d+)/\s*(\d+)\s*\|\s*"
    r"elapsed time per iteration \(ms\):\s*([\d.]+)")
_FLOPS = re.compile(r"approx flops per GPU:\s*([\d.]+)\s*([KMGTPEZ]?FLOPS|Yi)?")
_SCALE = {"": 1.0, "KFLOPS": 1e3, "MFLOPS": 1e6, "GFLOPS": 1e9, "TFLOPS": 1e12, "PFLOPS": 1e15,
          "EFLOPS": 1e18, "ZFLOPS": 1e21}
# NeoXArgs.print() lists every argument as "  name ...... value" (arguments.py:print)
_ARG = re.compile(r"^\s*(global_num_gpus|train_batch_size|seq_length|log_interval)\s*\.{2,}\s*(\S+)",
                  re.M)


@dataclass(frozen=True)
class LoggedInterval:
    """One of NeoX's log lines: the mean of `log_interval` iterations ending at `iteration`."""
    iteration: int
    train_iters: int
    samples_per_sec: float
    elapsed_ms: float  # elapsed time per iteration (ms), averaged over the interval
    approx_flops_per_gpu: Optional[float]


@dataclass
class NeoxLog:
    intervals: List[LoggedInterval]
    args: dict  # the arguments NeoX printed at start that the comparison can use, as text

    @property
    def world_size(self) -> Optional[int]:
        value = self.args.get("global_num_gpus")
        return int(value) if value and value.isdigit() else None


def read_log(text: str) -> NeoxLog:
    intervals = []
    for line in text.splitlines():
        m = _ITERATION.search(line)
        if not m:
            continue
        f = _FLOPS.search(line)
        flops = float(f.group(1)) * _SCALE.get(f.group(2) or "", 1.0) if f else None
        intervals.append(LoggedInterval(iteration=int(m.group(2)), train_iters=int(m.group(3)),
                                        samples_per_sec=float(m.group(1)),
                                        elapsed_ms=float(m.group(4)), approx_flops_per_gpu=flops))
    # "  name .... value.......updated": the value runs into the padding dots and the tag
    args = {k: re.sub(r"\.*(default|updated)$", "", v) for k, v in _ARG.findall(text)}
    return NeoxLog(intervals=intervals, args=args)
