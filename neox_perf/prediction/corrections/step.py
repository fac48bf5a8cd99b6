"""The step terms: what a real training step costs beyond the sum of its isolated operator timings.

The published samples time each operator alone: the GPU span from its first kernel to its
last, warmed up, nothing before or after it. A real step runs hundreds of operators back to
back, and measured end-to-end iterations (predictors/fitting/devset.py) are systematically slower than
that sum -- most where each kernel does little work (small hidden sizes, small micro-batches,
wide tensor parallelism). The terms below are that difference, each with a physical meaning,
fitted on measured end-to-end runs (predictors/fitting/step_fit.py) and cross-validated on layouts
they were not fitted on. A profile without them predicts the plain operator sum.

Each term corrects one thing and applies only there (StepTerms.operator, issued, collective,
per_micro_batch, step_s); the order they apply in is the package's (corrections/__init__.py).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Mapping

from ..collective_sources import LINK_MODEL

# Operators whose time is set by arithmetic throughput; the rest are memory-bound.
COMPUTE_BOUND = frozenset({"linear1", "linear2", "linear3", "linear4", "linear_final", "qk", "av",
                           "flash_attention"})
FITTED = ("compute_scale", "memory_scale", "dispatch_s", "p2p_s", "micro_batch_s",
          "pipeline_micro_batch_s", "step_s", "queue_coupling", "dp_fabric_per_doubling")
# terms no longer priced, as stored sections may still name them: at 0 they read as absent; a
# section that gives one a value was fitted with it, and its other terms carry what it did not
RETIRED = {"tp_sync_s": "a fixed wait per tensor-parallel all-reduce, retired 2026-12-04: fitted "
                        "on Jean Zay it put vTrain's small tensor-parallel runs up to 67% over "
                        "once the host's cost per call had its measured value (docs/cross-cluster.md)"}
# the collectives of data parallelism: the whole job's gradient all-reduce after backward and
# ZeRO's parameter all-gather after the step
DATA_PARALLEL = frozenset({"dp_allreduce", "dp_allgather"})
# the most nodes a data-parallel group of the multi-node development set spans (vTrain's 3.6B
# model at dp 64 and its 175B model at tp 8, dp 8): past it dp_fabric_per_doubling extrapolates
FABRIC_NODES_FITTED = 8


def fabric_nodes(nodes: int) -> int:
    """The node count dp_fabric_per_doubling is priced at: the group's own, up to the widest
    the term was fitted on -- a log that kept growing past it ranked 16-32-node data-parallel
    groups (among the fastest layouts measured at 256-512 GPUs) slow."""
    return max(1, min(int(nodes), FABRIC_NODES_FITTED))


@dataclass(frozen=True)
class StepTerms:
    compute_scale: float = 1.0  # in-situ time of compute-bound operators / their isolated time
    memory_scale: float = 1.0  # the same for memory-bound operators (norms, softmax, loss, Adam)
    # host time to issue one framework call. The host runs ahead of the GPU, so a layer's
    # forward, backward or recompute takes the longer of its GPU time and its issue time (issued())
    dispatch_s: float = 0.0
    p2p_s: float = 0.0  # per pipeline send: the blocking handshake beyond the transfer itself
    micro_batch_s: float = 0.0  # per micro-batch per stage: data, loss scaling, engine calls
    # per micro-batch per stage under DeepSpeed's PipelineEngine: its instruction interpreter
    # (load, forward, backward, send/receive bookkeeping), on top of micro_batch_s
    pipeline_micro_batch_s: float = 0.0
    step_s: float = 0.0  # per optimizer step: overflow check, clipping, zero_grad, scheduler
    # how far a phase's host issue and device work fail to overlap where neither dominates:
    # 0 is a perfect queue (the longer of the two), 1 none (their sum); see issued()
    queue_coupling: float = 0.0
    # a data-parallel collective across N nodes takes its isolated time x (1 + this x log2 N). It
    # runs once per step with every rank of the job in it, after a long phase each rank ran on
    # its own, through the whole fabric at once, and each of its N inter-node hops can stall the
    # lock-step ring: multi-node runs show it well below what an isolated all-reduce of the same
    # group reaches, the more so the more nodes it spans (fitted on groups of 2-8 nodes; the
    # cross-validation by model agrees on it within 0.66-0.86 where a flat factor spread 2-3.5x).
    # Tensor-parallel all-reduces across nodes, issued every layer, show no such loss: a fit
    # that scales them too puts it at 0.
    dp_fabric_per_doubling: float = 0.0

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"step term {f.name} must be a finite number >= 0, got {v!r}")
        if self.compute_scale <= 0 or self.memory_scale <= 0:
            raise ValueError("step term scales must be > 0")

    @property
    def identity(self) -> bool:
        return self == StepTerms()

    def operator(self, op: str, seconds: float) -> float:
        """In-situ device seconds of one operator call measured `seconds` in isolation."""
        scale = self.compute_scale if op in COMPUTE_BOUND else self.memory_scale
        return scale * seconds

    def issued(self, device_seconds: float, launches: float) -> float:
        """Seconds a run of operator calls takes that keeps the device busy `device_seconds`
        and issues `launches` framework calls. The host queues kernels ahead of the device,
        so a long GEMM hides the issue time of the short calls around it, and a run of small
        kernels leaves the device waiting for the host: the longer of the two, where one
        dominates. Where they are close, the queue drains and refills -- a short kernel
        behind a long issue, a long GEMM after a burst of short calls -- and each side waits
        on the other part of the time: the phase takes the p-norm of the two, p =
        1/queue_coupling (at coupling 0.2, 15% over either when they are equal; under 1%
        once one is twice the other). estimate applies it per layer phase (forward, backward,
        recompute), head and loss, and adds the phase's collectives outside it: an all-reduce
        waits for every rank to issue it, so the dev set's runs show it exposed (hidden under
        the host's lead, the fit was worse)."""
        host = launches * self.dispatch_s
        top = max(device_seconds, host)
        q = self.queue_coupling
        if q <= 0 or top <= 0:
            return top
        return top * ((device_seconds / top) ** (1.0 / q) + (host / top) ** (1.0 / q)) ** q

    def per_micro_batch(self, pipeline_engine: bool) -> float:
        return self.micro_batch_s + (self.pipeline_micro_batch_s if pipeline_engine else 0.0)

    def collective(self, purpose: str, seconds: float, nodes: int = 1, source: str = "") -> float:
        """In-situ seconds of a collective over `nodes` nodes that the samples
        (or the link model) time at `seconds` in isolation. `source`: where that time comes from
        (neox_perf.prediction.collective_sources; "" where the profile does not say, priced as it is).

        dp_fabric_per_doubling is what a link model at a reference efficiency lacks against a
        real fabric under a whole job's load (fitted where the development sets' collectives are
        link-model prices): a collective sampled on the cluster's own fabric already shows that
        loss, and is left as measured. Past the widest group it was fitted on it stops growing
        (fabric_nodes); there the interval widens instead (estimate flags it extrapolated)."""
        if seconds <= 0:
            return seconds
        if purpose in DATA_PARALLEL and nodes > 1:
            if source != LINK_MODEL:
                return seconds
            return seconds * (1.0 + self.dp_fabric_per_doubling * math.log2(fabric_nodes(nodes)))
        if purpose == "pp_p2p":
            return seconds + self.p2p_s
        return seconds

    def to_dict(self) -> Dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StepTerms":
        unknown = set(data) - set(FITTED) - set(RETIRED)
        if unknown:
            raise ValueError(f"unknown step terms {', '.join(sorted(unknown))}")
        for name, why in RETIRED.items():
            if name in data and float(data[name]) != 0.0:
                raise ValueError(f"step term {name} is no longer priced ({why})")
        return cls(**{k: float(v) for k, v in data.items() if k in FITTED})
