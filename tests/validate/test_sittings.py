"""benchmarks/sittings.py: the same launches over several sittings -- their spread, each
sitting's level, and each layout class's error around that level (one-signed: a missing term)."""
import json
import math

import pytest

LAYOUTS = {"pp1-dp2-layernorm.yml": {"pp": 1, "mp": 1, "dp": 2},
           "pp1-dp2-swiglu-rmsnorm.yml": {"pp": 1, "mp": 1, "dp": 2},
           "pp2-untied-layernorm.yml": {"pp": 2, "mp": 1, "dp": 1},
           "pp1-mp2-flash.yml": {"pp": 1, "mp": 2, "dp": 1}}


def _sitting(tmp_path, name, level, dp_error, medians):
    """One sitting: every launch predicted at `level` times its median, the data-parallel ones
    at `level * (1 + dp_error)`."""
    results = []
    for (config, layout), median in zip(LAYOUTS.items(), medians):
        factor = level * (1 + dp_error if layout["dp"] == 2 else 1.0)
        results.append({"config": [f"/elsewhere/{config}"], "layout": layout, "measured_seconds": 0.9 * median,
                        "measured_median_seconds": median, "predicted_seconds": factor * median})
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"cluster": name, "results": results}))
    return str(path)


def test_spread_levels_and_a_one_signed_class(tmp_path, capsys, benchmark_script):
    files = [_sitting(tmp_path, "a", 1.10, -0.08, [2.0, 1.0, 3.0, 2.0]),
             _sitting(tmp_path, "b", 0.90, -0.06, [2.5, 1.0, 3.0, 2.02]),
             _sitting(tmp_path, "c", 1.00, -0.10, [2.2, 1.0, 3.3, 2.04])]
    rc = benchmark_script("sittings").main([*files, "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["config"]: r for r in out["spread"]["rows"]}
    assert rows["pp1-dp2-layernorm.yml"]["spread"] == pytest.approx(0.25)
    assert rows["pp1-dp2-swiglu-rmsnorm.yml"]["spread"] == pytest.approx(0.0)
    assert out["spread"]["worst"]["config"] == "pp1-dp2-layernorm.yml"
    assert out["spread"]["within_bar"] == 2  # the swiglu launch and the mp 2 one (2.0 .. 2.04)
    cells = out["class_errors"]["cells"]
    assert [c["profile"] for c in cells] == ["a", "b", "c"]
    for cell, level, dp in zip(cells, (1.10, 0.90, 1.00), (-0.08, -0.06, -0.10)):
        logs = [math.log(level * (1 + dp))] * 2 + [math.log(level)] * 2
        mean = sum(logs) / 4
        assert cell["level"] == pytest.approx(math.expm1(mean))
        # the level moves every launch alike: what is left is the class's own
        assert cell["classes"]["data parallel, pp <= 1"]["error"] == pytest.approx(
            math.expm1(math.log(level * (1 + dp)) - mean))
        assert cell["classes"]["pipelined (pp >= 2)"]["error"] == pytest.approx(math.expm1(math.log(level) - mean))
    classes = out["class_errors"]["classes"]
    assert classes["data parallel, pp <= 1"]["under"] == 3
    assert classes["data parallel, pp <= 1"]["one_signed"]
    assert classes["tensor parallel (mp >= 2)"]["over"] == 3 and classes["tensor parallel (mp >= 2)"]["one_signed"]
    # two sittings are too few to call a sign a term
    rc = benchmark_script("sittings").main([*files[:2], "--json"])
    assert not json.loads(capsys.readouterr().out)["class_errors"]["classes"]["data parallel, pp <= 1"]["one_signed"]
    benchmark_script("sittings").main(files)
    text = capsys.readouterr().out
    assert "under its level in 3 of 3" in text and "one-signed: a missing term" in text


def test_sittings_predicted_again_by_each_profile(tmp_path, capsys, benchmark_script):
    files = [_sitting(tmp_path, "a", 1.0, 0.0, [2.0, 1.5, 3.0, 2.0]),
             _sitting(tmp_path, "b", 1.0, 0.0, [2.2, 1.4, 3.1, 2.1])]
    rc = benchmark_script("sittings").main([*files, "--cluster", "perlmutter-a100", "--compare", "vista-gh200",
                                            "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    cells = out["class_errors"]["cells"]
    assert [(c["sitting"], c["profile"]) for c in cells] == [
        (0, "perlmutter-a100"), (0, "vista-gh200"), (1, "perlmutter-a100"), (1, "vista-gh200")]
    # the same profile predicts the same configs alike in both sittings: the levels differ by
    # the launches' measured medians alone
    a, b = cells[0], cells[2]
    assert a["level"] != b["level"]
    ratio = math.exp(sum(math.log(x / y) for x, y in zip([2.0, 1.5, 3.0, 2.0], [2.2, 1.4, 3.1, 2.1])) / 4)
    assert (1 + b["level"]) / (1 + a["level"]) == pytest.approx(ratio)


def test_a_file_that_is_not_a_sitting_gets_one_line(tmp_path, capsys, benchmark_script):
    bad = tmp_path / "engine.json"
    bad.write_text(json.dumps({"shapes": {}}))
    good = _sitting(tmp_path, "a", 1.0, 0.0, [2.0, 1.5, 3.0, 2.0])
    assert benchmark_script("sittings").main([good, str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and "fix:" in err[0]


def test_the_data_parallel_gradient_sync_beyond_its_price(tmp_path, capsys, benchmark_script):
    """Per dp 2 launch on one stage: (measured - predicted gradient sync) over its measured
    forward + backward; other classes and launches without components left out."""
    def launch(layout, predicted, measured, work=2.0):
        return {"config": ["x.yml"], "layout": layout, "measured_seconds": 3.0, "predicted_seconds": 3.0,
                "stages": [{"stage": 0, "forward_measured": work / 2, "backward_measured": work / 2,
                            "grad_sync_predicted": predicted, "grad_sync_measured": measured}]}
    dp, pp = {"pp": 1, "mp": 1, "dp": 2}, {"pp": 2, "mp": 1, "dp": 1}
    files = []
    for name, launches in (("a", [launch(dp, 0.10, 0.14), launch(dp, 0.10, 0.12), launch(pp, 0.0, 0.5)]),
                           ("b", [launch(dp, 0.20, 0.20, work=4.0), {**launch(dp, 0.1, 0.1), "stages": []}])):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"cluster": name, "results": launches}))
        files.append(str(path))
    assert benchmark_script("sittings").main([*files, "--json"]) == 0
    ex = json.loads(capsys.readouterr().out)["sync_excess"]
    assert ex["launches"] == 3 and ex["median"] == pytest.approx(0.01)  # 2%, 1%, 0%
    assert ex["sittings"] == [pytest.approx(0.015), pytest.approx(0.0)]
    benchmark_script("sittings").main(files)
    assert "gradient sync beyond each sitting's own price of it" in capsys.readouterr().out


def test_the_classes_can_be_the_layers_attention(tmp_path, capsys, benchmark_script):
    # the flash layout over by 5% in every sitting, the unfused ones on the level: by attention
    # the flash class is one-signed
    files = []
    for name, level in (("a", 1.1), ("b", 0.9), ("c", 1.0)):
        results = []
        for config, layout in LAYOUTS.items():
            attention = "flash" if "flash" in config else "unfused"
            factor = level * (1.05 if attention == "flash" else 1.0)
            results.append({"config": [config], "layout": {**layout, "attention": attention},
                            "measured_seconds": 1.0, "predicted_seconds": factor})
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"cluster": name, "results": results}))
        files.append(str(path))
    assert benchmark_script("sittings").main([*files, "--by", "attention", "--json"]) == 0
    classes = json.loads(capsys.readouterr().out)["class_errors"]["classes"]
    assert set(classes) == {"flash attention", "unfused attention"}
    assert classes["flash attention"]["over"] == 3 and classes["flash attention"]["one_signed"]
    assert classes["unfused attention"]["under"] == 3
