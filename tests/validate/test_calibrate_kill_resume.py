"""Killing `neox-perf calibrate` mid-way loses at most the point in flight; a re-run completes.

(calibration.sweep's own kill-and-resume is tested in tests/calibration; this is the command.)"""
import json
import sqlite3
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from neox_perf.calibration.plan import load_plan  # noqa: E402
from neox_perf.calibration.store import SampleStore  # noqa: E402
from neox_perf.predictors import load_profile  # noqa: E402

from validate_helpers import TINY_PLAN  # noqa: E402


def _rows(path):
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT id, op, phase, features, seconds, run_id, "
                            "info LIKE '%\"disturbed\"%' FROM samples ORDER BY id").fetchall()
    finally:
        conn.close()


def test_sigkill_of_the_cli_then_rerun(tmp_path, home, sigkill_once):
    """SIGKILL `neox-perf calibrate` (real clock) once a few points are committed, then the same
    command line again finishes from where the store stands and writes a usable profile."""
    plan = tmp_path / "slow.yml"
    # min_seconds makes every point take >= 40 ms of timed work, so the kill lands mid-plan
    plan.write_text(TINY_PLAN.replace("protocol: {warmup: 0, repeats: 2}",
                                      "protocol: {warmup: 0, repeats: 2, min_seconds: 0.04, max_repeats: 100000}"))
    store, out = tmp_path / "s.sqlite", tmp_path / "profile"
    cmd = [sys.executable, "-m", "neox_perf.cli", "calibrate", "--cluster", "tiny", "--plan", str(plan),
           "--store", str(store), "--out", str(out), "--nproc", "1", "--no-engine", "--json"]
    total = len(load_plan(str(plan)))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def ready():
        try:
            return store.exists() and len(_rows(store)) >= 3
        except sqlite3.OperationalError:  # schema not there yet
            return False
    sigkill_once(proc, ready)
    before = _rows(store)
    assert 3 <= len(before) < total, "killed too late to test a resume"
    assert not (out / "manifest.json").exists()

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    payload = json.loads(rerun.stdout)
    # what the killed run's disturbance watch marked (a busy moment on a shared box does it)
    # is measured again on resume, in place; everything else it committed is kept as it was
    kept = [r for r in before if not r[-1]]
    assert payload["operators"]["already_stored"] == len(kept)
    assert payload["operators"]["remeasured"] <= len(before) - len(kept)
    assert payload["operators"]["measured"] == total - len(before)
    after = _rows(store)
    assert set(kept) <= set(after) and len(after) == total
    with SampleStore(store) as s:
        assert s.integrity_check() == "ok"
        assert len({(x.op, x.phase, tuple(sorted(x.features.items()))) for x in s.samples()}) == total
    assert load_profile(out).operators()
