"""The `prediction` object of `check --json` with a cluster: keys pinned, interval sane."""
import json
from pathlib import Path

import pytest

from neox_perf.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "neox_perf" / "examples"

PREDICTION_KEYS = {
    "profile", "iteration_seconds", "interval_seconds", "eq7_seconds", "breakdown",
    "tokens_per_second", "stages", "operators", "extrapolated_share", "step_terms", "extrapolated",
    "coverage", "notes", "tflops_per_gpu", "mfu", "run_seconds", "run_gpu_hours", "run_hours_interval",
    "run_gpu_hours_interval",
    # added in v1 (new keys keep the version): NeoX's own log units, the Slurm --time of the run
    "neox_log", "slurm_time", "regime", "inter_node_share",
    # where each collective's price came from (sampled / link model / engine runs)
    "collective_sources",
    # per step term the profile's runs could not see, the iteration at its two ends (empty: none)
    "unseen_terms",
}


def _check(capsys, *argv):
    code = main(["check", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("cluster", ["perlmutter-a100", "perlmutter-a100-80gb", "vista-gh200",
                                     str(EXAMPLES / "clusters" / "dgx-a100.yml")])
def test_prediction_keys_and_interval(capsys, cluster):
    code, data = _check(capsys, str(EXAMPLES / "llemma-7b.yml"), "--gpus", "16", "--cluster", cluster)
    assert code in (0, 3), data
    pred = data["prediction"]
    assert set(pred) - {"fp32_matmuls"} == PREDICTION_KEYS  # fp32 runs on a GPU add fp32_matmuls
    assert pred["collective_sources"] and set(pred["collective_sources"].values()) <= {
        "sampled", "link model", "engine runs"}
    lo, hi = pred["interval_seconds"]
    assert lo < pred["iteration_seconds"] < hi
    hours_lo, hours_hi = pred["run_hours_interval"]
    assert hours_lo < pred["run_seconds"] / 3600 < hours_hi
    assert pred["step_terms"]["applied"] is True
    assert 0.0 <= pred["extrapolated_share"] <= 1.0
    # 16 GPUs span nodes on every one of these clusters: the interval is the across-nodes one
    # (one NIC per GPU on Vista's single-GPU nodes), and some of the step crosses nodes
    assert pred["regime"] == ("one NIC per GPU" if cluster == "vista-gh200" else "across nodes")
    assert 0.0 < pred["inter_node_share"] <= 1.0
    # every operator/phase of the decomposition, against the samples of the model predicting it
    rows = pred["coverage"]
    assert rows and {r["what"] for r in rows} >= {"linear1 fwd", "linear1 bwd"}
    for r in rows:
        assert set(r) == {"what", "state", "factor", "detail"}
        assert r["state"] in ("sampled", "interpolated", "in range", "extrapolated")
        assert (r["factor"] > 1.0) == (r["state"] == "extrapolated") and bool(r["detail"]) == (r["factor"] > 1.0)


def test_terms_make_the_prediction_slower_than_the_operator_sum(capsys):
    """The step terms model what isolated micro-benchmarks miss: a real step is never faster."""
    from neox_perf.config import WorldRequest, build, load_files
    from neox_perf.derive import derive
    from neox_perf.prediction.estimate import estimate
    from neox_perf.prediction.predict import load_cluster, predict
    from neox_perf.prediction.corrections import StepTerms
    profile = load_cluster("perlmutter-a100-80gb")
    cfg, _, _ = build(load_files([str(EXAMPLES / "gpt-20b.yml")]), WorldRequest(gpus=128),
                      cluster_gpus_per_node=profile.facts.gpus_per_node)
    p = predict(cfg, derive(cfg, 50257), profile)
    plain = estimate(p.decomposition, profile, StepTerms())
    assert p.iteration_seconds > plain.iteration_seconds
