"""`neox-perf validate` end to end: a tiny config trained for real by 2 processes (DeepSpeed,
gloo), predicted with a profile, compared, and printed as the versioned JSON envelope."""
import argparse
import io
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from neox_perf.commands.validate import COMPONENTS, run_validate  # noqa: E402
from neox_perf.errors import UsageError  # noqa: E402

TINY = """{
  "pipe_parallel_size": 1, "model_parallel_size": 1, "num_layers": 2, "hidden_size": 64,
  "num_attention_heads": 4, "seq_length": 32, "max_position_embeddings": 32,
  "pos_emb": "rotary", "norm": "rmsnorm", "no_weight_tying": true,
  "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
  "optimizer": {"type": "Adam", "params": {"lr": 0.001}}
}"""


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validate")
    base, extra = tmp / "tiny.yml", tmp / "flash.yml"
    base.write_text(TINY)
    extra.write_text('{"attention_config": [[["flash"], 2]], "precision": "fp16", "fp16": {"enabled": true}}')
    progress = []
    args = argparse.Namespace(configs=[str(base), str(extra)], gpus=2, cluster="perlmutter-a100",
                              iters=3, vocab_size=500, workdir=str(tmp / "work"), json=True)
    return run_validate(args, progress=lambda *a: progress.append(a)), progress


def test_the_json_envelope_has_the_comparison(validated, capsys):
    result, progress = validated
    from neox_perf.render import emit
    emit(result, want_json=True)
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "neox-perf/validate/v1" and data["exit_code"] == 0
    assert data["profile_warnings"] == []  # a bundled profile's calibration was not ours to watch
    (r,) = data["results"]
    assert {"config", "predicted_seconds", "measured_seconds", "components"} <= set(r)
    assert [c.rsplit("/", 1)[-1] for c in r["config"]] == ["tiny.yml", "flash.yml"]
    assert 0 < r["measured_seconds"] <= r["measured_median_seconds"] and r["predicted_seconds"] > 0
    assert r["iterations"] == 3 and r["warmup"] == 2
    assert [c["component"] for c in r["components"]] == list(COMPONENTS)
    measured = {c["component"]: c["measured_seconds"] for c in r["components"]}
    assert measured["forward"] > 0 and measured["backward"] > 0 and measured["grad_sync"] > 0
    assert measured["p2p"] == 0 and measured["tp_allreduce"] == 0  # one stage, no tensor parallel
    lay = r["layout"]
    assert (lay["pp"], lay["mp"], lay["dp"], lay["attention"], lay["precision"]) == (1, 1, 2, "flash", "fp32")
    assert data["mean_absolute_percentage_error"] == pytest.approx(100 * abs(r["error"]))
    assert progress and progress[-1][1] == 5  # 2 warm-up + 3 measured iterations


def test_the_error_is_bounded_on_both_sides(validated):
    result, _ = validated
    (r,) = result.results
    # the predicted side is the one pipeline's, at the precision the CPU run computes in
    from neox_perf.config import WorldRequest, build, load_files
    from neox_perf.derive import derive
    from neox_perf.prediction.predict import load_cluster, predict
    profile = load_cluster("perlmutter-a100")
    cfg, _, _ = build(load_files(r.config), WorldRequest(gpus=2),
                      cluster_gpus_per_node=profile.facts.gpus_per_node)
    expected = predict(cfg, derive(cfg, 500), profile, precision="fp32").iteration_seconds
    assert r.predicted_seconds == expected
    # one stage: its components are the whole predicted iteration
    assert sum(c["predicted_seconds"] for c in r.components) == pytest.approx(r.predicted_seconds, rel=1e-9)
    # measured: each rank's split of its typical (median) iteration, which the median of the
    # slowest rank's iterations is never under
    split = sum(c["measured_seconds"] for c in r.components)
    assert 0.5 * r.measured_seconds <= split <= r.measured_median_seconds * (1 + 1e-9)
    # At this size an A100 step is host-bound: the dev-set terms' host issue time (about 80 us
    # per framework call) puts its prediction near what one CPU core per process measures,
    # above or below it with the box's load. Bounded on both sides. The low side allows the
    # CPU run 3x the prediction: the median of 3 iterations on this 2-core box moved 0.025-0.035 s
    # against a 0.019 s prediction in four quiet runs in a row, and reached 2.0x once in CI (a
    # factor-two bound failed there on a change that moved no prediction).
    assert -2 / 3 < r.error < 1.0
    # against the typical iteration, the fastest beside it
    assert r.error == pytest.approx(r.predicted_seconds / r.measured_median_seconds - 1.0)
    assert r.error_fastest == pytest.approx(r.predicted_seconds / r.measured_seconds - 1.0)


def test_memory_is_measured_beside_the_time(validated):
    """The workload's live-bytes window (its second iteration, a warm-up one) against the
    prediction for what it ran (fp32 on this CPU): RMSNorm and the flash layers (the CPU's
    SDPA flash kernel on the same q, k, v copies NeoX hands flash-attn)."""
    (r,) = validated[0].results
    (row,) = r.memory
    assert row["stage"] == 0 and abs(row["error"]) <= 0.03, row
    comps = {c["component"]: c for c in row["components"]}
    for name in ("weights", "gradients", "optimizer_states", "activations"):
        assert comps[name]["measured"] > 0 and abs(comps[name]["error"]) <= 0.05, comps[name]


def test_the_text_names_the_config_and_the_error(validated):
    from rich.console import Console
    from neox_perf.render.validate_text import render
    out = io.StringIO()
    render(validated[0], Console(file=out, width=200))
    text = out.getvalue()
    assert "tiny.yml, flash.yml" in text and "mean absolute error" in text
    assert "memory per GPU at the peak" in text


def test_a_missing_config_is_a_usage_error(tmp_path):
    args = argparse.Namespace(configs=[str(tmp_path / "none.yml")], gpus=2, cluster="perlmutter-a100",
                              iters=2, vocab_size=None)
    with pytest.raises(UsageError, match="no such config"):
        run_validate(args)
