"""The achievable-rate table, the rules built on it (predictors/achievable.py) and the cleaning
rule for samples faster than the chip sustains (docs/achievable-rates.md)."""
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from neox_perf.prediction import opspec
from neox_perf.prediction.operators import OpCall
from neox_perf.predictors import achievable, gpus
from neox_perf.predictors.fitting import cleaning
from neox_perf.predictors.errors import ProfileError
from neox_perf.profile.facts import ClusterFacts, Link
from neox_perf.predictors.profile import load_profile
from neox_perf.predictors.fitting.samples import load_cluster

import predictors_synthetic as syn
from neox_perf.profile.manifest import Manifest
from neox_perf.profile.models import Baseline, ModelEntry
from neox_perf.profile.sections import Calibration, Provenance


def _stand_in(gpu, path="p", **manifest):
    """A profile of the GPU-table row `gpu` (or a device name) with these manifest sections."""
    name = gpus.gpu(gpu).name if gpus.find_gpu(gpu) else gpu
    return SimpleNamespace(facts=SimpleNamespace(gpu_name=f"NVIDIA {name}", peak_fp16_tflops=None),
                           manifest=Manifest("p", **manifest), path=path)


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
    desc = _stand_in("L40S", "l40s.yml")
    limits = achievable.limits(desc, "bf16")
    call = _call()
    seconds, why = limits.capped(call, call.flops / 400e12)
    assert seconds == pytest.approx(call.flops / 362e12) and "data-sheet bf16 peak" in why


@pytest.mark.parametrize("gpu", ["MI300X", "MI250X-GCD", "L40S"])
def test_fp32_is_refused_in_one_line_where_no_fp32_rate_is_known(gpu):
    desc = _stand_in(gpu, f"{gpu}.yml")
    with pytest.raises(ProfileError) as err:
        achievable.limits(desc, "fp32")
    line = err.value.line()
    assert "\n" not in line and f"{gpu}.yml" in line and "no measured" in line and "fix:" in line


def test_fp32_from_fp16_samples_and_a_cpu_calibration():
    h100 = _stand_in("H100-SXM5-80GB", "h.yml")
    limits = achievable.limits(h100, "fp32", tf32=False)
    assert limits.rescale_tflops == (794.5, 51.88) and limits.cap_tflops == 51.88
    assert "matmuls as IEEE fp32" in limits.note()
    gemm, norm = _call(), _call("layernorm", "fwd", tokens=16384, d=6144)
    # mostly compute-bound: the fp16 time carries ~7% of byte time that only doubles
    assert limits.rescaled(gemm, 1.0) == pytest.approx(794.5 / 51.88, rel=0.06)
    # a norm: its FLOPs on the vector units (67 TFLOP/s) in both precisions, its bytes doubled
    f, b, w = norm.flops, norm.bytes, 3350e9
    assert limits.rescaled(norm, 1.0) == pytest.approx((f / 67e12 + 2 * b / w) / (f / 67e12 + b / w))
    cpu = SimpleNamespace(facts=SimpleNamespace(gpu_name="Intel Xeon (CPU)"), path="cpu",
                          manifest=Manifest("cpu", calibration=Calibration(dtype="fp32", device="cpu")))
    assert achievable.limits(cpu, "fp32") is None
    # the model's fixed cost (launch and framework overhead) is the same in either element type
    launched = _stand_in("H100-SXM5-80GB", "l", operators={"linear3": {"fwd": ModelEntry(
        baseline=Baseline(("t0", "flops", "bytes"), (2e-5, 1e-15, 0.0)))}})
    with_t0 = achievable.limits(launched, "fp32", tf32=False)
    ratio = limits.rescaled(gemm, 1.0)
    assert with_t0.rescaled(gemm, 1e-3) == pytest.approx(2e-5 + (1e-3 - 2e-5) * ratio)
    assert with_t0.rescaled(gemm, 1e-5) == pytest.approx(1e-5)  # all of it fixed cost
    # a level-corrected copy (calibrate --from-run) predicts its run's fp32 calls already
    corrected = _stand_in("H100-SXM5-80GB", "c", provenance=Provenance(recalibrated={"dtype": "fp32"}))
    assert achievable.limits(corrected, "fp32").rescale_tflops is None
    # bf16 from fp16 samples rescales only where the two rates differ
    assert achievable.limits(_stand_in("MI300X"), "bf16").rescale_tflops == (654.0, 708.0)
    assert achievable.limits(h100, "bf16").rescale_tflops is None


