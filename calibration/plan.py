"""Sampling plans: which operator shapes and collective sizes a calibration measures.

A plan is YAML (``yaml.safe_load`` only) in the terms of the paper's Tables VI-VII: model
ranges (mp, b, h, l, d, ...) shared in ``defaults`` and overridable per operator, expanded
to each operator's generic per-rank features with the shape rules the decomposition and
the published-sample converter use (linear1: m=b*l, k=d, n=3d/mp; qk: batch=b*h/mp, ...).
An operator may instead list its generic features directly (``optimizer: {params: ...}``).

A range is a number, a list, ``{start, stop, step}`` (additive) or ``{start, stop, factor}``
(multiplicative); ``stop`` is inclusive. Combinations whose per-rank shapes are not whole
(d not divisible by h, 3d by mp) are skipped and counted, as a real model could not have
them. Every problem is one line naming the file and the key.
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import yaml

from neox_perf.prediction import opspec
from neox_perf.errors import NeoxPerfError

from .store import COLLECTIVE_PHASE

PLANS_DIR = Path(__file__).resolve().parent / "plans"
MAX_RANGE_VALUES = 10_000
MAX_POINTS = 200_000
DTYPE_CHOICES = ("auto", "fp32", "fp16", "bf16")
STAGES = ("first", "middle", "last", "only")
_TOP_KEYS = {"name", "description", "protocol", "dtype", "vocab", "defaults", "ops", "collectives"}
_MODEL_KEYS = {"mp", "b", "l", "d", "h", "vocab", "causal", "encoders", "stage"}


class PlanError(NeoxPerfError):
    """A plan file is unreadable or wrong: one line with the file, the key and the fix."""

    def __init__(self, file, key: Optional[str], problem: str, fix: Optional[str] = None):
        self.file, self.key, self.problem, self.fix = str(file), key, problem, fix
        where = f"{self.file}: {key}" if key else self.file
        text = f"{where}: {problem}" + (f" (fix: {fix})" if fix else "")
        super().__init__(" ".join(text.split()))


@dataclass(frozen=True)
class PlanPoint:
    op: str
    phase: str
    features: Tuple[Tuple[str, float], ...]  # sorted (name, value)

    def feature_dict(self) -> Dict[str, Any]:
        return dict(self.features)

    @property
    def label(self) -> str:
        return f"{self.op} {self.phase} " + " ".join(f"{k}={_fmt(v)}" for k, v in self.features)


def _fmt(v) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


@dataclass(frozen=True)
class Plan:
    name: str
    source: str
    digest: str
    warmup: int
    repeats: int
    min_seconds: float
    max_repeats: int
    dtype: str
    points: Tuple[PlanPoint, ...]
    collectives: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    collective_warmup: int = 2
    collective_repeats: int = 5
    skipped: Dict[str, int] = field(default_factory=dict)  # op -> combinations not whole
    # passes over the points, every other one in reverse order, each taking its share of the
    # protocol's runs; a point's sample pools them (calibration/sweep.py: per_sweep, _Sweep.points)
    sweeps: int = 1

    def __len__(self) -> int:
        return len(self.points)


# -- shape rules --------------------------------------------------------------------------

def _div(a, b):
    """a / b when whole, else None (the combination cannot exist in a real model)."""
    q, r = divmod(a, b)
    return q if r == 0 else None


def _vocab(m):
    return opspec.vocab_per_rank(m["vocab"], m["mp"])


def _tokens(m):
    return m["b"] * m["l"]


# op -> (model keys used, rule model -> features or None)
RULES: Dict[str, Tuple[Tuple[str, ...], Callable[[Dict[str, int]], Optional[Dict[str, Any]]]]] = {
    "linear1": (("mp", "b", "l", "d"), lambda m: {"m": _tokens(m), "k": m["d"], "n": _div(3 * m["d"], m["mp"])}),
    "linear2": (("mp", "b", "l", "d"), lambda m: {"m": _tokens(m), "k": _div(m["d"], m["mp"]), "n": m["d"]}),
    "linear3": (("mp", "b", "l", "d"), lambda m: {"m": _tokens(m), "k": m["d"], "n": _div(4 * m["d"], m["mp"])}),
    "linear4": (("mp", "b", "l", "d"), lambda m: {"m": _tokens(m), "k": _div(4 * m["d"], m["mp"]), "n": m["d"]}),
    "linear_final": (("mp", "b", "l", "d", "vocab"), lambda m: {"m": _tokens(m), "k": m["d"], "n": _vocab(m)}),
    "embedding": (("mp", "b", "l", "d", "vocab"), lambda m: {"tokens": _tokens(m), "vocab": _vocab(m), "d": m["d"]}),
    "layernorm": (("b", "l", "d"), lambda m: {"tokens": _tokens(m), "d": m["d"]}),
    "rmsnorm": (("b", "l", "d"), lambda m: {"tokens": _tokens(m), "d": m["d"]}),
    "res_add": (("b", "l", "d"), lambda m: {"tokens": _tokens(m), "d": m["d"]}),
    "gelu": (("mp", "b", "l", "d"), lambda m: {"tokens": _tokens(m), "width": _div(4 * m["d"], m["mp"])}),
    "rope": (("mp", "b", "l", "d", "h"), lambda m: {
        "tokens": _tokens(m), "heads": _div(m["h"], m["mp"]), "rot_dim": _even(_div(m["d"], m["h"]))}),
    "qk": (("mp", "b", "l", "d", "h"), lambda m: {
        "batch": _div(m["b"] * m["h"], m["mp"]), "l": m["l"], "head_dim": _div(m["d"], m["h"])}),
    "av": (("mp", "b", "l", "d", "h"), lambda m: {
        "batch": _div(m["b"] * m["h"], m["mp"]), "l": m["l"], "head_dim": _div(m["d"], m["h"])}),
    "fillmask": (("mp", "b", "l", "h"), lambda m: {"batch": _div(m["b"] * m["h"], m["mp"]), "l": m["l"]}),
    "softmax": (("mp", "b", "l", "h"), lambda m: {"batch": _div(m["b"] * m["h"], m["mp"]), "l": m["l"]}),
    "fused_softmax": (("mp", "b", "l", "h"), lambda m: {"batch": _div(m["b"] * m["h"], m["mp"]), "l": m["l"]}),
    "attn_dropout": (("mp", "b", "l", "h"), lambda m: {"batch": _div(m["b"] * m["h"], m["mp"]), "l": m["l"]}),
    "flash_attention": (("mp", "b", "l", "d", "h", "causal"), lambda m: {
        "b": m["b"], "l": m["l"], "heads": _div(m["h"], m["mp"]), "head_dim": _div(m["d"], m["h"]),
        "causal": m["causal"]}),
    "cross_entropy": (("mp", "b", "l", "vocab"), lambda m: {"tokens": _tokens(m), "vocab": _vocab(m)}),
    "optimizer": (("mp", "d", "encoders", "stage"), lambda m: {
        "params": int(round(opspec.neox_stage_params(m["d"], m["encoders"], m["mp"], m["stage"],
                                                     m["vocab"])))}),
}
assert set(RULES) == set(opspec.OPERATORS), "every opspec operator needs a shape rule"

# Defaults for keys a plan may leave out. Flash samples are non-causal (see opspec).
_IMPLICIT = {"vocab": [opspec.DEFAULT_VOCAB], "causal": [0], "stage": ["middle"], "mp": [1]}


def _even(x):
    return x if x is not None and x % 2 == 0 else None


def expand_model(op: str, model: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """One model point -> the op's per-rank features, or None if not whole."""
    keys, rule = RULES[op]
    if op == "optimizer":
        model = dict(model)
        model.setdefault("vocab", opspec.DEFAULT_VOCAB)
    feats = rule(model)
    if any(v is None for v in feats.values()):
        return None
    return feats


