"""A profile's engine terms: what a DeepSpeed step costs beyond its operators, typed.

`neox-perf calibrate` measures them (calibration/engine.py, calibration/tp_allreduce.py) and
predictors/fitting/engine_fit.py fits them into the manifest's "engine" section. That section is
typed here, EngineSection (frozen; a malformed section is one line naming the key), and parsed
once with the rest of the manifest (neox_perf/profile/manifest.py); estimate.py applies it to a
decomposition through EngineTerms, and `calibrate --from-run` writes terms back through
EngineSection.to_dict.

Five kinds of term, each where its cost scales differently:
- Residual (layer_forward/backward, other_forward/backward): seconds + per_unit * x on top
  of the operators, x the operators' own seconds (inside a layer) or the logits (outside),
  never taking the phase below the lowest ratio to its operators it was measured at; a
  layer's backward adds per_memory * its memory-bound operators' seconds (Residual.per_memory);
  tp_layer_/tp_other_forward/backward the same on top of a tensor-parallel phase's parts
  (operators, residual, all-reduces), for groups of the size it was measured in ("processes");
- Linear (optimizer_step, grad_flatten, grad_accumulate, zero_reduce, zero_step, and
  tp_allreduce per element): t0 + per_tensor * tensors + per_param * params;
- Curve (dp_allreduce, dp_allgather): measured [elements, seconds] points of a ZeRO step's
  whole-model collectives, interpolated;
- Arrival (dp_arrival): data-parallel replicas reach their gradient all-reduce apart, and each
  waits there for the slowest: a fraction of the compute since they last met.
Each term keeps the fit's own statistics (rows, errors, sampled range) unread, for the
manifest and the calibrate table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Dict, Mapping, Optional, Tuple

from ...errors import ProfileError
from ..operators import OpCall
from .step import COMPUTE_BOUND

RESIDUALS = ("layer_forward", "layer_backward", "other_forward", "other_backward",
             "tp_layer_forward", "tp_layer_backward", "tp_other_forward", "tp_other_backward")
LINEARS = ("optimizer_step", "grad_flatten", "grad_accumulate", "zero_reduce", "zero_step",
           "tp_allreduce")
CURVES = ("dp_allreduce", "dp_allgather")
ARRIVAL = "dp_arrival"
COEFFICIENTS = ("t0", "per_tensor", "per_param", "per_element")


RECALIBRATE = "recalibrate the profile"


class EngineTermsError(ProfileError):
    """A manifest's engine section that cannot be read: one line naming the key."""


def operator_seconds(profile, calls, memory_only: bool = False) -> float:
    """The profile's isolated seconds for the operator calls of one run of calls (no step term,
    no host queue): what a residual is fitted against (engine_fit from the engine step,
    runs.engine_rows from a training run); ``memory_only``: the memory-bound ones alone
    (Residual.per_memory)."""
    return sum(profile.predict(c.op, c.phase, c.feature_dict()).seconds * c.count
               for c in calls if isinstance(c, OpCall) and not (memory_only and c.op in COMPUTE_BOUND))


