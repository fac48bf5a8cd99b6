"""A calibrated profile's interval from its own validation runs (neox_perf/profile_validation)."""
import json
from types import SimpleNamespace

import pytest

from neox_perf.profile.facts import ClusterFacts, Link
from neox_perf.profile.manifest import Manifest
from neox_perf.profile.sections import Validation
from neox_perf.profile_validation import MIN_RUNS, record
from neox_perf.prediction.corrections import ACROSS_NODES, INSIDE_NODE, REGIMES, StepTermsSection, of_profile

FACTS = ClusterFacts("local", "cpu", 2**30, 2, Link("shared memory", 1.0, 1), Link("none", 1.0, 1), 0.1, 10.0)


def _profile(tmp_path, step_terms=None):
    """A calibrated profile's directory with a manifest (no models) and the profile read from it."""
    d = tmp_path / "local"
    d.mkdir()
    m = Manifest("local", FACTS, step_terms=step_terms and StepTermsSection.parse(step_terms))
    (d / "manifest.json").write_text(json.dumps(m.to_dict()))
    return SimpleNamespace(path=d, manifest=m, facts=SimpleNamespace(gpu_name="cpu"))


def test_the_interval_comes_from_enough_validated_configs(tmp_path):
    prof = _profile(tmp_path)
    ratios = [0.9, 0.95, 1.0, 1.02, 1.05, 1.1, 1.2]
    for i, r in enumerate(ratios[:MIN_RUNS - 1]):
        note = record(prof, [f"c{i}.yml"], measured=r, predicted=1.0, extrapolated_share=0.0)
        assert f"an interval needs {MIN_RUNS}" in note
        assert of_profile(prof)[1] is None
    for i, r in enumerate(ratios[MIN_RUNS - 1:], MIN_RUNS - 1):
        note = record(prof, [f"c{i}.yml"], measured=r, predicted=1.0, extrapolated_share=0.0)
    assert "80% interval is now" in note
    on_disk = json.loads((prof.path / "manifest.json").read_text())["validation"]
    assert len(on_disk["runs"]) == len(ratios)
    _, intervals = of_profile(SimpleNamespace(manifest=Manifest("local", validation=Validation.parse(on_disk)),
                                              facts=None))
    # measured on the profile's own machine: one interval, whatever the regime
    assert len({intervals.of(r) for r in REGIMES}) == 1
    interval = intervals.of(INSIDE_NODE)
    assert interval.lo_ratio < 1.0 < interval.hi_ratio
    assert min(ratios) <= interval.lo_ratio and interval.hi_ratio <= max(ratios)
    # the same config validated again replaces its run, it does not add one
    record(prof, ["c0.yml"], measured=1.5, predicted=1.0, extrapolated_share=0.0)
    runs = json.loads((prof.path / "manifest.json").read_text())["validation"]["runs"]
    assert len(runs) == len(ratios) and max(r["measured"] for r in runs) == 1.5


def test_own_interval_comes_before_the_development_sets(tmp_path):
    dev = {"terms": {"dispatch_s": 1e-5}, "interval": {"lo_ratio": 0.5, "hi_ratio": 2.0},
           "fitted_gpu": "A100"}
    prof = _profile(tmp_path, step_terms=dev)
    assert of_profile(prof)[1].of(INSIDE_NODE).hi_ratio == 2.0
    for i in range(MIN_RUNS):
        record(prof, [f"c{i}.yml"], measured=1.0 + 0.01 * i, predicted=1.0, extrapolated_share=0.0)
    terms, intervals = of_profile(prof)
    assert terms.dispatch_s == 1e-5 and intervals.of(ACROSS_NODES).hi_ratio < 1.1


def test_bundled_profiles_and_bad_numbers_are_not_written(tmp_path):
    from neox_perf.profile.directory import bundled_dir
    bundled = SimpleNamespace(path=bundled_dir() / "vista-gh200", manifest=Manifest("vista-gh200"))
    before = (bundled.path / "manifest.json").read_bytes()
    assert record(bundled, ["c.yml"], 1.0, 1.0, 0.0) is None
    assert (bundled.path / "manifest.json").read_bytes() == before
    prof = _profile(tmp_path)
    assert record(prof, ["c.yml"], 0.0, 1.0, 0.0) is None


def test_a_failed_write_keeps_the_old_manifest(tmp_path, monkeypatch):
    prof = _profile(tmp_path)
    record(prof, ["a.yml"], 1.0, 1.0, 0.0)
    before = (prof.path / "manifest.json").read_text()
    with pytest.raises(ValueError):
        record(prof, ["b.yml"], 1.0, 1.0, float("nan"))  # json refuses NaN mid-write
    assert (prof.path / "manifest.json").read_text() == before
    assert [p.name for p in prof.path.iterdir()] == ["manifest.json"]
