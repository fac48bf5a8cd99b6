"""Time the decomposition with a cluster profile and run the 1F1B timeline.

Every operator call is predicted once per distinct shape (all transformer layers share one),
so a 96-layer model costs no more to predict than a 2-layer one.

A profile made by `neox-perf calibrate` may also carry "engine" terms: what a step costs on
that machine beyond its operators, measured by running the reference model under DeepSpeed
at calibration shapes (predictors/local.fit_engine). They are applied when the run computes
in the precision they were measured in; bundled profiles have none. DeepSpeed's plain
optimizer and its ZeRO stage-1/2 optimizer do different work around the same all-reduce, and
each has its own terms, measured on its own path.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from .operators import CommCall, Decomposition, OpCall, StageWork
from .timeline import StageCost, Timeline, simulate_1f1b


@dataclass(frozen=True)
class Flag:
    what: str  # operator/collective and phase, e.g. "linear3 bwd" or "allreduce 16x4"
    reason: str


@dataclass(frozen=True)
class StageTimes:
    index: int
    layer_forward: float  # one transformer layer, one micro-batch (incl. its TP all-reduces)
    layer_backward: float
    forward: float  # whole stage, one micro-batch
    backward: float  # incl. recompute
    recompute: float
    mp_allreduce: float  # TP all-reduce seconds per micro-batch (fwd + bwd + recompute)
    send_activation: float
    send_gradient: float
    grad_allreduce: float
    tied_allreduce: float
    optimizer: float
    param_allgather: float
    engine: float = 0.0  # seconds per iteration the engine terms add here (TP all-reduces aside)


@dataclass(frozen=True)
class IterationEstimate:
    iteration_seconds: float
    timeline: Timeline
    stages: Tuple[StageTimes, ...]
    breakdown: Dict[str, float]
    operators: Dict[str, float]  # seconds per iteration on the critical stage, per operator+phase
    flags: Tuple[Flag, ...]
    eq7_seconds: float
    # 80% interval of the iteration time from the profile's measured end-to-end residuals;
    # None when the profile carries none.
    interval_seconds: Optional[Tuple[float, float]] = None


class _Cache:
    def __init__(self, profile, engine: Optional["EngineTerms"] = None):
        self.profile = profile
        self.engine = engine
        self.memo: Dict[tuple, float] = {}
        self.flags: Dict[str, str] = {}

    def time(self, call) -> float:
        if isinstance(call, OpCall):
            key = ("op", call.op, call.phase, call.features)
            if key not in self.memo:
                pred = self.profile.predict(call.op, call.phase, call.feature_dict())
                self._note(f"{call.op} {call.phase}", pred)
                self.memo[key] = float(pred.seconds)
            return self.memo[key]
        if self.engine is not None and call.purpose in ("mp_allreduce", "dp_allreduce", "dp_allgather"):
            measured = (self.engine.tp_allreduce(call) if call.purpose == "mp_allreduce"
                        else self.engine.dp_collective(call))
            if measured is not None:
                return measured
        key = ("comm", call.kind, call.elements, call.nodes, call.gpus_per_node)
        if key not in self.memo:
            pred = self.profile.predict_collective(call.kind, call.elements, call.nodes,
                                                   call.gpus_per_node)
            self._note(f"{call.kind} {call.nodes}x{call.gpus_per_node}", pred)
            self.memo[key] = float(pred.seconds)
        return self.memo[key]

    def _note(self, what: str, pred) -> None:
        if getattr(pred, "extrapolated", False) and what not in self.flags:
            self.flags[what] = getattr(pred, "reason", "") or "outside the sampled range"

    def total(self, calls) -> float:
        return sum(self.time(c) * c.count for c in calls)

    def comm(self, calls, purpose: str) -> float:
        return sum(self.time(c) * c.count for c in calls
                   if isinstance(c, CommCall) and c.purpose == purpose)


class EngineTerms:
    """A profile's measured engine terms, for one decomposition (None when not applicable)."""

    def __init__(self, terms: dict, micro_batches: int, zero_stage: int):
        self.t = terms
        self.m = micro_batches
        self.zero_stage = zero_stage
        self.deepspeed_path = zero_stage == 0  # measured on DeepSpeed's non-ZeRO optimizer path
        # stages 1 and 2 run one optimizer class (zero/stage_1_and_2.py); the ZeRO pass ran 1
        self.zero_path = zero_stage in (1, 2) and "zero_step" in terms

    @classmethod
    def of(cls, profile, decomp: Decomposition) -> Optional["EngineTerms"]:
        terms = (getattr(profile, "manifest", None) or {}).get("engine")
        if not terms or terms.get("precision") != decomp.precision:
            return None
        return cls(terms, decomp.micro_batches, decomp.zero_stage)

    def _residual(self, name: str, x: float) -> float:
        term = self.t.get(name)
        return term["seconds"] + term["per_unit"] * x if term else 0.0

    def layer(self, phase: str, operators: float) -> float:
        """Seconds one layer adds to its operators' `operators` seconds in this phase."""
        return self._residual(f"layer_{phase}", operators)

    def other(self, phase: str, operators: float, logits: float) -> float:
        """What the embedding, head and loss add (charged to the stage with the logits)."""
        if logits <= 0:
            return 0.0
        return max(self._residual(f"other_{phase}", logits), -operators)

    def _linear(self, name: str, params: float, tensors: float) -> Optional[float]:
        c = (self.t.get(name) or {}).get("coef")
        if c is None:
            return None
        return c.get("t0", 0.0) + c.get("per_tensor", 0.0) * tensors + c.get("per_param", 0.0) * params

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

    def dp_collective(self, call: CommCall) -> Optional[float]:
        """A data-parallel all-reduce / all-gather as a ZeRO step runs it, when measured for this
        group and at least as large as the smallest one measured (below, the collective
        benchmark's own samples are the better guide): interpolated between the measured
        sizes, beyond the largest at its cost per element."""
        c = self.t.get(call.purpose) or {}
        if (not c.get("points") or call.nodes != 1 or call.gpus_per_node != c.get("processes")
                or call.elements < c["points"][0][0]):
            return None
        x = call.elements
        pts = c["points"]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return pts[-1][1] * x / pts[-1][0]

    def tp_allreduce(self, call: CommCall) -> Optional[float]:
        """A tensor-parallel all-reduce as training sees it, when measured for this group."""
        c = (self.t.get("tp_allreduce") or {})
        if not c or call.nodes != 1 or call.gpus_per_node != c.get("processes"):
            return None
        return c["coef"]["t0"] + c["coef"]["per_element"] * call.elements

    def accumulate(self, params: float, tensors: float) -> float:
        """Per micro-batch on average: every micro-batch after the first adds its gradients."""
        per = self._linear("grad_accumulate", params, tensors) or 0.0
        return per * (self.m - 1) / self.m


