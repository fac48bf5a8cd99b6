"""A calibration's times brought to one machine speed before the fit (profile/one_speed.py):
each operator sample stores the reference readings its runs stood beside, each engine
shape-sweep the reading before it, and the fit multiplies every time by the calibration's start
reading over its own."""
import itertools
from types import SimpleNamespace

import pytest

from neox_perf.profile import one_speed

torch = pytest.importorskip("torch")

from calib_helpers import FakeClock  # noqa: E402
from test_disturbance import QUIET, FakeCpu, FakeDelay, FakeProbe  # noqa: E402


def test_times_are_scaled_by_the_reading_beside_them_and_held_inside_the_bound():
    # two runs beside a reading of 1.25 ms a loop, one beside 0.5 ms, the nominal 1 ms
    assert one_speed.scaled_times([4.0, 6.0, 1.0], [[0.00125, 2], [0.0005, 1]], 0.001) == \
        pytest.approx([3.2, 4.8, 1.5])  # x0.8 twice; x2 held at MAX_FACTOR (1.5)
    assert one_speed.sample_seconds(1.0, {"times": [4.0, 6.0, 1.0],
                                          "speeds": [[0.00125, 2], [0.0005, 1]]}, 0.001) == pytest.approx(1.5)
    assert one_speed.factor(0.001, 0.01) == pytest.approx(1 / one_speed.MAX_FACTOR)
    # what cannot be matched one for one is fitted as timed
    for speeds in (None, [[0.002, 2]], [[0.002, 4]], [[0.0, 3]], [["x", 3]], [[0.002, 1.5], [0.001, 1.5]]):
        assert one_speed.sample_seconds(1.0, {"times": [4.0, 6.0, 1.0], "speeds": speeds}, 0.001) == 1.0
    assert one_speed.sample_seconds(1.0, {"times": [4.0], "speeds": [[0.002, 1]]}, None) == 1.0


def test_an_engine_row_has_each_sweeps_repeats_at_one_speed():
    row = {"sweeps": 2, "speeds": [0.00125, 0.001], "params": 10, "forward": 1.0,
           "repeats": [{"forward": 2.0}, {"forward": 4.0}, {"forward": 1.0}, {"forward": 3.0}]}
    out = one_speed.engine_row(row, 0.001)
    assert [r["forward"] for r in out["repeats"]] == pytest.approx([1.6, 3.2, 1.0, 3.0])
    assert out["params"] == 10 and out["forward"] == 1.0  # counts, and the timed statistics, as stored
    assert row["repeats"][0]["forward"] == 2.0  # the file's row is not touched
    # a sweep without a reading, another dtype, no nominal: as timed
    assert one_speed.engine_row({**row, "speeds": [0.002]}, 0.001)["repeats"][0]["forward"] == 2.0
    assert one_speed.engine_row(row, 0.001, "fp32", "bf16")["repeats"][0]["forward"] == 2.0
    assert one_speed.engine_row(row, None) is row
    data = {"reference": {"dtype": "fp32"}, "shapes": {"a": row}, "zero": {"a": row, "b": {**row, "speeds": [0.00125, 0.00125]}}}
    each = one_speed.engine_data(data, one_speed.OneSpeed(0.001, "reading"), "fp32")
    assert each["zero"]["a"]["repeats"][0]["forward"] == pytest.approx(1.6)
    assert each["reference"] == {"dtype": "fp32"}
    # "step": every sweep of a pass at the median of the pass's readings (ZeRO's 1.25 ms: x0.8;
    # the plain pass's 1.125 ms: x0.889)
    step = one_speed.engine_data(data, one_speed.OneSpeed(0.001, "step"), "fp32")
    assert [r["forward"] for r in step["zero"]["a"]["repeats"]] == pytest.approx([1.6, 3.2, 0.8, 2.4])
    assert [r["forward"] for r in step["shapes"]["a"]["repeats"]] == pytest.approx([x / 1.125 for x in (2, 4, 1, 3)])
    assert one_speed.engine_data(data, None, "fp32") is data


def test_an_engine_shape_keeps_one_reading_per_sweep():
    from neox_perf.calibration.engine import pooled
    first = {"sweeps": 1, "speeds": [0.002], "repeats": [{"forward": 2.0}]}
    both = pooled(first, {"speeds": [0.001], "repeats": [{"forward": 1.0}]}, zero=False)
    assert both["speeds"] == [0.002, 0.001] and both["sweeps"] == 2 and both["forward"] == 1.0
    # a sweep stored before readings: none kept, the row is fitted as timed
    older = pooled({"sweeps": 1, "repeats": [{"forward": 2.0}]}, {"speeds": [0.001], "repeats": [{"forward": 1.0}]},
                   zero=False)
    assert "speeds" not in older


class CpuProbe(FakeProbe):
    cpu = True


def _scripted_store(tmp_path, tiny_plan, monkeypatch):
    """A calibration of the tiny plan whose watch reads 1.2, 1.2, 1.0, ... (loops 7) after a
    quiet start (QUIET, median 1.0): (store path, its samples, its summary)."""
    from neox_perf.calibration import sweep
    from neox_perf.calibration.disturbance import Watch
    from neox_perf.calibration.store import SampleStore

    def watch(device, dtype, threads):
        probe = CpuProbe(itertools.chain([(5.0, 0.0)], ((w, 0.0) for w in QUIET),
                                         itertools.cycle([(1.2, 0.0), (1.2, 0.0), (1.0, 0.0)])))
        w = Watch(probe, delay=FakeDelay(), cpu_clock=FakeCpu(), threads=1)
        w.begin()
        return w
    monkeypatch.setattr(sweep, "_watch", watch)
    path = tmp_path / "s.sqlite"
    summary = sweep.calibrate(tiny_plan, path, clock=FakeClock((0.002, 0.001)), watch=True)
    with SampleStore(path) as store:
        return path, store.samples(), summary


