"""Predicted vs measured iteration time of the reference workload on this machine.

Runs `neox-perf validate` (its command function) on every config of benchmarks/validation/
with 2 processes: each config is trained for real under DeepSpeed (CPU + gloo here, CUDA +
nccl on a GPU node), timed per iteration (warm-up dropped; the median over the measured
iterations, the typical iteration a prediction is for, the fastest beside it) and predicted
with the calibrated profile. Prints the table per config and per
component and the mean absolute percentage error, and the machine's load average before and
after (other jobs on a 2-core box slow whole launches: --repeat keeps each config's launch
with the lowest median).

    neox-perf calibrate --cluster local --quick      # once: the profile to check
    python benchmarks/validate_local.py [--cluster local] [--iters 8] [--json] [CONFIG ...]

A shared 2-core box drifts by 10-30% between launches minutes apart, so two profiles are
compared on one set of measurements, never on two runs: `--compare NAME...` predicts the same
measured launches with more profiles, and `--measured FILE` re-predicts a saved `--json`
output without launching anything (e.g. `--cluster local --compare local-for`).

The machine's speed moves too (the same reference loop 0.73-0.92 ms within one hour here):
`validate` times the calibration's own fixed reference before and after each launch
(commands/validate.py), and each profile's prediction is also given scaled by the reference's
cost at the speed the profile describes (its calibration's start; for a profile fitted at one
speed, that speed: neox_perf/profile/one_speed.py) over its cost at the launch (`machine_speed`,
above 1 when the machine ran faster): `error_at_machine_speed` is what the profile predicts
for the machine at the speed the launch found it, beside its plain error.

None of these configs shaped the quick sampling plan or the model: they were written for
this check (sizes between the plan's grid points: d 384/640/768, l 384, vocab 16000).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = sorted((HERE / "validation").glob("*.yml"))
VOCAB = 16000  # raw tokenizer size passed to the workload (padded to 16000 by NeoX's rule)


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _vocab(config: Path, given):
    """The layouts written for this check without a tokenizer train at VOCAB; the NeoX-shaped
    ones name theirs (GPT-2, Pythia, LLaMA, tiktoken) and train at its real size."""
    if given is not None:
        return given
    from neox_perf.config import load_files
    values = load_files([str(config)]).values
    return None if ("tokenizer_type" in values or "vocab_file" in values) else VOCAB


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", help="default: every benchmarks/validation/*.yml")
    ap.add_argument("--cluster", default="local")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--iters", type=int, default=8, help="measured iterations per config (after 2 warm-up)")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help=f"raw vocabulary (default: the config's tokenizer when it names one, "
                         f"else {VOCAB})")
    ap.add_argument("--repeat", type=int, default=1,
                    help="launch each config this many times, rounds interleaved, and keep the "
                         "launch with the lowest median iteration (other jobs on the box slow "
                         "whole launches, not single iterations)")
    ap.add_argument("--compare", nargs="+", default=[], metavar="CLUSTER",
                    help="more profiles predicted against the same measured launches")
    ap.add_argument("--measured", metavar="FILE",
                    help="a previous --json output: re-predict its measurements, launch nothing")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    configs = [Path(c) for c in args.configs] or CONFIGS
    if args.measured:
        return _repredict(args, configs)

    from neox_perf.prediction.predict import load_cluster
    from neox_perf.commands.validate import ValidateResult, validate_one
    from neox_perf.render.progress import bars, wanted

    profile = load_cluster(args.cluster)
    result = ValidateResult(cluster=profile.name, gpus=args.gpus)
    load_before, started = _load(), time.monotonic()
    runs = {i: [] for i in range(len(configs))}
    with bars(wanted(args.json)) as progress:
        for round_ in range(args.repeat):
            for i, cfg in enumerate(configs):
                step = None
                if progress is not None:
                    def step(done, total, label, i=i, r=round_):
                        progress(f"{r + 1}.{i + 1}/{len(configs)}", done, total, label)
                runs[i].append(validate_one([str(cfg)], args.gpus, profile, args.iters,
                                            _vocab(cfg, args.vocab_size), step))
    for i in range(len(configs)):
        best = min(runs[i], key=lambda r: r.measured_median_seconds)
        if args.repeat > 1:
            times = ", ".join(f"{r.measured_median_seconds:.3f}" for r in runs[i])
            best.notes.insert(0, f"lowest median of {args.repeat} launches (medians {times} s)")
        result.results.append(best)
    elapsed = time.monotonic() - started
    measured = [(Path(r.config[-1]), r.measured_median_seconds, r.measured_seconds,
                 r.reference_seconds_per_loop) for r in result.results]
    comparison = _compare([args.cluster, *args.compare], measured, args) if args.compare else None
    if args.json:
        from neox_perf.render.envelope import dump, envelope
        out = envelope(result.command, result.exit_code, result.to_dict())
        out.update(load_average_before=load_before, load_average_after=_load(), seconds=elapsed)
        if comparison is not None:
            out["comparison"] = comparison
        sys.stdout.write(dump(out) + "\n")
        return 0
    from rich.console import Console

    from neox_perf.render.validate_text import render
    render(result, Console(highlight=False, width=160))
    print(f"load average (1, 5, 15 min) before: {load_before}; after: {_load()}; "
          f"{elapsed:.0f} s for {len(configs)} configs")
    if comparison is not None:
        _print_comparison(comparison)
    return 0


def _summary(errors, rows) -> dict:
    worst = max(range(len(errors)), key=lambda i: abs(errors[i]))
    return {"mape": 100 * sum(map(abs, errors)) / len(errors),
            "mean_signed": 100 * sum(errors) / len(errors),
            "worst": {"config": rows[worst]["config"], "error": 100 * errors[worst]}}


def _compare(clusters, measured, args) -> dict:
    """Every profile's prediction of the same measured launches, against each launch's median
    iteration (the typical one, which predictions are for; the fastest beside it): per config
    and in summary (mean absolute and mean signed error, worst row). Where the launches carry
    the reference's cost now and the profile its calibration's, also at the machine's speed
    now: the prediction times (reference now / reference at calibration)."""
    from neox_perf.commands.validate import predict
    from neox_perf.profile.disturbance import reference
    from neox_perf.prediction.predict import load_cluster
    from neox_perf.calibration.launch import cuda_available

    device = "cuda" if cuda_available() else "cpu"
    rows = [{"config": cfg.name, "measured_median_seconds": m, "measured_seconds": fastest,
             "reference_seconds_per_loop": now, "predicted": {}} for cfg, m, fastest, now in measured]
    summary = {}
    for name in clusters:
        profile = load_cluster(name)
        ref = reference(profile)  # the speed the profile describes, read from its manifest once
        errors, at_speed = [], []
        for row, (cfg, m, fastest, now) in zip(rows, measured):
            p = predict([str(cfg)], args.gpus, profile, _vocab(cfg, args.vocab_size), device)
            seconds = p.estimate.iteration_seconds
            row["predicted"][name] = cell = {"seconds": seconds, "error": seconds / m - 1.0,
                                             "error_fastest": seconds / fastest - 1.0}
            errors.append(cell["error"])
            speed = ref.speed_at(now) if ref else None  # > 1: faster than the profile's speed
            if speed:
                cell["machine_speed"] = speed
                cell["error_at_machine_speed"] = seconds / speed / m - 1.0
                at_speed.append(cell["error_at_machine_speed"])
        summary[name] = _summary(errors, rows)
        if at_speed and len(at_speed) == len(errors):
            speeds = [row["predicted"][name]["machine_speed"] for row in rows]
            summary[name]["at_machine_speed"] = at = _summary(at_speed, rows)
            at["machine_speed_median"] = statistics.median(speeds)
            # does the error follow the machine's speed? Plain, a launch that found the machine
            # slow is predicted short; scaled, nothing should be left of that
            if len(set(speeds)) > 2:
                logs = [math.log(v) for v in speeds]
                at["correlation_with_speed"] = {
                    k: statistics.correlation(logs, [math.log1p(e) for e in es])
                    for k, es in (("plain", errors), ("scaled", at_speed))}
    return {"clusters": list(clusters), "rows": rows, "summary": summary}


def _print_comparison(comparison: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    names = comparison["clusters"]
    table = Table(title="The same measured launches, predicted by each profile (error vs the "
                        "median iteration)",
                  title_justify="left")
    table.add_column("config")
    table.add_column("measured (median)", justify="right")
    for n in names:
        table.add_column(f"{n} s", justify="right")
        table.add_column("error", justify="right")
    for row in comparison["rows"]:
        cells = []
        for n in names:
            p = row["predicted"][n]
            cells += [f"{p['seconds']:.3f}", f"{100 * p['error']:+.1f}%"]
        table.add_row(row["config"], f"{row['measured_median_seconds']:.3f}", *cells)
    console = Console(highlight=False, width=160)
    console.print(table)
    for n in names:
        s = comparison["summary"][n]
        console.print(f"{n}: MAPE {s['mape']:.2f}%, mean signed {s['mean_signed']:+.2f}%, worst "
                      f"{s['worst']['error']:+.1f}% ({s['worst']['config']})")
        a = s.get("at_machine_speed")
        if a:
            console.print(f"  scaled to the machine's speed at each launch (x{a['machine_speed_median']:.3f} "
                          f"the speed its profile describes, median): MAPE {a['mape']:.2f}%, mean signed "
                          f"{a['mean_signed']:+.2f}%, worst {a['worst']['error']:+.1f}% ({a['worst']['config']})"
                          + ("" if "correlation_with_speed" not in a else
                             "; log error against log speed: correlation {plain:+.2f} plain, {scaled:+.2f} "
                             "scaled".format(**a["correlation_with_speed"])))


def measurements(data: dict) -> list:
    """(config path, measured median, measured fastest) per launch of a saved --json output;
    a config saved on another checkout is read by its file name here."""
    out = []
    for r in data["results"]:
        cfg = Path(r["config"][-1])
        if not cfg.is_file():
            cfg = HERE / "validation" / cfg.name
        out.append((cfg, r.get("measured_median_seconds", r["measured_seconds"]), r["measured_seconds"],
                    r.get("reference_seconds_per_loop")))
    return out


def _repredict(args, configs) -> int:
    """`--measured FILE`: the measurements of an earlier --json run, predicted again."""
    import json

    data = json.loads(Path(args.measured).read_text())
    wanted = {c.name for c in configs} if args.configs else None
    measured = [m for m in measurements(data) if wanted is None or m[0].name in wanted]
    comparison = _compare([args.cluster, *args.compare], measured, args)
    if args.json:
        sys.stdout.write(json.dumps({"measured_from": args.measured, "comparison": comparison},
                                    indent=1) + "\n")
    else:
        _print_comparison(comparison)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
