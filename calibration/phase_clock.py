"""Exclusive wall time per named phase, by wrapping the functions that run each phase."""
from __future__ import annotations

import time
from typing import Dict, List


class PhaseClock:
    """Exclusive time per phase name: a phase nested in another (allreduce_gradients inside
    backward) is charged to itself and subtracted from its parent."""

    def __init__(self):
        self.now = time.perf_counter
        self.stack: List[List[float]] = []  # [start, child seconds]
        self.current: Dict[str, float] = {}
        self.listener = None  # optional: .enter(name) / .leave_last() as phases start and end

    def wrap(self, name: str, fn):
        clock = self

        def timed(*args, **kwargs):
            listener = clock.listener
            if listener is not None:
                listener.enter(name)
            clock.stack.append([clock.now(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                if listener is not None:
                    listener.leave_last()
                start, children = clock.stack.pop()
                spent = clock.now() - start
                clock.current[name] = clock.current.get(name, 0.0) + spent - children
                if clock.stack:
                    clock.stack[-1][1] += spent
        timed.__wrapped__ = fn
        return timed