# -- parsing -------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return not isinstance(v, bool) and (isinstance(v, int) or (isinstance(v, float) and v.is_integer()))


def expand_range(value: Any, *, file: str, key: str, minimum: int = 1) -> List[int]:
    """A number, a list, {start, stop, step} or {start, stop, factor} -> sorted unique ints."""
    def number(v, k=key):
        if isinstance(v, str):
            raise PlanError(file, k, f"{v!r} is text, not a number",
                            "write plain digits (YAML reads 1e6 as text; write 1000000)")
        if not _is_int(v):
            raise PlanError(file, k, f"{v!r} is not a whole number")
        if int(v) < minimum:
            raise PlanError(file, k, f"{int(v)} is below the minimum {minimum}")
        return int(v)

    if isinstance(value, dict):
        extra = set(value) - {"start", "stop", "step", "factor"}
        if extra:
            raise PlanError(file, key, f"unknown range key(s) {', '.join(sorted(map(str, extra)))}",
                            "a range is {start, stop, step} or {start, stop, factor}")
        for need in ("start", "stop"):
            if need not in value:
                raise PlanError(file, f"{key}.{need}", "missing", "a range needs start and stop")
        if ("step" in value) == ("factor" in value):
            raise PlanError(file, key, "give exactly one of step (additive) or factor (multiplicative)")
        start, stop = number(value["start"], f"{key}.start"), number(value["stop"], f"{key}.stop")
        if stop < start:
            raise PlanError(file, f"{key}.stop", f"stop {stop} is below start {start}")
        out, x = [], start
        if "step" in value:
            step = number(value["step"], f"{key}.step")
            if step < 1:
                raise PlanError(file, f"{key}.step", "step must be at least 1")
            grow = lambda v: v + step  # noqa: E731
        else:
            factor = number(value["factor"], f"{key}.factor")
            if factor < 2:
                raise PlanError(file, f"{key}.factor", "factor must be at least 2")
            grow = lambda v: v * factor  # noqa: E731
        while x <= stop:
            out.append(x)
            if len(out) > MAX_RANGE_VALUES:
                raise PlanError(file, key, f"expands to more than {MAX_RANGE_VALUES} values",
                                "use a larger step or factor")
            x = grow(x)
        return out
    if isinstance(value, list):
        if not value:
            raise PlanError(file, key, "empty list", "give at least one value")
        return sorted({number(v, f"{key}[{i}]") for i, v in enumerate(value)})
    return [number(value)]


