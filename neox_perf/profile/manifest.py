"""A cluster profile's manifest.json, typed: parsed once into one frozen Manifest, written
back as it was read.

    Manifest.parse(json.load(fh), where=path)   # a malformed key: one ProfileError line naming it
    manifest.to_dict()                          # what to write (neox_perf/profile/directory.py)
    dataclasses.replace(manifest, step_terms=...)   # a new version with one section changed

Sections: facts (facts.ClusterFacts), notes, provenance, calibration, training and arrays
(sections.py), operators and collectives (models.ModelEntry), extrapolation (the marker of
profiles whose trainer fitted efficiency curves), engine (corrections.EngineSection), step
terms (corrections.StepTermsSection), a calibrated profile's validation runs
(sections.Validation), whether its calibration was disturbed (disturbance.Disturbance), and, for a cluster description only, what was transferred (never
written). Keys this version does not know are kept in `extra` and written back.

Adding a section: a frozen class with parse(data, where) and to_dict() (sections.py shows the
pattern), a field here, one entry in _SECTIONS, and its place in ORDER.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from ..errors import ProfileError, reading, text
from ..prediction.corrections import EngineSection, StepTermsSection
from .disturbance import Disturbance
from .facts import ClusterFacts
from .models import ModelEntry, parse_collectives, parse_operators
from .sections import RETRAIN, ArraysRef, Calibration, Provenance, Training, Validation, mapping, ordered

SCHEMA = "neox-perf-profile"
SCHEMA_VERSION = 1
WRITTEN_BY = "point at a directory written by `neox-perf calibrate` or neox_perf.predictors.fitting.train"
REQUIRED = ("name", "facts", "operators", "collectives")
# the keys in the order the writers write them
ORDER = ("schema", "schema_version", "name", "facts", "notes", "provenance", "calibration", "training",
         "arrays", "operators", "collectives", "extrapolation", "engine", "step_terms", "validation",
         "disturbance", "transfer")


def _notes(data: Any) -> Tuple[str, ...]:
    if isinstance(data, str) or not isinstance(data, (list, tuple)):
        raise TypeError(f"expected a list of text, got {type(data).__name__}")
    return tuple(text(n) for n in data)


def _engine(data: Any, where: str) -> Optional[EngineSection]:
    return EngineSection.parse(data, where) if data else None  # {}: no engine terms


# key -> parse(value, where) of the sections with a class of their own
_SECTIONS = {
    "provenance": Provenance.parse, "calibration": Calibration.parse, "training": Training.parse,
    "arrays": ArraysRef.parse, "operators": parse_operators, "collectives": parse_collectives,
    "engine": _engine, "step_terms": StepTermsSection.parse, "validation": Validation.parse,
    "disturbance": Disturbance.parse,
}


@dataclass(frozen=True)
class Manifest:
    name: str
    facts: Optional[ClusterFacts] = None  # always there in a profile read from disk
    notes: Tuple[str, ...] = ()
    provenance: Optional[Provenance] = None
    calibration: Optional[Calibration] = None  # profiles made by `neox-perf calibrate`
    training: Optional[Training] = None
    arrays: Optional[ArraysRef] = None
    operators: Mapping[str, Mapping[str, ModelEntry]] = field(default_factory=dict)  # op -> phase ->
    collectives: Mapping[str, ModelEntry] = field(default_factory=dict)
    extrapolation: Optional[str] = None  # predictors/extrapolate.MARKER: efficiency curves fitted
    engine: Optional[EngineSection] = None
    step_terms: Optional[StepTermsSection] = None
    validation: Optional[Validation] = None
    disturbance: Optional[Disturbance] = None  # was its calibration disturbed (`neox-perf calibrate`)
    transfer: Optional[Mapping[str, Any]] = None  # a description's (predictors/transfer.py)
    extra: Mapping[str, Any] = field(default_factory=dict)  # keys this version does not know
    # Facts written before ClusterFacts had samples_from (the bundled profiles) lack the key:
    # written back without it while it is empty.
    facts_without_samples_from: bool = field(default=False, compare=False, repr=False)

    @classmethod
    def parse(cls, data: Any, where: str = "manifest") -> "Manifest":
        if not isinstance(data, Mapping) or data.get("schema") != SCHEMA:
            raise ProfileError(where, f"not a neox-perf cluster profile (no schema {SCHEMA!r})", WRITTEN_BY)
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ProfileError(where, f"profile schema version {version!r}, this neox-perf reads "
                                      f"{SCHEMA_VERSION}", f"use the neox-perf that wrote it or {RETRAIN}")
        for key in REQUIRED:
            if key not in data:
                raise ProfileError(where, f"profile manifest lacks {key!r}", RETRAIN)
        values: Dict[str, Any] = {}
        with reading(f"{where}: name", RETRAIN):
            values["name"] = text(data["name"])
        with reading(f"{where}: facts", RETRAIN):
            facts = mapping(data["facts"], f"{where}: facts")
            values["facts"] = ClusterFacts.from_dict(facts)
            values["facts_without_samples_from"] = "samples_from" not in facts
        with reading(f"{where}: notes", RETRAIN):
            values["notes"] = _notes(data.get("notes", []))
        with reading(f"{where}: extrapolation", RETRAIN):
            values["extrapolation"] = None if data.get("extrapolation") is None else text(data["extrapolation"])
        for key, parse in _SECTIONS.items():
            if data.get(key) is not None:
                with reading(f"{where}: {key}", RETRAIN):
                    values[key] = parse(data[key], f"{where}: {key}")
        if data.get("transfer") is not None:
            values["transfer"] = dict(mapping(data["transfer"], f"{where}: transfer"))
        values["extra"] = {k: v for k, v in data.items() if k not in ORDER}
        return cls(**values)

    def to_dict(self) -> Dict[str, Any]:
        """The manifest as written to manifest.json."""
        out: Dict[str, Any] = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "name": self.name}
        if self.facts is not None:
            out["facts"] = self.facts.to_dict()
            if self.facts_without_samples_from and not self.facts.samples_from:
                del out["facts"]["samples_from"]
        out["notes"] = list(self.notes)
        for key in ("provenance", "calibration", "training", "arrays"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key).to_dict()
        out["operators"] = {op: {phase: e.to_dict() for phase, e in phases.items()}
                            for op, phases in self.operators.items()}
        out["collectives"] = {kind: e.to_dict() for kind, e in self.collectives.items()}
        if self.extrapolation is not None:
            out["extrapolation"] = self.extrapolation
        for key in ("engine", "step_terms", "validation", "disturbance"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key).to_dict()
        if self.transfer is not None:
            out["transfer"] = dict(self.transfer)
        out.update(self.extra)
        return ordered(out, ORDER)

    def model(self, op: str, phase: str) -> Optional[ModelEntry]:
        """The entry of one operator phase, or of one collective (phase "comm"); None without."""
        if phase == "comm":
            return self.collectives.get(op)
        return (self.operators.get(op) or {}).get(phase)
