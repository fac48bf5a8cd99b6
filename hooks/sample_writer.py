"""Operator samples of one rank into its node's SQLite store in the run dir (source "run").

All ranks of a node write the same file at once: the store runs in WAL mode and commits each
sample in its own short transaction, so concurrent ranks never corrupt it and a killed run
keeps every committed row. The store keeps one row per (op, phase, features, dtype, device,
run, rank); a later window's aggregate of an already-written point is not written again
(the per-rank summary carries the aggregate over all windows).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Set

from neox_perf.runs.files import store_file


class InjectedFailure(RuntimeError):
    """Raised where a test asked for a failure (PYTHON_NEOX_PERF_INJECT)."""


class SampleWriter:
    def __init__(self, run_dir: str, facts: Dict[str, Any], job: Optional[str],
                 inject: Optional[str] = None):
        self.path = store_file(run_dir, facts.get("host") or "")
        self.facts = facts
        self.job = job
        self.inject = inject
        self.store = None
        self.device_id: Optional[int] = None
        self.run_id: Optional[int] = None
        self.written: Set[tuple] = set()
        self.count = 0

    def _open(self) -> None:
        from neox_perf.calibration.fingerprint import fingerprint
        from neox_perf.calibration.store import SampleStore
        self.store = SampleStore(self.path)
        f = self.facts
        self.device_id = self.store.register_device(fingerprint(f.get("device") or "cpu"))
        self.run_id = self.store.register_run("run", device=self.device_id, plan=None, info={
            "job": self.job, "rank": f.get("rank"), "stage": f.get("stage"),
            "stage_label": f.get("stage_label"), "engine": f.get("engine"),
            "world_size": f.get("world_size"), "host": f.get("host"), "pid": os.getpid()})

    def write(self, ops, window: int) -> int:
        """Write the points not written yet; returns how many rows were added."""
        if self.inject == "sample_writer":
            raise InjectedFailure("injected failure in the sample writer (PYTHON_NEOX_PERF_INJECT)")
        if self.store is None:
            self._open()
        added = 0
        for key, agg in ops.items():
            if key in self.written:
                continue
            op, phase, feats, dtype = key
            median = agg.median()
            if not (median > 0 and agg.min > 0):
                continue  # a clock too coarse for this op: not a measurement
            q1, q3 = agg.quartiles()
            if self.store.add_sample(op, phase, dict(feats), median, device=self.device_id,
                                     run=self.run_id, dtype=dtype, source="run",
                                     repeats=agg.calls, median=median, iqr=max(q3 - q1, 0.0),
                                     min_seconds=agg.min, rank=int(self.facts.get("rank") or 0),
                                     stage=self.facts.get("stage_label"),
                                     info={"window": window, "mean": agg.seconds / agg.calls}):
                added += 1
            self.written.add(key)
        self.count += added
        return added

    def close(self, info: Optional[Dict[str, Any]] = None) -> None:
        if self.store is None:
            return
        try:
            if self.run_id is not None:
                self.store.finish_run(self.run_id)
        finally:
            self.store.close()
            self.store = None
