"""The bundled profiles: loading, facts, provenance, predictions, flags and errors."""
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from neox_perf.prediction import opspec
from neox_perf.predictors import (ClusterProfile, Prediction, ProfileError, list_profiles, load_profile)

NAMES = ("perlmutter-a100-80gb", "vista-gh200")
HEAVY = ("sklearn", "xgboost", "torch", "deepspeed", "pandas", "scipy")


@pytest.fixture(scope="module", params=NAMES)
def profile(request) -> ClusterProfile:
    return load_profile(request.param)


def _mid(entry, names):
    return {n: float(np.sqrt(entry["ranges"][n][0] * entry["ranges"][n][1])) if entry["ranges"][n][0] > 0
            else entry["ranges"][n][0] for n in names}


def test_list_profiles():
    infos = {p.name: p for p in list_profiles()}
    assert set(NAMES) <= set(infos)
    assert infos["perlmutter-a100-80gb"].gpu == "NVIDIA A100-SXM4-80GB"
    assert "GH200" in infos["vista-gh200"].gpu
    for info in (infos[n] for n in NAMES):
        assert "2509.22832" in info.provenance and "MIT" in info.provenance
        assert (info.path / "manifest.json").is_file()


def test_load_by_name_directory_or_manifest():
    by_name = load_profile("perlmutter-a100-80gb")
    by_dir = load_profile(str(by_name.path))
    by_file = load_profile(by_name.path / "manifest.json")
    assert by_name.facts == by_dir.facts == by_file.facts


def test_facts():
    p, v = load_profile("perlmutter-a100-80gb").facts, load_profile("vista-gh200").facts
    assert (p.gpus_per_node, v.gpus_per_node) == (4, 1)
    assert p.gpu_memory_bytes == 80 * 2 ** 30 and v.gpu_memory_bytes == 96 * 2 ** 30
    assert p.intra_node_link.name.startswith("NVLink") and p.inter_node_link.name == "Slingshot-10"
    assert "InfiniBand" in v.inter_node_link.name
    assert p.peak_fp16_tflops > 0 and v.hbm_bandwidth_gbps > p.hbm_bandwidth_gbps
    with pytest.raises(Exception):
        p.name = "other"  # frozen


def test_manifest_provenance_and_validation(profile):
    m = profile.manifest.to_dict()  # as manifest.json holds it
    assert m["schema_version"] == 1
    files = m["provenance"]["files"]
    assert all(len(f["sha256"]) == 64 for f in files)
    assert {"numpy", "scikit-learn", "xgboost"} <= set(m["training"]["library_versions"])
    assert any("2509.22832" in m["provenance"]["source"] for _ in [0])
    for op, phases in m["operators"].items():
        for phase, entry in phases.items():
            if "derived" in entry:
                continue
            v = entry["validation_mape"]
            assert {"baseline", "pure_trees", "baseline_plus_trees", "chosen"} <= set(v), (op, phase)
            assert entry["model"] in ("random_forest", "xgboost", "baseline")
    assert set(m["collectives"]) == set(opspec.COLLECTIVES)
    assert any("80GB" in n or "96 GB" in n for n in m["notes"])


def test_vista_known_defects_are_recorded():
    m = load_profile("vista-gh200").manifest.to_dict()
    assert m["operators"]["flash_attention"]["bwd"]["derived"]["scale"] == "flop_ratio"
    files = {f["file"]: f for f in m["provenance"]["files"]}
    for topo in ("4_1", "8_1"):
        dropped = files[f"NVIDIAGH200120GB_allgather_large_fp16_{topo}.csv"]["dropped"]["comm"]
        assert sum(n for r, n in dropped.items() if "bandwidth" in r) > 100
    first = files["NVIDIAGH200120GB_firstStage_optimizer_fp16.csv"]["dropped"]["step"]
    assert sum(n for r, n in first.items() if "outlier" in r) >= 40
    assert "8x1" not in m["collectives"]["allgather"]["topologies"]


