"""The hardware a cluster profile describes: its GPU, how many per node, and its links.

Bandwidths are GB/s (10^9 bytes per second), one direction. Peak FLOP rates are dense
fp16 tensor-core rates from the vendors' data sheets (or, for a profile of this machine, the
fastest rate its samples reached: predictors/fitting/store_samples.measured_facts).
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Dict, Optional


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth_gbps: float  # GB/s one direction: per GPU inside a node, per node between nodes
    lanes: int  # parallel links / NICs that carry that bandwidth together


@dataclass(frozen=True)
class ClusterFacts:
    name: str
    gpu_name: str
    gpu_memory_bytes: int
    gpus_per_node: int
    intra_node_link: Link
    inter_node_link: Link
    peak_fp16_tflops: float
    hbm_bandwidth_gbps: float
    # Where the operator samples behind the predictions were measured, when not on this GPU
    # (a cluster description transferred from a sampled profile); "" for a sampled profile.
    samples_from: str = ""
    # Whether the calibrated machine ran fp32 matmuls as TF32 (torch.backends.cuda.matmul.allow_tf32,
    # TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1: `calibrate` on CUDA records it); None: not known, or no
    # TF32 there (a CPU). Absent from the manifest when None, so older manifests round-trip.
    tf32: Optional[bool] = None

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        if self.tf32 is None:
            del out["tf32"]
        return out

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "ClusterFacts":
        names = {f.name for f in fields(cls)}
        optional = {f.name for f in fields(cls) if f.default is not MISSING}
        missing = names - optional - set(data)
        if missing:
            raise KeyError(f"cluster facts lack {', '.join(sorted(missing))}")
        values = {k: data[k] for k in names if k in data}
        values["intra_node_link"] = Link(**data["intra_node_link"])
        values["inter_node_link"] = Link(**data["inter_node_link"])
        if values.get("tf32") is not None and not isinstance(values["tf32"], bool):
            raise ValueError(f"tf32 must be true, false or absent, got {values['tf32']!r}")
        return cls(**values)
