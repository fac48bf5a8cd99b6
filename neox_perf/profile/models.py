"""The manifest's model entries, typed: one per operator and phase ("operators") and one per
collective ("collectives").

An entry is either fitted -- the features it takes and their sampled ranges, the physical
baseline's coefficients, the exported trees on its residual (a ForestRef into arrays.npz),
for a collective the topologies it was sampled on, for a calibrated profile the efficiency
curve past the samples -- or derived from another phase of the same operator (Derived).
What nothing reads back (the fit's statistics, the model kind, the hyperparameters) stays in
`extra` as written. Parsed once with the manifest (neox_perf/profile/manifest.py); the
predictors build their models from these (predictors/artifacts.Model).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from ..errors import reading, text
from ..prediction.opspec import CAUSAL_KERNELS
from .sections import RETRAIN, mapping, ordered


@dataclass(frozen=True)
class Derived:
    """A phase predicted by another phase's model, because its own samples could not be used."""

    from_phase: str
    scale: str  # same | flop_ratio (the source's time x this phase's FLOPs / the source's)
    reason: str

    def to_dict(self) -> Dict[str, Any]:
        return {"from_phase": self.from_phase, "scale": self.scale, "reason": self.reason}


@dataclass(frozen=True)
class ForestRef:
    """Where an entry's exported trees are in arrays.npz, and their shape (checked on load)."""

    arrays: str  # the member prefix, "m<i>"
    nodes: int
    trees: int
    depth: int
    combine: str  # mean (random forest) | sum (boosted)
    base: float

    def to_dict(self) -> Dict[str, Any]:
        return {"arrays": self.arrays, "nodes": self.nodes, "trees": self.trees, "depth": self.depth,
                "combine": self.combine, "base": self.base}


@dataclass(frozen=True)
class Baseline:
    """The physical baseline the trees correct: coefficients of its terms (predictors/baseline)."""

    terms: Tuple[str, ...]
    coef: Tuple[float, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)  # form, bounds, the rates they imply

    ORDER = ("form", "terms", "coef", "nic_lanes", "lower_bounds", "at_lower_bound", "achieved_tflops",
             "achieved_gbps", "intra_peer_link_gbps", "inter_per_nic_gbps")

    @property
    def causal_kernel(self) -> Optional[str]:
        """The kernel whose blocks the baseline priced a causal call's work with
        (opspec.causal_work_fraction); None: the default, FlashAttention-2's tiles."""
        return self.extra.get("causal_kernel")

    def coefficient(self, term: str, default: float = 0.0) -> float:
        return dict(zip(self.terms, self.coef)).get(term, default)

    @property
    def intra_peer_link_gbps(self) -> Optional[float]:
        """A collective's fitted bandwidth per intra-node peer link (None: not identified)."""
        return self.extra.get("intra_peer_link_gbps")

    @property
    def inter_per_nic_gbps(self) -> Optional[float]:
        """A collective's fitted bandwidth per NIC (None: not identified)."""
        return self.extra.get("inter_per_nic_gbps")

    def to_dict(self) -> Dict[str, Any]:
        return ordered({**self.extra, "terms": list(self.terms), "coef": list(self.coef)}, self.ORDER)


@dataclass(frozen=True)
class Topology:
    """A (nodes x GPUs per node) group a collective was sampled on, and its sampled sizes."""

    nodes: int
    gpus_per_node: int
    rows: int
    elements: Tuple[float, float]  # smallest and largest sampled

    def to_dict(self) -> Dict[str, Any]:
        return {"nodes": self.nodes, "gpus_per_node": self.gpus_per_node, "rows": self.rows,
                "elements": list(self.elements)}


