"""The small-message end of collective predictions: NCCL's latency, not an unidentified alpha."""
import csv
from pathlib import Path

import numpy as np
import pytest

from neox_perf.prediction import opspec
from neox_perf.predictors import baseline, load_profile

REPO = Path(__file__).resolve().parents[2]
DGX = REPO / "neox_perf" / "examples" / "clusters" / "dgx-a100.yml"
LUT = REPO.parent / "shared" / "data" / "vtrain-a100" / "nccl-allreduce"
PROFILES = ("perlmutter-a100-80gb", "vista-gh200", str(DGX))


def _topologies(p):
    g = p.facts.gpus_per_node
    out = {(1, 2), (1, g), (2, 1), (2, g), (4, 1), (16, g)}
    return sorted(t for t in out if t[1] <= g and t[0] * t[1] > 1)


def _sampled_min(p, kind, nodes, gpn):
    """The smallest sample of that kind and topology in the profile (a description's base)."""
    base = p.base or p
    gpn = min(gpn, base.facts.gpus_per_node)
    if kind == "p2p":
        nodes, gpn = (2, 1) if nodes > 1 else (1, 2)
    entry = base.manifest.to_dict()["collectives"][kind]
    for t in entry["topologies"].values():
        if (t["nodes"], t["gpus_per_node"]) == (nodes, gpn):
            return t["elements"][0]
    return entry["ranges"]["elements"][0]


@pytest.mark.parametrize("name", PROFILES)
def test_below_the_samples_time_grows_with_size_and_meets_the_samples(name):
    p = load_profile(name)
    for kind in p.collectives():
        for nodes, gpn in _topologies(p):
            if gpn > 1 and kind != "p2p" and nodes == 1 and (p.base or p).facts.gpus_per_node == 1:
                continue  # a one-GPU base has no intra-node samples to meet
            lo = _sampled_min(p, kind, nodes, gpn)
            e = np.geomspace(1.0, lo, 60)
            t = np.array([p.predict_collective(kind, x, nodes, gpn).seconds for x in e])
            assert np.all(np.diff(t) > 0), (name, kind, nodes, gpn)
            # no jump where the samples begin
            just_below = p.predict_collective(kind, lo * (1 - 1e-7), nodes, gpn).seconds
            at = p.predict_collective(kind, lo, nodes, gpn).seconds
            assert just_below == pytest.approx(at, rel=1e-5), (name, kind, nodes, gpn)


@pytest.mark.parametrize("name", PROFILES)
def test_the_latency_floor_is_positive_and_physical(name):
    p = load_profile(name)
    for kind in p.collectives():
        for nodes, gpn in _topologies(p):
            floor = baseline.collective_latency(kind, nodes, gpn)
            tiny = p.predict_collective(kind, 1.0, nodes, gpn)
            assert floor > 0
            assert floor <= tiny.seconds < floor * 1.05, (name, kind, nodes, gpn)
            assert tiny.extrapolated
            # NCCL launches in a few us; no ring of <= 64 ranks needs a millisecond to start
            assert 5e-6 < floor < 1e-3
    # more ranks, more steps; a p2p is a single step
    assert (baseline.collective_latency("allreduce", 1, 2) < baseline.collective_latency("allreduce", 1, 4)
            < baseline.collective_latency("allreduce", 1, 8))
    assert baseline.collective_latency("allgather", 1, 8) < baseline.collective_latency("allreduce", 1, 8)
    assert baseline.collective_latency("p2p", 1, 2) < baseline.collective_latency("p2p", 2, 1)


def test_the_latency_agrees_with_the_one_fixed_cost_the_samples_do_identify():
    # Perlmutter's intra-node p2p samples start at 4 MB (~50 us on the wire), low enough to
    # pin the fixed cost; it was fitted without our latency model and lands near NCCL's.
    base = load_profile("perlmutter-a100-80gb")
    coef = dict(zip(base.manifest.to_dict()["collectives"]["p2p"]["baseline"]["terms"],
                    base.manifest.to_dict()["collectives"]["p2p"]["baseline"]["coef"]))
    floor = baseline.collective_latency("p2p", 1, 2)
    assert 0.5 < coef["alpha_intra"] / floor < 2.0


def test_small_all_reduces_no_longer_carry_the_unidentified_alpha():
    base = load_profile("perlmutter-a100-80gb")
    alpha = dict(zip(base.manifest.to_dict()["collectives"]["allreduce"]["baseline"]["terms"],
                     base.manifest.to_dict()["collectives"]["allreduce"]["baseline"]["coef"]))["alpha_intra"]
    assert alpha > 50e-6  # what the fit on >= 42 MB samples made of it
    dgx = load_profile(str(DGX))
    for p in (base, dgx):
        for gpn in (2, 4):
            one_mb = p.predict_collective("allreduce", 2 ** 19, 1, gpn).seconds
            assert baseline.collective_latency("allreduce", 1, gpn) < one_mb < alpha, (p.name, gpn)
    assert "tuning.cc" in dgx.manifest.transfer["collectives"]["latency"]


def _lut(n):
    with open(LUT / f"AR_GPU{n}_1M_1024M_LUT", newline="") as fh:
        reader = csv.reader(fh)
        next(reader)
        rows = [(float(r[0]), float(r[3]) * 1e-9) for r in reader if r]
    return np.array([r[0] for r in rows]), np.array([r[1] for r in rows])


@pytest.mark.skipif(not LUT.is_dir(), reason="../shared/data/vtrain-a100 not present")
def test_held_out_nccl_tests_all_reduce_on_a_dgx_a100():
    # Bounds measured with benchmarks/collectives_vtrain.py after the change (figures in the
    # module's report): nothing was fitted on these files.
    p = load_profile(str(DGX))
    mb = 1 << 20
    by_band = {"small": [], "mid": [], "large": []}
    for n in range(2, 9):
        size, meas = _lut(n)
        pred = np.array([p.predict_collective("allreduce", b / 2, 1, n).seconds for b in size])
        ratio = pred / meas
        assert np.mean(np.abs(ratio - 1)) < 0.12, n
        small = size < 8 * mb
        # the over-prediction of small all-reduces (x1.8-2.1 on 2 GPUs before) is gone and the
        # latency floor does not overshoot either way by more than a factor ~2
        assert 0.4 < np.min(ratio[small]) and np.max(ratio[small]) < 1.2, n
        by_band["small"] += list(ratio[small])
        by_band["mid"] += list(ratio[(size >= 8 * mb) & (size < 64 * mb)])
        by_band["large"] += list(ratio[size >= 64 * mb])
    mape = {k: float(np.mean(np.abs(np.array(v) - 1))) for k, v in by_band.items()}
    assert mape["small"] < 0.25 and mape["mid"] < 0.09 and mape["large"] < 0.05, mape