def test_every_model_predicts_inside_its_range(profile):
    for op, phases in profile.manifest.to_dict()["operators"].items():
        for phase, entry in phases.items():
            if "derived" in entry:
                continue
            feats = _mid(entry, entry["features"])
            pred = profile.predict(op, phase, feats)
            assert isinstance(pred, Prediction)
            assert np.isfinite(pred.seconds) and pred.seconds > 0, (op, phase)
            assert not pred.extrapolated, (op, phase, pred.reason)


def test_extrapolation_is_flagged_with_a_reason(profile):
    entry = profile.manifest.to_dict()["operators"]["linear1"]["fwd"]
    kmax = entry["ranges"]["k"][1]
    pred = profile.predict("linear1", "fwd", {"m": 8192, "k": 2 * kmax, "n": 3 * 2 * kmax})
    assert pred.extrapolated and f"k={2 * kmax:g} above the sampled maximum" in pred.reason
    assert pred.seconds > profile.predict("linear1", "fwd", {"m": 8192, "k": kmax, "n": 3 * kmax}).seconds


def test_causal_flash_attention_is_cheaper_and_flagged(profile):
    f = {"b": 4, "l": 4096, "heads": 32, "head_dim": 128, "causal": 0}
    full = profile.predict("flash_attention", "fwd", f)
    causal = profile.predict("flash_attention", "fwd", dict(f, causal=1))
    assert causal.extrapolated and "causal=1 never sampled" in causal.reason
    assert 0.4 * full.seconds < causal.seconds < full.seconds
    bwd = profile.predict("flash_attention", "bwd", f)
    assert bwd.seconds > full.seconds


def test_unsampled_topology_gets_a_flagged_physical_prediction(profile):
    gpn = profile.facts.gpus_per_node
    for kind in ("allreduce", "allgather"):
        big = profile.predict_collective(kind, 5e8, nodes=16, gpus_per_node=gpn)
        assert np.isfinite(big.seconds) and big.seconds > 0
        assert big.extrapolated and "never sampled" in big.reason
        small = profile.predict_collective(kind, 5e8, nodes=2, gpus_per_node=1)
        assert big.seconds > 0.5 * small.seconds


def test_sampled_topology_in_range_is_not_flagged(profile):
    topo = profile.manifest.to_dict()["collectives"]["allreduce"]["topologies"]
    t = next(iter(topo.values()))
    pred = profile.predict_collective("allreduce", float(np.mean(t["elements"])), t["nodes"], t["gpus_per_node"])
    assert not pred.extrapolated and pred.seconds > 0


def test_collective_edge_cases(profile):
    assert profile.predict_collective("allreduce", 1e6, 1, 1) == Prediction(0.0, False, "")
    with pytest.raises(ValueError, match="GPUs per node"):
        profile.predict_collective("allreduce", 1e6, 2, profile.facts.gpus_per_node + 1)
    with pytest.raises(ValueError, match="unknown collective"):
        profile.predict_collective("alltoall", 1e6, 2, 1)
    with pytest.raises(ValueError):
        profile.predict_collective("allreduce", 1e6, 0, 1)


def test_bad_queries_raise_value_errors(profile):
    with pytest.raises(ValueError, match="unknown operator"):
        profile.predict("conv2d", "fwd", {})
    with pytest.raises(ValueError, match="missing k"):
        profile.predict("linear1", "fwd", {"m": 1, "n": 2})
    with pytest.raises(ValueError, match="phases"):
        profile.predict("optimizer", "fwd", {"params": 1e9})
    with pytest.raises(ValueError, match="finite"):
        profile.predict("linear1", "fwd", {"m": 1, "k": float("nan"), "n": 2})


