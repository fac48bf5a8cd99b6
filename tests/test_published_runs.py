"""benchmarks/published_runs.py: published DGX A100 SuperPOD runs, predicted on the bundled
`dgx-a100` description, which nothing was fitted on.

The transcription is checked against each source's own second column (a typo in a row fails
here), each config splits the layers as the engines that were timed did, and each run goes
through `check --json` as a user's would; how close the predictions come is the benchmark's to
print (docs/cross-cluster.md), not pinned here.
"""
import math

import pytest


@pytest.fixture
def published(benchmark_script):
    return benchmark_script("published_runs")


def test_sc21_rows_reproduce_the_published_aggregate(published):
    # GPUs x teraFLOP/s per GPU is the table's aggregate petaFLOP/s, to its rounding (the per-GPU
    # rate is printed in whole teraFLOP/s: up to 0.4% off at 140)
    for billions, _a, _h, _l, _tp, _pp, gpus, _b, tflops, aggregate in published.SC21_TABLE:
        assert gpus * tflops / 1000 == pytest.approx(aggregate, rel=0.005), billions


def test_mtnlg_times_match_their_stated_rates(published):
    # the stated seconds and the stated teraFLOP/s per GPU agree through the FLOP count the
    # Megatron papers use (vocabulary padded to 51,200 at tensor parallel 8)
    mtnlg = [r for r in published.RUNS if r.source == published.MTNLG]
    assert [r.gpus for r in mtnlg] == [2240, 2800, 3360]
    for run in mtnlg:
        derived = published.sc21_seconds(run.layers, run.hidden, run.gpus, run.batch, run.tflops)
        assert derived == pytest.approx(run.seconds, rel=0.01), run.name


def test_sc21_time_is_the_papers_flop_count_over_the_rate(published):
    run = next(r for r in published.RUNS if r.name == "Megatron-LM 1.7B")
    flops = 96 * 512 * 2048 * 24 * 2304 ** 2 * (1 + 2048 / (6 * 2304) + 51200 / (16 * 24 * 2304))
    assert run.seconds == pytest.approx(flops / (32 * 137e12))
    assert not run.stated and run.dp == 32


def test_configs_divide_the_batch_or_are_skipped(published):
    run = next(r for r in published.RUNS if r.name == "MT-NLG 530B, 420 nodes")
    cfg = published.neox_config(run, 1)
    assert run.dp == 12
    assert cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * run.dp == 1920
    odd = published.Run("odd", "x", "x", 2, 64, 1, 1, 1, 3, 4, 1.0, 1.0)
    assert published.neox_config(odd, 1) is None  # 4 sequences over 3 replicas


def test_each_stage_holds_layers_over_pp_as_both_engines_ran(published):
    # NeoX's default 'type:transformer' also weighs its _pre/_post_transformer_block functions and
    # splits MT-NLG's 105 layers on 35 stages as 3, 4, 3, ..., 2: the configs name the layer class
    from neox_perf.predictors.fitting import devset

    def stages(values, run):  # raises where NeoX would refuse the config
        _, derived = devset.build_values(values, run.gpus, 8, "published run", run.name, 50257)
        return [s.transformer_layers for s in derived.stages]

    for name in ("MT-NLG 530B, 280 nodes", "Megatron-LM 1008B"):
        run = next(r for r in published.RUNS if r.name == name)
        values = published.neox_config(run, 1)
        assert stages(values, run) == [run.layers // run.pp] * run.pp, name
        # what NeoX's default would have built instead: one stage a layer heavier
        default = stages({**values, "pipe_partition_method": "type:transformer"}, run)
        assert max(default) == run.layers // run.pp + 1
    assert published.neox_config(published.RUNS[0], 1)["pipe_partition_method"] == devset.MEGATRON_PARTITION


def test_deepspeed_pipeline_runs_are_checked_as_a_user_would(published):
    mtnlg = [r for r in published.RUNS if r.source == published.MTNLG]
    rows = published.predicted(mtnlg, micro_batches=(1, 2))
    for row in rows:
        for micro in (1, 2):
            got = row["predicted"][micro]
            assert got["exit_code"] == 0 and got["regime"] == "across nodes", got
            lo, hi = got["interval"]
            assert lo < got["seconds"] < hi and math.isfinite(got["error"])
            assert got["inside"] == (lo <= row["run"]["seconds"] <= hi)
    s = published.summary(rows)[published.MTNLG]
    assert s["runs"] == 3 and 0 <= s["inside"] <= 3
    split = published.per_micro_batch_split(rows)
    assert split["micro_batches"] == [240, 192, 160]


def test_plan_on_mtnlg_names_the_best_layout_inside_a_node(published, tmp_path):
    # at 2,240 GPUs the predicted best puts tensor parallelism across nodes (checkpointing off):
    # plan marks it and names the best layout that keeps tensor parallelism inside a node
    import contextlib
    import io
    import json
    from neox_perf.cli import main
    run = next(r for r in published.RUNS if r.name == "MT-NLG 530B, 280 nodes")
    path = tmp_path / "mtnlg.yml"
    path.write_text(json.dumps(published.neox_config(run, 1)))
    argv = ["plan", str(path), "--gpus", "2240", "--cluster", "dgx-a100", "--top", "10"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv + ["--json"]) == 0
    cands = json.loads(out.getvalue())["candidates"]
    assert cands[0]["tp_across_nodes"] and cands[0]["layout"]["model_parallel_size"] > 8
    inside = next(c for c in cands if not c["tp_across_nodes"])
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        main(argv)
    assert f"the best layout with tensor parallelism inside a node ranks {inside['rank']}" in " ".join(text.getvalue().split())
