"""One DeepSpeed pipeline training iteration, simulated stage by stage and micro-batch by micro-batch.

The paper this project starts from (arXiv 2509.22832, Eq. 7) closes the pipeline with a formula:

    Runtime = (m - 1 + p) * (Max_Fwd + Max_Bwd) + First_Stage_Gradient_Sync + Max_Update

That is exact only for identical stages. Here every stage instead replays the instruction stream of
DeepSpeed's ``TrainSchedule`` (deepspeed/runtime/pipe/schedule.py), and the stages are coupled only
by the things that really couple them in ``PipelineEngine`` (deepspeed/runtime/pipe/engine.py):

* p2p send/recv pairs.  DeepSpeed calls ``torch.distributed.send``/``recv`` with ``async_op=False``
  (pipe/p2p.py ``send``/``recv``), which is ``isend(...).wait()``.  With NCCL the wait makes the
  compute stream depend on the transfer, and a send larger than NCCL's staging buffer (activations
  are b*s*h*2 bytes, far above it) cannot finish before the peer has posted its recv.  So a transfer
  is modelled as a rendezvous: it starts when *both* sides have reached the matching instruction and
  blocks both until it ends.  The cost is the sender's (as the paper charges p2p to the sender);
  the receiver spends that time waiting.  ``p2p_rendezvous=False`` gives buffered (eager) sends for
  comparison.
* ``ReduceTiedGrads`` is an all-reduce over the ranks sharing a tied weight (normally the first and
  last stage), so it starts on all of them when the slowest one gets there.
* The optimizer step starts with an overflow check and/or a gradient-norm all-reduce over the
  grid's "model parallel" group, which in a pipeline grid is every pipe x tensor rank of one
  data-parallel replica.  So no stage updates before *every* stage has finished ``ReduceGrads``.
  ``optimizer_sync=False`` drops that barrier (fp32 without clipping, or ZeRO with
  ``compute_grad_norm: false`` and no overflow check).
* ``train_batch`` ends with a loss broadcast over the pipe group, so the iteration ends when the
  slowest stage finishes its update.

Pure Python on purpose: it runs inside the CLI's time budget and must not import torch/deepspeed.
"""
from __future__ import annotations

import gc
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType
from typing import Mapping, NamedTuple, Sequence, Tuple

__all__ = [
    "StageCost",
    "StageCostError",
    "Event",
    "Timeline",
    "simulate_1f1b",
    "eq7_seconds",
    "stage_instructions",
]


@dataclass(frozen=True)
class StageCost:
    """Seconds, for one pipeline stage as seen by one of its ranks."""

    # one micro-batch forward incl. its tensor-parallel all-reduces and, past the first stage,
    # the all-gather of its partitioned input (DeepSpeed runs it inside ForwardPass, after the recv)
    forward: float
    # one micro-batch backward incl. recompute when activation checkpointing is on and, before
    # the last stage, the all-gathers of its partitioned output and received gradient
    backward: float
    send_activation: float  # p2p send of one micro-batch's activation to the next stage (ignored on the last)
    send_gradient: float  # p2p send of one micro-batch's input-gradient to the previous stage (ignored on the first)
    grad_allreduce: float  # data-parallel gradient all-reduce of this stage's parameters (0 when dp == 1)
    tied_allreduce: float = 0.0  # ReduceTiedGrads; every stage with a cost > 0 is in the one tied group
    optimizer: float = 0.0  # optimizer step of this stage
    param_allgather: float = 0.0  # ZeRO-1 parameter all-gather after the step (0 when zero stage 0 or dp == 1)
    # per iteration, this stage's replicas waiting at the gradient all-reduce for the slowest of
    # them (they ran the iteration's work at different speeds): before grad_allreduce, inside
    # the rank's ReduceGrads, idle (0 when dp == 1 or the profile did not measure it)
    dp_wait: float = 0.0


