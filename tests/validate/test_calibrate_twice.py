"""benchmarks/calibrate_twice.py: two profiles predict the same layouts, and each part of one
swapped into the other says where their disagreement comes from (issue #34 §1)."""
import pytest

pytest.importorskip("numpy")

CONFIGS = ["pp1-dp2-layernorm.yml", "pp2-untied-layernorm.yml"]


def _compare(benchmark_script, a, b, **kw):
    mod = benchmark_script("calibrate_twice")
    configs = [mod.HERE / "validation" / c for c in CONFIGS]
    return mod, mod.compare(mod._load(a), mod._load(b), configs, 2, **kw)


def test_a_profile_against_itself_agrees_everywhere(benchmark_script):
    _, out = _compare(benchmark_script, "perlmutter-a100-80gb", "perlmutter-a100-80gb")
    assert out["mean_abs_disagreement"] == 0.0 and out["within_bar"] == len(CONFIGS)
    for row in out["rows"]:
        assert row["parts"] and all(v == 0.0 for v in row["parts"].values())


def test_the_parts_of_another_profile_move_its_predictions(benchmark_script, capsys):
    mod, out = _compare(benchmark_script, "perlmutter-a100-80gb", "vista-gh200", detail=True)
    for row in out["rows"]:
        assert row["b_seconds"] / row["a_seconds"] - 1.0 == pytest.approx(row["disagreement"])
        assert row["disagreement"] != 0.0  # another GPU's samples
        # each part is A with B's part: every sampled part moves the prediction
        moves = row["parts"]
        assert moves["operators"] != 0.0 and moves["collectives"] != 0.0
        assert any(k.startswith("operator ") and v != 0.0 for k, v in moves.items())
        assert list(moves) == sorted(moves, key=lambda k: -abs(moves[k]))  # largest first
    mod.render(out)
    text = capsys.readouterr().out
    assert "mean |B/A - 1|" in text and "layouts within 3%" in text


def test_the_two_references_taken_out_leave_what_was_measured_differently(benchmark_script, tmp_path,
                                                                          capsys):
    from test_machine_speed import REFERENCE, _calibrated
    # one profile, calibrated once with the reference loop at 1 ms and once at 0.8 ms: the same
    # samples on a machine 1.25x faster at the second's start
    a = _calibrated(tmp_path / "a", [{"run": 1, "reference": REFERENCE, "baseline": {"work": 0.010}}])
    b = _calibrated(tmp_path / "b", [{"run": 1, "reference": REFERENCE, "baseline": {"work": 0.008}}])
    mod, out = _compare(benchmark_script, str(a), str(b))
    assert out["mean_abs_disagreement"] == 0.0  # identical samples
    at = out["at_reference_speed"]
    assert at["b_speed_over_a"] == pytest.approx(1.25)
    # at A's speed B's predictions are 1.25x its own: the samples' speed is all they differ by
    assert at["mean_abs_disagreement"] == pytest.approx(0.25) and at["within_bar"] == 0
    mod.render(out)
    assert "at x1.250 A's speed" in capsys.readouterr().out
    _, plain = _compare(benchmark_script, "perlmutter-a100-80gb", "perlmutter-a100-80gb")
    assert "at_reference_speed" not in plain  # no calibration of ours behind them


def test_the_witness_launches_take_the_machines_move_out(benchmark_script, capsys):
    mod = benchmark_script("calibrate_twice")
    # B predicts every layout 10% under A; the witnesses ran 2.0 s beside A's start, 2.0 s
    # between and 1.62 s after B: B's machine ran at sqrt(2.0 * 2.0) / sqrt(2.0 * 1.62) = x1.111
    rows = [{"config": n, "a_seconds": 2.0, "b_seconds": 1.8, "disagreement": -0.1, "parts": {}}
            for n in (*mod.WITNESSES, "other.yml")]
    result = {"a": "A", "b": "B", "gpus": 2, "rows": rows,
              **mod._agreement([r["disagreement"] for r in rows], rows)}
    launches = [dict.fromkeys(mod.WITNESSES, 2.0), dict.fromkeys(mod.WITNESSES, 2.0),
                dict.fromkeys(mod.WITNESSES, 1.62)]
    wit = mod.at_witness_speed(result, launches)
    assert wit["b_speed_over_a"] == pytest.approx((2.0 / 1.62) ** 0.5)
    assert wit["drift"] == pytest.approx({"a": 1.0, "b": 0.81})
    # at A's speed B's predictions are 0.9 x 1.111 = 1.0 of A's: the machine was all they differ by
    assert wit["mean_abs_disagreement"] == pytest.approx(0.0, abs=1e-3) and wit["within_bar"] == 4
    # beside: A against the launches around it (2.0 s), B against its own (1.8 s): both exact
    assert set(wit["beside"]) == set(mod.WITNESSES)
    for e in wit["beside"].values():
        assert e["a"] == pytest.approx(0.0) and e["b"] == pytest.approx(0.0, abs=1e-9)
    # one witness that ran no slower beside B than beside A leaves part of the disagreement
    launches[2] = {**launches[2], mod.WITNESSES[0]: 2.0}
    partly = mod.at_witness_speed(result, launches)
    assert 1.0 < partly["b_speed_over_a"] < wit["b_speed_over_a"]
    assert partly["mean_abs_disagreement"] > 0.02
    result["at_witness_speed"] = wit
    mod.render(result)
    assert "witness layouts ran x1.111 as fast beside B" in capsys.readouterr().out


def test_witness_files_are_read_back_only_when_all_three_are_there(benchmark_script, tmp_path):
    import json
    mod = benchmark_script("calibrate_twice")
    for i in range(2):
        (tmp_path / f"witness-{i}.json").write_text(json.dumps({"x.yml": 1.0 + i}))
    assert mod.read_witnesses(tmp_path) == []
    (tmp_path / "witness-2.json").write_text(json.dumps({"x.yml": 3.0}))
    assert [w["x.yml"] for w in mod.read_witnesses(tmp_path)] == [1.0, 2.0, 3.0]
