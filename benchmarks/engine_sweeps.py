"""Each engine pass's two sweeps, side by side: does a calibration's second sweep run slower?

    python benchmarks/engine_sweeps.py STORE.engine.json [MORE.engine.json ...] [--shapes]

The engine step measures every shape in two sweeps, the second reversed, and flags a pass whose
sweeps disagree across its shapes (calibration/engine.py: sweep_shifts, SHIFT_LIMIT, SHIFT_Z).
The flag reads a slow stretch of the machine as long as a sweep. This prints what the flag
reads, for every pass of every file given: the shift (the median over shapes of sweep 2 over
sweep 1, each a shape's median repeat of its phases), its z (shift over the median's standard
error), and whether the rule flags it; with --shapes, every shape's two medians. Across many
calibrations, a shift that keeps one sign is not a random slow stretch: it is something about
where a sweep sits in the calibration (docs/validation.md). Reads the files only.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys


def main(argv=None) -> int:
    from neox_perf.calibration.engine import _PASS_NAMES, sweep_flagged, sweep_medians, sweep_shifts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="engine files (STORE.engine.json) of calibrations")
    ap.add_argument("--shapes", action="store_true", help="print every shape's two sweeps")
    args = ap.parse_args(argv)
    signs = {}
    for path in args.files:
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError) as exc:
            print(f"{path}: not an engine file ({exc})", file=sys.stderr)
            return 1
        if not isinstance(data, dict):
            print(f"{path}: not an engine file (a JSON object of passes, as calibrate writes "
                  f"STORE.engine.json)", file=sys.stderr)
            return 1
        print(path)
        for section, s in sweep_shifts(data).items():
            shift, z = s["shift"], abs(s["shift"]) / s["se"] if s["se"] > 0 else float("inf")
            flagged = sweep_flagged(s)
            signs.setdefault(section, []).append(shift)
            print(f"  {_PASS_NAMES[section]:>15} pass: second sweep {math.exp(shift) - 1:+6.1%} against "
                  f"the first over {s['shapes']} shapes, z {z:4.1f}{'  flagged' if flagged else ''}")
            if args.shapes:
                for label, row in (data.get(section) or {}).items():
                    pair = sweep_medians(row, section)
                    if pair is not None and pair[0] > 0:
                        a, b = pair
                        print(f"      {label:<42} {a:8.4f} s  {b:8.4f} s  {b / a - 1:+6.1%}")
    if len(args.files) > 1:
        print("over the files:")
        for section, shifts in signs.items():
            up = sum(x > 0 for x in shifts)
            print(f"  {_PASS_NAMES[section]:>15} pass: second sweep slower in {up} of {len(shifts)}, "
                  f"median {math.exp(statistics.median(shifts)) - 1:+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