def _values(key_name: str, value: Any, file: str, key: str) -> list:
    if key_name == "stage":
        stages = value if isinstance(value, list) else [value]
        bad = [s for s in stages if s not in STAGES]
        if bad or not stages:
            raise PlanError(file, key, f"unknown stage(s) {bad or stages}", f"use {', '.join(STAGES)}")
        return list(dict.fromkeys(stages))
    if key_name == "causal":
        vals = expand_range(value, file=file, key=key, minimum=0)
        if any(v > 1 for v in vals):
            raise PlanError(file, key, "causal is 0 or 1")
        return vals
    return expand_range(value, file=file, key=key)


def _mapping(value, file, key) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PlanError(file, key, f"expected a mapping, got {type(value).__name__}")
    return value


_PROTOCOL_KEYS = ("warmup", "repeats", "min_seconds", "max_repeats")


def _protocol(raw, file, key, default=(3, 10)) -> Tuple[int, int, float, int]:
    raw = _mapping(raw, file, key)
    extra = set(raw) - set(_PROTOCOL_KEYS)
    if extra:
        raise PlanError(file, f"{key}.{sorted(map(str, extra))[0]}", "unknown key",
                        f"use {', '.join(_PROTOCOL_KEYS)}")
    for name, value in raw.items():
        if isinstance(value, (list, dict)):
            raise PlanError(file, f"{key}.{name}", "must be a single number")
    warmup = expand_range(raw.get("warmup", default[0]), file=file, key=f"{key}.warmup", minimum=0)[0]
    repeats = expand_range(raw.get("repeats", default[1]), file=file, key=f"{key}.repeats")[0]
    max_repeats = expand_range(raw.get("max_repeats", repeats), file=file, key=f"{key}.max_repeats")[0]
    if max_repeats < repeats:
        raise PlanError(file, f"{key}.max_repeats", f"{max_repeats} is below repeats {repeats}")
    min_seconds = raw.get("min_seconds", 0.0)
    if isinstance(min_seconds, bool) or not isinstance(min_seconds, (int, float)) or not min_seconds >= 0:
        raise PlanError(file, f"{key}.min_seconds", f"{min_seconds!r} is not a non-negative number")
    return warmup, repeats, float(min_seconds), max_repeats


