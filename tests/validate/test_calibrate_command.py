"""`neox-perf calibrate` through its command function: measure, fit, write, find by name."""
import json
import math

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from neox_perf.calibration.plan import load_plan  # noqa: E402
from neox_perf.calibration.store import SampleStore  # noqa: E402
from neox_perf.commands.calibrate import run_calibrate  # noqa: E402
from neox_perf.errors import UsageError  # noqa: E402
from neox_perf.predictors import load_profile  # noqa: E402
from neox_perf.predictors.fitting import fit  # noqa: E402

from validate_helpers import FakeClock, calibrate_args  # noqa: E402


def test_tiny_plan_builds_a_loadable_profile_and_reports_progress(tmp_path, tiny_plan, home):
    calls = []
    result = run_calibrate(calibrate_args(tmp_path, tiny_plan, out=None),
                           progress=lambda *a: calls.append(a), clock=FakeClock(), grid=fit.QUICK_GRID)
    points = len(load_plan(str(tiny_plan)))
    assert result.operators["measured"] == points and result.operators["already_stored"] == 0
    assert result.collectives["skipped"]  # one process: nothing to talk to
    assert {c[0] for c in calls} == {"operators", "collectives", "fit"}
    assert calls[-1][1] == calls[-1][2]  # the fit finished
    profile = load_profile("tiny")  # found by name under $NEOX_PERF_HOME/profiles
    assert str(profile.path) == str((home / "profiles" / "tiny").resolve())
    facts = profile.facts
    assert facts.gpus_per_node == 1 and facts.gpu_name.endswith("(CPU)")
    assert facts.intra_node_link.name == "shared memory (gloo)" and facts.gpu_memory_bytes > 2**30
    for op, phase in profile.operators():
        feats = {n: 64.0 for n in profile.manifest.to_dict()["operators"][op][phase]["features"]}
        assert math.isfinite(profile.predict(op, phase, feats).seconds)
    rows = {(r["op"], r["phase"]) for r in result.fit}
    assert ("linear1", "fwd") in rows and ("optimizer", "step") in rows
    json.dumps(result.to_dict())  # the --json payload is plain data


def test_rerun_resumes_and_a_bundled_name_is_refused(tmp_path, tiny_plan, home):
    args = calibrate_args(tmp_path, tiny_plan)
    first = run_calibrate(args, clock=FakeClock(), grid=fit.QUICK_GRID)
    again = run_calibrate(args, clock=FakeClock(), grid=fit.QUICK_GRID)
    assert again.operators["measured"] == 0
    assert again.operators["already_stored"] == first.operators["measured"]
    with pytest.raises(UsageError, match="bundled"):
        run_calibrate(calibrate_args(tmp_path, tiny_plan, cluster="perlmutter-a100", out=None))
    with pytest.raises(UsageError, match="exclude"):
        run_calibrate(calibrate_args(tmp_path, tiny_plan, quick=True))


def test_two_processes_measure_the_plans_collectives(tmp_path, tiny_plan, home):
    result = run_calibrate(calibrate_args(tmp_path, tiny_plan, nproc=2), clock=FakeClock(),
                           grid=fit.QUICK_GRID)
    assert result.collectives["measured"] == result.collectives["jobs"] == 4
    profile = load_profile(tmp_path / "profile")
    assert profile.facts.gpus_per_node == 2 and profile.collectives() == ["allreduce", "p2p"]
    assert profile.predict_collective("allreduce", 1000, 1, 2).seconds > 0
    with SampleStore(tmp_path / "s.sqlite") as store:
        assert store.integrity_check() == "ok"
        assert len({s.device_id for s in store.samples()}) == 1  # ops and collectives: one device


def test_the_engine_step_runs_before_the_operators(tmp_path, tiny_plan, home, monkeypatch):
    """After the operator step the engine's tensor-parallel pass ran slower than training does,
    and the mp 2 layouts carried it (docs/validation.md, stop 50): the engine step comes first."""
    pytest.importorskip("deepspeed")
    from neox_perf.commands import calibrate as command
    from neox_perf.predictors.fitting import engine_fit

    calls = []

    def engine(path, device, progress=None, **kwargs):  # stands in for the DeepSpeed runs
        if progress is not None:
            progress(1, 1, "done")
        return {"measured": 0}
    monkeypatch.setattr(command, "run_engine", engine)
    monkeypatch.setattr(engine_fit, "add_engine", lambda *a, **k: [])
    run_calibrate(calibrate_args(tmp_path, tiny_plan, engine=True), progress=lambda *a: calls.append(a[0]),
                  clock=FakeClock(), grid=fit.QUICK_GRID)
    assert list(dict.fromkeys(calls)) == ["engine", "operators", "collectives", "fit"]
