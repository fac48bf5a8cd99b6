"""What a first-time user meets (issue 32, section 4): help with examples, the one-line
verdict's fix beside its own warning, plural and node counts, a long fix as `plan --write`,
`report` on a missing run dir as a data error."""
from types import SimpleNamespace

import pytest

from neox_perf import exitcodes
from neox_perf.advice import MAX_SET_FLAGS, Suggestion, faster_verdicts
from neox_perf.cli import _COMMANDS

from cli_run import run  # helper modules beside this file
from conftest_paths import EXAMPLES, NEOX_CONFIGS


def _help(argv):
    code, out, err = run(argv)
    assert code == 0, err
    return out


def test_the_top_level_help_speaks_to_a_user_with_examples():
    text = _help(["--help"])
    assert "parse, run a command" not in text  # developer prose
    assert "GPU memory" in text and "examples:" in text and "neox-perf check " in text


@pytest.mark.parametrize("command", _COMMANDS)
def test_every_command_help_has_an_example(command):
    text = _help([command, "--help"])
    assert "example:" in text and f"neox-perf {command} " in text.split("example:")[1]


def test_check_help_names_the_cluster_description_yaml():
    text = " ".join(_help(["check", "--help"]).split())
    assert "description YAML" in text and "dgx-a100" in text


def test_the_line_puts_the_layout_fix_beside_its_own_label():
    # 64 single-GPU nodes, tensor parallel 4: two warnings (tensor parallelism across nodes, a
    # faster layout); the flags fix the second, so they must not sit bare after the first's text
    code, out, err = run(["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "64", "--cluster", "gh200-ndr",
                          "--format", "line"])
    assert code == exitcodes.OK, err
    fields = out.strip().split(" | ")
    verdict = next(f for f in fields if f.startswith("WARNING: "))
    assert "2 warnings: tensor parallelism" in verdict
    fix = next(f for f in fields if "--set " in f)
    assert fix.split(": ", 1)[0].endswith("faster layout") and fix.split(": ", 1)[1].startswith("--set ")


def test_one_gpu_is_singular_and_a_job_inside_a_node_says_so():
    code, out, _ = run(["check", str(EXAMPLES / "llemma-7b.yml"), "--gpus", "1", "--cluster", "perlmutter-a100",
                        "--set", "pipe_parallel_size=1", "--set", "model_parallel_size=1", "--format", "line"])
    assert out.startswith("neox-perf check: 1 GPU (part of a node of 4) "), out
    assert "1 GPUs" not in out and "1 nodes" not in out
    code, out, _ = run(["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "8", "--cluster", "dgx-a100",
                        "--set", "pipe_parallel_size=2", "--format", "line"])
    assert out.startswith("neox-perf check: 8 GPUs (1 node x 8) "), out


def _suggestion(n_keys):
    layout = SimpleNamespace(gpus=64)
    overrides = {f"key_{i}": i for i in range(n_keys)}
    candidate = SimpleNamespace(layout=layout, seconds_per_batch=1.0)
    return Suggestion("faster", candidate, overrides, {}, 10, 0.1, 64, user_seconds_per_batch=3.0)


def test_a_fix_of_many_flags_names_plan_write():
    few, many = _suggestion(MAX_SET_FLAGS), _suggestion(10)
    assert few.fix(["a.yml"], "dgx-a100") == few.set_flags()
    text = many.fix(["a.yml", "b.yml"], "dgx-a100")
    assert "--set" not in text and text.startswith("neox-perf plan a.yml b.yml --gpus 64 --cluster dgx-a100 --write")
    many.describe = lambda: "layout"  # the verdict's prose is not under test
    (verdict,) = faster_verdicts(many, ["a.yml"], "dgx-a100")
    assert "--write" in verdict.fix and verdict.fix.count("--set") == 0
    # the user's own flags (check's request_flags) reach the plan command, in both forms
    mine = "--set hidden_size=4096 --vocab-size 50000"
    (verdict,) = faster_verdicts(many, ["a.yml"], "dgx-a100", mine)
    assert verdict.fix.startswith(f"neox-perf plan a.yml {mine} --gpus 64 --cluster dgx-a100 --write")
    few.describe = lambda: "layout"
    (verdict,) = faster_verdicts(few, ["a.yml"], "dgx-a100", mine)
    assert verdict.fix.startswith(few.set_flags() + "; ")
    assert f"`neox-perf plan a.yml {mine} --gpus 64 --cluster dgx-a100` ranks every layout" in verdict.fix


