"""The manifest, typed (neox_perf/profile/manifest.py): every section parsed once into frozen
values, written back as it was read, and a malformed key one line naming the file, the key and
the fix."""
import copy
import json
import shutil
from dataclasses import FrozenInstanceError, replace

import pytest

from neox_perf.errors import ProfileError
from neox_perf.predictors import load_profile
from neox_perf.profile.directory import bundled_dir
from neox_perf.profile.disturbance import Disturbance
from neox_perf.profile.manifest import Manifest
from neox_perf.profile.models import ModelEntry
from neox_perf.profile.sections import ArraysRef, Calibration, Provenance, Training, Validation
from neox_perf.prediction.corrections import EngineSection, StepTerms, StepTermsSection

BUNDLED = ("perlmutter-a100-80gb", "vista-gh200")


def _bundled(name):
    path = bundled_dir() / name / "manifest.json"
    return path, path.read_text()


@pytest.mark.parametrize("name", BUNDLED)
def test_a_bundled_manifest_is_written_back_byte_for_byte(name):
    path, text = _bundled(name)
    m = Manifest.parse(json.loads(text), str(path))
    assert json.dumps(m.to_dict(), indent=1, allow_nan=False) + "\n" == text
    assert Manifest.parse(m.to_dict()) == m
    with pytest.raises(FrozenInstanceError):
        m.name = "other"
    # typed where the code reads it
    assert m.facts.gpu_name.startswith("NVIDIA") and m.arrays.file and m.arrays.trees > 0
    assert isinstance(m.step_terms.terms, StepTerms) and m.step_terms.interval.lo_ratio < 1
    entry = m.operators["linear1"]["fwd"]
    assert entry.baseline.coefficient("t0") == entry.baseline.coef[0] and entry.forest.trees > 0
    assert m.collectives["allreduce"].topologies and m.calibration is None and m.engine is None


# One of each section as the writers write them (a calibrated profile's, refitted from a run).
SECTIONS = [
    (Provenance.parse, {"source": "neox-perf calibrate on cpu (CPU)", "license": "n/a (own measurements)",
                        "store": "/s.sqlite", "samples": "all", "device_id": 1,
                        "fingerprint": {"kind": "cpu", "torch_threads": 1},
                        "runs": [{"id": 1, "plan": "quick", "started": 1.0, "finished": 2.0}],
                        "files": [{"file": "/s.sqlite", "kind": "store", "sha256": "ab", "rows": 3}],
                        "from_runs": [{"run_dir": "/r", "added": 4, "time": 3.0,
                                       "iteration_error": {"before": 0.5, "after": None}}]}),
    (Provenance.parse, {"source": "s", "license": "MIT", "recalibrated": {"from_profile": "x", "factors": {}}}),
    (Calibration.parse, {"dtype": "fp32", "device": "cpu", "threads": None, "processes": 2}),
    (Training.parse, {"library_versions": {"numpy": "2.0"}, "validation": "80/20",
                      "grid": [["random_forest", {"n_estimators": 32}], ["xgboost", {"max_depth": 4}]],
                      "seconds": None}),
    (ArraysRef.parse, {"file": "a.npz", "sha256": None, "models": 3, "nodes": 100, "trees": 9}),
    (Validation.parse, {"runs": [{"config": "/a.yml", "measured": 1.0, "predicted": 1.1,
                                  "extrapolated_share": 0.0}],
                        "interval": {"lo_ratio": 0.9, "hi_ratio": 1.2, "widen_per_extrapolated": 0.5}}),
    (StepTermsSection.parse, {"terms": StepTerms(dispatch_s=1e-5).to_dict(),
                              "interval": {"lo_ratio": 0.9, "hi_ratio": 1.1, "widen_per_extrapolated": 0.0},
                              "fitted_on": "runs", "fitted_gpu": "A100", "other_gpu_widen": 0.1,
                              "assumptions": "fp16", "cross_validation": {"by_layout": {"mape": 5.0}},
                              "command": "python benchmarks/endtoend.py"}),
    (EngineSection.parse, {"precision": "fp32", "source": "/e.json", "shapes": ["a"],
                           "layer_forward": {"seconds": 1e-3, "per_unit": 0.5, "feature": "operators",
                                             "rows": 3, "ratios": [[0.1, 1.5], [0.2, 1.1]]},
                           "optimizer_step": {"coef": {"t0": 1e-3, "per_param": 1e-9}, "rows": 3},
                           "dp_allreduce": {"points": [[1e6, 1e-3]], "processes": 2}}),
    (Disturbance.parse, {"flagged": True, "warning": "calibration disturbed: 3 of 9 ...", "samples": 9,
                         "disturbed": 3, "max_slowdown": 1.1,
                         "runs": [{"run": 1, "baseline": {"work": 0.01, "noise": 0.01, "threshold": 0.02},
                                   "points": {"flagged": 3, "retimed": 0, "still_flagged": 3}}]}),
    (lambda d: ModelEntry.parse(d, "operators.linear1.fwd"), {
        "features": ["m", "k", "n"], "rows": 40, "ranges": {"m": [8.0, 64.0], "k": [16.0, 16.0], "n": [24.0, 48.0]},
        "grid": {"m": [8.0, 64.0], "k": [16.0]}, "tree_features": ["m", "n"], "model": "xgboost",
        "forest": {"arrays": "m0", "nodes": 31, "trees": 4, "depth": 3, "combine": "sum", "base": 0.5},
        "baseline": {"form": "t0 + ...", "terms": ["t0", "sec_per_flop", "sec_per_byte"], "coef": [1e-6, 1e-12, 0.0],
                     "achieved_gbps": None},
        "efficiency": {"form": "c + ...", "intercept": 0.1, "terms": {"m": [0.2, 64.0]}}}),
    (lambda d: ModelEntry.parse(d, "collectives.p2p"), {
        "features": ["elements", "nodes", "gpus_per_node"], "rows": 6,
        "ranges": {"elements": [64.0, 4096.0], "nodes": [1.0, 1.0], "gpus_per_node": [2.0, 2.0]},
        "tree_features": ["elements"], "model": "baseline",
        "baseline": {"terms": ["alpha_intra"], "coef": [1e-5], "intra_peer_link_gbps": None},
        "topologies": {"1x2": {"nodes": 1, "gpus_per_node": 2, "rows": 6, "elements": [64.0, 4096.0]}}}),
    (lambda d: ModelEntry.parse(d, "operators.res_add.bwd"), {
        "derived": {"from_phase": "fwd", "scale": "same", "reason": "a copy of the forward"}}),
]


