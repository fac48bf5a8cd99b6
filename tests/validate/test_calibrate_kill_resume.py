"""Killing `neox-perf calibrate` mid-way loses at most the point in flight; a re-run completes."""
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from neox_perf.calibration.plan import load_plan  # noqa: E402
from neox_perf.calibration.store import SampleStore  # noqa: E402
from neox_perf.commands.calibrate import run_calibrate  # noqa: E402
from neox_perf.predictors import fit, load_profile  # noqa: E402

from validate_helpers import TINY_PLAN, FakeClock, calibrate_args  # noqa: E402

# The command, as the CLI runs it, with a clock whose every reading takes 20 ms of real time.
KILLABLE = textwrap.dedent("""
    import argparse, itertools, sys, time
    from neox_perf.commands.calibrate import run_calibrate
    ticks = itertools.count()

    def slow_clock():
        time.sleep(0.02)
        return next(ticks) * 1e-3

    run_calibrate(argparse.Namespace(cluster="tiny", quick=False, plan=sys.argv[1], store=sys.argv[2],
                                     out=sys.argv[3], nproc=1, engine=False), clock=slow_clock)
""")


def _rows(path):
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT id, op, phase, features, seconds, run_id FROM samples ORDER BY id").fetchall()
    finally:
        conn.close()


def test_kill_midway_then_rerun_through_the_command(tmp_path, tiny_plan, home):
    store, out = tmp_path / "s.sqlite", tmp_path / "profile"
    script = tmp_path / "killable.py"
    script.write_text(KILLABLE)
    total = len(load_plan(str(tiny_plan)))
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_plan), str(store), str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            try:
                if store.exists() and len(_rows(store)) >= 5:
                    break
            except sqlite3.OperationalError:  # schema not there yet
                pass
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.02)
        else:
            pytest.fail("calibration never got going")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = _rows(store)
    assert 5 <= len(before) < total, "killed too late to test a resume"
    assert not (out / "manifest.json").exists()

    result = run_calibrate(calibrate_args(tmp_path, tiny_plan), clock=FakeClock(), grid=fit.QUICK_GRID)
    assert result.operators["already_stored"] == len(before)
    assert result.operators["measured"] == total - len(before)
    after = _rows(store)
    assert after[:len(before)] == before and len(after) == total
    with SampleStore(store) as s:
        assert s.integrity_check() == "ok"
        assert len({(x.op, x.phase, tuple(sorted(x.features.items()))) for x in s.samples()}) == total
    assert load_profile(out).operators()  # the re-run wrote a usable profile
    assert os.path.getsize(out / "arrays.npz") > 0


def test_sigkill_of_the_cli_then_rerun(tmp_path, home):
    """The same through `neox-perf calibrate` itself, real clock: SIGKILL once a few points are
    committed, then the same command line again finishes from where the store stands."""
    plan = tmp_path / "slow.yml"
    # min_seconds makes every point take >= 40 ms of timed work, so the kill lands mid-plan
    plan.write_text(TINY_PLAN.replace("protocol: {warmup: 0, repeats: 2}",
                                      "protocol: {warmup: 0, repeats: 2, min_seconds: 0.04, max_repeats: 100000}"))
    store, out = tmp_path / "s.sqlite", tmp_path / "profile"
    cmd = [sys.executable, "-m", "neox_perf.cli", "calibrate", "--cluster", "tiny", "--plan", str(plan),
           "--store", str(store), "--out", str(out), "--nproc", "1", "--no-engine", "--json"]
    total = len(load_plan(str(plan)))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            try:
                if store.exists() and len(_rows(store)) >= 3:
                    break
            except sqlite3.OperationalError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.01)
        else:
            pytest.fail("calibration never got going")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = _rows(store)
    assert 3 <= len(before) < total, "killed too late to test a resume"

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    import json
    payload = json.loads(rerun.stdout)
    assert payload["operators"]["already_stored"] == len(before)
    assert payload["operators"]["measured"] == total - len(before)
    after = _rows(store)
    assert after[:len(before)] == before and len(after) == total
    assert load_profile(out).operators()
