"""`neox-perf clusters`: the bundled cluster profiles and where their numbers come from;
with --gpus, the GPU table a cluster description file can name."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from .. import exitcodes


@dataclass
class ClustersResult:
    profiles: List[dict] = field(default_factory=list)
    gpus: Optional[List[dict]] = None  # only with --gpus
    command: str = "clusters"
    render_hint: str = "clusters_text"
    exit_code: int = exitcodes.OK

    def to_dict(self) -> dict:
        if self.gpus is not None:
            return {"gpus": self.gpus}
        return {"profiles": self.profiles}


def run_clusters(args) -> ClustersResult:
    if getattr(args, "gpus", False):
        from ..predictors.gpus import GPUS
        return ClustersResult(gpus=[g.to_dict() for g in GPUS])
    from ..prediction.network import reading as network_reading
    from ..predictors.profile import list_profiles, load_profile
    rows = []
    for info in list_profiles():
        prof = load_profile(info.path)
        facts = prof.facts
        transfer = (prof.manifest.transfer or {}) if info.description else {}
        rows.append({
            "name": info.name, "path": str(info.path), "gpu": facts.gpu_name,
            "gpu_memory_bytes": facts.gpu_memory_bytes, "gpus_per_node": facts.gpus_per_node,
            "intra_node_link": facts.intra_node_link, "inter_node_link": facts.inter_node_link,
            "provenance": info.provenance,
            "kind": "description" if info.description else "sampled",
            "base": transfer.get("base_profile"),
            "samples_gpu": transfer.get("samples_gpu"),
            "measured": prof.manifest.provenance.measured if prof.manifest.provenance else None,
            "network": (lambda r: r.to_dict() if r is not None else None)(network_reading(prof)),
        })
    return ClustersResult(rows)
