"""The host's time per framework call under CUDA and on the CPU, on one host, in one process.

`StepTerms.dispatch_s` is the host's time to issue one framework call of a GPU run. Its prior
(step_fit.HOST_CALL_S) is measured with no GPU (benchmarks/host_cost.py: GPT-NeoX's train.py on
a CPU), which leaves two things open: what the CUDA launch path adds to a call, and how much of
a CPU run's call is the CPU computing its tiny kernels (docs/cross-cluster.md). This measures
both on whatever host it runs on: the reference workload's own transformer layers
(calibration/workload/layers.py: NeoX's operators in NeoX's order) at host_cost.py's layout
(hidden 64, sequence 32, micro-batch 1, dropout 0.1, each layer checkpointed), 2 and 10 layers
in turn, forward and backward, on each device given. At that size a GPU runs host-bound, so the
eight extra layers' time is the host's:

    host seconds per call = (median iteration at 10 layers - at 2) / 8 / calls per layer

with the calls counted by neox-perf's own decomposition of the same layout (host_cost.py's
calls_per_layer). No DeepSpeed and no launcher: the layers alone, so on a lent GPU it takes
seconds. `benchmarks/gpu_check.py` runs it as its `host` step, CUDA then CPU.

    python benchmarks/host_path.py [--device cpu] [--device cuda] [--size 64,4,32] [--rounds 3] [--json]

Measure on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Sequence

import neox_perf  # noqa: E402,F401  the installed package, before host_cost.py puts the checkout on sys.path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import host_cost  # noqa: E402  (its layout, its count of calls, its --size)


def workload_config(size: Sequence[int]):
    """host_cost.py's layout as the reference workload's WorkloadConfig (its depth set later)."""
    from neox_perf.calibration.workload.dims import from_neox
    from neox_perf.predictors.fitting import devset
    from neox_perf.testing import neox_cpu
    lay = host_cost.layout(2, tuple(size))
    cfg, derived = devset.build_values(neox_cpu.config_values(lay, "unused"), 1, 1,
                                       "host-path layout", lay.name, 256)
    return from_neox(cfg, derived.padded_vocab)


def calls_per_layer(size: Sequence[int]) -> int:
    return host_cost.calls_per_layer(host_cost.layout(2, tuple(size)))


def _iteration_seconds(layers, x0, mask, device: str, iters: int, warmup: int) -> List[float]:
    import torch
    from torch.utils.checkpoint import checkpoint
    params = [p for layer in layers for p in layer.parameters()]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = []
    for i in range(warmup + iters):
        for p in params:  # as the engine leaves them after a step: the backward assigns
            p.grad = None
        x = x0.detach().requires_grad_(True)
        sync()
        t0 = time.perf_counter()
        for layer in layers:  # each layer its own checkpointed chunk, as checkpoint_num_layers 1
            x = checkpoint(layer, x, mask, use_reentrant=True)
        x.float().sum().backward()
        sync()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def measure_device(device: str, size: Sequence[int] = host_cost.SIZE, rounds: int = 3,
                   iters: int = 30, warmup: int = 5) -> Dict[str, object]:
    """Host seconds per framework call on `device`, per round and their median."""
    import torch
    from neox_perf.calibration.workload.data import causal_mask
    from neox_perf.calibration.workload.layers import ParallelTransformerLayer
    from neox_perf.calibration.workload.tensor_parallel import TPState, set_tp_state, tp

    base = workload_config(size)
    calls = calls_per_layer(size)
    before = tp()
    set_tp_state(TPState(init_device=device))
    try:
        stacks = {}
        for n in host_cost.DEPTHS:
            torch.manual_seed(1234)
            wc = replace(base, num_layers=n, attention_types=(base.attention_types[0],) * n)
            stacks[n] = [ParallelTransformerLayer(wc, i).to(device).train() for i in range(n)]
        x0 = torch.randn(base.seq_length, 1, base.hidden, device=device)
        mask = causal_mask(base.seq_length, device)
        out = []
        for r in range(rounds):
            medians = {}
            for n in host_cost.depth_order(r):
                medians[n] = statistics.median(_iteration_seconds(stacks[n], x0, mask, device, iters, warmup))
            out.append(host_cost.round_result(medians, calls))
    finally:
        set_tp_state(before)
    return {"device": device, **host_cost.summary(out, calls, size)}


def line(result: Dict[str, object]) -> str:
    s = result["size"]
    return (f"{result['device']}, hidden {s['hidden']}, {s['heads']} heads, sequence {s['seq']}: "
            f"{result['median_per_call_s'] * 1e6:.1f} us a call (median of {len(result['rounds'])} rounds, "
            f"{result['min_per_call_s'] * 1e6:.1f} .. {result['max_per_call_s'] * 1e6:.1f}; "
            f"{result['calls_per_layer']} calls a checkpointed layer)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", action="append", choices=("cpu", "cuda"),
                    help="where the layers run (repeatable; default cpu)")
    ap.add_argument("--size", default=host_cost.SIZE, type=host_cost.size_arg, metavar="HIDDEN,HEADS,SEQ",
                    help="the layers' size (default: host_cost.py's, 64,4,32)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30, help="timed iterations per depth and round")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    size = args.size
    if args.rounds < 1 or args.iters < 1:
        ap.error("--rounds and --iters: 1 or more")
    devices = args.device or ["cpu"]
    if "cuda" in devices:
        import torch
        if not torch.cuda.is_available():
            print("host_path: --device cuda, but torch sees no CUDA GPU on this machine; run it with "
                  "--device cpu here", file=sys.stderr)
            return 2
    results = [measure_device(d, size, args.rounds, args.iters) for d in devices]
    for r in results:
        print(line(r))
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
