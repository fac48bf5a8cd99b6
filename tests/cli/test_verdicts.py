"""Verdicts a NeoX user can act on (issue 26, sections 1-2): what NeoX refuses is an error with
exit 1 and nothing predicted; a layout that cannot run shows what it would take instead; advice
follows the cause; layouts that fight the hardware are warnings with the share they cost."""
import json

import pytest
import yaml

from neox_perf import exitcodes

from cli_run import check_json, run  # (helper modules beside this file)

SMALL = ("num_layers: 8\nhidden_size: 512\nnum_attention_heads: 8\nseq_length: 512\n"
         "max_position_embeddings: 512\ntrain_micro_batch_size_per_gpu: 2\n"
         "gradient_accumulation_steps: 4\nfp16: {enabled: true}\ntrain_iters: 100\n")
BATCH = "train_micro_batch_size_per_gpu: 1\ngradient_accumulation_steps: 8\n"




def codes(data, level=None):
    return [v["code"] for v in data["verdicts"] if level is None or v["level"] == level]


def verdict_lines(text):
    return [l for l in text.splitlines() if l.split(" ")[0] in ("OK", "WARNING", "FAIL", "ERROR", "NOTE")]


# -- 1. refuse what NeoX refuses ---------------------------------------------------------------

def test_unknown_key_is_an_error_with_did_you_mean(write_yaml):
    path = write_yaml("typo.yml", SMALL + "checkpoint_activation: true\n")
    code, data = check_json(path, "--gpus", "8", "--cluster", "perlmutter-a100")
    assert code == exitcodes.INVALID_CONFIG
    bad = [v for v in data["verdicts"] if v["code"] == "unknown_key"]
    assert bad and bad[0]["level"] == "error" and bad[0]["file"] == path
    assert "did you mean 'checkpoint_activations'" in bad[0]["message"]
    assert data["verdict"]["level"] == "error" and data["prediction"] is None


def test_a_refused_run_never_ends_with_ok(write_yaml):
    path = write_yaml("typo.yml", SMALL + "checkpoint_activation: true\n")
    code, out, _ = run(["check", path, "--gpus", "8", "--cluster", "perlmutter-a100"])
    assert code == exitcodes.INVALID_CONFIG
    lines = verdict_lines(out)
    assert lines[0].startswith("ERROR") and lines[-1].startswith("ERROR")
    assert "every stage fits" not in out and not any(l.startswith("OK") for l in lines)


def test_typo_of_a_required_key_names_it(write_yaml):
    path = write_yaml("typo.yml", SMALL.replace("hidden_size", "hiden_size"))
    code, _, err = run(["check", path, "--gpus", "8"])
    assert code == exitcodes.INVALID_CONFIG
    assert "'hiden_size'" in err and "did you mean 'hidden_size'" in err


def test_llemma_34b_is_refused_like_neox(neox_configs):
    """llemma/34B.yml sets "attention_type", which NeoXArgs does not declare."""
    code, data = check_json(str(neox_configs / "llemma" / "34B.yml"), "--gpus", "64")
    assert code == exitcodes.INVALID_CONFIG
    assert [v["key"] for v in data["verdicts"] if v["code"] == "unknown_key"] == ["attention_type"]


def test_mistral_gated_width_mismatch_is_an_error(neox_configs, write_yaml):
    batch = write_yaml("batch.yml", BATCH)
    code, data = check_json(str(neox_configs / "mistral" / "7B.yml"), batch, "--gpus", "8")
    assert code == exitcodes.INVALID_CONFIG
    bad = [v for v in data["verdicts"] if v["code"] == "gated_mlp_width"]
    assert bad and bad[0]["level"] == "error" and "2 x 4779" in bad[0]["message"]
    assert "intermediate_size: 43008" in bad[0]["fix"]  # 3 x the Hugging Face gated width
    # and the fix it names is one NeoX builds
    fixed = write_yaml("fixed.yml", "intermediate-size: 43008\n")
    code, data = check_json(str(neox_configs / "mistral" / "7B.yml"), batch, fixed, "--gpus", "8")
    assert "gated_mlp_width" not in codes(data)


