"""Bundled cluster descriptions by name from any directory, and a GPU given by its data sheet
(issue 32, sections 1 and 2)."""
import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from neox_perf import exitcodes
from neox_perf.cli import main
from neox_perf.predictors import ProfileError, gpus, list_profiles, load_profile
from neox_perf.predictors.cluster_file import bundled_descriptions
from neox_perf.profile.directory import bundled_descriptions_dir
from neox_perf.prediction.corrections import of_profile

EXAMPLES = Path(__file__).resolve().parents[2] / "neox_perf" / "examples"
NEW = ("perlmutter-ss11", "hgx-h100", "gh200-ndr")
V100 = {"name": "V100-SXM2-32GB", "memory_GiB": 32, "hbm_GBps": 900, "fp16_tflops": 125,
        "fp32_tflops": 15.7, "sms": 80, "mhz": 1530}


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _description(tmp_path, gpu, name="v100-nodes"):
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump({"name": name, "base": "perlmutter-a100-80gb", "gpu": gpu,
                                    "gpus_per_node": 8, "intra_node_GBps": 150,
                                    "intra_node_topology": "pointtopoint", "inter_node_Gbps": 400,
                                    "nics_per_node": 4}))
    return path


# ---- named descriptions ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ("dgx-a100", "dgx-h100") + NEW)
def test_a_bundled_description_loads_by_name_from_any_directory(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    profile = load_profile(name)
    assert profile.name == name  # the file's stem is its name
    code, out, err = _run(["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "64", "--cluster", name,
                           "--json"])
    assert code in (exitcodes.OK, exitcodes.VERDICT_FAILED), err
    assert json.loads(out)["cluster"]["name"] == name


def test_every_bundled_description_sources_its_lines_and_is_listed():
    files = bundled_descriptions()
    assert {f.stem for f in files} >= {"dgx-a100", "dgx-h100", *NEW}
    listed = {p.name: p for p in list_profiles()}
    for f in files:
        assert f.parent == bundled_descriptions_dir()
        text = f.read_text()
        header = text[:text.index("\nname:")].lower()
        assert text.startswith("#") and any(s in header for s in ("data sheet", "user guide", "nersc")), f
        assert listed[f.stem].description


def test_perlmutter_ss11_is_todays_node_and_the_bundled_profile_is_unchanged():
    ss11, old = load_profile("perlmutter-ss11"), load_profile("perlmutter-a100")
    assert ss11.gpu.name == old.gpu.name == "A100-SXM4-40GB"
    assert (ss11.description.inter_node_Gbps, ss11.description.nics_per_node) == (800, 4)
    assert (old.description.inter_node_Gbps, old.description.inter_node_link) == (200, "Slingshot-10")


def test_clusters_lists_the_bundled_descriptions_beside_the_profiles():
    code, out, _ = _run(["clusters", "--json"])
    assert code == exitcodes.OK
    rows = {p["name"]: p for p in json.loads(out)["profiles"]}
    assert rows["perlmutter-a100-80gb"]["kind"] == "sampled"
    for name in ("dgx-a100", "dgx-h100", *NEW):
        assert rows[name]["kind"] == "description"


def test_a_near_miss_names_the_bundled_description(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "64", "--cluster", "dgx-a10"])
    assert code == exitcodes.USAGE and "did you mean dgx-a100?" in err and len(err.strip().splitlines()) == 1


# ---- any GPU from its data sheet --------------------------------------------------------------

def test_the_v100_rows_are_sourced_and_have_no_bf16():
    for name, gib in (("V100-SXM2-16GB", 16), ("V100-SXM2-32GB", 32)):
        g = gpus.gpu(name)
        assert (g.memory_gib, g.hbm_gbps, g.fp16_tflops, g.fp32_tflops, g.sms, g.boost_mhz) == \
            (gib, 900, 125, 15.7, 80, 1530)
        assert "V100" in g.source and g.peak_tflops("bf16") is None and g.achievable("bf16") is None
        rate = g.achievable("fp16")
        assert not rate.measured and "derived" in rate.source and rate.tflops < g.fp16_tflops


def test_derived_rates_follow_the_tables_measured_rows():
    g = gpus.gpu("V100-SXM2-32GB")
    fractions = sorted(r.tflops / p for r, p in (
        (gpus.ACHIEVABLE[n][k], gpus.gpu(n).peak_tflops(k)) for n in gpus.ACHIEVABLE for k in ("fp16", "bf16")
        if gpus.gpu(n).vendor == "NVIDIA" and k in gpus.ACHIEVABLE[n] and gpus.ACHIEVABLE[n][k].measured))
    assert len(fractions) >= 5
    lo, hi = fractions[0], fractions[-1]
    assert lo * 125 <= g.achievable("fp16").tflops <= hi * 125


