"""The operator step in sweeps: each point timed in two passes (the second reversed), each its
share of the protocol, the sample the fastest of all its runs; resumable between the sweeps."""
import pytest

pytest.importorskip("torch")

from neox_perf.calibration import sweep  # noqa: E402
from neox_perf.calibration.bench import Protocol  # noqa: E402
from neox_perf.calibration.plan import load_plan  # noqa: E402
from neox_perf.calibration.store import SampleStore  # noqa: E402

from calib_helpers import TINY_PLAN, FakeClock  # noqa: E402

TWO = TINY_PLAN.replace("protocol: {warmup: 0, repeats: 3}", "protocol: {warmup: 0, repeats: 3, sweeps: 2}")


@pytest.fixture
def two_sweeps(tmp_path):
    path = tmp_path / "two.yml"
    path.write_text(TWO)
    return str(path)


def test_a_sweeps_share_adds_up_to_the_protocol():
    p = Protocol(warmup=1, repeats=5, min_seconds=0.05, max_repeats=50)
    first, second = sweep.per_sweep(p, 2, 1), sweep.per_sweep(p, 2, 2)
    assert (first.repeats, second.repeats) == (3, 2)
    assert (first.max_repeats, second.max_repeats) == (25, 25)
    assert first.min_seconds == second.min_seconds == pytest.approx(0.025)
    assert first.warmup == second.warmup == 1  # each sweep builds the point afresh
    gpu = Protocol(warmup=10, repeats=10)  # the full plan's: a later sweep warms its tensors once
    assert (sweep.per_sweep(gpu, 2, 1).warmup, sweep.per_sweep(gpu, 2, 2).warmup) == (10, 1)
    assert sweep.per_sweep(gpu, 2, 1).repeats + sweep.per_sweep(gpu, 2, 2).repeats == 10
    assert sweep.per_sweep(Protocol(warmup=0, repeats=4), 2, 2).warmup == 0
    assert sweep.per_sweep(p, 1, 1) is p
    assert sweep.per_sweep(Protocol(warmup=0, repeats=1), 2, 2).repeats == 1  # never no run
    assert load_plan("quick").sweeps == 2 and load_plan("full").sweeps == 2


def test_every_point_is_timed_in_both_sweeps_the_second_reversed(tmp_path, two_sweeps):
    calls = []
    summary = sweep.calibrate(two_sweeps, tmp_path / "s.sqlite", clock=FakeClock(),
                              progress=lambda d, t, label: calls.append((d, t, label)))
    points = load_plan(two_sweeps).points
    n = len(points)
    assert (summary.measured, summary.pooled, summary.failed) == (n, n, [])
    # progress runs over both sweeps, the second in reverse plan order
    assert [c[0] for c in calls] == list(range(2 * n)) + [2 * n]
    assert {c[1] for c in calls} == {2 * n}
    assert calls[n][2] == f"{points[-1].label} (sweep 2)" and calls[2 * n - 1][2] == f"{points[0].label} (sweep 2)"
    with SampleStore(tmp_path / "s.sqlite") as store:
        samples = store.samples()
        assert len(samples) == n
        for s in samples:  # 2 + 1 runs: the protocol's 3, pooled
            assert s.repeats == 3 and len(s.info["times"]) == 3
            assert s.info["sweeps"] == {"done": 2, "of": 2} and sweep.sweeps_due(s.info) == 0
        assert store.runs()[0]["info"]["sweeps"] == 2


def test_the_sample_is_the_faster_sweeps(tmp_path, two_sweeps, mocker):
    """A slow stretch during one sweep: every point's sample is its other sweep's time."""
    from neox_perf.calibration.bench import Measurement, aggregate
    seen = []

    def measure(self, point, n=None):
        seen.append(n)
        times = [0.004, 0.005] if n == 1 else [0.002]  # the first sweep ran in a slow stretch
        return Measurement(point.op, point.phase, point.feature_dict(), "fp32", aggregate(times),
                           "fake", "fake")
    mocker.patch.object(sweep._Sweep, "measure", measure)
    sweep.calibrate(two_sweeps, tmp_path / "s.sqlite", clock=FakeClock(), watch=False)
    n = len(load_plan(two_sweeps).points)
    assert seen == [1] * n + [2] * n
    with SampleStore(tmp_path / "s.sqlite") as store:
        for s in store.samples():
            assert s.seconds == s.min == 0.002 and s.repeats == 3
            assert sorted(s.info["times"]) == [0.002, 0.004, 0.005]
            assert s.median == 0.004


def test_a_calibration_stopped_between_its_sweeps_resumes_with_the_second(tmp_path, two_sweeps, mocker):
    store_path = tmp_path / "s.sqlite"
    n = len(load_plan(two_sweeps).points)

    class Stop(Exception):
        pass

    def killed(self, point, k):  # the process dies as the second sweep begins
        raise Stop
    mocker.patch.object(sweep._Sweep, "_pool", killed)
    with pytest.raises(Stop):
        sweep.calibrate(two_sweeps, store_path, clock=FakeClock())
    with SampleStore(store_path) as store:
        first = {(s.op, s.phase, tuple(sorted(s.features.items()))): s for s in store.samples()}
        assert len(first) == n
        assert all(sweep.sweeps_due(s.info) == 1 and s.repeats == 2 for s in first.values())
    mocker.stopall()
    again = sweep.calibrate(two_sweeps, store_path, clock=FakeClock())
    assert (again.measured, again.already_stored, again.pooled) == (0, n, n)
    with SampleStore(store_path) as store:
        for s in store.samples():
            key = (s.op, s.phase, tuple(sorted(s.features.items())))
            assert s.repeats == 3 and sweep.sweeps_due(s.info) == 0
            assert s.info["times"][:2] == first[key].info["times"]  # the first sweep's runs kept
    third = sweep.calibrate(two_sweeps, store_path, clock=FakeClock())
    assert (third.measured, third.pooled) == (0, 0)  # a complete store is left as it is


def test_samples_stored_before_sweeps_are_complete(tmp_path, tiny_plan, two_sweeps):
    """A store calibrated in one sweep (an older neox-perf, or a plan without sweeps) is not
    timed again when resumed with a plan of two."""
    store_path = tmp_path / "s.sqlite"
    sweep.calibrate(tiny_plan, store_path, clock=FakeClock())
    with SampleStore(store_path) as store:
        assert all("sweeps" not in s.info and sweep.sweeps_due(s.info) == 0 for s in store.samples())
    again = sweep.calibrate(two_sweeps, store_path, clock=FakeClock())
    assert (again.measured, again.pooled) == (0, 0)
