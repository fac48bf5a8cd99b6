"""benchmarks/layer_residuals.py: a layer's residual fitted as one line or with its memory-bound
operators apart, over stored calibrations, and the profiles refitted by this checkout."""
import json
import shutil
from pathlib import Path

import pytest

from neox_perf.calibration.engine import engine_keys, engine_label
from neox_perf.predictors.fitting.engine_fit import _engine_prediction
from neox_perf.predictors.profile import load_profile

BUNDLED = Path(__file__).resolve().parents[2] / "neox_perf" / "profiles" / "perlmutter-a100-80gb"
SIZES = ((64, 64), (64, 256), (128, 64), (128, 256), (256, 128), (256, 512))


def _calibration(run_dir: Path, name: str) -> None:
    """A calibrate_twice.py --run directory's calibration NAME: a profile and engine
    measurements whose layer backward runs its memory-bound operators 2.5x their benchmark."""
    shutil.copytree(BUNDLED, run_dir / f"profile-{name}")
    profile = load_profile(run_dir / f"profile-{name}")
    shapes = {}
    for i, (d, l) in enumerate(SIZES):
        shape = (d, l, 1, "layernorm", "global", 256)
        keys = engine_keys(shape, 2)
        p = _engine_prediction(profile, keys, 256, "fp32")
        lf = 1.2 * p["layer_forward"] + 1e-3
        lb = 1.05 * p["layer_backward"] + 1.5 * p["layer_backward_memory"] + 5e-4
        shapes[engine_label(shape, 2)] = {
            "keys": keys, "vocab": 256, "layers": 2, "precision": "fp32", "params": 1000 * (i + 1),
            "tensors": 10 + i % 3, "layer_forward": 2 * lf, "layer_backward": 2 * lb,
            "forward": 2 * lf + p["other_forward"] + 2e-3, "backward": 2 * lb + p["other_backward"] + 2e-3,
            "flatten": 1e-3 * (i + 1), "step": 1e-4 * (10 + i % 3) + 2e-9 * 1000 * (i + 1), "accumulate": 1e-4}
    (run_dir / f"{name}.engine.json").write_text(json.dumps({"shapes": shapes}))


def test_the_split_is_found_and_the_profile_refitted(tmp_path, capsys, benchmark_script):
    run = tmp_path / "twice"
    run.mkdir()
    _calibration(run, "first")
    rc = benchmark_script("layer_residuals").main([str(run), "--refit", str(tmp_path / "out")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "twice-first:" in text and "over 1 calibrations:" in text
    backward = next(line for line in text.splitlines() if line.strip().startswith("backward:"))
    assert "(lower in 1 of 1)" in backward and "+1.50 .. +1.50" in backward
    engine = json.loads((tmp_path / "out" / "twice-first" / "manifest.json").read_text())["engine"]
    assert engine["layer_backward"]["per_memory"] == pytest.approx(1.5, rel=1e-3)
    assert "per_memory" not in engine["layer_forward"]
    # the stored calibration itself is left as it was
    assert json.loads((run / "profile-first" / "manifest.json").read_text()).get("engine") is None


def test_a_directory_without_calibrations_is_one_line(tmp_path, capsys, benchmark_script):
    rc = benchmark_script("layer_residuals").main([str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 2 and out.count("\n") == 1 and "fix:" in out and str(tmp_path) in out
