"""A calibration's measurements brought to one machine speed before the fit
(docs/calibration-disturbance.md, "One speed").

Why: on a VM the machine's own speed moves by a quarter within the hour with nothing else
running (the calibration's fixed reference loop 0.74-0.92 ms, docs/validation.md sittings
12-13). A calibration's steps meet it at different speeds -- the engine runs at one, the
operators at another -- and the engine terms, fitted as the engine's time minus the operators'
prediction, absorb the difference as if it were the engine's own cost. One reading at the
operator step's start (what `validate` scales by) does not describe the engine step before it.

What is done: the calibration's fixed reference (calibration/disturbance.Probe) is read beside
every timed piece -- the operator step's windows already read it; the engine step reads it
before each shape's sweep -- and stored with the times it stood beside. At the fit, times are
multiplied by nominal / speed, the nominal being the median reading of the operator step (the
speed the operators, the bulk of every prediction, were timed at; not its five start readings,
which one calibration of 2026-12-07 took 10-17% slower than every step after them), the speed
by one of two modes: "reading", each time's own reading; "step", the median of its step's
readings (the operator step -- its times then stay as timed -- and each engine pass), which
keeps a step's level and leaves its readings' scatter out. The profile then describes the
machine at that one speed (profile.disturbance.reference reads it back), and `validate` scales
it to the speed a launch finds. Only a CPU's measurements
carry readings (on a GPU a reading from the calibrating process would hold the device beside
its ranks); a measurement without one, or read in another dtype, is fitted as timed.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

MODES = ("reading", "step")
# The mode `calibrate` fits in: None, every time as timed. Decided before the second pair by
# its rule (docs/validation.md, sittings 14-15): "step" would become the default if it brought
# that pair closer as well. It took sitting 14's pair from 5.64% apart to 2.67% and sitting 15's
# from 7.66% to 9.83% (`python benchmarks/one_speed.py DIR`): the reference is not the speed of
# every step, so a fit stays as timed and the readings are kept for the benchmark.
MODE: Optional[str] = None

# A reading this far from the nominal is not the machine's speed but a disturbance the watch
# flags (calibration/disturbance.py): the factor is held inside it, so that one disturbed
# reading cannot move a sample by more than the machine's own range (0.74-0.92 ms, 1.25x).
MAX_FACTOR = 1.5


@dataclass(frozen=True)
class OneSpeed:
    """How a profile's times were brought to one speed (its manifest's training.one_speed)."""

    seconds_per_loop: float  # the nominal: the operator step's median reading
    mode: str  # MODES
    start_seconds_per_loop: Optional[float] = None  # the calibration's start readings' (recorded only)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"one_speed mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.seconds_per_loop > 0:
            raise ValueError(f"one_speed seconds_per_loop must be positive, got {self.seconds_per_loop!r}")

    def to_dict(self) -> Dict[str, Any]:
        return {"seconds_per_loop": self.seconds_per_loop, "mode": self.mode,
                "start_seconds_per_loop": self.start_seconds_per_loop}

    @classmethod
    def parse(cls, value: Any) -> Optional["OneSpeed"]:
        """From a manifest's training.one_speed: absent or null, as timed; else every field
        (a ValueError or TypeError names what is wrong)."""
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a mapping of seconds_per_loop, mode, start_seconds_per_loop, got {value!r}")
        start = value.get("start_seconds_per_loop")
        return cls(float(value.get("seconds_per_loop")), str(value.get("mode")),
                   None if start is None else float(start))


def factor(nominal: float, seconds_per_loop: Any) -> Optional[float]:
    """What a time read beside ``seconds_per_loop`` is multiplied by to be at ``nominal``
    (None: no usable reading)."""
    if not isinstance(seconds_per_loop, (int, float)) or seconds_per_loop <= 0 or nominal <= 0:
        return None
    return min(MAX_FACTOR, max(1.0 / MAX_FACTOR, nominal / float(seconds_per_loop)))


def _pairs_ok(speeds: Any) -> bool:
    return isinstance(speeds, (list, tuple)) and bool(speeds) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[1], int) for p in speeds)


def scaled_times(times: Sequence[float], speeds: Any, nominal: Optional[float],
                 step: Optional[float] = None) -> Optional[List[float]]:
    """``times`` at the nominal speed, ``speeds`` run-length pairs [seconds per loop, count] in
    the times' order (calibration/sweep.py stores them so); with ``step``, every one of them at
    that speed instead (the step's median). None where they do not cover the times one for one
    or a reading is unusable."""
    if nominal is None or not _pairs_ok(speeds) or not times:
        return None
    factors: List[float] = []
    for spl, n in speeds:
        f = factor(nominal, step if step is not None else spl)
        if f is None:
            return None
        factors += [f] * n
    if len(factors) != len(times):
        return None
    return [float(t) * f for t, f in zip(times, factors)]


def step_speed(infos: Sequence[Mapping[str, Any]]) -> Optional[float]:
    """The median reading of a step's operator samples, each run counted once."""
    xs = [float(spl) for info in infos if _pairs_ok(info.get("speeds"))
          for spl, n in info["speeds"] for _ in range(n)]
    return statistics.median(xs) if xs else None


def sample_seconds(seconds: float, info: Mapping[str, Any], nominal: Optional[float],
                   step: Optional[float] = None) -> float:
    """An operator sample's statistic (the fastest of its runs, calibration/bench.aggregate) at
    the nominal speed, or ``seconds`` as stored."""
    times = info.get("times") or ()
    scaled = scaled_times(times, info.get("speeds"), nominal, step)
    return min(scaled) if scaled else seconds


def engine_row(row: Mapping[str, Any], nominal: Optional[float], dtype: Optional[str] = None,
               reference_dtype: Optional[str] = None, step: Optional[float] = None) -> Mapping[str, Any]:
    """An engine file's shape row with each timed repeat at the nominal speed: its sweeps'
    readings (``row["speeds"]``, one per sweep, calibration/engine.py) applied to that sweep's
    repeats, or with ``step`` (its pass's median) every sweep's; every key of a repeat is a
    time. The row's own statistics are left as timed: the fit takes its statistic over the
    repeats (engine_fit.typical_row). Unchanged without readings for every sweep or when the
    engine's reference ran in another dtype than the nominal's."""
    speeds, repeats = row.get("speeds"), row.get("repeats")
    sweeps = int(row.get("sweeps", 1))
    if nominal is None or not isinstance(speeds, list) or not repeats or len(speeds) != sweeps \
            or len(repeats) % sweeps or (dtype and reference_dtype and dtype != reference_dtype):
        return row
    per = len(repeats) // sweeps
    factors = [factor(nominal, step if step is not None else s) for s in speeds]
    if any(f is None for f in factors):
        return row
    out = []
    for i, rep in enumerate(repeats):
        f = factors[i // per]
        out.append({k: (float(v) * f if isinstance(v, (int, float)) else v) for k, v in rep.items()})
    return {**row, "repeats": out}


ENGINE_SECTIONS = ("shapes", "zero", "tp")  # calibration/engine.py's passes


def engine_data(data: Mapping[str, Any], at: Optional[OneSpeed], dtype: Optional[str]) -> Mapping[str, Any]:
    """An engine file's passes with every row at ``at``'s speed (``engine_row``; in "step" mode
    each pass by the median of its readings); ``dtype`` the nominal reference's, compared with
    the one the engine's readings ran in (``data["reference"]["dtype"]``)."""
    if at is None:
        return data
    ran_in = (data.get("reference") or {}).get("dtype")
    out = dict(data)
    for section in ENGINE_SECTIONS:
        rows = data.get(section)
        if not rows:
            continue
        step = None
        if at.mode == "step":
            xs = [float(s) for r in rows.values() for s in (r.get("speeds") or ())
                  if isinstance(s, (int, float))]
            step = statistics.median(xs) if xs else None
        out[section] = {label: engine_row(row, at.seconds_per_loop, dtype, ran_in, step)
                        for label, row in rows.items()}
    return out


def of_profile(profile) -> Optional[OneSpeed]:
    """How a profile's samples were brought to one speed (its manifest's training.one_speed),
    or None: as timed."""
    return getattr(getattr(getattr(profile, "manifest", None), "training", None), "one_speed", None)
