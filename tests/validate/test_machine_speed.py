"""The machine's speed at a launch against its calibration's: the calibration's fixed reference
(calibration/disturbance.Probe) read back from the profile, timed again around each launch by
`validate`, and the prediction scaled to it beside the plain error (commands/validate.py,
benchmarks/validate_local.py)."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from test_validate_local_compare import CONFIGS


REFERENCE = "10 x (256x256x256 GEMM + 1048576-element add), fp32 on cpu"


def _calibrated(tmp_path, runs):
    """A bundled profile's copy whose manifest carries a calibration watch's record."""
    import shutil
    from dataclasses import replace

    from neox_perf.predictors.profile import list_profiles
    from neox_perf.profile import directory
    from neox_perf.profile.disturbance import Disturbance
    bundled = [p for p in list_profiles() if not p.description]
    if not bundled:
        pytest.skip("no bundled cluster profile")
    path = tmp_path / "calibrated"
    shutil.copytree(bundled[0].path, path)
    directory.update(path, lambda m: replace(m, name="calibrated",
                                             disturbance=Disturbance(False, extra={"runs": runs})))
    return path


def test_the_calibration_reference_is_read_from_the_profile(tmp_path):
    from neox_perf.predictors.profile import load_profile
    from neox_perf.profile.disturbance import Reference, reference
    # the last run with a baseline counts; a run without one (an older store) is passed over
    path = _calibrated(tmp_path, [{"run": 1, "reference": REFERENCE.replace("10 x", "20 x"),
                                   "baseline": {"work": 0.04}},
                                  {"run": 2, "reference": REFERENCE, "baseline": {"work": 0.01}},
                                  {"run": 3, "reference": REFERENCE}])
    assert reference(load_profile(path)) == Reference(10, "fp32", "cpu", pytest.approx(0.001))
    other = _calibrated(tmp_path / "b", [{"run": 1, "reference": "something else", "baseline": {"work": 1.0}}])
    assert reference(load_profile(other)) is None


def test_the_watch_record_loops_reach_the_manifest_and_count_before_the_text():
    from neox_perf.profile.disturbance import from_calibration, reference
    # the watch's own "loops" (calibration/disturbance.Watch.record) is kept per run; the text's
    # count is read only for a run recorded without it
    record = {"reference": REFERENCE, "loops": 20, "baseline": {"work": 0.04, "noise": 0.01}}
    section = from_calibration("local", [{"id": 7, "info": {"disturbance": record}}], 0, 100)
    assert section.extra["runs"][0]["loops"] == 20
    ref = reference(SimpleNamespace(manifest=SimpleNamespace(disturbance=section)))
    assert (ref.loops, ref.seconds_per_loop) == (20, pytest.approx(0.002))
    assert ref.speed_at(0.004) == pytest.approx(0.5) and ref.speed_at(None) is None


def test_the_probe_describes_what_the_profile_reads_back():
    from neox_perf.calibration.disturbance import Probe
    from neox_perf.profile.disturbance import Disturbance, reference
    probe = Probe("cpu", "fp32", loops=2)
    section = Disturbance(False, extra={"runs": [{"reference": probe.describe(), "baseline": {"work": 0.5}}]})
    ref = reference(SimpleNamespace(manifest=SimpleNamespace(disturbance=section)))
    assert (ref.loops, ref.dtype, ref.device, ref.seconds_per_loop) == (2, "fp32", "cpu", 0.25)
    assert probe.seconds_per_loop(readings=1) > 0


def _repredicted(tmp_path, capsys, benchmark_script, launches):
    """validate_local --measured over saved launches [(config, median s, reference s a loop)]
    with a profile whose calibration's reference cost 1 ms a loop: (script, argv, the
    comparison, the profile's cell per launch)."""
    path = _calibrated(tmp_path, [{"run": 1, "reference": REFERENCE, "baseline": {"work": 0.01}}])
    measured = {"results": [{"config": [n], "measured_seconds": t, "measured_median_seconds": t,
                             "reference_seconds_per_loop": now} for n, t, now in launches]}
    file = tmp_path / "measured.json"
    file.write_text(json.dumps(measured))
    script, argv = benchmark_script("validate_local"), ["--measured", str(file), "--cluster", str(path)]
    assert script.main(argv + ["--json"]) == 0
    comp = json.loads(capsys.readouterr().out)["comparison"]
    return script, argv, comp, [row["predicted"][str(path)] for row in comp["rows"]]


def test_launches_are_also_judged_at_the_speed_each_launch_found(tmp_path, capsys, benchmark_script):
    # the reference cost 2 ms a loop during the first launch (the machine at half the speed its
    # calibration started at) and 0.5 ms during the second (twice)
    script, argv, comp, cells = _repredicted(tmp_path, capsys, benchmark_script,
                                             [(n, 2.0, now) for n, now in zip(CONFIGS, (0.002, 0.0005))])
    path, file = argv[3], Path(argv[1])
    assert [c["machine_speed"] for c in cells] == pytest.approx([0.5, 2.0])
    for c, speed in zip(cells, (0.5, 2.0)):
        assert c["error_at_machine_speed"] == pytest.approx(c["seconds"] / speed / 2.0 - 1.0)
    at = comp["summary"][path]["at_machine_speed"]
    assert at["machine_speed_median"] == pytest.approx(1.25)
    assert at["mean_signed"] == pytest.approx(50 * sum(c["error_at_machine_speed"] for c in cells))
    assert "correlation_with_speed" not in at  # two launches say nothing of a correlation
    assert script.main(argv) == 0
    assert "scaled to the machine's speed at each launch (x1.250" in capsys.readouterr().out
    # a file saved without the readings: no speed, the plain errors only
    saved = json.loads(file.read_text())
    for r in saved["results"]:
        del r["reference_seconds_per_loop"]
    file.write_text(json.dumps(saved))
    assert script.main(argv) == 0
    text = capsys.readouterr().out
    assert "MAPE" in text and "machine's speed" not in text


