"""The manifest's "step_terms" section, parsed once with the manifest
(neox_perf/profile/manifest.py): the step terms, their interval per regime, and where both were
fitted (StepTermsSection: frozen, one-line errors, written back as read)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Mapping, Optional

from ...errors import ProfileError, reading, text
from .interval import ACROSS_NODES, Interval, Intervals
from .step import FITTED, StepTerms


REFIT = "refit them (benchmarks/endtoend.py --write-terms, or `neox-perf calibrate --from-run`)"
# the section's keys in the order its writers write them (benchmarks/endtoend.py)
SECTION_ORDER = ("terms", "unseen_terms", "interval", "intervals", "fitted_on", "fitted_gpu", "other_gpu_widen",
                 "assumptions", "cross_validation", "interval_coverage", "command")
# regimes whose interval the section stores beside `interval` (inside a node), by key
STORED_REGIMES = {"across_nodes": ACROSS_NODES}


@dataclass(frozen=True)
class StepTermsSection:
    """The manifest's "step_terms" section: the terms, the interval the development set's
    cross-validated residuals put around a prediction, and where both were fitted."""

    terms: Optional[StepTerms] = None  # None: the plain sum of operator predictions
    # terms the runs could not see (step_fit.unseen_terms), each with its posterior standard
    # deviation: their values are the prior's, and the interval spans them (corrections/unseen.py)
    unseen_terms: Optional[Mapping[str, float]] = None
    interval: Optional[Interval] = None  # inside a node (older sections: every regime)
    intervals: Optional[Mapping[str, Interval]] = None  # other regimes', by STORED_REGIMES key
    fitted_on: Optional[str] = None  # what the terms were fitted on, for the reports
    fitted_gpu: Optional[str] = None  # the GPU of those runs (the interval widens on another)
    other_gpu_widen: Optional[float] = None  # relative widening of the interval on another GPU
    cross_validation: Optional[Mapping[str, Any]] = None  # the fit's cross-validated errors
    extra: Mapping[str, Any] = field(default_factory=dict)  # assumptions, command, ... as written
    # the terms as the file wrote them: written back while they still say the same (a section
    # written before a term existed lacks it, and reads it at its default)
    terms_as_read: Optional[Mapping[str, Any]] = field(default=None, compare=False, repr=False)

    @classmethod
    def parse(cls, data: Mapping[str, Any], where: str = "step_terms") -> "StepTermsSection":
        if not isinstance(data, Mapping):
            raise ProfileError(where, "not a mapping", REFIT)
        out: Dict[str, Any] = {}
        with reading(f"{where}.terms", REFIT):
            out["terms"] = None if data.get("terms") is None else StepTerms.from_dict(data["terms"])
        out["unseen_terms"] = _keyed(data, "unseen_terms", where, FITTED, "step terms",
                                     "standard deviations", _sd)
        with reading(f"{where}.interval", REFIT):
            out["interval"] = None if data.get("interval") is None else Interval.from_dict(data["interval"])
        out["intervals"] = _keyed(data, "intervals", where, STORED_REGIMES, "", "intervals",
                                  Interval.from_dict)
        for key, kind in (("fitted_on", text), ("fitted_gpu", text), ("other_gpu_widen", float)):
            with reading(f"{where}.{key}", REFIT):
                out[key] = None if data.get(key) is None else kind(data[key])
        cv = data.get("cross_validation")
        if cv is not None and not isinstance(cv, Mapping):
            raise ProfileError(f"{where}.cross_validation", "not a mapping", REFIT)
        return cls(**out, cross_validation=cv,
                   extra={k: v for k, v in data.items() if k not in _TYPED},
                   terms_as_read=data.get("terms"))

    def to_dict(self) -> Dict[str, Any]:
        values: Dict[str, Any] = dict(self.extra)
        for key in _TYPED:
            v = getattr(self, key)
            if key == "intervals" and v is not None:
                values[key] = {k: iv.to_dict() for k, iv in v.items()}
            elif key == "terms" and v is not None and self.terms_as_read is not None \
                    and StepTerms.from_dict(self.terms_as_read) == v:
                values[key] = self.terms_as_read
            elif v is not None:
                values[key] = v.to_dict() if hasattr(v, "to_dict") else v
        return {**{k: values[k] for k in SECTION_ORDER if k in values},
                **{k: v for k, v in values.items() if k not in SECTION_ORDER}}


    def regime_intervals(self) -> Optional[Intervals]:
        """The interval of every regime: inside a node from `interval`, across nodes from
        `intervals.across_nodes` (the inside one where a section has none)."""
        if self.interval is None:
            return None
        across = (self.intervals or {}).get("across_nodes")
        return Intervals(self.interval, across or self.interval)


_TYPED = tuple(f.name for f in fields(StepTermsSection) if f.name not in ("extra", "terms_as_read"))


def _sd(value) -> float:
    sd = float(value)
    if not (math.isfinite(sd) and sd >= 0):
        raise ValueError(f"a standard deviation must be a finite number >= 0, got {value!r}")
    return sd


def _keyed(data: Mapping[str, Any], key: str, where: str, allowed, what: str, to: str, parse):
    """``data[key]``: a mapping from some of ``allowed`` to values ``parse`` reads, or None
    where absent; each value's error names its own key."""
    given = data.get(key)
    if given is None:
        return None
    if not isinstance(given, Mapping) or set(given) - set(allowed):
        raise ProfileError(f"{where}.{key}", "not a mapping of " + (f"{what} (" if what else "")
                           + ", ".join(allowed) + (")" if what else "") + f" to {to}", REFIT)
    parsed = {}
    for name, value in given.items():
        with reading(f"{where}.{key}.{name}", REFIT):
            parsed[name] = parse(value)
    return parsed