def test_vectorised_path_matches_scalar(profile):
    m = np.array([2048.0, 8192.0, 40960.0, 90000.0])
    batch = profile.predict_many("linear3", "bwd", {"m": m, "k": 4096, "n": 4096})
    for i in range(len(m)):
        one = profile.predict("linear3", "bwd", {"m": m[i], "k": 4096, "n": 4096})
        assert batch[i].seconds == pytest.approx(one.seconds, rel=1e-12)
        assert batch[i].extrapolated == one.extrapolated and batch[i].reason == one.reason


@pytest.mark.parametrize("op, grow, fixed", [
    ("linear1", "m", {"k": 4096, "n": 6144}), ("linear4", "k", {"m": 8192, "n": 4096}),
    ("linear_final", "m", {"k": 4096, "n": 12672}), ("qk", "l", {"batch": 32, "head_dim": 128}),
    ("av", "batch", {"l": 2048, "head_dim": 128}), ("gelu", "tokens", {"width": 8192}),
    ("layernorm", "tokens", {"d": 4096}), ("optimizer", "params", {}),
    ("flash_attention", "l", {"b": 4, "heads": 16, "head_dim": 128, "causal": 0}),
])
def test_bigger_work_is_not_much_faster(profile, op, grow, fixed):
    spec = opspec.op_spec(op)
    lo, hi = profile.manifest.to_dict()["operators"][op][spec.phases[0]]["ranges"][grow]
    values = np.geomspace(lo, 2 * hi, 12)
    for phase in spec.phases:
        times = [profile.predict(op, phase, dict(fixed, **{grow: v})).seconds for v in values]
        for a, b in zip(times, times[1:]):
            assert b > 0.5 * a, (op, phase, times)
        assert times[-1] > times[0]


def test_collectives_grow_with_size(profile):
    gpn = profile.facts.gpus_per_node
    for kind, nodes, g in (("allreduce", 2, 1), ("allgather", 2, 1), ("p2p", 2, 1), ("allreduce", 1, gpn)):
        if nodes * g == 1:
            continue
        times = [profile.predict_collective(kind, e, nodes, g).seconds for e in np.geomspace(2e6, 2e9, 10)]
        for a, b in zip(times, times[1:]):
            assert b > 0.5 * a, (kind, times)
        assert times[-1] > 10 * times[0]


def test_loading_does_not_import_training_libraries():
    code = ("import sys\n"
            "from neox_perf.predictors import load_profile\n"
            "ps = [load_profile(n) for n in %r]\n"
            "for p in ps:\n"
            "    p.predict('linear1', 'fwd', {'m': 8192, 'k': 4096, 'n': 12288})\n"
            "    p.predict_collective('allreduce', 1e8, 2, 1)\n"
            "print(','.join(m for m in %r if m in sys.modules))\n") % (NAMES, HEAVY)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_loaded_profiles_predict_a_grid():
    # how fast is benchmarks/unit_speed.py's
    ps = [load_profile(n) for n in NAMES]
    for p in ps:
        seconds = [p.predict("linear1", "fwd", {"m": 1024 + 64 * i, "k": 4096, "n": 12288}).seconds
                   for i in range(150)]
        assert all(s > 0 and math.isfinite(s) for s in seconds)
        assert seconds[-1] > seconds[0]  # 10x the rows of a GEMM take longer


# ---- errors ------------------------------------------------------------------------------

def _copy(tmp_path) -> Path:
    src = load_profile("perlmutter-a100-80gb").path
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def test_unknown_profile_name():
    with pytest.raises(ProfileError) as info:
        load_profile("summit-v100")
    assert "summit-v100" in str(info.value) and "perlmutter-a100-80gb" in str(info.value)


def test_directory_without_manifest(tmp_path):
    with pytest.raises(ProfileError, match="manifest.json: profile manifest not found"):
        load_profile(tmp_path)


def test_corrupt_manifest(tmp_path):
    d = _copy(tmp_path)
    (d / "manifest.json").write_text("{not json")
    with pytest.raises(ProfileError, match=r"manifest.json: unreadable profile manifest .*fix: retrain"):
        load_profile(d)


