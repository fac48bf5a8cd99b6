"""A sampled cluster profile: the regressors trained on one cluster's operator and NCCL samples.

A profile directory holds `manifest.json` (facts, provenance, per-model metadata) and
`arrays.npz` (every exported tree, read with allow_pickle=False). Only numpy and the standard
library are imported here: `neox-perf check` predicts through this on its fast path. Load one
with predictors/profile.load_profile.

    >>> p = load_profile("perlmutter-a100-80gb")
    >>> p.predict("linear1", "fwd", {"m": 8192, "k": 6144, "n": 18432}).seconds
    >>> p.predict_collective("allreduce", elements=50_000_000, nodes=2, gpus_per_node=4)
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from neox_perf.prediction import opspec
from neox_perf.profile.facts import ClusterFacts
from neox_perf.profile.manifest import Manifest
from neox_perf.profile.sections import Provenance
from neox_perf.prediction.collective_sources import SAMPLED
from neox_perf.profile.values import BatchPrediction, Coverage, Prediction, ProfileInfo

from . import baseline, extrapolate, line_rate
from .artifacts import Arrays, Model
from .errors import ProfileError


class ClusterProfile:
    """Trained regressors of one cluster (a neox_perf/profile/protocol.Profile). Build with
    predictors/profile.load_profile()."""

    base = None  # a sampled profile stands on its own samples (a description's has a base)

    def __init__(self, path: Path, manifest: Manifest, arrays: Optional[Arrays]):
        self.path = path
        self.manifest = manifest
        self.name: str = manifest.name
        self.facts: ClusterFacts = manifest.facts
        # Collective samples count elements of the dtype they were measured in: fp16 for the
        # published NCCL samples, the calibration's dtype for a profile of your own.
        self.collective_dtype: str = (manifest.calibration.dtype if manifest.calibration else None) or "fp16"
        # the element size its operator samples moved: what a stand-in's byte ratio is taken at
        self.dtype_bytes: int = 4 if self.collective_dtype == "fp32" else opspec.FP16_BYTES
        self._ops: Dict[Tuple[str, str], Model] = {}
        self._colls: Dict[str, Model] = {}
        self._cache: Dict[tuple, Prediction] = {}
        # efficiency curves past the sampled range: only profiles whose trainer fitted them
        # (local calibrations); bundled profiles keep baseline x trees everywhere
        self._curves: Dict[Tuple[str, str], object] = {}
        use_curves = manifest.extrapolation == extrapolate.MARKER
        for op, phases in manifest.operators.items():
            for phase, entry in phases.items():
                self._ops[(op, phase)] = Model(f"{op}/{phase}", entry, arrays)
                if use_curves and entry.efficiency is not None:
                    self._curves[(op, phase)] = extrapolate.Curve.from_entry(entry.features, entry.efficiency)
        for kind, entry in manifest.collectives.items():
            self._colls[kind] = Model(kind, entry, arrays)

    # ---- operators -------------------------------------------------------------------
    def operators(self) -> List[Tuple[str, str]]:
        """(op, phase) pairs this profile can predict."""
        return sorted(self._ops)

    def predict(self, op: str, phase: str, features: Mapping[str, float]) -> Prediction:
        """Seconds for one operator call on one rank (one micro-batch, one tensor-parallel shard).

        features: the op's generic per-rank shape, see neox_perf.prediction.opspec.OPS[op].features.
        """
        spec = opspec.op_spec(op)
        try:
            values = tuple(float(features[n]) for n in spec.features)
        except (KeyError, TypeError):
            values = None
        if values is None or len(features) != len(spec.features):
            return self.predict_many(op, phase, features)[0]  # raises the precise error
        key = (op, phase, values)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if self._stand_in(op, phase) is not None:
            return self.predict_many(op, phase, features)[0]
        model = self._model_for(op, phase, spec)
        _check_values(op, spec.features, values)
        if model.derived_from is not None or ((op, phase) in self._curves
                                              and model.out_of_range_one(values)):
            out = self.predict_many(op, phase, features)[0]
        else:
            c = model.coef_list
            feats = dict(zip(spec.features, values))
            base = (c[0] + c[1] * float(opspec.op_flops(op, phase, feats, causal_kernel=model.causal_kernel))
                    + c[2] * float(opspec.op_bytes(op, phase, feats)))
            reason = model.out_of_range_one(values)
            out = Prediction(base * math.exp(model.residual_one(values)), bool(reason), reason)
        if len(self._cache) < 100_000:
            self._cache[key] = out
        return out

    def _stand_in(self, op: str, phase: str) -> Optional[Tuple[str, str]]:
        """The sampled (operator, phase) predicting ``op`` when this profile has no model of it."""
        src = opspec.STAND_INS.get(op)
        if src is None or (op, phase) in self._ops or src not in self._ops:
            return None
        return src

    def _model_for(self, op: str, phase: str, spec) -> Model:
        if phase not in spec.phases:
            raise ValueError(f"operator {op!r} has phases {', '.join(spec.phases)}, not {phase!r}")
        model = self._ops.get((op, phase))
        if model is None:
            raise ProfileError(self.path, f"profile {self.name} has no model for {op}/{phase}",
                               "use a profile trained with samples for this operator")
        return model

    def coverage(self, op: str, phase: str, features: Mapping[str, float]) -> Coverage:
        """Whether the samples of the model predicting this call cover its shape: sampled,
        interpolated, or extrapolated and how far (a derived phase answers with its source's)."""
        src = self._stand_in(op, phase)
        if src is not None:
            return self.coverage(*src, features)
        spec = opspec.op_spec(op)
        model = self._model_for(op, phase, spec)
        if model.derived_from is not None:
            model = self._model_for(op, model.derived_from, spec)
        return model.coverage_one(tuple(float(features[n]) for n in spec.features))

    def predict_many(self, op: str, phase: str, features: Mapping[str, object]) -> BatchPrediction:
        """Vectorised predict: each feature a scalar or an array (broadcast together)."""
        spec = opspec.op_spec(op)
        if phase not in spec.phases:
            raise ValueError(f"operator {op!r} has phases {', '.join(spec.phases)}, not {phase!r}")
        missing = [n for n in spec.features if n not in features]
        extra = [n for n in features if n not in spec.features]
        if missing or extra:
            raise ValueError(f"{op} takes features {', '.join(spec.features)}"
                             + (f"; missing {', '.join(missing)}" if missing else "")
                             + (f"; unknown {', '.join(extra)}" if extra else ""))
        try:
            cols = [np.asarray(c, dtype=float).ravel()
                    for c in np.broadcast_arrays(*(np.asarray(features[n], dtype=float) for n in spec.features))]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{op}: features must be numbers or arrays of numbers ({exc})") from None
        for name, col in zip(spec.features, cols):
            ok = np.isfinite(col) & ((col >= 0) if name == "causal" else (col > 0))
            if not np.all(ok):
                _check_values(op, (name,), (float(col[~ok][0]),))
        feats = dict(zip(spec.features, cols))
        src = self._stand_in(op, phase)
        if src is not None:
            pred = self.predict_many(*src, feats)
            seconds = pred.seconds * opspec.stand_in_ratio(op, phase, feats, self.dtype_bytes)
            return BatchPrediction(seconds, pred.extrapolated, pred.reasons)
        model = self._model_for(op, phase, spec)
        if model.derived_from is not None:
            src = self.predict_many(op, model.derived_from, feats)
            seconds = src.seconds
            reasons = list(src.reasons)
            extrapolated = src.extrapolated.copy()
            if model.derived_scale == "flop_ratio":
                seconds = seconds * (np.asarray(opspec.op_flops(op, phase, feats), dtype=float)
                                     / np.asarray(opspec.op_flops(op, model.derived_from, feats), dtype=float))
                note = f"{op}/{phase} not measured reliably, {model.derived_reason}"
                reasons = [f"{note}; {r}" if r else note for r in reasons]
                extrapolated[:] = True
            return BatchPrediction(seconds, extrapolated, tuple(reasons))
        base = baseline.evaluate(baseline.roofline_design(op, phase, feats, causal_kernel=model.causal_kernel),
                                 model.coef)
        log_ratio = model.residual(cols)
        reasons = model.out_of_range(cols)
        curve = self._curves.get((op, phase))
        outside = np.array([bool(r) for r in reasons])
        if curve is not None and outside.any():
            sub = [c[outside] for c in cols]
            log_ratio = log_ratio.copy()
            log_ratio[outside] = extrapolate.extrapolated_log_ratio(
                curve, spec.features, sub, log_ratio[outside], model.lo, model.hi)
            reasons = [f"{r}; efficiency curve past the samples" if r else r for r in reasons]
        seconds = base * np.exp(log_ratio)
        return BatchPrediction(seconds, np.array([bool(r) for r in reasons]), tuple(reasons))

    # ---- collectives -----------------------------------------------------------------
    def collectives(self) -> List[str]:
        return sorted(self._colls)

    def predict_collective(self, kind: str, elements: float, nodes: int, gpus_per_node: int) -> Prediction:
        """Seconds for one NCCL collective over nodes x gpus_per_node ranks.

        elements: fp16 elements per rank as in the samples -- the reduced tensor (allreduce),
        each rank's input chunk (allgather), the tensor sent (p2p). For p2p, nodes=1 means both
        ends in one node, nodes>1 that it crosses nodes. One rank in total takes 0 s.
        """
        elements, nodes, gpus_per_node = collective_args(self, kind, elements, nodes, gpus_per_node)
        if nodes * gpus_per_node == 1 or elements == 0:
            return Prediction(0.0, False, "")
        key = (kind, elements, nodes, gpus_per_node)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        model = self._colls.get(kind)
        if model is None:
            raise ProfileError(self.path, f"profile {self.name} has no model for {kind}",
                               "use a profile trained with samples for this collective")
        if kind == "p2p":
            # one sender, one receiver: only whether the pair crosses nodes matters
            nodes, gpus_per_node = (2, 1) if nodes > 1 else (1, 2)
        topo = (nodes, gpus_per_node)
        sampled = topo in model.topologies
        lo = model.topologies[topo][0] if sampled else model.lo[model.features.index("elements")]
        if elements < lo * (1 - 1e-9):
            seconds = self._below_samples(kind, model, elements, lo, nodes, gpus_per_node, sampled)
        else:
            seconds = self._collective_seconds(kind, model, elements, nodes, gpus_per_node, sampled)
        if not sampled:
            listed = ", ".join(f"{a}x{b}" for a, b in sorted(model.topologies))
            out = Prediction(seconds, True, f"{kind}: topology {nodes} nodes x {gpus_per_node} GPUs/node "
                                            f"never sampled (sampled: {listed}); alpha-beta baseline only",
                             SAMPLED)
        else:
            hi = model.topologies[topo][1]
            reason = ""
            if not lo * (1 - 1e-9) <= elements <= hi * (1 + 1e-9):
                side = "below the sampled minimum" if elements < lo else "above the sampled maximum"
                reason = (f"{kind}: elements={elements:g} {side} {lo if elements < lo else hi:g} "
                          f"for {nodes} nodes x {gpus_per_node} GPUs/node"
                          + ("; NCCL latency model below it" if elements < lo else ""))
            out = Prediction(seconds, bool(reason), reason, SAMPLED)
        out = line_rate.at_least(self.facts, out, kind, elements, nodes, gpus_per_node)
        if len(self._cache) < 100_000:
            self._cache[key] = out
        return out

    def _collective_seconds(self, kind, model, elements, nodes, gpn, sampled) -> float:
        design = baseline.collective_design(kind, elements, nodes, gpn, self.facts.inter_node_link.lanes)
        seconds = float(baseline.evaluate(design, model.coef)[0])
        if sampled:
            seconds *= math.exp(model.residual_one((elements, float(nodes), float(gpn))))
        return seconds

    def _below_samples(self, kind, model, elements, lo, nodes, gpn, sampled) -> float:
        """Below the smallest sample the fitted alpha is not identified (the samples sit far
        above the latency-bound range), so NCCL's documented latency replaces it: latency +
        wire bytes at the bandwidth the prediction implies at the smallest sample, which meets
        the sampled prediction there and never drops under the latency floor."""
        floor = baseline.collective_latency(kind, nodes, gpn)
        at_lo = self._collective_seconds(kind, model, lo, nodes, gpn, sampled)
        if at_lo > floor:
            return floor + (at_lo - floor) * elements / lo  # wire bytes are linear in elements
        design = baseline.collective_design(kind, elements, nodes, gpn, self.facts.inter_node_link.lanes)
        return floor + float(baseline.evaluate(design[:, 2:], np.asarray(model.coef)[2:])[0])

    def info(self) -> ProfileInfo:
        return info_of(self.path, self.manifest)

    def __repr__(self) -> str:
        return f"ClusterProfile({self.name!r}, gpu={self.facts.gpu_name!r}, path={str(self.path)!r})"


def collective_args(profile, kind: str, elements, nodes, gpus_per_node) -> Tuple[float, int, int]:
    """(elements, nodes, gpus_per_node) of a collective query, checked against the profile's
    cluster; every profile kind (sampled or described) refuses the same bad queries."""
    if kind not in opspec.COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; known: {', '.join(opspec.COLLECTIVES)}")
    for name, v in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
    nodes, gpus_per_node = int(nodes), int(gpus_per_node)
    if gpus_per_node > profile.facts.gpus_per_node:
        raise ValueError(f"{profile.name} has {profile.facts.gpus_per_node} GPUs per node, not {gpus_per_node}")
    elements = float(elements)
    if not math.isfinite(elements) or elements < 0:
        raise ValueError(f"elements must be finite and >= 0, got {elements!r}")
    return elements, nodes, gpus_per_node


def _check_values(op: str, names, values) -> None:
    for name, v in zip(names, values):
        if not (math.isfinite(v) and (v >= 0 if name == "causal" else v > 0)):
            raise ValueError(f"{op}: feature {name} must be finite and {'>= 0' if name == 'causal' else '> 0'}, "
                             f"got {v!r}")


def info_of(path: Path, manifest: Manifest) -> ProfileInfo:
    prov = manifest.provenance or Provenance()
    versions = manifest.training.library_versions if manifest.training else {}
    source = "unknown source" if prov.source is None else prov.source
    text = f"{source}, {'unknown license' if prov.license is None else prov.license} licence"
    if versions:
        text += "; trained with " + ", ".join(f"{k} {v}" for k, v in versions.items() if k != "python")
    return ProfileInfo(manifest.name, path, manifest.facts.gpu_name, text)
