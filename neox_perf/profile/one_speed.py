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
before each shape's sweep -- and stored with the times it stood beside. At the fit, each time
is multiplied by nominal / reading, the nominal being the reference's cost at the operator
step's start (profile.disturbance.reference): the profile then describes the machine at that
one speed, and `validate` scales it to the speed a launch finds. Only a CPU's measurements
carry readings (on a GPU a reading from the calibrating process would hold the device beside
its ranks); a measurement without one, or read in another dtype, is fitted as timed.
"""
from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence

# Fit at one speed by default? Decided by benchmarks/one_speed.py's refit of calibration pairs
# (docs/validation.md); False keeps every time as it was timed.
ONE_SPEED = False

# A reading this far from the nominal is not the machine's speed but a disturbance the watch
# flags (calibration/disturbance.py): the factor is held inside it, so that one disturbed
# reading cannot move a sample by more than the machine's own range (0.74-0.92 ms, 1.25x).
MAX_FACTOR = 1.5


def factor(nominal: float, seconds_per_loop: Any) -> Optional[float]:
    """What a time read beside ``seconds_per_loop`` is multiplied by to be at ``nominal``
    (None: no usable reading)."""
    if not isinstance(seconds_per_loop, (int, float)) or seconds_per_loop <= 0 or nominal <= 0:
        return None
    return min(MAX_FACTOR, max(1.0 / MAX_FACTOR, nominal / float(seconds_per_loop)))


def scaled_times(times: Sequence[float], speeds: Any, nominal: Optional[float]) -> Optional[List[float]]:
    """``times`` at the nominal speed, ``speeds`` run-length pairs [seconds per loop, count] in
    the times' order (calibration/sweep.py stores them so); None where they do not cover the
    times one for one or a reading is unusable."""
    if nominal is None or not isinstance(speeds, (list, tuple)) or not times:
        return None
    factors: List[float] = []
    for pair in speeds:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not isinstance(pair[1], int):
            return None
        f = factor(nominal, pair[0])
        if f is None:
            return None
        factors += [f] * pair[1]
    if len(factors) != len(times):
        return None
    return [float(t) * f for t, f in zip(times, factors)]


def sample_seconds(seconds: float, info: Mapping[str, Any], nominal: Optional[float]) -> float:
    """An operator sample's statistic (the fastest of its runs, calibration/bench.aggregate) at
    the nominal speed, or ``seconds`` as stored."""
    times = info.get("times") or ()
    scaled = scaled_times(times, info.get("speeds"), nominal)
    return min(scaled) if scaled else seconds


def engine_row(row: Mapping[str, Any], nominal: Optional[float], dtype: Optional[str] = None,
               reference_dtype: Optional[str] = None) -> Mapping[str, Any]:
    """An engine file's shape row with each timed repeat at the nominal speed: its sweeps'
    readings (``row["speeds"]``, one per sweep, calibration/engine.py) applied to that sweep's
    repeats, every key of a repeat a time. The row's own statistics are left as timed: the fit
    takes its statistic over the repeats (engine_fit.typical_row). Unchanged without readings
    for every sweep or when the engine's reference ran in another dtype than the nominal's."""
    speeds, repeats = row.get("speeds"), row.get("repeats")
    sweeps = int(row.get("sweeps", 1))
    if nominal is None or not isinstance(speeds, list) or not repeats or len(speeds) != sweeps \
            or len(repeats) % sweeps or (dtype and reference_dtype and dtype != reference_dtype):
        return row
    per = len(repeats) // sweeps
    factors = [factor(nominal, s) for s in speeds]
    if any(f is None for f in factors):
        return row
    out = []
    for i, rep in enumerate(repeats):
        f = factors[i // per]
        out.append({k: (float(v) * f if isinstance(v, (int, float)) else v) for k, v in rep.items()})
    return {**row, "repeats": out}


ENGINE_SECTIONS = ("shapes", "zero", "tp")  # calibration/engine.py's passes


def engine_data(data: Mapping[str, Any], nominal: Optional[float], dtype: Optional[str]) -> Mapping[str, Any]:
    """An engine file's passes with every row at the nominal speed (``engine_row``); ``dtype``
    the nominal reference's, compared with the one the engine's readings ran in
    (``data["reference"]["dtype"]``)."""
    if nominal is None:
        return data
    ran_in = (data.get("reference") or {}).get("dtype")
    return {**data, **{section: {label: engine_row(row, nominal, dtype, ran_in)
                                 for label, row in (data.get(section) or {}).items()}
                       for section in ENGINE_SECTIONS if section in data}}


def nominal_of(profile) -> Optional[float]:
    """The reference's cost per loop a profile's samples were fitted at (its manifest's
    training.one_speed), or None: as timed."""
    training = getattr(getattr(profile, "manifest", None), "training", None)
    value = (getattr(training, "extra", None) or {}).get("one_speed")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None