def test_mfu_is_quoted_against_the_runs_precision():
    dgx = load_profile("perlmutter-a100")
    assert achievable.mfu_peak_tflops(dgx, "fp16") == 312
    assert achievable.mfu_peak_tflops(dgx, "fp32", tf32=False) == 19.5
    assert achievable.mfu_peak_tflops(dgx, "fp32", tf32=True) == 156  # the A100's dense TF32


# ---- TF32: an fp32 run's matmuls on the tensor cores -----------------------------------

def test_tf32_is_a_third_pricing_of_fp32_matmuls():
    """tf32 on: the matmul operators move from fp16's rate to TF32's, not IEEE fp32's; bytes
    and the vector-unit operators are priced as for IEEE fp32; the cap is TF32's rate."""
    h100 = _stand_in("H100-SXM5-80GB", "h.yml")
    tf32, ieee = achievable.limits(h100, "fp32", tf32=True), achievable.limits(h100, "fp32", tf32=False)
    assert tf32.rescale_tflops == (794.5, 402.15) and tf32.cap_tflops == 402.15 and tf32.matmul == "tf32"
    assert ieee.matmul == "fp32" and "matmuls as TF32" in tf32.note()
    gemm, norm = _call(), _call("layernorm", "fwd", tokens=16384, d=6144)
    assert tf32.rescaled(gemm, 1.0) == pytest.approx(794.5 / 402.15, rel=0.06)
    assert tf32.rescaled(gemm, 1.0) < ieee.rescaled(gemm, 1.0) / 5  # 402 vs 52 TFLOP/s
    assert tf32.rescaled(norm, 1.0) == pytest.approx(ieee.rescaled(norm, 1.0))  # memory-bound: unchanged
    # never faster than TF32's achievable rate, wherever the samples put it
    seconds, why = tf32.capped(gemm, gemm.flops / 600e12)
    assert seconds == pytest.approx(gemm.flops / 402.15e12) and "achievable tf32 rate" in why
    assert tf32.fp32_matmuls.known and tf32.fp32_matmuls.source == "tf32: true"
    # 16-bit runs know nothing of it
    assert achievable.limits(h100, "bf16", tf32=True).fp32_matmuls is None


def _description(tmp_path, **keys):
    from neox_perf.predictors import cluster_file, transfer
    base = load_profile("perlmutter-a100-80gb")
    data = {"name": "d", "base": base.name, "gpu": "A100-SXM4-80GB", "gpus_per_node": 8,
            "intra_node_GBps": 300, "inter_node_Gbps": 1600, **keys}
    desc = cluster_file.parse(data, tmp_path / "d.yml")
    return transfer.TransferredProfile(desc, base, transfer.base_gpu_of(desc, base))


def test_where_tf32_comes_from(tmp_path):
    """The description's key, else a calibrated profile's facts, else the default (TF32, its
    reason named); a GPU without a TF32 rate takes IEEE fp32, and refuses a tf32: true."""
    on = achievable.fp32_matmuls(_description(tmp_path, tf32=True))
    off = achievable.fp32_matmuls(_description(tmp_path, tf32=False))
    unsaid = achievable.fp32_matmuls(_description(tmp_path))
    assert (on.tf32, on.known, on.source) == (True, True, "cluster description d.yml tf32: true")
    assert (off.tf32, off.known) == (False, True) and "tf32: false" in off.source
    assert (unsaid.tf32, unsaid.known) == (achievable.DEFAULT_TF32, False)
    assert "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1" in unsaid.source and unsaid.source.startswith("default:")
    # the run's own record wins over the cluster's
    assert achievable.fp32_matmuls(_description(tmp_path, tf32=True), False, "the run").tf32 is False
    calibrated = _stand_in("A100-SXM4-80GB")
    calibrated.facts.tf32, calibrated.name = False, "mine"
    mm = achievable.fp32_matmuls(calibrated)
    assert (mm.tf32, mm.known) == (False, True) and "profile mine" in mm.source
    b200 = _stand_in("B200", "b.yml")
    assert achievable.fp32_matmuls(b200).tf32 is False and "no TF32 rate for B200" in achievable.fp32_matmuls(b200).source
    with pytest.raises(ProfileError) as err:
        achievable.limits(b200, "fp32", tf32=True)
    assert "\n" not in err.value.line() and "no TF32 rate" in err.value.line() and "tf32: false" in err.value.line()
    from neox_perf.predictors import cluster_file
    with pytest.raises(ProfileError, match="tf32: must be true or false"):
        cluster_file.parse({"name": "d", "base": "b", "gpu": "A100-SXM4-80GB", "gpus_per_node": 1,
                            "inter_node_Gbps": 200, "tf32": "yes"}, tmp_path / "d.yml")