def _ops(calls, cache: _Cache) -> float:
    return sum(cache.time(c) * c.count for c in calls if isinstance(c, OpCall))


def _stage_times(work: StageWork, cache: _Cache, engine: Optional[EngineTerms] = None) -> StageTimes:
    lf = cache.total(work.layer_forward)
    lb = cache.total(work.layer_backward)
    n = work.transformer_layers
    extra_f = extra_b = 0.0
    optimizer = cache.time(work.optimizer)
    grad_sync = cache.total(work.grad_sync)
    if engine is not None:
        lf += engine.layer("forward", _ops(work.layer_forward, cache))
        lb += engine.layer("backward", _ops(work.layer_backward, cache))
        extra_f = engine.other("forward", _ops(work.forward, cache), work.logits_elements)
        extra_b = (engine.other("backward", _ops(work.backward, cache), work.logits_elements)
                   + engine.accumulate(work.params_per_rank, work.param_tensors))
        step = engine.optimizer(work.params_per_rank, work.param_tensors,
                                work.optimizer.feature_dict()["params"])
        optimizer = optimizer if step is None else step
        grad_sync += engine.grad_reduce(work.params_per_rank)
    recompute = work.recompute_layers * lf
    fwd = n * lf + cache.total(work.forward) + extra_f
    bwd = n * lb + recompute + cache.total(work.backward) + extra_b
    mp = (n * (cache.comm(work.layer_forward, "mp_allreduce") + cache.comm(work.layer_backward, "mp_allreduce"))
          + work.recompute_layers * cache.comm(work.layer_forward, "mp_allreduce")
          + cache.comm(work.forward, "mp_allreduce") + cache.comm(work.backward, "mp_allreduce"))
    times = StageTimes(
        index=work.index, layer_forward=lf, layer_backward=lb, forward=fwd, backward=bwd,
        recompute=recompute, mp_allreduce=mp,
        send_activation=cache.time(work.send_activation) if work.send_activation else 0.0,
        send_gradient=cache.time(work.send_gradient) if work.send_gradient else 0.0,
        grad_allreduce=grad_sync, tied_allreduce=cache.total(work.tied_sync),
        optimizer=optimizer, param_allgather=cache.total(work.param_allgather))
    if engine is None:
        return times
    plain = _stage_times(work, cache, None)
    added = (engine.m * (fwd + bwd - plain.forward - plain.backward)
             + optimizer - plain.optimizer + grad_sync - plain.grad_allreduce)
    return replace(times, engine=added)


