"""Several sittings' launches side by side: how far one launch moves between sittings, and which
layout class a profile misses once each sitting's own level is taken out.

    python benchmarks/sittings.py S1.json S2.json [S3.json ...] [--cluster P [--compare Q ...]]
                                  [--by layout|attention] [--json]

Each file is one sitting: a `validate_local.py --json` output (the same configs launched for
real, each with its measured median iteration). Three things are printed.

The launches' spread: each config's measured median in every sitting, and how far apart they
are (largest over smallest). On a shared 2-core VM the same launch moves by tens of percent
between sittings; no profile can be judged closer than its launches reproduce.

The class errors: within one sitting, each launch's error against a profile is log(predicted /
measured median). Their mean is the sitting's level: a machine that ran the whole sitting slower
or faster, or a profile calibrated in another state of it, moves every launch alike. What is
left after the level is taken out belongs to the layout: a class's error is the mean of its
launches' errors minus the level. Classes: tensor parallel (mp >= 2), pipelined (pp >= 2),
data parallel on at most one pipeline stage (dp >= 2, pp <= 1); with --by attention, the
layers' attention instead (flash, or unfused: mask and softmax over s x s). A class that stays
on one side of its sitting's level in every sitting and under every profile is a missing term,
not noise (the brief: a one-signed error is a missing term). Without --cluster the files' own predictions
are read (each sitting's profile); with it, every sitting is predicted again by each profile
given (validate_local's --measured), launching nothing. The profiles of one sitting share its
launches, so a class is called one-signed when every sitting's mean over its profiles falls on
the same side, over three sittings or more.

The gradient sync beyond its price: each data-parallel launch's (dp >= 2, pp <= 1) measured
gradient sync less the sitting's own prediction of it, over its measured forward + backward (the
work since its replicas last met: what they wait for each other over, engine-terms.md). Reads
the files only.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from validate_local import _compare, measurements  # noqa: E402  (the same re-prediction)

BAR = 0.03  # issue #34's bar: a profile within 3% per layout
CLASSES = ("tensor parallel (mp >= 2)", "pipelined (pp >= 2)", "data parallel, pp <= 1")


def layout_class(layout: dict) -> str:
    if int(layout.get("mp", 1)) >= 2:
        return CLASSES[0]
    if int(layout.get("pp", 0)) >= 2:
        return CLASSES[1]
    if int(layout.get("dp", 1)) >= 2:
        return CLASSES[2]
    return "one process"


class NotASitting(ValueError):
    """A file that is not a validate_local.py --json output: one line naming it."""


def _read(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
        ok = all(isinstance(r["config"][-1], str) and float(r["measured_seconds"]) > 0
                 for r in data["results"])
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise NotASitting(f"{path}: not a validate_local.py --json output ({exc.__class__.__name__}: "
                          f"{exc}); fix: give the files `validate_local.py --json` wrote") from None
    if not ok:
        raise NotASitting(f"{path}: a launch without a config or a positive measured_seconds; fix: give "
                          f"the files `validate_local.py --json` wrote")
    return data


def _median(r: dict) -> float:
    return float(r.get("measured_median_seconds", r["measured_seconds"]))


def _name(r: dict) -> str:
    return Path(r["config"][-1]).name


def spread(sittings: list) -> dict:
    """Each config's measured median per sitting (those that launched it in two or more)."""
    medians = [{_name(r): _median(r) for r in s["results"]} for s in sittings]
    rows = []
    for name in sorted(set().union(*medians)):
        meds = [m.get(name) for m in medians]
        seen = [m for m in meds if m]
        if len(seen) >= 2:
            rows.append({"config": name, "medians": meds, "spread": max(seen) / min(seen) - 1.0})
    out = {"rows": rows}
    if rows:
        worst = max(rows, key=lambda r: r["spread"])
        out.update(median_spread=statistics.median(r["spread"] for r in rows),
                   worst={"config": worst["config"], "spread": worst["spread"]},
                   within_bar=sum(r["spread"] <= BAR for r in rows))
    return out


def attention_class(layout: dict) -> str:
    """The layer's attention: flash (one compute-bound operator) or unfused (a mask and a
    softmax over s x s, memory-bound: engine_fit.SPLIT_PHASES)."""
    return f"{layout.get('attention') or 'unfused'} attention"


CLASSIFY = {"layout": layout_class, "attention": attention_class}


def _errors(sitting: dict, profiles, gpus: int, classify=layout_class) -> dict:
    """{profile: [(config name, class, log(predicted / measured median))]} for one sitting."""
    classes = {_name(r): classify(r.get("layout") or {}) for r in sitting["results"]}
    if not profiles:  # the sitting's own predictions
        name = sitting.get("cluster") or "the sitting's profile"
        return {name: [(_name(r), classes[_name(r)], math.log(float(r["predicted_seconds"]) / _median(r)))
                       for r in sitting["results"] if r.get("predicted_seconds")]}
    comp = _compare(list(profiles), measurements(sitting), argparse.Namespace(gpus=gpus, vocab_size=None))
    return {p: [(row["config"], classes.get(row["config"], "one process"),
                 math.log1p(row["predicted"][p]["error"])) for row in comp["rows"]] for p in profiles}


