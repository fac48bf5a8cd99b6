"""Cluster description files and the GPU table: loading, inheritance, and every bad input."""
import json
import shutil

import pytest

from neox_perf.predictors import ProfileError, list_profiles, load_profile
from neox_perf.predictors import gpus
from neox_perf.profile.directory import bundled_dir
from neox_perf.predictors.transfer import TransferredProfile

REQUIRED_GPUS = ("A100-SXM4-40GB", "A100-SXM4-80GB", "A100-PCIe-80GB", "H100-SXM5-80GB", "H100-PCIe",
                 "H200-SXM-141GB", "GH200-96GB", "L40S", "B200", "MI250X", "MI300X")

MINIMAL = """\
name: mini
base: perlmutter-a100-80gb
gpu: H100-SXM5-80GB
gpus_per_node: 8
intra_node_GBps: 450
inter_node_Gbps: 3200
"""


def _write(tmp_path, text, name="cluster.yml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- GPU table ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", REQUIRED_GPUS)
def test_every_required_gpu_has_data_sheet_figures(name):
    g = gpus.gpu(name)
    assert g.memory_gib > 0 and g.hbm_gbps > 0 and g.fp16_tflops > g.fp32_tflops > 0
    assert "atasheet" in g.source  # a named vendor data sheet
    if g.sms is None or g.boost_mhz is None:
        assert "not in the data sheet" in g.note


def test_gpu_table_values_and_lookup():
    a40, a80 = gpus.gpu("A100-SXM4-40GB"), gpus.gpu("A100-SXM4-80GB")
    assert (a40.hbm_gbps, a80.hbm_gbps, a40.fp16_tflops) == (1555, 2039, 312)
    assert a40.memory_bytes == 40 * 2**30 and a80.memory_bytes == 80 * 2**30
    # device names as torch and the published sample files spell them
    assert gpus.find_gpu("NVIDIA A100-SXM4-80GB") is a80
    assert gpus.find_gpu("NVIDIAGH200120GB") is gpus.gpu("GH200-96GB")
    assert gpus.find_gpu("nvidia h100-sxm5-80gb").name == "H100-SXM5-80GB"
    assert gpus.find_gpu("V100") is None
    with pytest.raises(KeyError, match="did you mean A100-SXM4-40GB"):
        gpus.gpu("A100-SXM4-40G")
    assert gpus.gpu("MI250X-GCD").hbm_gbps * 2 == pytest.approx(gpus.gpu("MI250X").hbm_gbps, rel=1e-3)


# ---- loading ------------------------------------------------------------------------------

def test_a_minimal_description_loads_with_the_profile_interface(tmp_path):
    p = load_profile(str(_write(tmp_path, MINIMAL)))
    assert isinstance(p, TransferredProfile) and p.name == "mini"
    f = p.facts
    assert f.gpu_name.endswith("H100-SXM5-80GB") and f.gpu_memory_bytes == 80 * 2**30
    assert f.gpus_per_node == 8 and f.inter_node_link.bandwidth_gbps == 400.0 and f.inter_node_link.lanes == 8
    assert f.peak_fp16_tflops == 989 and "A100-SXM4-80GB" in f.samples_from
    assert p.collective_dtype == "fp16" and p.operators() and p.collectives()
    info = p.info()
    assert info.name == "mini" and "A100-SXM4-80GB" in info.provenance
    assert p.predict("layernorm", "fwd", {"tokens": 8192, "d": 4096}).seconds > 0
    assert p.predict_collective("allreduce", 1e8, 2, 8).seconds > 0


def test_the_manifest_carries_the_base_keys_and_a_transfer_section(tmp_path):
    base_dir = tmp_path / "base"
    shutil.copytree(bundled_dir() / "perlmutter-a100-80gb", base_dir)
    manifest = json.loads((base_dir / "manifest.json").read_text())
    manifest["step_terms"] = {"per_micro_batch": {"seconds": 0.001}}
    (base_dir / "manifest.json").write_text(json.dumps(manifest))
    text = MINIMAL.replace("base: perlmutter-a100-80gb", "base: ./base")
    p = load_profile(str(_write(tmp_path, text)))
    base = load_profile(str(base_dir))
    mine, theirs = p.manifest.to_dict(), base.manifest.to_dict()  # as manifest.json holds them
    for key in theirs:
        assert key in mine
        if key not in ("name", "facts", "notes"):
            assert mine[key] == theirs[key], key
    assert mine["step_terms"] == {"per_micro_batch": {"seconds": 0.001}}
    t = mine["transfer"]
    assert t["samples_gpu"] == "A100-SXM4-80GB" and t["target_gpu"] == "H100-SXM5-80GB"
    assert t["base_profile"] == base.name and t["operators"]["method"] == "additive"
    assert t["operators"]["compute_time_ratio"] == pytest.approx(271.2 / 794.5)  # achievable, not 312/989
    assert t["operators"]["compute_rates"] == "achievable"
    assert any("transferred" in line for line in t["summary"])
    assert mine["facts"]["gpus_per_node"] == 8 and mine["name"] == "mini"


