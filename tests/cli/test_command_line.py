"""The command line a NeoX user expects (issue 26, section 3): --set, --nodes / --gpus-per-node,
a mistyped --cluster, a missing file as typed, --format line, NeoX's own log units, the model
line."""
import ast
import json
import math
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from neox_perf import exitcodes

from cli_run import check_json, run  # noqa: E402  (helper modules beside this file)

SMALL = ("num_layers: 8\nhidden_size: 512\nnum_attention_heads: 8\nseq_length: 512\n"
         "max_position_embeddings: 512\ntrain_micro_batch_size_per_gpu: 2\n"
         "gradient_accumulation_steps: 4\nfp16: {enabled: true}\ntrain_iters: 100\n"
         "optimizer: {type: Adam, params: {lr: 0.0006}}\n")




def test_set_overrides_after_the_merge(write_yaml):
    path = write_yaml("a.yml", SMALL)
    code, data = check_json(path, "--gpus", "8", "--set", "train-micro-batch-size-per-gpu=4",
                            "--set", "zero_optimization.stage=1", "--set", "optimizer.params.lr=2.0e-4")
    assert code == exitcodes.OK
    training = data["config"]["training"]
    assert training["micro_batch_size"] == 4 and training["zero_stage"] == 1
    assert training["train_batch_size"] == 4 * 4 * 8


def test_set_is_checked_like_a_file(write_yaml):
    path = write_yaml("a.yml", SMALL)
    code, data = check_json(path, "--gpus", "8", "--set", "checkpoint_activation=true")
    assert code == exitcodes.INVALID_CONFIG
    bad = [v for v in data["verdicts"] if v["code"] == "unknown_key"][0]
    assert bad["file"] == "--set" and "did you mean 'checkpoint_activations'" in bad["message"]
    code, _, err = run(["check", path, "--gpus", "8", "--set", "pipe_parallel_size=two"])
    assert code == exitcodes.INVALID_CONFIG and err.startswith("neox-perf: --set: pipe_parallel_size")
    code, _, err = run(["check", path, "--gpus", "8", "--set", "pipe_parallel_size"])
    assert code == exitcodes.INVALID_CONFIG and "KEY=VALUE" in err


def test_nodes_without_gpus_per_node_asks_for_it(write_yaml):
    path = write_yaml("a.yml", SMALL)
    code, _, err = run(["check", path, "--nodes", "4"])
    assert code == exitcodes.USAGE and "--gpus-per-node" in err and len(err.splitlines()) == 1
    code, data = check_json(path, "--nodes", "4", "--gpus-per-node", "8")
    assert code == exitcodes.OK and data["derived"]["world_size"] == 32
    code, data = check_json(path, "--nodes", "4", "--cluster", "perlmutter-a100")
    assert data["derived"]["world_size"] == 16  # the cluster's 4 GPUs per node


def test_gpus_per_node_contradicting_the_cluster_is_an_error(write_yaml):
    path = write_yaml("a.yml", SMALL)
    code, _, err = run(["check", path, "--gpus", "8", "--gpus-per-node", "8", "--cluster", "perlmutter-a100"])
    assert code == exitcodes.USAGE and "contradicts" in err and "4 GPUs per node" in err
    code, _, _ = run(["check", path, "--gpus", "8", "--gpus-per-node", "4", "--cluster", "perlmutter-a100"])
    assert code == exitcodes.OK


def test_a_mistyped_cluster_gets_did_you_mean(write_yaml):
    path = write_yaml("a.yml", SMALL)
    code, _, err = run(["check", path, "--gpus", "8", "--cluster", "perlmuter-a100"])
    assert code == exitcodes.USAGE
    assert "did you mean perlmutter-a100" in err and "calibrate" not in err
    code, _, err = run(["check", path, "--gpus", "8", "--cluster", "no/such/cluster.yml"])
    assert code == exitcodes.USAGE and "no such file" in err and "calibrate" not in err


def test_a_missing_file_is_named_as_typed(tmp_path):
    code, _, err = run(["check", "125M", "-d", str(tmp_path), "--gpus", "8"])
    assert code == exitcodes.INVALID_CONFIG
    assert err.startswith(f"neox-perf: {tmp_path / '125M'}: no such file")
    code, _, err = run(["check", "nowhere.yml", "--gpus", "8"])
    assert err.startswith("neox-perf: nowhere.yml: no such file")


def test_format_line_is_one_line_with_a_slurm_time(write_yaml):
    path = write_yaml("a.yml", SMALL.replace("train_iters: 100", "train_iters: 200000"))
    argv = ["check", path, "--gpus", "8", "--cluster", "perlmutter-a100"]
    code, out, _ = run(argv + ["--format", "line"])
    assert code == exitcodes.OK and out.count("\n") == 1
    fields = out.strip().split(" | ")
    _, data = check_json(*argv[1:])
    pred = data["prediction"]
    assert fields[0].startswith("neox-perf check: 8 GPUs (2 nodes x 4) pp0 mp1 dp8")
    lo, hi = pred["interval_seconds"]
    assert fields[1] == f"{pred['iteration_seconds']:.3g} s/it (80%: {lo:.3g}-{hi:.3g})"
    assert f"{pred['run_gpu_hours']:,.0f} GPU-h" in fields[2]
    assert re.fullmatch(r"\d+\.\d/40 GiB per GPU", fields[3])
    assert fields[4].startswith(data["verdict"]["level"].upper() + ": ")
    # the allocation is sized for the interval's high end, rounded up to the minute
    minutes = math.ceil(hi * 200000 / 60)
    days, rest = divmod(minutes, 1440)
    assert fields[-1] == f"sbatch --time={days}-{rest // 60:02d}:{rest % 60:02d}:00"
    assert run(argv + ["--format", "line", "--json"])[0] == exitcodes.USAGE


