"""`check` says how it priced an fp32 run's matmuls, on the verdict line and in --json, with the
source (issue #30, section 3); a 16-bit run's output carries nothing of it."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cli_run import check_json, run  # noqa: E402  (helper modules beside this file)
from conftest_paths import EXAMPLES  # noqa: E402

DGX = EXAMPLES / "clusters" / "dgx-a100.yml"
FP32 = ["--set", "fp16.enabled=false"]


def _described(tmp_path, line: str) -> str:
    path = tmp_path / "dgx.yml"
    path.write_text(DGX.read_text() + line + "\n")
    return str(path)


def test_the_verdict_line_names_the_pricing_and_its_source(tmp_path):
    config = str(EXAMPLES / "llemma-7b.yml")
    code, out, _ = run(["check", config, "--gpus", "16", "--cluster", _described(tmp_path, "tf32: true"),
                        *FP32, "--format", "line"])
    assert code == 0 and "fp32 matmuls as TF32 (cluster description dgx.yml tf32: true)" in out
    _, said = check_json(config, "--gpus", "16", "--cluster", _described(tmp_path, "tf32: false"), *FP32)
    mm = said["prediction"]["fp32_matmuls"]
    assert mm["matmuls"] == "ieee_fp32" and mm["known"] and mm["other_seconds"] is None
    assert "fp32 matmuls as IEEE fp32 (cluster description dgx.yml tf32: false)" in said["verdict"]["text"]
    _, unsaid = check_json(config, "--gpus", "16", "--cluster", str(DGX), *FP32)
    mm = unsaid["prediction"]["fp32_matmuls"]
    assert not mm["known"] and mm["source"].startswith("default:") and mm["other_seconds"] > 0
    lo, hi = unsaid["prediction"]["interval_seconds"]
    assert lo <= min(mm["other_seconds"], unsaid["prediction"]["iteration_seconds"])
    assert hi >= max(mm["other_seconds"], unsaid["prediction"]["iteration_seconds"])
    assert "the 80% interval reaches" in unsaid["verdict"]["text"]


def test_a_16_bit_run_says_nothing_of_tf32(tmp_path):
    _, plain = check_json(str(EXAMPLES / "llemma-7b.yml"), "--gpus", "16", "--cluster", _described(tmp_path, "tf32: true"))
    assert "fp32_matmuls" not in plain["prediction"] and "TF32" not in plain["verdict"]["text"]
    assert "tf32" not in plain["cluster"]


def test_a_bad_tf32_value_is_one_line(tmp_path):
    code, out, err = run(["check", str(EXAMPLES / "llemma-7b.yml"), "--gpus", "16",
                          "--cluster", _described(tmp_path, "tf32: maybe")])
    assert code != 0 and len(err.strip().splitlines()) == 1 and "tf32: must be true or false" in err
