"""The development set read per layer: measured milliseconds per transformer layer per micro-batch.

An iteration of vTrain's runs is (micro-batches x layers per stage) of the same layer work plus
a little, so dividing it out shows what one layer costs at each layout, width and micro-batch
size -- and where that cost stops following the work (a host-bound floor, a kernel fallback)
before any model is fitted. Rows: (tp, dp, pp) and hidden size; columns: micro-batch size.

    python benchmarks/devset_per_layer.py [--csv ../shared/data/vtrain-a100/single_node_runs.csv]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from neox_perf.predictors.fitting import devset  # noqa: E402


def per_layer_ms(runs):
    """(layout, hidden) -> {micro_batch: median ms per layer per micro-batch}."""
    cells = defaultdict(list)
    for r in runs:
        cells[(r.layout, r.hidden, r.micro_batch)].append(
            1e3 * r.seconds / r.accumulation / (r.layers / r.pp))
    table = defaultdict(dict)
    for (layout, hidden, mb), values in cells.items():
        table[(layout, hidden)][mb] = statistics.median(values)
    return dict(table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", help="vTrain single_node_runs.csv (default ../shared/data/...)")
    args = ap.parse_args(argv)
    try:
        runs = devset.load_vtrain(Path(args.csv) if args.csv else None)
    except FileNotFoundError as exc:
        print(f"devset_per_layer: {exc}; nothing to read")
        return 0
    table = per_layer_ms(runs)
    sizes = sorted({mb for row in table.values() for mb in row})
    print("ms per layer per micro-batch (median over the rows of each cell)")
    print(f"{'(tp, dp, pp)':>12} {'hidden':>6} " + " ".join(f"{'mb ' + str(mb):>7}" for mb in sizes))
    for (layout, hidden), row in sorted(table.items()):
        cells = " ".join(f"{row[mb]:7.2f}" if mb in row else f"{'-':>7}" for mb in sizes)
        print(f"{str(layout):>12} {hidden:6d} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
