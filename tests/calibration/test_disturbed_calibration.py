"""Issue #26, section 6, done when: a calibration disturbed on purpose (a busy process beside it)
is flagged, in the profile and in `check`'s output with that profile; a quiet one is not.

Both runs are `neox-perf calibrate` (the command's function) of the same small plan, every
operator a tiny NeoX config runs (`--for`), pinned to one CPU. The disturbed run has a process
spinning on that same CPU. The OS scheduler then splits the core between the two, in slices of
a few milliseconds: an operator shorter than a slice often runs whole inside the calibration's
own slice, so the fastest of its timed runs can look undisturbed, and a probe timed the same way
would too. What cannot look undisturbed is the share of time the calibration spends runnable
but not running, about half of it here: the reference probe's runs are longer than a slice and
its readings count the run-queue wait (calibration/disturbance.py). Pinning makes the split
certain on any number of cores; without it, a 2-core machine would give the spinner the other
core.

The quiet run asserts its precondition instead of assuming it: another process taking turns on
that CPU disturbs a calibration for real. Other processes' CPU time on it is read from
/proc/stat (calibration/machine.CpuClock, independent of the probe), over the whole run and
over each of the watch's windows; when it would slow the calibration by more than half the run's
own threshold, that CPU was not quiet and the test skips, saying so (well below the threshold,
waits cannot reach it and drift is not corroborated). Work on the other CPUs does not make it skip: a slower reference with nothing
else running on the calibration's CPUs is the platform's noise, which must not be flagged.
On a CI machine running nothing else it runs.
"""
import argparse
import contextlib
import json
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")
if not hasattr(os, "sched_setaffinity"):
    pytest.skip("needs os.sched_setaffinity (Linux) to put a busy process on the calibration's CPU",
                allow_module_level=True)

from neox_perf.calibration import machine  # noqa: E402
from neox_perf.cli import main  # noqa: E402
from neox_perf.commands.calibrate import run_calibrate  # noqa: E402
from neox_perf.predictors import load_profile  # noqa: E402
from neox_perf.predictors.fitting import fit  # noqa: E402

from calib_helpers import spinning  # noqa: E402

PLAN = """
name: disturbance-test
protocol: {warmup: 1, repeats: 3}
defaults: {mp: 1, b: 1, l: 16, d: 32, h: 2, vocab: 256}
ops:
  linear1: {}
"""

CONFIG = """{
  "pipe_parallel_size": 1, "model_parallel_size": 1, "num_layers": 2, "hidden_size": 64,
  "num_attention_heads": 4, "seq_length": 32, "max_position_embeddings": 32,
  "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
  "optimizer": {"type": "Adam", "params": {"lr": 0.001}}
}"""

CPU = max(os.sched_getaffinity(0))


@contextlib.contextmanager
def _pinned(cpu):
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _calibrate(tmp_path, name, busy):
    (tmp_path / "plan.yml").write_text(PLAN)
    (tmp_path / "config.yml").write_text(CONFIG)
    args = argparse.Namespace(cluster=name, quick=False, plan=str(tmp_path / "plan.yml"),
                              store=str(tmp_path / "s.sqlite"), out=str(tmp_path / name), nproc=1,
                              engine=False, for_configs=[str(tmp_path / "config.yml")], gpus=1)
    mine, everywhere = machine.CpuClock(frozenset({CPU})), machine.CpuClock()
    start, start_all = mine.mark(), everywhere.mark()
    with contextlib.ExitStack() as stack:
        spinner = stack.enter_context(spinning(CPU)) if busy else None
        with _pinned(CPU):
            result = run_calibrate(args, grid=fit.QUICK_GRID)
        # before the spinner is reaped: a reaped child's CPU time counts as this process's own
        others = mine.others_cores(start, mine.mark()), everywhere.others_cores(start_all, everywhere.mark())
        assert spinner is None or spinner.poll() is None  # it spun all along
    return (result, *others)


def _check(capsys, tmp_path, name):
    argv = ["check", str(tmp_path / "config.yml"), "--gpus", "1", "--vocab-size", "256",
            "--cluster", str(tmp_path / name)]
    capsys.readouterr()
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["prediction"]["iteration_seconds"] > 0  # the profile predicts the config
    assert main(argv) == 0
    return data, capsys.readouterr().out


def test_a_calibration_beside_a_busy_process_is_flagged(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NEOX_PERF_HOME", str(tmp_path / "home"))
    result, others, _ = _calibrate(tmp_path, "busy", busy=True)
    assert others is None or others > 0.3  # the spinner really took the calibration's CPU
    d = result.disturbance
    run = d["runs"][-1]
    assert run["max_waited"] > 0.3, run  # the probe saw the calibration wait for its CPU
    assert d["flagged"] and 0 < d["disturbed"] <= d["samples"] == result.operators["measured"]
    assert run["points"]["still_flagged"] == d["disturbed"]  # the spinner never let re-timing start
    assert result.profile_warnings and "calibration disturbed" in result.profile_warnings[0]
    section = load_profile(tmp_path / "busy").manifest.disturbance  # recorded in the profile
    assert section.flagged and section.warning == d["warning"]
    data, text = _check(capsys, tmp_path, "busy")
    assert data["profile_warnings"] == [f"profile busy: {section.warning}"]
    assert "WARNING  profile busy: calibration disturbed" in text


def test_a_quiet_calibration_is_not_flagged(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NEOX_PERF_HOME", str(tmp_path / "home"))
    result, others, _ = _calibrate(tmp_path, "quiet", busy=False)
    d = result.disturbance
    run = d["runs"][-1]
    threshold = run["baseline"]["threshold"]
    # the busiest second of it too (the watch's windows, read from /proc/stat): one burst of
    # another process on this CPU is a real disturbance of the points timed then
    busiest = max(others or 0.0, run["machine"]["others_cores_max"] or 0.0)
    if others is None or busiest / (1 - min(busiest, 0.99)) > threshold / 2:
        pytest.skip(f"CPU {CPU} was not quiet: other processes took {others:.3f} of it during the "
                    f"calibration, {busiest:.3f} in its busiest window (its threshold "
                    f"{threshold:.2%}); run it when the load is low")
    assert not d["flagged"], d
    assert d["disturbed"] == 0 and result.profile_warnings == []
    assert load_profile(tmp_path / "quiet").manifest.disturbance.flagged is False
    data, text = _check(capsys, tmp_path, "quiet")
    assert data["profile_warnings"] == [] and "calibration disturbed" not in text
