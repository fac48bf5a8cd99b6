"""What a real training step costs beyond the sum of its isolated operator timings.

The published samples time each operator alone: the GPU span from its first kernel to its
last, warmed up, nothing before or after it. A real step runs hundreds of operators back to
back, and measured end-to-end iterations (predictors/fitting/devset.py) are systematically slower than
that sum -- most where each kernel does little work (small hidden sizes, small micro-batches,
wide tensor parallelism). The terms below are that difference, each with a physical meaning,
fitted on measured end-to-end runs (predictors/fitting/step_fit.py) and cross-validated on layouts
they were not fitted on. A profile without them predicts the plain operator sum.

Also here: the interval a profile's measured residuals put around every prediction, and the
manifest's "step_terms" section that carries both (StepTermsSection, parsed once with the
manifest: neox_perf/profile/manifest.py).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Dict, Mapping, Optional, Tuple

from ..errors import ProfileError, reading, text
from .collective_sources import LINK_MODEL

# Operators whose time is set by arithmetic throughput; the rest are memory-bound.
COMPUTE_BOUND = frozenset({"linear1", "linear2", "linear3", "linear4", "linear_final", "qk", "av",
                           "flash_attention"})
FITTED = ("compute_scale", "memory_scale", "dispatch_s", "tp_sync_s", "p2p_s", "micro_batch_s",
          "pipeline_micro_batch_s", "step_s", "queue_coupling", "dp_fabric_per_doubling")
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
    # a tensor-parallel all-reduce waits for its slowest rank: seconds per doubling of the group.
    # A run of calls' waits add to at most its operators' time (estimate._Cache.mp_factor)
    tp_sync_s: float = 0.0
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

    def collective(self, purpose: str, ranks: int, seconds: float, nodes: int = 1,
                   source: str = "") -> float:
        """In-situ seconds of a collective of `ranks` ranks over `nodes` nodes that the samples
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
        if purpose == "mp_allreduce":
            return seconds + self.tp_sync_s * math.log2(max(ranks, 2))
        if purpose == "pp_p2p":
            return seconds + self.p2p_s
        return seconds

    def to_dict(self) -> Dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StepTerms":
        unknown = set(data) - set(FITTED)
        if unknown:
            raise ValueError(f"unknown step terms {', '.join(sorted(unknown))}")
        return cls(**{k: float(v) for k, v in data.items()})