@dataclass(frozen=True)
class Residual:
    """What a phase takes beyond its operators: the phase runs in `operators + added(x,
    operators)` seconds.

    A residual may be negative: the operator benchmarks time each operator alone, with its own
    synchronisation, and inside a real step a phase can run faster than their sum. But how much
    faster is only known where it was measured. A straight line with a negative fixed part,
    fitted on large layers, crosses zero below them and would give small layers a negative
    time (a 2-stage pipeline of tiny layers came out at -1.1 ms a backward). So the phase never
    runs at a lower ratio to its operators than the lowest the term has evidence for (`floor`):
    the measured shapes' own ratios (ratio_range, ratios), or, for a term fitted before those
    were recorded, the line's ratio at the ends of the range it was fitted on; and with no
    evidence at all, never below zero time."""

    seconds: float
    per_unit: float
    extra: Mapping[str, Any] = field(default_factory=dict)  # feature and fit statistics
    # (operators, measured / operators) at the measured shapes, by operators: where the fit
    # chose them, the residual inside their range is interpolated between them (over log
    # operators) instead of read off the straight line
    ratios: Tuple[Tuple[float, float], ...] = ()
    # (lowest, highest) measured / operators over the rows it was fitted on (engine_fit)
    ratio_range: Optional[Tuple[float, float]] = None
    # seconds added per second of the phase's memory-bound operators (norms, softmax, masks,
    # activations: not COMPUTE_BOUND), on top of per_unit: a layer's backward reads what its
    # forward saved, long evicted from the caches by then, where the operator benchmark times
    # each one warm (engine_fit.SPLIT_PHASES; docs/engine-terms.md)
    per_memory: float = 0.0
    floor: float = field(init=False, repr=False, compare=False)  # the lowest ratio: see above

    def __post_init__(self):
        xs = [x for x, _ in self.ratios]
        if any(not (x > 0 and r > 0) for x, r in self.ratios) or xs != sorted(xs) \
                or len(set(xs)) != len(xs) or len(xs) == 1:
            raise ValueError("ratios must be (operators > 0, ratio > 0) pairs, at least two, "
                             "by increasing operators")
        if self.ratio_range is not None and not (len(self.ratio_range) == 2
                                                 and 0 < self.ratio_range[0] <= self.ratio_range[1]
                                                 and math.isfinite(self.ratio_range[1])):
            raise ValueError("ratio_range must be [lowest, highest], 0 < lowest <= highest")
        if not math.isfinite(self.per_memory):
            raise ValueError(f"per_memory must be a finite number, got {self.per_memory!r}")
        object.__setattr__(self, "floor", self._lowest_ratio())

    def _lowest_ratio(self) -> float:
        if self.ratio_range is not None:
            return self.ratio_range[0]
        if self.ratios:
            return min(r for _, r in self.ratios)
        sampled = self.extra.get("sampled")
        if sampled is None or self.extra.get("feature") != "operators":
            return 0.0  # its x is not the operators (or unknown): only the zero floor
        lo, hi = (float(v) for v in sampled)
        if not 0 < lo <= hi:
            raise ValueError(f"sampled must be [lowest, highest] operators > 0, got {sampled!r}")
        # (operators + residual) / operators of a line is monotone in the operators: its lowest
        # over the sampled range is at one end of it
        return max(0.0, min(1.0 + self.per_unit + self.seconds / x for x in (lo, hi)))

    def added(self, x: float, operators: float, memory: float = 0.0) -> float:
        """Seconds this term adds to a phase whose operators take ``operators`` seconds
        (``memory`` of them memory-bound), at ``x`` (its feature: the same operators, or the
        logits); the phase keeps `floor`."""
        return max(self.at(x, memory), (self.floor - 1.0) * operators)

    def at(self, x: float, memory: float = 0.0) -> float:
        pts = self.ratios
        if pts and pts[0][0] <= x <= pts[-1][0]:
            lx = math.log(x)
            for (x0, r0), (x1, r1) in zip(pts, pts[1:]):
                if x <= x1:
                    w = (lx - math.log(x0)) / (math.log(x1) - math.log(x0))
                    return (r0 + w * (r1 - r0) - 1.0) * x
        return self.seconds + self.per_unit * x + self.per_memory * memory

    def to_dict(self) -> Dict[str, Any]:
        out = {"seconds": self.seconds, "per_unit": self.per_unit, **self.extra}
        if self.per_memory:
            out["per_memory"] = self.per_memory
        if self.ratios:
            out["ratios"] = [list(p) for p in self.ratios]
        if self.ratio_range is not None:
            out["ratio_range"] = list(self.ratio_range)
        return out


