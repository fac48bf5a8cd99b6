import os
import sqlite3
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

from neox_perf.calibration.plan import load_plan  # noqa: E402
from neox_perf.calibration.sweep import calibrate, training_rows  # noqa: E402
from neox_perf.calibration.store import SampleStore  # noqa: E402

from calib_helpers import FakeClock  # noqa: E402


def _keys(store):
    return {(s.op, s.phase, tuple(sorted(s.features.items()))) for s in store.samples()}


def _plan_keys(plan):
    return {(p.op, p.phase, p.features) for p in load_plan(plan).points}


def test_calibrate_stores_every_point_then_resumes(tmp_path, tiny_plan):
    store_path = tmp_path / "cal.sqlite"
    calls = []
    summary = calibrate(tiny_plan, store_path, clock=FakeClock((2 ** -9, 2 ** -8)),
                        progress=lambda d, t, label: calls.append((d, t, label)))
    total = len(load_plan(tiny_plan))
    assert (summary.total, summary.measured, summary.already_stored, summary.failed) == (total, total, 0, [])
    assert summary.dtype == "fp32" and summary.device == "cpu" and summary.threads >= 1
    assert [c[0] for c in calls] == list(range(total)) + [total]
    assert calls[0][2].startswith("linear1 fwd ") and calls[-1] == (total, total, "done")
    with SampleStore(store_path) as store:
        assert _keys(store) == _plan_keys(tiny_plan)
        s = store.samples(op="linear1")[0]
        # readings step 2^-9, 2^-8, 2^-9, ...: every timed span (start -> end) is 2^-8 exactly
        assert s.repeats == 3 and s.info["timer"] == "wall-clock"
        assert s.seconds == s.median == s.info["times"][0] == 2 ** -8 and s.iqr == 0
        assert store.runs()[0]["finished"] is not None
    again = calibrate(tiny_plan, store_path, clock=FakeClock())
    assert (again.measured, again.already_stored) == (0, total)
    assert again.device_id == summary.device_id and again.run_id != summary.run_id
    rows = training_rows(store_path)
    assert len(rows) == total
    assert {"op", "phase", "seconds", "dtype"} <= set(rows[0])


def test_samples_become_the_trainers_training_sets(tmp_path, tiny_plan):
    from neox_perf.predictors.fitting.store_samples import training_sets
    store_path = tmp_path / "cal.sqlite"
    calibrate(tiny_plan, store_path, clock=FakeClock())
    sets = training_sets(store_path)
    points = load_plan(tiny_plan).points
    assert set(sets) == {(p.op, p.phase) for p in points}
    ts = sets[("linear1", "bwd")]
    assert set(ts.features) == {"m", "k", "n"} and len(ts) == 8
    assert (ts.seconds > 0).all() and ts.line.min() >= 1
    assert sets[("optimizer", "step")].features["params"].tolist() == [100.0, 200.0]


def test_oversized_points_are_reported_not_run(tmp_path, mocker):
    from neox_perf.calibration import sweep
    mocker.patch.object(sweep, "memory_budget", return_value=1e5)
    plan = tmp_path / "p.yml"
    plan.write_text("protocol: {warmup: 0, repeats: 1}\nops:\n  gelu: {tokens: [4, 100000], width: 8}\n")
    summary = calibrate(str(plan), tmp_path / "s.sqlite", clock=FakeClock())
    assert summary.measured == 2 and len(summary.failed) == 2
    assert all("GiB" in reason and "tokens=100000" in label for label, reason in summary.failed)


KILLABLE = textwrap.dedent("""
    import itertools, sys, time
    from neox_perf.calibration.sweep import calibrate

    ticks = itertools.count()

    def slow_clock():  # every reading takes 20 ms of real time: points finish slowly
        time.sleep(0.02)
        return next(ticks) * 1e-3

    calibrate(sys.argv[1], sys.argv[2], clock=slow_clock, threads=1)
""")


def _rows(path):
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT id, op, phase, features, seconds, created, run_id FROM samples "
                            "ORDER BY id").fetchall()
    finally:
        conn.close()


def test_kill_midway_then_rerun_leaves_a_correct_store(tmp_path, tiny_plan, sigkill_once):
    store_path = str(tmp_path / "cal.sqlite")
    script = tmp_path / "killable.py"
    script.write_text(KILLABLE)
    total = len(load_plan(tiny_plan))
    proc = subprocess.Popen([sys.executable, str(script), tiny_plan, store_path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    def ready():
        try:
            return os.path.exists(store_path) and len(_rows(store_path)) >= 5
        except sqlite3.OperationalError:  # schema not created yet
            return False
    sigkill_once(proc, ready, 60)
    before = _rows(store_path)
    assert 5 <= len(before) < total, "killed too late to test a resume"

    summary = calibrate(tiny_plan, store_path, clock=FakeClock())
    assert summary.already_stored == len(before)
    assert summary.measured == total - len(before)
    after = _rows(store_path)
    assert after[:len(before)] == before  # earlier rows untouched
    with SampleStore(store_path) as store:
        assert store.integrity_check() == "ok"
        assert _keys(store) == _plan_keys(tiny_plan)
        runs = store.runs()
        assert runs[0]["finished"] is None and runs[-1]["finished"] is not None
    conn = sqlite3.connect(store_path)
    dupes = conn.execute("SELECT COUNT(*) FROM (SELECT 1 FROM samples GROUP BY op, phase, features, "
                         "dtype, device_id HAVING COUNT(*) > 1)").fetchone()[0]
    assert dupes == 0 and len(after) == total
