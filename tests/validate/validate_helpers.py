"""Shared by the validate/calibrate tests (a uniquely named module: every test folder has a conftest)."""
import argparse
import itertools

# Every operator the decomposition of a tiny NeoX config asks for, at a few shapes, plus a
# tiny collectives section: seconds to measure, enough rows for the trainer to fit.
TINY_PLAN = """
name: tiny-validate
protocol: {warmup: 0, repeats: 2}
defaults: {mp: 1, b: 1, l: [16, 32], d: [32, 64], h: 2, vocab: 256}
ops:
  linear1: {}
  linear4: {}
  layernorm: {}
  softmax: {}
  gelu: {}
  optimizer: {params: [1000, 4000, 16000]}
collectives:
  protocol: {warmup: 1, repeats: 2}
  allreduce: {elements: [64, 4096]}
  p2p: {elements: [64, 4096]}
"""


class FakeClock:
    """Each reading advances by the next of ``steps`` (cycled): deterministic timings."""

    def __init__(self, steps=(0.001, 0.002)):
        self.steps = itertools.cycle(steps)
        self.now = 0.0

    def __call__(self):
        self.now += next(self.steps)
        return self.now


def calibrate_args(tmp_path, plan, **over):
    args = dict(cluster="tiny", quick=False, plan=str(plan), store=str(tmp_path / "s.sqlite"),
                out=str(tmp_path / "profile"), nproc=1, engine=False)
    args.update(over)
    return argparse.Namespace(**args)
