"""A calibration that knows it was disturbed, piece by piece and without timing anything: the
threshold from the start readings, the watch's windows driven by a scripted probe and run-queue
clock, the machine readers, the store's marks (re-measured by the next calibration), and the
profile section and warning built from them. The real thing, a calibration beside a busy
process, is tests/calibration/test_disturbed_calibration.py."""
import json
import os
import sys
import types

import pytest

from neox_perf.calibration import machine
from neox_perf.profile.disturbance import Disturbance, from_calibration, profile_warnings

torch = pytest.importorskip("torch")

from neox_perf.calibration.disturbance import (START_READINGS, THRESHOLD_FLOOR, Baseline, Reading,  # noqa: E402
                                               Watch, wait_slowdown)

from calib_helpers import FakeClock  # noqa: E402

QUIET = [1.00, 1.03, 0.99, 1.02, 1.00]  # start readings' work: range 3% without the slowest


def _reading(work, waited=0.0, neighbours=()):
    return Reading("r", 0.0, seconds=work, cpu=work, waited=waited, neighbours=neighbours)


class FakeProbe:
    """Scripted readings: (work, waited) pairs, the first one the discarded warm-up."""

    loops = 7

    def __init__(self, script):
        self.script = iter(script)
        self.labels = []

    def describe(self):
        return "a fake reference"

    def read(self, label, at=0.0):
        work, waited, *mean = next(self.script)
        self.labels.append(label)
        return Reading(label, at, seconds=work, cpu=work, waited=waited,
                       waited_mean=mean[0] if mean else waited)


class FakeCpu:
    """Other processes' cores over every window: ``others``."""

    cpus = frozenset({0})

    def __init__(self, others=0.0):
        self.others = others

    def mark(self):
        return None

    def others_cores(self, start, end):
        return self.others


class FakeDelay:
    """A run-queue clock that advances by ``step`` seconds at each reading."""

    def __init__(self):
        self.now, self.step = 0.0, 0.0

    def __call__(self):
        self.now += self.step
        return self.now


def _watch(later, delay=None, others=0.0):
    probe = FakeProbe([(5.0, 0.0)] + [(w, 0.0) for w in QUIET] + later)
    watch = Watch(probe, delay=delay or FakeDelay(), cpu_clock=FakeCpu(others), threads=1)
    watch.begin()
    return watch, probe


def test_the_threshold_is_the_start_readings_own_spread():
    base = Baseline.of([_reading(w) for w in QUIET])
    assert base.work == 1.00 and base.noise == pytest.approx(0.03)
    assert base.threshold == pytest.approx(0.06)
    assert base.judge(_reading(1.05), others=0.5) == []  # within the noise
    assert "1.08x its time at rest while other processes kept 0.50 cores busy" in \
        base.judge(_reading(1.08), others=0.5)[0]
    # a slower reference with nothing else running is the platform's noise, not a neighbour
    assert base.judge(_reading(1.08)) == base.judge(_reading(1.08), others=0.05) == []
    # waits count as the slowdown they cause (5% of the time waiting is 5.3% longer), against
    # their own threshold: 3%, not the work's 6%
    assert wait_slowdown(0.05) == pytest.approx(0.05 / 0.95) and base.judge(_reading(1.0, 0.025)) == []
    assert "held this CPU 5%" in base.judge(_reading(1.0, 0.05))[0]
    assert "held this CPU 10%" in base.judge(_reading(1.0, 0.10))[0]
    assert "pid 42 (2.0 GiB)" in base.judge(_reading(1.0, None, ((42, 2 * 2**30),)))[0]
    # a noisier start tolerates more; one slowed start reading does not
    noisy = Baseline.of([_reading(w) for w in (1.0, 1.1, 0.95, 1.0, 1.05)])
    assert noisy.judge(_reading(1.08), others=0.5) == []
    assert Baseline.of([_reading(w) for w in QUIET[:-1] + [1.5]]).threshold == pytest.approx(2 * 0.04 / 1.02)