MAX_SWEEPS = 4
LATER_WARMUP = 1  # untimed runs of a point in a sweep after its first (calibration/sweep.per_sweep)


def _sweeps(value, file) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SWEEPS:
        raise PlanError(file, "protocol.sweeps", f"{value!r} is not a whole number from 1 to {MAX_SWEEPS}",
                        "give 1 (each point's runs back to back) or 2 (two passes, the second reversed)")
    return value


def _op_points(op: str, raw: dict, defaults: dict, file: str, key: Optional[str] = None
               ) -> Tuple[List[Dict[str, Any]], int, Tuple[str, ...]]:
    key = key or f"ops.{op}"
    raw = dict(_mapping(raw, file, key))
    phases = raw.pop("phases", None)
    spec = opspec.op_spec(op)
    if phases is None:
        phases = list(spec.phases)
    else:
        phases = phases if isinstance(phases, list) else [phases]
        bad = [p for p in phases if p not in spec.phases]
        if bad or not phases:
            raise PlanError(file, f"{key}.phases", f"{op} has phases {', '.join(spec.phases)}, not "
                                                   f"{bad or phases}")
    # l, d, b and vocab are both model keys and features; the others say "generic".
    generic = (set(raw) & set(spec.features)) - _MODEL_KEYS
    if generic:
        missing = set(spec.features) - set(raw)
        extra = set(raw) - set(spec.features)
        if missing or extra:
            raise PlanError(file, key, f"mixes generic features and model keys (missing "
                                       f"{', '.join(sorted(missing)) or '-'}, extra "
                                       f"{', '.join(sorted(map(str, extra))) or '-'})",
                            f"give either all of {', '.join(spec.features)} or model keys only")
        names = list(spec.features)
        ranges = [_values("causal" if n == "causal" else n, raw[n], file, f"{key}.{n}") for n in names]
        return [dict(zip(names, combo)) for combo in itertools.product(*ranges)], 0, tuple(phases)
    used, _ = RULES[op]
    unknown = set(raw) - _MODEL_KEYS
    if unknown:
        name = sorted(map(str, unknown))[0]
        raise PlanError(file, f"{key}.{name}", f"unknown key for {op}",
                        f"use model keys ({', '.join(used)}) or its features ({', '.join(spec.features)})")
    unused = set(raw) - set(used)
    if unused:
        name = sorted(unused)[0]
        raise PlanError(file, f"{key}.{name}", f"{op} does not depend on {name}",
                        f"remove it; {op} uses {', '.join(used)}")
    ranges = []
    for name in used:
        if name in raw:
            ranges.append(_values(name, raw[name], file, f"{key}.{name}"))
        elif name in defaults:
            ranges.append(defaults[name])
        elif name in _IMPLICIT:
            ranges.append(_IMPLICIT[name])
        else:
            raise PlanError(file, f"{key}.{name}", "missing",
                            f"give {name} under ops.{op} or under defaults")
    points, skipped = [], 0
    for combo in itertools.product(*ranges):
        model = dict(zip(used, combo))
        model.setdefault("vocab", defaults.get("vocab", [opspec.DEFAULT_VOCAB])[0])
        feats = expand_model(op, model)
        if feats is None:
            skipped += 1
        else:
            points.append(feats)
        if len(points) > MAX_POINTS:
            raise PlanError(file, key, f"expands to more than {MAX_POINTS} points", "narrow its ranges")
    return points, skipped, tuple(phases)


