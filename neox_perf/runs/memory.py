"""Predicted vs measured memory of a run, per pipeline stage and per component.

Measured: the hook's live-bytes window (calibration/live_memory.py), each rank's peak of live tensor
bytes and what was live at it, by the components `check` predicts (derive/memory.COMPONENTS);
on CUDA also the allocator's own peaks. Predicted: the stage's StageMemory from the config the
hook recorded, rebuilt for the device and precision the engine really ran (runs/prediction).
One rank per stage is compared (the stage's ranks hold the same tensors; the first one that
measured is used, and the spread over the others is reported). No torch.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from ..derive.memory import COMPONENTS

# A component is judged against its own size, but never against less than this share of the
# stage's total: a few bytes of loss scalars would otherwise be a 100% error.
FLOOR = 0.001


def error(predicted: Optional[float], measured: Optional[float],
          total: Optional[float] = None) -> Optional[float]:
    """(predicted - measured) / max(measured, FLOOR x total)."""
    if predicted is None or measured is None:
        return None
    base = max(measured, FLOOR * (total or 0.0))
    return None if base <= 0 else (predicted - measured) / base


def live_of(summary: dict) -> Optional[dict]:
    live = (summary.get("memory") or {}).get("live")
    return live if live and live.get("peak_bytes") is not None and not live.get("error") else None


def stage_rows(summaries: List[dict], derived) -> List[Dict[str, Any]]:
    """Per stage: {"stage", "rank", "ranks", "predicted", "measured", "error", "moment",
    "predicted_moment", "components": [{component, predicted, measured, error}], "cuda"}."""
    by_stage: Dict[int, List[dict]] = {}
    for s in sorted(summaries, key=lambda s: s.get("rank", 0)):
        live = live_of(s)
        if live is None:
            continue
        stage = int((s.get("facts") or {}).get("stage") or 0)
        by_stage.setdefault(stage, []).append((s, live))
    rows = []
    for stage in sorted(by_stage):
        if derived is None or stage >= len(derived.stages):
            continue
        s, live = by_stage[stage][0]
        mem = derived.stages[stage].memory
        measured = int(live["peak_bytes"])
        peaks = [int(l["peak_bytes"]) for _, l in by_stage[stage]]
        comps = []
        for c in COMPONENTS:
            p, m = mem.peak.get(c, 0), (live.get("at_peak") or {}).get(c, 0)
            comps.append({"component": c, "predicted": p, "measured": m,
                          "error": error(p, m, measured)})
        rows.append({
            "stage": stage, "rank": s.get("rank"), "ranks": [x.get("rank") for x, _ in by_stage[stage]],
            "predicted": mem.total, "measured": measured, "error": error(mem.total, measured),
            "measured_spread": (max(peaks) - min(peaks)) / measured if measured else None,
            "moment": live.get("peak_moment"), "predicted_moment": mem.peak_moment,
            "components": comps, "cuda": live.get("cuda"),
            "device_total": mem.device_total, "device_terms": dict(mem.device_terms),
            "tracker": {"iteration": live.get("iteration"),
                        "iteration_seconds": live.get("iteration_seconds"),
                        "setup_seconds": live.get("tracker_seconds")},
        })
    return rows
