"""`neox-perf validate --neox`: GPT-NeoX's own run under the hook as the measured side."""
import argparse
import os

import pytest

from neox_perf.commands import validate_neox
from neox_perf.errors import UsageError
from neox_perf.testing import neox_cpu


def test_cpu_keys_override_what_the_user_wrote():
    values = {"train_iters": 320000, "save": "/ckpt", "distributed_backend": "nccl",
              "data_path": "/nowhere/data_text_document", "vocab_file": "/x/vocab.json",
              "eval_iters": 10}
    out = validate_neox._cpu_values(values, gpus=2, iters=5, data_prefix="/d/enwik8_text_document",
                                    on_cpu=True)
    assert out["train_iters"] == validate_neox.WARMUP + validate_neox.WINDOW_ITERATIONS + 5
    assert out["lr_decay_iters"] == out["train_iters"]
    assert "save" not in out and "vocab_file" not in out and out["eval_iters"] == 0
    assert out["distributed_backend"] == "gloo" and out["global_num_gpus"] == 2
    assert out["tokenizer_type"] == "CharLevelTokenizer"
    assert validate_neox._data_readable(values) is False


def test_without_a_checkout_it_is_a_usage_error(tmp_path):
    args = argparse.Namespace(neox=str(tmp_path), configs=["x.yml"], gpus=2, cluster="c",
                              iters=2, workdir=None)
    with pytest.raises(UsageError, match="not a GPT-NeoX checkout"):
        validate_neox.run_validate_neox(args)


def test_validate_neox_live(neox, neox_work, tmp_path):
    cluster = os.environ.get("NEOX_PERF_NEOX_CLUSTER")
    if not cluster:
        pytest.skip("set NEOX_PERF_NEOX_CLUSTER to a profile (neox-perf calibrate --quick)")
    cfg = neox_cpu.write_config(neox_cpu.LAYOUTS["pp1"], str(tmp_path), "/nowhere")
    args = argparse.Namespace(neox=neox, configs=[cfg], gpus=2, cluster=cluster, iters=3,
                              workdir=str(tmp_path / "work"))
    result = validate_neox.run_validate_neox(args)
    (r,) = result.results
    assert r.predicted_seconds > 0 and r.measured_seconds > 0
    assert r.layout["logged_params"] and r.layout["source"].startswith("GPT-NeoX")
    assert any("mapped to the decomposition" in n for n in r.notes)
    assert any(n.startswith("memory stage 0") for n in r.notes)
    assert {c["component"] for c in r.components} == set(validate_neox.COMPONENTS)