def test_foreign_json(tmp_path):
    d = _copy(tmp_path)
    (d / "manifest.json").write_text(json.dumps({"hello": "world"}))
    with pytest.raises(ProfileError, match="not a neox-perf cluster profile"):
        load_profile(d)


def test_newer_schema(tmp_path):
    d = _copy(tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m["schema_version"] = 99
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ProfileError, match="schema version 99"):
        load_profile(d)


def test_corrupt_or_missing_arrays(tmp_path):
    d = _copy(tmp_path)
    data = (d / "arrays.npz").read_bytes()
    (d / "arrays.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ProfileError, match=r"arrays.npz: .*sha256"):
        load_profile(d)
    (d / "arrays.npz").unlink()
    with pytest.raises(ProfileError, match="arrays.npz: profile arrays file not found"):
        load_profile(d)


def test_arrays_without_checksum_still_validated(tmp_path):
    d = _copy(tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m["arrays"]["sha256"] = None
    (d / "manifest.json").write_text(json.dumps(m))
    (d / "arrays.npz").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(ProfileError, match="corrupt profile arrays"):
        load_profile(d)


def test_error_messages_are_one_line(tmp_path):
    d = _copy(tmp_path)
    (d / "manifest.json").write_text("{\n\n bad")
    with pytest.raises(ProfileError) as info:
        load_profile(d)
    assert "\n" not in str(info.value)


def test_unsampled_attention_dropout_stands_in_for_softmax_by_bytes(profile):
    # No published set samples dropout: the softmax forward over the same [batch, l, l] (one
    # elementwise pass) predicts both phases, scaled by bytes moved (fp16: 5/4 of softmax's)
    for phase in ("fwd", "bwd"):
        for l, out in ((1024, False), (65536, True)):
            f, ratio = {"batch": 16, "l": l}, 5 / 4
            got, src = profile.predict("attn_dropout", phase, f), profile.predict("softmax", "fwd", f)
            assert got.seconds == pytest.approx(src.seconds * ratio, rel=1e-12)
            assert got.extrapolated == src.extrapolated == out
            many = profile.predict_many("attn_dropout", phase, {"batch": [16, 32], "l": l})
            assert many.seconds[0] == pytest.approx(got.seconds, rel=1e-12)
            assert profile.coverage("attn_dropout", phase, f) == profile.coverage("softmax", "fwd", f)
    # a profile that samples dropout itself predicts it with its own model (here: fillmask's
    # fitted model filed under attn_dropout; loaded profiles are cached, so a fresh one)
    from neox_perf.predictors.artifacts import Arrays
    from neox_perf.profile.directory import arrays_path
    from neox_perf.profile.manifest import Manifest
    manifest = profile.manifest.to_dict()
    manifest["operators"]["attn_dropout"] = {"fwd": manifest["operators"]["fillmask"]["fwd"]}
    manifest = Manifest.parse(manifest)
    own = ClusterProfile(profile.path, manifest, Arrays(arrays_path(profile.path, manifest), manifest.arrays.sha256))
    f = {"batch": 16, "l": 1024}
    assert own.predict("attn_dropout", "bwd", f).seconds == pytest.approx(
        profile.predict("attn_dropout", "bwd", f).seconds, rel=1e-12)
    assert own.predict("attn_dropout", "fwd", f).seconds != pytest.approx(
        profile.predict("attn_dropout", "fwd", f).seconds, rel=1e-3)


def test_transferred_profile_scales_the_stand_in_as_its_own_operator():
    from neox_perf.prediction.predict import load_cluster
    forty = load_cluster("perlmutter-a100")  # 40 GB nodes, memory-bound operators transferred
    f = {"batch": 16, "l": 1024}
    for phase in ("fwd", "bwd"):
        base = forty.base.predict("attn_dropout", phase, f).seconds
        assert forty.predict("attn_dropout", phase, f).seconds > base  # less HBM bandwidth
