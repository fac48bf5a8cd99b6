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
