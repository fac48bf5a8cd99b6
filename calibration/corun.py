"""Processes that run the operator being timed, as the other ranks of a CPU run do.

A calibration times one process while the machine's other cores idle; a CPU training run has
one rank per core executing the same operators at the same moment, contending for caches and
memory bandwidth. CoRunners keeps n processes (one thread each) running a given point in a
loop while the caller times it (benchmarks/drift_probe.py --corun measures the difference).
"""
from __future__ import annotations

import multiprocessing
from contextlib import contextmanager


def _corunner(points, go, ready, idle) -> None:
    """Runs each point it is given in a loop while `go` is set (a co-scheduled rank)."""
    from neox_perf.calibration.bench import Protocol, measure
    from neox_perf.calibration.launch import use_caching_malloc
    from neox_perf.calibration.sweep import pinned_threads
    use_caching_malloc()
    with pinned_threads(1):
        while True:
            point = points.get()
            if point is None:
                return
            op, phase, features, dtype = point
            busy = Protocol(warmup=0, repeats=3)  # short rounds: `go` is checked between them
            measure(op, phase, features, protocol=busy, dtype=dtype)  # built and warm
            ready.put(1)
            while go.is_set():
                measure(op, phase, features, protocol=busy, dtype=dtype)
            idle.put(1)


class CoRunners:
    """n processes that run the point being timed, started once for every point."""

    def __init__(self, n: int):
        ctx = multiprocessing.get_context("spawn")  # torch in a forked child is unsafe
        self.go, self.ready, self.idle = ctx.Event(), ctx.Queue(), ctx.Queue()
        self.queues = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=_corunner, args=(q, self.go, self.ready, self.idle),
                                  daemon=True) for q in self.queues]
        for proc in self.procs:
            proc.start()

    def __enter__(self):
        return self

    @contextmanager
    def running(self, point):
        """Every co-runner runs `point` (op, phase, features, dtype) for the block's duration."""
        self.go.set()
        for q in self.queues:
            q.put(point)
        for _ in self.queues:
            self.ready.get(timeout=600)
        try:
            yield
        finally:
            self.go.clear()
            for _ in self.queues:
                self.idle.get(timeout=600)

    def __exit__(self, *exc):
        for q in self.queues:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()