def parse_plan(data: Any, *, source: str = "<plan>", name: Optional[str] = None,
               digest: str = "") -> Plan:
    file = source
    data = _mapping(data, file, None)
    extra = set(data) - _TOP_KEYS
    if extra:
        raise PlanError(file, sorted(map(str, extra))[0], "unknown key",
                        f"top-level keys are {', '.join(sorted(_TOP_KEYS))}")
    protocol = dict(_mapping(data.get("protocol"), file, "protocol"))
    sweeps = _sweeps(protocol.pop("sweeps", 1), file)
    warmup, repeats, min_seconds, max_repeats = _protocol(protocol, file, "protocol")
    dtype = data.get("dtype", "auto")
    if dtype not in DTYPE_CHOICES:
        raise PlanError(file, "dtype", f"unknown dtype {dtype!r}", f"use {', '.join(DTYPE_CHOICES)}")
    defaults_raw = _mapping(data.get("defaults"), file, "defaults")
    unknown = set(defaults_raw) - _MODEL_KEYS
    if unknown:
        raise PlanError(file, f"defaults.{sorted(map(str, unknown))[0]}", "unknown model key",
                        f"use {', '.join(sorted(_MODEL_KEYS))}")
    defaults = {k: _values(k, v, file, f"defaults.{k}") for k, v in defaults_raw.items()}
    if "vocab" in data:
        defaults.setdefault("vocab", _values("vocab", data["vocab"], file, "vocab"))
    ops = _mapping(data.get("ops"), file, "ops")
    points: List[PlanPoint] = []
    seen = set()
    skipped: Dict[str, int] = {}
    for op, raws in ops.items():
        if op not in opspec.OPS:
            raise PlanError(file, f"ops.{op}", "unknown operator", f"use one of {', '.join(opspec.OPERATORS)}")
        # a list of blocks is a union of grids: large shapes sampled sparsely (m up to 8192
        # at small widths only) without the full product of every range
        blocks = raws if isinstance(raws, list) else [raws]
        if not blocks:
            raise PlanError(file, f"ops.{op}", "an empty list samples nothing", "give {} or blocks")
        for i, raw in enumerate(blocks):
            where = f"ops.{op}" if len(blocks) == 1 and not isinstance(raws, list) else f"ops.{op}[{i}]"
            feats_list, n_skipped, phases = _op_points(op, raw, defaults, file, where)
            if not feats_list:
                raise PlanError(file, where, "no combination gives whole per-rank shapes",
                                "check d is divisible by h and by mp, h by mp")
            if n_skipped:
                skipped[op] = skipped.get(op, 0) + n_skipped
            for feats in feats_list:
                items = tuple(sorted((k, v) for k, v in feats.items()))
                for phase in phases:
                    point = PlanPoint(op, phase, items)
                    if point not in seen:  # different mp / h can give the same per-rank shape
                        seen.add(point)
                        points.append(point)
    if len(points) > MAX_POINTS:
        raise PlanError(file, "ops", f"{len(points)} points, more than {MAX_POINTS}", "narrow the ranges")
    collectives, cwarm, crep = _collectives(data.get("collectives"), file)
    if not points and not collectives:
        raise PlanError(file, "ops", "the plan measures nothing", "list operators under ops")
    return Plan(name=name or str(data.get("name") or Path(file).stem), source=file, digest=digest,
                warmup=warmup, repeats=repeats, min_seconds=min_seconds, max_repeats=max_repeats,
                dtype=dtype, points=tuple(points),
                collectives=collectives, collective_warmup=cwarm, collective_repeats=crep,
                skipped=skipped, sweeps=sweeps)


