"""`neox-perf plan` end to end: the JSON contract, --write reproduced by check, one-line errors."""
import contextlib
import io
import json
import subprocess
import sys

import pytest
import yaml

from neox_perf import exitcodes
from neox_perf.cli import main

from conftest_paths import EXAMPLES  # helper module beside this file

SMALL = ("num_layers: 12\nhidden_size: 1024\nnum_attention_heads: 16\nseq_length: 1024\n"
         "max_position_embeddings: 1024\ntrain_micro_batch_size_per_gpu: 4\n"
         "gradient_accumulation_steps: 4\npipe_parallel_size: 2\nmodel_parallel_size: 2\n"
         "fp16: {enabled: true}\ncheckpoint_activations: true\ntrain_iters: 1000\n"
         "zero_optimization: {stage: 1, reduce_bucket_size: 50000000}\n")

CONTRACT = {
    "top": {"schema", "neox_perf_version", "command", "exit_code", "files", "cluster", "gpus",
            "global_batch", "global_batch_source", "train_iters", "memory_headroom", "evaluated",
            "predicted", "admissible", "bounded", "duplicates", "rejected", "seconds", "baseline",
            "baselines", "candidates", "pareto_front", "no_layout", "written", "overlay", "warnings",
            "collapsed", "within_interval", "profile_warnings"},  # the last three added in v1 (adding keeps the version)
    "candidate": {"rank", "gpus", "layout", "train_batch_size", "batch_difference",
                  "iteration_seconds", "interval_seconds", "tokens_per_second", "mfu", "run_hours",
                  "gpu_hours", "fits", "max_memory_fraction", "dominant", "pareto",
                  "equivalent", "tp_across_nodes"},  # the last two added in v1
    "layout": {"pipe_parallel_size", "model_parallel_size", "data_parallel_size",
               "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
               "checkpoint_activations", "zero_stage", "pipe_partition_method"},
    "baseline_extra": {"reason", "note"},  # note added in v1
}
DOMINANT = {"compute", "TP-comm", "bubble", "p2p", "DP-sync", "optimizer"}


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def cluster():
    from neox_perf.predictors.profile import list_profiles
    names = [p.name for p in list_profiles()]
    if not names:
        pytest.skip("no bundled cluster profile")
    return "vista-gh200" if "vista-gh200" in names else names[0]


def test_json_contract(write_yaml, cluster):
    path = write_yaml("small.yml", SMALL)
    code, out, err = run(["plan", path, "--gpus", "8,16", "--cluster", cluster, "--top", "5", "--json"])
    assert code == exitcodes.OK, err
    data = json.loads(out)
    assert data["schema"] == "neox-perf/plan/v1" and data["command"] == "plan"
    assert set(data) == CONTRACT["top"]
    assert 1 <= len(data["candidates"]) <= 5
    for cand in data["candidates"] + data["pareto_front"]:
        assert set(cand) == CONTRACT["candidate"]
        assert set(cand["layout"]) == CONTRACT["layout"]
        assert cand["dominant"] in DOMINANT and cand["fits"] is True
        assert 0 < cand["max_memory_fraction"] <= data["memory_headroom"]
        lay = cand["layout"]
        assert (max(lay["pipe_parallel_size"], 1) * lay["model_parallel_size"]
                * lay["data_parallel_size"]) == cand["gpus"]
        assert cand["interval_seconds"] is None or len(cand["interval_seconds"]) == 2
    assert set(data["baseline"]) == CONTRACT["candidate"] | CONTRACT["baseline_extra"]
    ranks = [c["rank"] for c in data["candidates"]]
    assert ranks == sorted(ranks) and ranks[0] == 1
    hours = [c["run_hours"] for c in data["candidates"]]
    assert hours == sorted(hours)
    assert data["evaluated"] >= data["admissible"] + sum(data["rejected"].values()) - data["duplicates"]
    assert data["predicted"] + data["bounded"] == data["admissible"]
    # the Pareto front: nothing on it is both slower and dearer than another front member
    front = data["pareto_front"]
    assert front and all(not (a["run_hours"] < b["run_hours"] and a["gpu_hours"] < b["gpu_hours"])
                         for a in front for b in front)


def test_baseline_has_its_rank_even_outside_the_top(write_yaml, cluster):
    path = write_yaml("small.yml", SMALL)
    code, out, _ = run(["plan", path, "--gpus", "8", "--cluster", cluster, "--top", "1", "--json"])
    data = json.loads(out)
    base = data["baseline"]
    assert base["layout"] == {"pipe_parallel_size": 2, "model_parallel_size": 2, "data_parallel_size": 2,
                              "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
                              "checkpoint_activations": True, "zero_stage": 1,
                              "pipe_partition_method": "type:transformer|mlp"}
    assert base["rank"] >= 1 and base["reason"] is None
    code, out, _ = run(["plan", path, "--gpus", "8", "--cluster", cluster, "--top", "0", "--json"])
    full = json.loads(out)
    same = [c for c in full["candidates"] if c["layout"] == base["layout"]]
    assert len(same) == 1 and same[0]["rank"] == base["rank"]
    assert same[0]["iteration_seconds"] == base["iteration_seconds"]
    code, out, _ = run(["plan", path, "--gpus", "8", "--cluster", cluster, "--top", "1"])
    assert f"ranks {base['rank']} of" in out


