"""Profiler events -> the decomposition's operators (opspec names and features).

Input is a flat list of `Event`s (one per torch.profiler FunctionEvent, or one recorded JSON
object per event: see profiling.extract_events), with parent links, per-thread nesting,
shapes and autograd sequence numbers. Output is one `WindowResult`: per (op, phase,
features, dtype) call counts and durations, per neox-perf phase range the time spent, and
what could not be mapped, by name, with the reason.

How an event becomes an operator:
- Forward: the first event on the way down the tree that a rule recognises (aten::linear
  before its addmm, aten::layer_norm before native_layer_norm, ...) is one call; its subtree
  is not visited again. Features come from its input shapes.
- Backward: the autograd engine records `autograd::engine::evaluate_function: XBackward0`
  events carrying the sequence number of the forward op that created node X. Each forward
  event "owns" the sequence numbers from its own up to the next forward event's on that
  thread (a masked_fill_ on a view also creates CopySlices/AsStrided nodes with the next
  numbers). All backward nodes owned by one forward call add up to that call's backward.
- Activation recompute runs forward ops inside a backward node; they carry sequence
  numbers >= 0 (backward-internal ops carry -1), which is how they are told apart.
- Collectives run as `gloo:all_reduce` / `nccl:all_reduce` ... events (gloo on its own
  worker threads); their group is inferred from the phase range they fall in.
- Glue: what no rule names but runs inside a phase range next to named operators (bias
  adds after a skip_bias_add linear, the views/splits/transposes around attention, the
  autograd nodes of those, gradient accumulation into .grad, DeepSpeed's flatten and
  norm/clip around a collective or the optimizer) belongs to the operator it serves: it is
  added to the nearest operator call in time within the same range instance (the latest
  one before it, else the first after it), forward or backward side as that call's event
  was. What has no operator in its range stays unmapped, except DeepSpeed's gradient
  reduction at data parallelism 1 (flatten, a one-rank all-reduce, copy back), which the
  decomposition carries as an engine term, not an operator call: it maps to that term.
  `glue` lists what was attributed.
  Host time between events inside a forward/backward range (the Python that prepares and
  issues the next operator; it is what separates a CPU op's launch from the last one) joins
  the operator issued next, except where a collective on another thread covers it (waiting
  for a collective is the collective's time, already counted). It is listed in `glue` as
  "host time between operators".
Durations: CPU inclusive time on a CPU run, summed kernel time on a GPU run.
The event and context types live in trace_events, the per-operator rules in trace_rules.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from neox_perf.prediction import opspec

from .trace_events import Dims, Event, Groups, MapContext
from .trace_rules import (COLLECTIVE_EVENT, COLLECTIVE_KIND, Unmapped, match, prod, shape,
                          collective_group, linear_name, placement)

__all__ = ["Dims", "Event", "Groups", "MapContext", "Unmapped", "OpAgg", "WindowResult",
           "collective_group", "linear_name", "placement", "map_events", "infer_dims"]

EVALUATE = "autograd::engine::evaluate_function: "
PHASE_PREFIX = "neox_perf::"
ITERATION_PHASE = "iteration"
# Ranges whose unnamed work joins the nearest named operator (see "Glue" above).
GLUE_PHASES = frozenset({"forward", "backward", "reduce_grads", "reduce_tied_grads",
                         "optimizer_step", "step"})
GAP_PHASES = frozenset({"forward", "backward"})
HOST_GAP = "host time between operators"
GRAD_REDUCE_TERM = "gradient reduction (engine term grad_flatten)"
BIAS_ADD = "bias add of a RowParallelLinear (skip_bias_add)"
SKIP_BIAS_LINEARS = frozenset({"linear2", "linear4"})
MAX_KEPT_DURATIONS = 256  # per operator key, for the median; the rest only counts


@dataclass
class OpAgg:
    calls: int = 0
    seconds: float = 0.0
    min: float = math.inf
    max: float = 0.0
    kept: List[float] = field(default_factory=list)

    def add(self, seconds: float, calls: int = 1) -> None:
        self.calls += calls
        self.seconds += seconds
        self.min = min(self.min, seconds)
        self.max = max(self.max, seconds)
        if len(self.kept) < MAX_KEPT_DURATIONS:
            self.kept.append(seconds)

    def merge(self, other: "OpAgg") -> None:
        self.calls += other.calls
        self.seconds += other.seconds
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        room = MAX_KEPT_DURATIONS - len(self.kept)
        if room > 0:
            self.kept.extend(other.kept[:room])

    def median(self) -> float:
        xs = sorted(self.kept)
        if not xs:
            return 0.0
        mid = len(xs) // 2
        return xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])

    def quartiles(self) -> Tuple[float, float]:
        xs = sorted(self.kept)
        if len(xs) < 2:
            return (xs[0], xs[0]) if xs else (0.0, 0.0)

        def q(p):
            pos = p * (len(xs) - 1)
            lo = int(math.floor(pos))
            hi = min(lo + 1, len(xs) - 1)
            return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
        return q(0.25), q(0.75)


OpKey = Tuple[str, str, Tuple[Tuple[str, float], ...], str]  # op, phase, features, dtype


@dataclass
class WindowResult:
    ops: Dict[OpKey, OpAgg] = field(default_factory=dict)
    phases: Dict[str, OpAgg] = field(default_factory=dict)  # neox-perf range -> time
    op_phases: Dict[Tuple[str, str], float] = field(default_factory=dict)  # (op, range) -> s
    unmapped: Dict[str, dict] = field(default_factory=dict)  # name -> calls, seconds, reason
    glue: Dict[str, dict] = field(default_factory=dict)  # name -> calls, seconds, ops it joined
    iterations: int = 0
    events: int = 0
    notes: List[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def merge(self, other: "WindowResult") -> None:
        for table in ("ops", "phases"):
            mine = getattr(self, table)
            for key, agg in getattr(other, table).items():
                mine.setdefault(key, OpAgg()).merge(agg)
        for key, s in other.op_phases.items():
            self.op_phases[key] = self.op_phases.get(key, 0.0) + s
        for name, u in other.unmapped.items():
            mine = self.unmapped.setdefault(name, {"calls": 0, "seconds": 0.0,
                                                   "reason": u["reason"], "example": u["example"]})
            mine["calls"] += u["calls"]
            mine["seconds"] += u["seconds"]
        for name, g in other.glue.items():
            mine = self.glue.setdefault(name, {"calls": 0, "seconds": 0.0, "ops": {}})
            mine["calls"] += g["calls"]
            mine["seconds"] += g["seconds"]
            for op, sec in g["ops"].items():
                mine["ops"][op] = mine["ops"].get(op, 0.0) + sec
        self.iterations += other.iterations
        self.events += other.events
        for n in other.notes:
            self.note(n)


# ---- features from shapes -----------------------------------------------------------------


class _Owners:
    """Per forward thread: sequence number -> the forward call that owns it (or None)."""

    def __init__(self):
        self.seqs: Dict[int, List[int]] = {}
        self.calls: Dict[int, List[Optional[int]]] = {}

    def add(self, thread: int, seq: int, call: Optional[int]) -> None:
        seqs = self.seqs.setdefault(thread, [])
        calls = self.calls.setdefault(thread, [])
        i = bisect.bisect_left(seqs, seq)
        if i < len(seqs) and seqs[i] == seq:
            if call is not None:
                calls[i] = call
            return
        seqs.insert(i, seq)
        calls.insert(i, call)

    def owner(self, thread: int, seq: int) -> Optional[int]:
        if seq < 0:
            return None
        for t in ((thread,) if thread in self.seqs else tuple(self.seqs)):
            seqs = self.seqs[t]
            i = bisect.bisect_right(seqs, seq) - 1
            if i >= 0:
                return self.calls[t][i]
        return None


class _Walker:
    def __init__(self, events: Sequence[Event], ctx: MapContext):
        self.ctx = ctx
        ids = {e.id for e in events}
        self.children: Dict[int, List[Event]] = {}
        roots = []
        for e in events:
            if e.parent is not None and e.parent in ids:
                self.children.setdefault(e.parent, []).append(e)
            else:
                roots.append(e)
        for kids in self.children.values():
            kids.sort(key=lambda x: x.start)
        self.roots = sorted(roots, key=lambda x: x.start)
        self.range_events = [e for e in events if e.name.startswith(PHASE_PREFIX)]
        ranges = sorted((e.start, e.start + e.dur, e.name[len(PHASE_PREFIX):])
                        for e in self.range_events)
        self.iteration_ranges = [r for r in ranges if r[2] == ITERATION_PHASE]
        self.ranges = [r for r in ranges if r[2] != ITERATION_PHASE]
        self.range_starts = [r[0] for r in self.ranges]
        self.owners = _Owners()
        # [op, features, fwd seconds, bwd seconds, bwd nodes, phase, recomputed]
        self.calls: List[list] = []
        # (time, call, "fwd"|"bwd"): where each call's forward event and backward nodes ran
        self.anchors: List[Tuple[float, int, str]] = []
        self.glue: List[Tuple[Event, str, Optional[str]]] = []
        self.collective_spans: List[Tuple[float, float]] = []
        self._call_spans: List[Tuple[int, float, float]] = []  # (call, start, end) of ops
        self._merged_spans: Optional[List[List[float]]] = None
        # thread -> (RowParallel linear awaiting its bias, bias seen expanded)
        self._pending_bias: Dict[int, Tuple[int, bool]] = {}
        self.out = WindowResult(events=len(events), iterations=len(self.iteration_ranges))

    def seconds(self, e: Event) -> float:
        # GPU: the kernels' time (CPU time is only the launch); CPU: inclusive wall time.
        us = e.device if self.ctx.device == "cuda" else e.dur
        return max(us, 0.0) * 1e-6

    def range_at(self, t: float) -> Optional[Tuple[float, float, str]]:
        # Ranges nest only shallowly (a plain engine's gradient all-reduce runs inside its
        # backward): the innermost range holding t is the latest-starting one that does.
        i = bisect.bisect_right(self.range_starts, t) - 1
        for j in range(i, max(i - 8, -1), -1):
            if t <= self.ranges[j][1]:
                return self.ranges[j]
        return None

    def phase_at(self, t: float) -> str:
        r = self.range_at(t)
        if r is not None:
            return r[2]
        for lo, hi, _ in self.iteration_ranges:
            if lo <= t <= hi:
                return ITERATION_PHASE
        return "other"

    def run(self) -> WindowResult:
        for e in self.range_events:
            self.out.phases.setdefault(e.name[len(PHASE_PREFIX):], OpAgg()).add(self.seconds(e))
        for root in self.roots:
            _, leftovers = self._visit(root, in_backward=False)
            self.glue.extend(leftovers)
        self._uncover_calls()
        self._attribute_glue(self._host_gaps())
        self._finish_calls()
        self._grad_reduce_term()
        return self.out

    def _visit(self, e: Event, in_backward: bool):
        """Walk e's subtree. Returns (mapped anything, [(event, reason, name)] not mapped)."""
        if e.name.startswith(EVALUATE):
            return self._backward(e)
        m = COLLECTIVE_EVENT.match(e.name)
        if m:
            return self._collective(e, m.group(2))
        kids = self.children.get(e.id, ())
        if e.name.startswith("c10d::"):
            # The backend event (gloo: on its own thread) carries the collective's time; the
            # dispatch and what the caller waits beyond it are glue (less the overlap).
            mapped, leftovers = self._visit_all(kids, in_backward)
            if mapped or leftovers:
                return mapped, leftovers
            return False, [(e, "collective dispatch", None)]
        # Inside backward only recomputed forward ops (aten, sequence number >= 0) are ops;
        # autograd node events there carry their forward op's number.
        op_like = not in_backward or (e.seq >= 0 and e.name.startswith("aten::"))
        if e.name in ("aten::expand_as", "aten::expand") and e.thread in self._pending_bias \
                and len(shape(e, 0)) == 1:
            self._pending_bias[e.thread] = (self._pending_bias[e.thread][0], True)
        if op_like:
            phase = self.phase_at(e.start)
            try:
                hit = match(e, self.ctx, phase, in_backward)
            except Unmapped as exc:
                # a real operator that could not be named: reported, never glue
                self._own(e, None)
                self._unmapped(e, str(exc))
                return False, []
            if hit is not None:
                op, feats = hit
                pending = self._pending_bias.pop(e.thread, None) if op == "res_add" else None
                owner = pending[0] if pending and pending[1] else None
                if owner is not None:
                    # NeoX's skip_bias_add: RowParallelLinear returns its bias, added by
                    # bias_dropout_add as a same-shape add (bias.expand_as(residual)) right
                    # before the residual add: the bias of the GEMM, not a residual.
                    self._join((e.start, owner, "fwd"), self.seconds(e), BIAS_ADD)
                    self._own(e, owner)
                    return True, []
                self.calls.append([op, _features(op, feats), self.seconds(e), 0.0, 0, phase,
                                   in_backward])
                call = len(self.calls) - 1
                self._call_spans.append((call, e.start, e.start + e.dur))
                self.anchors.append((e.start, call, "fwd"))
                self._own(e, call)
                if op in SKIP_BIAS_LINEARS and not in_backward:
                    self._pending_bias[e.thread] = (call, False)
                else:
                    self._pending_bias.pop(e.thread, None)
                return True, []
            if e.seq >= 0:
                self.owners.add(e.thread, e.seq, None)
        if not kids:
            if e.name.startswith(PHASE_PREFIX) or e.name.startswith("ProfilerStep#"):
                return False, []
            return False, [(e, "no rule for this operator", None)]
        mapped, leftovers = self._visit_all(kids, in_backward)
        if not mapped and (e.name.startswith("aten::") or not leftovers) \
                and not e.name.startswith(PHASE_PREFIX) and not e.name.startswith("ProfilerStep#"):
            # Report an unmapped op as itself, not as the pieces it is made of (an autograd
            # Function whose only child is a collective's dispatch included).
            return False, [(e, "no rule for this operator", None)]
        return mapped, leftovers

    def _visit_all(self, kids, in_backward: bool):
        mapped, leftovers = False, []
        for c in kids:
            m, rest = self._visit(c, in_backward)
            mapped = mapped or m
            leftovers.extend(rest)
        return mapped, leftovers

    def _own(self, e: Event, call: Optional[int]) -> None:
        stack = [e]
        while stack:
            x = stack.pop()
            if x.seq >= 0:
                self.owners.add(x.thread, x.seq, call)
            stack.extend(self.children.get(x.id, ()))

    # backward
    def _owner(self, e: Event) -> Optional[int]:
        return self.owners.owner(e.fwd_thread or e.thread, e.seq)

    def _backward(self, e: Event):
        call = self._owner(e)
        if call is None:
            inner = self._owned_nodes(e)
            distinct = {c for c, _ in inner}
            if len(distinct) == 1:
                call = distinct.pop()  # e.g. CopySlices wrapping MaskedFillBackward0
            elif inner:
                for c, node in inner:
                    self._add_backward(c, self.seconds(node), node.start)
                return True, []
        if call is not None:
            self._add_backward(call, self.seconds(e), e.start)
            return True, []
        mapped, leftovers = self._visit_all(self.children.get(e.id, ()), in_backward=True)
        if not mapped:
            node = e.name[len(EVALUATE):]
            return False, [(e, "backward of an unmapped forward op", f"backward: {node}")]
        return mapped, leftovers

    def _owned_nodes(self, e: Event):
        out, stack = [], list(self.children.get(e.id, ()))
        while stack:
            x = stack.pop()
            if x.name.startswith(EVALUATE):
                continue
            if x.seq >= 0 and not x.name.startswith("aten::"):
                c = self._owner(x)
                if c is not None:
                    out.append((c, x))
                    continue
            stack.extend(self.children.get(x.id, ()))
        return out

    def _add_backward(self, call: int, seconds: float, start: float) -> None:
        rec = self.calls[call]
        rec[3] += seconds
        rec[4] += 1
        self.anchors.append((start, call, "bwd"))

    # collectives
    def _collective(self, e: Event, what: str):
        kind = COLLECTIVE_KIND.get(what)
        phase = self.phase_at(e.start)
        if kind is None:
            return False, [(e, f"collective {what!r} is not in the decomposition", None)]
        if not e.shapes or not isinstance(e.shapes[0], list):
            return False, [(e, "collective without a recorded tensor shape", None)]
        x = shape(e, 0)  # [] is a 0-dim tensor: one element
        if kind == "recv":
            # The paper charges p2p to the sender; a recv is mostly waiting for it.
            key = ("p2p recv", phase)
            self.out.op_phases[key] = self.out.op_phases.get(key, 0.0) + self.seconds(e)
            return True, []
        group = collective_group(kind, phase, self.ctx.groups)
        if group is None:
            return False, [(e, f"{kind} during {phase}: its process group is unknown", None)]
        nodes, gpn = group
        feats = {"elements": prod(x), "nodes": nodes, "gpus_per_node": gpn}
        self.calls.append([kind, _features(kind, feats), self.seconds(e), 0.0, 0, phase, False])
        self.anchors.append((e.start, len(self.calls) - 1, "fwd"))
        self.collective_spans.append((e.start, e.start + e.dur))
        return True, []

    def _host_gaps(self) -> List[Tuple[float, float, float]]:
        """(start, end, seconds) of host time inside forward/backward ranges between their
        direct children, less what collectives on other threads cover. CPU runs only: on a
        GPU the operators' time is kernel time and host gaps overlap it."""
        if self.ctx.device == "cuda":
            return []
        out = []
        for r in self.range_events:
            if r.name[len(PHASE_PREFIX):] not in GAP_PHASES:
                continue
            cursor, end = r.start, r.start + r.dur
            for c in self.children.get(r.id, ()):  # sorted by start
                if c.start > cursor:
                    out.append((cursor, c.start))
                cursor = max(cursor, c.start + c.dur)
            if end > cursor:
                out.append((cursor, end))
        gaps = []
        for lo, hi in out:
            us = self._uncovered_us(lo, hi)
            if us > 0:
                gaps.append((lo, hi, us * 1e-6))
        return gaps

    def _uncover_calls(self) -> None:
        """On a CPU an operator that runs collectives inside itself (NeoX's vocab-parallel
        cross-entropy all-reduces its max, sum and target logits) waits for them on its own
        thread while the backend's event on another thread carries their time: the operator
        keeps only what no mapped collective covers, so the wait is not counted twice."""
        if self.ctx.device == "cuda" or not self.collective_spans:
            return
        for call, lo, hi in self._call_spans:
            covered = (hi - lo) - self._uncovered_us(lo, hi)
            if covered > 0:
                rec = self.calls[call]
                rec[2] = max(rec[2] - covered * 1e-6, 0.0)

    def _uncovered_us(self, lo: float, hi: float) -> float:
        """Microseconds of [lo, hi] no mapped collective covers: a rank waiting inside
        c10d (a model-parallel region's all-reduce, say) is the collective's time."""
        if self._merged_spans is None:
            merged: List[List[float]] = []
            for a, b in sorted(self.collective_spans):
                if merged and a <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], b)
                else:
                    merged.append([a, b])
            self._merged_spans = merged
        covered = sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in self._merged_spans
                      if a < hi and b > lo)
        return max((hi - lo) - covered, 0.0)

    def _attribute_glue(self, gaps) -> None:
        anchors = sorted(self.anchors)
        times = [a[0] for a in anchors]

        def nearest(t: float, after_first: bool):
            rng = self.range_at(t)
            if rng is None or rng[2] not in GLUE_PHASES:
                return None
            lo, hi, _ = rng
            # a gap ends where the operator it issues starts: that one counts as "after"
            i = bisect.bisect_left(times, t) if after_first else bisect.bisect_right(times, t)
            before = anchors[i - 1] if i >= 1 and times[i - 1] >= lo else None
            after = anchors[i] if i < len(anchors) and times[i] <= hi else None
            return (after or before) if after_first else (before or after)

        for lo, hi, seconds in gaps:
            target = nearest(hi, after_first=True)
            if target is not None:
                self._join(target, seconds, HOST_GAP)
        for e, reason, name in self.glue:
            target = nearest(e.start, after_first=False)
            if target is None:
                if self.phase_at(e.start) == "reduce_grads" and self.ctx.groups.dp <= 1:
                    self._grad_reduce(e, name)
                    continue
                self._unmapped(e, reason, name)
                continue
            seconds = self.seconds(e)
            if self.ctx.device != "cuda" and self.collective_spans:
                seconds = min(seconds, self._uncovered_us(e.start, e.start + e.dur) * 1e-6)
            self._join(target, seconds, name or e.name)

    # At data parallelism 1 DeepSpeed still runs its gradient reduction: Python that buckets
    # the gradients, a flatten, an all-reduce over a group of one, the copy back. No operator
    # call carries that work; the decomposition's gradient-reduction term does (EngineTerms.
    # grad_reduce, fitted on the wall time of engine.allreduce_gradients), so the whole range
    # maps to that term, host time included, and stays out of the operator samples.
    def _grad_reduce(self, e: Event, name: Optional[str]) -> None:
        self._glue(name or e.name, GRAD_REDUCE_TERM, self.seconds(e))

    def _grad_reduce_term(self) -> None:
        rng = self.out.phases.get("reduce_grads")
        if self.ctx.groups.dp > 1 or rng is None:
            return
        other = sum(s for (op, ph), s in self.out.op_phases.items() if ph == "reduce_grads")
        self.out.op_phases[(GRAD_REDUCE_TERM, "reduce_grads")] = max(rng.seconds - other, 0.0)

    def _join(self, target, seconds: float, name: str) -> None:
        _, call, part = target
        self.calls[call][2 if part == "fwd" else 3] += seconds
        self._glue(name, f"{self.calls[call][0]} {part}", seconds)

    def _glue(self, name: str, joined: str, seconds: float) -> None:
        """List `seconds` of the unnamed event `name` as attributed to `joined`."""
        g = self.out.glue.setdefault(name, {"calls": 0, "seconds": 0.0, "ops": {}})
        g["calls"] += 1
        g["seconds"] += seconds
        g["ops"][joined] = g["ops"].get(joined, 0.0) + seconds

    def _unmapped(self, e: Event, reason: str, name: Optional[str] = None) -> None:
        key = name or e.name
        u = self.out.unmapped.setdefault(key, {"calls": 0, "seconds": 0.0, "reason": reason,
                                               "example": e.shapes[:3] if e.shapes else []})
        u["calls"] += 1
        u["seconds"] += self.seconds(e)

    def _finish_calls(self) -> None:
        dtype = self.ctx.dtype
        for op, feats, fwd, bwd, nodes, phase, recompute in self.calls:
            if op in opspec.COLLECTIVES:
                self.out.ops.setdefault((op, "comm", feats, dtype), OpAgg()).add(fwd)
            elif op == "optimizer":
                self.out.ops.setdefault((op, opspec.OPTIMIZER_PHASE, feats, dtype), OpAgg()).add(fwd)
            else:
                self.out.ops.setdefault((op, "fwd", feats, dtype), OpAgg()).add(fwd)
                if nodes:
                    self.out.ops.setdefault((op, "bwd", feats, dtype), OpAgg()).add(bwd)
                    key = (op, "backward")
                    self.out.op_phases[key] = self.out.op_phases.get(key, 0.0) + bwd
                if recompute:
                    self.out.note("activation recompute: forward ops rerun inside backward "
                                  "are counted as forward calls")
            key = (op, phase)
            self.out.op_phases[key] = self.out.op_phases.get(key, 0.0) + fwd


