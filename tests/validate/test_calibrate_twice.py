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