def _plan_write_check(configs, gpus, cluster, tmp_path, extra=()):
    best = tmp_path / "best-layout.yml"
    code, out, err = run(["plan", *configs, "--gpus", str(gpus), "--cluster", cluster, "--top", "3",
                          "--write", str(best), "--json", *extra])
    assert code == exitcodes.OK, err
    planned = json.loads(out)
    top = planned["candidates"][0]
    written = yaml.safe_load(best.read_text())
    assert written == planned["overlay"]  # only the keys that change, dashed
    code, out, err = run(["check", *configs, str(best), "--gpus", str(top["gpus"]),
                          "--cluster", cluster, "--json"])
    assert code == exitcodes.OK, err
    checked = json.loads(out)
    assert checked["prediction"]["iteration_seconds"] == top["iteration_seconds"]
    lay = top["layout"]
    assert checked["derived"]["data_parallel_size"] == lay["data_parallel_size"]
    assert checked["config"]["training"]["micro_batch_size"] == lay["train_micro_batch_size_per_gpu"]
    assert checked["config"]["training"]["zero_stage"] == lay["zero_stage"]
    return planned, written


def test_write_overlay_reproduced_by_check(write_yaml, cluster, tmp_path):
    path = write_yaml("small.yml", SMALL)
    planned, written = _plan_write_check([path], 8, cluster, tmp_path)
    for key in written:  # nothing the user's file already says
        assert key.replace("-", "_") not in yaml.safe_load(SMALL) or \
            yaml.safe_load(SMALL)[key.replace("-", "_")] != written[key]


def test_write_overlay_bundled_example(cluster, tmp_path):
    _plan_write_check([str(EXAMPLES / "llemma-7b.yml")], 32, cluster, tmp_path,
                      extra=("--max-micro-batch", "4"))


def test_write_overlay_shipped_20b(neox_configs, cluster, tmp_path):
    _plan_write_check([str(neox_configs / "20B.yml")], 64, cluster, tmp_path,
                      extra=("--max-micro-batch", "2"))


def test_no_layout_is_one_line_naming_the_constraint(write_yaml, cluster):
    huge = ("num_layers: 4\nhidden_size: 40960\nnum_attention_heads: 40\nseq_length: 2048\n"
            "max_position_embeddings: 2048\ntrain_micro_batch_size_per_gpu: 1\nfp16: {enabled: true}\n")
    path = write_yaml("huge.yml", huge)
    code, out, err = run(["plan", path, "--gpus", "3", "--cluster", cluster])
    assert code == exitcodes.VERDICT_FAILED
    lines = out.strip().splitlines()
    assert len(lines) == 1 and "--gpus 3 admits no layout" in lines[0]
    assert "heads 40 divide by mp 1, 2, 4, 5, 8, 10, 20, 40 only" in lines[0]
    assert "need more than 90%" in lines[0]
    code, out, _ = run(["plan", path, "--gpus", "3", "--cluster", cluster, "--json"])
    data = json.loads(out)
    assert data["exit_code"] == exitcodes.VERDICT_FAILED and data["candidates"] == []
    assert data["rejected"]["heads_divisible_by_mp"] > 0 and data["rejected"]["out_of_memory"] > 0
    assert "admits no layout" in data["error"]["message"]


def test_bad_input_exit_codes(write_yaml, cluster):
    path = write_yaml("small.yml", SMALL)
    for argv in (["--gpus", "8,x"], ["--gpus", "0"], ["--gpus", "8", "--memory-headroom", "1.5"]):
        code, _, err = run(["plan", path, "--cluster", cluster, *argv])
        assert code == exitcodes.USAGE and len(err.strip().splitlines()) == 1
    code, _, err = run(["plan", path, "--gpus", "8", "--cluster", "no-such-cluster"])
    assert code == exitcodes.USAGE and len(err.strip().splitlines()) == 1
    code, out, err = run(["plan", "/nonexistent.yml", "--gpus", "8", "--cluster", cluster, "--json"])
    assert code == exitcodes.INVALID_CONFIG and json.loads(out)["error"]["message"]
    bad = write_yaml("bad.yml", SMALL.replace("hidden_size: 1024", "hidden_size: 1000"))
    code, _, err = run(["plan", bad, "--gpus", "8", "--cluster", cluster])
    assert code == exitcodes.INVALID_CONFIG and "hidden_size" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    code, _, err = run(["plan", path, "--gpus", "8", "--cluster", cluster, "--write", path])
    assert code == exitcodes.USAGE and "same file name" in err


