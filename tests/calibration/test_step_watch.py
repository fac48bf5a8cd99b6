"""Issue #34 §2: every step of `calibrate` after the operators is watched whole (collectives,
gradient buckets, the tensor-parallel all-reduce, the engine): a step other processes shared is
run again once the machine is quiet, its re-run replacing it only when that was quiet too, and
what could not be cleaned flags the profile.

The steps' verdicts come from the CPU time other processes used while the step ran
(calibration/machine.CpuClock, read from /proc/stat): the tests put a real process spinning on
the calibration's CPUs for the first run of one step, then stop it. Unit tests drive StepWatch
with a scripted clock."""
import json
from pathlib import Path
import os
import subprocess
import sys

import pytest

from neox_perf.calibration import machine
from neox_perf.calibration.step_watch import STEP_LIMIT, StepWatch
from neox_perf.profile.disturbance import from_calibration

from calib_helpers import spinning  # noqa: E402


class ScriptedClock:
    """others_cores per judged span, in order (and a steady steal); two cores."""

    def __init__(self, shares, steal=0.0):
        self.cpus = frozenset({0, 1})
        self.shares = list(shares)
        self.steal = steal
        self.marks = 0

    def mark(self):
        self.marks += 1
        return self.marks

    def others_cores(self, start, end):
        return 2 * self.shares.pop(0)

    def steal_cores(self, start, end):
        return 2 * self.steal


def _watch(shares):
    return StepWatch(cpu_clock=ScriptedClock(shares), sleep=lambda s: None, quiet_wait=10.0)


def test_a_quiet_step_runs_once():
    watch, calls = _watch([0.001]), []
    assert watch.run("engine", lambda: calls.append("run") or 7, lambda: calls.append("again")) == 7
    assert calls == ["run"] and watch.disturbed == []
    assert watch.record()["steps"][0]["others_share"] == pytest.approx(0.001)


def test_steal_is_recorded_beside_the_step_and_never_reruns_it():
    # the hypervisor took 5% of both CPUs through the step (this VM's steal is steady): a re-run
    # waits for the same hypervisor, so it is recorded, not judged; other processes' 0.1% is quiet
    watch = StepWatch(cpu_clock=ScriptedClock([0.001], steal=0.05), sleep=lambda s: None, quiet_wait=10.0)
    again = []
    watch.run("engine", lambda: None, lambda: again.append(1))
    rec = watch.record()["steps"][0]
    assert again == [] and watch.disturbed == [] and rec["why"] == []
    assert rec["steal_share"] == pytest.approx(0.05) and rec["others_share"] == pytest.approx(0.001)
    from rich.console import Console
    from neox_perf.render.calibrate_text import _steps
    console = Console(record=True, width=240)
    _steps(watch.record(), console)
    said = console.export_text()
    assert "other processes took at most 0.1% of the CPUs" in said and "steal at most 5.0%" in said


def test_the_real_clock_reads_steal_apart_from_processes(tmp_path, monkeypatch):
    # cpu0 and cpu1: user nice system idle iowait irq softirq steal; 2 s apart
    stat = tmp_path / "stat"
    monkeypatch.setattr(machine, "PROC_STAT", str(stat))
    clock = machine.CpuClock(frozenset({0, 1}), columns=machine.PROCESS_COLUMNS)
    t = machine.TICKS
    stat.write_text("cpu  0 0 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0 0\n")
    start = clock.mark()
    stat.write_text(f"cpu  0 0 0 0 0 0 0 0\ncpu0 {t} 0 0 0 0 {t} {t} {t // 10}\n"
                    f"cpu1 0 0 0 0 0 0 0 {t // 10}\n")
    end = machine.CpuMark(start.wall + 2.0, clock.mark().busy, start.own, clock.mark().steal)
    assert clock.others_cores(start, end) == pytest.approx(0.5)  # user alone: 1 core-s in 2 s
    assert clock.steal_cores(start, end) == pytest.approx(0.1)  # 0.2 core-s in 2 s


def test_a_disturbed_step_is_run_again_and_the_quiet_rerun_replaces_it():
    # first run shared (30% of the CPUs), then a quiet window, then a quiet re-run
    watch, committed = _watch([0.30, 0.0, 0.001]), []
    watch.run("collectives", lambda: None, lambda: (lambda: committed.append(True)))
    rec = watch.record()["steps"][0]
    assert committed == [True] and rec["retimed"] and not rec["still_disturbed"]
    assert "30% of this machine's CPUs" in rec["why"][0] and watch.record()["still_disturbed"] == []


def test_a_rerun_that_is_shared_too_leaves_the_step_flagged_and_the_first_result():
    watch, committed = _watch([0.30, 0.0, 0.25]), []
    watch.run("engine", lambda: None, lambda: (lambda: committed.append(True)))
    assert committed == [] and watch.record()["still_disturbed"] == ["engine"]
    assert any(w.startswith("re-run: ") for w in watch.records[0].why)


