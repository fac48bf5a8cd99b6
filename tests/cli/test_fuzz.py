"""Mangled configs never produce a traceback: one line on stderr and a named exit code."""
import io
import contextlib
import string

import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from neox_perf import exitcodes
from neox_perf.cli import main

GOOD = {
    "pipe_parallel_size": 2, "model_parallel_size": 2, "num_layers": 4, "hidden_size": 64,
    "num_attention_heads": 4, "seq_length": 32, "max_position_embeddings": 32,
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "zero_optimization": {"stage": 1}, "fp16": {"enabled": True},
}
values = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**12), st.floats(allow_nan=True),
                   st.text(string.printable, max_size=12),
                   st.lists(st.integers(-3, 5), max_size=3),
                   st.dictionaries(st.sampled_from(["stage", "enabled", "type"]),
                                   st.one_of(st.integers(-2, 5), st.text(max_size=3)), max_size=2))
keys = st.one_of(st.sampled_from(sorted(GOOD)), st.sampled_from(["pos_emb", "norm", "num_kv_heads",
                 "attention_config", "train_batch_size", "rotary_pct", "vocab_file", "pipe-parallel-size",
                 "intermediate_size", "activation", "checkpoint_activations", "bf16", "seq-length"]),
                 st.text(string.ascii_letters + "-_", min_size=1, max_size=10))


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.dictionaries(keys, values, max_size=4), drop=st.sets(st.sampled_from(sorted(GOOD)), max_size=2),
       gpus=st.integers(1, 64))
def test_mangled_values(tmp_path, mutations, drop, gpus):
    cfg = {k: v for k, v in GOOD.items() if k not in drop}
    cfg.update(mutations)
    path = tmp_path / "m.yml"
    path.write_text(yaml.safe_dump(cfg))
    code, out, err = run(["check", str(path), "--gpus", str(gpus), "--json"])
    assert code in (exitcodes.OK, exitcodes.INVALID_CONFIG, exitcodes.VERDICT_FAILED), err
    assert "Traceback" not in err and "internal error" not in err
    if code == exitcodes.INVALID_CONFIG and err:
        assert len(err.strip().splitlines()) == 1


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(string.printable, max_size=200))
def test_mangled_text(tmp_path, text):
    path = tmp_path / "t.yml"
    path.write_text(text)
    code, out, err = run(["check", str(path), "--gpus", "4"])
    assert code in (exitcodes.OK, exitcodes.INVALID_CONFIG, exitcodes.VERDICT_FAILED)
    assert "Traceback" not in err and "internal error" not in err