@dataclass(frozen=True)
class Interval:
    """An 80% interval as ratios to the point prediction, from measured residuals."""

    lo_ratio: float  # 10th percentile of measured / predicted
    hi_ratio: float  # 90th percentile
    widen_per_extrapolated: float = 0.0  # extra relative width per unit share of extrapolated time
    # extra relative height of the high end per unit share of the iteration spent in collectives
    # that cross nodes: where the evidence is an uncertainty and not a measured term (a fabric
    # nobody measured under a real job), the interval is skewed upward, not the point moved
    upward_per_inter_node: float = 0.0

    def around(self, seconds: float, extrapolated_share: float = 0.0,
               inter_node_share: float = 0.0) -> Tuple[float, float]:
        w = self.widen_per_extrapolated * max(0.0, min(1.0, extrapolated_share))
        up = self.upward_per_inter_node * max(0.0, min(1.0, inter_node_share))
        return seconds * self.lo_ratio / (1.0 + w), seconds * self.hi_ratio * (1.0 + w) * (1.0 + up)

    def widened(self, relative: float) -> "Interval":
        """Both ends moved out by ``relative`` (terms fitted on another GPU)."""
        return replace(self, lo_ratio=self.lo_ratio / (1 + relative), hi_ratio=self.hi_ratio * (1 + relative))

    def to_dict(self) -> Dict[str, float]:
        # the upward skew is a regime's (Intervals.of), never fitted: stored only where set
        out = asdict(self)
        if not self.upward_per_inter_node:
            del out["upward_per_inter_node"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Interval":
        lo, hi = float(data["lo_ratio"]), float(data["hi_ratio"])
        if not (0 < lo <= 1.0 <= hi and math.isfinite(hi)):
            raise ValueError(f"interval ratios must satisfy 0 < lo <= 1 <= hi, got {lo}, {hi}")
        up = float(data.get("upward_per_inter_node", 0.0))
        if not (math.isfinite(up) and up >= 0):
            raise ValueError(f"upward_per_inter_node must be a finite number >= 0, got {up}")
        return cls(lo, hi, float(data.get("widen_per_extrapolated", 0.0)), up)


# Where a job runs, for its interval: the residuals differ by regime (cross-validated in
# benchmarks/endtoend.py), so each regime carries its own. Transferred to another GPU, every
# regime's interval widens (of_profile).
INSIDE_NODE, ACROSS_NODES, ONE_NIC_PER_GPU = "inside a node", "across nodes", "one NIC per GPU"
REGIMES = (INSIDE_NODE, ACROSS_NODES, ONE_NIC_PER_GPU)
# One GPU (and one NIC) per node: every tensor-parallel, pipeline and data-parallel collective
# crosses the fabric. No measured runs of such a cluster are in the development sets, and the
# public evidence is an uncertainty, not a term: the published samples already run at 92-96% of
# the NIC's line rate, so a real run can only be slower; NCCL keeps GPUDirect RDMA off by default
# on GH200, where the NIC sits behind the Grace CPU (NVIDIA/nccl issue 1579); fabric noise at
# scale costs all-reduces up to half their bandwidth (arXiv 2408.14090), i.e. up to twice their
# time. So such a job's interval is the across-nodes one with its high end raised by the
# iteration's inter-node share, once more (x2 on that share).
ONE_NIC_UPWARD = 1.0


def regime_of(crosses_nodes: bool, gpus_per_node: int) -> str:
    if not crosses_nodes:
        return INSIDE_NODE
    return ONE_NIC_PER_GPU if gpus_per_node == 1 else ACROSS_NODES


@dataclass(frozen=True)
class Intervals:
    """A profile's 80% interval per regime."""

    inside_node: Interval
    across_nodes: Interval
    # the one-NIC-per-GPU skew (ONE_NIC_UPWARD) where the residuals are not of such a cluster
    one_nic_upward: float = ONE_NIC_UPWARD

    def of(self, regime: str) -> Interval:
        if regime == INSIDE_NODE:
            return self.inside_node
        if regime == ACROSS_NODES:
            return self.across_nodes
        if regime == ONE_NIC_PER_GPU:
            return replace(self.across_nodes, upward_per_inter_node=self.one_nic_upward)
        raise ValueError(f"unknown regime {regime!r}; known: {', '.join(REGIMES)}")

    def widened(self, relative: float) -> "Intervals":
        return replace(self, inside_node=self.inside_node.widened(relative),
                       across_nodes=self.across_nodes.widened(relative))

    @classmethod
    def single(cls, interval: Interval) -> "Intervals":
        """One interval for every regime: a profile validated on its own machine, whose residuals
        are that machine's, network included -- nothing to skew."""
        return cls(interval, interval, one_nic_upward=0.0)



REFIT = "refit them (benchmarks/endtoend.py --write-terms, or `neox-perf calibrate --from-run`)"
# the section's keys in the order its writers write them (benchmarks/endtoend.py)
SECTION_ORDER = ("terms", "interval", "intervals", "fitted_on", "fitted_gpu", "other_gpu_widen",
                 "assumptions", "cross_validation", "interval_coverage", "command")
# regimes whose interval the section stores beside `interval` (inside a node), by key
STORED_REGIMES = {"across_nodes": ACROSS_NODES}


@dataclass(frozen=True)
class StepTermsSection:
    """The manifest's "step_terms" section: the terms, the interval the development set's
    cross-validated residuals put around a prediction, and where both were fitted."""

    terms: Optional[StepTerms] = None  # None: the plain sum of operator predictions
    interval: Optional[Interval] = None  # inside a node (older sections: every regime)
    intervals: Optional[Mapping[str, Interval]] = None  # other regimes', by STORED_REGIMES key
    fitted_on: Optional[str] = None  # what the terms were fitted on, for the reports
    fitted_gpu: Optional[str] = None  # the GPU of those runs (the interval widens on another)
    other_gpu_widen: Optional[float] = None  # relative widening of the interval on another GPU
    cross_validation: Optional[Mapping[str, Any]] = None  # the fit's cross-validated errors
    extra: Mapping[str, Any] = field(default_factory=dict)  # assumptions, command, ... as written
    # the terms as the file wrote them: written back while they still say the same (a section
    # written before a term existed lacks it, and reads it at its default)
    terms_as_read: Optional[Mapping[str, Any]] = field(default=None, compare=False, repr=False)

    @classmethod
    def parse(cls, data: Mapping[str, Any], where: str = "step_terms") -> "StepTermsSection":
        if not isinstance(data, Mapping):
            raise ProfileError(where, "not a mapping", REFIT)
        out: Dict[str, Any] = {}
        with reading(f"{where}.terms", REFIT):
            out["terms"] = None if data.get("terms") is None else StepTerms.from_dict(data["terms"])
        with reading(f"{where}.interval", REFIT):
            out["interval"] = None if data.get("interval") is None else Interval.from_dict(data["interval"])
        regimes = data.get("intervals")
        if regimes is not None:
            if not isinstance(regimes, Mapping) or set(regimes) - set(STORED_REGIMES):
                raise ProfileError(f"{where}.intervals", "not a mapping of "
                                   + ", ".join(STORED_REGIMES) + " to intervals", REFIT)
            parsed = {}
            for key, value in regimes.items():
                with reading(f"{where}.intervals.{key}", REFIT):
                    parsed[key] = Interval.from_dict(value)
            out["intervals"] = parsed
        for key, kind in (("fitted_on", text), ("fitted_gpu", text), ("other_gpu_widen", float)):
            with reading(f"{where}.{key}", REFIT):
                out[key] = None if data.get(key) is None else kind(data[key])
        cv = data.get("cross_validation")
        if cv is not None and not isinstance(cv, Mapping):
            raise ProfileError(f"{where}.cross_validation", "not a mapping", REFIT)
        return cls(**out, cross_validation=cv,
                   extra={k: v for k, v in data.items() if k not in _TYPED},
                   terms_as_read=data.get("terms"))

    def to_dict(self) -> Dict[str, Any]:
        values: Dict[str, Any] = dict(self.extra)
        for key in _TYPED:
            v = getattr(self, key)
            if key == "intervals" and v is not None:
                values[key] = {k: iv.to_dict() for k, iv in v.items()}
            elif key == "terms" and v is not None and self.terms_as_read is not None \
                    and StepTerms.from_dict(self.terms_as_read) == v:
                values[key] = self.terms_as_read
            elif v is not None:
                values[key] = v.to_dict() if hasattr(v, "to_dict") else v
        return {**{k: values[k] for k in SECTION_ORDER if k in values},
                **{k: v for k, v in values.items() if k not in SECTION_ORDER}}


    def regime_intervals(self) -> Optional[Intervals]:
        """The interval of every regime: inside a node from `interval`, across nodes from
        `intervals.across_nodes` (the inside one where a section has none)."""
        if self.interval is None:
            return None
        across = (self.intervals or {}).get("across_nodes")
        return Intervals(self.interval, across or self.interval)


_TYPED = tuple(f.name for f in fields(StepTermsSection) if f.name not in ("extra", "terms_as_read"))


# A calibrated profile's own validation runs (neox_perf/profile_validation.py, the manifest's
# sections.Validation): once there are enough, their residuals give its interval.
VALIDATION_MIN_RUNS = 5  # an 80% interval needs a tail on each side: fewer cannot place one


def of_profile(profile) -> Tuple[StepTerms, Optional[Intervals]]:
    """The step terms and intervals a profile's manifest carries (identity and None without);
    a calibrated profile's interval from its own validation runs comes first. ``profile``: a
    neox_perf.profile.protocol.Profile.

    Terms measured on one GPU and applied to another (a description transferred to another
    GPU, or a profile whose end-to-end runs came from elsewhere) keep their values, but the
    intervals widen by the section's `other_gpu_widen`: the operator error measured when one
    GPU's samples predict another's (benchmarks/transfer_gpu.py)."""
    manifest = profile.manifest
    section = manifest.step_terms or StepTermsSection()
    terms = section.terms or StepTerms()
    own = manifest.validation
    if own is not None and own.interval is not None and len(own.runs) >= VALIDATION_MIN_RUNS:
        # measured on this profile's own machine: nothing to widen for another GPU
        return terms, Intervals.single(own.interval)
    intervals = section.regime_intervals()
    if intervals is not None and section.fitted_gpu:
        gpu = profile.facts.gpu_name
        if gpu and not _same_gpu(section.fitted_gpu, gpu):
            intervals = intervals.widened(section.other_gpu_widen or 0.0)
    return terms, intervals


def _same_gpu(a: str, b: str) -> bool:
    norm = lambda s: "".join(ch for ch in s.lower() if ch.isalnum()).replace("nvidia", "")
    return norm(a) == norm(b)