@pytest.mark.parametrize("extra, code", [
    ("save: /ckpt\n", "save_without_checkpoint_factor"),
    ("min_lr: 0.01\noptimizer: {type: Adam, params: {lr: 0.001}}\n", "min_lr_above_lr"),
    ("fp16_lm_cross_entropy: true\nbf16: {enabled: true}\nfp16: {enabled: false}\n",
     "fp16_lm_cross_entropy"),
    ("precision: bfloat16\n", "precision_conflict"),
    ("data_types: {grad_accum_dtype: fp32}\n", "grad_accum_dtype_zero0"),
    ("optimizer: {type: OneBitAdam, params: {lr: 0.001}}\ntrain_iters: null\n", "onebitadam_train_iters"),
    ("optimizer: {type: Adam}\n", "optimizer_params"),
    ("num_unique_layers: 3\n", "num_unique_layers"),
])
def test_neox_refusals_are_errors(write_yaml, extra, code):
    base = SMALL
    for key in ("fp16:", "train_iters:"):  # the extras restate these
        if key in extra:
            base = "\n".join(l for l in base.splitlines() if not l.startswith(key)) + "\n"
    path = write_yaml("c.yml", base + extra)
    rc, data = check_json(path, "--gpus", "8")
    assert rc == exitcodes.INVALID_CONFIG, data["verdicts"]
    assert code in codes(data, "error")


def test_out_of_memory_shows_no_time_and_what_it_would_take(neox_configs):
    """13B on 8 x A100-40GB: no time-to-train, MFU or GPU-hours of a layout that cannot run;
    the fastest layout that fits instead, ready to paste -- and pasting it fits."""
    argv = [str(neox_configs / "13B.yml"), "--gpus", "8", "--cluster", "perlmutter-a100"]
    code, data = check_json(*argv)
    assert code == exitcodes.VERDICT_FAILED
    assert data["prediction"] is None
    advice = data["advice"]
    assert advice["reason"] == "fits" and advice["memory_fraction"] <= 0.9
    code, out, _ = run(["check", *argv])
    assert "MFU" not in out and "Prediction (" not in out and "What it would take" in out
    assert verdict_lines(out)[0].startswith("FAIL")
    pasted = argv[:1] + advice["set"].split() + argv[1:]
    if "--gpus" in advice["set"]:  # the layout needs more GPUs: its own --gpus wins
        pasted = argv[:1] + advice["set"].split() + argv[3:]
    code, again = check_json(*pasted)
    assert code == exitcodes.OK, again["verdicts"]
    assert again["prediction"]["iteration_seconds"] == pytest.approx(advice["iteration_seconds"])


def test_out_of_memory_advice_follows_the_dominant_term(neox_configs, write_yaml):
    code, data = check_json(str(neox_configs / "13B.yml"), "--gpus", "8", "--cluster", "perlmutter-a100")
    oom = [v for v in data["verdicts"] if v["code"] == "out_of_memory"][0]
    assert "model states dominate" in oom["fix"] and "checkpoint_activations" not in oom["fix"]
    # activations dominate: a long sequence, a large micro-batch, no checkpointing
    path = write_yaml("act.yml", SMALL.replace("seq_length: 512", "seq_length: 8192").replace(
        "max_position_embeddings: 512", "max_position_embeddings: 8192").replace(
        "train_micro_batch_size_per_gpu: 2", "train_micro_batch_size_per_gpu: 16"))
    code, data = check_json(path, "--gpus", "8", "--cluster", "perlmutter-a100")
    assert code == exitcodes.VERDICT_FAILED
    oom = [v for v in data["verdicts"] if v["code"] == "out_of_memory"][0]
    assert "activations dominate" in oom["fix"] and "enable checkpoint_activations" in oom["fix"]
    assert oom["key"] == "checkpoint_activations"


# -- 2. advise from the cause: the hardware, the partition, the plan, the tokenizer -------------

def _llemma_34b_accepted(neox_configs, write_yaml):
    """llemma/34B.yml without the key NeoX refuses (what its authors ran)."""
    data = yaml.safe_load((neox_configs / "llemma" / "34B.yml").read_text())
    data.pop("attention_type")
    return write_yaml("llemma34b.yml", yaml.safe_dump(data))