def test_every_operator_sample_stores_the_readings_beside_its_runs(tmp_path, tiny_plan, monkeypatch):
    """Each stored sample names the reading that opened its window, and the fit scales its
    times by it ("reading") or by the step's median ("step")."""
    from neox_perf.predictors.fitting.store_samples import training_sets
    path, samples, _ = _scripted_store(tmp_path, tiny_plan, monkeypatch)
    seen = set()
    for s in samples:
        speeds = s.info["speeds"]
        assert sum(n for _, n in speeds) == len(s.info["times"])
        seen |= {round(spl * 7, 6) for spl, _ in speeds}
    assert seen <= {1.0, 1.2} and len(seen) == 2  # both readings stood beside some samples
    nominal = 1.0 / 7
    as_timed = training_sets(path)
    at_one = training_sets(path, at=one_speed.OneSpeed(nominal, "reading"))
    step = one_speed.step_speed([s.info for s in samples])
    assert step * 7 in (pytest.approx(1.0), pytest.approx(1.1), pytest.approx(1.2))
    at_step = training_sets(path, at=one_speed.OneSpeed(nominal, "step"))
    by_id = {s.id: s for s in samples}
    for key, ts in at_one.items():
        for line, seconds, timed in zip(ts.line, ts.seconds, as_timed[key].seconds):
            s = by_id[int(line)]
            factors = [nominal / spl for spl, n in s.info["speeds"] for _ in range(n)]
            assert seconds == pytest.approx(min(t * f for t, f in zip(s.info["times"], factors)))
            assert timed == pytest.approx(s.seconds)
    for key, ts in at_step.items():  # every sample by the step's one median
        assert ts.seconds == pytest.approx(as_timed[key].seconds * nominal / step)


def test_the_fit_is_at_the_operator_steps_speed_only_where_it_read_a_cpu_reference(tmp_path, tiny_plan,
                                                                                    monkeypatch):
    from neox_perf.predictors.fitting.calibrated import _at_one_speed
    from neox_perf.profile.disturbance import Disturbance, Reference, reference
    path, samples, summary = _scripted_store(tmp_path, tiny_plan, monkeypatch)
    run = {"reference": "7 x (256x256x256 GEMM + 1048576-element add), fp32 on cpu", "loops": 7,
           "baseline": {"work": 1.0}}
    section = Disturbance(False, extra={"runs": [run]})
    step = one_speed.step_speed([s.info for s in samples])
    at = _at_one_speed(path, summary.device_id, section, "fp32", "step")
    # the nominal is the operator step's median reading (1.2 here), the start's (1.0) kept beside it
    assert (at.seconds_per_loop, at.mode, at.start_seconds_per_loop) == (
        pytest.approx(1.2 / 7), "step", pytest.approx(1.0 / 7)) and step == at.seconds_per_loop
    assert _at_one_speed(path, summary.device_id, section, "fp32", None) is None
    assert _at_one_speed(path, summary.device_id, section, "bf16", "step") is None  # another dtype
    gpu = Disturbance(False, extra={"runs": [{**run, "reference": run["reference"].replace("cpu", "cuda")}]})
    assert _at_one_speed(path, summary.device_id, gpu, "fp32", "step") is None
    assert _at_one_speed(path, summary.device_id, None, "fp32", "step") is None
    # the speed a profile describes: its start's, or the one it was fitted at
    manifest = SimpleNamespace(disturbance=section, training=SimpleNamespace(one_speed=None))
    assert reference(SimpleNamespace(manifest=manifest)) == Reference(7, "fp32", "cpu", pytest.approx(1.0 / 7))
    manifest.training.one_speed = at
    assert reference(SimpleNamespace(manifest=manifest)).seconds_per_loop == pytest.approx(step)


def test_the_manifest_keeps_the_speed_typed_and_names_a_broken_one():
    from neox_perf.errors import ProfileError
    from neox_perf.profile.sections import Training
    at = one_speed.OneSpeed(0.001, "step", 0.0012)
    data = {"library_versions": {}, "grid": [], "seconds": 1.0, "one_speed": at.to_dict(), "tree_input": "x"}
    training = Training.parse(data)
    assert training.one_speed == at and training.to_dict() == Training.parse(training.to_dict()).to_dict()
    assert training.to_dict()["one_speed"] == at.to_dict()
    assert Training.parse({**data, "one_speed": None}).one_speed is None
    assert "one_speed" not in Training.parse({k: v for k, v in data.items() if k != "one_speed"}).to_dict()
    for broken in ({"mode": "step"}, {"seconds_per_loop": 0.001, "mode": "sometimes"}, 0.001):
        with pytest.raises(ProfileError, match="training.one_speed"):
            Training.parse({**data, "one_speed": broken})


def test_a_failed_engine_reading_is_no_reading_and_keeps_the_barriers_matched():
    from neox_perf.calibration.engine import _reference_reading

    class Barrier:
        peers, calls = 2, 0

        def __call__(self):
            self.calls += 1

    class Broken:
        def seconds_per_loop(self, readings):
            raise RuntimeError("no")
    barrier = Barrier()
    assert _reference_reading(Broken(), barrier) is None and barrier.calls == 2
    assert _reference_reading(None, barrier) is None and barrier.calls == 4  # the other peers