def class_errors(sittings: list, profiles=(), gpus: int = 2, classify=layout_class) -> dict:
    """Per sitting and profile: the level and each class's error around it; per class: on which
    side of the level it fell, over every sitting and profile. ``classify``: a launch's class
    from its layout (CLASSIFY)."""
    cells = []
    for i, s in enumerate(sittings):
        for profile, errs in _errors(s, profiles, gpus, classify).items():
            if not errs:
                continue
            level = statistics.fmean(e for _, _, e in errs)
            by = {}
            for _, cls, e in errs:
                by.setdefault(cls, []).append(e)
            cells.append({"sitting": i, "profile": profile, "level": math.expm1(level), "launches": len(errs),
                          "classes": {c: {"error": math.expm1(statistics.fmean(v) - level), "launches": len(v)}
                                      for c, v in sorted(by.items())}})
    summary = {}
    for cls in sorted({c for cell in cells for c in cell["classes"]}):
        xs = [cell["classes"][cls]["error"] for cell in cells if cls in cell["classes"]]
        # the profiles of one sitting share its launches: the sittings are what is independent,
        # so the sign is judged per sitting (its profiles' mean), over at least three of them
        per_sitting = [statistics.fmean(cell["classes"][cls]["error"] for cell in cells
                                        if cell["sitting"] == i and cls in cell["classes"])
                       for i in sorted({cell["sitting"] for cell in cells if cls in cell["classes"]})]
        signs = {x > 0 for x in per_sitting if x != 0}
        summary[cls] = {"cells": len(xs), "under": sum(x < 0 for x in xs), "over": sum(x > 0 for x in xs),
                        "mean": statistics.fmean(xs), "sittings": per_sitting,
                        "one_signed": len(per_sitting) >= 3 and len(signs) == 1
                        and all(x != 0 for x in per_sitting)}
    return {"cells": cells, "classes": summary}


def sync_excess(sittings: list) -> dict:
    """Per data-parallel launch on one stage, (measured - predicted gradient sync) / measured
    forward + backward, from each file's own stage components; their median and quartiles over
    every sitting, and each sitting's median."""
    per = []
    for s in sittings:
        shares = []
        for r in s["results"]:
            stages = r.get("stages") or []
            if layout_class(r.get("layout") or {}) != CLASSES[2] or len(stages) != 1:
                continue
            st = stages[0]
            work = float(st.get("forward_measured") or 0) + float(st.get("backward_measured") or 0)
            if work > 0 and st.get("grad_sync_measured") is not None:
                shares.append((float(st["grad_sync_measured"]) - float(st.get("grad_sync_predicted") or 0)) / work)
        per.append(shares)
    every = sorted(x for shares in per for x in shares)
    if len(every) < 2:
        return {"launches": len(every)}
    q1, med, q3 = statistics.quantiles(every, n=4, method="inclusive")
    return {"launches": len(every), "median": med, "quartiles": [q1, q3],
            "sittings": [statistics.median(x) if x else None for x in per]}


def render(files, sp: dict, ce: dict, ex: dict) -> None:
    print(f"{len(files)} sittings: " + ", ".join(files))
    print("\nthe same launch's measured median iteration in each sitting (s), and their spread:")
    for r in sp["rows"]:
        meds = "  ".join(f"{m:7.3f}" if m else "      -" for m in r["medians"])
        print(f"  {r['config']:<52} {meds}   {100 * r['spread']:5.1f}%")
    if sp["rows"]:
        print(f"  median spread {100 * sp['median_spread']:.1f}%, worst {100 * sp['worst']['spread']:.1f}% "
              f"({sp['worst']['config']}); {sp['within_bar']} of {len(sp['rows'])} configs reproduce "
              f"within {100 * BAR:.0f}%")
    print("\neach sitting's level (mean error of its launches) and each class's error around it:")
    for cell in ce["cells"]:
        cls = ", ".join(f"{c} {100 * v['error']:+.1f}% ({v['launches']})" for c, v in cell["classes"].items())
        print(f"  sitting {cell['sitting'] + 1}, {cell['profile']}: level {100 * cell['level']:+.1f}%; {cls}")
    print("\nover every sitting and profile:")
    for cls, s in ce["classes"].items():
        note = "  one-signed: a missing term, not noise" if s["one_signed"] else ""
        by = ", ".join(f"{100 * x:+.1f}%" for x in s["sittings"])
        print(f"  {cls:<28} under its level in {s['under']} of {s['cells']}, over in {s['over']}, "
              f"mean {100 * s['mean']:+.1f}%; per sitting {by}{note}")
    if "median" in ex:
        by = ", ".join("-" if x is None else f"{100 * x:+.1f}%" for x in ex["sittings"])
        print(f"\ndata-parallel launches' gradient sync beyond each sitting's own price of it, over their "
              f"forward + backward: median {100 * ex['median']:+.1f}% (quartiles {100 * ex['quartiles'][0]:+.1f}% "
              f"to {100 * ex['quartiles'][1]:+.1f}%, {ex['launches']} launches); per sitting {by}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="validate_local.py --json outputs, one per sitting")
    ap.add_argument("--cluster", help="predict every sitting again with this profile")
    ap.add_argument("--compare", nargs="+", default=[], metavar="CLUSTER", help="and with these")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--by", choices=sorted(CLASSIFY), default="layout",
                    help="the classes: the layout's parallelism (default), or its attention kind")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.compare and not args.cluster:
        ap.error("--compare needs --cluster")
    try:
        sittings = [_read(f) for f in args.files]
    except NotASitting as exc:
        print(exc, file=sys.stderr)
        return 1
    profiles = [args.cluster, *args.compare] if args.cluster else []
    sp, ex = spread(sittings), sync_excess(sittings)
    ce = class_errors(sittings, profiles, args.gpus, CLASSIFY[args.by])
    if args.json:
        sys.stdout.write(json.dumps({"schema": 1, "sittings": list(args.files), "spread": sp,
                                     "class_errors": ce, "sync_excess": ex}, indent=1) + "\n")
    else:
        render(args.files, sp, ce, ex)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
