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


def test_unknown_key_warns_with_suggestion(write_yaml):
    a = write_yaml("a.yml", BASE + "num_attention_head: 8\n")
    raw = load_files([a])
    assert any("did you mean 'num_attention_heads'" in w for w in raw.warnings)


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
    with pytest.raises(ConfigError, match="file not found"):
        load_files(["/nonexistent/x.yml"])
