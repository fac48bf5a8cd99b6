"""GPT-NeoX's own training-log units, computed as NeoX computes them, and its log read back.

NeoX prints, every log_interval iterations (megatron/logging.py:431-496 at ea7aefd8):
    samples/sec: {train_batch_size / iteration_time:.3f} | iteration {i:8d}/{train_iters:8d} |
    elapsed time per iteration (ms): {elapsed * 1000 / log_interval:.1f} | ... |
    approx flops per GPU: {human_readable_flops(get_actual_flops(...))} | ...
`get_actual_flops` (logging.py:80-160) is the Megatron formula with a checkpointing factor of 4
(else 3) and its own variants for RWKV and Mamba blocks; it divides by the world size. These are
reproduced here line for line, so a prediction can be held against a training log in the units
the log uses, and a log (no hook) can be compared with the prediction.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import List, Optional

from .config.specs import NeoxConfig


def approx_flops_per_iteration(cfg: NeoxConfig, padded_vocab: int) -> float:
    """NeoX's get_actual_flops numerator (megatron/logging.py:91-158): FLOPs per iteration."""
    m, t = cfg.model, cfg.training
    batch, seq, h, layers, vocab = (t.train_batch_size, m.seq_length, m.hidden_size, m.num_layers,
                                    padded_vocab)
    ckpt = 4 if t.checkpoint_activations else 3
    kinds = set(m.attention_types)  # NeoX tests membership in the expanded attention_config
    if "rwkv" in kinds:
        heads = m.num_attention_heads
        return batch * seq * (78 * h * h * layers + 84 * h * layers + 16 * h + 12 * h * vocab
                              + 18 * h * h * layers / heads)
    if "mamba" in kinds:
        if m.expansion_factor:
            d_inner = h * m.expansion_factor
        elif m.intermediate_size:
            d_inner = m.intermediate_size
        else:
            d_inner = h * 2
        d_state, conv = 16, 4
        dt_rank = math.ceil(h / 16)
        ssm = ckpt * d_inner * seq * batch * (11 * d_state + 4 * dt_rank + 1)
        projectors = ckpt * seq * batch * 6 * d_inner * h
        conv_flops = ckpt * seq * batch * 2 * d_inner * conv
        return (ssm + projectors + conv_flops) * layers + 6 * seq * batch * h * vocab
    return (24 * ckpt * batch * seq * layers * (h ** 2)
            * (1.0 + (seq / (6.0 * h)) + (vocab / (16.0 * layers * h))))


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
