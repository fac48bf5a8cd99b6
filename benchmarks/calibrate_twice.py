"""Two calibrations of one machine, the same layouts predicted with each: do they agree?

    python benchmarks/calibrate_twice.py --run DIR          # calibrate --quick twice (fresh
                                                             # stores under DIR), then compare
    python benchmarks/calibrate_twice.py PROFILE_A PROFILE_B # compare two existing profiles

Each layout of benchmarks/validation/ is predicted (2 processes, as validate_local.py launches
them) with profile A and profile B; the table gives their disagreement, B over A. Then, per
layout, which part of the profile the disagreement comes from: A with one part of B's swapped
in -- the operator regressors, the collective regressors, each engine term (the layer residuals,
the optimizer and gradient terms, the tensor-parallel all-reduce, ZeRO's collectives), the step
terms -- and the prediction's move. The parts' moves need not add up (they interact); the one
that moves most is where the calibration is not reproducible.

The two calibrations must each be taken on a quiet machine (nothing else running): what is
compared is the calibration's own repeatability, not the machine's load. `--run` checks the
load average before each and says so when it is not quiet.

A quiet machine can still change speed between the two (a VM on a shared host: the same fixed
reference loop 0.92 ms at one calibration's start and 0.74 at the next's, 2026-12-05). Each
calibration times that reference at its start (calibration/disturbance.Probe; the profile keeps
it), so the disagreement is also given with the ratio of the two references taken out
(`at_reference_speed`). Whether that is the calibrations' speed is what the line tests: one
reading, at the operator step's start, after the engine step. On 2026-12-05 it took one pair from
18.5% apart to 6.1%, and another from 13.4% to 40.8% (docs/validation.md, sitting 13). A profile
fitted at one speed (neox_perf/profile/one_speed.py) describes the machine at its operator step's
median reading instead, and that is the reference compared (benchmarks/one_speed.py refits a pair
so).

The reference is a GEMM and an add; it has not tracked the layouts' own speed on the AMD VM
(docs/validation.md, sittings 14-15). So `--run` also times the work itself: three witness
layouts (WITNESSES, launched as `validate` launches them) before the first calibration, between
the two and after the second. Each calibration's machine is the mean of the launches on either
side of it; `at_witness_speed` is the disagreement with the ratio of those two taken out, and
`beside` each profile's error on the launches around it, and `drift` how far the launches
moved across each calibration. Where the launches held, the plain disagreement is the
calibration's own. Where they moved, the witnesses say by how much, not how much of it a
calibration took in: on 2026-12-07 they slowed 6% across each of two calibrations that came out
2.7% apart, and taking the whole move out left them 3.5% apart (docs/validation.md, sittings
16-17).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from validate_local import CONFIGS, _vocab  # noqa: E402  (the same layouts and vocabularies)

BAR = 0.03  # the bar: two quiet calibrations agree within 3% per layout
# one layout of each kind the pair disagreed on (data-parallel, tensor-parallel, pipelined), each
# about 2 s an iteration here: three launches take about two minutes
WITNESSES = ("pp1-dp2-layernorm.yml", "pp1-mp2-rmsnorm-recompute.yml", "pp2-rmsnorm-flash-recompute.yml")
WITNESS_ITERS = 8


def calibrate(out_dir: Path, name: str) -> Path:
    """`neox-perf calibrate --quick` into a fresh store; returns the profile directory."""
    store, prof = out_dir / f"{name}.sqlite", out_dir / f"profile-{name}"
    load = os.getloadavg()[0]
    print(f"calibrating {name} (load average {load:.2f})", flush=True)
    started = time.monotonic()
    with open(out_dir / f"{name}.json", "w") as fh:
        rc = subprocess.call([sys.executable, "-m", "neox_perf", "calibrate", "--cluster", name,
                              "--quick", "--store", str(store), "--out", str(prof), "--json"],
                             stdout=fh)
    if rc != 0:
        raise SystemExit(f"calibrate {name} failed (exit {rc}); see {out_dir / (name + '.json')}")
    print(f"  {time.monotonic() - started:.0f} s", flush=True)
    return prof


def witness(out_dir: Path, label: str, gpus: int, iters: int = WITNESS_ITERS) -> Dict[str, float]:
    """Each witness layout trained now, for real (validate's launch, no profile needed): its
    median iteration in seconds, by config name; kept as ``DIR/witness-LABEL.json``."""
    from neox_perf.commands.validate import WARMUP_ITERATIONS, run_workload

    out = {}
    print(f"witness launches {label} (load average {os.getloadavg()[0]:.2f})", flush=True)
    for name in WITNESSES:
        cfg = HERE / "validation" / name
        # WITNESSES name no tokenizer: _vocab gives the raw vocabulary validate_local trains at
        run = run_workload([str(cfg)], gpus, WARMUP_ITERATIONS + iters, _vocab(cfg, None),
                           out_dir / f"witness-{label}-{cfg.stem}")
        out[name] = statistics.median(run["seconds_per_iter"][WARMUP_ITERATIONS:])
    (out_dir / f"witness-{label}.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def read_witnesses(out_dir: Path) -> List[Dict[str, float]]:
    """The launches before, between and after (``witness-0/1/2.json``); [] when absent."""
    paths = [out_dir / f"witness-{i}.json" for i in range(3)]
    return [json.loads(p.read_text()) for p in paths] if all(p.is_file() for p in paths) else []


def at_witness_speed(result: dict, launches: List[Dict[str, float]]) -> dict:
    """The pair's disagreement with the machine's own move taken out. Calibration A ran between
    launches 0 and 1, B between 1 and 2; each one's machine is the geometric mean of the launches
    on either side (per layout), and B ran at ``b_speed_over_a`` A's speed (above 1: faster),
    the geometric mean over the witness layouts. ``drift`` is each calibration's after over
    before (a speed that moved during one makes its mean a guess), ``beside`` each profile's
    error on the witness layouts against the launches around it."""
    before, between, after = launches
    names = [n for n in before if n in between and n in after]
    if not names:
        raise ValueError("the witness launches share no layout")
    at_a = {n: math.sqrt(before[n] * between[n]) for n in names}
    at_b = {n: math.sqrt(between[n] * after[n]) for n in names}
    speed = statistics.geometric_mean([at_a[n] / at_b[n] for n in names])
    rows = result["rows"]
    at = [(1 + r["disagreement"]) * speed - 1.0 for r in rows]
    predicted = {r["config"]: (r["a_seconds"], r["b_seconds"]) for r in rows}
    beside = {n: {"a": predicted[n][0] / at_a[n] - 1.0, "b": predicted[n][1] / at_b[n] - 1.0}
              for n in names if n in predicted}
    return {"b_speed_over_a": speed,
            "drift": {"a": statistics.geometric_mean([between[n] / before[n] for n in names]),
                      "b": statistics.geometric_mean([after[n] / between[n] for n in names])},
            "launches": launches, "beside": beside, **_agreement(at, rows)}


def _load(path_or_name: str):
    from neox_perf.prediction.predict import load_cluster
    return load_cluster(path_or_name)


def parts(a, b, detail: bool = False) -> Dict[str, object]:
    """Profile a with each part of b swapped in, by name. Reaches into the sampled profile's
    model tables: a benchmark's dissection, not an API."""
    from neox_perf.prediction.corrections.engine import ARRIVAL
    out = {}

    def fresh(manifest=None):
        p = copy.copy(a)
        p._cache = {}
        if manifest is not None:
            p.manifest = manifest
        return p

    p = fresh()
    p._ops, p._curves = b._ops, b._curves
    out["operators"] = p
    if detail:  # each operator model alone
        for key in sorted(set(a._ops) & set(b._ops)):
            p = fresh()
            p._ops = {**a._ops, key: b._ops[key]}
            p._curves = {k: v for k, v in a._curves.items() if k != key}
            if key in b._curves:
                p._curves[key] = b._curves[key]
            out[f"operator {key[0]}/{key[1]}"] = p
    p = fresh()
    p._colls = b._colls
    out["collectives"] = p
    ea, eb = a.manifest.engine, b.manifest.engine
    if ea is not None and eb is not None:
        arrival = {ARRIVAL} if ea.arrival is not None or eb.arrival is not None else set()
        names = sorted(set(ea.residuals) | set(ea.linears) | set(ea.curves)
                       | set(eb.residuals) | set(eb.linears) | set(eb.curves) | arrival)
        for n in names:
            out[f"engine {n}"] = fresh(dataclasses.replace(a.manifest, engine=ea.with_terms_of(eb, n)))
    if a.manifest.step_terms != b.manifest.step_terms:
        out["step terms"] = fresh(dataclasses.replace(a.manifest, step_terms=b.manifest.step_terms))
    return out


def compare(a, b, configs: List[Path], gpus: int, detail: bool = False) -> dict:
    from neox_perf.commands.validate import predict

    swapped = parts(a, b, detail)
    rows = []
    for cfg in configs:
        vocab = _vocab(cfg, None)

        def seconds(profile) -> float:
            return predict([str(cfg)], gpus, profile, vocab, "cpu").estimate.iteration_seconds

        sa, sb = seconds(a), seconds(b)
        moves = {name: seconds(p) / sa - 1.0 for name, p in swapped.items()}
        top = sorted(moves.items(), key=lambda kv: -abs(kv[1]))
        rows.append({"config": cfg.name, "a_seconds": sa, "b_seconds": sb,
                     "disagreement": sb / sa - 1.0, "parts": dict(top)})
    out = {"a": str(a.path), "b": str(b.path), "gpus": gpus, "rows": rows,
           **_agreement([r["disagreement"] for r in rows], rows)}
    # B's machine ran at (A's reference cost / B's) of A's speed at their starts: B's
    # predictions at A's speed are B's times that
    from neox_perf.commands.validate import machine_speed
    from neox_perf.profile.disturbance import reference
    ref_b = reference(b)
    speed = machine_speed(a, ref_b.seconds_per_loop) if ref_b else None
    if speed:
        at = [(1 + r["disagreement"]) * speed - 1.0 for r in rows]
        out["at_reference_speed"] = {"b_speed_over_a": speed, **_agreement(at, rows)}
    return out


def _agreement(disagreements: List[float], rows: List[dict]) -> dict:
    worst = max(range(len(rows)), key=lambda i: abs(disagreements[i]))
    return {"mean_abs_disagreement": sum(map(abs, disagreements)) / len(rows),
            "worst": {"config": rows[worst]["config"], "disagreement": disagreements[worst]},
            "within_bar": sum(abs(d) <= BAR for d in disagreements), "bar": BAR}


def render(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=170)
    table = Table(title=f"A: {result['a']}\nB: {result['b']}\nthe same layouts, predicted with "
                        f"each ({result['gpus']} processes); parts: A with that part of B",
                  title_justify="left")
    for col in ("config", "A s", "B s", "B/A", "largest moves (A with B's part)"):
        table.add_column(col, justify="left" if col in ("config",) or col.startswith("largest") else "right")
    for r in result["rows"]:
        moves = ", ".join(f"{n} {100 * v:+.1f}%" for n, v in list(r["parts"].items())[:3])
        table.add_row(r["config"], f"{r['a_seconds']:.4f}", f"{r['b_seconds']:.4f}",
                      f"{100 * r['disagreement']:+.1f}%", moves)
    console.print(table)
    console.print(f"mean |B/A - 1| {100 * result['mean_abs_disagreement']:.2f}%, worst "
                  f"{100 * result['worst']['disagreement']:+.1f}% ({result['worst']['config']}); "
                  f"{result['within_bar']} of {len(result['rows'])} layouts within "
                  f"{100 * result['bar']:.0f}%")
    wit = result.get("at_witness_speed")
    if wit:
        drift = wit["drift"]
        console.print(f"the witness layouts ran x{wit['b_speed_over_a']:.3f} as fast beside B as beside A "
                      f"(each calibration's launches after over before: A x{drift['a']:.3f}, B "
                      f"x{drift['b']:.3f} in time); at their speed: mean |B/A - 1| "
                      f"{100 * wit['mean_abs_disagreement']:.2f}%, worst "
                      f"{100 * wit['worst']['disagreement']:+.1f}% ({wit['worst']['config']}); "
                      f"{wit['within_bar']} of {len(result['rows'])} within {100 * wit['bar']:.0f}%")
        console.print("each profile against the launches beside it: " + "; ".join(
            f"{n} A {100 * e['a']:+.1f}% B {100 * e['b']:+.1f}%" for n, e in wit["beside"].items()))
    at = result.get("at_reference_speed")
    if at:
        console.print(f"B's calibration started with the machine at x{at['b_speed_over_a']:.3f} A's speed "
                      f"(their reference loops); at one speed: mean |B/A - 1| "
                      f"{100 * at['mean_abs_disagreement']:.2f}%, worst {100 * at['worst']['disagreement']:+.1f}% "
                      f"({at['worst']['config']}); {at['within_bar']} of {len(result['rows'])} within "
                      f"{100 * at['bar']:.0f}%")
    totals: Dict[str, float] = {}
    for r in result["rows"]:
        for n, v in r["parts"].items():
            totals[n] = totals.get(n, 0.0) + abs(v) / len(result["rows"])
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    console.print("mean |move| per part: " + ", ".join(f"{n} {100 * v:.2f}%" for n, v in ranked[:8]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="*", help="two profiles (names or directories)")
    ap.add_argument("--run", metavar="DIR", help="calibrate --quick twice into DIR, then compare")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--operators", action="store_true",
                    help="also swap each operator's model alone (which regressor moves)")
    ap.add_argument("--no-witness", action="store_true",
                    help="--run without the witness launches around the calibrations")
    ap.add_argument("--witnesses", metavar="DIR",
                    help="with two profiles: the witness-0/1/2.json a --run wrote in DIR")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    launches: List[Dict[str, float]] = []
    if args.run:
        out = Path(args.run)
        if out.exists() and any(out.iterdir()):
            ap.error(f"{out}: not empty; --run wants a fresh directory (a resumed store is not a "
                     f"second calibration)")
        out.mkdir(parents=True, exist_ok=True)
        witnessed = not args.no_witness
        launches += [witness(out, "0", args.gpus)] if witnessed else []
        paths = [str(calibrate(out, "first"))]
        launches += [witness(out, "1", args.gpus)] if witnessed else []
        paths.append(str(calibrate(out, "second")))
        launches += [witness(out, "2", args.gpus)] if witnessed else []
    elif len(args.profiles) == 2:
        paths = args.profiles
        launches = read_witnesses(Path(args.witnesses)) if args.witnesses else []
        if args.witnesses and not launches:
            ap.error(f"{args.witnesses}: no witness-0.json, witness-1.json and witness-2.json there")
    else:
        ap.error("give two profiles, or --run DIR")
    result = compare(_load(paths[0]), _load(paths[1]), CONFIGS, args.gpus, args.operators)
    if launches:
        result["at_witness_speed"] = at_witness_speed(result, launches)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
    else:
        render(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