class Event(NamedTuple):
    """One interval on one stage's stream.

    kinds: forward, backward, send_act, send_grad (the transfer, on the sender), send_wait (sender
    waiting for the receiver to post its recv), recv_wait (receiver blocked until the data has
    arrived, transfer included), tied_wait, tied_allreduce, dp_wait (waiting for the slowest
    data-parallel replica), grad_allreduce, sync_wait (waiting for
    the optimizer's cross-stage all-reduce), optimizer, allgather.  micro_batch is -1 for the
    end-of-batch events.  Zero-length waits are left out.  Timeline.events lists each stage's
    events in time order; stages are interleaved in simulation order.
    """

    stage: int
    kind: str
    micro_batch: int
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    iteration_seconds: float
    events: Tuple[Event, ...]
    # Per stage, seconds.  busy: own work (compute, own sends, collectives, update).  idle: the rest
    # of the iteration.  bubble: idle time before the stage's end-of-batch collectives start,
    # including time blocked in a recv while the peer's send is in flight (p2p is the sender's).
    busy: Tuple[float, ...]
    idle: Tuple[float, ...]
    bubble: Tuple[float, ...]
    stage_ready: Tuple[float, ...]  # end of each stage's 1F1B instruction stream
    grad_sync_end: Tuple[float, ...]  # end of each stage's ReduceGrads
    critical_stage: int  # the stage whose gradient sync finishes last
    # For the report.  pipeline_seconds: end of the last backward on any stage.  The critical stage
    # splits as stage_ready = critical_compute_seconds + pp_p2p_seconds (its own sends) +
    # bubble_seconds.  *_exposed: the critical stage's tied / gradient all-reduce time past
    # pipeline_seconds (the gradient all-reduce's with its wait for the slowest replica).
    # update_seconds: optimizer + all-gather on the critical path.  So
    # iteration_seconds == pipeline_seconds + tied_allreduce_exposed + dp_allreduce_exposed + update_seconds.
    # eq7_seconds: the paper's formula on the same inputs.
    components: Mapping[str, float] = field(hash=False)


# Instruction codes; small ints keep the hot loop cheap.
_FWD, _BWD, _SEND_ACT, _RECV_ACT, _SEND_GRAD, _RECV_GRAD = range(6)
_KIND_NAMES = ("forward", "backward", "send_act", "recv_act", "send_grad", "recv_grad")


@lru_cache(maxsize=512)
def _program(num_stages: int, micro_batches: int, stage: int) -> Tuple[Tuple[int, int], ...]:
    """The compute and p2p instructions of TrainSchedule for one stage, as (code, micro_batch).

    TrainSchedule runs 2*(m+p-1) steps; even/odd stages take forward and backward steps in
    opposite phase so adjacent stages always meet at matching send/recv pairs.  Its per-parity
    id helpers reduce to: forward step iff step+stage is even, forward id (step-stage)/2,
    backward id (step+stage+1)/2 - p.  A step's output is sent at the *next* step (SendGrad at
    the start of a forward step, SendActivation after RecvGrad in a backward step), which is
    why a result can sit ready while its stage waits on another transfer.
    """
    p, m, s = num_stages, micro_batches, stage
    has_prev = s > 0
    has_next = s < p - 1
    ops = []
    prev = -1
    for step in range(2 * (m + p - 1)):
        if (step + s) % 2 == 0:
            mb = (step - s) // 2
            forward = True
        else:
            mb = (step + s + 1) // 2 - p
            forward = False
        valid = 0 <= mb < m
        prev_valid = 0 <= prev < m
        if forward:
            if prev_valid and has_prev:
                ops.append((_SEND_GRAD, prev))
            if valid and has_prev:
                ops.append((_RECV_ACT, mb))
            if valid:
                ops.append((_FWD, mb))
        else:
            if valid and has_next:
                ops.append((_RECV_GRAD, mb))
            if prev_valid and has_next:
                ops.append((_SEND_ACT, prev))
            if valid:
                ops.append((_BWD, mb))
        prev = mb
    return tuple(ops)


