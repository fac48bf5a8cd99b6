"""The manifest's small sections, typed: where the samples came from (provenance), how a
calibrated profile's samples were timed (calibration), how the models were trained
(training), the arrays file holding the trees (arrays), and a calibrated profile's own
validation runs (validation).

Each is frozen and parsed once (`parse(data, where)`, a malformed value one ProfileError line
naming the key); `to_dict()` gives back what was read: the fields this code reads are typed,
the rest (statistics and records nobody reads back) is kept in `extra` as written, and keys
come out in the order the writers write them. Adding a field: give it a default, read it in
`parse`, and it is written back by `to_dict`; adding a section: a class like these and one line
in manifest.Manifest.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from ..errors import ProfileError, reading, text
from ..prediction.corrections import Interval
from .one_speed import OneSpeed

RETRAIN = ("retrain it with `python -m neox_perf.predictors.fitting.train` (a bundled profile) or "
           "`neox-perf calibrate` (your own)")


def ordered(values: Mapping[str, Any], order: Sequence[str]) -> Dict[str, Any]:
    """``values`` with the keys of ``order`` first, in that order, then the rest as they come."""
    return {**{k: values[k] for k in order if k in values},
            **{k: v for k, v in values.items() if k not in order}}


def mapping(data: Any, where: str, fix: str = RETRAIN) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ProfileError(where, f"not a mapping ({type(data).__name__})", fix)
    return data


def _typed(cls) -> Tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if f.name != "extra")


def _write(section, order: Sequence[str], always: Sequence[str] = ()) -> Dict[str, Any]:
    """extra + the typed fields (None left out unless in ``always``), in ``order``."""
    values = dict(section.extra)
    for name in _typed(type(section)):
        v = getattr(section, name)
        if v is not None or name in always:
            values[name] = v
    return ordered(values, order)


def _optional(data: Mapping[str, Any], key: str, kind, where: str):
    with reading(f"{where}.{key}", RETRAIN):
        v = data.get(key)
        return None if v is None else kind(v)


@dataclass(frozen=True)
class Provenance:
    """Where a profile's samples came from, and what was done to it since."""

    source: Optional[str] = None
    license: Optional[str] = None
    # when its samples were measured (a date, or the publication they came with): a profile is
    # as current as the network and software its samples ran on (neox_perf/prediction/network.py)
    measured: Optional[str] = None
    store: Optional[str] = None  # the calibration store a calibrated profile was fitted from
    device_id: Optional[int] = None  # the store's device it was fitted on
    recalibrated: Optional[Mapping[str, Any]] = None  # a level correction: from what, by which run
    from_runs: Optional[Tuple[Mapping[str, Any], ...]] = None  # runs merged by a refit, oldest first
    extra: Mapping[str, Any] = field(default_factory=dict)  # files, fingerprint, runs, ...

    ORDER = ("source", "license", "measured", "license_files", "sample_dir", "device_string", "store", "samples",
             "device_id", "fingerprint", "runs", "files", "recalibrated", "from_runs")

    @classmethod
    def parse(cls, data: Any, where: str = "provenance") -> "Provenance":
        data = mapping(data, where)
        runs = data.get("from_runs")
        with reading(f"{where}.from_runs", RETRAIN):
            runs = None if runs is None else tuple(dict(mapping(r, f"{where}.from_runs")) for r in runs)
        rec = data.get("recalibrated")
        return cls(source=_optional(data, "source", text, where), license=_optional(data, "license", text, where),
                   measured=_optional(data, "measured", text, where),
                   store=_optional(data, "store", text, where), device_id=_optional(data, "device_id", int, where),
                   recalibrated=None if rec is None else dict(mapping(rec, f"{where}.recalibrated")),
                   from_runs=runs, extra={k: v for k, v in data.items() if k not in _typed(cls)})

    def to_dict(self) -> Dict[str, Any]:
        out = _write(self, self.ORDER)
        if self.from_runs is not None:
            out["from_runs"] = [dict(r) for r in self.from_runs]
        return out


@dataclass(frozen=True)
class Calibration:
    """How a calibrated profile's samples were timed (`neox-perf calibrate`)."""

    dtype: Optional[str] = None  # the element type of its operator and collective samples
    device: Optional[str] = None  # cpu | cuda
    threads: Optional[int] = None  # torch threads per process
    processes: Optional[int] = None  # the processes the collectives ran over (GPUs per node)
    extra: Mapping[str, Any] = field(default_factory=dict)

    ORDER = ("dtype", "device", "threads", "processes")

    @classmethod
    def parse(cls, data: Any, where: str = "calibration") -> "Calibration":
        data = mapping(data, where)
        return cls(dtype=_optional(data, "dtype", text, where), device=_optional(data, "device", text, where),
                   threads=_optional(data, "threads", int, where),
                   processes=_optional(data, "processes", int, where),
                   extra={k: v for k, v in data.items() if k not in _typed(cls)})

    def to_dict(self) -> Dict[str, Any]:
        return _write(self, self.ORDER, always=self.ORDER)  # unknown values are written as null