def test_the_bundled_perlmutter_a100_is_the_40gb_description():
    p = load_profile("perlmutter-a100")
    assert isinstance(p, TransferredProfile)
    assert p.facts.gpu_memory_bytes == 40 * 2**30 and p.facts.hbm_bandwidth_gbps == 1555
    assert p.base.name == "perlmutter-a100-80gb" and p.base.facts.gpu_memory_bytes == 80 * 2**30
    t = p.manifest.transfer
    assert t["samples_gpu"] == "A100-SXM4-80GB" and t["target_gpu"] == "A100-SXM4-40GB"
    assert t["operators"]["bandwidth_time_ratio"] == pytest.approx(2039 / 1555)
    infos = {i.name: i for i in list_profiles()}
    assert infos["perlmutter-a100"].description and not infos["perlmutter-a100-80gb"].description


def test_a_user_description_directory_is_found_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("NEOX_PERF_HOME", str(tmp_path))
    folder = tmp_path / "profiles" / "mine"
    folder.mkdir(parents=True)
    _write(folder, MINIMAL.replace("name: mini", "name: mine"))
    p = load_profile("mine")
    assert p.name == "mine" and p.path == folder.resolve()
    assert "mine" in [i.name for i in list_profiles()]


# ---- bad input: one line naming the file, the key and the fix -----------------------------

BAD = [
    ("gpus_per_nod: 8", "gpus_per_nod", "did you mean gpus_per_node"),
    ("colour: blue", "colour", "known keys"),
    ("DROP:name", "name", "missing"),
    ("DROP:base", "base", "missing"),
    ("DROP:gpu", "gpu", "missing"),
    ("DROP:gpus_per_node", "gpus_per_node", "missing"),
    ("DROP:inter_node_Gbps", "inter_node_Gbps", "missing"),
    ("DROP:intra_node_GBps", "intra_node_GBps", "need a link"),
    ("SET:gpu: H100-SXM", "gpu", "did you mean"),
    ("SET:gpu: V100", "gpu", "clusters --gpus"),
    ("SET:gpus_per_node: 0", "gpus_per_node", "whole number"),
    ("SET:gpus_per_node: 2.5", "gpus_per_node", "whole number"),
    ("SET:gpus_per_node: eight", "gpus_per_node", "must be a number"),
    ("SET:intra_node_GBps: -300", "intra_node_GBps", "positive"),
    ("SET:inter_node_Gbps: true", "inter_node_Gbps", "must be a number"),
    ("SET:name: ''", "name", "non-empty string"),
    ("intra_node_topology: ring", "intra_node_topology", "nvswitch, pointtopoint"),
    ("inter_node_efficiency: 1.5", "inter_node_efficiency", "(0, 1]"),
    ("nics_per_node: 0", "nics_per_node", "whole number"),
    ("notes: {a: 1}", "notes", "list of strings"),
    ("base_gpu: Z100", "base_gpu", "unknown GPU"),
    ("SET:base: nowhere-cluster", "base", "no sampled profile"),
    ("SET:base: perlmutter-a100", "base", "not a sampled profile"),
]


def _variant(spec: str) -> str:
    lines = MINIMAL.splitlines()
    if spec.startswith("DROP:"):
        key = spec[5:]
        lines = [ln for ln in lines if not ln.startswith(key + ":")]
    elif spec.startswith("SET:"):
        key = spec[4:].split(":")[0]
        lines = [spec[4:] if ln.startswith(key + ":") else ln for ln in lines]
    else:
        lines.append(spec)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("spec, key, words", BAD)
def test_every_bad_key_or_value_is_one_line_naming_file_key_and_fix(tmp_path, spec, key, words):
    path = _write(tmp_path, _variant(spec), "bad.yml")
    with pytest.raises(ProfileError) as err:
        load_profile(str(path))
    line = err.value.line()
    assert "\n" not in line and str(path) in line and key in line and "(fix:" in line
    assert words in line, line


@pytest.mark.parametrize("text, words", [
    ("- just\n- a list\n", "YAML mapping"),
    ("name: [unclosed\n", "not valid YAML"),
    ("", "YAML mapping"),
    ("!!python/object/apply:os.system ['echo hi']\n", "not valid YAML"),
])
def test_a_file_that_is_not_a_description_is_one_line(tmp_path, text, words):
    path = _write(tmp_path, text, "odd.yaml")
    with pytest.raises(ProfileError) as err:
        load_profile(str(path))
    assert "\n" not in err.value.line() and str(path) in err.value.line() and words in err.value.line()


def test_a_base_whose_gpu_is_not_in_the_table_asks_for_base_gpu(tmp_path):
    base_dir = tmp_path / "odd-base"
    shutil.copytree(bundled_dir() / "vista-gh200", base_dir)
    manifest = json.loads((base_dir / "manifest.json").read_text())
    manifest["facts"]["gpu_name"] = "Some Future GPU"
    (base_dir / "manifest.json").write_text(json.dumps(manifest))
    text = MINIMAL.replace("base: perlmutter-a100-80gb", f"base: {base_dir}")
    with pytest.raises(ProfileError, match="base_gpu"):
        load_profile(str(_write(tmp_path, text)))
    p = load_profile(str(_write(tmp_path, text + "base_gpu: GH200-96GB\n", "fixed.yml")))
    assert p.base_gpu.name == "GH200-96GB"
