"""Training end to end on a small synthetic cluster (tiny grid): profile written, loadable, sane."""
import json

import numpy as np
import pytest

from neox_perf.predictors import load_profile
from neox_perf.predictors.fitting import fit, train
from neox_perf.predictors.fitting.known_clusters import KnownCluster

import predictors_synthetic as syn
from test_predictors_samples import FACTS


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("samples")
    syn.write_cluster(root / "fake")

    def flash_defect(cols, times):
        times[1][:] = 0.1 * times[0]

    syn.write_operator(root / "fake", "flash_atten", seed=7, mutate=flash_defect)
    known = KnownCluster(FACTS, "fake", syn.GPU, ("synthetic test cluster",))
    out = tmp_path_factory.mktemp("profiles")
    manifest, table = train.train_cluster(root, known, out, grid=fit.QUICK_GRID, log=lambda *a: None)
    return out / "fake", manifest, table


def test_profile_is_written_and_loads(trained):
    path, manifest, _ = trained
    profile = load_profile(path)
    assert profile.facts == FACTS
    assert json.loads((path / "manifest.json").read_text())["arrays"]["sha256"]
    assert set(manifest["collectives"]) == {"allreduce", "allgather", "p2p"}
    assert manifest["operators"]["flash_attention"]["bwd"]["derived"]["scale"] == "flop_ratio"


def test_predictions_follow_the_synthetic_truth(trained):
    path, _, _ = trained
    profile = load_profile(path)
    feats = {"m": 4096.0, "k": 3072.0, "n": 4608.0}
    truth = syn.roofline_us("linear1", "fwd", {k: np.array(v) for k, v in feats.items()}) * 1e-6
    pred = profile.predict("linear1", "fwd", feats)
    assert pred.seconds == pytest.approx(float(truth), rel=0.1)
    assert not pred.extrapolated
    # the truth is a roofline: beyond the samples the baseline keeps tracking it
    big = {"m": 4 * 12288.0, "k": 8192.0, "n": 24576.0}
    truth = syn.roofline_us("linear1", "fwd", {k: np.array(v) for k, v in big.items()}) * 1e-6
    pred = profile.predict("linear1", "fwd", big)
    assert pred.extrapolated and pred.seconds == pytest.approx(float(truth), rel=0.15)


def test_collectives_alpha_beta_recovers_link_speeds(trained):
    path, manifest, _ = trained
    base = manifest["collectives"]["allreduce"]["baseline"]
    assert base["intra_peer_link_gbps"] == pytest.approx(50, rel=0.1)
    assert base["inter_per_nic_gbps"] == pytest.approx(5, rel=0.1)
    profile = load_profile(path)
    pred = profile.predict_collective("allreduce", 1e8, 16, 4)
    wire = 2 * 63 / 64 * 2e8
    assert pred.extrapolated and pred.seconds == pytest.approx(wire / (4 * 5e9), rel=0.15)


def test_every_file_has_provenance(trained):
    _, manifest, _ = trained
    for f in manifest["provenance"]["files"]:
        assert len(f["sha256"]) == 64
        assert "skipped" in f or f["kept"]


def test_table_prints(trained, capsys):
    _, _, table = trained
    from neox_perf.render.fit_table import print_fit_table
    print_fit_table("fake", table)
    out = capsys.readouterr().out
    assert "baseline+trees" in out and "linear1" in out


def test_cli_reports_missing_samples(tmp_path, capsys):
    assert train.main(["--samples", str(tmp_path / "nowhere"), "--out", str(tmp_path)]) == 2
    assert "not found" in capsys.readouterr().err


def test_coverage_says_sampled_interpolated_or_how_far_out(trained):
    path, manifest, _ = trained
    profile = load_profile(path)
    entry = manifest["operators"]["linear1"]["fwd"]
    grid, (lo, hi) = entry["grid"], entry["ranges"]["m"]
    assert set(grid) == {"m", "k", "n"} and all(len(v) <= train.GRID_MAX for v in grid.values())
    at = {f: grid[f][len(grid[f]) // 2] for f in ("m", "k", "n")}
    assert profile.coverage("linear1", "fwd", at).state == "sampled"
    between = dict(at, m=(grid["m"][0] * grid["m"][1]) ** 0.5)  # strictly between two sampled m
    assert profile.coverage("linear1", "fwd", between).state == "interpolated"
    out = profile.coverage("linear1", "fwd", dict(at, m=4 * hi))
    assert out.state == "extrapolated" and out.factor == pytest.approx(4.0)
    assert out.detail == f"m={4 * hi:g} vs the sampled maximum {hi:g}"
    below = profile.coverage("linear1", "fwd", dict(at, m=lo / 2, n=grid["n"][-1] * 3))
    assert below.factor == pytest.approx(3.0) and below.detail.startswith("n=")  # the furthest
    # a phase derived from another answers with its source's samples
    fa = manifest["operators"]["flash_attention"]["fwd"]
    q = {f: fa["grid"][f][0] if f in fa["grid"] else fa["ranges"][f][0] for f in fa["features"]}
    assert profile.coverage("flash_attention", "bwd", q) == profile.coverage("flash_attention", "fwd", q)
