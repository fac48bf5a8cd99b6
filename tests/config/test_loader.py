import pytest

from neox_perf.config import WorldRequest, build, load_files
from neox_perf.errors import ConfigError

BASE = """
num_layers: 4
hidden_size: 256
num_attention_heads: 8
seq_length: 128
max_position_embeddings: 128
train_micro_batch_size_per_gpu: 2
"""


def test_dash_and_underscore_keys_are_the_same_key(write_yaml):
    a = write_yaml("a.yml", BASE + "pipe-parallel-size: 2\n")
    raw = load_files([a])
    assert raw.values["pipe_parallel_size"] == 2


def test_same_key_in_two_files_is_refused_like_neox(write_yaml):
    a = write_yaml("a.yml", BASE + "train_iters: 10\n")
    b = write_yaml("b.yml", "train_iters: 20\n")
    with pytest.raises(ConfigError) as exc:
        load_files([a, b])
    line = exc.value.line()
    assert "b.yml" in line and "train_iters" in line and "a.yml" in line and "\n" not in line


def test_dashed_variant_in_later_file_overrides_with_warning(write_yaml):
    a = write_yaml("a.yml", BASE + "train_iters: 10\n")
    b = write_yaml("b.yml", "train-iters: 20\n")
    raw = load_files([a, b])
    assert raw.values["train_iters"] == 20
    assert any("overrides" in w for w in raw.warnings)


def test_same_base_name_refused(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    (tmp_path / "x" / "c.yml").write_text(BASE)
    (tmp_path / "y" / "c.yml").write_text("train_iters: 1\n")
    with pytest.raises(ConfigError, match="same file name"):
        load_files([str(tmp_path / "x" / "c.yml"), str(tmp_path / "y" / "c.yml")])


def test_yml_suffix_is_added_like_deepy(write_yaml, tmp_path):
    write_yaml("model.yml", BASE)
    raw = load_files(["model"], conf_dir=str(tmp_path))
    assert raw.files[0].endswith("model.yml")


def test_unknown_key_is_an_error_with_suggestion(write_yaml):
    """NeoXArgs(**config) raises on a key it does not declare: an error verdict, not a note."""
    a = write_yaml("a.yml", BASE + "checkpoint_activation: true\n")
    _, verdicts, warnings = build(load_files([a]), WorldRequest(gpus=1))
    bad = [v for v in verdicts if v.code == "unknown_key"]
    assert len(bad) == 1 and bad[0].level == "error" and bad[0].file == a
    assert "did you mean 'checkpoint_activations'" in bad[0].message
    assert not any("checkpoint_activation" in w for w in warnings)


def test_a_typo_of_a_required_key_names_the_typo(write_yaml):
    a = write_yaml("a.yml", BASE.replace("hidden_size", "hiden_size"))
    with pytest.raises(ConfigError) as exc:
        build(load_files([a]), WorldRequest(gpus=1))
    assert "'hiden_size'" in exc.value.line() and "did you mean 'hidden_size'" in exc.value.line()


def test_type_errors_name_file_key_and_fix(write_yaml):
    a = write_yaml("a.yml", BASE + "pipe_parallel_size: two\n")
    with pytest.raises(ConfigError) as exc:
        load_files([a])
    line = exc.value.line()
    assert "a.yml" in line and "pipe_parallel_size" in line and "fix:" in line


def test_literal_choices_are_case_insensitive_like_neox(write_yaml):
    a = write_yaml("a.yml", BASE + "norm: RMSNorm\n")
    cfg, _, _ = build(load_files([a]), WorldRequest(gpus=1))
    assert cfg.model.norm == "rmsnorm"


def test_int_accepted_for_float(write_yaml):
    a = write_yaml("a.yml", BASE + "rotary_pct: 1\n")
    load_files([a])


def test_bool_is_not_an_int(write_yaml):
    a = write_yaml("a.yml", BASE + "num_layers: true\n")
    with pytest.raises(ConfigError):
        load_files([a])


@pytest.mark.parametrize("text, needle", [
    ("", "empty"),
    ("- a\n- b\n", "not a mapping"),
    ("a: [1, 2\n", "not valid YAML"),
    ("!!python/object:os.system {}\n", "not valid YAML"),
])
def test_unreadable_files_give_one_line(write_yaml, text, needle):
    a = write_yaml("a.yml", text)
    with pytest.raises(ConfigError) as exc:
        load_files([a])
    assert needle in exc.value.line() and "\n" not in exc.value.line()


def test_missing_file():
    with pytest.raises(ConfigError, match="no such file"):
        load_files(["/nonexistent/x.yml"])


def test_missing_file_is_named_as_typed(tmp_path):
    """deepy.py appends .yml to a bare name; the error names what the user typed, and the
    path tried beside it."""
    with pytest.raises(ConfigError) as exc:
        load_files(["125M"], conf_dir=str(tmp_path))
    line = exc.value.line()
    assert line.startswith(f"{tmp_path / '125M'}: no such file")
    assert f"nor {tmp_path / '125M.yml'}" in line
