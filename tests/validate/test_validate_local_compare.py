"""benchmarks/validate_local.py compares profiles on one set of measurements: `--measured`
re-predicts a saved run with several profiles, launching nothing (a shared box drifts by
10-30% between launches, so two profiles are never compared on two runs)."""
import json

import pytest

CONFIGS = ["pp1-dp2-layernorm.yml", "pp2-untied-layernorm.yml"]


def test_measured_file_is_repredicted_by_each_profile(tmp_path, capsys, benchmark_script):
    measured = {"results": [{"config": [f"/elsewhere/{name}"], "measured_seconds": 2.0 + i,
                             "measured_median_seconds": 2.2 + i}
                            for i, name in enumerate(CONFIGS)]}  # saved on another checkout
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(measured))
    rc = benchmark_script("validate_local").main(["--measured", str(path), "--cluster", "perlmutter-a100",
                         "--compare", "vista-gh200", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    comp = out["comparison"]
    assert comp["clusters"] == ["perlmutter-a100", "vista-gh200"]
    assert [r["config"] for r in comp["rows"]] == CONFIGS
    for row in comp["rows"]:
        a, b = (row["predicted"][n] for n in comp["clusters"])
        assert a["seconds"] != b["seconds"]  # two profiles, two predictions of one measurement
        assert row["measured_median_seconds"] > row["measured_seconds"]
        for p in (a, b):  # against the typical (median) iteration, the fastest beside it
            assert p["error"] == pytest.approx(p["seconds"] / row["measured_median_seconds"] - 1.0)
            assert p["error_fastest"] == pytest.approx(p["seconds"] / row["measured_seconds"] - 1.0)
    for name, s in comp["summary"].items():
        errors = [r["predicted"][name]["error"] for r in comp["rows"]]
        assert s["mape"] == pytest.approx(100 * sum(map(abs, errors)) / len(errors))
        assert s["mean_signed"] == pytest.approx(100 * sum(errors) / len(errors))
        assert abs(s["worst"]["error"]) == pytest.approx(100 * max(map(abs, errors)))


def test_measured_file_text_table(tmp_path, capsys, benchmark_script):
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"results": [{"config": [CONFIGS[0]], "measured_seconds": 1.5}]}))
    assert benchmark_script("validate_local").main(["--measured", str(path), "--cluster", "perlmutter-a100"]) == 0
    text = capsys.readouterr().out
    assert CONFIGS[0] in text and "perlmutter-a100: MAPE" in text and "mean signed" in text


def test_validate_compares_with_the_typical_iteration():
    from neox_perf.commands.validate import ConfigValidation
    r = ConfigValidation(config=["x.yml"], layout={}, predicted_seconds=1.1, measured_seconds=1.0,
                         measured_median_seconds=1.1, iterations=5, warmup=2, components=[], stages=[])
    assert r.error == pytest.approx(0.0) and r.error_fastest == pytest.approx(0.1)
    d = r.to_dict()
    assert d["error_against"] == "median" and d["error_fastest"] == pytest.approx(0.1)


def test_measured_stage_components_split_the_typical_iteration():
    from neox_perf.commands.validate import measured_stage_components
    its = [{"iteration": t, "forward": t / 2, "backward": t / 4} for t in (1.0, 3.0, 1.2, 1.1, 0.9)]
    stage = measured_stage_components({0: its}, [{"rank": 0, "stage": 0}], warmup=0)[0]
    assert stage["forward"] == pytest.approx(0.55) and stage["other"] == pytest.approx(1.1 / 4)


def test_validate_summary_reports_the_sign_the_absolute_mean_hides():
    from neox_perf.commands.validate import ConfigValidation, ValidateResult

    def row(pred, meas):
        return ConfigValidation(config=["x.yml"], layout={}, predicted_seconds=pred,
                                measured_seconds=meas, measured_median_seconds=meas, iterations=3,
                                warmup=2, components=[], stages=[])
    result = ValidateResult(cluster="local", gpus=2, results=[row(0.9, 1.0), row(1.3, 1.0)])
    d = result.to_dict()
    assert d["mean_absolute_percentage_error"] == pytest.approx(20.0)
    assert d["mean_signed_percentage_error"] == pytest.approx(10.0)
    assert d["max_absolute_percentage_error"] == pytest.approx(30.0)
    assert ValidateResult(cluster="local", gpus=2).to_dict()["mean_signed_percentage_error"] is None

