"""Fitting a profile from a calibration store, and the engine terms it can carry."""
import json
import math
import shutil

import numpy as np
import pytest

pytest.importorskip("sklearn")

from neox_perf.prediction import opspec  # noqa: E402
from neox_perf.calibration.store import SampleStore  # noqa: E402
from neox_perf.predictors import load_profile  # noqa: E402
from neox_perf.predictors.fitting import fit  # noqa: E402
from neox_perf.predictors.fitting.calibrated import fit_store  # noqa: E402
from neox_perf.predictors.fitting.engine_fit import add_engine, fit_engine  # noqa: E402

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


def _cpu_flash(phase, f):
    """Causal attention as PyTorch's CPU kernel runs it: its own blocks' work (opspec.TORCH_CPU)."""
    return (2e-5 + opspec.op_flops("flash_attention", phase, f, causal_kernel=opspec.TORCH_CPU) / 5e10
            + opspec.op_bytes("flash_attention", phase, f) / 1e10)


def test_a_cpu_calibration_prices_causal_attention_with_the_cpu_kernels_blocks(tmp_path):
    # The CPU kernel skips whole 512-key blocks (3/4 of the work at l 1024, 5/8 at 2048), where
    # FlashAttention-2's 128-row tiles skip more (9/16, 17/32). Fitted against the tiles, the
    # trees carry a residual that moves with l and read a length between the samples wrong; the
    # profile records the kernel and prices the lengths between and past them as it runs.
    rng = np.random.default_rng(1)
    _store(tmp_path / "s.sqlite", rng)
    with SampleStore(tmp_path / "s.sqlite") as store:
        dev = store.register_device(FINGERPRINT)
        run = store.register_run("calibrate", device=dev, plan="flash", info={"dtype": "fp32"})
        for b in (1, 2):
            for heads in (4, 8):
                for l in (256, 512, 1024, 2048, 4096):
                    for causal in (0, 1):
                        f = {"b": b, "l": l, "heads": heads, "head_dim": 64, "causal": causal}
                        for phase in ("fwd", "bwd"):
                            store.add_sample("flash_attention", phase, f,
                                             _cpu_flash(phase, f) * rng.uniform(0.98, 1.02),
                                             device=dev, run=run, dtype="fp32")
    fit_store(tmp_path / "s.sqlite", "synthetic", tmp_path / "p", grid=fit.QUICK_GRID)
    profile = load_profile(tmp_path / "p")
    entry = profile.manifest.to_dict()["operators"]["flash_attention"]["fwd"]
    assert entry["baseline"]["causal_kernel"] == opspec.TORCH_CPU
    for l in (768, 1536, 3072):  # between the sampled lengths
        for phase in ("fwd", "bwd"):
            f = {"b": 1, "l": l, "heads": 6, "head_dim": 64, "causal": 1}
            one = profile.predict("flash_attention", phase, f).seconds
            assert one == pytest.approx(_cpu_flash(phase, f), rel=0.04), (l, phase)
            many = profile.predict_many("flash_attention", phase, {k: [v] for k, v in f.items()}).seconds[0]
            assert many == pytest.approx(one, rel=1e-9)


def test_a_causal_kernel_the_profile_does_not_know_is_one_line(tmp_path):
    from neox_perf.errors import ProfileError
    _store(tmp_path / "s.sqlite", np.random.default_rng(0))
    fit_store(tmp_path / "s.sqlite", "synthetic", tmp_path / "p", grid=fit.QUICK_GRID)
    path = tmp_path / "p" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["operators"]["linear1"]["fwd"]["baseline"]["causal_kernel"] = "tpu-v5"
    path.write_text(json.dumps(manifest))
    with pytest.raises(ProfileError) as err:
        load_profile(tmp_path / "p")
    text = str(err.value)
    assert "operators.linear1.fwd.baseline" in text and "tpu-v5" in text and "\n" not in text


TENSORS = (10, 14, 11, 13)