def _validation(speed):
    from neox_perf.commands.validate import ConfigValidation
    layout = {"pp": 1, "mp": 1, "dp": 2, "micro_batch": 2, "grad_accum": 1, "seq": 512, "hidden": 512,
              "layers": 4, "norm": "layernorm", "attention": "global", "recompute": False, "zero": 0}
    return ConfigValidation(config=["x.yml"], layout=layout, predicted_seconds=1.2, measured_seconds=0.9,
                            measured_median_seconds=1.0, iterations=5, warmup=2, components=[],
                            stages=[], reference_seconds_per_loop=None if speed is None else 0.001 / speed,
                            machine_speed=speed)


def test_a_validation_keeps_its_plain_error_and_adds_the_scaled_one():
    from neox_perf.commands.validate import machine_speed
    profile = SimpleNamespace(manifest=SimpleNamespace(disturbance=SimpleNamespace(
        extra={"runs": [{"reference": REFERENCE, "baseline": {"work": 0.01}}]})))
    assert machine_speed(profile, 0.002) == pytest.approx(0.5)  # the loop twice as dear: half speed
    assert machine_speed(profile, None) is None
    assert machine_speed(SimpleNamespace(), 0.002) is None  # no calibration of ours behind it
    r = _validation(1.25)
    d = r.to_dict()
    assert d["error"] == pytest.approx(0.2)  # the judged error does not move
    assert d["machine_speed"] == 1.25 and d["error_at_machine_speed"] == pytest.approx(1.2 / 1.25 - 1.0)
    assert _validation(None).to_dict()["error_at_machine_speed"] is None


def test_the_text_says_the_speed_only_where_it_was_read():
    import io

    from rich.console import Console

    from neox_perf.commands.validate import ValidateResult
    from neox_perf.render.validate_text import render

    def text(r):
        buf = io.StringIO()
        render(ValidateResult(cluster="local", gpus=2, results=[r]), Console(file=buf, width=200))
        return buf.getvalue()
    assert "x1.250 the speed its profile describes" in text(_validation(1.25))
    assert "-4.0%" in text(_validation(1.25))
    assert "speed its profile describes" not in text(_validation(None))


def _with(reference):
    return SimpleNamespace(manifest=SimpleNamespace(disturbance=SimpleNamespace(
        extra={"runs": [{"reference": reference, "baseline": {"work": 0.01}}]})))


def test_only_a_cpu_reference_is_timed_again_and_a_failed_reading_is_none(monkeypatch):
    from neox_perf.calibration.disturbance import Probe
    from neox_perf.commands.validate import reference_clock
    # a GPU's reference would hold a CUDA context beside the training ranks: not read
    assert reference_clock(_with(REFERENCE.replace("on cpu", "on cuda:0"))) is None
    clock = reference_clock(_with(REFERENCE.replace("10 x", "1 x")))
    assert clock() > 0

    def broken(self, readings=3):
        raise RuntimeError("the reference could not run")
    monkeypatch.setattr(Probe, "seconds_per_loop", broken)
    assert clock() is None  # the validation goes on without it


def test_whether_the_error_follows_the_speed(tmp_path, capsys, benchmark_script):
    import math
    import statistics
    launches = zip(CONFIGS + ["pp0-mp2-layernorm.yml"], (2.0, 1.0, 3.0), (0.002, 0.0005, 0.001))
    script, argv, comp, cells = _repredicted(tmp_path, capsys, benchmark_script, list(launches))
    path = argv[3]
    got = comp["summary"][path]["at_machine_speed"]["correlation_with_speed"]
    logs = [math.log(c["machine_speed"]) for c in cells]
    for key, field in (("plain", "error"), ("scaled", "error_at_machine_speed")):
        assert got[key] == pytest.approx(statistics.correlation(logs, [math.log1p(c[field]) for c in cells]))
    assert script.main(argv) == 0
    assert "against log speed: correlation" in capsys.readouterr().out  # (wrapped at the console width)


def test_the_reference_is_timed_around_the_launch_and_nothing_without_it():
    from neox_perf.commands.validate import around_launch
    order = []

    def launch():
        order.append("launch")
        return "result"
    out, now = around_launch(_with(REFERENCE.replace("10 x", "1 x")), launch)
    assert (out, order) == ("result", ["launch"]) and now > 0
    assert around_launch(SimpleNamespace(), launch) == ("result", None)  # no calibration of ours
    with pytest.raises(RuntimeError):  # a failed launch is the launch's error, not the reading's
        around_launch(_with(REFERENCE), lambda: (_ for _ in ()).throw(RuntimeError("launch failed")))