def _collectives(raw, file) -> Tuple[Dict[str, Tuple[int, ...]], int, int]:
    raw = dict(_mapping(raw, file, "collectives"))
    warmup, repeats, _, _ = _protocol(raw.pop("protocol", None), file, "collectives.protocol", (2, 5))
    out = {}
    for kind, spec in raw.items():
        key = f"collectives.{kind}"
        if kind not in opspec.COLLECTIVES:
            raise PlanError(file, key, "unknown collective", f"use {', '.join(opspec.COLLECTIVES)}")
        spec = _mapping(spec, file, key)
        if set(spec) != {"elements"}:
            raise PlanError(file, key, "expects exactly one key, elements",
                            "elements per rank as in the samples: {start, stop, factor} or a list")
        out[kind] = tuple(expand_range(spec["elements"], file=file, key=f"{key}.elements"))
    return out, warmup, repeats


def bundled_plans() -> Dict[str, Path]:
    return {p.stem: p for p in sorted(PLANS_DIR.glob("*.yml"))}


def load_plan(plan) -> Plan:
    """A Plan from a bundled name ("quick", "full"), a YAML path, or a Plan (returned as is)."""
    if isinstance(plan, Plan):
        return plan
    bundled = bundled_plans()
    path = bundled[str(plan)] if str(plan) in bundled else Path(plan)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlanError(path, None, "no such plan file",
                        f"pass a YAML path or one of {', '.join(bundled) or 'the bundled plans'}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(path, None, f"cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else None
        raise PlanError(path, where, f"not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    return parse_plan(data, source=str(path), name=path.stem if path in bundled.values() else None,
                      digest=hashlib.sha256(text.encode("utf-8")).hexdigest()[:16])


# -- config-targeted points (calibrate --for) -----------------------------------------------

# The feature whose size a job scales first; the neighbourhood steps it x0.5 and x2 so the
# trees see a slope around the job's own shape rather than one isolated sample.
_LEADING = ("m", "tokens", "l", "params")
NEIGHBOURHOOD = (0.5, 2.0)


def leading_feature(op: str) -> Optional[str]:
    names = opspec.op_spec(op).features
    return next((n for n in _LEADING if n in names), None)


def _point(op: str, phase: str, feats: Mapping[str, float]) -> PlanPoint:
    return PlanPoint(op, phase, tuple(sorted((k, float(int(round(v))) if k != "causal" else float(v))
                                             for k, v in feats.items())))


def decomposition_targets(decomp, neighbourhood=NEIGHBOURHOOD
                          ) -> Tuple[List[PlanPoint], Dict[str, Tuple[int, ...]]]:
    """Every operator call and collective size a Decomposition runs, plus the operators'
    neighbours on the leading size feature: (plan points, {collective kind: elements})."""
    calls, comms = [], []
    for st in decomp.stages:
        for call in (*st.layer_forward, *st.layer_backward, *st.forward, *st.backward,
                     st.optimizer, st.send_activation, st.send_gradient, *st.grad_sync,
                     *st.tied_sync, *st.param_allgather):
            if call is None:
                continue
            (comms if hasattr(call, "elements") else calls).append(call)
    points: List[PlanPoint] = []
    for call in calls:
        feats = call.feature_dict()
        points.append(_point(call.op, call.phase, feats))
        lead = leading_feature(call.op)
        for factor in (neighbourhood if lead else ()):
            value = int(round(feats[lead] * factor))
            if value >= 1:
                points.append(_point(call.op, call.phase, {**feats, lead: value}))
    sizes: Dict[str, set] = {}
    for c in comms:
        sizes.setdefault(c.kind, set()).add(max(1, int(round(c.elements))))
    return (list(dict.fromkeys(points)),
            {k: tuple(sorted(v)) for k, v in sorted(sizes.items())})


def with_targets(plan: Plan, points, collectives: Mapping[str, Tuple[int, ...]]) -> Plan:
    """The plan plus the targets it does not already hold (its own points keep their order,
    so a resumed run measures in the same order)."""
    from dataclasses import replace
    have = set(plan.points)
    extra = tuple(p for p in dict.fromkeys(points) if p not in have)
    merged = {k: tuple(sorted(set(plan.collectives.get(k, ())) | set(collectives.get(k, ()))))
              for k in set(plan.collectives) | set(collectives)}
    return replace(plan, points=plan.points + extra, collectives=merged)


def estimated_seconds(plan: Plan, seconds_of: Callable[[str, str, Dict[str, Any]], float],
                      per_point: float = 0.005) -> float:
    """Wall seconds the operator sweep of ``plan`` takes if one call of each point costs
    ``seconds_of(op, phase, features)``: warm-up plus the protocol's timed runs (more for
    cheap ops, up to max_repeats, until min_seconds), a backward run re-doing its forward
    untimed, one untimed forward to shape the gradient, and ``per_point`` of set-up."""
    import math
    total = 0.0
    most = max(plan.max_repeats, plan.repeats)
    for p in plan.points:
        f = p.feature_dict()
        t = max(float(seconds_of(p.op, p.phase, f)), 1e-7)
        fwd = float(seconds_of(p.op, "fwd", f)) if p.phase == "bwd" else 0.0
        runs = plan.repeats
        if plan.min_seconds > 0:
            runs = max(runs, min(most, math.ceil(plan.min_seconds / t)))
        # each sweep its share of the runs, with its own warm-up (one run after the first
        # sweep: calibration/sweep.per_sweep), forward and set-up
        warmups = plan.warmup + (plan.sweeps - 1) * min(plan.warmup, LATER_WARMUP)
        total += (runs + warmups) * (t + fwd) + plan.sweeps * (fwd + per_point)
    return total


def roofline_seconds(flops_per_second: float, bytes_per_second: float, launch: float = 5e-6):
    """seconds_of for estimated_seconds from two rates (a pessimistic stand-in machine)."""
    def seconds_of(op, phase, feats):
        return (launch + float(opspec.op_flops(op, phase, feats)) / flops_per_second
                + float(opspec.op_bytes(op, phase, feats)) / bytes_per_second)
    return seconds_of


def sized_to(plan: Plan, budget_s: float, seconds_of: Callable[[str, str, Dict[str, Any]], float],
             per_point: float = 0.005, min_rows: int = 20) -> Tuple[Plan, int, float]:
    """``plan`` thinned until estimated_seconds says its sweep fits ``budget_s``: every
    (op, phase) keeps 1 point in ``stride`` (evenly spread over its own order, its ends kept)
    but never fewer than ``min_rows`` (or all it has), the trainer's least for a tree model
    (predictors/fitting/fit.MIN_ROWS_FOR_TREES). Returns (plan, stride, estimated seconds);
    stride 1 is the plan whole. Where even the floor does not fit, the floor is returned."""
    import math
    from dataclasses import replace
    groups: Dict[Tuple[str, str], List[PlanPoint]] = {}
    for p in plan.points:
        groups.setdefault((p.op, p.phase), []).append(p)

    def thinned(stride: int) -> Plan:
        keep = set()
        for pts in groups.values():
            n = len(pts)
            count = min(n, max(min_rows, math.ceil(n / stride)))
            idx = {round(i * (n - 1) / max(count - 1, 1)) for i in range(count)} if count > 1 else {0}
            keep.update(pts[i] for i in idx)
        return replace(plan, points=tuple(p for p in plan.points if p in keep))

    largest = max((len(v) for v in groups.values()), default=1)
    stride, out = 1, plan
    while True:
        seconds = estimated_seconds(out, seconds_of, per_point)
        if seconds <= budget_s or stride >= largest:
            return out, stride, seconds
        stride = min(largest, stride * 2)
        out = thinned(stride)
