"""Two calibrations fitted again at one speed: do they agree once every step's times are brought
to the speed their operators were timed at?

    python benchmarks/one_speed.py DIR [--json]   # DIR from calibrate_twice.py --run

Each store in DIR (first.sqlite, second.sqlite, with their engine and tensor-parallel files) is
fitted again by this checkout three times, into DIR/refit-NAME-KIND: as timed, and with its
operator samples and engine repeats brought to the operator step's median speed
(neox_perf/profile/one_speed.py) by the reading beside each ("reading") or by the median of
each step's readings ("step": the operators then stay as timed, each engine pass moves). Each pair is then compared as calibrate_twice.py compares
two profiles: their disagreement per layout, plain and with the two start readings' ratio
taken out (`at_reference_speed`: each profile describes the machine at one speed -- its start,
as timed; its operator step's median, at one speed -- so that ratio is all that should be left
between them).

Also printed per calibration: what the readings saw, against its start (median and range of
the operator step's and of the engine step's readings), so the disagreement can be read beside
how far each step's machine was from the speed the profile is fitted at; and whether a reading
foretells the times beside it: over the points and shapes timed in two sweeps, the correlation
of log(reading in sweep 2 / in sweep 1) with log(time in sweep 2 / in sweep 1) (the fastest
run of an operator point; the median repeat of an engine shape's phases), and the spread of the
time's log ratio before and after dividing by the reading's.

Takes a few minutes (six fits); the stores must hold the readings (calibrations from stop 58
on); one without them is fitted as timed both ways, and the line says so.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from calibrate_twice import _load, compare  # noqa: E402
from validate_local import CONFIGS  # noqa: E402

NAMES = ("first", "second")


KINDS = {"as-timed": None, "reading": "reading", "step": "step"}


def refit(store: Path, out: Path, name: str, one_speed, processes: int) -> Path:
    """The profile of ``store`` fitted again into ``out``, as `calibrate` fits it."""
    from neox_perf.calibration.engine import engine_path
    from neox_perf.calibration.tp_allreduce import tp_path
    from neox_perf.predictors.fitting.calibrated import fit_store
    from neox_perf.predictors.fitting.engine_fit import add_engine
    fit_store(store, name, out, gpus_per_node=processes, one_speed=one_speed)
    if engine_path(store).is_file():
        add_engine(out, engine_path(store), tp_path(store))
    return out


def readings(store: Path, profile) -> Dict[str, object]:
    """The readings each step stood beside, as the nominal's multiple (above 1: slower)."""
    from neox_perf.calibration.engine import engine_path
    from neox_perf.calibration.store import SampleStore
    from neox_perf.profile.disturbance import reference
    ref = reference(profile)
    if ref is None:
        return {}
    with SampleStore(store) as s:
        ops = [spl for sample in s.samples(source="calibrate")
               for spl, _ in (sample.info.get("speeds") or ())]
    engine: List[float] = []
    if engine_path(store).is_file():
        data = json.loads(engine_path(store).read_text())
        engine = [spl for section in ("shapes", "zero", "tp")
                  for row in (data.get(section) or {}).values() for spl in row.get("speeds") or ()]

    def spread(xs: List[float]) -> Optional[Dict[str, float]]:
        if not xs:
            return None
        rel = [x / ref.seconds_per_loop for x in xs]
        return {"median": statistics.median(rel), "min": min(rel), "max": max(rel), "n": len(rel)}
    return {"nominal_seconds_per_loop": ref.seconds_per_loop, "operators": spread(ops),
            "engine": spread(engine)}


def _correlation(pairs: List[tuple]) -> Optional[Dict[str, float]]:
    """pairs of (log reading ratio, log time ratio): their correlation, the time's spread, and
    its spread with the reading's ratio taken out."""
    if len(pairs) < 3:
        return None
    xs, ys = zip(*pairs)
    mx, my = statistics.mean(xs), statistics.mean(ys)
    vx = sum((x - mx) ** 2 for x in xs)
    vy = sum((y - my) ** 2 for y in ys)
    cov = sum((x - mx) * (y - my) for x, y in pairs)
    return {"n": len(pairs), "correlation": cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else float("nan"),
            "spread": statistics.pstdev(ys), "spread_scaled": statistics.pstdev([y - x for x, y in pairs])}


