"""TF32 as the cluster has it (issue #30, section 3): an fp32 run's matmuls priced as TF32 or IEEE
fp32 by the cluster description's `tf32:`, and where nobody says, the default with an 80%
interval that reaches the other pricing. 16-bit runs know nothing of it."""
from pathlib import Path

import pytest

from neox_perf.config import WorldRequest, build, load_files
from neox_perf.config.loader import RawConfig
from neox_perf.derive import derive

from neox_perf.prediction.predict import predict
from neox_perf.predictors import achievable
from neox_perf.predictors.profile import load_profile

EXAMPLES = Path(__file__).resolve().parents[2] / "neox_perf" / "examples"
DGX = (EXAMPLES / "clusters" / "dgx-a100.yml").read_text()


def _cluster(tmp_path, tf32=None):
    text = DGX + ("" if tf32 is None else f"tf32: {'true' if tf32 else 'false'}\n")
    path = tmp_path / f"dgx-{tf32}.yml"
    path.write_text(text)
    return load_profile(str(path))


def _config(precision="fp32"):
    raw = load_files([str(EXAMPLES / "llemma-7b.yml")])
    values = dict(raw.values, fp16={"enabled": precision == "fp16"}, bf16={"enabled": False})
    cfg, verdicts, _ = build(RawConfig(values=values, sources=dict(raw.sources), files=list(raw.files)),
                             WorldRequest(gpus=16, gpus_per_node=8))
    assert not [v for v in verdicts if v.level == "error"] and cfg.training.precision == precision
    return cfg, derive(cfg, 32000)


def _matmul_seconds(est) -> float:
    return sum(s for name, s in est.operators.items() if name.split()[0] in achievable.COMPUTE_BOUND)


def _other_seconds(est) -> float:
    return sum(s for name, s in est.operators.items() if name.split()[0] not in achievable.COMPUTE_BOUND)


def test_the_description_says_tf32_or_ieee(tmp_path):
    cfg, derived = _config()
    on = predict(cfg, derived, _cluster(tmp_path, True))
    off = predict(cfg, derived, _cluster(tmp_path, False))
    assert on.fp32_matmuls.tf32 and on.fp32_matmuls.known and on.fp32_matmuls.source.endswith("tf32: true")
    assert not off.fp32_matmuls.tf32 and off.fp32_matmuls.known
    # the matmuls run several times faster (A100: 134.2 vs 19.18 TFLOP/s achievable) ...
    assert _matmul_seconds(off.estimate) > 4 * _matmul_seconds(on.estimate)
    # ... the memory-bound operators not at all (but for a vector-unit call the IEEE cap, 19.18
    # TFLOP/s, raises by nanoseconds)
    assert _other_seconds(on.estimate) == pytest.approx(_other_seconds(off.estimate), rel=1e-6)
    assert on.estimate.iteration_seconds < off.estimate.iteration_seconds / 2
    # and never faster than the TF32 rate the A100 sustains
    per_gpu = derived.flops.model_per_iteration / on.estimate.iteration_seconds / 16 / 1e12
    assert 19.18 < per_gpu <= 134.2
    # a description that says so keeps its interval as the profile gives it
    assert on.fp32_matmuls.other_seconds is None and off.fp32_matmuls.other_seconds is None


def test_unsaid_takes_the_default_and_the_interval_reaches_the_other(tmp_path):
    cfg, derived = _config()
    on = predict(cfg, derived, _cluster(tmp_path, True)).estimate
    off = predict(cfg, derived, _cluster(tmp_path, False)).estimate
    unsaid = predict(cfg, derived, _cluster(tmp_path))
    mm = unsaid.fp32_matmuls
    assert not mm.known and mm.tf32 is achievable.DEFAULT_TF32 and mm.source.startswith("default:")
    taken, other = (on, off) if mm.tf32 else (off, on)
    assert unsaid.estimate.iteration_seconds == pytest.approx(taken.iteration_seconds, rel=1e-12)
    assert mm.other_seconds == pytest.approx(other.iteration_seconds, rel=1e-12)
    lo, hi = unsaid.estimate.interval_seconds
    assert lo <= on.iteration_seconds * (1 + 1e-12) and hi >= off.iteration_seconds * (1 - 1e-12)
    # widened on the other's side only: the default's own side is the profile's interval
    if mm.tf32:
        assert lo == pytest.approx(on.interval_seconds[0]) and hi == pytest.approx(off.iteration_seconds)
    else:
        assert hi == pytest.approx(off.interval_seconds[1]) and lo == pytest.approx(on.iteration_seconds)
    assert "80% interval reaches" in mm.text()


def test_the_runs_record_wins_and_16_bit_runs_are_untouched(tmp_path):
    cfg, derived = _config()
    said = predict(cfg, derived, _cluster(tmp_path, True), tf32=False, tf32_source="the run: x")
    off = predict(cfg, derived, _cluster(tmp_path, False))
    assert said.estimate.iteration_seconds == pytest.approx(off.estimate.iteration_seconds, rel=1e-12)
    assert said.fp32_matmuls.source == "the run: x"
    cfg16, derived16 = _config("fp16")
    plain = predict(cfg16, derived16, _cluster(tmp_path))
    for tf32 in (True, False):
        other = predict(cfg16, derived16, _cluster(tmp_path, tf32), tf32=tf32)
        assert other.fp32_matmuls is None and other.estimate.iteration_seconds == plain.estimate.iteration_seconds
        assert other.estimate.interval_seconds == plain.estimate.interval_seconds