@dataclass(frozen=True)
class ModelEntry:
    features: Tuple[str, ...] = ()
    ranges: Mapping[str, Tuple[float, float]] = field(default_factory=dict)  # sampled min, max
    grid: Optional[Mapping[str, Tuple[float, ...]]] = None  # distinct sampled values, if a grid
    tree_features: Tuple[str, ...] = ()  # the features the trees split on
    forest: Optional[ForestRef] = None  # None: the baseline alone predicts
    baseline: Optional[Baseline] = None
    topologies: Optional[Mapping[str, Topology]] = None  # collectives: "<nodes>x<gpus/node>"
    efficiency: Optional[Mapping[str, Any]] = None  # past the samples (predictors/extrapolate.Curve)
    derived: Optional[Derived] = None  # set: no model of its own, the other phase's
    extra: Mapping[str, Any] = field(default_factory=dict)  # rows, model, validation, ...

    ORDER = ("features", "rows", "ranges", "grid", "tree_features", "model", "hyperparameters",
             "validation_mape", "validation_best_kind", "forest", "export_max_error", "baseline",
             "topologies", "efficiency", "derived")

    @classmethod
    def parse(cls, data: Any, where: str) -> "ModelEntry":
        data = mapping(data, where)
        if "derived" in data:
            with reading(f"{where}.derived", RETRAIN):
                d = mapping(data["derived"], f"{where}.derived")
                derived = Derived(text(d["from_phase"]), text(d["scale"]), text(d["reason"]))
            return cls(derived=derived, extra={k: v for k, v in data.items() if k != "derived"})
        with reading(where, RETRAIN):
            features = tuple(text(n) for n in data["features"])
            ranges = {n: (float(data["ranges"][n][0]), float(data["ranges"][n][1])) for n in features}
            grid = None if data.get("grid") is None else {
                str(n): tuple(float(v) for v in vs) for n, vs in mapping(data["grid"], f"{where}.grid").items()}
            trees = tuple(text(n) for n in data["tree_features"])
            unknown = [n for n in trees if n not in features]
            if unknown:
                raise ValueError(f"tree_features {unknown} are not among the features {list(features)}")
        with reading(f"{where}.baseline", RETRAIN):
            b = mapping(data["baseline"], f"{where}.baseline")
            baseline = Baseline(tuple(text(t) for t in b["terms"]), tuple(float(c) for c in b["coef"]),
                                {k: v for k, v in b.items() if k not in ("terms", "coef")})
            if baseline.causal_kernel is not None and baseline.causal_kernel not in CAUSAL_KERNELS:
                raise ValueError(f"causal_kernel {baseline.causal_kernel!r} is not one of "
                                 f"{', '.join(CAUSAL_KERNELS)}")
        forest = None
        if data.get("forest") is not None:
            with reading(f"{where}.forest", RETRAIN):
                f = mapping(data["forest"], f"{where}.forest")
                forest = ForestRef(text(f["arrays"]), int(f["nodes"]), int(f["trees"]), int(f["depth"]),
                                   text(f["combine"]), float(f["base"]))
        topologies = None
        if data.get("topologies") is not None:
            with reading(f"{where}.topologies", RETRAIN):
                topologies = {str(k): Topology(int(t["nodes"]), int(t["gpus_per_node"]), int(t["rows"]),
                                               (float(t["elements"][0]), float(t["elements"][1])))
                              for k, t in mapping(data["topologies"], f"{where}.topologies").items()}
        efficiency = data.get("efficiency")
        if efficiency is not None:
            efficiency = dict(mapping(efficiency, f"{where}.efficiency"))
        typed = ("features", "ranges", "grid", "tree_features", "forest", "baseline", "topologies",
                 "efficiency", "derived")
        return cls(features, ranges, grid, trees, forest, baseline, topologies, efficiency, None,
                   {k: v for k, v in data.items() if k not in typed})

    def to_dict(self) -> Dict[str, Any]:
        values: Dict[str, Any] = dict(self.extra)
        if self.derived is not None:
            values["derived"] = self.derived.to_dict()
            return ordered(values, self.ORDER)
        values.update(features=list(self.features),
                      ranges={n: list(r) for n, r in self.ranges.items()},
                      tree_features=list(self.tree_features))
        if self.grid is not None:
            values["grid"] = {n: list(vs) for n, vs in self.grid.items()}
        if self.forest is not None:
            values["forest"] = self.forest.to_dict()
        if self.baseline is not None:
            values["baseline"] = self.baseline.to_dict()
        if self.topologies is not None:
            values["topologies"] = {k: t.to_dict() for k, t in self.topologies.items()}
        if self.efficiency is not None:
            values["efficiency"] = dict(self.efficiency)
        return ordered(values, self.ORDER)


def parse_operators(data: Any, where: str) -> Dict[str, Dict[str, ModelEntry]]:
    return {str(op): {str(phase): ModelEntry.parse(entry, f"{where}.{op}.{phase}")
                      for phase, entry in mapping(phases, f"{where}.{op}").items()}
            for op, phases in mapping(data, where).items()}


def parse_collectives(data: Any, where: str) -> Dict[str, ModelEntry]:
    return {str(kind): ModelEntry.parse(entry, f"{where}.{kind}") for kind, entry in mapping(data, where).items()}