def stage_instructions(num_stages: int, micro_batches: int, stage: int) -> Tuple[Tuple[str, int], ...]:
    """The (kind, micro_batch) stream one stage executes; kinds: forward, backward, send_act,
    recv_act, send_grad, recv_grad.  Public so tests can hold it against DeepSpeed itself."""
    _check_shape(num_stages, micro_batches)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} outside 0..{num_stages - 1}")
    return tuple((_KIND_NAMES[code], mb) for code, mb in _program(num_stages, micro_batches, stage))


def _check_shape(num_stages: int, micro_batches: int) -> None:
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    if num_stages < 1:
        raise ValueError("need at least one pipeline stage")


class StageCostError(ValueError):
    """A stage cost that is not a time (negative, NaN, infinite); the caller that priced it
    (estimate) names where the number came from."""

    def __init__(self, stage: int, name: str, value):
        self.stage, self.name, self.value = stage, name, value
        super().__init__(f"stage {stage}: {name} must be a finite number >= 0, got {value!r}")


def _check_costs(stages: Sequence[StageCost]) -> None:
    for i, c in enumerate(stages):
        for name in ("forward", "backward", "send_activation", "send_gradient", "grad_allreduce",
                     "tied_allreduce", "optimizer", "param_allgather", "dp_wait"):
            v = getattr(c, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise StageCostError(i, name, v)


def eq7_seconds(stages: Sequence[StageCost], micro_batches: int) -> float:
    """The paper's Eq. 7.  p2p is charged to the sender's pass as the paper does
    (Fwd_s = forward + send_activation, Bwd_s = backward + send_gradient, excluding sends that a
    first/last stage never makes); ReduceTiedGrads is not in the formula."""
    stages = list(stages)
    p = len(stages)
    _check_shape(p, micro_batches)
    _check_costs(stages)
    max_fwd = max(c.forward + (c.send_activation if s < p - 1 else 0.0) for s, c in enumerate(stages))
    max_bwd = max(c.backward + (c.send_gradient if s > 0 else 0.0) for s, c in enumerate(stages))
    max_update = max(c.optimizer + c.param_allgather for c in stages)
    return (micro_batches - 1 + p) * (max_fwd + max_bwd) + stages[0].grad_allreduce + max_update


def simulate_1f1b(
    stages: Sequence[StageCost],
    micro_batches: int,
    *,
    p2p_rendezvous: bool = True,
    optimizer_sync: bool = True,
    events: bool = True,
) -> Timeline:
    """Simulate one ``train_batch`` (gradient_accumulation_steps = micro_batches) of DeepSpeed's
    PipelineEngine, stage by stage.  See the module docstring for what couples the stages.
    ``events=False``: the same timeline without its events (``events == ()``), for callers that
    read only its times -- the planner times thousands of micro-batch x stage streams."""
    # ~4*p*m short-lived tuples and no reference cycles: cyclic GC passes triggered by them (full
    # ones are slow once torch is imported in the same process) would triple the worst case.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate(stages, micro_batches, p2p_rendezvous, optimizer_sync, events)
    finally:
        if gc_was_enabled:
            gc.enable()


# Recent instruction-stream simulations, bounded by the events and stages they hold.
_STREAMS: "OrderedDict[tuple, tuple]" = OrderedDict()
_STREAM_EVENTS_MAX = 200_000


def _remember(key, value) -> None:
    _STREAMS[key] = value
    held = sum(len(v[0]) + len(v[1]) for v in _STREAMS.values())
    while held > _STREAM_EVENTS_MAX and len(_STREAMS) > 1:
        _, old = _STREAMS.popitem(last=False)
        held -= len(old[0]) + len(old[1])


def _streams(p: int, m: int, fwd, bwd, send_act, send_grad, p2p_rendezvous: bool,
             record: bool = True):
    """Every stage's TrainSchedule stream up to its last backward: (events, clock, last backward
    end, own p2p seconds) per stage. `record` False: no events (half the time of a long
    stream; nothing else depends on them)."""
    progs = [_program(p, m, s) for s in range(p)]

    ptr = [0] * p
    clock = [0.0] * p
    # When a stage is blocked on a p2p instruction: the time it got there; else None.
    posted = [None] * p
    last_bwd_end = [0.0] * p
    sent = [0.0] * p  # own transfer time, the p2p part of busy
    # Eager mode only: arrival times queued per channel, act[s] is s->s+1, grad[s] is s+1->s.
    act_q = [[] for _ in range(p)]
    grad_q = [[] for _ in range(p)]
    act_head = [0] * p
    grad_head = [0] * p

    events = []
    ev = events.append
    # tuple.__new__ skips NamedTuple's Python-level __new__: ~2x cheaper, and there are ~4*p*m events.
    _new = tuple.__new__
    runnable = list(range(p - 1, -1, -1))

    while runnable:
        s = runnable.pop()
        prog = progs[s]
        n = len(prog)
        i = ptr[s]
        t = clock[s]
        while i < n:
            code, mb = prog[i]
            if code == _FWD:
                e = t + fwd[s]
                if record:
                    ev(_new(Event, (s, "forward", mb, t, e)))
                t = e
                i += 1
                continue
            if code == _BWD:
                e = t + bwd[s]
                if record:
                    ev(_new(Event, (s, "backward", mb, t, e)))
                t = e
                last_bwd_end[s] = e
                i += 1
                continue

            is_send = code == _SEND_ACT or code == _SEND_GRAD
            peer = s + 1 if (code == _SEND_ACT or code == _RECV_GRAD) else s - 1

            if not p2p_rendezvous:
                if is_send:
                    cost = send_act[s] if code == _SEND_ACT else send_grad[s]
                    e = t + cost
                    if cost > 0:
                        if record:
                            ev(_new(Event, (s, "send_act" if code == _SEND_ACT else "send_grad", mb, t, e)))
                    sent[s] += cost
                    t = e
                    i += 1
                    # Hand the arrival straight to a receiver already waiting for it.
                    want = _RECV_ACT if code == _SEND_ACT else _RECV_GRAD
                    if posted[peer] is not None and progs[peer][ptr[peer]] == (want, mb):
                        tr = posted[peer]
                        done = e if e > tr else tr
                        if done > tr:
                            if record:
                                ev(_new(Event, (peer, "recv_wait", mb, tr, done)))
                        posted[peer] = None
                        clock[peer] = done
                        ptr[peer] += 1
                        runnable.append(peer)
                    elif code == _SEND_ACT:
                        act_q[s].append(e)
                    else:
                        grad_q[peer].append(e)
                    continue
                if code == _RECV_ACT:
                    q, h, k = act_q[peer], act_head, peer
                else:
                    q, h, k = grad_q[s], grad_head, s
                if h[k] < len(q):
                    arrival = q[h[k]]
                    h[k] += 1
                    if arrival > t:
                        if record:
                            ev(_new(Event, (s, "recv_wait", mb, t, arrival)))
                        t = arrival
                    i += 1
                    continue
                posted[s] = t
                break

            # Rendezvous: the peer must already be parked on the complementary instruction.
            tp = posted[peer]
            if tp is not None:
                pcode, pmb = progs[peer][ptr[peer]]
                # Codes pair up as send = recv - 1 on each channel.
                if pcode == (code + 1 if is_send else code - 1):
                    if pmb != mb:
                        raise RuntimeError(
                            f"p2p mismatch: stage {s} {_KIND_NAMES[code]} mb {mb} vs stage {peer} "
                            f"{_KIND_NAMES[pcode]} mb {pmb}")
                    if is_send:
                        sender, ts, receiver, tr, scode = s, t, peer, tp, code
                    else:
                        sender, ts, receiver, tr, scode = peer, tp, s, t, pcode
                    cost = send_act[sender] if scode == _SEND_ACT else send_grad[sender]
                    start = ts if ts > tr else tr
                    e = start + cost
                    if start > ts:
                        if record:
                            ev(_new(Event, (sender, "send_wait", mb, ts, start)))
                    if cost > 0:
                        if record:
                            ev(_new(Event, (sender, "send_act" if scode == _SEND_ACT else "send_grad", mb, start, e)))
                    if e > tr:
                        if record:
                            ev(_new(Event, (receiver, "recv_wait", mb, tr, e)))
                    sent[sender] += cost
                    posted[peer] = None
                    clock[peer] = e
                    ptr[peer] += 1
                    runnable.append(peer)
                    t = e
                    i += 1
                    continue
            posted[s] = t
            break
        ptr[s] = i
        clock[s] = t

    stuck = [s for s in range(p) if ptr[s] < len(progs[s])]
    if stuck:
        raise RuntimeError(f"pipeline deadlock: stages {stuck} blocked on p2p")
    return tuple(events), tuple(clock), tuple(last_bwd_end), tuple(sent)


def _lockstep_streams(p: int, m: int, fwd, bwd, send_act, send_grad):
    """What _streams(..., p2p_rendezvous=True, record=False) returns, step by step of
    TrainSchedule instead of instruction by instruction: equal to the last bit (the same
    additions and maxima per stage, in the same order; tests/test_timeline.py holds the two
    together), 3-5x faster (benchmarks/unit_speed.py: pp 32 x 1,024 micro-batches, the
    quick search's longest stream, 16 against 54 ms; pp 16 x 128, 1.0 against 4.7 ms).

    Why a step at a time is exact: at step k, the stages with k + s even take a forward step
    and the others a backward step, and every p2p instruction of the step pairs a forward-step
    stage s with its predecessor s - 1 in that same step (s's SendGrad of the micro-batch
    s - 1 then runs backward meets s - 1's RecvGrad, then s's RecvActivation meets
    s - 1's SendActivation; _program's id helpers give both sides the same micro-batch). So a
    step is disjoint pairs (s - 1, s), each two rendezvous then each side's compute, and the
    stages outside a pair (stage 0 in a forward step, the last in a backward one) only compute.
    """
    clock = [0.0] * p
    last_bwd_end = [0.0] * p
    sent = [0.0] * p
    last = p - 1
    for k in range(2 * (m + p - 1)):
        first = k & 1  # the first forward-step stage that has a predecessor
        if not first:
            if (k >> 1) < m:  # stage 0's forward of micro-batch k / 2
                clock[0] += fwd[0]
            first = 2
        for s in range(first, p, 2):
            a = s - 1
            ta = clock[a]
            tb = clock[s]
            grad_mb = ((k + s) >> 1) - p  # s sends it back, then s - 1 runs its backward
            grad = 0 <= grad_mb < m
            if grad:
                start = ta if ta > tb else tb
                cost = send_grad[s]
                ta = tb = start + cost
                sent[s] += cost
            act_mb = (k - s) >> 1  # s - 1 sends it on, then s runs its forward
            if 0 <= act_mb < m:
                start = ta if ta > tb else tb
                cost = send_act[a]
                ta = tb = start + cost
                sent[a] += cost
                tb = tb + fwd[s]
            if grad:
                ta = ta + bwd[a]
                last_bwd_end[a] = ta
            clock[a] = ta
            clock[s] = tb
        if (k + last) & 1 and 0 <= ((k + last + 1) >> 1) - p < m:  # the last stage's backward
            clock[last] += bwd[last]
            last_bwd_end[last] = clock[last]
    return (), tuple(clock), tuple(last_bwd_end), tuple(sent)


def _simulate(stages: Sequence[StageCost], micro_batches: int, p2p_rendezvous: bool,
              optimizer_sync: bool, record: bool = True) -> Timeline:
    stages = list(stages)
    p = len(stages)
    m = micro_batches
    _check_shape(p, m)
    _check_costs(stages)

    fwd = [c.forward for c in stages]
    bwd = [c.backward for c in stages]
    send_act = [c.send_activation for c in stages]
    send_grad = [c.send_gradient for c in stages]
    # Layouts that differ only after the last backward (ZeRO stage, data-parallel sync, update)
    # replay the same instruction streams: simulate those once.
    # (A stream simulated with its events serves a caller that wants none, not the reverse.)
    key = (tuple(fwd), tuple(bwd), tuple(send_act), tuple(send_grad), m, p2p_rendezvous)
    hit = _STREAMS.get(key + (True,))
    if hit is None and not record:
        hit = _STREAMS.get(key + (False,))
    if hit is None:
        if p2p_rendezvous and not record:
            hit = _lockstep_streams(p, m, fwd, bwd, send_act, send_grad)
        else:
            hit = _streams(p, m, fwd, bwd, send_act, send_grad, p2p_rendezvous, record)
        _remember(key + (record,), hit)
    stream_events, clock, last_bwd_end, sent = hit
    clock = list(clock)
    events = list(stream_events) if record else []
    ev = events.append
    _new = tuple.__new__

    # End of batch: ReduceTiedGrads, ReduceGrads, OptimizerStep, in that order on every stage.
    ready = list(clock)
    tied_group = [s for s in range(p) if stages[s].tied_allreduce > 0]
    tied_start = max((ready[s] for s in tied_group), default=0.0)
    tied_end = list(ready)
    for s in tied_group:
        if tied_start > ready[s]:
            ev(_new(Event, (s, "tied_wait", -1, ready[s], tied_start)))
        tied_end[s] = tied_start + stages[s].tied_allreduce
        ev(_new(Event, (s, "tied_allreduce", -1, tied_start, tied_end[s])))

    ar_end = [0.0] * p
    for s in range(p):
        arrived = tied_end[s] + stages[s].dp_wait
        if stages[s].dp_wait > 0:
            ev(_new(Event, (s, "dp_wait", -1, tied_end[s], arrived)))
        ar_end[s] = arrived + stages[s].grad_allreduce
        if stages[s].grad_allreduce > 0:
            ev(_new(Event, (s, "grad_allreduce", -1, arrived, ar_end[s])))
    sync = max(ar_end)
    # Lowest index on ties: with equal stages that is stage 0, the stage Eq. 7 names.
    critical = ar_end.index(sync)

    stage_end = [0.0] * p
    for s in range(p):
        c = stages[s]
        t = ar_end[s]
        if optimizer_sync and sync > t:
            ev(_new(Event, (s, "sync_wait", -1, t, sync)))
            t = sync
        if c.optimizer > 0:
            ev(_new(Event, (s, "optimizer", -1, t, t + c.optimizer)))
            t += c.optimizer
        if c.param_allgather > 0:
            ev(_new(Event, (s, "allgather", -1, t, t + c.param_allgather)))
            t += c.param_allgather
        stage_end[s] = t
    iteration = max(stage_end)

    busy = []
    bubble = []
    for s in range(p):
        c = stages[s]
        compute = m * (c.forward + c.backward)
        bubble.append(ready[s] - compute - sent[s])
        collective = (c.tied_allreduce if s in tied_group else 0.0) + c.grad_allreduce
        busy.append(compute + sent[s] + collective + c.optimizer + c.param_allgather)
    idle = tuple(iteration - b for b in busy)

    pipeline = max(last_bwd_end)
    # ready[critical] and the tied start are never after pipeline_seconds (a stage's last send is
    # consumed by its predecessor's later backward), so [pipeline, sync] is covered by the critical
    # stage's tied reduce followed by its wait for the slowest replica and its gradient all-reduce.
    tied_exposed = max(0.0, tied_end[critical] - pipeline)
    dp_exposed = sync - max(pipeline, tied_end[critical])
    components = MappingProxyType({
        "iteration_seconds": iteration,
        "stage_forward_max": max(fwd),
        "stage_backward_max": max(bwd),
        "pipeline_seconds": pipeline,
        "critical_compute_seconds": m * (fwd[critical] + bwd[critical]),
        "pp_p2p_seconds": sent[critical],
        "bubble_seconds": bubble[critical],
        "tied_allreduce_exposed": tied_exposed,
        "dp_allreduce_exposed": dp_exposed,
        "update_seconds": iteration - sync,
        "eq7_seconds": eq7_seconds(stages, m),
    })
    return Timeline(
        iteration_seconds=iteration,
        events=tuple(events) if record else (),
        busy=tuple(busy),
        idle=idle,
        bubble=tuple(bubble),
        stage_ready=tuple(ready),
        grad_sync_end=tuple(ar_end),
        critical_stage=critical,
        components=components,
    )