def test_the_windows_around_a_slow_reading_are_flagged_and_no_other():
    watch, probe = _watch([(1.0, 0.0), (1.5, 0.0), (1.0, 0.0), (1.0, 0.0)], others=0.8)
    assert probe.labels[:2] == ["warm-up", "start 1"] and len(watch.start) == START_READINGS
    assert watch.interval > 0 and watch.flagged_readings == []
    closed = []
    for i in range(4):
        watch.add(f"point {i}")
        closed.append(watch.close(f"after point {i}"))
    assert [w.disturbed for w in closed] == [False, True, True, False]
    assert "1.50x its time at rest" in closed[1].why[0]  # closed by the slow reading
    assert closed[2].why[0].startswith("at the reading before: ")  # opened by it
    assert closed[2].points == ["point 2"] and watch.disturbed_windows == 2
    rec = watch.record()
    json.dumps(rec)
    assert rec["reasons"] == {"drift": pytest.approx(0.5), "others_cores": 0.8}
    assert rec["max_drift"] == pytest.approx(0.5) and rec["machine"]["others_cores_max"] == 0.8
    assert rec["readings_taken"] == START_READINGS + 4 and rec["loops"] == 7
    assert rec["baseline"]["threshold"] == pytest.approx(0.06)
    assert not rec["flagged"]  # nothing is flagged in a store until the sweep says so


def test_a_slow_reference_with_nothing_else_running_flags_nothing():
    watch, _ = _watch([(1.5, 0.0), (1.0, 0.0)], others=0.0)
    for i in range(2):
        watch.add(f"point {i}")
        assert not watch.close(f"after point {i}").disturbed
    rec = watch.record()
    assert rec["max_drift"] == pytest.approx(0.5) and rec["reasons"] == {}  # recorded, not flagged


def test_a_window_in_which_the_calibration_waited_is_flagged():
    delay = FakeDelay()
    watch, _ = _watch([(1.0, 0.0), (1.0, 0.0)], delay)
    watch.add("point")
    assert not watch.close("quiet").disturbed
    delay.step = 3600.0  # an hour on the run queue between two readings of a short window
    watch.add("point")
    window = watch.close("after a wait")
    assert window.waited == 1.0 and "waited for a CPU 100% of the window" in window.why[-1]


def test_a_window_counts_its_waits_against_the_blips_of_the_start():
    delay = FakeDelay()
    # a reference without spread, and start readings that waited 1% of their time in blips
    # their least waited runs left out
    probe = FakeProbe([(5.0, 0.0)] + [(1.0, 0.0, 0.01)] * START_READINGS + [(1.0, 0.0)] * 2)
    watch = Watch(probe, delay=delay, cpu_clock=FakeCpu())
    base = watch.begin()
    # a range of zero: the threshold's floor (3%, a slowdown within the reproducibility bar)
    assert base.threshold == THRESHOLD_FLOOR and base.wait_noise == 0.01
    assert base.window_wait_limit == pytest.approx(THRESHOLD_FLOOR / (1 + THRESHOLD_FLOOR))
    for share, disturbed in ((0.025, False), (0.035, True)):  # an hour-long window waiting that share
        delay.step = share * 3600
        watch.window.started -= 3600
        watch.add("point")
        assert watch.close("after an hour").disturbed is disturbed
    # the waits' own limit, whatever the work's noise (a 6% work threshold, waits still at 3%)
    assert Baseline(1.0, 0.03, 0.06, 0.01).window_wait_limit == pytest.approx(0.03 / 1.03)
    assert Baseline(1.0, 0.001, 0.03, 0.05).window_wait_limit == pytest.approx(0.10)  # blips at rest
    assert Baseline(1.0, 0.001, 0.002, 0.6).window_wait_limit == 1.0  # a start that waited: never


def test_a_reference_whose_work_wanders_still_sees_a_neighbour_take_its_cpu():
    # five start readings 17% apart in work (this VM's own drift, nothing else running):
    # the work's threshold is 34%, the waits keep their own 3%
    noisy = Baseline.of([_reading(w) for w in (1.0, 1.17, 0.95, 1.05, 1.3)])
    assert noisy.threshold == pytest.approx(2 * 0.22 / 1.05) and noisy.wait_threshold == THRESHOLD_FLOOR
    assert noisy.judge(_reading(1.3), others=0.5) == []  # drift within the work's own noise
    assert "held this CPU 10%" in noisy.judge(_reading(1.0, 0.10))[0]  # a neighbour on the CPU
    assert noisy.window_wait_limit == pytest.approx(THRESHOLD_FLOOR / (1 + THRESHOLD_FLOOR))
    delay = FakeDelay()
    probe = FakeProbe([(5.0, 0.0)] + [(w, 0.0) for w in (1.0, 1.17, 0.95, 1.05, 1.3)] + [(1.0, 0.0)] * 2)
    watch = Watch(probe, delay=delay, cpu_clock=FakeCpu())
    watch.begin()
    delay.step = 0.25 * 3600  # an hour-long window that waited a quarter of its time
    watch.window.started -= 3600
    watch.add("point")
    assert watch.close("after an hour").disturbed


