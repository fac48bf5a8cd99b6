import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from neox_perf.prediction import opspec  # noqa: E402
from neox_perf.calibration import bench  # noqa: E402
from neox_perf.calibration.bench import Protocol, Timer, aggregate, measure  # noqa: E402

from calib_helpers import TINY, FakeClock  # noqa: E402


def _durations(seed, n):
    # multiples of 2^-12 s: sums and differences of these are exact in binary floating point
    rng = random.Random(seed)
    return [rng.randint(1, 4000) / 4096 for _ in range(n)]


class SequenceClock:
    """Readings 0, d0, d0+g, d0+g+d1, ...: timed spans are exactly ``durations``."""

    def __init__(self, durations, gap=1.0):
        self.readings = []
        t = 0.0
        for d in durations:
            self.readings += [t, t + d]
            t += d + gap
        self.calls = 0

    def __call__(self):
        value = self.readings[self.calls]
        self.calls += 1
        return value


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seeded_fake_timer_gives_exact_median_and_iqr(seed):
    durations = _durations(seed, 10)
    clock = SequenceClock(durations)
    m = measure("gelu", "fwd", {"tokens": 4, "width": 8}, timer=Timer(clock),
                protocol=Protocol(warmup=3, repeats=10))
    assert clock.calls == 20  # two readings per timed run, none while warming up
    agg = m.aggregate
    assert list(agg.times) == durations
    x = sorted(durations)
    # n = 10: median between the 5th and 6th; quartiles at positions 2.25 and 6.75 (numpy 'linear')
    assert agg.median == (x[4] + x[5]) / 2
    assert agg.q1 == x[2] + 0.25 * (x[3] - x[2])
    assert agg.q3 == x[6] + 0.75 * (x[7] - x[6])
    assert agg.iqr == agg.q3 - agg.q1
    assert agg.median == np.median(durations)
    assert agg.iqr == pytest.approx(np.subtract(*np.percentile(durations, [75, 25])), abs=0)
    assert agg.seconds == agg.min == x[0] and agg.repeats == 10
    assert m.timer == "wall-clock" and m.dtype == "fp32"


def test_aggregate_edges():
    one = aggregate([0.5])
    assert (one.seconds, one.median, one.iqr, one.repeats) == (0.5, 0.5, 0.0, 1)
    with pytest.raises(ValueError):
        aggregate([])
    with pytest.raises(ValueError):
        aggregate([1.0, float("nan")])


def test_adaptive_repeats_stop_at_the_time_budget():
    clock = FakeClock((0.01,))  # every timed span is 0.01 s
    m = measure("res_add", "fwd", {"tokens": 4, "d": 4}, timer=Timer(clock),
                protocol=Protocol(warmup=1, repeats=3, min_seconds=0.1, max_repeats=50))
    assert m.aggregate.repeats == 10
    m = measure("res_add", "fwd", {"tokens": 4, "d": 4}, timer=Timer(FakeClock((0.01,))),
                protocol=Protocol(warmup=0, repeats=3, min_seconds=10.0, max_repeats=7))
    assert m.aggregate.repeats == 7
    with pytest.raises(ValueError):
        Protocol(warmup=0, repeats=5, max_repeats=3)


def test_backward_timing_excludes_forward(monkeypatch):
    events = []

    def clock():
        events.append("clock")
        return float(len(events))

    real = bench.BUILDERS["gelu"]

    def traced(f, dev, dt):
        case = real(f, dev, dt)
        forward = case.forward

        def fwd(state):
            events.append("fwd")
            out = forward(state)
            out.register_hook(lambda g: events.append("bwd"))
            return out
        case.forward = fwd
        return case
    monkeypatch.setitem(bench.BUILDERS, "gelu", traced)
    measure("gelu", "bwd", {"tokens": 4, "width": 8}, timer=Timer(clock), protocol=Protocol(1, 2))
    timed = events[events.index("clock"):]
    # every timed span (clock ... clock) holds exactly one backward and no forward
    assert timed == ["clock", "bwd", "clock", "fwd", "clock", "bwd", "clock"]


ALL_POINTS = [(op, phase) for op in opspec.OPERATORS for phase in opspec.op_spec(op).phases]


@pytest.mark.parametrize("op, phase", ALL_POINTS)
def test_every_operator_runs_on_cpu(op, phase):
    feats = {k: TINY[k] for k in opspec.op_spec(op).features}
    m = measure(op, phase, feats, protocol=Protocol(warmup=1, repeats=2))
    assert m.aggregate.repeats == 2 and m.aggregate.seconds > 0
    assert m.impl and m.op == op and m.phase == phase


def test_ops_compute_what_they_claim():
    torch.manual_seed(0)
    x, w = torch.randn(3, 8), torch.randn(8)
    expected = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + bench.RMSNORM_EPS) * w
    assert torch.allclose(bench.rms_norm(x, w), expected, atol=1e-6)
    assert torch.equal(bench.rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])),
                       torch.tensor([-3.0, -4.0, 1.0, 2.0]))
    case = bench.build_case("fillmask", {"batch": 2, "l": 4})
    out = case.forward(case.prepare())
    assert (out[:, 0, 1:] == bench.NEOX_MASK_VALUE).all() and (out[:, 3, :] != bench.NEOX_MASK_VALUE).all()
    case = bench.build_case("fused_softmax", {"batch": 2, "l": 4})
    probs = case.forward(case.prepare())
    assert "fallback" in case.impl
    assert torch.allclose(probs.sum(-1), torch.ones(2, 4)) and probs[0, 0, 1] < 1e-3
    case = bench.build_case("qk", {"batch": 2, "l": 5, "head_dim": 4})
    assert tuple(case.forward(case.prepare()).shape) == (2, 5, 5)
    case = bench.build_case("flash_attention", {"b": 2, "l": 5, "heads": 3, "head_dim": 4, "causal": 0})
    assert tuple(case.forward(case.prepare()).shape) == (2, 3, 5, 4)


def test_shapes_must_be_whole():
    with pytest.raises(ValueError, match="whole"):
        bench.build_case("rope", {"tokens": 4, "heads": 1.5, "rot_dim": 8})
    with pytest.raises(ValueError, match="even"):
        bench.build_case("rope", {"tokens": 4, "heads": 2, "rot_dim": 7})
    with pytest.raises(ValueError, match="dtype"):
        bench.build_case("gelu", {"tokens": 4, "width": 4}, dtype="fp8")