def _operator_seconds(work: StageWork, cache: _Cache, micro_batches: int) -> Dict[str, float]:
    out: Dict[str, float] = {}
    n = work.transformer_layers

    def add(calls, times: float):
        for c in calls:
            name = f"{c.op} {c.phase}" if isinstance(c, OpCall) else f"{c.purpose} {c.phase}"
            out[name] = out.get(name, 0.0) + cache.time(c) * c.count * times

    add(work.layer_forward, n * micro_batches)
    add(work.layer_backward, n * micro_batches)
    for c in work.layer_forward:
        if isinstance(c, OpCall):
            name = f"{c.op} recompute"
            out[name] = out.get(name, 0.0) + cache.time(c) * c.count * work.recompute_layers * micro_batches
    add(work.forward, micro_batches)
    add(work.backward, micro_batches)
    add(work.grad_sync, 1)
    add(work.param_allgather, 1)
    add((work.optimizer,), 1)
    return {k: v for k, v in out.items() if v > 0}


def estimate(decomp: Decomposition, profile) -> IterationEstimate:
    from .timeline import eq7_seconds
    engine = EngineTerms.of(profile, decomp)
    cache = _Cache(profile, engine)
    times = [_stage_times(w, cache, engine) for w in decomp.stages]
    costs = [StageCost(forward=t.forward, backward=t.backward, send_activation=t.send_activation,
                       send_gradient=t.send_gradient, grad_allreduce=t.grad_allreduce,
                       tied_allreduce=t.tied_allreduce, optimizer=t.optimizer,
                       param_allgather=t.param_allgather) for t in times]
    m = decomp.micro_batches
    tl = simulate_1f1b(costs, m)
    crit = tl.critical_stage
    c = tl.components
    first_layer_stage = next((t for t in times if t.layer_forward > 0), times[0])
    breakdown = {
        "encoder_forward": first_layer_stage.layer_forward,
        "encoder_backward": first_layer_stage.layer_backward,
        "stage_forward_max": max(t.forward for t in times),
        "stage_backward_max": max(t.backward for t in times),
        "pipeline": c.get("pipeline_seconds", 0.0),
        "bubble": c.get("bubble_seconds", 0.0),
        "dp_allreduce": max(t.grad_allreduce for t in times),
        "dp_allreduce_exposed": c.get("dp_allreduce_exposed", 0.0),
        "dp_allgather": max(t.param_allgather for t in times),
        "optimizer": max(t.optimizer for t in times),
        "update": c.get("update_seconds", 0.0),
        "mp_allreduce": times[crit].mp_allreduce * m,
        "pp_p2p": c.get("pp_p2p_seconds", 0.0),
        "tied_allreduce": max(t.tied_allreduce for t in times),
        "engine": max(t.engine for t in times),
    }
    return IterationEstimate(
        iteration_seconds=tl.iteration_seconds, timeline=tl, stages=tuple(times),
        breakdown=breakdown, operators=_operator_seconds(decomp.stages[crit], cache, m),
        flags=tuple(Flag(k, v) for k, v in sorted(cache.flags.items())),
        eq7_seconds=eq7_seconds(costs, m))
