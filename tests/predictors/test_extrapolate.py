"""Efficiency-curve extrapolation (predictors/extrapolate.py) and its gate in ClusterProfile."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from neox_perf.prediction import opspec
from neox_perf.predictors import extrapolate
from neox_perf.predictors.profile import load_profile

BUNDLED = Path(__file__).resolve().parents[2] / "neox_perf" / "profiles" / "perlmutter-a100-80gb"
PEAK = 1e11


def _gemm_truth(m, k, n):
    """A GEMM whose efficiency rises with m, n and k and saturates: m/(m+96), etc."""
    eff = (m / (m + 96.0)) * (n / (n + 64.0)) * (k / (k + 32.0))
    return 2 * m * k * n / (PEAK * eff)


def _grid(ms):
    m, k, n = np.meshgrid(ms, [64, 256, 1024], [128, 512, 2048], indexing="ij")
    return m.ravel().astype(float), k.ravel().astype(float), n.ravel().astype(float)


def test_the_curve_extrapolates_a_saturating_efficiency_better_than_either_end_sample():
    rng = np.random.default_rng(0)
    m, k, n = _grid([16, 32, 64, 128, 256])
    t = _gemm_truth(m, k, n) * np.exp(rng.normal(0, 0.02, m.size))
    base = 2 * m * k * n / PEAK  # a pure FLOPs roofline at the peak rate
    curve = extrapolate.fit_curve({"m": m, "k": k, "n": n}, np.log(t / base), ("m", "k", "n"))
    assert curve.terms["m"][0] > 0  # efficiency rises with m
    mt, kt, nt = _grid([1024, 4096, 8192])
    truth = _gemm_truth(mt, kt, nt)
    new = 2 * mt * kt * nt / PEAK * np.exp(curve.log_ratio({"m": mt, "k": kt, "n": nt}))
    # what a tree does past its range: the edge sample's efficiency (m = 256) held forever
    largest = 2 * mt * kt * nt / PEAK * (_gemm_truth(256.0, kt, nt) / (2 * 256.0 * kt * nt / PEAK))
    smallest = 2 * mt * kt * nt / PEAK * (_gemm_truth(16.0, kt, nt) / (2 * 16.0 * kt * nt / PEAK))
    err = lambda p: float(np.mean(np.abs(p / truth - 1)))  # noqa: E731
    assert err(new) < 0.06
    assert err(new) < 0.5 * err(largest) and err(largest) < err(smallest)


def test_the_curve_down_weights_samples_slowed_by_load():
    rng = np.random.default_rng(1)
    m, k, n = _grid([16, 32, 64, 128, 256])
    t = _gemm_truth(m, k, n)
    slowed = rng.random(m.size) < 0.15
    t = np.where(slowed, t * 4.0, t)  # a busy machine: some samples 4x slow, none fast
    base = 2 * m * k * n / PEAK
    curve = extrapolate.fit_curve({"m": m, "k": k, "n": n}, np.log(t / base), ("m", "k", "n"))
    clean = ~slowed
    fitted = base * np.exp(curve.log_ratio({"m": m, "k": k, "n": n}))
    assert float(np.median(np.abs(fitted[clean] / t[clean] - 1))) < 0.1


def _with_curve(tmp_path, efficiency, marker=extrapolate.MARKER):
    out = tmp_path / "profile"
    shutil.copytree(BUNDLED, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["operators"]["linear1"]["fwd"]["efficiency"] = efficiency
    if marker:
        manifest["extrapolation"] = marker
    (out / "manifest.json").write_text(json.dumps(manifest))
    return load_profile(out), manifest["operators"]["linear1"]["fwd"]


@pytest.mark.skipif(not BUNDLED.is_dir(), reason="bundled profile absent")
def test_bundled_profiles_and_in_range_queries_are_unchanged(tmp_path):
    bundled = load_profile(BUNDLED)
    assert bundled.manifest.extrapolation is None
    curve = {"intercept": 0.3, "terms": {"m": [0.5, 4096.0]}}
    gated, entry = _with_curve(tmp_path, curve)
    ungated, _ = _with_curve(tmp_path / "u", curve, marker=None)
    lo = {n: entry["ranges"][n][0] for n in entry["features"]}
    hi = {n: entry["ranges"][n][1] for n in entry["features"]}
    inside = {n: float(np.sqrt(lo[n] * hi[n])) for n in entry["features"]}
    for profile in (gated, ungated):
        assert profile.predict("linear1", "fwd", inside).seconds == pytest.approx(
            bundled.predict("linear1", "fwd", inside).seconds, rel=1e-12)
    outside = {**inside, "m": hi["m"] * 8}
    assert ungated.predict("linear1", "fwd", outside).seconds == pytest.approx(
        bundled.predict("linear1", "fwd", outside).seconds, rel=1e-12)
    assert gated.predict("linear1", "fwd", outside).seconds != pytest.approx(
        bundled.predict("linear1", "fwd", outside).seconds, rel=1e-3)


@pytest.mark.skipif(not BUNDLED.is_dir(), reason="bundled profile absent")
def test_past_the_range_the_prediction_is_continuous_then_follows_the_curve(tmp_path):
    curve = {"intercept": -0.2, "terms": {"m": [0.4, 2048.0], "n": [0.2, 1024.0]}}
    gated, entry = _with_curve(tmp_path, curve)
    bundled = load_profile(BUNDLED)
    hi = {n: entry["ranges"][n][1] for n in entry["features"]}
    lo = {n: entry["ranges"][n][0] for n in entry["features"]}
    point = {n: float(np.sqrt(lo[n] * hi[n])) for n in entry["features"]}
    edge = {**point, "m": hi["m"]}
    just_past = {**point, "m": hi["m"] * 1.001}
    a = gated.predict("linear1", "fwd", edge).seconds
    b = gated.predict("linear1", "fwd", just_past)
    assert b.extrapolated and "efficiency curve" in b.reason
    assert b.seconds == pytest.approx(a * 1.001, rel=2e-3)  # no jump at the face of the box
    # beyond a factor of 4 the trees are gone: baseline x exp(curve) exactly
    far = {**point, "m": hi["m"] * 16}
    c = extrapolate.Curve.from_entry(entry["features"], curve)
    coef = np.asarray(entry["baseline"]["coef"])
    base = coef[0] + coef[1] * opspec.op_flops("linear1", "fwd", far) + coef[2] * opspec.op_bytes(
        "linear1", "fwd", far)
    expect = base * float(np.exp(c.log_ratio({k: np.array([v]) for k, v in far.items()})[0]))
    assert gated.predict("linear1", "fwd", far).seconds == pytest.approx(expect, rel=1e-9)
    many = gated.predict_many("linear1", "fwd", {k: np.array([point[k], far[k]]) for k in point})
    assert many.seconds[1] == pytest.approx(expect, rel=1e-9)
    assert many.seconds[0] == pytest.approx(bundled.predict("linear1", "fwd", point).seconds, rel=1e-12)


def test_check_path_stays_numpy_only():
    import subprocess
    import sys
    code = ("import sys; import neox_perf.predictors.profile, neox_perf.predictors.extrapolate; "
            "bad = [m for m in ('sklearn', 'xgboost', 'torch') if m in sys.modules]; print(bad); "
            "sys.exit(bool(bad))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