@dataclass(frozen=True)
class Linear:
    t0: float = 0.0
    per_tensor: float = 0.0
    per_param: float = 0.0
    per_element: float = 0.0
    names: Tuple[str, ...] = ()  # the coefficients the manifest gives, in its order
    processes: Optional[int] = None  # the group a collective term was measured in
    extra: Mapping[str, Any] = field(default_factory=dict)

    def at(self, params: float = 0.0, tensors: float = 0.0) -> float:
        return self.t0 + self.per_tensor * tensors + self.per_param * params

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"coef": {n: getattr(self, n) for n in self.names}}
        if self.processes is not None:
            out["processes"] = self.processes
        return {**out, **self.extra}


@dataclass(frozen=True)
class Curve:
    points: Tuple[Tuple[float, float], ...]  # (elements, seconds), by size
    processes: Optional[int]
    extra: Mapping[str, Any] = field(default_factory=dict)

    def at(self, x: float) -> float:
        """Interpolated between the measured sizes, beyond the largest at its cost per element."""
        pts = self.points
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return pts[-1][1] * x / pts[-1][0]

    def to_dict(self) -> Dict[str, Any]:
        return {"points": [list(p) for p in self.points], "processes": self.processes, **self.extra}


@lru_cache(maxsize=None)  # a few group sizes, each priced in every layout of a plan
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for one): how far, in standard deviations,
    the slowest of n ranks runs past their mean."""
    if n <= 1:
        return 0.0
    # the integral of x * n * pdf(x) * cdf(x)^(n - 1) on a grid fine enough for 4 digits
    step, total = 0.01, 0.0
    for i in range(-800, 801):
        x = i * step
        cdf = 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
        total += x * n * math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi) * cdf ** (n - 1) * step
    return total


@dataclass(frozen=True)
class Arrival:
    """Data-parallel replicas reach their gradient all-reduce apart: each runs the same work
    since they last met, but not at the same speed, and every replica waits there for the
    slowest. `fraction`: the mean replica's wait per second of that work, measured among
    `processes` ranks running the same phases at once (calibration/engine.py's plain pass:
    per repeat, the slowest peer's forward + backward past the peers' mean, over the mean).

    For a smaller group the wait shrinks as the expected lead of the slowest of n over their
    mean (independent normal spreads: 0.56 standard deviations for two, 1.03 for four); for a
    larger one it is held at the measured group's, not extrapolated (nothing measured how the
    slowest of more replicas moves)."""

    fraction: float
    processes: int
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not (0.0 <= self.fraction <= 0.5 and math.isfinite(self.fraction)):
            raise ValueError(f"fraction must be in [0, 0.5], got {self.fraction!r}")
        if self.processes < 2:
            raise ValueError(f"processes must be 2 or more, got {self.processes!r}")

    def at(self, replicas: int) -> float:
        """The wait per second of work since the replicas last met, for ``replicas`` of them."""
        if replicas <= 1:
            return 0.0
        n = min(replicas, self.processes)
        return self.fraction * expected_max_normal(n) / expected_max_normal(self.processes)

    def to_dict(self) -> Dict[str, Any]:
        return {"fraction": self.fraction, "processes": self.processes, **self.extra}


@dataclass(frozen=True)
class EngineSection:
    """The manifest's "engine" section, parsed."""

    precision: Optional[str]
    residuals: Mapping[str, Residual] = field(default_factory=dict)
    linears: Mapping[str, Linear] = field(default_factory=dict)
    curves: Mapping[str, Curve] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)  # source, shapes, extra_rows, ...
    arrival: Optional[Arrival] = None

    @classmethod
    def parse(cls, data: Mapping[str, Any], where: str = "engine") -> "EngineSection":
        if not isinstance(data, Mapping):
            raise EngineTermsError(where, "not a mapping", RECALIBRATE)
        residuals, linears, curves, extra, arrival = {}, {}, {}, {}, None
        for key, value in data.items():
            try:
                if key in RESIDUALS and value:
                    ratio_range = value.get("ratio_range")
                    residuals[key] = Residual(float(value["seconds"]), float(value["per_unit"]),
                                              _rest(value, ("seconds", "per_unit", "ratios",
                                                            "ratio_range", "per_memory")),
                                              tuple((float(a), float(b))
                                                    for a, b in value.get("ratios") or ()),
                                              None if ratio_range is None
                                              else tuple(float(v) for v in ratio_range),
                                              float(value.get("per_memory", 0.0)))
                elif key in LINEARS and value:
                    coef = value["coef"]
                    unknown = set(coef) - set(COEFFICIENTS)
                    if unknown:
                        raise ValueError(f"unknown coefficients {sorted(unknown)}")
                    processes = value.get("processes")
                    linears[key] = Linear(**{n: float(v) for n, v in coef.items()},
                                          names=tuple(coef),
                                          processes=None if processes is None else int(processes),
                                          extra=_rest(value, ("coef", "processes")))
                elif key in CURVES and value:
                    points = tuple((float(a), float(b)) for a, b in value.get("points") or ())
                    processes = value.get("processes")
                    curves[key] = Curve(points, None if processes is None else int(processes),
                                        _rest(value, ("points", "processes")))
                elif key == ARRIVAL and value:
                    arrival = Arrival(float(value["fraction"]), int(value["processes"]),
                                      _rest(value, ("fraction", "processes")))
                elif key != "precision":
                    extra[key] = value
            except (KeyError, TypeError, ValueError) as exc:
                raise EngineTermsError(f"{where}.{key}", f"cannot be read ({exc.__class__.__name__}: "
                                       f"{exc})", RECALIBRATE) from None
        return cls(data.get("precision"), residuals, linears, curves, extra, arrival)

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"precision": self.precision}
        out.update({k: v.to_dict() for k, v in self.residuals.items()})
        out.update({k: v.to_dict() for k, v in self.linears.items()})
        out.update({k: v.to_dict() for k, v in self.curves.items()})
        if self.arrival is not None:
            out[ARRIVAL] = self.arrival.to_dict()
        out.update(self.extra)
        return out

    def with_terms_of(self, other: "EngineSection", *names: str) -> "EngineSection":
        """This section with ``other``'s terms of these names (kept from an older fit)."""
        def pick(mine, theirs):
            return {**mine, **{n: theirs[n] for n in names if n in theirs}}
        return replace(self, residuals=pick(self.residuals, other.residuals),
                       linears=pick(self.linears, other.linears),
                       curves=pick(self.curves, other.curves),
                       arrival=other.arrival if ARRIVAL in names else self.arrival)

    def linear(self, name: str) -> Optional[Linear]:
        return self.linears.get(name)


