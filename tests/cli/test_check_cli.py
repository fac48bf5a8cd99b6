import contextlib
import io
import json
import subprocess
import sys

import pytest

from neox_perf import exitcodes
from neox_perf.cli import main

from conftest_paths import EXAMPLES, NEOX_CONFIGS  # noqa: F401  (helper module beside this file)


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


CONTRACT = {
    "top": {"schema", "neox_perf_version", "command", "exit_code", "files", "cluster", "config",
            "derived", "stages", "parameters", "flops", "tokens", "verdicts", "warnings",
            "profile_warnings", "prediction", "memory_fit"},
    "derived": {"raw_vocab_size", "raw_vocab_source", "padded_vocab_size", "world_size",
                "data_parallel_size", "model_parallel_size", "pipeline_stages",
                "micro_batches_per_iteration"},
    "stage": {"index", "layers", "layer_names", "transformer_layers", "parameters", "memory_bytes",
              "memory", "capacity_bytes", "device_memory_bytes", "device_memory_terms",
              "usable_capacity_bytes", "memory_columns", "device_memory_term_sources"},
    "parameters": {"total", "per_rank_max", "neox_logged"},
    "verdict": {"code", "level", "message", "key", "file", "fix"},
}


def test_json_contract_without_cluster():
    code, out, _ = run(["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "128", "--json"])
    assert code == exitcodes.OK
    data = json.loads(out)
    assert data["schema"] == "neox-perf/check/v1"
    assert CONTRACT["top"] <= set(data)
    assert CONTRACT["derived"] <= set(data["derived"])
    assert CONTRACT["parameters"] <= set(data["parameters"])
    assert all(CONTRACT["stage"] <= set(s) for s in data["stages"])
    assert data["prediction"] is None and data["cluster"] is None
    assert data["derived"]["data_parallel_size"] == 8
    assert sum(s["transformer_layers"] for s in data["stages"]) == 44


def test_json_stage_memory_adds_up():
    """Every byte of a stage's device total is in one column; the allocated peak is the sum of
    what is live at it; the device terms are named."""
    code, out, _ = run(["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "128", "--json",
                        "--cluster", "perlmutter-a100"])
    data = json.loads(out)
    for s in data["stages"]:
        assert sum(s["memory_columns"].values()) == s["device_memory_bytes"]
        assert sum(s["memory"]["peak"].values()) == s["memory_bytes"]
        assert s["device_memory_bytes"] == s["memory_bytes"] + sum(s["device_memory_terms"].values())
        assert {"allocator reserve", "CUDA context", "NCCL buffers"} <= set(s["device_memory_terms"])
        assert s["usable_capacity_bytes"] < s["capacity_bytes"]
        # each term says where its figure comes from
        assert set(s["device_memory_term_sources"]) == set(s["device_memory_terms"])
        assert all(src.strip() for src in s["device_memory_term_sources"].values())
    fit = data["memory_fit"]  # the one verdict, on the fullest stage, in bytes
    worst = max(data["stages"], key=lambda s: s["device_memory_bytes"])
    assert (fit["stage"], fit["device_memory_bytes"]) == (worst["index"], worst["device_memory_bytes"])
    assert fit["headroom_bytes"] == fit["usable_capacity_bytes"] - fit["device_memory_bytes"]
    assert fit["warning_from_bytes"] < fit["usable_capacity_bytes"] < fit["fail_above_bytes"]
    assert fit["level"] == "ok" and fit["device_memory_bytes"] <= fit["warning_from_bytes"]


def test_inside_the_band_is_a_warning_with_the_dominant_term(write_yaml):
    """A layout predicted a little under the usable capacity may still run out of memory
    (derive/fit.py's band): WARNING, exit 0, with the largest term and the fix."""
    from neox_perf.derive.fit import band
    code, out, _ = run(["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "128", "--json",
                        "--cluster", "perlmutter-a100"])
    data = json.loads(out)
    fit = data["memory_fit"]
    low, high = band(fit["usable_capacity_bytes"])
    assert (low, high) == (fit["warning_from_bytes"], fit["fail_above_bytes"])
    # micro-batches raise the fullest stage through the band: the first one inside it warns
    seen = set()
    for mb in range(2, 64):
        code, out, _ = run(["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "128", "--json",
                            "--cluster", "perlmutter-a100", "--set",
                            f"train_micro_batch_size_per_gpu={mb}"])
        data = json.loads(out)
        level = data["memory_fit"]["level"]
        seen.add(level)
        if level == "warning":
            v = [v for v in data["verdicts"] if v["code"] == "may_run_out_of_memory"][0]
            assert code == exitcodes.OK and v["level"] == "warning" and v["fix"]
            assert "may run out of memory" in v["message"] and data["memory_fit"]["dominant"] in v["message"]
            break
        if level == "fail":
            break
    assert "warning" in seen, seen


def test_verdict_keys_pinned(write_yaml):
    path = write_yaml("bad.yml", "num_layers: 4\nhidden_size: 100\nnum_attention_heads: 8\n"
                                 "seq_length: 64\nmax_position_embeddings: 32\n"
                                 "train_micro_batch_size_per_gpu: 1\n")
    code, out, _ = run(["check", path, "--gpus", "1", "--json"])
    data = json.loads(out)
    assert code == exitcodes.INVALID_CONFIG
    assert data["verdicts"] and all(CONTRACT["verdict"] == set(v) for v in data["verdicts"])
    codes = {v["code"] for v in data["verdicts"]}
    assert {"hidden_divisible_by_heads", "seq_within_positions"} <= codes


def test_neox_20b_exact(neox_configs):
    code, out, _ = run(["check", str(neox_configs / "20B.yml"), "--gpus", "96", "--json"])
    data = json.loads(out)
    assert code == exitcodes.OK
    assert data["parameters"]["total"] == 20_554_567_680
    assert data["derived"]["padded_vocab_size"] == 50432
    assert data["derived"]["raw_vocab_size"] == 50277
    assert [s["transformer_layers"] for s in data["stages"]] == [11, 12, 11, 10]


def _shared_configs():
    if not NEOX_CONFIGS.is_dir():
        return []
    return sorted(p for p in NEOX_CONFIGS.rglob("*.yml"))


@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("path", _shared_configs(), ids=lambda p: p.name)
def test_every_shipped_config_reports_or_fails_in_one_line(path, merged):
    argv = ["check", str(path)] + ([str(NEOX_CONFIGS / "local_setup.yml")] if merged else []) + ["--gpus", "8"]
    code, out, err = run(argv)
    assert code in (exitcodes.OK, exitcodes.INVALID_CONFIG, exitcodes.VERDICT_FAILED), err
    assert "Traceback" not in err and "internal error" not in err
    if code == exitcodes.INVALID_CONFIG and not out:
        line = err.strip()
        assert len(line.splitlines()) == 1 and line.startswith("neox-perf: ")
    else:
        assert "neox-perf check" in out


def test_usage_errors_exit_2(capsys):
    assert run(["check"])[0] == exitcodes.USAGE
    assert run(["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "zero"])[0] == exitcodes.USAGE
    code, _, err = run(["check", str(EXAMPLES / "gpt-20b.yml"), "--cluster", "no-such-cluster"])
    assert code == exitcodes.USAGE and len(err.strip().splitlines()) == 1


def test_missing_file_exit_1_one_line():
    code, out, err = run(["check", "/nonexistent.yml", "--json"])
    assert code == exitcodes.INVALID_CONFIG
    assert json.loads(out)["error"]["message"].startswith("/nonexistent.yml")
    assert len(err.strip().splitlines()) == 1


def test_out_of_memory_is_a_failed_verdict(write_yaml):
    path = write_yaml("big.yml", "num_layers: 80\nhidden_size: 8192\nnum_attention_heads: 64\n"
                                 "seq_length: 4096\nmax_position_embeddings: 4096\n"
                                 "train_micro_batch_size_per_gpu: 8\nfp16: {enabled: true}\n")
    code, out, _ = run(["check", path, "--gpus", "1", "--cluster", "perlmutter-a100", "--json"])
    data = json.loads(out)
    assert code == exitcodes.VERDICT_FAILED
    assert any(v["code"] == "out_of_memory" and v["level"] == "fail" for v in data["verdicts"])


def test_check_as_a_process_leaves_its_objects_to_the_exit():
    """main() without arguments (the console script, python -m neox_perf) freezes what a check
    leaves, so CPython's shutdown does not collect it; called with arguments (a test, a caller
    that goes on), it does not, and its objects stay collectable."""
    probe = ("import gc, sys, contextlib, io; from neox_perf.cli import main\n"
             f"argv = ['check', r'{EXAMPLES / 'gpt-20b.yml'}', '--gpus', '128', '--cluster', "
             "'perlmutter-a100', '--json']\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             "    main(argv)\n"
             "    inside = gc.get_freeze_count()\n"
             "    sys.argv = ['neox-perf'] + argv\n"
             "    main()\n"
             "print(inside, gc.get_freeze_count())")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    inside, ending = map(int, proc.stdout.split())
    assert inside == 0 and ending > 10_000


def test_check_imports_no_heavy_modules():
    probe = ("import sys; from neox_perf.cli import main; import contextlib, io\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             f"    main(['check', r'{EXAMPLES / 'gpt-20b.yml'}', '--gpus', '128', '--cluster', 'perlmutter-a100'])\n"
             "heavy = [m for m in ('torch', 'deepspeed', 'sklearn', 'xgboost', 'pandas', 'scipy') if m in sys.modules]\n"
             "print(','.join(heavy))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