def test_waits_at_the_start_are_recorded_as_a_disturbance_from_the_start():
    probe = FakeProbe([(1.0, 0.0)] + [(w, 0.5) for w in QUIET] + [(1.0, 0.5)])
    watch = Watch(probe, delay=FakeDelay(), cpu_clock=FakeCpu())
    watch.begin()
    assert len(watch.flagged_readings) == START_READINGS
    watch.add("point")
    assert watch.close("end").disturbed  # opened and closed by readings that waited
    assert watch.record()["reasons"] == {"waited": 0.5}


def test_machine_readers():
    clock = machine.CpuClock(frozenset({0}))
    t = machine.TICKS
    two_s = machine.CpuMark(2.0, 3 * t, 1.0)
    assert clock.others_cores(machine.CpuMark(0.0, 0, 0.0), two_s) == pytest.approx(1.0)
    assert clock.others_cores(machine.CpuMark(1.99, 0, 0.0), two_s) is None  # too short to tell
    assert clock.others_cores(machine.CpuMark(0.0, None, 0.0), two_s) is None
    mark = machine.CpuClock().mark()
    assert mark.own >= 0 and (mark.busy is None or mark.busy > 0)
    delay = machine.run_delay()
    assert delay is None or delay >= 0


def test_the_process_columns_leave_interrupt_time_out(tmp_path, monkeypatch):
    # cpu0: user nice system idle iowait irq softirq steal
    stat = tmp_path / "stat"
    stat.write_text("cpu  0 0 0 0 0 0 0 0\ncpu0 100 0 50 900 0 30 200 5\n")
    monkeypatch.setattr(machine, "PROC_STAT", str(stat))
    every = machine.CpuClock(frozenset({0})).mark().busy
    processes = machine.CpuClock(frozenset({0}), columns=machine.PROCESS_COLUMNS).mark()
    assert every == 100 + 50 + 30 + 200 + 5 and processes.busy == 100 + 50 and processes.steal == 5


def test_gpu_neighbours_through_nvml(monkeypatch):
    class Proc:
        def __init__(self, pid, mem):
            self.pid, self.usedGpuMemory = pid, mem
    calls = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByUUID=lambda u: calls.append(u) or "h",
        nvmlDeviceGetHandleByIndex=lambda i: calls.append(i) or "h",
        nvmlDeviceGetComputeRunningProcesses=lambda h: [Proc(os.getpid(), 1), Proc(4242, 2**30)])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert machine.gpu_neighbours("8c7d") == [{"pid": 4242, "memory_bytes": 2**30}]  # not this process
    assert calls == ["init", "GPU-8c7d", "shutdown"]
    assert machine.gpu_neighbours(None, 1) and calls[-2] == 1

    def broken():
        raise RuntimeError("NVML Shared Library Not Found")
    monkeypatch.setattr(fake, "nvmlInit", broken)
    assert machine.gpu_neighbours("x") is None  # no answer is not a failure


def _tiny_store(tmp_path, tiny_plan):
    from neox_perf.calibration.sweep import calibrate
    path = tmp_path / "s.sqlite"
    summary = calibrate(tiny_plan, path, clock=FakeClock(), watch=False)
    return path, summary


def test_flagged_samples_are_measured_again_by_the_next_calibration(tmp_path, tiny_plan):
    from neox_perf.calibration.store import SampleStore
    from neox_perf.calibration.sweep import calibrate
    path, first = _tiny_store(tmp_path, tiny_plan)
    assert first.disturbance is None  # an injected clock: nothing to watch
    with SampleStore(path) as store:
        assert "disturbance" not in store.runs()[0]["info"]
        samples = store.samples(op="linear1")[:3]
        marked = store.flag_disturbed([(s.op, s.phase, s.features) for s in samples],
                                      {"window": 1, "why": ["test"]}, device=first.device_id, dtype="fp32")
        assert marked == 3
        flagged = store.disturbed(device=first.device_id, dtype="fp32")
        assert len(flagged) == 3 and all(m["why"] == ["test"] for m in flagged.values())
        assert store.disturbed(device=first.device_id, dtype="fp16") == {}
        kept = store.samples(op="linear1")[0].info
        assert kept["times"] and kept["disturbed"]["window"] == 1  # the mark is added, nothing lost
    again = calibrate(tiny_plan, path, clock=FakeClock((0.003,)), watch=False)
    assert (again.remeasured, again.measured, again.already_stored) == (3, 0, first.total - 3)
    with SampleStore(path) as store:
        assert store.disturbed(device=first.device_id) == {}
        assert store.count() == first.total  # replaced, not added
        remeasured = [s for s in store.samples(op="linear1") if s.run_id == again.run_id]
        assert len(remeasured) == 3 and all(s.seconds == pytest.approx(0.003) for s in remeasured)