def test_a_machine_that_never_quiets_is_not_rerun():
    watch = StepWatch(cpu_clock=ScriptedClock([0.3] + [0.3] * 100), sleep=lambda s: None,
                      quiet_wait=0.0)
    called = []
    watch.run("tensor-parallel all-reduce", lambda: None, lambda: called.append(1))
    assert called == [] and watch.disturbed[0].still_disturbed
    assert "not quiet again" in watch.disturbed[0].why[-1]


def test_a_still_disturbed_step_flags_the_profile_and_names_the_step():
    watch = _watch([0.3, 0.0, 0.3])
    watch.run("engine", lambda: None, lambda: (lambda: None))
    rec = {"baseline": {"work": 0.01, "noise": 0.01, "threshold": 0.03}, "steps": watch.record()}
    section = from_calibration("mine", [{"id": 1, "info": {"disturbance": rec}}], 0, 50)
    assert section.flagged and "the engine step, other processes took 30%" in section.warning
    assert "new --store" in section.warning
    clean = _watch([0.001])
    clean.run("engine", lambda: None)
    rec["steps"] = clean.record()
    assert not from_calibration("mine", [{"id": 1, "info": {"disturbance": rec}}], 0, 50).flagged


# -- the real steps, beside a real busy process ------------------------------------------------

@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux /proc/stat and affinity")
def test_the_watch_sees_a_real_process_beside_a_step(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))[:2]
    clock = machine.CpuClock(frozenset(cpus))

    def step():  # a step's ranks: children doing work for about 1.5 s
        subprocess.run([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<1.5: pass"],
                       check=True)

    watch = StepWatch(cpu_clock=clock, quiet_window=1.2, quiet_wait=30.0)
    rerun = []

    def again():
        step()
        rerun.append(True)
        return lambda: rerun.append("committed")

    with spinning(cpus[-1]):
        first = StepWatch(cpu_clock=clock)
        first.run("collectives", step)
    assert first.disturbed and first.records[0].others_share > STEP_LIMIT  # it was seen
    watch.run("collectives", step, again)
    rec = watch.records[0]
    # without the spinner: quiet, run once (the machine's own work here stays under the limit),
    # or -- only if something else really shared the CPUs -- re-run or flagged, never silent
    assert not rec.why or rec.retimed or rec.still_disturbed
    json.dumps(watch.record())


@pytest.mark.parametrize("shares, committed", [([0.30, 0.0, 0.25], False), ([0.30, 0.0, 0.001], True)])
def test_a_rerun_leaves_no_scratch_behind_and_each_step_has_its_own(tmp_path, monkeypatch, shares, committed):
    """calibrate's steps (commands/calibrate._Steps) run again into a scratch file: moved over the
    first result when the re-run was quiet, removed when it was not. The engine's and the
    tensor-parallel results are both .json: their scratch names differ (one name had let the
    engine's uncommitted scratch stand where the tensor-parallel step's was checked)."""
    from neox_perf.commands import calibrate as command
    written = []

    def writer(tag):
        def run(path, *args, **kwargs):
            written.append(Path(path).name)
            Path(path).write_text(json.dumps({"from": tag, "n": len(written)}))
        return run
    monkeypatch.setattr(command, "run_tp_benchmark", writer("tp"))
    monkeypatch.setattr(command, "run_engine", writer("engine"))
    store = tmp_path / "s.sqlite"
    steps = command._Steps(store, 2, "cpu", _watch(list(shares) * 2))
    steps.tensor_parallel()
    steps.engine(None)
    first, again = written[0::2], written[1::2]
    assert first == ["s.tp.json", "s.engine.json"] and len(set(again)) == 2  # a scratch each
    assert not any((tmp_path / name).exists() for name in again)
    for final, n in (("s.tp.json", 1), ("s.engine.json", 3)):
        assert json.loads((tmp_path / final).read_text())["n"] == (n + 1 if committed else n)


def test_a_step_flagged_after_it_ran_is_disturbed_and_says_why():
    """What the CPU shares cannot see but the step's own result shows (the engine step's sweeps
    disagreeing: engine.sweep_findings) marks the step's record disturbed, with the reason."""
    from neox_perf.calibration.step_watch import StepWatch

    class Clock:
        cpus = (0, 1)

        def mark(self):
            return 0

        def others_cores(self, a, b):
            return 0.0

        def steal_cores(self, a, b):
            return 0.0

    watch = StepWatch(cpu_clock=Clock(), sleep=lambda s: None)
    watch.run("engine", lambda: None)
    assert watch.disturbed == []
    watch.flag("engine", [])
    assert watch.disturbed == []
    watch.flag("engine", ["its tensor-parallel pass ran +12% in its second sweep"])
    watch.flag("no such step", ["ignored"])
    assert [r.step for r in watch.disturbed] == ["engine"]
    assert watch.record()["steps"][0]["why"] == ["its tensor-parallel pass ran +12% in its second sweep"]
    assert watch.record()["still_disturbed"] == ["engine"]
