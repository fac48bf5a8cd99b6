"""What a profile's network is: the link it names, the bus bandwidth its collectives give a
large all-reduce across two nodes, and when (and how) that was measured.

A profile is only as current as the network its samples ran on. The bundled Perlmutter profile's
cross-node all-reduce is what the paper measured (a few GB/s of bus bandwidth), far below a
DGX-class node of today; a user planning for other nodes needs to see that before trusting a
layout the slow network favoured (deep pipelines, no data parallelism), and to know that a
cluster description of their own nodes is the way to predict those (neox_perf/examples/clusters/).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

from ..errors import ProfileError

# An all-reduce of 1 GiB of fp16 gradients (a 0.5B-parameter stage's) across two nodes: large
# enough that latency is noise, small enough to sit in every profile's sampled range.
PROBE_ELEMENTS = 2 ** 29
# where a user whose nodes are not the sampled ones goes next: a bundled description by name
# (resolved from any directory), or one of their own written like it
DESCRIBE_YOUR_NODES = "--cluster dgx-a100, or your own YAML like it: `neox-perf clusters` lists them"


@dataclass(frozen=True)
class NetworkReading:
    link: str  # the inter-node link the profile names
    allreduce_bus_GBps: float  # bus bandwidth of a 1 GiB all-reduce over 2 nodes, per GPU
    # "sampled" (NCCL samples of this network: the profile's own, or a description's base on the
    # same network) or "link model" (a description's links at a reference efficiency)
    how: str
    measured: Optional[str]  # when those samples were measured, where the profile says

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        when = f", measured {self.measured}" if self.measured else ""
        how = "as sampled" if self.how == "sampled" else "the description's link model"
        return (f"{self.link}: all-reduce across nodes {self.allreduce_bus_GBps:.1f} GB/s bus bandwidth "
                f"per GPU ({how}{when})")


def reading(profile) -> Optional[NetworkReading]:
    """The profile's inter-node network, or None where it has one node only."""
    facts = profile.facts
    gpn = facts.gpus_per_node
    try:
        seconds = profile.predict_collective("allreduce", PROBE_ELEMENTS, 2, gpn).seconds
    except (ProfileError, ValueError, KeyError):
        # a profile calibrated without collectives (one GPU, `calibrate --for` a 1-GPU config)
        # has no network to show; a job that needs one is told so by its own prediction
        return None
    if seconds <= 0:
        return None
    ranks = 2 * gpn
    # nccl-tests' bus bandwidth: algorithm bandwidth x 2 (n - 1) / n for an all-reduce
    bus = PROBE_ELEMENTS * 2 / seconds * 2 * (ranks - 1) / ranks / 1e9
    link = facts.inter_node_link.name or "inter-node link"
    source = profile
    if profile.base is not None:
        # a description: its links are the described ones, at the efficiency its base measured
        # where the base sampled the same network, else a reference one (predictors/transfer.py)
        transfer = profile.manifest.transfer or {}
        why = (((transfer.get("collectives") or {}).get("efficiency_source")) or {}).get("allreduce_inter", "")
        if not str(why).startswith("fitted on"):
            return NetworkReading(link, bus, "link model", None)
        source = profile.base
    prov = source.manifest.provenance
    return NetworkReading(link, bus, "sampled", prov.measured if prov is not None else None)