@pytest.mark.parametrize("parse, data", SECTIONS)
def test_each_section_is_written_back_as_it_was_read(parse, data):
    section = parse(copy.deepcopy(data))
    assert section.to_dict() == data
    assert parse(section.to_dict()) == section


def test_typed_fields_read_what_the_code_reads():
    prov = SECTIONS[0][0](SECTIONS[0][1])
    assert prov.store == "/s.sqlite" and prov.device_id == 1 and prov.from_runs[0]["added"] == 4
    assert prov.extra["samples"] == "all"
    val = Validation.parse(SECTIONS[5][1])
    assert val.runs[0].predicted == 1.1 and val.interval.widen_per_extrapolated == 0.5
    p2p = ModelEntry.parse(SECTIONS[-2][1], "p2p")
    assert p2p.topologies["1x2"].elements == (64.0, 4096.0) and p2p.baseline.intra_peer_link_gbps is None
    assert ModelEntry.parse(SECTIONS[-1][1], "x").derived.from_phase == "fwd"
    # a section changed is a new value; a field set to None is left out when written
    section = StepTermsSection.parse(SECTIONS[6][1])
    assert "cross_validation" not in replace(section, cross_validation=None).to_dict()
    assert "interval" not in Validation(runs=val.runs).to_dict()
    dist = Disturbance.parse(SECTIONS[8][1])
    assert dist.flagged and dist.disturbed == 3 and dist.extra["runs"][0]["run"] == 1
    assert Disturbance().to_dict() == {"flagged": False}  # a quiet calibration's, without counts


def test_a_calibrated_manifest_round_trips_with_every_section():
    _, text = _bundled("perlmutter-a100-80gb")
    data = json.loads(text)
    del data["step_terms"]
    # as `neox-perf calibrate` and `validate` write them, in their order
    data = {**{k: v for k, v in data.items() if k in ("schema", "schema_version", "name")},
            "facts": {**data["facts"], "samples_from": ""}, "notes": data["notes"],
            "provenance": SECTIONS[0][1], "calibration": SECTIONS[2][1], "training": data["training"],
            "arrays": data["arrays"], "operators": data["operators"], "collectives": data["collectives"],
            "extrapolation": "efficiency-curve", "engine": SECTIONS[7][1], "step_terms": SECTIONS[6][1],
            "validation": SECTIONS[5][1], "disturbance": SECTIONS[8][1],
            "from_a_newer_version": {"kept": True}}
    m = Manifest.parse(copy.deepcopy(data))
    assert m.to_dict() == data and list(m.to_dict()) == list(data)
    assert m.extra == {"from_a_newer_version": {"kept": True}} and m.facts.samples_from == ""
    assert m.model("allreduce", "comm") is m.collectives["allreduce"]
    assert m.model("linear1", "fwd") is m.operators["linear1"]["fwd"] and m.model("nope", "fwd") is None


