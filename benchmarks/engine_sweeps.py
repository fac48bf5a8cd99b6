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

With --levels, across the files: each pass's level in each sweep of each file (the median over
the shapes every file holds of log(the shape's median repeat in that sweep / its median over
every sweep of every file)), and the spread of those levels sweep by sweep and file by file.
Where a file's sweeps agree while the files spread as widely as single sweeps do, what sets
the level lasts a whole pass, and its two sweeps are one draw of it (docs/validation.md, "The
tensor-parallel pass's level: per launch, or per stretch of the machine?").
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
    ap.add_argument("--levels", action="store_true",
                    help="each pass's level per sweep and file, and their spread across the files")
    args = ap.parse_args(argv)
    signs, loaded = {}, []
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
        loaded.append((path, data))
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
    if args.levels:
        _levels(loaded)
    return 0


def _levels(loaded) -> None:
    """Per pass, across the files: each file's sweep levels, and the spread (population
    standard deviation of the log level) of single sweeps and of files (their sweeps' mean)."""
    from neox_perf.calibration.engine import _PASS_NAMES, sweep_medians

    print("levels across the files (each shape against its median over every sweep of every file):")
    for section, name in _PASS_NAMES.items():
        pairs = {path: {label: sweep_medians(row, section)
                        for label, row in (data.get(section) or {}).items()}
                 for path, data in loaded}
        common = set.intersection(*({k for k, v in p.items() if v and min(v) > 0}
                                    for p in pairs.values()))
        if len(pairs) < 2 or len(common) < 3:
            continue
        ref = {k: statistics.median(x for p in pairs.values() for x in p[k]) for k in common}
        levels = {path: [statistics.median(math.log(p[k][i] / ref[k]) for k in common) for i in (0, 1)]
                  for path, p in pairs.items()}
        print(f"  {name} pass, over {len(common)} shapes:")
        for path, (a, b) in levels.items():
            print(f"    {path}: sweeps {math.exp(a) - 1:+6.1%} {math.exp(b) - 1:+6.1%}, "
                  f"apart {math.exp(b - a) - 1:+6.1%}")
        sweeps = [x for pair in levels.values() for x in pair]
        files = [statistics.fmean(pair) for pair in levels.values()]
        apart = [abs(b - a) for a, b in levels.values()]
        print(f"    spread: a sweep {statistics.pstdev(sweeps):.1%}, a file (its two sweeps' mean) "
              f"{statistics.pstdev(files):.1%}; a file's two sweeps apart {statistics.median(apart):.1%} "
              f"in the median (independent sweeps: a file's spread {statistics.pstdev(sweeps) / math.sqrt(2):.1%}, "
              f"its sweeps {statistics.pstdev(sweeps) * 2 / math.sqrt(math.pi):.1%} apart)")


if __name__ == "__main__":
    sys.exit(main())