@pytest.mark.parametrize("gpu", [V100, "V100-SXM2-32GB", {**V100, "name": "Tesla-V100-ours"}],
                         ids=["mapping", "table", "mapping-new-name"])
def test_a_v100_predicts_with_the_another_gpu_interval(tmp_path, gpu):
    path = _description(tmp_path, gpu)
    profile = load_profile(str(path))
    assert profile.gpu.fp16_tflops == 125 and not profile.same_gpu
    base_terms, base_iv = of_profile(profile.base)
    _, iv = of_profile(profile)
    widen = profile.base.manifest.step_terms.other_gpu_widen
    assert widen and iv.across_nodes.hi_ratio == pytest.approx(base_iv.across_nodes.hi_ratio * (1 + widen))
    code, out, err = _run(["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "64", "--cluster", str(path),
                           "--json"])
    assert code == exitcodes.OK, err
    pred = json.loads(out)["prediction"]
    lo, hi = pred["interval_seconds"]
    assert lo < pred["iteration_seconds"] < hi
    assert (hi / pred["iteration_seconds"]) == pytest.approx(iv.across_nodes.hi_ratio, rel=0.05)
    if isinstance(gpu, dict):
        assert any("derived from its data sheet" in n for n in profile.manifest.notes)


def test_a_v100_mapping_with_measured_rates_uses_them(tmp_path):
    path = _description(tmp_path, {**V100, "achievable_tflops": {"fp16": 110}})
    g = load_profile(str(path)).gpu
    assert g.achievable("fp16").tflops == 110 and g.achievable("fp16").measured
    assert not g.achievable("fp32").measured


def test_a_bf16_run_on_a_v100_is_one_line(tmp_path):
    cfg = yaml.safe_load((EXAMPLES / "gpt-20b.yml").read_text())
    cfg.pop("fp16")
    cfg.update({"precision": "bfloat16", "bf16": {"enabled": True}})
    (tmp_path / "m.yml").write_text(yaml.safe_dump(cfg))
    for gpu in (V100, "V100-SXM2-16GB"):
        path = _description(tmp_path, gpu)
        code, out, err = _run(["check", str(tmp_path / "m.yml"), "--gpus", "64", "--cluster", str(path)])
        lines = err.strip().splitlines()
        assert code != exitcodes.OK and len(lines) == 1 and "no bf16" in lines[0] and "fp16" in lines[0], err


@pytest.mark.parametrize("gpu,words", [
    ({k: v for k, v in V100.items() if k != "hbm_GBps"}, ["gpu.hbm_GBps", "missing"]),
    ({**V100, "hbm_GBs": 900}, ["gpu.hbm_GBs", "did you mean hbm_GBps"]),
    ({**V100, "fp16_tflops": "125"}, ["gpu.fp16_tflops", "positive number"]),
    ({**V100, "achievable_tflops": {"fp16": 200}}, ["achievable_tflops.fp16", "above the data sheet"]),
    ({**V100, "hbm_GBps": 0.9}, ["gpu.hbm_GBps", "did you write TB/s?"]),
])
def test_a_bad_data_sheet_mapping_is_one_line(tmp_path, gpu, words):
    with pytest.raises(ProfileError) as info:
        load_profile(str(_description(tmp_path, gpu)))
    line = info.value.line()
    assert "\n" not in line and all(w in line for w in words), line


def test_a_bundled_description_path_typed_elsewhere_names_the_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "64", "--cluster",
                         "neox_perf/examples/clusters/dgx-a100.yml"])
    assert code == exitcodes.USAGE and "fix: --cluster dgx-a100" in err and len(err.strip().splitlines()) == 1


def test_plan_says_a_bf16_run_on_a_v100_in_one_line_too(tmp_path):
    """The planner refuses what no layout can compute before it searches (it prices only the
    layouts that fit, so it would otherwise answer "no layout")."""
    cfg = yaml.safe_load((EXAMPLES / "gpt-20b.yml").read_text())
    cfg.pop("fp16")
    cfg.update({"precision": "bfloat16", "bf16": {"enabled": True}})
    (tmp_path / "m.yml").write_text(yaml.safe_dump(cfg))
    path = _description(tmp_path, "V100-SXM2-16GB")
    code, out, err = _run(["plan", str(tmp_path / "m.yml"), "--gpus", "64", "--cluster", str(path)])
    lines = err.strip().splitlines()
    assert code != exitcodes.OK and len(lines) == 1 and "no bf16" in lines[0] and "fp16" in lines[0], err