def foretells(store: Path) -> Dict[str, object]:
    """Per step, whether the sweep-to-sweep change of the reading foretells the time's."""
    from neox_perf.calibration.engine import _SWEEP_PHASES, engine_path
    from neox_perf.calibration.store import SampleStore
    out: Dict[str, object] = {}
    with SampleStore(store) as s:
        pairs = []
        for sample in s.samples(source="calibrate"):
            speeds, times = sample.info.get("speeds") or (), sample.info.get("times") or ()
            if len(speeds) == 2 and speeds[0][1] + speeds[1][1] == len(times):
                n = speeds[0][1]
                pairs.append((math.log(speeds[1][0] / speeds[0][0]), math.log(min(times[n:]) / min(times[:n]))))
        out["operators"] = _correlation(pairs)
    if engine_path(store).is_file():
        data = json.loads(engine_path(store).read_text())
        for section, phases in _SWEEP_PHASES.items():
            pairs = []
            for row in (data.get(section) or {}).values():
                speeds, reps = row.get("speeds") or (), row.get("repeats") or ()
                if len(speeds) == 2 and reps and len(reps) % 2 == 0:
                    n = len(reps) // 2
                    tot = [sum(float(r[k]) for k in phases) for r in reps]
                    pairs.append((math.log(speeds[1] / speeds[0]),
                                  math.log(statistics.median(tot[n:]) / statistics.median(tot[:n]))))
            out[f"engine {section}"] = _correlation(pairs)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="a calibrate_twice.py --run directory")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    d = Path(args.dir)
    out: Dict[str, object] = {"dir": str(d), "readings": {}, "pairs": {}}
    fitted: Dict[str, List[Path]] = {kind: [] for kind in KINDS}
    for name in NAMES:
        store = d / f"{name}.sqlite"
        if not store.is_file():
            raise SystemExit(f"{store}: not found; give a calibrate_twice.py --run directory")
        for kind in fitted:
            target = d / f"refit-{name}-{kind}"
            print(f"fitting {name} {kind} -> {target}", file=sys.stderr, flush=True)
            fitted[kind].append(refit(store, target, name, KINDS[kind], args.gpus))
        out["readings"][name] = readings(store, _load(str(fitted["as-timed"][-1])))
        out["readings"][name]["foretells"] = foretells(store)
    for kind, (a, b) in fitted.items():
        result = compare(_load(str(a)), _load(str(b)), CONFIGS, args.gpus)
        out["pairs"][kind] = {k: result[k] for k in ("mean_abs_disagreement", "worst", "within_bar")}
        out["pairs"][kind]["at_reference_speed"] = result.get("at_reference_speed")
        out["pairs"][kind]["rows"] = [{k: r[k] for k in ("config", "disagreement")} for r in result["rows"]]
    if args.json:
        sys.stdout.write(json.dumps(out, indent=1) + "\n")
        return 0
    for name, r in out["readings"].items():
        parts = [f"{step} x{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}, {s['n']} readings)"
                 for step in ("operators", "engine") if (s := r.get(step))]
        print(f"{name}: the reference's cost beside each step over its start's: "
              + ("; ".join(parts) if parts else "no readings stored (fitted as timed both ways)"))
        for step, c in (r.get("foretells") or {}).items():
            if c:
                print(f"  {step}: sweep 2 over sweep 1, reading vs time: correlation {c['correlation']:+.2f} "
                      f"over {c['n']}; the time's spread {100 * c['spread']:.1f}%, over the reading's "
                      f"{100 * c['spread_scaled']:.1f}%")
    for kind, p in out["pairs"].items():
        line = (f"{kind}: mean |B/A - 1| {100 * p['mean_abs_disagreement']:.2f}%, worst "
                f"{100 * p['worst']['disagreement']:+.1f}% ({p['worst']['config']}), "
                f"{p['within_bar']} of {len(p['rows'])} within 3%")
        at = p.get("at_reference_speed")
        if at:
            line += (f"; at one speed (B's profile at x{at['b_speed_over_a']:.3f} A's): "
                     f"{100 * at['mean_abs_disagreement']:.2f}%, worst {100 * at['worst']['disagreement']:+.1f}%, "
                     f"{at['within_bar']} within 3%")
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
