"""The achievable-rate table and the rules built on it (predictors/achievable.py)."""
from types import SimpleNamespace

import pytest

from neox_perf import opspec
from neox_perf.operators import OpCall
from neox_perf.predictors import achievable, gpus
from neox_perf.predictors.errors import ProfileError
from neox_perf.predictors.profile import load_profile


def test_every_rate_is_sourced_and_below_its_data_sheet():
    for g in gpus.GPUS:
        for precision in ("fp16", "bf16", "fp32"):
            rate = g.achievable(precision)
            if rate is None:
                continue
            assert rate.source and 0 < rate.tflops < g.peak_tflops(precision), (g.name, precision)
            # a figure not measured on this GPU says where it comes from
            assert rate.measured or "derived" in rate.source or "bf16 figure" in rate.source, (g.name, precision)
        if g.achievable("tf32") is not None:
            assert g.achievable("fp32").tflops < g.achievable("tf32").tflops < g.achievable("fp16").tflops
    # the 16-bit rates exist for every row but L40S (no public measurement: docs say so)
    assert [g.name for g in gpus.GPUS if g.achievable("fp16") is None] == ["L40S"]
    assert gpus.gpu("A100-SXM4-80GB").achievable("bfloat16").tflops == 271.2
    assert gpus.gpu("H100-SXM5-80GB").achievable("fp16").tflops == 794.5
    with pytest.raises(ValueError, match="unknown precision"):
        gpus.gpu("A100-SXM4-80GB").achievable("fp8")


def test_clusters_gpus_json_carries_the_achievable_rates():
    row = gpus.gpu("MI300X").to_dict()["achievable_tflops"]
    assert row["fp16"]["tflops"] == 654.0 and row["bf16"]["tflops"] == 708.0
    assert "hipBLASLt" in row["bf16"]["source"] and row["bf16"]["measured"] is True


def _call(op="linear3", phase="fwd", dt=2, **features):
    features = features or {"m": 16384, "k": 6144, "n": 24576}
    return OpCall(op, phase, tuple(sorted(features.items())), 1.0, "layer",
                  float(opspec.op_flops(op, phase, features)), float(opspec.op_bytes(op, phase, features, dt)))


def test_a_description_is_capped_at_its_gpus_achievable_rate():
    dgx = load_profile("perlmutter-a100")  # the 40 GB description: A100-SXM4-40GB, derived 271.2
    limits = achievable.limits(dgx, "fp16")
    call = _call()
    assert limits.rescale_tflops is None
    seconds, why = limits.capped(call, call.flops / 300e12)
    assert seconds == pytest.approx(call.flops / 271.2e12) and "271.2 TFLOP/s (derived)" in why
    assert limits.capped(call, call.flops / 200e12) == (call.flops / 200e12, "")


def test_a_gpu_without_a_measured_rate_is_capped_at_its_data_sheet():
    desc = SimpleNamespace(gpu=gpus.gpu("L40S"), manifest={}, path="l40s.yml")
    limits = achievable.limits(desc, "bf16")
    call = _call()
    seconds, why = limits.capped(call, call.flops / 400e12)
    assert seconds == pytest.approx(call.flops / 362e12) and "data-sheet bf16 peak" in why


@pytest.mark.parametrize("gpu", ["MI300X", "MI250X-GCD", "L40S"])
def test_fp32_is_refused_in_one_line_where_no_fp32_rate_is_known(gpu):
    desc = SimpleNamespace(gpu=gpus.gpu(gpu), manifest={}, path=f"{gpu}.yml")
    with pytest.raises(ProfileError) as err:
        achievable.limits(desc, "fp32")
    line = err.value.line()
    assert "\n" not in line and f"{gpu}.yml" in line and "no measured" in line and "fix:" in line


def test_fp32_from_fp16_samples_and_a_cpu_calibration():
    h100 = SimpleNamespace(gpu=gpus.gpu("H100-SXM5-80GB"), manifest={}, path="h.yml")
    limits = achievable.limits(h100, "fp32")
    assert limits.rescale_tflops == (794.5, 51.88) and limits.cap_tflops == 51.88
    assert "IEEE fp32" in limits.note() and "allow_tf32" in limits.note()
    gemm, norm = _call(), _call("layernorm", "fwd", tokens=16384, d=6144)
    # mostly compute-bound: the fp16 time carries ~7% of byte time that only doubles
    assert limits.rescaled(gemm, 1.0) == pytest.approx(794.5 / 51.88, rel=0.06)
    # a norm: its FLOPs on the vector units (67 TFLOP/s) in both precisions, its bytes doubled
    f, b, w = norm.flops, norm.bytes, 3350e9
    assert limits.rescaled(norm, 1.0) == pytest.approx((f / 67e12 + 2 * b / w) / (f / 67e12 + b / w))
    cpu = SimpleNamespace(facts=SimpleNamespace(gpu_name="Intel Xeon (CPU)"),
                          manifest={"calibration": {"dtype": "fp32", "device": "cpu"}}, path="cpu")
    assert achievable.limits(cpu, "fp32") is None
    # bf16 from fp16 samples rescales only where the two rates differ
    assert achievable.limits(SimpleNamespace(gpu=gpus.gpu("MI300X"), manifest={}), "bf16").rescale_tflops == (654.0, 708.0)
    assert achievable.limits(h100, "bf16").rescale_tflops is None


def test_mfu_is_quoted_against_the_runs_precision():
    dgx = load_profile("perlmutter-a100")
    assert achievable.mfu_peak_tflops(dgx, "fp16") == 312
    assert achievable.mfu_peak_tflops(dgx, "fp32") == 19.5