@dataclass(frozen=True)
class Training:
    """How the models were trained: library versions, the tree grid, how long it took."""

    library_versions: Mapping[str, str] = field(default_factory=dict)
    grid: Tuple[Tuple[str, Mapping[str, Any]], ...] = ()  # (model kind, hyperparameters) tried
    seconds: Optional[float] = None
    one_speed: Optional[OneSpeed] = None  # the speed its times were brought to (profile/one_speed.py)
    extra: Mapping[str, Any] = field(default_factory=dict)  # validation, tree_input, cleaning, ...

    ORDER = ("library_versions", "validation", "tree_input", "one_speed", "grid", "cleaning",
             "flash_attention_causal", "seconds")

    @classmethod
    def parse(cls, data: Any, where: str = "training") -> "Training":
        data = mapping(data, where)
        with reading(f"{where}.library_versions", RETRAIN):
            versions = {str(k): str(v) for k, v in mapping(data.get("library_versions") or {},
                                                           f"{where}.library_versions").items()}
        with reading(f"{where}.grid", RETRAIN):
            grid = tuple((str(kind), dict(params)) for kind, params in data.get("grid") or ())
        with reading(f"{where}.one_speed", RETRAIN):
            one_speed = OneSpeed.parse(data.get("one_speed"))
        return cls(versions, grid, _optional(data, "seconds", float, where), one_speed,
                   {k: v for k, v in data.items() if k not in _typed(cls)})

    def to_dict(self) -> Dict[str, Any]:
        out = _write(self, self.ORDER, always=("seconds",))
        if self.one_speed is not None:
            out["one_speed"] = self.one_speed.to_dict()
        out["library_versions"] = dict(self.library_versions)
        out["grid"] = [[kind, dict(params)] for kind, params in self.grid]
        return ordered(out, self.ORDER)


@dataclass(frozen=True)
class ArraysRef:
    """The arrays file beside the manifest that holds every exported tree."""

    file: Optional[str] = None  # None: a profile without trees
    sha256: Optional[str] = None  # checked on load (None until the file is written)
    models: int = 0
    nodes: int = 0
    trees: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)

    ORDER = ("file", "sha256", "models", "nodes", "trees")

    @classmethod
    def parse(cls, data: Any, where: str = "arrays") -> "ArraysRef":
        data = mapping(data, where)
        counts = {}
        for key in ("models", "nodes", "trees"):
            with reading(f"{where}.{key}", RETRAIN):
                counts[key] = int(data.get(key) or 0)
        return cls(file=_optional(data, "file", text, where) or None,
                   sha256=_optional(data, "sha256", text, where), **counts,
                   extra={k: v for k, v in data.items() if k not in _typed(cls)})

    def to_dict(self) -> Dict[str, Any]:
        return _write(self, self.ORDER, always=self.ORDER)


@dataclass(frozen=True)
class ValidationRun:
    """One `neox-perf validate` of a calibrated profile: one config set, its measured and
    predicted iteration, and how much of the prediction extrapolated."""

    config: str  # the config files, absolute, joined by " + "
    measured: float
    predicted: float
    extrapolated_share: float

    def to_dict(self) -> Dict[str, Any]:
        return {"config": self.config, "measured": self.measured, "predicted": self.predicted,
                "extrapolated_share": self.extrapolated_share}


@dataclass(frozen=True)
class Validation:
    """A calibrated profile's own validation runs (neox_perf/profile_validation.py) and the
    interval their residuals give once there are enough (corrections.VALIDATION_MIN_RUNS)."""

    runs: Tuple[ValidationRun, ...] = ()
    interval: Optional[Interval] = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    ORDER = ("runs", "interval")

    @classmethod
    def parse(cls, data: Any, where: str = "validation") -> "Validation":
        data = mapping(data, where)
        runs = []
        for i, r in enumerate(data.get("runs") or ()):
            with reading(f"{where}.runs[{i}]", RETRAIN):
                runs.append(ValidationRun(str(r["config"]), float(r["measured"]), float(r["predicted"]),
                                          float(r["extrapolated_share"])))
        with reading(f"{where}.interval", RETRAIN):
            interval = None if data.get("interval") is None else Interval.from_dict(data["interval"])
        return cls(tuple(runs), interval, {k: v for k, v in data.items() if k not in _typed(cls)})

    def to_dict(self) -> Dict[str, Any]:
        out = _write(self, self.ORDER, always=("runs",))
        out["runs"] = [r.to_dict() for r in self.runs]
        if self.interval is not None:
            out["interval"] = self.interval.to_dict()
        return ordered(out, self.ORDER)
