"""Overhead of the runtime hook outside profiling windows, on a real DeepSpeed engine.

    OMP_NUM_THREADS=1 python benchmarks/hook_overhead.py [--rounds 6] [--iters 20] [--device cuda] [--json]

One process (world size 1; gloo on the CPU, nccl and CUDA-event timing with --device cuda,
calibration/cuda_facts.EventTimer): a DeepSpeedEngine training an MLP with gradient
accumulation, so every iteration passes the hook's forward/backward/step/allreduce wrappers
GAS times, syncs the clock, appends the iteration line and steps the (idle) profiler; the
profiling schedule is set so that no window ever opens. Plain and hooked rounds alternate in
ABBA order (unwrapping and rewrapping the same engine) and the median iteration of each is compared.

On a shared 2-core machine iteration times wander by more than 1%, so the script also times
the hook's own machinery directly: the same wrappers around an engine whose methods do
nothing. That figure, divided by the real iteration time, is the overhead.

Loss identity: two fresh engines from the same seed train the same batches, one plain and one
hooked; the hook must not change a single loss value (compared exactly, and the largest
difference reported).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

NEVER = "skip=1000000000,warmup=1,active=1,every=2,repeat=1"  # windows that never open


def _dist(device: str = "cpu"):
    from neox_perf.calibration.launch import free_port
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    import deepspeed
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")


def _engine(width: int, gas: int, device: str = "cpu"):
    import deepspeed
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width),
                                torch.nn.GELU(), torch.nn.Linear(4 * width, width)).to(device)
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
              "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    return engine


def _iterations(engine, n: int, width: int, device: str = "cpu", losses=None):
    """Seconds of each of ``n`` iterations (CUDA events on a GPU, perf_counter on a CPU); the
    loss of every micro-batch appended to ``losses`` when given (read after the timing)."""
    import torch

    from neox_perf.calibration.cuda_facts import EventTimer
    x = torch.randn(16, width, generator=torch.Generator().manual_seed(1)).to(device)
    timer, kept = EventTimer(cuda=device == "cuda"), []
    for _ in range(n):
        timer.start()
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            if losses is not None:
                kept.append(loss.detach())
        timer.stop()
    times = timer.seconds()
    if losses is not None:
        losses += [float(v) for v in kept]
    return times


def loss_identity(session_of, width: int, gas: int, device: str, iters: int = 5) -> dict:
    """Two fresh engines from one seed, the same batches, one plain and one hooked (by
    ``session_of(engine)``, which attaches a session and returns it): their losses."""
    from neox_perf.hooks import engine_patch
    plain, hooked = [], []
    _iterations(_engine(width, gas, device), iters, width, device, plain)
    engine = _engine(width, gas, device)
    session = session_of(engine)
    _iterations(engine, iters, width, device, hooked)
    engine_patch.unwrap_engine(engine)
    session.finish()
    worst = max((abs(a - b) for a, b in zip(plain, hooked)), default=0.0)
    return {"micro_batches": len(plain), "identical": plain == hooked, "max_abs_difference": worst,
            "plain": plain, "hooked": hooked}


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


def measure(rounds: int = 6, iters: int = 20, width: int = 512, gas: int = 4,
            device: str = "cpu") -> dict:
    """The whole benchmark (in this process: it initialises torch.distributed), as data."""
    import torch
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    _dist(device)
    from neox_perf.hooks import engine_patch
    from neox_perf.hooks.session import Session
    from neox_perf.hooks.settings import Settings, Windows
    engine = _engine(width, gas, device)
    with tempfile.TemporaryDirectory() as run_dir:
        # no live-bytes window either: like a profiling window it is one perturbed iteration
        def settings(sub):
            return Settings(run_dir=os.path.join(run_dir, sub), windows=Windows.parse(NEVER),
                            report_at_exit=False, memory_iteration=None)
        session = Session(settings("overhead"))
        session.attach(engine, (), {})
        engine_patch.unwrap_engine(engine)
        _iterations(engine, 5, width, device)  # warm-up
        plain, hooked = [], []
        for r in range(rounds):
            # ABBA order: whichever runs second in a round must not always be the hooked one
            for hooked_now in ((False, True) if r % 2 == 0 else (True, False)):
                if hooked_now:
                    engine_patch.wrap_engine(engine, session)
                    hooked += _iterations(engine, iters, width, device)
                    engine_patch.unwrap_engine(engine)
                else:
                    plain += _iterations(engine, iters, width, device)
        cost = _machinery(session, gas, 2000)
        session.finish()

        def attach(eng):
            s = Session(settings("loss"))
            s.attach(eng, (), {})
            return s
        losses = loss_identity(attach, width, gas, device)
    p, h = statistics.median(plain), statistics.median(hooked)
    q = statistics.quantiles(plain, n=4)
    from neox_perf.calibration.cuda_facts import EventTimer
    return {"device": device, "timer": EventTimer(cuda=device == "cuda").method,
            "world": 1, "gas": gas, "width": width, "threads": torch.get_num_threads(),
            "rounds": rounds, "iters_per_round": iters, "plain": plain, "hooked": hooked,
            "plain_median_s": p, "hooked_median_s": h, "overhead": (h - p) / p,
            "plain_iqr": (q[2] - q[0]) / p, "machinery_s": cost, "machinery_share": cost / p,
            "loss": losses}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--gas", type=int, default=4)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--json", action="store_true", help="the result as one JSON object")
    args = ap.parse_args(argv)
    r = measure(args.rounds, args.iters, args.width, args.gas, args.device)
    if args.json:
        import json
        print(json.dumps(r))
        return 0
    p, h, loss = r["plain_median_s"], r["hooked_median_s"], r["loss"]
    print(f"hook overhead outside profiling windows (DeepSpeedEngine, {args.device}, world 1, "
          f"GAS {args.gas}, MLP width {args.width}, {r['threads']} thread(s); {r['timer']})")
    print(f"  plain iteration, median of {len(r['plain'])}:   {p * 1e3:8.3f} ms  (IQR {r['plain_iqr'] * 100:.1f}%)")
    print(f"  hooked iteration, median of {len(r['hooked'])}:  {h * 1e3:8.3f} ms  ({r['overhead'] * 100:+.2f}%)")
    print(f"  hook machinery per iteration:   {r['machinery_s'] * 1e6:8.1f} us  "
          f"= {r['machinery_share'] * 100:.3f}% of the plain iteration")
    print(f"  loss over {loss['micro_batches']} micro-batches, plain vs hooked: "
          f"{'identical' if loss['identical'] else 'DIFFERENT'} (max |diff| {loss['max_abs_difference']:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