def _edit(data, keys, value):
    node = data
    for k in keys[:-1]:
        node = node[k]
    if value is KeyError:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value


BAD = [
    (("facts", "gpus_per_node"), KeyError, "facts"),
    (("notes",), "one note", "notes"),
    (("operators", "linear1", "fwd", "ranges"), KeyError, "operators.linear1.fwd"),
    (("operators", "linear1", "fwd", "tree_features"), ["m", "nope"], "operators.linear1.fwd"),
    (("operators", "linear1", "fwd", "forest", "trees"), "many", "operators.linear1.fwd.forest"),
    (("collectives", "allreduce", "topologies", "1x2", "nodes"), "one", "collectives.allreduce.topologies"),
    (("collectives", "p2p", "baseline"), [1, 2], "collectives.p2p.baseline"),
    (("provenance", "license"), 3, "provenance.license"),
    (("training", "grid"), 5, "training.grid"),
    (("arrays", "models"), "x", "arrays.models"),
    (("step_terms", "terms", "dispatch_s"), -1.0, "step_terms.terms"),
    (("step_terms", "interval", "lo_ratio"), 2.0, "step_terms.interval"),
    (("step_terms", "fitted_gpu"), ["A100"], "step_terms.fitted_gpu"),
    (("step_terms", "unseen_terms"), {"dispatch_s": -1e-5}, "step_terms.unseen_terms.dispatch_s"),
    (("step_terms", "unseen_terms"), {"launch_s": 1e-5}, "step_terms.unseen_terms"),
    (("step_terms", "unseen_terms"), [1e-5], "step_terms.unseen_terms"),
    (("engine",), {"optimizer_step": {"coef": {"t0": "fast"}}}, "engine.optimizer_step"),
    (("validation",), {"runs": [{"config": "/a.yml", "measured": 1.0}]}, "validation.runs[0]"),
    (("calibration",), {"dtype": "fp32", "threads": "many"}, "calibration.threads"),
    (("facts", "tf32"), "yes", "facts"),
    (("disturbance",), {"flagged": "yes"}, "disturbance.flagged"),
    (("disturbance",), {"flagged": True, "disturbed": "some"}, "disturbance.disturbed"),
]


@pytest.mark.parametrize("keys, value, where", BAD, ids=[w for *_, w in BAD])
def test_a_malformed_key_is_one_line_naming_the_file_and_the_key(tmp_path, keys, value, where):
    d = tmp_path / "p"
    shutil.copytree(bundled_dir() / "perlmutter-a100-80gb", d)
    data = json.loads((d / "manifest.json").read_text())
    _edit(data, keys, value)
    (d / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ProfileError) as err:
        load_profile(d)
    line = err.value.line()
    assert "\n" not in line and f"{d / 'manifest.json'}: {where}" in line and "(fix: " in line, line


@pytest.mark.parametrize("tf32", [True, False])
def test_facts_tf32_is_written_where_known_and_absent_where_not(tf32):
    """`calibrate` on a GPU records whether its fp32 matmuls ran as TF32 (facts.tf32); a
    manifest without the key (the bundled ones, a CPU calibration) reads None and writes none."""
    from neox_perf.predictors.fitting.store_samples import measured_facts
    path, text = _bundled("vista-gh200")
    data = json.loads(text)
    assert "tf32" not in data["facts"] and Manifest.parse(data).facts.tf32 is None
    data["facts"]["tf32"] = tf32
    m = Manifest.parse(data)
    assert m.facts.tf32 is tf32 and m.to_dict()["facts"]["tf32"] is tf32
    gpu, _ = measured_facts("g", {"kind": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "tf32": tf32}, {}, 1)
    cpu, _ = measured_facts("c", {"kind": "cpu", "device_name": "a CPU", "tf32": tf32}, {}, 1)
    assert gpu.tf32 is tf32 and cpu.tf32 is None and "tf32" not in cpu.to_dict()