def _runs(*records):
    return [{"id": i + 1, "kind": "calibrate", "info": {"dtype": "fp32", **({"disturbance": r} if r else {})}}
            for i, r in enumerate(records)]


RECORD = {"reference": "ref", "baseline": {"work": 0.01, "noise": 0.012, "threshold": 0.024},
          "max_slowdown": 1.1, "reasons": {"waited": 0.52}, "points": {"flagged": 9, "retimed": 2}}


def test_the_profile_section_and_its_warning():
    assert from_calibration("mine", _runs(None), 0, 10) is None  # not watched: nothing to say
    quiet = from_calibration("mine", _runs({**RECORD, "reasons": {}}), 0, 40)
    assert not quiet.flagged and quiet.warning is None and quiet.samples == 40
    assert quiet.extra["runs"][0]["run"] == 1
    bad = from_calibration("mine", _runs(None, RECORD), 7, 40)
    assert bad.flagged and bad.disturbed == 7
    assert bad.warning.startswith("calibration disturbed: 7 of 40 operator samples were timed while ")
    assert "waited for a CPU up to 52% of its time, beyond its own noise of 1.2%" in bad.warning
    assert "`neox-perf calibrate --cluster mine` again" in bad.warning
    assert Disturbance.parse(bad.to_dict()) == bad
    # the collectives and the engine cannot be re-timed: a reading after them says so
    after = {**RECORD, "after": {"what": "after the collectives and the engine",
                                 "why": ["the reference took 1.40x its time at rest while ..."],
                                 "found": {"drift": 0.4, "others_cores": 1.2}}}
    late = from_calibration("mine", _runs(after), 0, 40)
    assert late.flagged and "after the collectives and the engine, the reference took 1.40x" in late.warning
    assert "took up to 1.40x its time at rest while other processes kept up to 1.20 cores" in late.warning
    assert "new --store" in late.warning


def test_every_report_gets_the_warning_of_the_profile_and_of_its_base():
    from neox_perf.profile.manifest import Manifest
    bad = from_calibration("mine", _runs(RECORD), 3, 40)
    sampled = types.SimpleNamespace(manifest=Manifest("mine", disturbance=bad), base=None)
    described = types.SimpleNamespace(manifest=Manifest("my-cluster"), base=sampled)
    assert profile_warnings(sampled) == [f"profile mine: {bad.warning}"]
    assert profile_warnings(described) == [f"profile mine: {bad.warning}"]
    assert profile_warnings(types.SimpleNamespace(manifest=Manifest("quiet"))) == []


def test_the_probe_benchmark_reads_a_busy_cpu(capsys, benchmark_script):
    """benchmarks/disturbance_probe.py: the probe alone and beside a spinner on its CPU."""
    affinity = os.sched_getaffinity(0)
    assert benchmark_script("disturbance_probe").main(["--readings", "2", "--json"]) == 0
    assert os.sched_getaffinity(0) == affinity  # given back
    out = json.loads(capsys.readouterr().out)
    assert {"work", "noise", "threshold"} <= set(out["baseline"]) and out["busy"]["readings"] == 2
    assert out["busy"]["waited"]["median"] > 0.3 and out["busy"]["disturbed"] == 2
    # the steps' watch's view beside it: processes and steal apart (None where too short to tell)
    view = out["busy"]["steps_view"]
    assert view["cpus"] == len(affinity) and {"processes_share", "steal_share"} <= set(view)
    assert out["baseline"]["wait_threshold"] == THRESHOLD_FLOOR


def test_tight_start_readings_do_not_make_a_threshold_below_the_floor():
    # five start readings 0.1% apart: twice their range is 0.2%, under the platform's own
    # blips; the floor keeps a 2% slower reference beside a busy neighbour unflagged
    base = Baseline.of([_reading(w) for w in (1.000, 1.001, 1.002, 1.001, 1.000)])
    assert base.noise < 0.005 and base.threshold == THRESHOLD_FLOOR
    assert base.judge(_reading(1.02), others=0.5) == []
    assert base.judge(_reading(1.04), others=0.5) != []