def test_fp32_samples_calibrated_with_tf32_are_tf32_matmul_samples():
    """A profile calibrated in fp32 with TF32 on predicts TF32 matmuls: a TF32 run takes them
    as they are, an IEEE run is rescaled from TF32's rate down to fp32's, and back."""
    cal = Calibration(dtype="fp32", device="cuda")
    on = _stand_in("H100-SXM5-80GB", "c", calibration=cal)
    on.facts.tf32 = True
    assert achievable.limits(on, "fp32", tf32=True).rescale_tflops is None
    assert achievable.limits(on, "fp32", tf32=False).rescale_tflops == (402.15, 51.88)
    off = _stand_in("H100-SXM5-80GB", "c", calibration=cal)
    off.facts.tf32 = False
    assert achievable.limits(off, "fp32", tf32=True).rescale_tflops == (51.88, 402.15)
    # a level correction to a run that recorded its TF32
    corrected = _stand_in("H100-SXM5-80GB", "c", provenance=Provenance(recalibrated={"dtype": "fp32", "tf32": True}))
    assert achievable.limits(corrected, "fp32", tf32=False).rescale_tflops == (402.15, 51.88)


# ---- cleaning -------------------------------------------------------------------------

GCD = ClusterFacts(name="gcd", gpu_name="AMD MI250X-GCD", gpu_memory_bytes=64 << 30, gpus_per_node=8,
                   intra_node_link=Link("xgmi", 100.0, 7), inter_node_link=Link("slingshot", 25.0, 4),
                   peak_fp16_tflops=191.5, hbm_bandwidth_gbps=1638.0)


def test_rows_beating_the_achievable_rate_are_raised_to_it_and_counted(tmp_path):
    """The synthetic GEMMs run at up to ~200 TFLOP/s: on one MI250X GCD (achievable 147.0,
    data sheet 191.5, dropped only above 1.25 x 191.5) the faster rows are kept but raised to
    FLOPs / 147.0, each file counts them, the manifest notes say how many."""
    syn.write_operator(tmp_path, "linear1")
    (tmp_path / "nccl").mkdir()
    sets, records = load_cluster(tmp_path)
    raw = sets[("linear1", "fwd")]
    floor = opspec.op_flops("linear1", "fwd", raw.features) / 147.0e12
    fast = int(np.sum(raw.seconds < floor))
    assert fast > 0
    result = cleaning.clean(sets, records, GCD)
    kept = result.sets[("linear1", "fwd")]
    rate = opspec.op_flops("linear1", "fwd", kept.features) / kept.seconds
    assert rate.max() <= 147.0e12 * (1 + 1e-9)
    rec = next(r for r in records if r.path.name.endswith("linear1_fp16.csv"))
    assert rec.capped["fwd"] == fast and rec.to_dict()["capped_to_achievable"]["fwd"] == fast
    assert any(n.startswith("linear1/fwd:") and "147 TFLOP/s" in n for n in result.notes)
    # a CPU calibration (no GPU row) keeps every row as measured
    sets, records = load_cluster(tmp_path)
    cpu = replace(GCD, gpu_name="AMD EPYC (CPU)")
    same = cleaning.clean(sets, records, cpu).sets[("linear1", "fwd")]
    assert not any(r.capped for r in records)
    assert (opspec.op_flops("linear1", "fwd", same.features) / same.seconds).max() > 147.0e12