def test_format_line_of_a_refused_config_has_no_time(write_yaml):
    path = write_yaml("a.yml", SMALL + "hidden_dropout_typo: 0.1\n")
    code, out, _ = run(["check", path, "--gpus", "8", "--cluster", "perlmutter-a100", "--format", "line"])
    assert code == exitcodes.INVALID_CONFIG and out.count("\n") == 1
    assert "ERROR: NeoX would refuse" in out and "s/it" not in out and "sbatch" not in out


def _neox_flops_function():
    """get_actual_flops and human_readable_flops from GPT-NeoX's own megatron/logging.py, compiled
    alone (the module imports torch and megatron; the two functions need only math and the
    world size)."""
    src = os.environ.get("NEOX_PERF_NEOX_SRC")
    path = Path(src or "") / "megatron" / "logging.py"
    if not src or not path.is_file():
        pytest.skip("NEOX_PERF_NEOX_SRC (a GPT-NeoX checkout) is not set")
    tree = ast.parse(path.read_text())
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef)
             and n.name in ("get_actual_flops", "human_readable_flops")]
    namespace = {"math": math}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


@pytest.mark.parametrize("extra", ["checkpoint_activations: true\n", "checkpoint_activations: false\n",
                                   "attention_config: [[[mamba], all]]\n"])
def test_neox_log_units_are_computed_as_neox_computes_them(write_yaml, extra):
    ns = _neox_flops_function()
    path = write_yaml("a.yml", SMALL + extra)
    code, data = check_json(path, "--gpus", "8", "--cluster", "perlmutter-a100")
    pred, cfg = data["prediction"], data["config"]
    it = pred["iteration_seconds"]
    m, t = cfg["model"], cfg["training"]
    neox_args = SimpleNamespace(
        padded_vocab_size=data["derived"]["padded_vocab_size"], train_batch_size=t["train_batch_size"],
        seq_length=m["seq_length"], hidden_size=m["hidden_size"], num_layers=m["num_layers"],
        checkpoint_activations=t["checkpoint_activations"], attention_config=m["attention_types"],
        num_attention_heads=m["num_attention_heads"], expansion_factor=m["expansion_factor"],
        intermediate_size=m["intermediate_size"])
    ns["torch"] = SimpleNamespace(distributed=SimpleNamespace(get_world_size=lambda: 8))
    flops = ns["get_actual_flops"](neox_args, it)
    log = pred["neox_log"]
    assert log["approx_flops_per_gpu"] == pytest.approx(flops, rel=1e-12)
    assert log["approx_flops_per_gpu_text"] == ns["human_readable_flops"](flops)
    assert log["samples_per_sec"] == pytest.approx(t["train_batch_size"] / it)
    assert log["elapsed_time_per_iteration_ms"] == pytest.approx(it * 1000)
    assert log["line"] == (f"samples/sec: {t['train_batch_size'] / it:.3f} | elapsed time per iteration "
                           f"(ms): {it * 1000:.1f} | approx flops per GPU: {ns['human_readable_flops'](flops)}")


def test_neox_log_units_in_the_text(write_yaml):
    path = write_yaml("a.yml", SMALL)
    code, out, _ = run(["check", path, "--gpus", "8", "--cluster", "perlmutter-a100"])
    _, data = check_json(path, "--gpus", "8", "--cluster", "perlmutter-a100")
    assert "elapsed time per iteration (ms)" in out and data["prediction"]["neox_log"]["line"][:40] in out


def test_the_model_line_shows_what_changes_the_size(neox_configs, write_yaml):
    """NeoX's gated 2/3 rule makes llemma/34B.yml's MLP 11008 wide (21B parameters); experts
    and kv heads change the size too."""
    code, out, _ = run(["check", str(neox_configs / "llemma" / "34B.yml"), "--gpus", "64"])
    model = " ".join(out.split("model", 1)[1].split("layout")[0].replace("│", " ").split())
    assert "MLP 11008 (swiglu gated: 2/3 of 4 x hidden, halved)" in model
    assert "64 heads / 8 kv" in model and "21.06B" in out
    path = write_yaml("moe.yml", SMALL + "moe_num_experts: 8\nmoe_top_k: 2\nmoe_expert_interval: 2\n")
    code, out, _ = run(["check", path, "--gpus", "8"])
    assert "8 experts (top-2, every 2 layers)" in " ".join(out.replace("│", " ").split())
    path = write_yaml("wide.yml", SMALL + "intermediate_size: 3000\n")
    code, out, _ = run(["check", path, "--gpus", "8"])
    assert "MLP 3000 (intermediate_size 3000)" in " ".join(out.replace("│", " ").split())
