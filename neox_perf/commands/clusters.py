"""`neox-perf clusters`: the bundled cluster profiles and where their numbers come from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from .. import exitcodes


@dataclass
class ClustersResult:
    profiles: List[dict] = field(default_factory=list)
    command: str = "clusters"
    render_hint: str = "clusters_text"
    exit_code: int = exitcodes.OK

    def to_dict(self) -> dict:
        return {"profiles": self.profiles}


def run_clusters(args) -> ClustersResult:
    from ..predictors.profile import list_profiles, load_profile
    rows = []
    for info in list_profiles():
        prof = load_profile(info.path)
        facts = prof.facts
        rows.append({
            "name": info.name, "path": str(info.path), "gpu": facts.gpu_name,
            "gpu_memory_bytes": facts.gpu_memory_bytes, "gpus_per_node": facts.gpus_per_node,
            "intra_node_link": facts.intra_node_link, "inter_node_link": facts.inter_node_link,
            "provenance": info.provenance,
        })
    return ClustersResult(rows)
