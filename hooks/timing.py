"""Per-iteration wall time of one rank, streamed to a JSON-lines file.

An iteration is one `PipelineEngine.train_batch`, or for a plain DeepSpeedEngine the span
from the first forward after an optimizer step to the end of the next step() at a
gradient-accumulation boundary. On a GPU both ends synchronise the device (as Megatron's
timers do), otherwise the clock would stop when the kernels are queued, not when they ran.

On a CPU rank the line also carries the wall seconds of each engine phase in that iteration
("ph": forward, backward, step, ... as engine_patch labels them; nested phases are inside
their parent's), measured outside profiling windows: the report's components come from them.

Every iteration appends one line and flushes (no fsync: a killed process keeps what reached
the OS, a power cut may lose the tail). Memory stays bounded: the full series lives in the
file, the process keeps counters and the last few hundred values.
"""
from __future__ import annotations

import collections
import json
import math
import time
from typing import Callable, Deque, Dict, Optional

RECENT = 512


class IterationClock:
    def __init__(self, path: str, sync: Optional[Callable[[], None]] = None):
        self.path = path
        self.sync = sync or (lambda: None)
        # One process owns this rank's file; a re-run into the same run dir starts it afresh.
        self._fh = open(path, "w", encoding="utf-8", buffering=1 << 16)
        self._start: Optional[float] = None
        self.count = 0
        self.profiled = 0
        self.min = math.inf
        self.max = 0.0
        self.total = 0.0
        self.recent: Deque[float] = collections.deque(maxlen=RECENT)

    @property
    def running(self) -> bool:
        return self._start is not None

    def start(self) -> None:
        self.sync()
        self._start = time.perf_counter()

    def stop(self, profiled: bool, phases: Optional[Dict[str, float]] = None) -> Optional[float]:
        """End the iteration; ``phases``: wall seconds per engine phase in it (CPU ranks)."""
        if self._start is None:
            return None
        self.sync()
        seconds = time.perf_counter() - self._start
        self._start = None
        index = self.count
        self.count += 1
        # Profiled iterations are slower by design; the stats keep them apart.
        if profiled:
            self.profiled += 1
        else:
            self.min = min(self.min, seconds)
            self.max = max(self.max, seconds)
            self.total += seconds
            self.recent.append(seconds)
        rec = {"i": index, "s": round(seconds, 9), "p": int(profiled), "t": round(time.time(), 3)}
        if phases:
            rec["ph"] = {k: round(v, 9) for k, v in phases.items()}
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()
        return seconds

    def abandon(self) -> None:
        self._start = None

    def stats(self) -> Dict[str, object]:
        plain = self.count - self.profiled
        return {"iterations": self.count, "profiled_iterations": self.profiled,
                "min_seconds": self.min if plain else None,
                "max_seconds": self.max if plain else None,
                "mean_seconds": self.total / plain if plain else None,
                "file": self.path}

    def close(self) -> None:
        try:
            self._fh.close()
        except Exception:
            pass
