"""Time the decomposition with a cluster profile and run the 1F1B timeline.

Every operator call is predicted once per distinct shape (all transformer layers share one),
so a 96-layer model costs no more to predict than a 2-layer one.

A profile made by `neox-perf calibrate` may also carry "engine" terms: what a step costs on
that machine beyond its operators, measured by running the reference model under DeepSpeed
at calibration shapes (predictors/fitting/engine_fit.py). They are applied when the run computes
in the precision they were measured in; bundled profiles have none. DeepSpeed's plain
optimizer and its ZeRO stage-1/2 optimizer do different work around the same all-reduce, and
each has its own terms, measured on its own path.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

from ..errors import ProfileError
from .operators import CommCall, Decomposition, OpCall, StageWork, framework_calls
from ..profile.protocol import Profile
from .collective_sources import ENGINE_RUNS, LINK_MODEL
from .corrections import (COMPUTE_BOUND, DATA_PARALLEL, FABRIC_NODES_FITTED, INSIDE_NODE, Corrections,
                          EngineTerms, StepTerms, of_profile, regime_of, unseen, unseen_of)
from .timeline import StageCost, StageCostError, Timeline, simulate_1f1b


@dataclass(frozen=True)
class Flag:
    what: str  # operator/collective and phase, e.g. "linear3 bwd" or "allreduce 16x4"
    reason: str
    # extrapolated: outside the samples (the reason says how far; a cap may follow it);
    # capped: raised to the GPU's achievable rate (predictors/achievable.py)
    kind: str = "extrapolated"


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
    # seconds per micro-batch of the all-gathers that rebuild the pipeline's partitioned
    # activation (forward) and gradient (backward) over the tensor-parallel group; inside
    # forward / backward, where the receiving rank spends them (operators._partition_allgathers)
    pp_allgather: float = 0.0
    # seconds per iteration this stage's replicas wait at the gradient all-reduce for the
    # slowest of them (the engine's dp_arrival term; in `engine` too)
    dp_wait: float = 0.0


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
    # share of the iteration spent in operators predicted outside their sampled ranges
    extrapolated_share: float = 0.0
    # per "op phase": the shape the profile's samples cover least well (any stage), when the
    # profile can tell (sampled, interpolated, in range, extrapolated and how far)
    coverage: Dict[str, Any] = field(default_factory=dict)
    # where the job runs, which picks the interval (corrections.REGIMES), and the share of the
    # iteration the critical stage spends in collectives that cross nodes
    regime: str = INSIDE_NODE
    inter_node_share: float = 0.0
    # per collective purpose (dp_allreduce, mp_allreduce, pp_p2p, ...): where its prices came
    # from -- sampled on this cluster, a description's link model, or the engine's own run
    collective_sources: Dict[str, str] = field(default_factory=dict)
    # per step term the profile's fitting runs could not see (corrections.unseen): the
    # iteration priced with it at the low and the high end of its 80% range; the interval
    # reaches what they say (span_unseen)
    unseen_terms: Dict[str, Tuple[float, float]] = field(default_factory=dict)


_RANK = {"sampled": 0, "in range": 1, "interpolated": 1, "extrapolated": 2}


def _worse(a, b) -> bool:
    return (_RANK.get(a.state, 1), a.factor) > (_RANK.get(b.state, 1), b.factor)


def _collective(call) -> bool:
    return not isinstance(call, OpCall)


class _Cache:
    def __init__(self, profile: Profile, engine: Optional["EngineTerms"] = None,
                 terms: StepTerms = StepTerms(), limits=None):
        self.profile = profile
        # the corrections in their order (corrections/__init__): the step terms' and the
        # engine's here, per call and per run of calls; the rest in _stage_times
        self.corrections = Corrections(terms, engine)
        self.engine = engine
        self.terms = terms
        self.limits = limits  # predictors.achievable.OperatorLimits, or None (no GPU row)
        self.memo: Dict[tuple, float] = {}
        self.flags: Dict[str, str] = {}
        self.capped_only: set = set()  # flags whose call was capped, not extrapolated
        self.extrapolated: set = set()  # memo keys whose prediction left the sampled range
        self.coverage: Dict[str, Any] = {}  # "op phase" -> its least-covered shape
        # per collective purpose, where its prices came from (neox_perf.prediction.collective_sources)
        self.sources: Dict[str, set] = {}

    def time(self, call) -> float:
        key = self.key(call)
        if isinstance(call, OpCall):
            if key not in self.memo:
                pred = self.profile.predict(call.op, call.phase, call.feature_dict())
                self._note(f"{call.op} {call.phase}", pred)
                self._cover(call)
                if pred.extrapolated:
                    self.extrapolated.add(key)
                self.memo[key] = self._operator_seconds(call, float(pred.seconds))
            return self.memo[key]
        measured = self.corrections.measured_collective(call)
        if measured is not None:
            self.sources.setdefault(call.purpose, set()).add(ENGINE_RUNS)
            return measured
        if key not in self.memo:
            pred = self.profile.predict_collective(call.kind, call.elements, call.nodes,
                                                   call.gpus_per_node)
            self._note(f"{call.kind} {call.nodes}x{call.gpus_per_node}", pred)
            if pred.extrapolated:
                self.extrapolated.add(key)
            source = getattr(pred, "source", "") or ""
            self.memo[key] = self.terms.collective(call.purpose, float(pred.seconds), call.nodes, source)
            if source:
                self.sources.setdefault(call.purpose, set()).add(source)
            if (call.purpose in DATA_PARALLEL and call.nodes > FABRIC_NODES_FITTED
                    and self.terms.dp_fabric_per_doubling > 0 and source == LINK_MODEL):
                what = f"{call.purpose} {call.nodes}x{call.gpus_per_node}"
                self.flags.setdefault(what, f"the data-parallel fabric term was fitted on groups of up to "
                                            f"{FABRIC_NODES_FITTED} nodes; this group spans {call.nodes} "
                                            f"(priced at {FABRIC_NODES_FITTED}, the interval widens)")
                self.extrapolated.add(key)
        return self.memo[key]

    def _operator_seconds(self, call: OpCall, seconds: float) -> float:
        """In-situ seconds of one call the profile predicts at `seconds`: priced in the run's
        precision, scaled by the step terms, and never faster than the GPU's achievable rate
        (predictors/achievable.py); a capped call is flagged like an extrapolated one."""
        if self.limits is None:
            return self.terms.operator(call.op, seconds)
        seconds = self.terms.operator(call.op, self.limits.rescaled(call, seconds))
        seconds, why = self.limits.capped(call, seconds)
        if why:
            what = f"{call.op} {call.phase}"
            have = self.flags.get(what)
            if have is None:
                self.capped_only.add(what)
                self.flags[what] = why
            elif why not in have:  # a reason already given stays, beside the others
                self.flags[what] = f"{have}; {why}"
        return seconds

    def key(self, call) -> tuple:
        if isinstance(call, OpCall):
            return ("op", call.op, call.phase, call.features, call.launches)
        return ("comm", call.kind, call.purpose, call.elements, call.nodes, call.gpus_per_node)

    def _cover(self, call) -> None:
        try:
            got = self.profile.coverage(call.op, call.phase, call.feature_dict())
        except Exception:  # noqa: BLE001 - a profile without the model has said so in predict
            return
        name = f"{call.op} {call.phase}"
        have = self.coverage.get(name)
        if have is None or _worse(got, have):
            self.coverage[name] = got

    def _note(self, what: str, pred) -> None:
        if pred.extrapolated and what not in self.flags:
            self.flags[what] = pred.reason or "outside the sampled range"
        elif pred.extrapolated and what in self.capped_only:
            reason = pred.reason or "outside the sampled range"
            self.flags[what] = f"{reason}; {self.flags[what]}"
            self.capped_only.discard(what)

    def total(self, calls) -> float:
        """Seconds of one run of calls (a layer phase, the head, the loss): its operators queue
        on the device as the host issues them (StepTerms.issued); its collectives add."""
        return self.operators(calls) + sum(seconds for _, seconds in self.priced(calls, _collective))

    def priced(self, calls, which=None) -> List[Tuple[object, float]]:
        """(call, its seconds times its count) for each call of one run of calls that ``which``
        accepts (default every one). A caller that sums a part of the run says which, so the
        rest is not priced for nothing (total and comm run per stage and phase, for every
        layout the planner times)."""
        return [(c, self.time(c) * c.count) for c in calls if which is None or which(c)]

    def _device_and_launches(self, calls) -> Tuple[float, float]:
        return sum(self.time(c) * c.count for c in calls if isinstance(c, OpCall)), framework_calls(calls)

    def operators(self, calls) -> float:
        """Seconds of the operators of one run of calls, issued by the host (StepTerms.issued)."""
        return self.terms.issued(*self._device_and_launches(calls))

    def memory_bound(self, calls) -> float:
        """Device seconds of the memory-bound operators (not COMPUTE_BOUND) of one run of calls."""
        return sum(self.time(c) * c.count for c in calls
                   if isinstance(c, OpCall) and c.op not in COMPUTE_BOUND)

    def host_wait(self, calls) -> float:
        """What the device waits for the host in one run of calls: its operators' issued time
        less their kernels."""
        device, launches = self._device_and_launches(calls)
        return self.terms.issued(device, launches) - device

    def comm(self, calls, purpose: str) -> float:
        return sum(seconds for _, seconds in self.priced(
            calls, lambda c: isinstance(c, CommCall) and c.purpose == purpose))


def _update(work: StageWork, cache: _Cache, engine: Optional[EngineTerms]) -> Tuple[float, float]:
    """(optimizer step before the profile's per-step term, gradient sync) of one stage per
    iteration: what _stage_times and stage_tails time alike."""
    optimizer = cache.time(work.optimizer)
    grad_sync = cache.total(work.grad_sync)
    if engine is not None:
        step = engine.optimizer(work.params_per_rank, work.param_tensors,
                                work.optimizer.feature_dict()["params"])
        optimizer = optimizer if step is None else step
        grad_sync += engine.grad_reduce(work.params_per_rank)
    return optimizer, grad_sync


def _stage_times(work: StageWork, cache: _Cache, engine: Optional[EngineTerms] = None,
                 pipeline_engine: bool = False) -> StageTimes:
    lf = cache.total(work.layer_forward)
    lb = cache.total(work.layer_backward)
    n = work.transformer_layers
    head_f, head_b = cache.total(work.forward), cache.total(work.backward)
    extra_f = extra_b = 0.0
    optimizer, grad_sync = _update(work, cache, engine)
    if engine is not None:
        lf += engine.layer("forward", cache.operators(work.layer_forward),
                           cache.memory_bound(work.layer_forward))
        lb += engine.layer("backward", cache.operators(work.layer_backward),
                           cache.memory_bound(work.layer_backward))
        extra_f = engine.other("forward", cache.operators(work.forward), work.logits_elements)
        extra_b = engine.other("backward", cache.operators(work.backward), work.logits_elements)
        # tensor-parallel ranks meeting at their all-reduces (engine_fit's tensor-parallel pass)
        lf += engine.tensor_parallel("layer", "forward", lf, work.layer_forward)
        lb += engine.tensor_parallel("layer", "backward", lb, work.layer_backward)
        extra_f += engine.tensor_parallel("other", "forward", head_f + extra_f, work.forward)
        extra_b += engine.tensor_parallel("other", "backward", head_b + extra_b, work.backward)
        extra_b += engine.accumulate(work.params_per_rank, work.param_tensors)
    recompute = work.recompute_layers * lf
    # the engine's own per-micro-batch work (instructions, data, loss scaling) and per-step
    # bookkeeping, where the profile's step terms measured them
    fwd = n * lf + head_f + extra_f + cache.terms.per_micro_batch(pipeline_engine)
    bwd = n * lb + recompute + head_b + extra_b
    optimizer += cache.terms.step_s
    mp = (n * (cache.comm(work.layer_forward, "mp_allreduce") + cache.comm(work.layer_backward, "mp_allreduce"))
          + work.recompute_layers * cache.comm(work.layer_forward, "mp_allreduce")
          + cache.comm(work.forward, "mp_allreduce") + cache.comm(work.backward, "mp_allreduce"))
    times = StageTimes(
        index=work.index, layer_forward=lf, layer_backward=lb, forward=fwd, backward=bwd,
        recompute=recompute, mp_allreduce=mp,
        send_activation=cache.time(work.send_activation) if work.send_activation else 0.0,
        send_gradient=cache.time(work.send_gradient) if work.send_gradient else 0.0,
        grad_allreduce=grad_sync, tied_allreduce=cache.total(work.tied_sync),
        optimizer=optimizer, param_allgather=cache.total(work.param_allgather),
        pp_allgather=cache.comm(work.forward, "pp_allgather") + cache.comm(work.backward, "pp_allgather"))
    if engine is None:
        return times
    plain = _stage_times(work, cache, None, pipeline_engine)
    added = (engine.m * (fwd + bwd - plain.forward - plain.backward)
             + optimizer - plain.optimizer + grad_sync - plain.grad_allreduce)
    return replace(times, engine=added)


def _operator_seconds(work: StageWork, cache: _Cache,
                      micro_batches: int) -> Tuple[Dict[str, float], float]:
    """Seconds per iteration per operator+phase on one stage, and how many of those seconds
    come from predictions outside the sampled ranges."""
    out: Dict[str, float] = {}
    extrapolated = 0.0
    n = work.transformer_layers

    def add(calls, times: float, phase: Optional[str] = None):
        nonlocal extrapolated
        for c, seconds in cache.priced(calls):
            if phase is not None and not isinstance(c, OpCall):
                continue
            label = phase or c.phase
            name = f"{c.op} {label}" if isinstance(c, OpCall) else f"{c.purpose} {label}"
            seconds *= times
            out[name] = out.get(name, 0.0) + seconds
            if cache.key(c) in cache.extrapolated:
                extrapolated += seconds

    # each run of calls the host issues as one queue (estimate's layer phases, head, loss), and
    # the device's wait for the host in it, charged as one line per phase
    queued = ((work.layer_forward, n, None, "fwd"), (work.layer_backward, n, None, "bwd"),
              (work.layer_forward, work.recompute_layers, "recompute", "recompute"),
              (work.forward, 1, None, "fwd"), (work.backward, 1, None, "bwd"))
    for calls, per_micro_batch, phase, issued_as in queued:
        times = per_micro_batch * micro_batches
        add(calls, times, phase)
        wait = cache.host_wait(calls) * times
        if wait > 0:
            name = f"host dispatch {issued_as}"
            out[name] = out.get(name, 0.0) + wait
    add(work.grad_sync, 1)
    add(work.param_allgather, 1)
    add((work.optimizer,), 1)
    return {k: v for k, v in out.items() if v > 0}, extrapolated


def _inter_node_seconds(work: StageWork, cache: _Cache, micro_batches: int) -> Optional[float]:
    """Seconds per iteration one stage's ranks spend in collectives that cross nodes (its sends
    and receives included: a pipeline send blocks both ends); None when none crosses."""
    n, m = work.transformer_layers, micro_batches
    runs = ((work.layer_forward, (n + work.recompute_layers) * m), (work.layer_backward, n * m),
            (work.forward, m), (work.backward, m), (work.grad_sync, 1), (work.tied_sync, 1),
            (work.param_allgather, 1), ((work.send_activation, work.send_gradient), m))
    seconds, crosses = 0.0, False
    for calls, times in runs:
        for _, priced in cache.priced([c for c in calls if c is not None],
                                      lambda c: isinstance(c, CommCall) and c.nodes > 1):
            crosses = True
            seconds += priced * times
    return seconds if crosses else None


def _with_dp_wait(times: StageTimes, wait: float) -> StageTimes:
    """A stage's times with its replicas' wait for the slowest of them at the gradient
    all-reduce: the iteration's work of the stage is what they drifted apart over (a replica
    meets its pipeline neighbours every micro-batch, but its own replicas only there)."""
    return replace(times, dp_wait=wait, engine=times.engine + wait) if wait > 0 else times


def stage_tails(decomp: Decomposition, profile: Profile,
                limits=None) -> Tuple[Tuple[float, float, float, float], ...]:
    """Per stage, (gradient sync, optimizer step, parameter all-gather) seconds per iteration
    and the replicas' wait for the slowest per second of the stage's work: the StageTimes fields
    estimate() gives them (grad_allreduce, optimizer, param_allgather, dp_wait over the
    micro-batches' forward + backward), without the layers, the timeline and the rest (the
    planner's quick search needs these of many layouts; tests/cli/test_plan_core.py holds them
    equal)."""
    corrections = Corrections.of(profile, decomp)
    engine = corrections.engine
    cache = _Cache(profile, engine, corrections.step, limits)
    out = []
    for work in decomp.stages:
        optimizer, grad_sync = _update(work, cache, engine)
        share = engine.dp_wait(work.grad_sync, 1.0) if engine is not None else 0.0
        out.append((grad_sync, optimizer + cache.terms.step_s, cache.total(work.param_allgather), share))
    return tuple(out)


def estimate(decomp: Decomposition, profile: Profile, terms: Optional[StepTerms] = None,
             limits=None, events: bool = True) -> IterationEstimate:
    """terms: the step terms to apply (default: the profile's own; fitting passes its trials).
    limits: the run's precision rescale and achievable-rate cap on the profile's GPU
    (predictors.achievable.limits, which predict.predict and the step-term fit pass); None
    prices operators as the profile predicts them. events: False leaves the timeline's events
    out (timeline.simulate_1f1b), nothing else."""
    from .timeline import eq7_seconds
    corrections = Corrections.of(profile, decomp, terms)
    engine = corrections.engine
    cache = _Cache(profile, engine, corrections.step, limits)
    m = decomp.micro_batches
    times = [_stage_times(w, cache, engine, decomp.pipeline_engine) for w in decomp.stages]
    if engine is not None:
        times = [_with_dp_wait(t, engine.dp_wait(w.grad_sync, m * (t.forward + t.backward)))
                 for t, w in zip(times, decomp.stages)]
    costs = [StageCost(forward=t.forward, backward=t.backward, send_activation=t.send_activation,
                       send_gradient=t.send_gradient, grad_allreduce=t.grad_allreduce,
                       tied_allreduce=t.tied_allreduce, optimizer=t.optimizer,
                       param_allgather=t.param_allgather, dp_wait=t.dp_wait) for t in times]
    try:
        tl = simulate_1f1b(costs, m, events=events)
    except StageCostError as exc:
        # Every term is kept a time where it is priced (an engine term's floor, the step terms'
        # own validation); should one still come out negative, the user sees which profile and
        # stage, in one line, and the hook's prediction says so instead of an internal error.
        raise ProfileError(getattr(profile, "path", profile.name),
                           f"cluster profile {profile.name!r} prices stage {exc.stage}'s "
                           f"{exc.name} at {exc.value!r} s, not a time",
                           "recalibrate the profile (neox-perf calibrate), or predict with "
                           "another --cluster; please report it") from None
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
        "dp_wait": max(t.dp_wait for t in times),
        "dp_allreduce_exposed": c.get("dp_allreduce_exposed", 0.0),
        "dp_allgather": max(t.param_allgather for t in times),
        "optimizer": max(t.optimizer for t in times),
        "update": c.get("update_seconds", 0.0),
        "mp_allreduce": times[crit].mp_allreduce * m,
        "pp_p2p": c.get("pp_p2p_seconds", 0.0),
        "pp_allgather": times[crit].pp_allgather * m,
        "tied_allreduce": max(t.tied_allreduce for t in times),
        "engine": max(t.engine for t in times),
    }
    operators, extrapolated = _operator_seconds(decomp.stages[crit], cache, m)
    seconds = tl.iteration_seconds
    across = [s for s in (_inter_node_seconds(w, cache, m) for w in decomp.stages) if s is not None]
    regime = regime_of(bool(across), decomp.gpus_per_node)
    interval = corrections.intervals.of(regime) if corrections.intervals is not None else None
    inter_share = min(max(across, default=0.0) / seconds, 1.0) if seconds > 0 else 0.0
    return IterationEstimate(
        iteration_seconds=seconds, timeline=tl, stages=tuple(times),
        breakdown=breakdown, operators=operators,
        flags=tuple(Flag(k, v, "capped" if k in cache.capped_only else "extrapolated")
                    for k, v in sorted(cache.flags.items())),
        eq7_seconds=eq7_seconds(costs, m),
        interval_seconds=interval.around(seconds, extrapolated / seconds, inter_share)
        if interval and seconds > 0 else None,
        extrapolated_share=extrapolated / seconds if seconds > 0 else 0.0,
        coverage=dict(sorted(cache.coverage.items())),
        regime=regime, inter_node_share=inter_share,
        collective_sources={k: " + ".join(sorted(v)) for k, v in sorted(cache.sources.items())})


def span_unseen(decomp: Decomposition, profile: Profile, est: IterationEstimate,
                limits=None) -> IterationEstimate:
    """``est`` (estimate()'s, with the profile's own terms) with its 80% interval reaching the
    step terms the profile's fitting runs could not see: each priced at either end of its range
    (corrections/unseen.py). The point prediction stays; a profile without such terms, or
    without an interval, comes back as it was."""
    sd = unseen_of(profile)  # read first: most profiles have none, and this is check's path
    if not sd or not est.interval_seconds:
        return est
    step, _ = of_profile(profile)
    priced = {name: (estimate(decomp, profile, low, limits, events=False).iteration_seconds,
                     estimate(decomp, profile, high, limits, events=False).iteration_seconds)
              for name, low, high in unseen.ends(step, sd)}
    by = unseen.spread(est.iteration_seconds, priced.values())
    return replace(est, interval_seconds=unseen.widened(est.interval_seconds, by), unseen_terms=priced)