def test_text_output_and_chart(write_yaml, cluster):
    path = write_yaml("small.yml", SMALL)
    code, out, err = run(["plan", path, "--gpus", "8,16,32", "--cluster", cluster, "--top", "4"])
    assert code == exitcodes.OK, err
    assert "neox-perf plan" in out and "time to train vs GPUs" in out
    assert all(f"{g} GPUs" in out for g in (8, 16, 32))
    assert "\u2014" in out or "-" in out  # the interval column until profiles carry one


def test_plan_imports_no_heavy_modules(cluster):
    probe = ("import sys; from neox_perf.cli import main; import contextlib, io\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             f"    main(['plan', r'{EXAMPLES / 'llemma-7b.yml'}', '--gpus', '16', '--cluster', "
             f"'{cluster}', '--max-micro-batch', '2'])\n"
             "heavy = [m for m in ('torch', 'deepspeed', 'sklearn', 'xgboost', 'pandas', 'scipy') "
             "if m in sys.modules]\n"
             "print(','.join(heavy))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def test_shipped_20b_several_gpu_counts(neox_configs, cluster):
    code, out, err = run(["plan", str(neox_configs / "20B.yml"), "--gpus", "64,128", "--cluster",
                          cluster, "--top", "10", "--json", "--max-micro-batch", "4"])
    assert code == exitcodes.OK, err
    data = json.loads(out)
    assert data["global_batch"] == 4 * 32 * 8  # the config's micro x accumulation x dp at 64 GPUs
    assert {c["gpus"] for c in data["candidates"] + data["pareto_front"]} <= {64, 128}
    assert len(data["baselines"]) == 2 and all(b["rank"] for b in data["baselines"])
    assert data["evaluated"] > 500


def test_interval_is_shown_when_the_profile_has_one(write_yaml, cluster):
    """The interval column shows what IterationEstimate.interval_seconds holds, unchanged."""
    from rich.console import Console
    from neox_perf.commands.plan import PlanResult, candidate_dict
    from neox_perf.config import load_files
    from neox_perf.plan import Planner
    from neox_perf.prediction.predict import load_cluster
    from neox_perf.render import plan_text
    profile = load_cluster(cluster)
    plan = Planner(load_files([write_yaml("small.yml", SMALL)]), profile, 50257, keep=3).run([8])
    for c in plan.candidates:
        c.interval_seconds = (c.iteration_seconds * 0.9, c.iteration_seconds * 1.25)
    result = PlanResult(plan=plan, files=["small.yml"], profile_name=cluster, facts=profile.facts, top=3)
    console = Console(width=200, record=True, highlight=False)
    plan_text.render(result, console)
    text = console.export_text()
    best = plan.candidates[0]
    assert f"{best.interval_seconds[0]:.2f}-{best.interval_seconds[1]:.2f}" in text
    assert candidate_dict(best)["interval_seconds"] == list(best.interval_seconds)


@pytest.mark.parametrize("name", ["125M.yml", "cpu_mock_config.yml", "sparse.yml", "175B.yml"])
def test_shipped_configs_plan_or_fail_in_one_line_like_check(neox_configs, cluster, name):
    path = str(neox_configs / name)
    code, out, err = run(["plan", path, "--gpus", "8", "--cluster", cluster, "--top", "2",
                          "--max-micro-batch", "2"])
    assert code in (exitcodes.OK, exitcodes.INVALID_CONFIG, exitcodes.VERDICT_FAILED), err
    assert "Traceback" not in err and "internal error" not in err
    check_code, _, check_err = run(["check", path, "--gpus", "8", "--cluster", cluster])
    if code == exitcodes.INVALID_CONFIG:  # the config itself is refused: the same line as check
        assert len(err.strip().splitlines()) == 1 and err == check_err
    elif code == exitcodes.VERDICT_FAILED:  # nothing fits: one line naming the constraint
        assert len(out.strip().splitlines()) == 1 and "admits no layout" in out
    else:
        assert "neox-perf plan" in out


# -- issue 26: rows that differ in nothing, rows the interval cannot tell apart, the kept batch --

def test_layouts_that_differ_in_nothing_predicted_are_one_row(neox_configs, cluster):
    """20B.yml on 96 GPUs: the three partition methods cut 6-stage pipelines with the same
    predicted time and memory; they are one row, the others listed as its equivalents."""
    code, out, _ = run(["plan", str(neox_configs / "20B.yml"), "--gpus", "96", "--cluster", cluster,
                        "--top", "0", "--max-micro-batch", "2", "--json"])
    data = json.loads(out)
    cands = data["candidates"]
    assert data["collapsed"] > 0 and any(c["equivalent"] for c in cands)
    seen = {}
    for c in cands:
        l = c["layout"]
        key = (c["gpus"], l["pipe_parallel_size"], l["model_parallel_size"],
               l["train_micro_batch_size_per_gpu"], l["gradient_accumulation_steps"],
               l["checkpoint_activations"])
        for other in seen.get(key, []):
            assert (abs(other["iteration_seconds"] - c["iteration_seconds"]) > 1e-3 * other["iteration_seconds"]
                    or abs(other["max_memory_fraction"] - c["max_memory_fraction"]) > 0.005)
        seen.setdefault(key, []).append(c)
    folded = next(c for c in cands if c["equivalent"])
    assert all(e["pipe_partition_method"] != folded["layout"]["pipe_partition_method"]
               or e["zero_stage"] != folded["layout"]["zero_stage"] for e in folded["equivalent"])


def test_says_when_the_top_lies_within_the_best_interval(neox_configs, cluster):
    argv = ["plan", str(neox_configs / "20B.yml"), "--gpus", "96", "--cluster", cluster, "--top", "8",
            "--max-micro-batch", "2"]
    data = json.loads(run(argv + ["--json"])[1])
    best = data["candidates"][0]
    high = best["interval_seconds"][1]
    inside = sum(1 for c in data["candidates"][1:] if c["iteration_seconds"] * best["train_batch_size"]
                 / c["train_batch_size"] <= high)
    assert data["within_interval"] == inside > 0
    text = " ".join(run(argv)[1].split())
    assert f"ranks 1-{inside + 1} lie within rank 1's 80% interval" in text


def test_the_users_layout_keeps_the_global_batch_at_other_gpu_counts(neox_configs, cluster):
    """20B.yml sets micro 4 x accumulation 32 and no train_batch_size: at 64 GPUs (dp 8) that is
    a batch of 1024; at 128 GPUs the user's layout is compared with accumulation 16, not at twice
    the batch."""
    code, out, _ = run(["plan", str(neox_configs / "20B.yml"), "--gpus", "64,128", "--cluster", cluster,
                        "--top", "3", "--max-micro-batch", "4", "--json"])
    data = json.loads(out)
    assert data["global_batch"] == 1024
    at128 = next(b for b in data["baselines"] if b["gpus"] == 128)
    assert at128["batch_difference"] == 0 and at128["layout"]["gradient_accumulation_steps"] == 16
    assert "accumulation 16 instead of 32 keeps the global batch 1024" in at128["note"]


def test_plan_takes_set_like_check(write_yaml, cluster):
    path = write_yaml("small.yml", SMALL)
    code, out, _ = run(["plan", path, "--gpus", "8", "--cluster", cluster, "--top", "1", "--json",
                        "--set", "model_parallel_size=1", "--set", "pipe_parallel_size=1"])
    base = json.loads(out)["baseline"]["layout"]
    assert (base["model_parallel_size"], base["pipe_parallel_size"]) == (1, 1)


def test_marks_tensor_parallelism_across_nodes_as_check_warns(write_yaml):
    # dgx-a100: 8 GPUs a node, so model parallel 16 spans two; check warns on such a layout
    path = write_yaml("small.yml", SMALL)
    argv = ["plan", path, "--gpus", "32", "--cluster", "dgx-a100", "--top", "0"]
    code, out, err = run(argv + ["--json"])
    assert code == exitcodes.OK, err
    cands = json.loads(out)["candidates"]
    assert {c["tp_across_nodes"] for c in cands} == {True, False}
    for c in cands:
        assert c["tp_across_nodes"] == (c["layout"]["model_parallel_size"] > 8)
    spans = next(c for c in cands if c["tp_across_nodes"])
    written = write_yaml("spans.yml", SMALL.replace("model_parallel_size: 2", "model_parallel_size: 16")
                         .replace("pipe_parallel_size: 2", f"pipe_parallel_size: {spans['layout']['pipe_parallel_size']}"))
    check = json.loads(run(["check", written, "--gpus", "32", "--cluster", "dgx-a100", "--json"])[1])
    assert "tensor_parallel_across_nodes" in {v["code"] for v in check["verdicts"]}
    code, text, _ = run(argv)
    text = " ".join(text.split())
    assert "^: tensor parallelism spans nodes" in text and "-16-" in text and "^" in text.split("^:")[0]
    # the best layout that keeps it inside a node is named only where one that does not ranks first
    inside = next(c for c in cands if not c["tp_across_nodes"])
    named = f"the best layout with tensor parallelism inside a node ranks {inside['rank']}"
    assert (named in text) == cands[0]["tp_across_nodes"]