def test_check_hands_its_own_model_flags_to_the_commands_it_suggests():
    """check's request_flags: -d, every --set (quoted for a shell), --vocab-size, --gpus-per-node;
    never the files, the GPUs or the cluster, which the suggestion sets itself."""
    from types import SimpleNamespace
    from neox_perf.commands.check import request_flags
    args = SimpleNamespace(conf_dir="my configs", sets=["hidden_size=4096", "train_data_paths=[a, b]"],
                           vocab_size=50000, gpus_per_node=4, gpus=64, cluster="dgx-a100")
    assert request_flags(args) == ("-d 'my configs' --set hidden_size=4096 --set 'train_data_paths=[a, b]' "
                                   "--vocab-size 50000 --gpus-per-node 4")
    assert request_flags(SimpleNamespace(conf_dir=None, sets=[], vocab_size=None, gpus_per_node=None)) == ""


def test_report_on_a_missing_run_dir_is_a_data_error_naming_no_absent_file(tmp_path):
    code, _, err = run(["report", str(tmp_path / "nope")])
    assert code == exitcodes.INVALID_CONFIG and "no such run dir" in err and "fix:" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run(["report", str(empty)])
    assert code == exitcodes.INVALID_CONFIG and "errors.log" not in err and len(err.strip().splitlines()) == 1
    (empty / "errors.log").write_text("{}\n")
    code, _, err = run(["report", str(empty)])
    assert "errors.log" in err


@pytest.mark.skipif(not (NEOX_CONFIGS / "20B.yml").is_file(), reason="GPT-NeoX configs not beside the repo")
def test_the_issue_command_works_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(["check", str(NEOX_CONFIGS / "20B.yml"), "--gpus", "96", "--cluster", "dgx-a100",
                          "--format", "line"])
    assert code == exitcodes.OK, err
    assert out.startswith("neox-perf check: 96 GPUs (12 nodes x 8)")


def test_a_long_fix_on_the_command_line_is_plan_write():
    # 13B on 2 GPUs of 40 GB, no checkpointing, micro-batch 16: six keys change to fit on 16
    argv = ["check", str(EXAMPLES / "llama-13b.yml"), "--gpus", "2", "--cluster", "perlmutter-a100",
            "--set", "pipe_parallel_size=1", "--set", "model_parallel_size=2", "--set",
            "checkpoint_activations=false", "--set", "zero_optimization.stage=0", "--set",
            "train_micro_batch_size_per_gpu=16"]
    code, out, _ = run(argv + ["--format", "line"])
    assert code == exitcodes.VERDICT_FAILED
    fix = next(f for f in out.strip().split(" | ") if f.startswith("fits as: "))
    # the plan searches the user's model: their own --set flags come along, in their order
    assert fix.split(": ", 1)[1].startswith(f"neox-perf plan {EXAMPLES / 'llama-13b.yml'} --set pipe_parallel_size=1 "
                          f"--set model_parallel_size=2 --set checkpoint_activations=false "
                          f"--set zero_optimization.stage=0 --set train_micro_batch_size_per_gpu=16 "
                          f"--gpus 16 --cluster perlmutter-a100 --write best.yml"), fix
    code, out, _ = run(argv)
    assert "paste after your config files" not in out and "--write best.yml" in out
    assert "--set train_micro_batch_size_per_gpu=16" in out  # one line: a --set with its value


def test_a_suggested_command_repeats_the_cluster_as_the_user_gave_it(tmp_path, monkeypatch):
    """--cluster NAME of the user's own profile (under $NEOX_PERF_HOME) comes back as that name,
    a --cluster PATH as the same path made absolute (the command works from any directory):
    what the check command was given, not a path the renderer guesses from the loaded profile."""
    import shutil

    from neox_perf.profile.directory import bundled_dir
    home = tmp_path / "home"
    shutil.copytree(bundled_dir() / "perlmutter-a100", home / "profiles" / "mine")
    monkeypatch.setenv("NEOX_PERF_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    argv = ["check", str(EXAMPLES / "llama-13b.yml"), "--gpus", "2", "--set", "pipe_parallel_size=1",
            "--set", "model_parallel_size=2", "--set", "checkpoint_activations=false", "--set",
            "zero_optimization.stage=0", "--set", "train_micro_batch_size_per_gpu=16", "--format", "line"]
    for given, repeated in (("mine", "mine"), ("home/profiles/mine", str(home / "profiles" / "mine"))):
        code, out, _ = run(argv + ["--cluster", given])
        assert code == exitcodes.VERDICT_FAILED
        fix = next(f for f in out.strip().split(" | ") if f.startswith("fits as: "))
        assert f"--gpus 16 --cluster {repeated} --write best.yml" in fix, fix
