"""GPT-NeoX's own training program as the reference: predicted vs measured, mapped share,
loss identity, hook overhead and recalibration, on this machine.

    NEOX_PERF_NEOX_SRC=/path/to/gpt-neox NEOX_PERF_NEOX_PYTHON=/path/to/venv/bin/python \\
    OMP_NUM_THREADS=1 python benchmarks/neox_validate.py --cluster NAME [--layouts pp0,pp1]

Every layout of neox_perf.testing.neox_cpu.LAYOUTS trains with NeoX's unmodified deepy.py +
train.py under `neox-perf run --cluster NAME`; the table is that run's report (the hook's
prediction from the NeoX args every rank received, against the iterations it timed outside
its profiling windows). Then:
- loss identity: the first layout again without the hook, losses compared bit for bit;
- hook overhead outside windows: the first layout with the hook on and windows off against
  no hook, alternated A B B A, median train_step time (NeoX's own step, timed by the
  harness's wrapper identically in both) over the iterations after warm-up; and, since a
  shared box's steps wander by more than the hook costs, the hook's own accounting of the
  time it spends at iteration boundaries (rank summaries' `hook_self`) over that step;
- recalibration: `calibrate --from-run` on one layout's run (a copy of the profile and its
  store, so NAME is left untouched), then the iteration error on another layout's run
  before and after; `--recalibrate all` learns from each layout in turn and summarises the
  error on every other.
The machine is shared: the load average is printed next to every timing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from neox_perf.testing import neox_cpu  # noqa: E402

WINDOWS = "skip=3,warmup=1,active=2,every=100000,repeat=1"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def report_json(run_dir: str, cluster: str, env=None) -> dict:
    proc = subprocess.run([sys.executable, "-m", "neox_perf", "report", run_dir, "--cluster", cluster,
                           "--json"], capture_output=True, text=True, env=env)
    try:
        return json.loads(proc.stdout)
    except ValueError:
        raise SystemExit(f"neox-perf report {run_dir} failed: {proc.stderr.strip()[-400:]}")


def _err(rep: dict):
    """The iteration error against the typical (median) iteration, which predictions are for."""
    it = rep.get("iteration") or {}
    return it.get("error_median")


def layout_table(names, work: Path, cluster: str, iters: int) -> dict:
    runs = {}
    print(f"{'layout':7} {'what':50} {'pred s':>8} {'min s':>8} {'error':>7} {'median s':>8} "
          f"{'error':>7}  mapped share per rank   params NeoX/pred  load")
    for name in names:
        lay = neox_cpu.LAYOUTS[name]
        run = neox_cpu.run_layout(lay, str(work), hook_dir=str(work / "runs" / name),
                                  cluster=cluster, windows=WINDOWS, iters=iters)
        if not run.ok:
            print(f"{name:7} FAILED (exit {run.returncode}):\n{run.tail(15)}")
            continue
        rep = report_json(run.run_dir, cluster)
        runs[name] = (run, rep)
        it = rep["iteration"]
        share = " ".join(f"r{c['rank']}:{100 * c['fraction']:.1f}%" for c in rep["coverage"]
                         if c.get("fraction") is not None)
        pred, meas = it.get("predicted"), (it.get("measured") or {}).get("min")
        med = (it.get("measured") or {}).get("median")
        err, err_med = it.get("error_min"), _err(rep)
        from neox_perf.runs import prediction
        s0 = json.load(open(os.path.join(run.run_dir, "rank-00000.json")))
        _, derived, _ = prediction.rebuild(s0["config"], s0["facts"])
        nan = float("nan")
        print(f"{name:7} {lay.describe():50} {pred or nan:8.3f} {meas or nan:8.3f} "
              f"{100 * err if err is not None else nan:6.1f}% {med or nan:8.3f} "
              f"{100 * err_med if err_med is not None else nan:6.1f}%  {share:24} "
              f"{run.logged_params}/{derived.params.neox_logged}  {load()}")
    for label, key in (("median (the typical iteration)", "error_median"), ("min", "error_min")):
        errs = [abs(rep["iteration"][key]) for _, rep in runs.values()
                if rep["iteration"].get(key) is not None]
        if errs:
            print(f"iteration error against the measured {label}: mean |error| "
                  f"{100 * statistics.fmean(errs):.1f}%, max {100 * max(errs):.1f}% over "
                  f"{len(errs)} layouts")
    return runs


def loss_identity(name: str, work: Path, runs: dict, iters: int) -> None:
    hooked = runs.get(name, (None,))[0]
    if hooked is None:
        return
    plain = neox_cpu.run_layout(neox_cpu.LAYOUTS[name], str(work), iters=iters)
    same = plain.ok and hooked.loss_series() == plain.loss_series()
    print(f"loss with and without the hook ({name}, {len(plain.loss_series())} iterations, "
          f"float.hex per iteration): {'bit-identical' if same else 'DIFFERENT'}")
    if not same:
        print("  hooked:", hooked.loss_series()[:4], "\n  plain: ", plain.loss_series()[:4])


def overhead(name: str, work: Path, iters: int, pairs: int) -> None:
    """Median NeoX train_step time, hook on with windows off (B) against no hook (A)."""
    lay = neox_cpu.LAYOUTS[name]
    times = {"A": [], "B": []}
    own = []  # the hook's accounting of its own time per iteration (B runs, slowest rank)
    order = "ABBA" * pairs
    for i, which in enumerate(order):
        hook = str(work / "runs" / f"overhead-{i}") if which == "B" else None
        run = neox_cpu.run_layout(lay, str(work), hook_dir=hook, windows="off", iters=iters)
        if not run.ok:
            print(f"overhead run {which} failed:\n{run.tail(10)}")
            return
        steps = [max(vals) for vals in zip(*(run.step_seconds[r] for r in sorted(run.step_seconds)))]
        per_iter = statistics.median(steps[2:])
        times[which].append(per_iter)
        if hook:
            from neox_perf.runs.files import read_rank_summaries
            mine = [(s.get("hook_self") or {}).get("per_iteration_seconds")
                    for s in read_rank_summaries(hook)]
            if mine and None not in mine:
                own.append(max(mine) / per_iter)
    a, b = statistics.median(times["A"]), statistics.median(times["B"])
    print(f"hook overhead outside windows ({name}, {order}, median step of the slowest rank): "
          f"no hook {a * 1e3:.1f} ms, hook {b * 1e3:.1f} ms, {100 * (b / a - 1):+.2f}%  "
          f"(runs: A {[round(x * 1e3, 1) for x in times['A']]}, B {[round(x * 1e3, 1) for x in times['B']]}; "
          f"load {load()})")
    if own:
        print(f"hook's own time between windows (its accounting on the B runs, slowest rank): "
              f"{100 * max(own):.3f}% of the step at most ({', '.join(f'{100 * x:.3f}%' for x in own)})")


def _recalibrated_errors(src_name: str, names, runs: dict, cluster: str, work: Path):
    """`calibrate --from-run` on src_name's run, in a copy of the profile and its store (NAME is
    left untouched); the iteration error of every run in names after it, or None."""
    home = Path(os.environ.get("NEOX_PERF_HOME") or Path.home() / ".cache" / "neox-perf")
    copy = work / "recal-home"
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(home, copy)
    store = copy / "stores" / f"{cluster}.sqlite"
    env = dict(os.environ, NEOX_PERF_HOME=str(copy))
    cmd = [sys.executable, "-m", "neox_perf", "calibrate", "--cluster", cluster, "--from-run",
           runs[src_name][0].run_dir]
    if store.is_file():
        cmd += ["--store", str(store)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(f"calibrate --from-run {src_name} failed: {proc.stderr.strip()[-400:]}")
        return None
    return {n: _err(report_json(runs[n][0].run_dir, cluster, env)) for n in names}


def recalibrate(pairs, runs: dict, cluster: str, work: Path) -> None:
    """pairs: (learned from, held out) layouts. Each learned-from layout is recalibrated once;
    with several pairs the held-out errors are summarised (mean |error| before and after)."""
    pairs = [(a, b) for a, b in pairs if a in runs and b in runs]
    if not pairs:
        print("recalibration skipped: both layouts of a pair must have run")
        return
    names = sorted({n for pair in pairs for n in pair})
    before = {n: _err(runs[n][1]) for n in names}
    held = []
    for src in dict.fromkeys(a for a, _ in pairs):
        after = _recalibrated_errors(src, names, runs, cluster, work)
        if after is None:
            continue
        for n in [src] + [b for a, b in pairs if a == src]:
            b, a = before[n], after[n]
            role = "learned from" if n == src else "held out"
            print(f"recalibrated from {src}: {n} ({role}) iteration error "
                  f"{100 * b:+.1f}% -> {100 * a:+.1f}%" if None not in (a, b) else f"{n}: no error")
            if n != src and None not in (a, b):
                held.append((b, a))
    if len(held) > 1:
        better = sum(abs(a) < abs(b) for b, a in held)
        print(f"held-out runs: mean |error| {100 * statistics.fmean(abs(b) for b, _ in held):.1f}% -> "
              f"{100 * statistics.fmean(abs(a) for _, a in held):.1f}%, lower on {better} of {len(held)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", required=True, help="profile to predict with (calibrate --quick here)")
    p.add_argument("--layouts", default=",".join(neox_cpu.LAYOUTS))
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--work", default=None, help="work dir (default: a new one under /tmp)")
    p.add_argument("--overhead-pairs", type=int, default=1, help="ABBA blocks for the overhead")
    p.add_argument("--recalibrate", default="pp1:pp2",
                   help="LEARN:HELDOUT layouts, 'all' (each layout learned, every other held "
                        "out), or ''")
    p.add_argument("--skip", default="", help="comma list of: identity,overhead,recalibrate")
    args = p.parse_args(argv)
    try:
        neox_cpu.neox_src()
    except neox_cpu.NeoxUnavailable as exc:
        print(f"neox_validate: {exc}")
        return 2
    work = Path(args.work or f"/tmp/neox-perf-neox-validate-{int(time.time())}")
    work.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.layouts.split(",") if n]
    skip = set(args.skip.split(","))
    print(f"GPT-NeoX {neox_cpu.neox_src()} with {neox_cpu.neox_python()}; work {work}; load {load()}")
    runs = layout_table(names, work, args.cluster, args.iters)
    if "identity" not in skip:
        loss_identity(names[0], work, runs, args.iters)
    if "overhead" not in skip:
        overhead(names[0], work, args.iters, args.overhead_pairs)
    if args.recalibrate and "recalibrate" not in skip:
        if args.recalibrate == "all":
            pairs = [(a, b) for a in names for b in names if a != b]
        else:
            pairs = [tuple(args.recalibrate.split(":"))]
        recalibrate(pairs, runs, args.cluster, work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