def _features(op: str, feats: dict) -> Tuple[Tuple[str, float], ...]:
    return tuple(sorted((k, int(v) if float(v).is_integer() else float(v)) for k, v in feats.items()))


DUMP_ENV = "PYTHON_NEOX_PERF_TRACE_DUMP"  # a directory: every mapped window is also saved there


def map_events(events: Sequence[Event], ctx: MapContext) -> WindowResult:
    _dump(events, ctx)
    return _Walker(events, ctx).run()


def _dump(events: Sequence[Event], ctx: MapContext) -> None:
    """Save the window's events (JSON, the format tests/hooks/traces/ holds) when asked: how
    the recorded NeoX traces are made. Never lets a failure reach the mapping."""
    import os
    where = os.environ.get(DUMP_ENV, "").strip()
    if not where:
        return
    try:
        import json
        from dataclasses import asdict
        os.makedirs(where, exist_ok=True)
        rank = int(os.environ.get("RANK", "0"))
        n = len([f for f in os.listdir(where) if f.startswith(f"rank{rank}-")])
        path = os.path.join(where, f"rank{rank}-window{n}.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"context": {"dims": asdict(ctx.dims), "groups": asdict(ctx.groups),
                                   "device": ctx.device, "dtype": ctx.dtype,
                                   "optimizer_params": ctx.optimizer_params},
                       "events": [e.to_dict() for e in events]}, fh)
    except Exception:
        pass


def infer_dims(events: Sequence[Event], mp: int = 1) -> Dims:
    """Widths guessed from the trace when there is no config: hidden = the LayerNorm width,
    then NeoX's 3d/4d rules. Only used to name GEMMs; the features are shapes either way."""
    widths: Dict[int, int] = {}
    for e in events:
        if e.name in ("aten::layer_norm", "aten::rms_norm"):
            x = shape(e, 0)
            if x:
                widths[x[-1]] = widths.get(x[-1], 0) + 1
    if not widths:
        return Dims()
    d = max(widths, key=widths.get)
    return Dims(hidden=d, qkv=3 * d // mp, ffn_out=4 * d // mp, ffn_in=4 * d // mp,
                hidden_local=d // mp, source="trace")
