"""Operator micro-benchmarks on NeoX-shaped tensors, forward and backward, one op at a time.

Protocol (the paper, arXiv 2509.22832 §III.A): each operator runs in isolation, first
``warmup`` untimed runs (allocator, oneDNN/cuBLAS heuristics, Adam state, page faults),
then ``repeats`` timed runs -- more for cheap ops, until ``min_seconds`` of timed work.

Aggregate: the sample's ``seconds`` is the **minimum** of the timed runs; the median and
the interquartile range are stored beside it as the noise figure. The paper takes the mean
of the 3rd-7th fastest of 10. Timing noise here is one-sided -- a run can be slowed by
preemption, a page fault or a co-scheduled neighbour, never sped up -- so the fastest run
is the best estimate of the operator's own cost. Measured on this project's shared 2-core
box (60 quick-plan points timed twice, 1 thread, 10-50 runs each), |log ratio| between
the two passes, median / p90 over points, in two sessions:
  minimum 0.030 / 0.38 and 0.011 / 0.051; lower quartile 0.047 / 0.47 and 0.012 / 0.072;
  trimmed mean (the paper's, scaled to the run count) 0.061 / 0.79 and 0.013 / 0.065;
  median 0.064 / 0.81 and 0.013 / 0.076.
On a quiet device the choices agree closely; the raw times are kept in the sample's info
so the trainer can re-aggregate.

Backward is timed alone: each repetition rebuilds the graph with an untimed forward, then
times ``out.backward(grad)`` with a fixed, seeded ``grad``. Leaf gradients are reset to
None before each run so accumulation (``+=`` into .grad) is never timed.

Every clock reading goes through ``Timer``: an injected clock makes the protocol testable
with a deterministic sequence, the default is ``time.perf_counter`` on CPU and CUDA events
on a GPU (an injected clock on a GPU is bracketed by synchronize so it sees kernel time).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from neox_perf.prediction import opspec

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
NEOX_MASK_VALUE = -10000.0  # megatron attention_mask_func fills with this, not -inf
RMSNORM_EPS = 1e-8


@dataclass(frozen=True)
class Protocol:
    """``repeats`` timed runs after ``warmup``; then more, up to ``max_repeats``, while the
    timed total is under ``min_seconds`` (cheap ops get many runs for almost no time)."""

    warmup: int = 3
    repeats: int = 10
    min_seconds: float = 0.0
    max_repeats: int = 0  # 0: same as repeats

    def __post_init__(self):
        if self.warmup < 0 or self.repeats < 1:
            raise ValueError(f"warmup must be >= 0 and repeats >= 1, got {self.warmup}, {self.repeats}")
        if self.min_seconds < 0 or (self.max_repeats and self.max_repeats < self.repeats):
            raise ValueError(f"min_seconds must be >= 0 and max_repeats >= repeats, got "
                             f"{self.min_seconds}, {self.max_repeats}")

    def more(self, times: Sequence[float]) -> bool:
        if len(times) < self.repeats:
            return True
        return len(times) < max(self.max_repeats, self.repeats) and sum(times) < self.min_seconds


@dataclass(frozen=True)
class Aggregate:
    seconds: float  # what the regressors are fitted on: the minimum (see the module doc)
    median: float
    q1: float
    q3: float
    iqr: float
    min: float
    repeats: int
    times: Tuple[float, ...]


def aggregate(times: Sequence[float]) -> Aggregate:
    """Minimum (``seconds``), median and IQR (quartiles interpolated like numpy's default)."""
    xs = [float(t) for t in times]
    if not xs:
        raise ValueError("no timings to aggregate")
    if any(not math.isfinite(t) or t < 0 for t in xs):
        raise ValueError(f"timings must be finite and non-negative, got {xs}")
    med = statistics.median(xs)
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return Aggregate(seconds=min(xs), median=med, q1=q1, q3=q3, iqr=q3 - q1, min=min(xs),
                     repeats=len(xs), times=tuple(xs))


class Timer:
    """Times one call of ``fn`` after an untimed ``setup``.

    ``clock`` (seconds, monotonic) is injectable. With ``clock=None`` a CUDA device is timed
    with CUDA events and a CPU with ``time.perf_counter``. Exactly two clock readings are
    taken per timed call and none during warm-up, so a fake clock's sequence maps to
    durations one to one. (torch.utils.benchmark.Timer reads its own timeit clock and
    cannot take an injected one, hence this small loop.)
    """

    def __init__(self, clock: Optional[Callable[[], float]] = None, *, device="cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.uses_events = clock is None and self.cuda
        self.clock = clock if clock is not None else time.perf_counter
        self.method = ("cuda-events" if self.uses_events else
                       "wall-clock+synchronize" if self.cuda else "wall-clock")

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def measure(self, fn: Callable[[Any], Any], setup: Optional[Callable[[], Any]] = None) -> float:
        state = setup() if setup is not None else None
        self._sync()  # isolation: nothing of setup still running when the timed call starts
        if self.uses_events:
            with torch.cuda.device(self.device):  # events record on the current device's stream
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn(state)
                end.record()
                end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = self.clock()
        fn(state)
        self._sync()
        return float(self.clock() - t0)

    def run_untimed(self, fn: Callable[[Any], Any], setup: Optional[Callable[[], Any]] = None) -> None:
        state = setup() if setup is not None else None
        fn(state)
        self._sync()


# -- cases: one operator's tensors and its forward ----------------------------------------

@dataclass
class Case:
    """prepare() -> fresh per-run state (untimed); forward(state) -> output tensor."""

    prepare: Callable[[], Any]
    forward: Callable[[Any], torch.Tensor]
    leaves: List[torch.Tensor] = field(default_factory=list)
    impl: str = ""
    step: Optional[Callable[[Any], Any]] = None  # optimizer: the timed call, no forward


def _int(features: Mapping[str, Any], name: str, *, even: bool = False) -> int:
    value = float(features[name])
    if not value.is_integer() or value < 1:
        raise ValueError(f"feature {name}={features[name]!r} must be a positive whole number "
                         f"to build a tensor")
    if even and int(value) % 2:
        raise ValueError(f"feature {name}={int(value)} must be even (rotate-half)")
    return int(value)


def _leaf(shape, device, dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_()


def _reset(leaves):
    def prepare():
        for t in leaves:
            t.grad = None
        return leaves
    return prepare


def _gemm(f, dev, dt):
    m, k, n = _int(f, "m"), _int(f, "k"), _int(f, "n")
    x, w, b = _leaf((m, k), dev, dt), _leaf((n, k), dev, dt, k ** -0.5), _leaf((n,), dev, dt)
    return Case(_reset([x, w, b]), lambda s: F.linear(s[0], s[1], s[2]), [x, w, b], "F.linear+bias")


def _qk(f, dev, dt):
    batch, l, hd = _int(f, "batch"), _int(f, "l"), _int(f, "head_dim")
    q, k = _leaf((batch, l, hd), dev, dt), _leaf((batch, l, hd), dev, dt)
    out = torch.empty(batch, l, l, device=dev, dtype=dt)  # NeoX's matmul_input_buffer, beta=0

    def fwd(s):
        return torch.baddbmm(out, s[0], s[1].transpose(1, 2), beta=0.0, alpha=1.0 / math.sqrt(hd))
    return Case(_reset([q, k]), fwd, [q, k], "torch.baddbmm")


def _av(f, dev, dt):
    batch, l, hd = _int(f, "batch"), _int(f, "l"), _int(f, "head_dim")
    p, v = _leaf((batch, l, l), dev, dt, 1.0 / l), _leaf((batch, l, hd), dev, dt)
    return Case(_reset([p, v]), lambda s: torch.bmm(s[0], s[1]), [p, v], "torch.bmm")


def _causal_mask(l, dev):
    return torch.triu(torch.ones(1, l, l, dtype=torch.bool, device=dev), diagonal=1)


def _fillmask(f, dev, dt):
    batch, l = _int(f, "batch"), _int(f, "l")
    x, mask = _leaf((batch, l, l), dev, dt), _causal_mask(l, dev)

    def prepare():
        x.grad = None
        return x + 0  # in-place needs a non-leaf; the copy is made here, untimed
    return Case(prepare, lambda s: s.masked_fill_(mask, NEOX_MASK_VALUE), [x], "masked_fill_")


def _softmax(f, dev, dt):
    batch, l = _int(f, "batch"), _int(f, "l")
    x = _leaf((batch, l, l), dev, dt)
    return Case(_reset([x]), lambda s: torch.softmax(s[0], dim=-1), [x], "torch.softmax")


# The probability NeoX configs use when they drop out attention; the kernel's time does not
# depend on it (every element draws, scales and writes its mask whatever p is).
DROPOUT_P = 0.1


def _attn_dropout(f, dev, dt):
    batch, l = _int(f, "batch"), _int(f, "l")
    x = _leaf((batch, l, l), dev, dt)
    return Case(_reset([x]), lambda s: F.dropout(s[0], p=DROPOUT_P, training=True), [x],
                "F.dropout (training)")


class _FusedUpperTriangSoftmax(torch.autograd.Function):
    """Megatron's ScaledUpperTriangMaskedSoftmax kernel, when NeoX's fused kernels are built."""

    @staticmethod
    def forward(ctx, x, scale):
        import scaled_upper_triang_masked_softmax_cuda as kernel
        ctx.scale = scale
        y = kernel.forward(x, scale)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        import scaled_upper_triang_masked_softmax_cuda as kernel
        (y,) = ctx.saved_tensors
        return kernel.backward(grad.contiguous(), y, ctx.scale), None


def _fused_kernel_available(dev, dt) -> bool:
    if dev.type != "cuda" or dt == torch.float32:
        return False
    try:
        import scaled_upper_triang_masked_softmax_cuda  # noqa: F401
        return True
    except ImportError:
        return False


def _fused_softmax(f, dev, dt):
    batch, l = _int(f, "batch"), _int(f, "l")
    x, mask, scale = _leaf((batch, l, l), dev, dt), _causal_mask(l, dev), 1.0
    if _fused_kernel_available(dev, dt):
        return Case(_reset([x]), lambda s: _FusedUpperTriangSoftmax.apply(s[0], scale), [x],
                    "megatron scaled_upper_triang_masked_softmax")

    # Without the kernel: the same three steps in one function, as NeoX's non-fused path.
    def fwd(s):
        return torch.softmax((s[0] * scale).masked_fill(mask, NEOX_MASK_VALUE), dim=-1)
    return Case(_reset([x]), fwd, [x], "fallback: scale+masked_fill+softmax (no fused kernel)")


def _flash(f, dev, dt):
    b, l, heads, hd = _int(f, "b"), _int(f, "l"), _int(f, "heads"), _int(f, "head_dim")
    causal = bool(float(f["causal"]))
    q, k, v = (_leaf((b, l, heads, hd), dev, dt) for _ in range(3))  # NeoX/flash-attn layout

    def fwd(s):
        return F.scaled_dot_product_attention(s[0].transpose(1, 2), s[1].transpose(1, 2),
                                              s[2].transpose(1, 2), is_causal=causal)
    return Case(_reset([q, k, v]), fwd, [q, k, v], "F.scaled_dot_product_attention")


def _layernorm(f, dev, dt):
    tokens, d = _int(f, "tokens"), _int(f, "d")
    x, w, b = _leaf((tokens, d), dev, dt), _leaf((d,), dev, dt), _leaf((d,), dev, dt)
    return Case(_reset([x, w, b]), lambda s: F.layer_norm(s[0], (d,), s[1], s[2], 1e-5),
                [x, w, b], "F.layer_norm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = RMSNORM_EPS) -> torch.Tensor:
    # NeoX's RMSNorm module, written out: torch's fused F.rms_norm would time another kernel.
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rmsnorm(f, dev, dt):
    tokens, d = _int(f, "tokens"), _int(f, "d")
    x, w = _leaf((tokens, d), dev, dt), _leaf((d,), dev, dt)
    return Case(_reset([x, w]), lambda s: rms_norm(s[0], s[1]), [x, w], "x*rsqrt(mean(x^2)+eps)*w")


def _res_add(f, dev, dt):
    tokens, d = _int(f, "tokens"), _int(f, "d")
    x, y = _leaf((tokens, d), dev, dt), _leaf((tokens, d), dev, dt)
    return Case(_reset([x, y]), lambda s: s[0] + s[1], [x, y], "x + y")


def _gelu(f, dev, dt):
    x = _leaf((_int(f, "tokens"), _int(f, "width")), dev, dt)
    return Case(_reset([x]), lambda s: F.gelu(s[0]), [x], "F.gelu")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(f, dev, dt):
    tokens, heads, rot = _int(f, "tokens"), _int(f, "heads"), _int(f, "rot_dim", even=True)
    q, k = _leaf((tokens, heads, rot), dev, dt), _leaf((tokens, heads, rot), dev, dt)
    angle = torch.rand(tokens, 1, rot, device=dev) * 6.283
    cos, sin = angle.cos().to(dt), angle.sin().to(dt)

    def fwd(s):
        # q and k both rotated, as opspec counts; concatenated so backward has one output.
        return torch.cat([s[0] * cos + rotate_half(s[0]) * sin,
                          s[1] * cos + rotate_half(s[1]) * sin])
    return Case(_reset([q, k]), fwd, [q, k], "rotate-half on q and k")


def _embedding(f, dev, dt):
    tokens, vocab, d = _int(f, "tokens"), _int(f, "vocab"), _int(f, "d")
    ids = torch.randint(0, vocab, (tokens,), device=dev)
    w = _leaf((vocab, d), dev, dt)
    return Case(_reset([w]), lambda s: F.embedding(ids, s[0]), [w], "F.embedding (dense grad)")


def _cross_entropy(f, dev, dt):
    tokens, vocab = _int(f, "tokens"), _int(f, "vocab")
    logits = _leaf((tokens, vocab), dev, dt)
    labels = torch.randint(0, vocab, (tokens,), device=dev)
    return Case(_reset([logits]), lambda s: F.cross_entropy(s[0], labels), [logits], "F.cross_entropy")


def _optimizer(f, dev, dt):
    # DeepSpeed's FP16 optimizer and ZeRO keep one flat fp32 master buffer per group, so a
    # single flat parameter is the faithful layout. fp16 grad conversion is not included.
    params = _int(f, "params")
    p = torch.nn.Parameter(torch.randn(params, device=dev, dtype=torch.float32))
    p.grad = torch.randn_like(p) * 1e-3
    kwargs = {"fused": True} if dev.type == "cuda" else {"foreach": True}
    opt = torch.optim.Adam([p], lr=1e-4, **kwargs)
    impl = "torch.optim.Adam(" + ", ".join(f"{k}=True" for k in kwargs) + "), fp32 master"
    return Case(lambda: None, lambda s: p, [p], impl, step=lambda s: opt.step())


BUILDERS: Dict[str, Callable[[Mapping[str, Any], torch.device, torch.dtype], Case]] = {
    "linear1": _gemm, "linear2": _gemm, "linear3": _gemm, "linear4": _gemm, "linear_final": _gemm,
    "qk": _qk, "av": _av, "fillmask": _fillmask, "softmax": _softmax,
    "fused_softmax": _fused_softmax, "attn_dropout": _attn_dropout, "flash_attention": _flash, "layernorm": _layernorm,
    "rmsnorm": _rmsnorm, "res_add": _res_add, "gelu": _gelu, "rope": _rope,
    "embedding": _embedding, "cross_entropy": _cross_entropy, "optimizer": _optimizer,
}
assert set(BUILDERS) == set(opspec.OPERATORS), "every opspec operator needs a benchmark"


def build_case(op: str, features: Mapping[str, Any], *, device="cpu", dtype: str = "fp32") -> Case:
    spec = opspec.op_spec(op)
    missing = set(spec.features) - set(features)
    if missing:
        raise ValueError(f"{op} needs features {', '.join(sorted(missing))}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return BUILDERS[op](features, torch.device(device), DTYPES[dtype])


def estimate_bytes(op: str, features: Mapping[str, Any], dtype: str = "fp32") -> float:
    """Rough peak memory of one benchmark: opspec's bytes moved, twice (tensors and grads)."""
    spec = opspec.op_spec(op)
    size = DTYPES[dtype].itemsize
    return 2.0 * max(float(spec.bytes_moved(p, features, size)) for p in spec.phases)


@dataclass(frozen=True)
class Measurement:
    op: str
    phase: str
    features: Dict[str, Any]
    dtype: str
    aggregate: Aggregate
    impl: str
    timer: str


def measure(op: str, phase: str, features: Mapping[str, Any], *, timer: Optional[Timer] = None,
            protocol: Protocol = Protocol(), dtype: str = "fp32", seed: int = 0) -> Measurement:
    """Benchmark one (op, phase, features) point under ``protocol``."""
    timer = timer or Timer()
    spec = opspec.op_spec(op)
    if phase not in spec.phases:
        raise ValueError(f"operator {op!r} has phases {spec.phases}, not {phase!r}")
    torch.manual_seed(seed)
    case = build_case(op, features, device=timer.device, dtype=dtype)
    if case.step is not None:
        setup, fn = case.prepare, case.step
    elif phase == "fwd":
        setup, fn = case.prepare, case.forward
    else:
        out0 = case.forward(case.prepare())
        grad = torch.randn(out0.shape, device=out0.device, dtype=torch.float32).to(out0.dtype)
        del out0

        def setup():
            return case.forward(case.prepare())

        def fn(out):
            out.backward(grad)
    for _ in range(protocol.warmup):
        timer.run_untimed(fn, setup)
    times: List[float] = []
    while protocol.more(times):
        times.append(timer.measure(fn, setup))
    return Measurement(op, phase, dict(features), dtype, aggregate(times), case.impl, timer.method)
