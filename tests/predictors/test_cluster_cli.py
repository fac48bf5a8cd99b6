"""Cluster descriptions and the GPU table through the real CLI."""
import contextlib
import io
import json
from pathlib import Path

import pytest

from neox_perf import exitcodes
from neox_perf.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "neox_perf" / "examples"

# 24 layers x 2560 on one GPU with plain fp16 Adam: about 49 GiB allocated, 52.5 GiB on the
# device -- below an 80 GB A100's WARNING band (from 65.3 GiB: derive/fit.py), far above 40 GB.
FITS_80_NOT_40 = """\
num_layers: 24
hidden_size: 2560
num_attention_heads: 32
seq_length: 2048
max_position_embeddings: 2048
train_micro_batch_size_per_gpu: 4
checkpoint_activations: true
fp16: {enabled: true}
"""


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _memory_verdict(data):
    return [(v["code"], v["level"]) for v in data["verdicts"] if "memory" in v["code"]]


def test_perlmutter_a100_is_the_40gb_node_and_the_80gb_profile_is_sampled(tmp_path):
    cfg = tmp_path / "m.yml"
    cfg.write_text(FITS_80_NOT_40)
    code80, out80, _ = _run(["check", str(cfg), "--gpus", "1", "--cluster", "perlmutter-a100-80gb", "--json"])
    code40, out40, _ = _run(["check", str(cfg), "--gpus", "1", "--cluster", "perlmutter-a100", "--json"])
    d80, d40 = json.loads(out80), json.loads(out40)
    total = d80["stages"][0]["memory_bytes"]
    assert 40 * 2**30 < total < 80 * 2**30 and d40["stages"][0]["memory_bytes"] == total
    assert code80 == exitcodes.OK and _memory_verdict(d80) == [("fits_in_memory", "ok")]
    assert code40 == exitcodes.VERDICT_FAILED and ("out_of_memory", "fail") in _memory_verdict(d40)
    assert d40["cluster"]["gpu_memory_bytes"] == 40 * 2**30
    # the report says where the samples came from and what was transferred
    assert "A100-SXM4-80GB" in d40["cluster"]["samples_from"] and "transferred" in d40["cluster"]["samples_from"]
    assert d80["cluster"]["samples_from"] == ""


def test_a_description_file_predicts_through_check(tmp_path):
    dgx = EXAMPLES / "clusters" / "dgx-a100.yml"
    code, out, err = _run(["check", str(EXAMPLES / "gpt-20b.yml"), "--nodes", "16", "--cluster", str(dgx), "--json"])
    assert code == exitcodes.OK, err
    data = json.loads(out)
    assert data["cluster"]["gpus_per_node"] == 8 and data["derived"]["world_size"] == 128
    assert data["cluster"]["profile"] == "dgx-a100"
    text_code, text, _ = _run(["check", str(EXAMPLES / "gpt-20b.yml"), "--nodes", "16", "--cluster", str(dgx)])
    assert text_code == exitcodes.OK and "dgx-a100" in text


def test_a_bad_description_is_one_line_on_the_command_line(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("name: x\nbase: perlmutter-a100-80gb\ngpu: A100-SXM4-80GB\ngpus_per_nod: 8\n"
                   "inter_node_Gbps: 800\n")
    code, out, err = _run(["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "8", "--cluster", str(bad)])
    lines = err.strip().splitlines()
    assert code == exitcodes.USAGE and len(lines) == 1 and "Traceback" not in err
    assert str(bad) in lines[0] and "gpus_per_nod" in lines[0] and "did you mean gpus_per_node" in lines[0]


def test_clusters_gpus_json_keys():
    code, out, _ = _run(["clusters", "--gpus", "--json"])
    data = json.loads(out)
    assert code == exitcodes.OK and data["schema"] == "neox-perf/clusters/v1" and "profiles" not in data
    names = [g["name"] for g in data["gpus"]]
    assert {"A100-SXM4-40GB", "GH200-96GB", "MI300X", "B200"} <= set(names)
    keys = {"name", "vendor", "memory_gib", "memory_bytes", "memory_type", "hbm_gbps", "fp16_tflops", "tf32_tflops",
            "fp32_tflops", "sms", "boost_mhz", "source", "note", "bf16", "ridge_flops_per_byte",
            "achievable_tflops"}
    for g in data["gpus"]:
        assert set(g) == keys and g["source"]
    code, text, _ = _run(["clusters", "--gpus"])
    assert code == exitcodes.OK and "MI250X" in text and "Datasheet" in text


def test_clusters_lists_the_description_beside_the_sampled_profiles():
    code, out, _ = _run(["clusters", "--json"])
    rows = {p["name"]: p for p in json.loads(out)["profiles"]}
    assert code == exitcodes.OK and {"perlmutter-a100", "perlmutter-a100-80gb", "vista-gh200"} <= set(rows)
    p = rows["perlmutter-a100"]
    assert p["kind"] == "description" and p["base"] == "perlmutter-a100-80gb"
    assert p["samples_gpu"] == "A100-SXM4-80GB" and p["gpu_memory_bytes"] == 40 * 2**30
    assert rows["perlmutter-a100-80gb"]["kind"] == "sampled"


@pytest.mark.parametrize("cluster", ["perlmutter-a100", str(EXAMPLES / "clusters" / "dgx-a100.yml")])
def test_check_with_a_description_imports_no_heavy_modules(cluster):
    import subprocess
    import sys
    probe = ("import sys, contextlib, io\nfrom neox_perf.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             f"    main(['check', r'{EXAMPLES / 'gpt-20b.yml'}', '--gpus', '128', '--cluster', r'{cluster}'])\n"
             "print(','.join(m for m in ('torch', 'deepspeed', 'sklearn', 'xgboost', 'scipy', 'pandas')"
             " if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
