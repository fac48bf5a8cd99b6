"""Overhead of the runtime hook outside profiling windows, on a real DeepSpeed engine.

    OMP_NUM_THREADS=1 python benchmarks/hook_overhead.py [--rounds 6] [--iters 20]

One process (world size 1, gloo, CPU): a DeepSpeedEngine training an MLP with gradient
accumulation, so every iteration passes the hook's forward/backward/step/allreduce wrappers
GAS times, syncs the clock, appends the iteration line and steps the (idle) profiler; the
profiling schedule is set so that no window ever opens. Plain and hooked rounds alternate in
ABBA order (unwrapping and rewrapping the same engine) and the median iteration of each is compared.

On a shared 2-core machine iteration times wander by more than 1%, so the script also times
the hook's own machinery directly: the same wrappers around an engine whose methods do
nothing. That figure, divided by the real iteration time, is the overhead.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

NEVER = "skip=1000000000,warmup=1,active=1,every=2,repeat=1"  # windows that never open


def _dist():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")


def _engine(width: int, gas: int):
    import deepspeed
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width),
                                torch.nn.GELU(), torch.nn.Linear(4 * width, width))
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
              "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    return engine


def _iterations(engine, n: int, width: int):
    import torch
    x = torch.randn(16, width)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
        times.append(time.perf_counter() - t0)
    return times


class _NoOp:
    """An engine whose work is free: what is left is the hook's own cost."""

    def __init__(self, gas):
        self.gas, self.global_steps, self.micro = gas, 0, 0

    def forward(self, *a):
        return None

    def backward(self, *a):
        return None

    def step(self):
        self.micro += 1
        if self.micro % self.gas == 0:
            self.global_steps += 1

    def allreduce_gradients(self):
        return None


def _machinery(session, gas: int, n: int):
    from neox_perf.hooks import engine_patch
    noop = _NoOp(gas)

    def loop():
        t0 = time.perf_counter()
        for _ in range(n):
            for _ in range(gas):
                noop.forward()
                noop.backward()
                noop.allreduce_gradients()
                noop.step()
        return (time.perf_counter() - t0) / n
    bare = min(loop() for _ in range(5))
    engine_patch._wrap_plain(noop, session, {})
    wrapped = min(loop() for _ in range(5))
    return wrapped - bare


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--gas", type=int, default=4)
    args = ap.parse_args()
    import torch
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    _dist()
    from neox_perf.hooks import engine_patch
    from neox_perf.hooks.session import Session
    from neox_perf.hooks.settings import Settings, Windows
    engine = _engine(args.width, args.gas)
    with tempfile.TemporaryDirectory() as run_dir:
        # no live-bytes window either: like a profiling window it is one perturbed iteration
        session = Session(Settings(run_dir=run_dir, windows=Windows.parse(NEVER),
                                   report_at_exit=False, memory_iteration=None))
        session.attach(engine, (), {})
        engine_patch.unwrap_engine(engine)
        _iterations(engine, 5, args.width)  # warm-up
        plain, hooked = [], []
        for r in range(args.rounds):
            # ABBA order: whichever runs second in a round must not always be the hooked one
            for hooked_now in ((False, True) if r % 2 == 0 else (True, False)):
                if hooked_now:
                    engine_patch.wrap_engine(engine, session)
                    hooked += _iterations(engine, args.iters, args.width)
                    engine_patch.unwrap_engine(engine)
                else:
                    plain += _iterations(engine, args.iters, args.width)
        cost = _machinery(session, args.gas, 2000)
        session.finish()
    p, h = statistics.median(plain), statistics.median(hooked)
    spread = (statistics.quantiles(plain, n=4)[2] - statistics.quantiles(plain, n=4)[0]) / p
    print("hook overhead outside profiling windows (DeepSpeedEngine, CPU, world 1, "
          f"GAS {args.gas}, MLP width {args.width}, {torch.get_num_threads()} thread(s))")
    print(f"  plain iteration, median of {len(plain)}:   {p * 1e3:8.3f} ms  (IQR {spread * 100:.1f}%)")
    print(f"  hooked iteration, median of {len(hooked)}:  {h * 1e3:8.3f} ms  ({(h - p) / p * 100:+.2f}%)")
    print(f"  hook machinery per iteration:   {cost * 1e6:8.1f} us  "
          f"= {cost / p * 100:.3f}% of the plain iteration")
    return 0


if __name__ == "__main__":
    sys.exit(main())