def _engine_json(path, profile, sizes=((64, 64), (128, 64), (128, 128), (256, 64)),
                 layer=lambda operators: 1.2 * operators + 1e-3, backward=None):
    """Engine measurements at these (hidden, seq) shapes whose layers take ``layer(their
    operators)`` (default: 20% + 1 ms slower than the operators predict); ``backward(its
    operator predictions)``, when given, a layer's backward instead."""
    from neox_perf.calibration.engine import engine_keys, engine_label
    from neox_perf.predictors.fitting.engine_fit import _engine_prediction
    shapes = {}
    for i, (d, l) in enumerate(sizes):
        shape = (d, l, 1, "layernorm", "global", 256)
        keys = engine_keys(shape, 2)
        p = _engine_prediction(profile, keys, 256, "fp32")
        lf, lb = layer(p["layer_forward"]), (backward(p) if backward else layer(p["layer_backward"]))
        shapes[engine_label(shape, 2)] = {
            "keys": keys, "vocab": 256, "layers": 2, "precision": "fp32", "params": 1000 * (i + 1),
            "tensors": TENSORS[i % 4], "layer_forward": 2 * lf, "layer_backward": 2 * lb,
            "forward": 2 * lf + p["other_forward"] + 2e-3, "backward": 2 * lb + p["other_backward"] + 2e-3,
            "flatten": 1e-3 * (i + 1), "step": 1e-4 * TENSORS[i % 4] + 2e-6 * 1000 * (i + 1),
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


def test_a_layer_backward_residual_finds_its_memory_bound_operators_slower(tmp_path):
    # a backward whose memory-bound operators (norm, softmax, mask, activation) run 2.5x their
    # warm benchmark and the rest 5% over, at shapes whose memory-bound share differs (the
    # attention's s x s grows with the sequence): the fit separates the two, the forward has
    # no such column, and the shapes are predicted to within rounding
    profile = load_profile("perlmutter-a100-80gb")
    sizes = ((64, 64), (64, 256), (128, 64), (128, 256), (256, 128), (256, 512))

    def backward(p):
        return 1.05 * p["layer_backward"] + 1.5 * p["layer_backward_memory"] + 5e-4
    _engine_json(tmp_path / "engine.json", profile, sizes, backward=backward)
    terms, table = fit_engine(profile, tmp_path / "engine.json")
    back = terms["layer_backward"]
    assert back["per_memory"] == pytest.approx(1.5, rel=1e-3)
    assert back["per_unit"] == pytest.approx(0.05, abs=1e-3) and back["loo_max"] < 1e-6
    assert "per_memory" not in terms["layer_forward"]
    assert any("memory-bound" in r.note for r in table if r.op == "engine layer_backward")
    # the one line it replaced misses shapes by their memory-bound share
    from neox_perf.predictors.fitting.engine_fit import _engine_prediction, _residual_fit
    from neox_perf.calibration.engine import engine_keys
    preds = [_engine_prediction(profile, engine_keys((d, l, 1, "layernorm", "global", 256), 2), 256, "fp32")
             for d, l in sizes]
    x = np.array([p["layer_backward"] for p in preds])
    m = np.array([backward(p) for p in preds])
    assert _residual_fit(x, m - x, m)[1].max() > 1e-3


# The line `calibrate` fitted to this project's CPU for its `ident` profile's layer backward
# (benchmarks/outputs_identical.py; +135.8% of the operators - 1.79 ms, a negative fixed part),
# its fixed part scaled to an A100's layers: measured on layers of 3 to 20 ms of operators, it
# crosses zero at 1.3 ms, above the 1.2 ms of the tiny 2-stage model below (`check` of that
# model on `ident` stopped on "stage 0: backward must be a finite number >= 0, got -0.00108").
BIG_LAYERS = ((4096, 1024), (4096, 2048), (6144, 1024), (8192, 1024))
TINY_PIPELINE = """
num_layers: 4
hidden_size: 64
num_attention_heads: 4
seq_length: 32
max_position_embeddings: 32
pos_emb: rotary
rotary_pct: 0.25
no_weight_tying: true
train_micro_batch_size_per_gpu: 2
gradient_accumulation_steps: 2
optimizer: {type: Adam, params: {lr: 0.003}}
pipe_parallel_size: 2
"""


def _negative_fixed_part(operators):
    return 2.358 * operators - 3e-3


def test_a_line_with_a_negative_fixed_part_keeps_small_layers_at_their_lowest_measured_ratio(
        tmp_path, write_yaml, capsys):
    from neox_perf.cli import main
    from neox_perf.config import WorldRequest, build, load_files
    from neox_perf.derive import derive
    from neox_perf.prediction.predict import predict
    from neox_perf.profile.directory import bundled_dir

    mine = tmp_path / "mine"
    shutil.copytree(bundled_dir() / "perlmutter-a100-80gb", mine)
    _engine_json(tmp_path / "engine.json", load_profile(mine), BIG_LAYERS, _negative_fixed_part)
    add_engine(mine, tmp_path / "engine.json")
    profile = load_profile(mine)
    terms = profile.manifest.engine.residuals
    measured = json.loads((tmp_path / "engine.json").read_text())["shapes"].values()
    for phase in ("forward", "backward"):
        term = terms[f"layer_{phase}"]
        assert term.seconds == pytest.approx(-3e-3, rel=1e-4) and term.per_unit == pytest.approx(1.358, rel=1e-4)
        # the fit records the measured layers' time over their operators', lowest and highest
        lo, hi = term.ratio_range
        operators = [(m[f"layer_{phase}"] / 2 + 3e-3) / 2.358 for m in measured]
        assert lo == pytest.approx(min(_negative_fixed_part(x) / x for x in operators), rel=1e-6)
        assert hi == pytest.approx(max(_negative_fixed_part(x) / x for x in operators), rel=1e-6)
        assert 1.0 < lo < hi < 2.358

    path = write_yaml("tiny.yml", TINY_PIPELINE)
    cfg, _, _ = build(load_files([path]), WorldRequest(gpus=2),
                      cluster_gpus_per_node=profile.facts.gpus_per_node)  # as check builds it
    derived = derive(cfg, 500)
    plain = predict(cfg, derived, load_profile("perlmutter-a100-80gb")).estimate  # no engine terms
    est = predict(cfg, derived, profile).estimate
    for p, e in zip(plain.stages, est.stages):
        x = p.layer_backward  # one layer's operators: no tensor-parallel all-reduce in it
        assert x + _negative_fixed_part(x) - x < 0  # the line alone: a negative layer backward
        # below the measured shapes the phase keeps the lowest ratio they were measured at
        assert e.layer_backward == pytest.approx(terms["layer_backward"].ratio_range[0] * x, rel=1e-9)
        assert e.layer_forward == pytest.approx(terms["layer_forward"].ratio_range[0] * p.layer_forward, rel=1e-9)
        assert e.backward > 0 and e.forward > 0
    # and `check` predicts the run: no internal error
    code = main(["check", path, "--gpus", "2", "--cluster", str(mine), "--vocab-size", "500", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["prediction"]["iteration_seconds"] == pytest.approx(est.iteration_seconds)


def test_tensor_parallel_terms_recover_a_known_coupling(tmp_path):
    """The tensor-parallel pass's rows, built 30% (layers) and 10% (head and loss) slower than
    their parts -- operators, the fitted residuals, their all-reduces as the profile prices
    them --, give those ratios back, with every row agreeing (leave-one-out error ~0)."""
    from neox_perf.calibration.engine import engine_keys, engine_label
    from neox_perf.predictors.fitting.engine_fit import _engine_prediction
    profile = load_profile("perlmutter-a100-80gb")
    path = tmp_path / "engine.json"
    _engine_json(path, profile)
    data = json.loads(path.read_text())

    def comm(calls):
        return sum(profile.predict_collective(c.kind, c.elements, c.nodes, c.gpus_per_node).seconds
                   * c.count for c in calls)
    tp = {}
    for d, l in ((128, 64), (256, 64), (256, 128)):
        shape = (d, l, 1, "layernorm", "global", 256)
        keys = engine_keys(shape, 2, mp=2)
        p = _engine_prediction(profile, keys, 256, "fp32")
        assert p["layer_forward_comm"] and p["other_forward_comm"]  # mp 2: all-reduces priced
        lf = 1.3 * (1.2 * p["layer_forward"] + 1e-3 + comm(p["layer_forward_comm"]))
        lb = 1.3 * (1.2 * p["layer_backward"] + 1e-3 + comm(p["layer_backward_comm"]))
        of = 1.1 * (p["other_forward"] + 2e-3 + comm(p["other_forward_comm"]))
        ob = 1.1 * (p["other_backward"] + 2e-3 + comm(p["other_backward_comm"]))
        tp[engine_label(shape, 2)] = {
            "keys": keys, "vocab": 256, "layers": 2, "model_parallel_size": 2, "processes": 2,
            "precision": "fp32", "params": 1000, "tensors": 10, "layer_forward": 2 * lf,
            "layer_backward": 2 * lb, "forward": 2 * lf + of, "backward": 2 * lb + ob}
    path.write_text(json.dumps({**data, "tp": tp}))
    terms, table = fit_engine(profile, path)
    for name, ratio in (("tp_layer_forward", 1.3), ("tp_layer_backward", 1.3),
                        ("tp_other_forward", 1.1), ("tp_other_backward", 1.1)):
        t = terms[name]
        # (the residuals under the parts are fitted, not given: within 0.1% of those built in)
        assert 1 + t["per_unit"] == pytest.approx(ratio, rel=1e-3), name
        assert t["processes"] == 2 and t["rows"] == 3 and t["loo_max"] < 1e-3
        assert t["ratio_range"][0] == pytest.approx(ratio, rel=1e-3)
    assert any(r.op == "engine tp_layer_forward" for r in table)

    class NoAllReduce:  # a profile without all-reduce samples cannot price the parts
        manifest = profile.manifest

        def predict(self, *a, **k):
            return profile.predict(*a, **k)

        def predict_collective(self, *a, **k):
            from neox_perf.errors import ProfileError
            raise ProfileError("p", "profile p has no model for allreduce", "use another")
    terms, table = fit_engine(NoAllReduce(), path)
    assert not any(k.startswith("tp_") for k in terms) and "layer_forward" in terms
    assert any("not fitted" in r.note for r in table if r.op.startswith("engine tp_"))
    data.pop("tp", None)
    path.write_text(json.dumps(data))
    assert not any(k.startswith("tp_") for k in fit_engine(profile, path)[0])  # no pass: no terms
