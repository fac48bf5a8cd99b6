"""Shared by the calibration tests (a uniquely named module: every test folder has a conftest)."""
import contextlib
import itertools
import subprocess
import sys

# Tiny per-op features: every operator builds and runs in well under a millisecond.
TINY = {"m": 8, "k": 16, "n": 24, "batch": 4, "l": 16, "head_dim": 8, "b": 2, "heads": 2,
        "causal": 1, "tokens": 32, "d": 16, "width": 64, "rot_dim": 8, "vocab": 128,
        "params": 1000}

TINY_PLAN = """
name: tiny
protocol: {warmup: 0, repeats: 3}
defaults: {mp: [1, 2], b: 1, l: [8, 16], d: [16, 32], h: 2, vocab: 200}
ops:
  linear1: {}
  layernorm: {}
  qk: {}
  softmax: {}
  optimizer: {params: [100, 200]}
"""


class FakeClock:
    """Deterministic clock: each reading advances by the next of ``steps`` (cycled)."""

    def __init__(self, steps=(0.001,)):
        self.steps = itertools.cycle(steps)
        self.now = 0.0
        self.calls = 0

    def __call__(self):
        self.calls += 1
        self.now += next(self.steps)
        return self.now


SPIN = "import os\nos.sched_setaffinity(0, {%d})\nprint('spinning', flush=True)\nwhile True:\n    pass\n"


@contextlib.contextmanager
def spinning(cpu):
    """A process spinning on ``cpu`` for the block (a child: judge before it is reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", SPIN % cpu], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "spinning"
        yield proc
    finally:
        proc.kill()
        proc.wait()
