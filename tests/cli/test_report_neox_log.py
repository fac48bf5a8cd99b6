"""`neox-perf report TRAIN_LOG --config ...` (issue 26, section 3): GPT-NeoX's own training log,
no hook, held against the prediction for its config. The log here is written line for line in
NeoX's formats (NeoXArgs.print, megatron/logging.py training_log); tests/neox runs NeoX itself."""
import json
import statistics

import pytest

from neox_perf import exitcodes

from cli_run import run  # (helper module beside this file)

SMALL = ("num_layers: 8\nhidden_size: 512\nnum_attention_heads: 8\nseq_length: 512\n"
         "max_position_embeddings: 512\ntrain_micro_batch_size_per_gpu: 2\n"
         "gradient_accumulation_steps: 4\nfp16: {enabled: true}\ntrain_iters: 100\n"
         "optimizer: {type: Adam, params: {lr: 0.0006}}\nlog_interval: 10\n")


def neox_arg(name, value):
    """One line of NeoXArgs.print() (megatron/neox_arguments/arguments.py:757-785)."""
    line = "  {} {} {}".format(name, "." * (32 - len(name)), value)
    return line + "." * (64 - len(line)) + "updated"


def neox_log_line(iteration, train_iters, elapsed_ms, batch, flops_text, loss=6.5):
    """One of training_log's lines (megatron/logging.py:431-559), fp16."""
    sps = batch / (elapsed_ms / 1000.0)
    return (" samples/sec: {:.3f} |".format(sps) + " iteration {:8d}/{:8d} |".format(iteration, train_iters)
            + " elapsed time per iteration (ms): {:.1f} |".format(elapsed_ms)
            + " learning rate: {:.3E} |".format(6e-4) + f" approx flops per GPU: {flops_text} |"
            + " lm_loss: {:.6E} |".format(loss) + " loss scale: {:.1f} |".format(65536.0)
            + " number of skipped iterations: {:3d} |".format(0)
            + " number of nan iterations: {:3d} |".format(0))


def write_log(tmp_path, elapsed, world=8, batch=64):
    lines = ["NeoXArgs.from_ymls() ['small.yml']", "-------------------- arguments --------------------",
             neox_arg("global_num_gpus", world), neox_arg("train_batch_size", batch),
             neox_arg("log_interval", 10), "---------------- end of arguments ----------------",
             "> building train, validation, and test datasets ..."]
    for i, ms in enumerate(elapsed, 1):
        lines.append(neox_log_line(10 * i, 100, ms, batch, "95.1TFLOPS"))
    path = tmp_path / "train.log"
    path.write_text("\n".join(lines) + "\n")
    return str(path)



def test_a_neox_log_against_the_prediction(tmp_path, write_yaml):
    cfg = write_yaml("small.yml", SMALL)
    elapsed = [2950.0, 1210.5, 1190.2, 1305.9, 1201.1]  # the first interval holds the warm-up
    log = write_log(tmp_path, elapsed)
    code, out, err = run(["report", log, "--config", cfg, "--cluster", "perlmutter-a100", "--json"])
    assert code == exitcodes.OK, err
    r = json.loads(out)
    assert r["schema"] == "neox-perf/report-neox-log/v1" and r["world_size"] == 8
    median = statistics.median(elapsed[1:]) / 1000
    assert r["measured"]["median_seconds"] == pytest.approx(median)
    assert r["logged"]["used"] == 4 and r["logged"]["iterations"] == [20, 30, 40, 50]
    assert r["measured"]["approx_flops_per_gpu"] == pytest.approx(95.1e12)
    # the prediction is check's for the same config and GPUs
    check = json.loads(run(["check", cfg, "--gpus", "8", "--cluster", "perlmutter-a100", "--json"])[1])
    predicted = check["prediction"]["iteration_seconds"]
    assert r["predicted"]["iteration_seconds"] == pytest.approx(predicted)
    assert r["predicted"]["neox_log"] == pytest.approx(
        {k: v for k, v in check["prediction"]["neox_log"].items() if k != "approx_flops_per_gpu_text"})
    assert r["error_median"] == pytest.approx((predicted - median) / median)
    ratio = median / predicted
    assert (f"{ratio:.1f}x as slow as predicted" if ratio >= 2 else
            f"{abs(ratio - 1):.0%} {'slower' if ratio >= 1 else 'faster'} than predicted") in r["verdict"]
    assert not r["notes"]
    code, text, _ = run(["report", log, "--config", cfg, "--cluster", "perlmutter-a100"])
    assert "elapsed time per iteration (ms)" in text and "samples/sec" in text


def test_a_log_of_another_batch_is_noted(tmp_path, write_yaml):
    cfg = write_yaml("small.yml", SMALL)
    log = write_log(tmp_path, [3000.0, 1200.0, 1200.0], batch=128)
    code, out, _ = run(["report", log, "--config", cfg, "--cluster", "perlmutter-a100", "--json"])
    assert any("batch of 128" in n for n in json.loads(out)["notes"])


def test_a_log_needs_its_config_and_a_neox_log(tmp_path, write_yaml):
    log = write_log(tmp_path, [3000.0, 1200.0])
    code, _, err = run(["report", log, "--cluster", "perlmutter-a100"])
    assert code == exitcodes.USAGE and "--config" in err and len(err.splitlines()) == 1
    other = tmp_path / "other.log"
    other.write_text("hello\n")
    code, _, err = run(["report", str(other), "--config", write_yaml("s.yml", SMALL), "--cluster",
                        "perlmutter-a100"])
    assert code == exitcodes.USAGE and "elapsed time per iteration" in err
