"""Issue #34 §2, each case: `calibrate` (its command function, the real clock, two processes)
with a process spinning on its CPUs during the first run of one step -- the plan's collectives,
the gradient-bucket collectives, the tensor-parallel all-reduce, the engine runs -- and quiet
otherwise. The step is seen, run again once the machine is quiet, and either its quiet re-run
replaced what the first run measured, or the profile is flagged naming it. Never silent.

The operator step's own watch (reference probe, windows, re-timing) is tested in
tests/calibration/test_disturbed_calibration.py."""
import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("deepspeed")
if not hasattr(os, "sched_setaffinity"):
    pytest.skip("needs os.sched_setaffinity (Linux)", allow_module_level=True)

from neox_perf.calibration.engine import engine_path  # noqa: E402
from neox_perf.calibration.store import COLLECTIVE_PHASE, SampleStore  # noqa: E402
from neox_perf.calibration.tp_allreduce import tp_path  # noqa: E402
from neox_perf.commands import calibrate as command  # noqa: E402
from neox_perf.predictors import load_profile  # noqa: E402
from neox_perf.predictors.fitting import fit  # noqa: E402

from validate_helpers import calibrate_args  # noqa: E402

SPIN = "import os\nos.sched_setaffinity(0, {%d})\nprint('spinning', flush=True)\nwhile True:\n    pass\n"
PLAN = """
name: steps
protocol: {warmup: 0, repeats: 2}
defaults: {mp: 1, b: 1, l: [32, 64], d: [64, 128], h: 2, vocab: [256, 512]}
ops:
  embedding: {}
  layernorm: {}
  linear1: {}
  linear2: {}
  linear3: {}
  linear4: {}
  linear_final: {}
  rope: {}
  qk: {}
  fillmask: {}
  softmax: {}
  fused_softmax: {}
  attn_dropout: {}
  av: {}
  gelu: {}
  res_add: {}
  cross_entropy: {}
  optimizer: {params: [1000, 100000, 1000000]}
collectives:
  protocol: {warmup: 1, repeats: 3}
  allreduce: {elements: [1024, 65536]}
"""
ENGINE_SHAPE = (128, 64, 1, "layernorm", "global", 512)

# step name in the record -> the function of calibrate.py that runs it
STEPS = {"collectives": "launch_plan_collectives",
         "gradient-bucket collectives": "run_bucket_collectives",
         "tensor-parallel all-reduce": "run_tp_benchmark",
         "engine": "run_engine"}


# The spinner is another process's, as a neighbour's would be: started through a launcher that
# exits at once, so it is not this process's child (a reaped child's CPU time counts as the
# calibration's own, machine.CpuClock) and it is stopped by its pid.
LAUNCH = ("import subprocess, sys\n"
          "p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stdout=subprocess.PIPE, "
          "stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, "
          "start_new_session=True)\n"
          "print(p.pid, p.stdout.readline().strip(), flush=True)\n")


@contextlib.contextmanager
def _spinning(cpu):
    out = subprocess.run([sys.executable, "-c", LAUNCH, SPIN % cpu], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[1] == "spinning"
    pid = int(out[0])
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGKILL)


def _disturb_first_call(monkeypatch, name):
    """The step's first run has a spinner on one of the calibration's CPUs all along."""
    original = getattr(command, name)
    calls = []

    def disturbed(*args, **kwargs):
        calls.append(args[0])
        if len(calls) > 1:
            return original(*args, **kwargs)
        with _spinning(max(os.sched_getaffinity(0))):
            return original(*args, **kwargs)
    monkeypatch.setattr(command, name, disturbed)
    return calls


@pytest.mark.parametrize("step", list(STEPS))
def test_a_step_shared_with_a_busy_process_is_retimed_or_flagged(step, tmp_path, monkeypatch):
    monkeypatch.setenv("NEOX_PERF_HOME", str(tmp_path / "home"))
    (tmp_path / "plan.yml").write_text(PLAN)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("two processes need two CPUs")
    calls = _disturb_first_call(monkeypatch, STEPS[step])
    args = calibrate_args(tmp_path, tmp_path / "plan.yml", nproc=2, engine=True,
                          engine_shapes=[ENGINE_SHAPE])
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus[:2]))  # the spinner takes one of the two the steps run on
    try:
        result = command.run_calibrate(args, grid=fit.QUICK_GRID)
    finally:
        os.sched_setaffinity(0, before)
    watched = {s["step"]: s for s in result.steps_watched["steps"]}
    rec = watched[step]
    assert rec["others_share"] > 0.1, rec  # the spinner was seen
    assert len(calls) == 2 or rec["still_disturbed"], rec  # run again once quiet, or flagged
    profile = load_profile(tmp_path / "profile")
    section = profile.manifest.disturbance
    if rec["retimed"]:
        assert not rec["still_disturbed"] and rec["retime_share"] <= result.steps_watched["limit"]
        # the re-run's result is what the profile was fitted on
        if step in ("collectives", "gradient-bucket collectives"):
            with SampleStore(tmp_path / "s.sqlite") as store:
                retimed = [s for s in store.samples(source="calibrate")
                           if s.phase == COLLECTIVE_PHASE and s.info.get("retimed")]
            assert retimed
        else:
            target = tp_path if step.startswith("tensor") else engine_path
            assert calls[1] != target(tmp_path / "s.sqlite")  # measured into a scratch file
            assert json.loads(target(tmp_path / "s.sqlite").read_text())  # then moved over
            assert not calls[1].exists()
    else:
        assert rec["still_disturbed"] and section.flagged and step in section.warning
    # the other steps ran beside nothing of ours: judged quiet, or (something else shared the
    # machine) handled the same way -- never silently kept
    for other in watched.values():
        assert not other["why"] or other["retimed"] or other["still_disturbed"]
