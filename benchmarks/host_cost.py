"""The host's time to issue one framework call of a transformer layer, measured on GPT-NeoX's own
training program with no GPU: what `StepTerms.dispatch_s` is, physically, before any GPU run.

A cluster of large models never runs host-bound, so its runs cannot show this cost (Jean Zay's
fit hands back its prior: docs/cross-cluster.md). This benchmark measures it where nothing
hides it: NeoX's unmodified `train.py` on this CPU (neox_perf/testing/neox_cpu.py), at a size
where every kernel is a few microseconds (hidden 64, sequence 32, micro-batch 1), with
activation checkpointing and dropout as the development set's Megatron-DeepSpeed runs had.
Two depths, launched in turn (2 and 10 layers, the order alternating per round): what the eight
extra layers add to the median iteration is the host's time for their forward, recompute and
backward, and neox-perf's own decomposition of the same config says how many framework calls
that is. Per round:

    host seconds per call = (median iteration at 10 layers - at 2) / 8 / calls per layer

The result is a prior, not a fit: a GPU host issues the same Python and the same dispatcher
calls, plus a CUDA launch per kernel (a few microseconds), on another CPU. At the prior's size
the CPU's own kernels are part of the cost; `--size` shrinks the layers until only the host's
path is left (the same calls a layer: tests/test_host_cost.py), which says how much.

    python benchmarks/host_cost.py [--rounds 4] [--size 64,4,32] [--json]

Needs NEOX_PERF_NEOX_SRC (and NEOX_PERF_NEOX_PYTHON); measure on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from neox_perf.testing import neox_cpu  # noqa: E402

DEPTHS = (2, 10)
# the development set's runs (vTrain: Megatron-DeepSpeed's defaults) had dropout 0.1 and
# activation checkpointing; NeoX's CPU layouts default to no dropout
EXTRA = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
WARMUP = 10  # iterations left out of each median
SIZE = (64, 4, 32)  # hidden, heads, sequence: the prior's measurement (step_fit.HOST_CALL_S)


def layout(layers: int, size=SIZE) -> "neox_cpu.Layout":
    hidden, heads, seq = size
    return neox_cpu.Layout(f"host-cost-{layers}", gpus=1, pp=0, mp=1, checkpoint=True, micro=1,
                           gas=1, layers=layers, hidden=hidden, heads=heads, seq=seq, iters=40,
                           pos_emb="learned", tied=True, extra=dict(EXTRA))


def calls_per_layer(lay) -> int:
    """Framework calls one layer issues per micro-batch, as the prediction counts them
    (operators.OpCall.launches): forward, its recompute under checkpointing, backward."""
    from neox_perf.prediction.operators import decompose, framework_calls, stage_shapes
    from neox_perf.predictors.fitting import devset
    values = neox_cpu.config_values(lay, "unused")
    cfg, derived = devset.build_values(values, lay.gpus, lay.gpus, "host-cost layout", lay.name, 256)
    stage = decompose(cfg, derived.padded_vocab, stage_shapes(derived)).stages[0]
    recompute = 1 if stage.recompute_layers else 0
    return int(round(framework_calls(stage.layer_forward) * (1 + recompute)
                     + framework_calls(stage.layer_backward)))


def depth_order(round_index: int) -> tuple:
    """The depths in one round's order: alternated, so neither depth always runs first."""
    return DEPTHS if round_index % 2 == 0 else DEPTHS[::-1]


def round_result(medians: dict, calls: int) -> dict:
    """One round, from its median iteration (seconds) at each depth: the extra layers' time, a
    layer's and a call's."""
    per_layer = (medians[DEPTHS[1]] - medians[DEPTHS[0]]) / (DEPTHS[1] - DEPTHS[0])
    return {"medians_s": medians, "per_layer_s": per_layer, "per_call_s": per_layer / calls}


def summary(rounds: list, calls: int, size) -> dict:
    """The rounds (round_result) and their median, lowest and highest seconds a call."""
    per_call = [r["per_call_s"] for r in rounds]
    return {"size": {"hidden": size[0], "heads": size[1], "seq": size[2]},
            "calls_per_layer": calls, "rounds": rounds, "median_per_call_s": statistics.median(per_call),
            "min_per_call_s": min(per_call), "max_per_call_s": max(per_call)}


def measure(rounds: int, work_dir: Optional[str] = None, size=SIZE) -> dict:
    """Host seconds per framework call, per round and their median; NeoxUnavailable where no
    GPT-NeoX checkout is set."""
    neox_cpu.neox_src()
    calls = calls_per_layer(layout(DEPTHS[0], size))
    work = work_dir or tempfile.mkdtemp(prefix="neox-perf-host-cost-")
    out = []
    for i in range(rounds):
        medians = {}
        for layers in depth_order(i):
            run = neox_cpu.run_layout(layout(layers, size), os.path.join(work, f"round{i}-L{layers}"))
            medians[layers] = statistics.median(run.iteration_ms[WARMUP:]) / 1e3
        r = round_result(medians, calls)
        out.append(r)
        print(f"round {i + 1}: median iteration {medians[DEPTHS[0]] * 1e3:.2f} ms at {DEPTHS[0]} layers, "
              f"{medians[DEPTHS[1]] * 1e3:.2f} ms at {DEPTHS[1]}: {r['per_layer_s'] * 1e3:.3f} ms a layer, "
              f"{r['per_call_s'] * 1e6:.1f} us a call", flush=True)
    return {**summary(out, calls, size), "load_average": os.getloadavg()[0]}


def size_arg(text: str) -> tuple:
    """--size HIDDEN,HEADS,SEQ (argparse type; host_path.py reads it too)."""
    try:
        size = tuple(int(x) for x in text.split(","))
        if len(size) == 3 and min(size) >= 1 and size[0] % size[1] == 0:
            return size
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: give HIDDEN,HEADS,SEQ, positive whole numbers, HIDDEN "
                                     "a multiple of HEADS (e.g. 16,2,8)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--work-dir", help="where NeoX's data, configs and logs go (default: a temp dir)")
    ap.add_argument("--size", default=SIZE, type=size_arg, metavar="HIDDEN,HEADS,SEQ",
                    help="the layers' size (default: the prior's, 64,4,32); smaller, the CPU's own "
                         "kernel time leaves the per-call cost and the host's path remains")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    size = args.size
    try:
        result = measure(args.rounds, args.work_dir, size)
    except neox_cpu.NeoxUnavailable as exc:
        print(f"host_cost: {exc}; nothing measured")
        return 0
    print(f"hidden {size[0]}, {size[1]} heads, sequence {size[2]}: "
          f"{result['calls_per_layer']} framework calls a checkpointed layer (forward, recompute, "
          f"backward); host time per call: median {result['median_per_call_s'] * 1e6:.1f} us over "
          f"{len(result['rounds'])} rounds ({result['min_per_call_s'] * 1e6:.1f} .. "
          f"{result['max_per_call_s'] * 1e6:.1f}); load average {result['load_average']:.2f}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
