"""benchmarks/drift_probe.py re-times stored calibration points with the calibration's own code
and reports now / then: a store whose times were recorded 1000x too slow reads as far faster."""
import json

import pytest

pytest.importorskip("torch")

from neox_perf.calibration.store import SampleStore  # noqa: E402


def _store(tmp_path):
    path = tmp_path / "s.sqlite"
    with SampleStore(path) as store:
        dev = store.register_device({"device": "cpu-test"})
        run = store.register_run("calibrate", device=dev, plan="quick", info={
            "warmup": 1, "repeats": 3, "min_seconds": 0.0, "max_repeats": 3})  # as calibrate records
        untimed = store.register_run("calibrate", device=dev, plan="quick")  # no protocol: never picked
        store.add_sample("res_add", "fwd", {"tokens": 16, "d": 256}, 0.05, device=dev, run=untimed,
                         dtype="fp32")
        for d in (32, 64):  # tiny ops (tens of us) stored as if they had taken 50 ms
            store.add_sample("res_add", "fwd", {"tokens": 16, "d": d}, 0.05, device=dev, run=run,
                             dtype="fp32")
        store.add_sample("res_add", "fwd", {"tokens": 16, "d": 128}, 5.0, device=dev, run=run,
                         dtype="fp32")  # outside 1-200 ms: never picked
        store.add_sample("allreduce", "comm", {"elements": 1024, "nodes": 1, "gpus_per_node": 2},
                         0.01, device=dev, run=run, dtype="fp32")  # a collective: never picked
    return path


def test_ratio_now_over_calibration(tmp_path, capsys, benchmark_script):
    path = _store(tmp_path)
    assert benchmark_script("drift_probe").main(["--store", str(path), "--points", "10", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["points"] == 2
    ratio = out["ratio_now_over_calibration"]
    assert 0 < ratio["q1"] <= ratio["median"] <= ratio["q3"] < 0.2
    assert set(out["by_op"]) == {"res_add"}


def test_not_a_store_is_one_line(tmp_path, capsys, benchmark_script):
    bad = tmp_path / "x.sqlite"
    bad.write_text("not sqlite")
    assert benchmark_script("drift_probe").main(["--store", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("drift_probe: ") and err.count("\n") == 1


def test_corun_times_each_point_beside_processes_running_it(tmp_path, capsys, benchmark_script):
    path = _store(tmp_path)
    assert benchmark_script("drift_probe").main(["--store", str(path), "--points", "10",
                                                 "--corun", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["corun"] == 1 and set(out["corun_by_op"]) == {"res_add"}
    c = out["ratio_corun_over_alone"]
    assert 0 < c["q1"] <= c["median"] <= c["q3"]