def test_tensor_parallel_wider_than_a_node_is_a_warning_with_its_share(neox_configs, write_yaml):
    path = _llemma_34b_accepted(neox_configs, write_yaml)
    code, data = check_json(path, "--nodes", "16", "--cluster", "perlmutter-a100")
    assert code == exitcodes.OK
    tp = [v for v in data["verdicts"] if v["code"] == "tensor_parallel_across_nodes"]
    assert tp and tp[0]["level"] == "warning"
    share = data["prediction"]["breakdown"]["mp_allreduce"] / data["prediction"]["iteration_seconds"]
    assert f"{share:.0%} of the predicted step" in tp[0]["message"] and share > 0.5
    assert data["verdict"]["level"] == "warning"
    # the layout the quick search offers keeps tensor parallelism within a node
    assert data["advice"]["reason"] == "faster" and data["advice"]["speedup"] > 1.25
    assert data["advice"]["overrides"].get("model_parallel_size", 8) <= 4
    assert "slower_than_best_layout" in codes(data, "warning")


def test_uneven_pipeline_stages_are_a_warning_with_their_share(write_yaml):
    """One layer per stage and a 256k vocabulary: the last stage's LM head and loss weigh several
    layers, and 1F1B runs every micro-batch at that stage's pace."""
    path = write_yaml("uneven.yml", SMALL.replace("num_layers: 8", "num_layers: 8\npipe_parallel_size: 8")
                      .replace("gradient_accumulation_steps: 4", "gradient_accumulation_steps: 32"))
    code, data = check_json(path, "--gpus", "8", "--cluster", "perlmutter-a100", "--vocab-size", "256000")
    warn = [v for v in data["verdicts"] if v["code"] == "pipeline_imbalance"]
    assert warn and "stage 7" in warn[0]["message"] and "of the step" in warn[0]["message"]
    assert "LM head" in warn[0]["message"]


def test_a_layout_far_slower_than_the_plan_finds_is_a_warning(neox_configs):
    argv = [str(neox_configs / "1-3B.yml"), "--gpus", "16", "--cluster", "perlmutter-a100"]
    code, data = check_json(*argv)
    slow = [v for v in data["verdicts"] if v["code"] == "slower_than_best_layout"]
    assert slow and slow[0]["level"] == "warning" and "neox-perf plan" in slow[0]["fix"]
    advice = data["advice"]
    assert advice["speedup"] >= 1.25 and advice["set"] in slow[0]["fix"]
    # the layout it names is predicted as it says when pasted
    code, again = check_json(argv[0], *advice["set"].split(), *argv[1:])
    assert again["prediction"]["iteration_seconds"] == pytest.approx(advice["iteration_seconds"])
    assert data["prediction"]["iteration_seconds"] / again["prediction"]["iteration_seconds"] == \
        pytest.approx(advice["speedup"], rel=1e-6)


def test_a_good_layout_gets_no_search_and_no_warning(write_yaml):
    path = write_yaml("ok.yml", SMALL)
    code, data = check_json(path, "--gpus", "1", "--cluster", "perlmutter-a100")
    assert code == exitcodes.OK and data["advice"] is None
    assert data["verdict"]["level"] == "ok"


def test_an_assumed_vocabulary_is_in_the_verdict(write_yaml):
    path = write_yaml("spm.yml", SMALL + "tokenizer_type: SPMTokenizer\n")
    code, data = check_json(path, "--gpus", "8")
    warn = [v for v in data["verdicts"] if v["code"] == "vocab_assumed"]
    assert warn and warn[0]["level"] == "warning" and "50,257" in warn[0]["message"]
    assert "--vocab-size" in warn[0]["fix"]
    code, data = check_json(path, "--gpus", "8", "--vocab-size", "32000")
    assert "vocab_assumed" not in codes(data)


def test_the_plain_check_path_does_not_load_the_planner(write_yaml):
    """The planner (and its search) loads only where a verdict needs it."""
    import subprocess
    import sys
    ok = write_yaml("ok.yml", SMALL)
    probe = ("import sys, contextlib, io\nfrom neox_perf.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             f"    code = main(['check', r'{ok}', '--gpus', '1', '--cluster', 'perlmutter-a100'])\n"
             "print(code, 'neox_perf.plan' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert proc.stdout.split() == ["0", "False"], proc.stderr