def _rest(value: Mapping[str, Any], known) -> Dict[str, Any]:
    return {k: v for k, v in value.items() if k not in known}


@dataclass(frozen=True)
class EngineTerms:
    """A profile's engine terms applied to one decomposition (None when not applicable)."""

    section: EngineSection
    m: int  # micro-batches per iteration
    zero_stage: int

    @property
    def deepspeed_path(self) -> bool:  # measured on DeepSpeed's non-ZeRO optimizer path
        return self.zero_stage == 0

    @property
    def zero_path(self) -> bool:
        # stages 1 and 2 run one optimizer class (zero/stage_1_and_2.py); the ZeRO pass ran 1
        return self.zero_stage in (1, 2) and "zero_step" in self.section.linears

    @classmethod
    def of(cls, profile, decomp) -> Optional["EngineTerms"]:
        section = profile.manifest.engine  # parsed with the manifest
        if section is None or section.precision != decomp.precision:
            return None
        return cls(section, decomp.micro_batches, decomp.zero_stage)

    def _residual(self, name: str, x: float, operators: float) -> float:
        term = self.section.residuals.get(name)
        return term.added(x, operators) if term else 0.0

    def layer(self, phase: str, operators: float, memory: float = 0.0) -> float:
        """Seconds one layer adds to its operators' `operators` seconds in this phase, ``memory``
        of them in memory-bound operators."""
        term = self.section.residuals.get(f"layer_{phase}")
        return term.added(operators, operators, memory) if term else 0.0

    def tensor_parallel(self, part: str, phase: str, parts: float, calls) -> float:
        """Seconds a tensor-parallel ``part`` ("layer", or "other": embedding, head and loss)
        adds in training to its ``parts`` (operators, residual, its all-reduces ``calls`` as
        priced) in this phase: only where those all-reduces are a one-node group of the size the
        term was measured in (engine_fit's tensor-parallel pass)."""
        term = self.section.residuals.get(f"tp_{part}_{phase}")
        groups = {(c.nodes, c.gpus_per_node) for c in calls
                  if getattr(c, "purpose", None) == "mp_allreduce"}
        if term is None or parts <= 0 or groups != {(1, term.extra.get("processes"))}:
            return 0.0
        return term.added(parts, parts)

    def other(self, phase: str, operators: float, logits: float) -> float:
        """What the embedding, head and loss add (charged to the stage with the logits)."""
        if logits <= 0:
            return 0.0
        return self._residual(f"other_{phase}", logits, operators)

    def _linear(self, name: str, params: float, tensors: float) -> Optional[float]:
        term = self.section.linears.get(name)
        return None if term is None else term.at(params, tensors)

    def optimizer(self, params: float, tensors: float,
                  partition: Optional[float] = None) -> Optional[float]:
        """The optimizer step beside its collectives; None: keep the operator prediction.
        ``partition``: the parameters this rank's optimizer steps (default all of them)."""
        if self.deepspeed_path:
            return self._linear("optimizer_step", params, tensors)
        if self.zero_path:
            return self._linear("zero_step", params if partition is None else partition, 0)
        return None

    def grad_flatten(self, params: float) -> float:
        return (self._linear("grad_flatten", params, 0) or 0.0) if self.deepspeed_path else 0.0

    def grad_reduce(self, params: float) -> float:
        """Per iteration: what reducing the gradients costs beside the all-reduces themselves."""
        if self.deepspeed_path:
            return self.grad_flatten(params)
        if not self.zero_path:
            return 0.0
        # ZeRO-1 reduces at the accumulation boundary only; ZeRO-2 in every micro-batch's
        # backward (stage_1_and_2.reduce_ready_partitions_and_remove_grads)
        times = self.m if self.zero_stage == 2 else 1
        return (self._linear("zero_reduce", params, 0) or 0.0) * times

    def dp_collective(self, call) -> Optional[float]:
        """A data-parallel all-reduce / all-gather as a ZeRO step runs it, when measured for this
        group and at least as large as the smallest one measured (below, the collective
        benchmark's own samples are the better guide)."""
        c = self.section.curves.get(call.purpose)
        if (c is None or not c.points or call.nodes != 1 or call.gpus_per_node != c.processes
                or call.elements < c.points[0][0]):
            return None
        return c.at(call.elements)

    def tp_allreduce(self, call) -> Optional[float]:
        """A tensor-parallel all-reduce as training sees it, when measured for this group."""
        c = self.section.linears.get("tp_allreduce")
        if c is None or call.nodes != 1 or call.gpus_per_node != c.processes:
            return None
        return c.t0 + c.per_element * call.elements

    def accumulate(self, params: float, tensors: float) -> float:
        """Per micro-batch on average: every micro-batch after the first adds its gradients."""
        per = self._linear("grad_accumulate", params, tensors) or 0.0
        return per * (self.m - 1) / self.m

    def dp_wait(self, grad_sync, work_seconds: float) -> float:
        """Per iteration: what a replica waits at its gradient all-reduce (``grad_sync``, the
        stage's data-parallel calls) for the slowest replica, after ``work_seconds`` of work
        since they last met; 0 without a data-parallel group or the measured term."""
        term = self.section.arrival
        sizes = [c.nodes * c.gpus_per_node for c in grad_sync
                 if getattr(c, "purpose", None) == "dp_allreduce"]
        if term is None or not sizes or work_seconds <= 0:
            return 0.0
        return term.at(max(sizes)) * work_seconds
