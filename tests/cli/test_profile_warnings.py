"""A profile whose calibration was disturbed says so in every report made with it: check and
plan (text and JSON), validate and calibrate (their results and renderers). report and
calibrate --from-run need a hooked run: tests/hooks/test_from_run.py."""
import io
import json
import shutil
from dataclasses import replace

import pytest
from rich.console import Console

from neox_perf.profile import directory
from neox_perf.profile.disturbance import Disturbance

from test_plan_cli import SMALL, run  # the plan tests' config and in-process CLI runner

WARNING = ("calibration disturbed: 3 of 9 operator samples were timed while other work shared "
           "the machine (a test).")
LINE = f"profile shaky: {WARNING}"


@pytest.fixture
def shaky(tmp_path):
    """A bundled profile's copy whose manifest says its calibration was disturbed."""
    from neox_perf.predictors.profile import list_profiles
    bundled = [p for p in list_profiles() if not p.description]
    if not bundled:
        pytest.skip("no bundled cluster profile")
    path = tmp_path / "shaky"
    shutil.copytree(bundled[0].path, path)
    directory.update(path, lambda m: replace(m, name="shaky", disturbance=Disturbance(True, WARNING, 9, 3)))
    return path, bundled[0].name


@pytest.mark.parametrize("command", ["check", "plan"])
def test_check_and_plan_carry_the_warning(shaky, write_yaml, command):
    path, bundled = shaky
    argv = [command, write_yaml("small.yml", SMALL), "--gpus", "8"]
    code, out, err = run(argv + ["--cluster", str(path), "--json"])
    assert code == 0, err
    assert json.loads(out)["profile_warnings"] == [LINE]
    code, out, err = run(argv + ["--cluster", str(path)])
    assert code == 0 and "WARNING  profile shaky: calibration disturbed: 3 of 9" in out, out
    _, out, _ = run(argv + ["--cluster", bundled, "--json"])  # the same profile, undisturbed
    assert json.loads(out)["profile_warnings"] == []


def _text(result):
    buf = io.StringIO()
    module = __import__(f"neox_perf.render.{result.render_hint}", fromlist=["render"])
    module.render(result, Console(file=buf, width=200, highlight=False))
    return buf.getvalue()


def test_validate_and_calibrate_results_carry_it():
    from neox_perf.commands.calibrate import CalibrateResult
    from neox_perf.commands.validate import ValidateResult
    v = ValidateResult(cluster="shaky", gpus=2, profile_warnings=[LINE])
    assert v.to_dict()["profile_warnings"] == [LINE] and f"WARNING  {LINE}" in _text(v)
    section = Disturbance(True, WARNING, 9, 3, extra={"runs": [{"run": 1}]})
    c = CalibrateResult(cluster="shaky", profile_path="/p", store="/s", plan="quick", device="cpu",
                        disturbance=section.to_dict(), profile_warnings=[LINE])
    assert c.to_dict()["disturbance"]["flagged"] is True and f"WARNING  {LINE}" in _text(c)
    quiet = Disturbance(False, None, 9, 0, extra={"runs": [{"run": 1, "readings_taken": 12,
                                                           "baseline": {"threshold": 0.021}}]})
    c = replace(c, disturbance=quiet.to_dict(), profile_warnings=[])
    text = _text(c)
    assert "machine quiet" in text and "2.1%" in text and "12 readings" in text and "WARNING" not in text
