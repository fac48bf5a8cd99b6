"""The fastest any collective can be: its bytes over the line rate of the links it crosses.

No sample, link model or correction may price a collective below it (issue 30: no impossible
number). The bound is deliberately loose, so that it only ever catches a price that cannot be
true (a bogus sample, a model extrapolated below its data): inside a node every GPU drives its
full per-GPU link rate (an NVSwitch; point-to-point NVLink can only be slower); between nodes a
node is one super-rank behind all its NICs, and what a bandwidth-optimal algorithm must move
across that node's boundary is the ring's wire bytes over the nodes (all-reduce 2(N-1)/N of the
tensor, all-gather N-1 of the node's chunks) -- the lower bound of Patarasuk & Yuan (JPDC 2009)
for all-reduce, which NCCL's ring and tree reach at best.
"""
from __future__ import annotations

from dataclasses import replace

from neox_perf.prediction import opspec


def floor_seconds(facts, kind: str, elements: float, nodes: int, gpus_per_node: int) -> float:
    """Seconds one collective of nodes x gpus_per_node ranks cannot beat on `facts`' links
    (neox_perf.profile.facts.ClusterFacts); 0 where the facts name no bandwidth."""
    if nodes > 1:
        rate = facts.inter_node_link.bandwidth_gbps * 1e9  # GB/s per node, all NICs together
        per_node = elements * gpus_per_node if kind == "allgather" else elements
        wire = opspec.collective_wire_bytes(kind, per_node, 2 if kind == "p2p" else nodes)
    else:
        rate = facts.intra_node_link.bandwidth_gbps * 1e9  # GB/s per GPU, one direction
        wire = opspec.collective_wire_bytes(kind, elements, 2 if kind == "p2p" else gpus_per_node)
    return float(wire) / rate if rate > 0 else 0.0


def at_least(facts, pred, kind: str, elements: float, nodes: int, gpus_per_node: int):
    """`pred` (a neox_perf.profile.values.Prediction), or the line rate's time where it is faster
    than the links allow: flagged, so the interval widens for it."""
    floor = floor_seconds(facts, kind, elements, nodes, gpus_per_node)
    if pred.seconds >= floor:
        return pred
    where = "between nodes" if nodes > 1 else "inside the node"
    why = f"{kind} {nodes}x{gpus_per_node}: priced below the line rate of the links {where}; raised to it"
    return replace(pred, seconds=floor, extrapolated=True,
                   reason=f"{pred.reason}; {why}" if pred.reason else why)
