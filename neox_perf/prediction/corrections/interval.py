"""The 80% interval a profile's measured residuals put around every prediction, per regime
(inside a node, across nodes, one NIC per GPU): Interval, Intervals."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, Mapping, Tuple


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
