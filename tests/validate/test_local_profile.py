"""Fitting a profile from a calibration store, and the engine terms it can carry."""
import json
import math

import numpy as np
import pytest

pytest.importorskip("sklearn")

from neox_perf import opspec  # noqa: E402
from neox_perf.calibration.store import SampleStore  # noqa: E402
from neox_perf.predictors import load_profile  # noqa: E402
from neox_perf.predictors.fitting import fit  # noqa: E402
from neox_perf.predictors.fitting.calibrated import fit_store  # noqa: E402
from neox_perf.predictors.fitting.engine_fit import fit_engine  # noqa: E402

FINGERPRINT = {"kind": "cpu", "device_name": "Test CPU", "torch_threads": 1, "machine": "x86_64"}


def _roofline(op, phase, f):
    return 2e-5 + opspec.op_flops(op, phase, f) / 5e10 + opspec.op_bytes(op, phase, f) / 1e10


def _store(path, rng):
    """A small store of known physics: every op a roofline with 3% noise, collectives alpha-beta."""
    with SampleStore(path) as store:
        dev = store.register_device(FINGERPRINT)
        run = store.register_run("calibrate", device=dev, plan="synthetic", info={"dtype": "fp32"})
        for op in ("linear1", "layernorm", "gelu"):
            for m in (64, 128, 256, 512, 1024):
                for d in (64, 128, 256, 512):
                    f = ({"m": m, "k": d, "n": 3 * d} if op == "linear1" else
                         {"tokens": m, "d": d} if op == "layernorm" else {"tokens": m, "width": 4 * d})
                    for phase in ("fwd", "bwd"):
                        t = _roofline(op, phase, f) * rng.uniform(0.97, 1.03)
                        store.add_sample(op, phase, f, t, device=dev, run=run, dtype="fp32")
        for params in np.geomspace(1e4, 1e7, 24).astype(int):
            store.add_sample("optimizer", "step", {"params": int(params)}, 2e-5 + params * 3e-9,
                             device=dev, run=run, dtype="fp32")
        coll = store.register_run("calibrate", device=dev, plan="collectives",
                                  info={"dtype": "fp32", "gpus_per_node": 2})
        for e in (1024, 16384, 262144, 4194304):
            store.add_sample("allreduce", "comm", {"elements": e, "nodes": 1, "gpus_per_node": 2},
                             1e-4 + e * 4 / 2e9, device=dev, run=coll, dtype="fp32")


def test_a_small_store_fits_a_loadable_profile(tmp_path):
    _store(tmp_path / "s.sqlite", np.random.default_rng(0))
    done = fit_store(tmp_path / "s.sqlite", "synthetic", tmp_path / "p", grid=fit.QUICK_GRID)
    profile = load_profile(tmp_path / "p")
    assert profile.name == "synthetic" and profile.facts.gpus_per_node == 2
    assert profile.facts.gpu_name == "Test CPU (CPU)"
    assert profile.manifest.to_dict()["calibration"]["dtype"] == "fp32"
    f = {"m": 384.0, "k": 192.0, "n": 576.0}  # between the samples
    pred = profile.predict("linear1", "fwd", f).seconds
    assert math.isfinite(pred) and pred == pytest.approx(_roofline("linear1", "fwd", f), rel=0.15)
    big = profile.predict("optimizer", "step", {"params": 5e7})  # beyond: the baseline extrapolates
    assert big.extrapolated and big.seconds == pytest.approx(2e-5 + 5e7 * 3e-9, rel=0.2)
    assert profile.predict_collective("allreduce", 1e5, 1, 2).seconds > 1e-4
    rows = {(r.op, r.phase): r for r in done.table}
    assert rows[("linear1", "fwd")].validation["chosen"] < 0.1  # 80/20 MAPE on this easy set
    assert rows[("allreduce", "comm")].model == "baseline"  # four rows: too few for trees


def _engine_json(path, profile):
    """Engine measurements whose layers run 20% + 1 ms slower than the operators predict."""
    from neox_perf.calibration.engine import engine_keys, engine_label
    from neox_perf.predictors.fitting.engine_fit import _engine_prediction
    shapes = {}
    for i, (d, l) in enumerate([(64, 64), (128, 64), (128, 128), (256, 64)]):
        shape = (d, l, 1, "layernorm", "global", 256)
        keys = engine_keys(shape, 2)
        p = _engine_prediction(profile, keys, 256, "fp32")
        lf, lb = 1.2 * p["layer_forward"] + 1e-3, 1.2 * p["layer_backward"] + 1e-3
        shapes[engine_label(shape, 2)] = {
            "keys": keys, "vocab": 256, "layers": 2, "precision": "fp32", "params": 1000 * (i + 1),
            "tensors": (10, 14, 11, 13)[i], "layer_forward": 2 * lf, "layer_backward": 2 * lb,
            "forward": 2 * lf + p["other_forward"] + 2e-3, "backward": 2 * lb + p["other_backward"] + 2e-3,
            "flatten": 1e-3 * (i + 1), "step": 1e-4 * (10, 14, 11, 13)[i] + 2e-6 * 1000 * (i + 1),
            "accumulate": 1e-4}
    path.write_text(json.dumps({"shapes": shapes}))


def test_engine_terms_recover_a_known_slowdown(tmp_path):
    profile = load_profile("perlmutter-a100-80gb")  # any profile with every operator of a layer
    _engine_json(tmp_path / "engine.json", profile)
    terms, table = fit_engine(profile, tmp_path / "engine.json")
    for phase in ("forward", "backward"):
        t = terms[f"layer_{phase}"]
        assert t["per_unit"] == pytest.approx(0.2, abs=1e-6) and t["seconds"] == pytest.approx(1e-3, rel=1e-4)
        assert t["loo_max"] < 1e-6
        other = terms[f"other_{phase}"]
        assert other["seconds"] == pytest.approx(2e-3, rel=1e-4) and abs(other["per_unit"]) < 1e-12
    step = terms["optimizer_step"]["coef"]
    assert step["per_tensor"] == pytest.approx(1e-4, rel=0.02) and step["per_param"] == pytest.approx(2e-6, rel=0.02)
    assert any(r.op == "engine layer_forward" for r in table)
